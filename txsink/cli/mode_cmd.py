"""``txsink mode --job J --set attach|dedup``: change a job's pinned mode (docs/operations.md)."""

from __future__ import annotations

import argparse
from typing import Any

from txsink.cli.common import choice, choices_metavar, jobs_of, open_stores
from txsink.cli.ops_cmd import _common
from txsink.cli.output import Exit, Output
from txsink.errors import ConfigError
from txsink.ops import status as st
from txsink.ops.mode import MODES, change_mode


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "mode",
        help="show or change a job's pinned mode (attach | dedup)",
        description="A job's mode is decided at its first commit and pinned in Keeper; writers "
        "never switch it. With --set, change it between batches: refused while the writer is "
        "live, an xid is PREPARED, or a dedup batch is half-written; takes a new writer epoch "
        "(fencing any writer still running in the old mode). Restart the query afterwards.",
    )
    _common(p)
    p.add_argument(
        "--set",
        dest="new_mode",
        type=choice(*MODES),
        metavar=choices_metavar(MODES),
        help="the mode to pin",
    )
    p.add_argument(
        "--stale-after",
        type=float,
        default=st.DEFAULT_STALE_AFTER,
        metavar="S",
        help="a heartbeat older than S seconds is stale (default 600)",
    )
    p.add_argument("--force", action="store_true", help="change even if the writer looks live")
    p.set_defaults(func=run_mode)


def run_mode(args: argparse.Namespace, out: Output) -> int:
    with open_stores(args) as stores:
        jobs = jobs_of(stores, args)
        if args.new_mode is None:
            metas = {j: stores.registry.job_meta(j) for j in jobs}
            pinned = {j: (m.mode or None) if m else None for j, m in metas.items()}
            return out.result(
                Exit.OK,
                "\n".join(f"{j}: {m or '(not pinned yet)'}" for j, m in pinned.items()),
                jobs=[{"job": j, "mode": m} for j, m in pinned.items()],
            )
        if args.job is None:
            raise ConfigError("--set needs --job: a mode is changed one job at a time")
        change = change_mode(
            stores, args.job, args.new_mode, stale_after=args.stale_after, force=args.force
        )
    text = (
        f"job {change.job}: mode {change.old} -> {change.new} (epoch {change.epoch}); restart "
        f"the query to write in mode {change.new}"
        if change.changed
        else f"job {change.job}: already pinned to {change.new}; nothing changed"
    )
    return out.result(Exit.OK, text, jobs=[change.to_json()])
