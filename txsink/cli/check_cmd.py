"""``txsink check --table db.t``: what the server and table support, before the first write."""

from __future__ import annotations

import argparse
from typing import Any

from txsink.cli.common import choice, choices_metavar, resolve_credentials
from txsink.cli.ops_cmd import _common
from txsink.cli.output import Exit, Output, finding, table
from txsink.config import WriterConfig
from txsink.options import MODES


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "check",
        help="what a server and target table support, before the first write",
        description="What --table on --url supports: the mode a job would take and why, batch "
        "visibility, the dedup window, your insert settings and privileges, the state store "
        "(a staging table and a state node are made and removed; the table is never written). "
        "Exit 0 when a job can run, 1 when a check failed.",
    )
    _common(p)
    p.add_argument("--table", required=True, metavar="DB.T", help="the target table")
    p.add_argument(
        "--mode",
        default="auto",
        type=choice(*MODES),
        metavar=choices_metavar(MODES),
        help="the mode asked",
    )
    p.set_defaults(func=run_check_cmd)


def run_check_cmd(args: argparse.Namespace, out: Output) -> int:
    from txsink.ops.check import run_check

    creds = resolve_credentials(args)
    options = {
        "url": creds.url,
        "user": creds.user,
        "password": creds.password or "",
        "table": args.table,
        "job": args.job or "txsink-check",
        "keeper": args.keeper,
        "keeper_root": args.keeper_root,
        "keeper_auth": creds.keeper_auth or "",
        "state": args.state,
        "state_database": args.state_database,
        "staging_database": args.staging_database or "txsink_staging",
        "mode": args.mode,
        "verify": "true" if args.verify else "false",
        "ca_cert": args.ca_cert or "",
        "connect_timeout": str(args.connect_timeout),
        "send_receive_timeout": str(args.send_receive_timeout),
        "keeper_timeout": str(args.keeper_timeout),
        "keeper_retry_s": str(args.keeper_retry_s),
    }
    report = run_check(WriterConfig.from_options(options))
    rows = [{"check": c.name, "status": c.status, "detail": c.detail} for c in report.checks]
    verdict = (
        f"a job can write to {report.table} in {report.mode} mode with state={report.state}"
        if report.can_run
        else "a job cannot run yet: fix what failed above"
    )
    failed = [
        finding(f"check-{c.name}", "error", c.detail) for c in report.checks if c.status == "fail"
    ]
    return out.result(
        Exit.OK if report.can_run else Exit.FINDINGS,
        table(rows, ["check", "status", "detail"]) + "\n\n" + verdict,
        findings=failed,
        **report.to_json(),
    )
