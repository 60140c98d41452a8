"""Render ``results.json`` as docs/benchmarks.md (and the sweep plot as a PNG).

Pure formatting: every figure comes from the results dict that run.py wrote, so the doc
can be regenerated with ``python -m benchmarks.report benchmarks/results.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

SINK_NAMES = {
    "noop": "(a) no-op Arrow writer",
    "baseline": "(b) baseline insert_arrow (at-least-once)",
    "attach": "(c) clickhouse_tx mode=attach",
    "dedup": "(d) clickhouse_tx mode=dedup",
}


def ms(d: dict[str, Any], key: str) -> str:
    return f"{d[key]:.1f}"


def rng(s: dict[str, Any], fmt: str = ",.0f") -> str:
    return f"{s['median']:{fmt}} ({s['min']:{fmt}} - {s['max']:{fmt}})"


Target = tuple[str, str, bool | None]


def target_rows(r: dict[str, Any]) -> list[Target]:
    """Every target of the benchmarks (issue 29's and the earlier ones still held), what
    this run measured and whether it is met."""
    rows: list[Target] = []
    rows += _throughput_targets(r.get("throughput") or {})
    rows += _latency_targets(r.get("latency") or {})
    rows += _commit_targets(r.get("commit") or {})
    values = r.get("values")
    if values:
        share = max(x["share_pct"] for x in values.values())
        rows.append(
            ("per-value checks <= 3% of the insert (largest share)", f"{share:.2f}%", share <= 3)
        )
    st = r.get("state")
    if st:
        for key, label in (("commit", "driver commit"), ("save", "dedup save")):
            d = st["paired_ms"][key]["median"]
            rows.append(
                (f"state=clickhouse adds <= 15 ms per batch ({label})", f"{d:+.1f} ms", d <= 15)
            )
    rows += _count_targets(r.get("counts") or {})
    rows += _shape_targets(r.get("shapes") or {})
    mem = r.get("memory")
    if mem and mem.get("growth"):
        g = mem["growth"]
        rows.append(("worker memory independent of partition size", f"{g:.2f}x", g <= 1.25))
    return rows


def _throughput_targets(tp: dict[str, Any]) -> list[Target]:
    rows: list[Target] = []
    for schema in ("narrow", "wide"):
        ratios = (tp.get(schema) or {}).get("ratios")
        if not ratios:
            continue
        for sink, limit in (("attach", 0.98), ("dedup", 0.95)):
            x = ratios[f"{sink}/baseline"]["median"]
            rows.append((f"{sink}/baseline {schema} >= {limit:.2f}", f"{x:.3f}", x >= limit))
    if tp.get("narrow"):
        attach = tp["narrow"]["sinks"]["attach"]["rows_per_s"]["median"]
        rows.append(("attach narrow >= 1,000,000 rows/s", f"{attach:,.0f}", attach >= 1_000_000))
    return rows


def _latency_targets(lat: dict[str, Any]) -> list[Target]:
    rows: list[Target] = []
    for c in lat.get("cases", []):
        spread = bool(c.get("spread"))
        limit = 40 if spread else 25
        size = f"{c['rows'] // 1000}k rows{', 4 partitions' if spread else ''}"
        for sink in ("clickhouse_tx", "foreach_batch"):
            o = c[f"{sink}_overhead"]
            p50, p99 = o["p50_ms"], o["p99_ms"]
            rows.append(
                (
                    f"{sink} addBatch overhead p50 <= {limit} ms ({size})",
                    f"{p50:+.0f} ms",
                    p50 <= limit,
                )
            )
            rows.append(
                (
                    f"{sink} overhead p99 <= 2x p50 ({size})",
                    f"{p99:+.0f} ms",
                    p99 <= 2 * max(p50, 0),
                )
            )
    return rows


def _commit_targets(co: dict[str, Any]) -> list[Target]:
    rows: list[Target] = []
    for k in (16, 64):
        d = co.get(f"driver_{k}")
        if d:
            ratio = d["p99_ms"] / d["p50_ms"]
            rows.append(
                (
                    f"commit p99 <= 2x p50 ({k} partitions)",
                    f"{d['p99_ms']:.1f} / {d['p50_ms']:.1f} ms = {ratio:.2f}x",
                    ratio <= 2,
                )
            )
    return rows


# issue 39's per-batch counts: (target, the count, its limit at a shape, what it counts)
COUNT_TARGETS = (
    (
        "task statements besides inserts on its critical path <= 1 per task",
        "task_statements",
        lambda s: s["tasks"],
        "tasks/ClickHouse/",
    ),
    ("commit statements <= 4", "commit_statements", lambda s: 4, "commit/ClickHouse/"),
    ("Keeper requests per batch <= 8", "keeper_requests", lambda s: 8, "/Keeper sent/"),
    ("state statements per batch <= 8", "state_statements", lambda s: 8, "/state/"),
    ("parts added per batch <= partition values", "parts_added", lambda s: s["values"], ""),
)


def _count_label(s: dict[str, Any]) -> str:
    return f"({s['tasks']} tasks x {s['values']} partition values, state={s['state']})"


def _count_targets(counts: dict[str, Any]) -> list[Target]:
    rows: list[Target] = []
    for s in counts.get("shapes", []):
        for name, key, limit, _ in COUNT_TARGETS:
            if key == "keeper_requests" and s["state"] != "keeper":
                continue
            if key == "state_statements" and s["state"] != "clickhouse":
                continue
            if key == "parts_added" and (s["state"] != "keeper" or s.get("merged_parts")):
                continue  # a net figure once the target merged (seen at state=clickhouse)
            rows.append((f"{name} {_count_label(s)}", f"{s[key]:g}", s[key] <= limit(s)))
    return rows


SHAPE_RATIO = 0.8  # issue 39: attach at least 80% of the baseline's speed at every shape


def _shape_label(s: dict[str, Any]) -> str:
    return f"({s['tasks']} tasks x {s['values']} partition values, batch save)"


def _shape_targets(shapes: dict[str, Any]) -> list[Target]:
    """Issue 39's shapes: attach/baseline speed (paired: baseline s / attach s) and the
    parts attach mode adds per save."""
    rows: list[Target] = []
    for s in shapes.get("shapes", []):
        x = s["ratio"]["median"]
        rows.append(
            (
                f"attach/baseline >= {SHAPE_RATIO:.2f} {_shape_label(s)}",
                f"{x:.3f}",
                x >= SHAPE_RATIO,
            )
        )
        parts = s["sinks"]["attach"]["parts_added"]
        rows.append(
            (
                f"parts added per batch <= partition values {_shape_label(s)}",
                f"{parts:g}",
                parts <= s["values"],
            )
        )
    return rows


def _shape_floor(r: dict[str, Any], target: str) -> str:
    """A shape target not met: the run's own figures for it."""
    for s in (r.get("shapes") or {}).get("shapes", []):
        if not target.endswith(_shape_label(s)):
            continue
        if target.startswith("parts added"):
            return f"published with visibility={s['visibility']}: " + (
                "each task's staging is published as it is, one part per task and partition value"
                if s["visibility"] == "partition"
                else "the batch staging was not merged to one part per partition value "
                "before the ATTACH (compact_bytes, the target's engine)"
            )
        x, b, a = s["ratio"], s["sinks"]["baseline"], s["sinks"]["attach"]
        extra = a["seconds"]["median"] - b["seconds"]["median"]
        where = (
            "the target lies inside the noise of the repetitions"
            if x["min"] <= SHAPE_RATIO <= x["max"]
            else "below the target in every repetition"
        )
        return (
            f"paired ratios of this run {x['min']:.3f} - {x['max']:.3f}: {where}; attach adds "
            f"{extra:+.2f} s a save to the baseline's {b['seconds']['median']:.2f} s "
            f"(validation, the staging CREATE and its check in each of {s['tasks']} tasks, "
            + (
                "the commit: one MOVE per task's staging)"
                if s["visibility"] == "partition"
                else "the commit: the batch gathered or copied, one ATTACH)"
            )
        )
    return ""


def _count_floor(r: dict[str, Any], target: str) -> str:
    """The statements or requests a count target still counts, by kind (one batch)."""
    for s in (r.get("counts") or {}).get("shapes", []):
        if not target.endswith(_count_label(s)):
            continue
        prefix = next(p for name, _, _, p in COUNT_TARGETS if target.startswith(name))
        if not prefix or not s["per_batch"]:
            return "one part per task and partition value: each staging table is published as it is"
        kinds = s["per_batch"][0]["kinds"]
        seen = sorted(
            ((n, k) for k, n in kinds.items() if prefix in k and "/INSERT" not in k),
            key=lambda x: (-x[0], x[1]),
        )
        return "; ".join(_counted(n, k) for n, k in seen)
    return ""


# Why each kind of commit statement is sent (kinds as benchmarks.hotpath._kind names them)
COMMIT_WHY = {
    "read staged parts of": "the one read before the prepare: each task's rows against what it "
    "sent, the manifest's part ids, the bytes that decide compaction, the target's views (one "
    "made since validation refuses attach) and losing attempts' staging",
    "create batch staging": "the table the batch is gathered in, under this finisher's own "
    "name, so that one ATTACH publishes all of it",
    "copy": "hard links of every task's staging into the batch staging, one ALTER for any "
    "number of tasks (where the batch is not gathered)",
    "gather task staging into": "every task's rows inserted into the batch staging, one "
    "part per partition value (a plain MergeTree target below compact_bytes; else the copy)",
    "create gathered batch staging": "the batch staging made from the target's CREATE (read "
    "in the one read) and filled with every task's rows in the same statement, one part per "
    "partition value, under this finisher's own name (a plain MergeTree target below "
    "compact_bytes without MATERIALIZED columns, TTL or comment)",
    "ATTACH PARTITION ALL FROM": "the publish: the whole batch visible at once",
    "DROP TABLE IF EXISTS": "the batch's staging, every table in one statement",
    "MOVE PARTITION ID": "visibility=partition: one per staging table",
}


def _counted(n: float, key: str) -> str:
    """``phase: n x kind`` of one counted kind, with why a commit statement is needed."""
    phase, kind = key.split("/", 1)[0], key.rsplit("/", maxsplit=1)[-1]
    why = COMMIT_WHY.get(kind) if phase == "commit" else None
    return f"{phase}: {n:g} x {kind}" + (f" ({why})" if why else "")


def section_targets(r: dict[str, Any]) -> list[str]:
    out = [
        "## Targets",
        "",
        "A target not met names what stands in its way, measured in this run.",
        "",
        "| target | measured | met | when not met: the floor |",
        "|---|---|---|---|",
    ]
    for name, value, ok in target_rows(r):
        why = "" if ok else floor_of(r, name)
        out.append(f"| {name} | {value} | {'yes' if ok else '**no**'} | {why} |")
    return [*out, ""]


def floor_of(r: dict[str, Any], target: str) -> str:
    """What keeps a target out of reach, from this run's own figures."""
    if target.endswith(", batch save)"):
        return _shape_floor(r, target)
    trips = (r.get("profile") or {}).get("trips")
    if "addBatch overhead" in target and trips:
        count: dict[tuple[str, str], float] = {}
        for row in trips["rows"]:
            if not row["kind"].startswith("INSERT"):  # the baseline inserts the same
                key = (row["phase"], row["store"])
                count[key] = count.get(key, 0.0) + row["count"]
        floor = trips["floor_ms"]["ClickHouse"]
        commit = ", ".join(
            f"{row['count']:g} x {row['kind']}"
            for row in trips["rows"]
            if row["phase"] == "commit" and row["store"] == "ClickHouse"
        )
        return (
            f"round trips the protocol makes per micro-batch of {trips['tasks']} tasks: "
            f"{count.get(('tasks', 'ClickHouse'), 0):g} ClickHouse statements besides the "
            f"inserts in the tasks, {count.get(('commit', 'ClickHouse'), 0):g} in the commit "
            f"({commit}) and {count.get(('commit', 'Keeper'), 0):g} Keeper requests; one "
            f"statement costs at least {floor:.1f} ms here (`SELECT 1`); the round trips "
            f"and what each is for: below"
        )
    if "overhead p99" in target:
        return "the p50 is above its target; the p99 follows the commit's p99 (2.)"
    if target.startswith("commit p99"):
        return (
            "this run's slowest commits (2.); where they spent their time was not traced in "
            "this run (`benchmarks/hotpath.py` times every request of a batch)"
        )
    if target.startswith("state=clickhouse"):
        return _state_floor(r)
    if target.endswith("state=keeper)") or target.endswith("state=clickhouse)"):
        return _count_floor(r, target)
    if target.startswith("per-value"):
        return "one Arrow compute pass per rule over every value of its column (5.)"
    if "/baseline" in target:
        return _ratio_floor(r, target)
    return ""


def _state_floor(r: dict[str, Any]) -> str:
    """state=clickhouse over state=keeper: its statements per batch, from the counts."""
    for s in (r.get("counts") or {}).get("shapes", []):
        if s["state"] == "clickhouse" and (s["tasks"], s["values"]) == (4, 1):
            return (
                f"a batch sends {s['state_statements']:g} state statements at 4 tasks x 1 "
                "value (counts), each a round trip to ClickHouse, which writes KeeperMap "
                "through its own Keeper session, where state=keeper sends one Keeper request"
            )
    return "a batch's state statements are counted by `make bench-counts --state clickhouse`"


def _ratio_floor(r: dict[str, Any], target: str) -> str:
    """A throughput ratio not met: where it sits in this run's spread of paired ratios,
    and what txsink adds per block in that mode."""
    pair, schema = target.split()[:2]
    x = r["throughput"][schema]["ratios"][pair]
    limit = float(target.rsplit(">=", 1)[1])
    spread = f"paired ratios of this run {x['min']:.3f} - {x['max']:.3f}"
    where = (
        f"{spread}: the target lies inside the noise of the repetitions"
        if x["min"] <= limit <= x["max"]
        else f"{spread}: below the target in every repetition"
    )
    adds = (
        "a BLAKE2b fingerprint per block (hashed ahead in a thread since issue 29), a Keeper "
        "write per block (BEFORE) and one per Spark partition (AFTER)"
        if pair.startswith("dedup")
        else "per task its staging's CREATE (the rows travel as the "
        "baseline's); per batch, on a plain MergeTree target below compact_bytes, every row "
        "written once more inside ClickHouse: the gather into one part per partition value "
        "(compact_bytes=0 keeps the parts and skips it)"
    )
    return f"{where}; txsink adds {adds}"


def section_machine(r: dict[str, Any]) -> list[str]:
    m = r["machine"]
    versions = ", ".join(
        f"{k} {m[k]}" for k in ("python", "pyspark", "pyarrow", "clickhouse_connect", "chdb")
    )
    return [
        "## Machine",
        "",
        f"- CPU: {m['cpu']}, {m['cores']} cores (shared with other engineers' test runs: "
        "absolute figures are noisy, ratios are measured side by side)",
        f"- kernel {m['kernel']}; {m['java']}; {versions}; txsink at git {m['git']}",
        f"- load average at the start of each section: {r.get('load', {})}",
        "",
        "```",
        m["free_g"],
        "```",
        "",
    ]


def section_throughput(r: dict[str, Any]) -> list[str]:
    tp = r.get("throughput")
    if not tp:
        return []
    out = [
        "## 1. Throughput",
        "",
        "Batch `df.write...save()` of a DataFrame read from Parquet files generated once "
        "(same files, same Spark partitions for every sink), Spark `local[2]`, JVM and Python "
        "workers warmed up first. Every repetition writes each sink once (order rotated); "
        "each write goes into a fresh target, whose row count is checked after it. "
        "Figures: median (min - max) over repetitions; MB = Arrow in-memory bytes. "
        "Ratios are per repetition (paired), median (min - max). The baseline gets the same "
        "block size (1,000,000 rows / 256 MiB) and compression (lz4) as txsink's defaults.",
        "",
    ]
    for schema, s in tp.items():
        out += [
            f"### {schema}: {s['rows']:,} rows x {s['columns']} columns, "
            f"{s['arrow_mb']:,.0f} MiB, {s['files']} files, {s['spark_partitions']} Spark "
            "partitions",
            "",
            "| sink | rows/s | MB/s |",
            "|---|---|---|",
        ]
        for sink, v in s["sinks"].items():
            out.append(f"| {SINK_NAMES[sink]} | {rng(v['rows_per_s'])} | {rng(v['mb_per_s'])} |")
        out += ["", "| ratio | paired median (min - max) | ratio of medians |", "|---|---|---|"]
        for name, v in s["ratios"].items():
            out.append(f"| {name} | {rng(v, '.3f')} | {v['of_medians']:.3f} |")
        out.append("")
    return out


def section_commit(r: dict[str, Any]) -> list[str]:
    co = r.get("commit")
    if not co:
        return []
    out = [
        "## 2. Commit overhead per batch",
        "",
        f"{co['batches']} batches per row, each one staging table holding k partitions of "
        f"{co['rows_per_partition']:,} rows, published with visibility=batch (the batch "
        "gathered into its batch staging, one ATTACH). "
        "*Transactor*: "
        "`CommitResult.seconds` of `Transactor.commit_batch` (prepare + publish + record, incl. "
        "the staging drop); staging created outside the timing. *Driver commit*: "
        "`txsink.committer.commit_batch` as Spark's driver-side `commit` runs it (borrows "
        "the process's pooled Keeper and ClickHouse connections, checks the run's epoch and "
        "the target's views, commits, sweeps strays), minus the Python worker start (Spark "
        "reuses it). Milliseconds.",
        "",
        "| partitions | Transactor p50 | p95 | p99 | prepare p50 | publish p50 | "
        "driver commit p50 | p95 | p99 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    rerun = r.get("commit_rerun")
    for k in (1, 4, 16, 64):
        if f"transactor_{k}" not in co:
            continue
        t, d = co[f"transactor_{k}"], co[f"driver_{k}"]
        c = t["commit"]
        out.append(
            f"| {k} | {ms(c, 'p50_ms')} | {ms(c, 'p95_ms')} | {ms(c, 'p99_ms')} | "
            f"{ms(t['prepare'], 'p50_ms')} | {ms(t['publish'], 'p50_ms')} | "
            f"{ms(d, 'p50_ms')} | {ms(d, 'p95_ms')} | {ms(d, 'p99_ms')} |"
        )
    out += _commit_rerun(rerun)
    out.append("")
    return out


def _commit_rerun(rerun: dict[str, Any] | None) -> list[str]:
    if not rerun:
        return []
    rows = ", ".join(
        f"{k.split('_')[1]} partitions {rerun[k]['p50_ms']:.0f} / {rerun[k]['p99_ms']:.0f}"
        for k in sorted(rerun, key=lambda k: int(k.split("_")[1]) if k.startswith("driver_") else 0)
        if k.startswith("driver_")
    )
    return [
        "",
        f"Driver commit p50 / p99 ms in a second run with nothing else on the machine "
        f"(`{rerun['command']}`, started {rerun['started']}): {rows}. The p50 holds; the "
        "p99 follows the target's background merges (120 batches of k small parts into one "
        "table) and ZooKeeper's fsync on the two shared cores.",
    ]


def section_latency(r: dict[str, Any]) -> list[str]:
    lat = r.get("latency")
    if not lat:
        return []
    first = lat["cases"][0]
    out = [
        "## 2a. Small micro-batches, end to end",
        "",
        f"Streaming queries (`availableNow`, {lat['files_per_batch']} Parquet files per "
        f"trigger, one Spark partition each), {first['rounds']} rounds of {first['batches']} "
        "batches per sink (first batch of each query left out), sinks in rotated order, each "
        "into its own fresh table; row counts checked after every query. Spark's own "
        "`durationMs.addBatch` (tasks + commit), ms. *Overhead*: per round, p50 of the txsink "
        "sink minus p50 of its at-least-once twin in the same round; median (min - max) over "
        "rounds. p99 overhead: p99 minus p99 over all batches. Batches carry one event date "
        "(one target partition) unless marked *4 partitions*.",
        "",
        "| rows/batch | baseline p50 | clickhouse_tx p50 | p99 | overhead p50 | p99 | "
        "foreach baseline p50 | foreach_batch p50 | p99 | overhead p50 | p99 |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in lat["cases"]:
        tx, fe = c["clickhouse_tx_overhead"], c["foreach_batch_overhead"]
        label = f"{c['rows']:,}" + (" (4 partitions)" if c.get("spread") else "")
        out.append(
            f"| {label} | {ms(c['baseline'], 'p50_ms')} | {ms(c['clickhouse_tx'], 'p50_ms')} | "
            f"{ms(c['clickhouse_tx'], 'p99_ms')} | **{tx['p50_ms']:+.0f}** "
            f"({tx['min_ms']:+.0f} - {tx['max_ms']:+.0f}) | {tx['p99_ms']:+.0f} | "
            f"{ms(c['foreach_baseline'], 'p50_ms')} | {ms(c['foreach_batch'], 'p50_ms')} | "
            f"{ms(c['foreach_batch'], 'p99_ms')} | **{fe['p50_ms']:+.0f}** "
            f"({fe['min_ms']:+.0f} - {fe['max_ms']:+.0f}) | {fe['p99_ms']:+.0f} |"
        )
    out.append("")
    return out


def section_shards(r: dict[str, Any]) -> list[str]:
    sh = r.get("shards")
    if not sh:
        return []
    out = [
        "## 2c. One xid across shards",
        "",
        "`benchmarks/shards.py`: a cluster of its own (`txsink embedded up --shards 3`: three "
        "chdb endpoints, one ZooKeeper). Batch `save()` of the narrow dataset with "
        "`clickhouse_tx` (attach, `shard_by=id`) into the first k shards, in rotated order, "
        "fresh tables each time, rows checked over the shards. On two cores every shard "
        "shares the same CPUs: this shows what sharding costs, not how it scales."
        + (
            f" Measured in a run of its own: `{sh['run']['command']}`, started "
            f"{sh['run']['started']} (git {sh['run']['git']})."
            if sh.get("run")
            else ""
        ),
        "",
        "| shards | rows/s | rows/s per shard | rows on each shard |",
        "|---|---|---|---|",
    ]
    for k, t in sh["throughput"].items():
        each = ", ".join(f"{n:,}" for n in t["rows_on_each_shard"])
        out.append(f"| {k} | {rng(t['rows_per_s'])} | {rng(t['rows_per_s_per_shard'])} | {each} |")
    out += [
        "",
        "Commit of one batch staged on k shards (1,000 rows in one partition per shard): "
        "`CommitResult.seconds` (prepare + one MOVE statement per shard + record + drops).",
        "",
        "| shards | batches | p50 ms | p95 ms | p99 ms |",
        "|---|---|---|---|---|",
    ]
    for k, c in sh["commit"].items():
        out.append(
            f"| {k} | {c['n']} | {ms(c, 'p50_ms')} | {ms(c, 'p95_ms')} | {ms(c, 'p99_ms')} |"
        )
    out.append("")
    return out


def section_recovery(r: dict[str, Any]) -> list[str]:
    rec = r.get("recovery")
    if not rec:
        return []
    lib, e2e = rec["library"], rec["end_to_end"]
    out = [
        "## 2b. Recovery after a crash",
        "",
        f"*Library level* ({lib['clean']['n']} trials each, batches of {rec['partitions']} "
        "partitions): a new writer's `Transactor.begin` (new epoch + recovery) plus its next "
        "`commit_batch`, after a predecessor that crashed right after PREPARE (recovery rolls "
        "that xid forward: MOVE + record) vs after a clean predecessor.",
        "",
        "| predecessor | p50 ms | p95 ms | max ms |",
        "|---|---|---|---|",
    ]
    for kind in ("clean", "crashed"):
        s = lib[kind]
        out.append(f"| {kind} | {ms(s, 'p50_ms')} | {ms(s, 'p95_ms')} | {ms(s, 'max_ms')} |")
    out += [
        "",
        "*End to end* (`python -m txsink.demo job`, 3 files of 5,000 rows, one per batch): the "
        "crashed run dies at `TXSINK_FAULT=driver.after_prepare` in its second batch; the clean "
        "one finished and was restarted with 3 new files. Restart measured from the new run's "
        "takeover (its first commit entry, after Spark's start-up and the first tasks) to the "
        "first COMMITTED record of the new epoch (crashed: the rolled-forward xid):",
        "",
        "| restart after | takeover -> first commit | first xid | exit codes | rows in target |",
        "|---|---|---|---|---|",
    ]
    for kind in ("clean", "crashed"):
        s = e2e[kind]
        out.append(
            f"| {kind} | {s['seconds'] * 1000:.0f} ms | {s['xid']} | {s['exit_codes']} | "
            f"{s['rows']:,} |"
        )
    return [*out, ""]


def section_sweep(r: dict[str, Any], plot_name: str) -> list[str]:
    sw = r.get("sweep")
    if not sw:
        return []
    out = [
        "## 3. Trigger-interval sweep",
        "",
        f"Spark `rate` source at {sw['rate']:,} rows/s (2 partitions), event time = the "
        f"row's `timestamp`, into clickhouse_tx attach; {sw['seconds']} s per interval. A "
        f"poller reads `count()` / `max(event_time)` of the target every {sw['poll_seconds']} "
        "s; a row's latency is the first poll that sees it minus its event time. *Delivered* "
        "= rows visible at the end / run time (includes the first interval); *capacity* = "
        "rows / time spent in batches; *busy* = mean batch time / interval. The rate source "
        "hands out rows in whole seconds (its offsets are seconds), which adds up to about "
        "1 s to every latency whatever the sink.",
        "",
        f"![trigger sweep]({plot_name})",
        "",
        "| interval s | batches | delivered rows/s | capacity rows/s | latency p50 s | p95 s "
        "| max s | batch s | busy |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for p in sw["points"]:
        out.append(
            f"| {p['interval_s']} | {p['batches']} | {p['rows_per_s']:,.0f} | "
            f"{p['capacity_rows_per_s']:,.0f} | {p['latency_p50_s']:.2f} | "
            f"{p['latency_p95_s']:.2f} | {p['latency_max_s']:.2f} | "
            f"{p['batch_seconds_mean']:.2f} | {p['busy']:.2f} |"
        )
    out += [
        "",
        "Intervals close to the window length: the window holds only a few batches, and rows "
        "of the last interval are not visible yet when it closes, so *delivered* understates "
        "throughput there; *capacity* and *busy* show whether the sink kept up.",
    ]
    return [*out, ""]


def section_memory(r: dict[str, Any]) -> list[str]:
    mem = r.get("memory")
    if not mem:
        return []
    out = [  # out[2] is the description
        "## 4. Executor memory",
        "",
        "One Spark partition generated in the JVM (`spark.range(..., numPartitions=1)`, "
        "id + date + ~1 KB string), written by one Python worker; peak RSS of any PySpark "
        "Python process, sampled from /proc every 50 ms. Default `block_bytes` "
        f"{mem['block_bytes_mb']} MiB. Peak growth big/small: **{mem['growth']:.2f}x**.",
        "",
        "| sink | partition MiB | rows | seconds | peak worker RSS MiB |",
        "|---|---|---|---|---|",
    ]
    if mem["runs"][1]["partition_mb"] < mem["block_bytes_mb"]:
        out[2] += (
            " (Here the small partition is below one block, so its peak is lower by"
            " construction: the comparison needs the full sizes.)"
        )
    for x in mem["runs"]:
        out.append(
            f"| {x['sink']} | {x['partition_mb']:,.0f} | {x['rows']:,} | {x['seconds']:.1f} | "
            f"{x['peak_rss_mb']:,.0f} |"
        )
    return [*out, ""]


def section_profile(r: dict[str, Any]) -> list[str]:
    pr = r.get("profile")
    if not pr:
        return []
    out = [
        "## Profiles (pyinstrument, top lines)",
        "",
        f"In-process, real functions, {pr['rows']:,} narrow rows in 10,000-row Arrow batches: "
        f"baseline write {pr['baseline_write_s']:.2f} s, txsink `write_partition` "
        f"{pr['txsink_write_s']:.2f} s; fixed cost of one small `save()` (validate + 2 tasks "
        f"+ commit) {pr['fixed_save_ms']:.0f} ms.",
        "",
    ]
    out += section_trips(pr.get("trips"))
    for name, text in pr["profiles"].items():
        out += [f"### {name}", "", "```", text, "```", ""]
    return out


def section_trips(tr: dict[str, Any] | None) -> list[str]:
    """The round trips of one small batch, per phase and kind (hotpath.trips_of_a_batch)."""
    if not tr:
        return []
    floor = tr["floor_ms"]
    out = [
        f"### Round trips of one batch of {tr['tasks']} tasks",
        "",
        f"Micro-batches of a stream (one run, after its first batch) of {tr['tasks']} tasks "
        "of 1,000 rows each (4 staging tables of one target partition, as 4 files per "
        "trigger), in-process; every "
        "ClickHouse statement (`Client._call`) and Keeper request (`KazooConn.wait`) "
        f"timed where txsink makes it; count and ms are medians over {tr['batches']} "
        f"batches. The floor of one round trip here: `SELECT 1` {floor['ClickHouse']:.1f} "
        f"ms, one Keeper read {floor['Keeper']:.1f} ms. The tasks run one after another "
        "here; Spark runs them two at a time on two cores.",
        "",
        "| phase | store | request | count | ms |",
        "|---|---|---|---|---|",
    ]
    totals: dict[tuple[str, str], list[float]] = {}
    for row in tr["rows"]:
        out.append(
            f"| {row['phase']} | {row['store']} | {row['kind']} | {row['count']:g} | "
            f"{row['ms']:.1f} |"
        )
        total = totals.setdefault((row["phase"], row["store"]), [0.0, 0.0])
        total[0] += row["count"]
        total[1] += row["ms"]
    for (phase, store), (count, ms) in totals.items():
        out.append(f"| **{phase}** | **{store}** | all | **{count:g}** | **{ms:.1f}** |")
    return [*out, ""]


NOTES = """## Where the time goes

- **Per row, txsink costs what the baseline costs.** Both send the same Arrow blocks with
  the same `insert_arrow` to the same endpoint; in the profiles `write_partition` spends
  its time in clickhouse-connect's `insert_arrow` (Arrow serialisation, lz4, waiting for
  the server), and txsink's own per-row work (`iter_blocks` slicing, the value checks of
  section 5) is a few milliseconds per million rows.
- **Per micro-batch, txsink makes round trips the baseline does not**, counted and timed in
  *Round trips of one batch* below (a stream's steady state, 4 tasks) and counted at 200
  tasks and at 50 partition values in section 2e. Each task makes its staging table
  (`CREATE TABLE ... AS target SETTINGS ...`, read back only by a worker's first task)
  while it waits for Spark's first rows, off its critical path (on it when the rows come
  at once: one statement), then reads nothing more. The driver's commit
  (`visibility=batch`, the default where the target allows it) sends the same statements
  whatever the number of tasks and partition values: one read (the staged parts and
  whether each staging is fit to publish, the target's views, columns and CREATE, losing
  attempts' staging), one CREATE of the batch
  staging that also fills it (every task's rows in one part per partition value; where
  the batch is large, or the target's CREATE cannot be reproduced, a CREATE and a copy or
  an insert), the ATTACH that publishes it, one DROP (without SYNC: the names go at
  once, the disk later). Keeper: a sync, one read of the job's state, the prepare, the
  fence check and the commit (7 requests in 5 round trips).
- **What is left is round trips the protocol needs:** a staging table per task attempt
  (a failed or zombie attempt's rows never reach a published table); the read before the
  prepare (the manifest must be what the tasks staged, and a view made since validation
  must stop an attach publish); a batch staging table under the finisher's own name (one
  ATTACH is atomic, several are not; the name is its claim against a second finisher);
  the drop. On this machine one statement
  costs at least the `SELECT 1` floor shown below, and ClickHouse and ZooKeeper share two
  cores with Spark; a real server answers these on its own cores.
- Figures on this machine are noisy: two cores are shared with other engineers' test
  suites (load averages above). Compare figures of one run, side by side.
"""


def section_values(r: dict[str, Any]) -> list[str]:
    values = r.get("values")
    if not values:
        return []
    out = [
        "## 5. Per-value checks",
        "",
        "`txsink.clickhouse.values.apply` over every 10,000-row batch of a dataset (the "
        "checks each writer task runs before it sends a batch: docs/types.md), next to "
        "`insert_arrow` of the same batches (median of 3). *own*: the dataset's table; "
        "*checked*: integers unsigned and the timestamp `DateTime64(3)`, so every column "
        "gets range and precision rules.",
        "",
        "| dataset | rules | rows | checks s | insert s | checks / insert |",
        "|---|---|---|---|---|---|",
    ]
    for name, x in values.items():
        out.append(
            f"| {name} | {x['rules']} | {x['rows']:,} | {x['checks_s']:.3f} | "
            f"{x['insert_s']:.2f} | {x['share_pct']:.2f}% |"
        )
    return [*out, ""]


def section_state(r: dict[str, Any]) -> list[str]:
    st = r.get("state")
    if not st:
        return []
    out = [
        "## 2d. The state store: Keeper vs ClickHouse (KeeperMap)",
        "",
        f"The same work with `state=keeper` and `state=clickhouse`, in {st['rounds']} rotated "
        f"rounds (`benchmarks/state_store.py`): a driver commit of an attach batch of "
        f"{st['partitions']} partitions ({st['batches_per_round']} per round), a dedup-mode "
        f"batch save of {st['save_rows']:,} rows in {st['partitions']} Spark partitions "
        f"({st['saves_per_round']} per round), and a takeover after a crash right after "
        "PREPARE plus the next commit (3 per round)."
        + (f" Measured by `{st['command']}`, {st['started']}." if st.get("command") else ""),
        "",
        "| per batch | keeper p50 ms | keeper p99 ms | clickhouse p50 ms | clickhouse p99 ms "
        "| paired difference, median (min..max) ms |",
        "|---|---|---|---|---|---|",
    ]
    names = {"commit": "driver commit", "save": "dedup save", "recovery": "recovery"}
    for key, label in names.items():
        k, c, d = st["stores"]["keeper"][key], st["stores"]["clickhouse"][key], st["paired_ms"][key]
        out.append(
            f"| {label} | {ms(k, 'p50_ms')} | {ms(k, 'p99_ms')} | {ms(c, 'p50_ms')} | "
            f"{ms(c, 'p99_ms')} | {d['median']:+.1f} ({d['min']:+.1f}..{d['max']:+.1f}) |"
        )
    rounds = {k: st["paired_ms"][k].get("rounds") for k in names}
    shown = "; ".join(
        f"{names[k]} {', '.join(f'{x:+.0f}' for x in v or ())}" for k, v in rounds.items()
    )
    per_round = f"Paired difference per round, in order (ms): {shown}. "
    out += [
        "",
        (per_round if all(rounds.values()) else "")
        + "The differences grow with the rows of the state table: every round (and every "
        "earlier section with state=clickhouse) adds jobs' state to the one KeeperMap "
        "table; KeeperMap reads a key by equality in one "
        "Keeper request, but lists children (the takeover's listing of records, the "
        "delete of a dedup batch's state) by reading every row of the table: measured "
        "on this stack, a read by key stays at 7-8 ms from 10 to 4,000 rows, a listing "
        "takes 16 ms at 10 rows, 186 ms at 1,000 and 384 ms at 4,000. Each save here is a "
        "new run, whose takeover lists, and a dedup batch's state is deleted by a "
        "listing; a stream's commit lists once every 50 batches (retention). A listing "
        "bounded by the job's own state (a table per job, or an index of children) is "
        "not built yet.",
    ]
    return [*out, ""]


def section_counts(r: dict[str, Any]) -> list[str]:
    co = r.get("counts")
    if not co:
        return []
    from benchmarks.counts import table

    return [
        "## 2e. Per batch, at more tasks and partition values: statements, requests, parts",
        "",
        "Counts that do not depend on the machine (`benchmarks/counts.py`, issue 39): "
        f"a stream's batches after its first, median of {co['batches']}, in-process "
        "(the real `write_partition` of each task, then `commit_batch`), attach mode into "
        "a `MergeTree PARTITION BY p` target whose merges are stopped; each task writes "
        f"{co['rows_per_value']} rows per partition value over every value. ClickHouse "
        "statements counted at `Client._call`, Keeper requests as kazoo sends them (a "
        "multi is one; in brackets those waited on), state statements: the KeeperMap "
        "store's (`state=clickhouse`), parts: active parts of the target after - before.",
        "",
        *table(co),
        "",
    ]


def section_shapes(r: dict[str, Any]) -> list[str]:
    sh = r.get("shapes")
    if not sh:
        return []
    from benchmarks.shapes import table

    return [
        "## 2f. Batch save at more tasks and partition values: wall time and parts",
        "",
        f"`benchmarks/shapes.py` (issue 39): batch `save()` of {sh['rows']:,} narrow rows "
        "with a column `p` of P values, `repartition(T)` (round-robin: every task holds "
        "every value; cached before the saves), through the at-least-once baseline "
        "(`insert_arrow`) and `clickhouse_tx` attach mode (default visibility: the one "
        "the query log shows it published with), in rotated order, "
        f"{sh['reps']} repetition(s), each save into a fresh `MergeTree PARTITION BY p` "
        "target whose merges are stopped; rows and distinct ids checked after each. "
        "Seconds: median; attach/baseline: speed (baseline s / attach s) per repetition, "
        "median (min - max); parts added: active parts of the target after the save, "
        "median. Targets (issue 39, in the table of targets): attach/baseline >= "
        f"{SHAPE_RATIO:.2f} at 200 x 1 and 20 x 50; parts added per batch <= partition values.",
        "",
        *table(sh),
        "",
    ]


def render(r: dict[str, Any], plot_name: str = "trigger_sweep.png") -> str:
    lines = [
        "# Benchmarks",
        "",
        "Generated by `make bench` (`benchmarks/run.py`); raw figures in "
        "`benchmarks/results.json`. Every run starts its own embedded stack (chdb over HTTP + "
        "ZooKeeper) in a temporary directory on free ports.",
        "",
        f"Command: `{r['command']}` ({r['sizes']['name']} sizes), started {r['started']}, "
        f"took {r.get('total_seconds', 0) / 60:.1f} min.",
        "",
    ]
    if r.get("merged"):
        m = r["merged"]
        lines += [
            f"Sections {', '.join(m['sections'])} were measured again by a later run "
            f"(`{m['command']}`, started {m['started']}, {m['total_seconds'] / 60:.1f} min) "
            "and replace the first run's; the others are the first run's.",
            "",
        ]
    lines += section_targets(r)
    lines += section_machine(r)
    lines += section_throughput(r)
    lines += section_commit(r)
    lines += section_latency(r)
    lines += section_recovery(r)
    lines += section_shards(r)
    lines += section_state(r)
    lines += section_counts(r)
    lines += section_shapes(r)
    lines += section_sweep(r, plot_name)
    lines += section_memory(r)
    lines += section_values(r)
    lines += [NOTES]
    lines += section_profile(r)
    return "\n".join(lines).rstrip() + "\n"


def write(results: dict[str, Any], doc: Path, plot: Path) -> None:
    if results.get("sweep"):
        from benchmarks.trigger_sweep import plot as draw

        draw(results["sweep"], plot)
    doc.write_text(render(results, plot.name))


if __name__ == "__main__":
    path = Path(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results.json")
    root = Path(__file__).resolve().parents[1]
    write(
        json.loads(path.read_text()),
        root / "docs" / "benchmarks.md",
        root / "docs" / "trigger_sweep.png",
    )
