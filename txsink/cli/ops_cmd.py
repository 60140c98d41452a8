"""``txsink status | recover | verify | tune``: the operator's commands.

Each command calls :mod:`txsink.ops` and renders the result through :class:`Output`;
this module registers all four and runs ``status``; ``recover``, ``verify`` and ``tune``
run in their own modules. Every one takes the common flags (:mod:`txsink.cli.common`).
Exit statuses follow :class:`txsink.cli.output.Exit` (docs/cli.md#exit-statuses):

- ``status``: 0 nothing needs attention; 1 a warning (or no jobs in the store).
- ``recover``: 0 clean afterwards (or nothing to do, or ``--dry-run``); 3 refused (a live
  writer holds the job and no ``--force``, or no confirmation); 4 alarms remain (or a
  dedup batch stopped half-way, named, which only a rerun or ``--discard-dedup`` settles).
- ``verify``: 0 clean; 1 anomalies (or no jobs).
- ``tune``: 0.
- any: 2 bad flags or a missing job, 4 a state that needs an operator, 5 unreachable.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import signal
import sys
import threading
import time
from typing import Any

from txsink.cli.common import add_common, jobs_of, open_stores, option_type, store_name
from txsink.cli.output import Exit, Output, age, finding, kv_table, short_age, table, when
from txsink.cli.recover_cmd import run_recover
from txsink.cli.tune_cmd import run_tune
from txsink.cli.verify_cmd import run_verify
from txsink.errors import ConfigError
from txsink.ops import anomalies as an
from txsink.ops import status as st
from txsink.ops import tune_model as tm
from txsink.ops.liveness import explain
from txsink.options import OPTIONS


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "status",
        help="jobs, writers, last committed batch, pending xids, staging, warnings",
        description="One line per job, those that need attention first; --job J or -v: "
        "the detail (docs/operations.md). Exit 0; 1: a warning needs attention, or no jobs.",
    )
    _common(p)
    p.add_argument(
        "-v",
        "--detail",
        action="store_true",
        help="every job in detail (the default with --job)",
    )
    p.add_argument(
        "--watch",
        type=float,
        default=None,
        metavar="N",
        help="redraw every N seconds until Ctrl-C (not with --json)",
    )
    p.add_argument(
        "--stuck-after",
        type=float,
        default=an.DEFAULT_STUCK_AFTER,
        metavar="S",
        help="warn about PREPARED xids older than S seconds (default 300)",
    )
    p.add_argument(
        "--stale-after",
        type=float,
        default=st.DEFAULT_STALE_AFTER,
        metavar="S",
        help="a heartbeat older than S seconds is stale (default: 3 x the commit cadence)",
    )
    p.set_defaults(func=run_status)

    p = subparsers.add_parser(
        "recover",
        help="roll PREPARED xids forward, roll orphan staging back (fences the writer)",
        description="Show each job's recovery plan, then carry it out under a new writer "
        "epoch, which fences the previous writer; refused while a live writer holds the job "
        "unless --force. Exit 0 clean, 3 refused, 4 alarms remain.",
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
        metavar="S",
        help="a heartbeat younger than S seconds is live (default: as status says)",
    )
    p.add_argument(
        "--discard-dedup",
        metavar="XID",
        help="give up a dedup batch stopped half-way (docs/operations.md)",
    )
    p.set_defaults(func=run_recover)

    p = subparsers.add_parser(
        "verify",
        help="audit the committed history (backward/overlap/gap) and reconcile the target",
        description="Check each job's committed history (backward, overlap, gap), stuck "
        "PREPARED xids, ledger vs target rows per partition and staging left behind. Exit 0 "
        "only when clean.",
    )
    _common(p)
    p.add_argument(
        "--recent",
        type=int,
        default=an.DEFAULT_RECENT,
        metavar="N",
        help="look for staging left by the N newest xids (default 20)",
    )
    p.add_argument(
        "--stuck-after",
        type=float,
        default=an.DEFAULT_STUCK_AFTER,
        metavar="S",
        help="PREPARED xids older than S seconds are anomalies (default 300)",
    )
    p.add_argument(
        "--allow-other-writers",
        action="store_true",
        help="more rows in a target than committed is a warning only",
    )
    p.set_defaults(func=run_verify)

    p = subparsers.add_parser(
        "tune",
        help="measure the real commit overhead on a table and recommend a trigger interval",
        description="Runs tiny real transactions into a scratch copy of --table under a "
        "scratch job and recommends a trigger interval, with its reasoning.",
    )
    _common(p)
    p.add_argument("--table", required=True, metavar="DB.T", help="the target table")
    p.add_argument(
        "--shards",
        default=(),
        type=option_type(OPTIONS["shards"]),
        metavar="URLS",
        help="shard URLs, comma-separated (default: --job's)",
    )
    p.add_argument(
        "--rows-per-second",
        type=float,
        default=None,
        metavar="N",
        help="expected input rate, to estimate rows per batch",
    )
    p.add_argument(
        "--sample-seconds",
        type=float,
        default=None,
        metavar="S",
        help="with --job: its rate over the last S seconds",
    )
    p.add_argument(
        "--max-overhead",
        type=float,
        default=tm.DEFAULT_MAX_OVERHEAD,
        metavar="F",
        help="largest share of an interval to spend (0.05)",
    )
    p.add_argument(
        "--transactions",
        type=int,
        default=tm.DEFAULT_TRANSACTIONS,
        metavar="N",
        help="transactions to measure (default 20)",
    )
    p.add_argument(
        "--writers",
        type=int,
        default=tm.DEFAULT_WRITERS,
        metavar="N",
        help="Spark tasks per partition and batch (default 4)",
    )
    p.add_argument(
        "--merge-seconds",
        type=float,
        default=tm.DEFAULT_MERGE_SECONDS,
        metavar="S",
        help="seconds merges take to fold new parts (60)",
    )
    p.add_argument(
        "--plot",
        default=None,
        metavar="OUT.png",
        help="plot overhead vs interval (needs matplotlib)",
    )
    p.set_defaults(func=run_tune)


def _common(p: argparse.ArgumentParser) -> None:
    add_common(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")


WATCH_MIN_S = 0.5  # --watch: no faster, so a typo cannot hammer Keeper and ClickHouse
WATCH_CLOSE_S = 2.0  # after Ctrl-C, how long the watch waits for its sessions to close


def run_status(args: argparse.Namespace, out: Output) -> int:
    if args.watch is not None and (
        out.json_mode or not math.isfinite(args.watch) or args.watch < WATCH_MIN_S
    ):
        raise ConfigError(
            f"--watch N redraws a terminal every N >= {WATCH_MIN_S:g} seconds (got "
            f"{args.watch:g}{' with --json' if out.json_mode else ''}); for machines, poll "
            "`txsink status --json` instead"
        )
    if args.watch is None:
        with open_stores(args) as stores:
            return _status_once(args, out, stores)
    stores = open_stores(args)
    _leave_after_interrupt(out)
    try:
        while True:
            if out.stream.isatty():
                out.stream.write("\x1b[H\x1b[2J")  # home, clear: redraw in place
            out.stream.write(f"txsink status, every {args.watch:g}s; Ctrl-C ends\n")
            _status_once(args, out, stores)
            time.sleep(args.watch)
    except KeyboardInterrupt:
        # Ctrl-C may land while kazoo reconnects; its stop() then waits for the session
        # timeout: close on the side, bounded, so that Ctrl-C ends the watch at once
        closing = threading.Thread(target=stores.close, daemon=True)
        closing.start()
        closing.join(WATCH_CLOSE_S)
        if closing.is_alive():
            # kazoo's handler stops again at exit (atexit) and would wait for this very
            # close: the sessions are abandoned (ZooKeeper expires them), the output kept
            _leave(out)
        return Exit.OK
    except BaseException:
        stores.close()
        raise


def _leave(out: Output) -> None:
    """End the process now with 0, the output kept."""
    with contextlib.suppress(OSError, ValueError):
        out.stream.flush()
        sys.stderr.flush()
    os._exit(Exit.OK)


def _leave_after_interrupt(out: Output) -> None:
    """Ctrl-C ends the watch within ``WATCH_CLOSE_S`` + 1 s wherever the main thread is:
    the SIGINT also arms a timer that ends the process, in case a library on the way
    (a Keeper or HTTP retry loop) swallows the KeyboardInterrupt and the watch goes on.
    Only where signals can be set (the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        return
    previous = signal.getsignal(signal.SIGINT)

    def interrupted(signum: int, frame: Any) -> None:
        timer = threading.Timer(WATCH_CLOSE_S + 1.0, _leave, args=(out,))
        timer.daemon = True
        timer.start()
        signal.signal(signal.SIGINT, previous)  # a second Ctrl-C: as any command's
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, interrupted)


def _status_once(args: argparse.Namespace, out: Output, stores: Any) -> int:
    names = jobs_of(stores, args)
    jobs = st.collect_status(
        stores, names, stuck_after=args.stuck_after, stale_after=args.stale_after
    )
    found = [
        finding(w.kind, w.level, w.message, j.job, xid=w.xid, table=w.table)
        for j in jobs
        for w in j.warnings
    ]
    if not jobs:
        message = (
            f"no jobs in the {store_name(args)}: check --keeper-root and the store "
            "(--state, --keeper or --url)"
        )
        found.append(finding("no-jobs", "warn", message))
    code = Exit.FINDINGS if any(f["level"] == "warn" for f in found) else Exit.OK
    if not jobs:
        text = f"status: {found[-1]['message']}"
    elif args.detail or args.job is not None:
        text = "\n\n".join(_render_status(j) for j in jobs)
    else:
        text = _one_line_per_job(jobs, args.state)
    return out.result(
        code,
        text,
        jobs=[j.to_json() for j in jobs],
        findings=found,
        keeper_root=args.keeper_root,
        state=args.state,
        warnings=sum(1 for f in found if f["level"] == "warn"),
    )


def _one_line_per_job(jobs: list[st.JobStatus], store: str) -> str:
    rows = [
        {
            "job": j.job,
            "target": j.target + (f"+{len(j.targets) - 1}" if len(j.targets) > 1 else ""),
            "mode": j.mode or "?",
            "store": store,
            "last_batch": "-" if j.last_batch is None else j.last_batch,
            "age": short_age(j.last_commit_age),
            "pending": len(j.pending),
            "writer": j.writer,
            "attention": _attention(j),
        }
        for j in jobs
    ]
    columns = ["job", "target", "mode", "store", "last_batch", "age", "pending"]
    warned = sum(1 for j in jobs if any(w.level == "warn" for w in j.warnings))
    summary = f"{len(jobs)} job(s), {warned} need attention" + (
        "; `txsink status --job J` for one job's detail" if warned else ""
    )
    return table(rows, [*columns, "writer", "attention"]) + "\n" + summary


def _attention(j: st.JobStatus) -> str:
    kind = j.attention
    if kind is None:
        return "-"
    more = len(j.warnings) - 1
    return kind + (f" (+{more})" if more else "")


def _render_status(j: st.JobStatus) -> str:
    writer = (
        f"{j.writer.upper()}: epoch {j.epoch}, owner {j.owner}, heartbeat "
        f"{age(j.heartbeat_age)}{f' ({j.owner_state})' if j.owner_state else ''}"
        if j.epoch is not None
        else "none"
    )
    cadence = (
        f"commits every {j.cadence_s:g}s (median)" if j.cadence_s is not None else "not yet known"
    )
    why = explain(j)
    head = kv_table(
        {
            "target": f"{j.target} ({j.mode or '?'} mode)"
            + (f"; one xid over {', '.join(j.targets)}" if len(j.targets) > 1 else ""),
            "writer": writer,
            "last commit": (f"batch {j.last_batch} at " if j.last_batch is not None else "at ")
            + f"{when(j.last_commit_at)} ({age(j.last_commit_age)})"
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
    warnings = warnings or "    none"
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
