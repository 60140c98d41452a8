"""``txsink tune``: measure the real per-batch overhead on a target and pick a trigger interval.

Every micro-batch pays a fixed cost whatever its size: executors create a staging table
per task, the driver prepares in Keeper, moves each partition, records COMMITTED and
drops staging. :func:`measure` runs that path for real (``Transactor.commit_batch``)
against a scratch COPY of the target (``CREATE TABLE db.__txsink_tune_<hex> AS db.t``),
under a scratch job ``tune-<hex>``, staging a few rows into 1 and into 4 partitions per
transaction. The target itself is only read (to seed sample rows); the scratch table, its
staging and the scratch job's Keeper nodes are removed afterwards, also on failure.

:func:`recommend` (pure) turns the measurement into a trigger interval::

    T = max(overhead_p95 / max_overhead,                       # overhead budget
            merge_seconds * writers / (PARTS_BUDGET * parts_to_delay_insert),  # parts
            1 s)

The parts term: each batch adds up to ``writers`` parts (one per Spark task that staged
rows of the partition) to every partition it touches; keeping the parts one merge cycle
adds to a tenth of ``parts_to_delay_insert`` keeps inserts far from being delayed.
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from txsink.clickhouse.observe import PARTS_SETTING_KEYS
from txsink.clickhouse.replicated_ddl import staging_engine_clause, staging_keeper_path
from txsink.errors import ConfigError, TxSinkError
from txsink.names import qualified, split_table
from txsink.ops.tune_model import (
    DEFAULT_MAX_OVERHEAD,
    DEFAULT_MERGE_SECONDS,
    DEFAULT_TRANSACTIONS,
    DEFAULT_WRITERS,
    MIN_INTERVAL,
    PARTS_BUDGET,
    ROWS_PER_PARTITION,
    SCRATCH_PREFIX,
    Recommendation,
    Sample,
    TuneResult,
)
from txsink.ports.registry import Registry
from txsink.protocol.codec import JobMeta
from txsink.protocol.ids import batch_xid, run_tag, staging_name
from txsink.protocol.states import Mode, StagedPart, XidState
from txsink.transactor import Transactor

# Re-exported: the result types and defaults live in txsink.ops.tune_model.
__all__ = [
    "combine_shards",
    "measure",
    "merge_tree_limits",
    "observed_rate",
    "overhead_curve",
    "recommend",
    "write_plot",
]

log = logging.getLogger(__name__)

# --------------------------------------------------------------------------- table facts


def merge_tree_limits(warehouse: Any, table: str) -> tuple[int, int]:
    """(parts_to_delay_insert, parts_to_throw_insert) of ``db.table``: the table's own
    SETTINGS, else the server's merge_tree_settings defaults (as ``target_info`` reads them)."""
    info = warehouse.target_info(table)
    if not info.is_merge_tree:
        raise ConfigError(
            f"table {table} is {info.engine}, not a MergeTree: txsink publishes with MOVE "
            "PARTITION only into MergeTree tables (dedup mode has no staging to measure)"
        )
    delay, throw = PARTS_SETTING_KEYS
    return int(info.settings.get(delay, 1000)), int(info.settings.get(throw, 3000))


# --------------------------------------------------------------------------- measurement


def _seed(client: Any, table: str, scratch: str, want: int) -> list[str]:
    """Fill the scratch copy with a few rows of up to ``want`` partitions; their ids."""
    db, name = split_table(scratch)
    fq = qualified(db, name)
    tdb, tname = split_table(table)
    client.command(
        f"INSERT INTO {fq} SELECT * FROM {qualified(tdb, tname)} WHERE _partition_id IN "
        f"(SELECT DISTINCT partition_id FROM system.parts WHERE active AND "
        f"database = {{db:String}} AND table = {{t:String}} ORDER BY partition_id DESC "
        f"LIMIT {int(want)}) LIMIT {ROWS_PER_PARTITION * 4} BY _partition_id",
        parameters={"db": tdb, "t": tname},
        idempotent=False,
        what=f"seed {scratch} from {table}",
    )
    pids = sorted(_partitions(client, scratch))
    if len(pids) < want:
        try:
            client.command(
                f"INSERT INTO {fq} SELECT * FROM generateRandom() LIMIT 64",
                idempotent=False,
                what=f"seed {scratch} with random rows",
            )
        except TxSinkError as exc:
            log.info("random seed rows for %s failed: %s", scratch, exc)
        pids = sorted(_partitions(client, scratch))
    return pids[:want]


def _partitions(client: Any, table: str) -> list[str]:
    db, name = split_table(table)
    return [
        str(r[0])
        for r in client.query_rows(
            "SELECT partition_id FROM system.parts WHERE active AND database = {db:String} "
            "AND table = {t:String} GROUP BY partition_id HAVING sum(rows) > 0",
            parameters={"db": db, "t": name},
            what=f"read partitions of {table}",
        )
    ]


def measure(
    registry: Registry,
    warehouse: Any,
    table: str,
    *,
    transactions: int = DEFAULT_TRANSACTIONS,
    max_overhead: float = DEFAULT_MAX_OVERHEAD,
    writers: int = DEFAULT_WRITERS,
    merge_seconds: float = DEFAULT_MERGE_SECONDS,
    progress: Callable[[str], None] | None = None,
    step: Callable[[str], None] | None = None,
) -> TuneResult:
    """Run ``transactions`` tiny real transactions into a scratch copy of ``table``
    (``step`` hears of each one done: a progress bar)."""
    if transactions < 2:
        raise ConfigError(f"--transactions must be at least 2, got {transactions}")
    client = warehouse.client
    delay, throw = merge_tree_limits(warehouse, table)
    db, _ = split_table(table)
    tag = uuid.uuid4().hex[:10]
    scratch = f"{db}.{SCRATCH_PREFIX}{tag}"
    job = f"tune-{tag}"
    say = progress or (lambda _msg: None)
    samples: list[Sample] = []
    notes: list[str] = []
    transactor = Transactor(registry, warehouse, job)
    prefix = transactor.prefix
    sdb, sname = split_table(scratch)
    tdb, tname = split_table(table)
    info = warehouse.target_info(table)
    engine = ""
    if info.is_replicated:  # its own Keeper path, never the target's (replicated_ddl)
        engine = staging_engine_clause(info, staging_keeper_path(info, sdb, sname), {})
    try:
        client.command(
            f"CREATE TABLE {qualified(sdb, sname)} AS {qualified(tdb, tname)} {engine}",
            idempotent=False,
            what=f"create scratch copy {scratch} AS {table}",
        )
        warehouse.ensure_staging_db()
        pids = _seed(client, table, scratch, 4)
        if not pids:
            raise ConfigError(
                f"cannot find sample rows for {table} (it is empty and random rows do not fit "
                "its columns); insert a few rows into it, then re-run `txsink tune`"
            )
        if len(pids) < 4:
            notes.append(
                f"only {len(pids)} partition(s) available: the 4-partition transactions "
                f"touch {len(pids)}"
            )
        epoch = transactor.begin(
            f"txsink-tune-{tag}",
            meta=JobMeta(target=scratch, mode=Mode.ATTACH.value, unknown={"scratch": True}),
        )
        run = run_tag(job)
        warmup = 0.0
        say(f"measuring {transactions} transactions into scratch copy {scratch} (job {job})")
        for i in range(transactions + 1):  # transaction 0 warms connections and paths up
            k = 1 if i % 2 else min(4, len(pids))
            chosen = pids[:k]
            name = staging_name(job, batch_xid(i), run, 0, 0, i, transactor.namespace).table
            t0 = time.perf_counter()
            warehouse.create_staging(scratch, name)
            client.command(
                f"INSERT INTO {qualified(warehouse.staging_db, name)} SELECT * FROM "
                f"{qualified(sdb, sname)} WHERE _partition_id IN {{p:Array(String)}} "
                f"LIMIT {ROWS_PER_PARTITION} BY _partition_id",
                parameters={"p": chosen},
                settings={"optimize_on_insert": 0},
                idempotent=False,
                what=f"stage rows into {name}",
            )
            view = warehouse.staging_view([name]).get(name) or {}
            parts = [StagedPart(name, pid, rows) for pid, rows in sorted(view.items()) if rows]
            t1 = time.perf_counter()
            result = transactor.commit_batch(epoch, batch_xid(i), i, scratch, parts)
            t2 = time.perf_counter()
            if step is not None:
                step(f"transaction {i} of {transactions}")
            if i == 0:
                warmup = t2 - t0
                continue
            samples.append(
                Sample(
                    i,
                    len(parts),
                    sum(p.rows for p in parts),
                    t1 - t0,
                    t2 - t1,
                    result.timings.get("prepare", 0.0),
                    result.timings.get("publish", 0.0),
                )
            )
        committed = [r for r in registry.list(job) if r.state is XidState.COMMITTED]
        if len(committed) < transactions:
            notes.append(f"only {len(committed)} of {transactions + 1} transactions committed")
    finally:
        _cleanup(registry, warehouse, scratch, job, prefix)
    return TuneResult(
        table,
        scratch,
        job,
        warmup,
        samples,
        delay,
        throw,
        len(pids),
        max_overhead,
        writers,
        merge_seconds,
        notes=notes,
    )


def _cleanup(registry: Registry, warehouse: Any, scratch: str, job: str, prefix: str) -> None:
    """Remove the scratch table, its staging and the scratch job; log what fails."""
    sdb, sname = split_table(scratch)
    try:
        for table in warehouse.list_staging(prefix):
            warehouse.drop_staging(table)
        warehouse.client.command(
            f"DROP TABLE IF EXISTS {qualified(sdb, sname)} SYNC", what=f"drop scratch {scratch}"
        )
    except TxSinkError as exc:
        log.warning("could not drop scratch %s or its staging: %s; drop it by hand", scratch, exc)
    try:
        registry.delete_job(job)
    except TxSinkError as exc:
        log.warning("could not delete scratch job %s from Keeper: %s", job, exc)


def combine_shards(urls: Sequence[str], results: Sequence[TuneResult]) -> TuneResult:
    """One sharded job's batch from per-shard measurements (pure).

    Each task stages its rows shard after shard (:func:`txsink.spark.attach_write._stage_sharded`:
    a table created and filled on one shard, then the next), so the stages add up; the
    driver prepares once and publishes shard after shard (commits add up: a bound from
    above, as the Keeper prepare and record are counted once per shard). Transaction i
    of every shard is taken as one batch; limits are the tightest shard's."""
    n = min(len(r.samples) for r in results)
    samples = [
        Sample(
            i + 1,
            sum(r.samples[i].partitions for r in results),
            sum(r.samples[i].rows for r in results),
            sum(r.samples[i].stage_seconds for r in results),
            sum(r.samples[i].commit_seconds for r in results),
            sum(r.samples[i].prepare_seconds for r in results),
            sum(r.samples[i].publish_seconds for r in results),
        )
        for i in range(n)
    ]
    first = results[0]
    combined = TuneResult(
        first.table,
        ", ".join(r.scratch_table for r in results),
        ", ".join(r.job for r in results),
        sum(r.warmup_seconds for r in results),
        samples,
        min(r.parts_to_delay_insert for r in results),
        min(r.parts_to_throw_insert for r in results),
        min(r.partitions_available for r in results),
        first.max_overhead,
        first.writers,
        first.merge_seconds,
        notes=[
            f"shard {k} ({u}): {note}"
            for k, (u, r) in enumerate(zip(urls, results, strict=True))
            for note in r.notes
        ],
    )
    combined.shards = [
        {
            "shard": k,
            "url": url,
            "commit_seconds": r.stats("commit_seconds"),
            "overhead_seconds": r.stats("overhead_seconds"),
        }
        for k, (url, r) in enumerate(zip(urls, results, strict=True))
    ]
    combined.notes.append(
        f"{len(urls)} shards measured one after the other; a batch's overhead is the "
        "the sum of the shards' staging plus the sum of their commits"
    )
    return combined


# --------------------------------------------------------------------------- rates


def observed_rate(
    registry: Registry,
    job: str,
    *,
    sample_seconds: float | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> tuple[float | None, str]:
    """Rows per second of ``job``: a ledger delta over ``sample_seconds`` if given (and
    non-zero), else rows over the span of the retained committed records."""
    if sample_seconds:
        before = registry.ledger(job).rows
        sleep(sample_seconds)
        delta = registry.ledger(job).rows - before
        if delta > 0:
            return delta / sample_seconds, (
                f"ledger of job {job}: {delta} rows committed in {sample_seconds:g}s"
            )
    done = sorted(
        (r for r in registry.list(job) if r.state is XidState.COMMITTED and r.committed_at),
        key=lambda r: r.committed_at or 0.0,
    )
    if len(done) < 2:
        return None, f"job {job} has fewer than 2 retained committed records: no rate"
    span = (done[-1].committed_at or 0.0) - (done[0].committed_at or 0.0)
    rows = sum(r.rows for r in done[1:])
    if span <= 0:
        return None, f"job {job}'s retained commits span no time: no rate"
    return rows / span, (
        f"ledger of job {job}: {rows} rows over {span:.0f}s between its oldest and newest "
        f"retained commits ({len(done)} records)"
    )


# --------------------------------------------------------------------------- the advice


def recommend(
    overhead_p95: float,
    *,
    max_overhead: float,
    parts_to_delay_insert: int,
    parts_to_throw_insert: int,
    writers: int = DEFAULT_WRITERS,
    merge_seconds: float = DEFAULT_MERGE_SECONDS,
    rows_per_second: float | None = None,
    rate_source: str = "",
    samples: int = 0,
) -> Recommendation:
    """The trigger interval and its reasoning, line by line (pure)."""
    if not 0 < max_overhead < 1:
        raise ConfigError(f"--max-overhead must be between 0 and 1, got {max_overhead}")
    budget = PARTS_BUDGET * parts_to_delay_insert
    t_overhead = overhead_p95 / max_overhead
    t_parts = merge_seconds * writers / budget if budget > 0 else float("inf")
    interval = max(t_overhead, t_parts, MIN_INTERVAL)
    trigger = math.ceil(interval)
    lines = [
        f"fixed cost per batch (stage + prepare + publish + record), p95 over {samples} "
        f"transactions: {overhead_p95:.3f} s",
        f"overhead budget {max_overhead:.0%} of the interval: T >= {overhead_p95:.3f} / "
        f"{max_overhead:g} = {t_overhead:.2f} s",
        f"parts_to_delay_insert = {parts_to_delay_insert} (parts_to_throw_insert = "
        f"{parts_to_throw_insert}): keep new parts per partition per merge cycle <= "
        f"{PARTS_BUDGET:.0%} of it = {budget:g}",
        f"each batch adds up to {writers} parts per partition (--writers), merge cycle "
        f"{merge_seconds:g} s (--merge-seconds): T >= {merge_seconds:g} x {writers} / "
        f"{budget:g} = {t_parts:.2f} s",
        f"floor: T >= {MIN_INTERVAL:g} s",
        f"recommended trigger interval T = max({t_overhead:.2f}, {t_parts:.2f}, "
        f"{MIN_INTERVAL:g}) = {interval:.2f} s: "
        f'.trigger(processingTime="{trigger} seconds")',
    ]
    rows_per_batch = None
    if rows_per_second is not None:
        rows_per_batch = round(rows_per_second * trigger)
        lines.append(
            f"at {rows_per_second:,.0f} rows/s ({rate_source or '--rows-per-second'}): about "
            f"{rows_per_batch:,} rows per batch at T = {trigger} s"
        )
    return Recommendation(
        round(interval, 3),
        round(t_overhead, 3),
        round(t_parts, 3),
        rows_per_second,
        rate_source,
        rows_per_batch,
        lines,
    )


def overhead_curve(
    overhead: float, intervals: Sequence[float] | None = None
) -> list[tuple[float, float]]:
    """(trigger interval, share of it spent on the fixed per-batch cost)."""
    grid = intervals or [0.5 * 1.25**i for i in range(40)]
    return [(t, min(1.0, overhead / t)) for t in grid]


def write_plot(result: TuneResult, path: str) -> str:
    """A PNG of overhead share vs trigger interval; ConfigError if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ConfigError(
            f"--plot {path} needs matplotlib, which is not installed: "
            "`pip install 'txsink[bench]'` (or `pip install matplotlib`), or drop --plot"
        ) from exc
    over = result.stats("overhead_seconds")
    fig, ax = plt.subplots(figsize=(7, 4))
    for key, style in (("p50", "-"), ("p95", "--")):
        xs, ys = zip(*overhead_curve(over[key]), strict=True)
        ax.plot(xs, [y * 100 for y in ys], style, label=f"overhead {key} ({over[key]:.3f} s)")
    ax.axhline(result.max_overhead * 100, color="grey", linewidth=0.8, label="--max-overhead")
    if result.recommendation:
        ax.axvline(
            result.recommendation.interval,
            color="red",
            linewidth=0.8,
            label=f"recommended T = {result.recommendation.interval:.2f} s",
        )
    ax.set_xscale("log")
    ax.set_xlabel("trigger interval (s)")
    ax.set_ylabel("share of the interval spent on commit overhead (%)")
    ax.set_title(f"txsink commit overhead on {result.table}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
