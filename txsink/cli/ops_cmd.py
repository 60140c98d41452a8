"""``txsink status | recover | verify | tune``: the operator's commands.

Each command calls :mod:`txsink.ops` and renders the result through :class:`Output`.
Exit statuses:

- ``status``: 0 (informational); 1 when the job named by ``--job`` does not exist.
- ``recover``: 0 clean afterwards (or nothing to do, or ``--dry-run``); 3 refused (a live
  writer holds the job and no ``--force``, or no confirmation); 4 alarms remain.
- ``verify``: 0 clean; 1 anomalies.
- ``tune``: 0.
- any: 2 for a txsink error (unreachable Keeper/ClickHouse, bad arguments), see
  :mod:`txsink.cli.main`.
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
from typing import Any

from txsink.cli.main import add_common, resolve_credentials
from txsink.cli.output import Output, kv_table, table
from txsink.clickhouse.warehouse import ClickHouseWarehouse
from txsink.errors import ConfigError
from txsink.ops import recovery as rc
from txsink.ops import status as st
from txsink.ops import tune as tn
from txsink.ops import verify as vf
from txsink.ops.liveness import Liveness, explain

EXIT_REFUSED = 3
EXIT_ALARMS = 4


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "status",
        help="jobs, writers, last committed batch, pending xids, staging, warnings",
        description="Show every job under the Keeper root (or --job): writer epoch and owner, "
        "heartbeat age, last committed batch, rows committed, xids not yet committed, staging "
        "tables, and warnings (see docs/operations.md). Exit 0; 1 if --job does not exist.",
    )
    _common(p)
    p.add_argument(
        "--stuck-after",
        type=float,
        default=st.DEFAULT_STUCK_AFTER,
        help="warn about PREPARED xids older than this many seconds (default 300)",
    )
    p.add_argument(
        "--stale-after",
        type=float,
        default=st.DEFAULT_STALE_AFTER,
        help="an owner heartbeat older than this many seconds is stale (default: follows the "
        "job's commit cadence, 3 x the median interval between recent commits, within "
        "[30, 600]; 600 before the second commit)",
    )
    p.set_defaults(func=run_status)

    p = subparsers.add_parser(
        "recover",
        help="roll PREPARED xids forward, roll orphan staging back (fences the writer)",
        description="Show the recovery plan of each job, then carry it out under a new writer "
        "epoch (owner txsink-recover@host:pid), which fences the previous writer. Refuses while "
        "a live writer holds the job unless --force. Exit 0 clean, 3 refused, 4 alarms remain.",
    )
    _common(p)
    p.add_argument("--dry-run", action="store_true", help="show the plan, change nothing")
    p.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    p.add_argument(
        "--force",
        action="store_true",
        help="recover even while a writer's heartbeat is fresh (fences it)",
    )
    p.add_argument(
        "--stale-after",
        type=float,
        default=st.DEFAULT_STALE_AFTER,
        help="a writer whose heartbeat is younger than this many seconds is live (default: "
        "follows the job's commit cadence, see `txsink status`)",
    )
    p.set_defaults(func=run_recover)

    p = subparsers.add_parser(
        "verify",
        help="audit the committed history (backward/overlap/gap) and reconcile the target",
        description="Order each job's COMMITTED xids by commit sequence and report backward, "
        "overlap and gap anomalies, PREPARED xids older than --stuck-after, ledger vs target "
        "row counts per partition, and staging left by recent commits. Exit 0 only when clean.",
    )
    _common(p)
    p.add_argument(
        "--recent",
        type=int,
        default=vf.DEFAULT_RECENT,
        help="check staging leftovers of the N newest committed xids (default 20)",
    )
    p.add_argument(
        "--stuck-after",
        type=float,
        default=vf.DEFAULT_STUCK_AFTER,
        help="PREPARED xids older than this many seconds are anomalies (default 300)",
    )
    p.add_argument(
        "--allow-other-writers",
        action="store_true",
        help="a target holding more rows than txsink committed is a warning only",
    )
    p.set_defaults(func=run_verify)

    p = subparsers.add_parser(
        "tune",
        help="measure the real commit overhead on a table and recommend a trigger interval",
        description="Runs tiny real transactions into a scratch copy of --table (dropped "
        "afterwards) under a scratch job, measures p50/p95/p99 overhead, reads "
        "parts_to_delay_insert, and recommends a trigger interval with its reasoning.",
    )
    _common(p)
    p.add_argument("--table", required=True, help="the target table, db.table")
    p.add_argument(
        "--shards",
        default=None,
        help="comma-separated shard URLs (a sharded job's local table on each; default: "
        "the shards of --job, if it is sharded): measured shard by shard, then combined",
    )
    p.add_argument(
        "--rows-per-second",
        type=float,
        default=None,
        help="expected input rate, to estimate rows per batch",
    )
    p.add_argument(
        "--sample-seconds",
        type=float,
        default=None,
        help="with --job: measure the job's rate from its ledger over this many seconds",
    )
    p.add_argument(
        "--max-overhead",
        type=float,
        default=tn.DEFAULT_MAX_OVERHEAD,
        help="largest share of the interval the fixed cost may take (default 0.05)",
    )
    p.add_argument(
        "--transactions",
        type=int,
        default=tn.DEFAULT_TRANSACTIONS,
        help="transactions to measure (default 20)",
    )
    p.add_argument(
        "--writers",
        type=int,
        default=tn.DEFAULT_WRITERS,
        help="Spark tasks writing each target partition per batch (default 4)",
    )
    p.add_argument(
        "--merge-seconds",
        type=float,
        default=tn.DEFAULT_MERGE_SECONDS,
        help="how long background merges take to fold new parts (default 60)",
    )
    p.add_argument(
        "--plot",
        default=None,
        metavar="OUT.png",
        help="write overhead share vs trigger interval as a PNG (needs matplotlib)",
    )
    p.set_defaults(func=run_tune)


def _common(p: argparse.ArgumentParser) -> None:
    add_common(p)
    p.add_argument("--keeper-root", default="/txsink", help="txsink's root node (default /txsink)")
    p.add_argument(
        "--staging-database",
        default=None,
        help="staging database (default: the job's own, else txsink_staging)",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")


def _stores(args: argparse.Namespace) -> st.Stores:
    creds = resolve_credentials(args)
    return st.open_stores(
        creds.url,
        args.keeper,
        user=creds.user,
        password=creds.password,
        keeper_auth=creds.keeper_auth,
        keeper_root=args.keeper_root,
        staging_database=args.staging_database,
    )


def _when(ts: float | None) -> str:
    if ts is None:
        return "-"
    return dt.datetime.fromtimestamp(ts, dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _age(seconds: float | None) -> str:
    return "never" if seconds is None else f"{seconds:.1f}s ago"


# --------------------------------------------------------------------------- status


def run_status(args: argparse.Namespace, out: Output) -> int:
    with _stores(args) as stores:
        if args.job is not None and args.job not in stores.registry.list_jobs():
            message = (
                f"job {args.job!r} does not exist under Keeper root {args.keeper_root} at "
                f"{args.keeper}; `txsink status` lists the jobs there"
            )
            out.emit({"error": message, "job": args.job, "jobs": []}, f"txsink: {message}")
            return 1
        jobs = st.collect_status(
            stores,
            args.job,
            root=args.keeper_root,
            stuck_after=args.stuck_after,
            stale_after=args.stale_after,
        )
    payload = {
        "keeper_root": args.keeper_root,
        "jobs": [j.to_json() for j in jobs],
        "warnings": sum(1 for j in jobs for w in j.warnings if w.level == "warn"),
    }
    if not jobs:
        out.emit(payload, f"no jobs under Keeper root {args.keeper_root}")
        return 0
    out.emit(payload, "\n\n".join(_render_status(j) for j in jobs))
    return 0


def _render_status(j: st.JobStatus) -> str:
    writer = (
        f"epoch {j.epoch}, owner {j.owner}, heartbeat {_age(j.heartbeat_age)}"
        f"{f' ({j.owner_state})' if j.owner_state else ''}{', LIVE' if j.live else ''}"
        if j.epoch is not None
        else "none"
    )
    cadence = (
        f"commits every {j.cadence_s:g}s (median)" if j.cadence_s is not None else "not yet known"
    )
    why = explain(
        Liveness(j.live, j.heartbeat_age, j.cadence_s, j.stale_after_s, j.stale_after_source)
    )
    head = kv_table(
        {
            "target": f"{j.target} ({j.mode or '?'} mode)"
            + (f"; one xid over {', '.join(j.targets)}" if len(j.targets) > 1 else ""),
            "writer": writer,
            "last commit": f"batch {j.last_batch} at {_when(j.last_commit_at)} "
            f"({_age(j.last_commit_age)})"
            if j.last_commit_at
            else "none yet",
            "cadence": cadence,
            "stale after": f"{j.stale_after_s:g}s ({why}): heartbeat older = writer gone",
            "committed": f"{j.committed} xids, {j.rows_committed:,} rows",
            "staging db": j.staging_database,
        }
    )
    pending = table(
        [
            {
                **p.__dict__,
                "age_s": p.age_seconds,
                "staging": len(p.staging_tables),
                "tables": ", ".join(f"{t}:{n}" for t, n in p.tables.items()),
            }
            for p in j.pending
        ],
        ["xid", "batch", "state", "age_s", "rows", "staging", "epoch", "tables"],
    )
    staging = table(
        [s.__dict__ for s in j.staging], ["table", "xid", "rows", "bytes", "referenced_by"]
    )
    warnings = "\n".join(f"    [{w.level}] {w.kind}: {w.message}" for w in j.warnings)
    indent = "\n".join("  " + line for line in head.splitlines())
    return "\n".join(
        [
            f"job {j.job}",
            indent,
            "  xids not yet committed:",
            *("    " + line for line in pending.splitlines()),
            "  staging tables:",
            *("    " + line for line in staging.splitlines()),
            "  warnings:",
            warnings,
        ]
    )


# --------------------------------------------------------------------------- recover


def _render_plan(v: rc.RecoveryPlanView, staging_db: str) -> list[str]:
    holder = (
        f"writer epoch {v.epoch} held by {v.owner}, heartbeat {_age(v.heartbeat_age)}"
        f"{' (LIVE)' if v.live else ''}"
        if v.epoch is not None
        else "no writer epoch yet"
    )
    lines = [f"job {v.job}: {holder}"]
    p = v.plan
    lines += [
        f"  plan: roll forward  {x} (PREPARED, {v.roll_forward_rows.get(x, 0)} rows)"
        for x in p.rolled_forward
    ]
    lines += [
        f"  plan: roll back     {staging_db}.{t} (staged, no PREPARED xid references it)"
        for t in p.rolled_back
    ]
    lines += [
        f"  plan: drop leftover {staging_db}.{t} (its xid is COMMITTED)"
        for t in p.dropped_leftovers
    ]
    lines += [f"  expected alarm: {a}" for a in v.expected_alarms]
    if v.empty:
        lines.append("  nothing to do")
    return lines


def run_recover(args: argparse.Namespace, out: Output) -> int:
    lines: list[str] = []
    entries: dict[str, dict[str, Any]] = {}
    code = 0
    with _stores(args) as stores:
        jobs = st.resolve_jobs(stores.registry, args.job, args.keeper_root)
        views = [rc.plan_job_recovery(stores, j, stale_after=args.stale_after) for j in jobs]
        for v in views:
            db = stores.warehouse(stores.registry.job_meta(v.job)).staging_db
            lines += _render_plan(v, db)
            entries[v.job] = {
                "job": v.job,
                "plan": v.to_json(),
                "refused": None,
                "outcome": None,
                "report": v.plan.to_json(),
            }
        if not jobs:
            lines.append(f"no jobs under Keeper root {args.keeper_root}")
        todo = [v for v in views if not v.empty]
        if args.dry_run:
            for v in todo:
                if v.live:
                    lines.append(
                        f"note: job {v.job} has a live writer ({v.owner}); recover would refuse "
                        "without --force"
                    )
            lines.append("dry run: nothing was changed")
            out.emit(
                {"dry_run": True, "jobs": list(entries.values()), "clean": not todo},
                "\n".join(lines),
            )
            return 0
        allowed = []
        for v in todo:
            if v.live and not args.force:
                why = (
                    f"refusing to recover job {v.job}: writer {v.owner} (epoch {v.epoch}) "
                    f"heartbeat {v.heartbeat_age:.1f}s ago is fresher than "
                    + (
                        f"--stale-after {v.stale_after_s:g}s"
                        if args.stale_after is not None
                        else f"its stale threshold {v.stale_after_s:g}s (commit cadence "
                        + (f"{v.cadence_s:g}s" if v.cadence_s is not None else "unknown")
                        + ")"
                    )
                    + ", so it may be mid-batch. Stop that query (or wait "
                    "until its heartbeat is stale), or re-run with --force to fence it"
                )
                entries[v.job]["refused"] = why
                lines.append(why)
                code = EXIT_REFUSED
            else:
                allowed.append(v)
        if allowed and not args.yes:
            refusal = _confirm(args, out, allowed, lines)
            if refusal:
                for v in allowed:
                    entries[v.job]["refused"] = refusal
                lines.append(refusal)
                out.emit(
                    {"dry_run": False, "jobs": list(entries.values()), "clean": False},
                    "\n".join(lines),
                )
                return EXIT_REFUSED
        for v in allowed:
            outcome = rc.carry_out_recovery(stores, v.job, stale_after=args.stale_after)
            db = stores.warehouse(stores.registry.job_meta(v.job)).staging_db
            lines += _render_outcome(outcome, db)
            entries[v.job].update(outcome=outcome.to_json(), report=outcome.report.to_json())
            if not outcome.clean:
                code = EXIT_ALARMS
    clean = code == 0
    out.emit({"dry_run": False, "jobs": list(entries.values()), "clean": clean}, "\n".join(lines))
    return code


def _confirm(
    args: argparse.Namespace, out: Output, allowed: list[rc.RecoveryPlanView], lines: list[str]
) -> str | None:
    """None when the operator confirmed; else why nothing will be done."""
    if out.json_mode:
        return "refusing to change anything: --json needs --yes (or --dry-run); nothing changed"
    if not sys.stdin.isatty():
        return (
            "refusing to change anything: stdin is not a terminal, so the plan cannot be "
            "confirmed; re-run with --yes to carry it out (or --dry-run to only show it)"
        )
    out.emit(None, "\n".join(lines))
    lines.clear()
    names = ", ".join(v.job for v in allowed)
    out.progress(
        f"Carry out this plan for {names}? Each job gets a new writer epoch, which fences "
        "its current writer. [y/N] "
    )
    answer = sys.stdin.readline().strip().lower()
    return None if answer in ("y", "yes") else "not confirmed; nothing was changed"


def _render_outcome(o: rc.RecoveryOutcome, staging_db: str) -> list[str]:
    r = o.report
    lines = [
        f"job {o.job}: took writer epoch {o.epoch} as {o.owner}; this fences "
        + (
            f"{o.fenced_owner} (epoch {o.fenced_epoch}): its next commit fails with FencedError, "
            "restart that query to resume the job"
            if o.fenced_owner
            else "no earlier writer"
        )
    ]
    stuck = set(o.remaining.plan.rolled_forward)
    lines += [f"  rolled forward  {x}" for x in r.rolled_forward if x not in stuck]
    lines += [f"  rolled back     {staging_db}.{t}" for t in r.rolled_back]
    lines += [f"  dropped         {staging_db}.{t}" for t in r.dropped_leftovers]
    if r.pruned:
        lines.append(f"  pruned {len(r.pruned)} old COMMITTED record(s)")
    lines += [f"  ALARM: {a}" for a in r.alarms]
    lines.append(
        f"job {o.job}: clean"
        if o.clean
        else f"job {o.job}: ALARMS REMAIN ({len(r.alarms)}); see docs/operations.md#lost-staging"
    )
    return lines


# --------------------------------------------------------------------------- verify


def run_verify(args: argparse.Namespace, out: Output) -> int:
    with _stores(args) as stores:
        jobs = st.resolve_jobs(stores.registry, args.job, args.keeper_root)
        results = [
            vf.verify(
                stores.registry,
                stores.warehouse(stores.registry.job_meta(job)),
                job,
                stuck_after=args.stuck_after,
                recent=args.recent,
                allow_other_writers=args.allow_other_writers,
            )
            for job in jobs
        ]
    clean = all(r.clean for r in results)
    payload = {"clean": clean, "jobs": [r.to_json() for r in results]}
    blocks = [_render_verify(r) for r in results] or [f"no jobs under {args.keeper_root}"]
    anomalies = sum(len(r.anomalies) for r in results)
    blocks.append("verify: CLEAN" if clean else f"verify: {anomalies} ANOMALIES")
    out.emit(payload, "\n\n".join(blocks))
    return 0 if clean else 1


def _render_verify(r: vf.VerifyResult) -> str:
    c = r.checked
    lines = [
        f"job {r.job}  target {r.target}",
        f"  history: {c.get('committed_retained', 0)} committed xids retained "
        f"(seq {c.get('seq_range') or '-'}), {c.get('prepared', 0)} PREPARED, "
        f"{c.get('adhoc_exempt', 0)} ad-hoc exempt",
    ]
    per_table = c.get("tables") or ({r.target: c} if "ledger_rows" in c else {})
    for name, t in per_table.items():
        lines.append(
            f"  reconciliation of {name} by {t['reconciled_by']}: ledger {t['ledger_rows']:,} "
            f"rows ({', '.join(t['writers']) or '-'}) vs target {t['target_rows']:,} rows in "
            f"{t['partitions']} partition(s) [{t.get('engine') or 'missing'}]"
        )
    lines.append("  anomalies:" if r.anomalies else "  anomalies: none")
    for a in r.anomalies:
        who = f"  [xids {', '.join(a.xids)}]" if a.xids else ""
        lines.append(f"    {a.kind.upper()}: {a.message}{who}")
    for w in r.warnings:
        lines.append(f"  warning {w.kind}: {w.message}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- tune


def run_tune(args: argparse.Namespace, out: Output) -> int:
    if args.sample_seconds and not args.job:
        raise ConfigError("--sample-seconds measures a job's rate from its ledger: add --job J")
    with _stores(args) as stores:
        shards = [u for u in (args.shards or "").split(",") if u]
        if not shards and args.job:
            meta = stores.registry.job_meta(args.job)
            shards = list(meta.shards) if meta else []

        def measure(warehouse: Any) -> tn.TuneResult:
            return tn.measure(
                stores.registry,
                warehouse,
                args.table,
                transactions=args.transactions,
                max_overhead=args.max_overhead,
                writers=args.writers,
                merge_seconds=args.merge_seconds,
                progress=out.progress,
            )

        if shards:
            db = stores.warehouse().staging_db
            result = tn.combine_shards(
                shards,
                [measure(ClickHouseWarehouse(stores.shard_client(u), db)) for u in shards],
            )
        else:
            result = measure(stores.warehouse())
        rate, source = args.rows_per_second, "--rows-per-second"
        if rate is None and args.job:
            st.resolve_jobs(stores.registry, args.job, args.keeper_root)
            rate, source = tn.observed_rate(
                stores.registry, args.job, sample_seconds=args.sample_seconds
            )
            if rate is None:
                result.notes.append(source)
    over = result.stats("overhead_seconds")
    result.recommendation = tn.recommend(
        over["p95"],
        max_overhead=args.max_overhead,
        parts_to_delay_insert=result.parts_to_delay_insert,
        parts_to_throw_insert=result.parts_to_throw_insert,
        writers=args.writers,
        merge_seconds=args.merge_seconds,
        rows_per_second=rate,
        rate_source=source if rate is not None else "",
        samples=len(result.samples),
    )
    payload = result.to_json()
    if args.plot:
        payload["plot"] = tn.write_plot(result, args.plot)
    data = result.to_json()
    rows = [
        {"measure": name, **data[key]}
        for name, key in (
            ("stage (create + insert)", "stage_seconds"),
            ("prepare", "prepare_seconds"),
            ("publish + record + drop", "publish_seconds"),
            ("commit total", "commit_seconds"),
            ("overhead (stage + commit)", "overhead_seconds"),
        )
    ]
    per_shard = [
        f"shard {s['shard']} ({s['url']}): commit p50 {s['commit_seconds']['p50']:.3f} s / "
        f"p95 {s['commit_seconds']['p95']:.3f} s"
        for s in data.get("shards", [])
    ]
    by_parts = ", ".join(
        f"{k} partition(s): p50 {v['p50']:.3f} s / p95 {v['p95']:.3f} s"
        for k, v in data["commit_seconds_by_partitions"].items()
    )
    text = "\n".join(
        [
            f"measured {len(result.samples)} transactions into scratch copy {result.scratch_table} "
            f"(dropped), scratch job {result.job} (deleted)",
            table(rows, ["measure", "p50", "p95", "p99", "mean"]),
            f"commit by partitions touched: {by_parts}",
            *per_shard,
            *(f"note: {n}" for n in result.notes),
            "",
            "reasoning:",
            *(f"  {line}" for line in result.recommendation.reasoning),
            *([f"plot written to {args.plot}"] if args.plot else []),
        ]
    )
    out.emit(payload, text)
    return 0
