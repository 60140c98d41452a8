"""``txsink demo``: the main job with injected crashes on the embedded stack, then a report."""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path
from typing import Any

from txsink.cli.common import choice, choices_metavar
from txsink.cli.output import Exit, Output, kv_table, table
from txsink.errors import ConfigError
from txsink.options import MODES


def register(subs: Any) -> None:
    p: argparse.ArgumentParser = subs.add_parser(
        "demo",
        help="stream into ClickHouse while crashing the job at every protocol step, then verify",
        description="Runs a streaming job from generated Parquet files into a partitioned "
        "MergeTree table, crashing it at each fault point and by kill -9 of the driver, "
        "restarting from the checkpoint until done, then reports and runs verify. Exit 0 "
        "only when the target is exact and verify is clean.",
    )
    p.add_argument(
        "--url",
        default=os.environ.get("TXSINK_URL"),
        help="ClickHouse URL (default: start the embedded stack)",
    )
    p.add_argument(
        "--keeper",
        default=os.environ.get("TXSINK_KEEPER"),
        help="Keeper connect string (default: embedded)",
    )
    p.add_argument(
        "--dir", default=None, help="work directory for source and checkpoint (default: a temp dir)"
    )
    p.add_argument(
        "--files", type=int, default=12, help="Parquet files in the source (one per micro-batch)"
    )
    p.add_argument("--rows-per-file", type=int, default=20_000)
    p.add_argument("--kills", type=int, default=2, help="extra runs ended by kill -9 of the driver")
    p.add_argument("--mode", default="auto", type=choice(*MODES), metavar=choices_metavar(MODES))
    p.add_argument("--seed", type=int, default=42)
    p.add_argument(
        "--skip-two-tables",
        action="store_true",
        help="skip the second job: rows and their daily counts committed as one xid "
        "(txsink.transaction), crashed at two random driver points",
    )
    p.add_argument(
        "--shards",
        type=int,
        default=1,
        help="also run the job on a table sharded over N embedded ClickHouse endpoints "
        "(txsink embedded up --shards N), crashed at every fault point and by kill -9, with "
        "an exact report per shard",
    )
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)


def run(args: argparse.Namespace, out: Output) -> int:
    from txsink.demo import run_demo

    url, keeper = args.url, args.keeper
    shards: tuple[str, ...] = ()
    if args.shards > 1 and (url or keeper):
        raise ConfigError("--shards runs on the embedded cluster: leave out --url and --keeper")
    if not url or not keeper:
        from txsink.embedded import stack

        out.progress("starting the embedded stack (ClickHouse engine over HTTP + ZooKeeper) ...")
        info = stack.up(shards=args.shards if args.shards > 1 else None)
        url, keeper = url or info.url, keeper or info.keeper
        shards = info.shards if args.shards > 1 else ()
        out.progress(f"stack up: ClickHouse {', '.join(info.shards)}, Keeper {info.keeper}")
    workdir = args.dir or tempfile.mkdtemp(prefix="txsink-demo-")
    from txsink.demo import jvm

    out.progress(f"job JVM start-up: {jvm.enable(Path('.txsink') / 'jvm')}")
    out.progress(f"work dir {workdir}; every run below is crashed on purpose, then restarted")
    report = run_demo(
        url,
        keeper,
        workdir,
        files=args.files,
        rows_per_file=args.rows_per_file,
        kills=args.kills,
        seed=args.seed,
        mode=args.mode,
        two_tables=not args.skip_two_tables,
        shards=shards,
        progress=out.progress,
    )
    ok = report.exact and report.verify_clean
    text = "\n".join(
        [
            "",
            "runs:",
            table([r.__dict__ for r in report.runs], ["run", "crash", "exit_code", "seconds"]),
            "",
            "result:",
            kv_table(
                {
                    "rows produced": f"{report.produced:,}",
                    "rows in target": f"{report.in_target:,}",
                    "distinct ids": f"{report.distinct_ids:,}",
                    "duplicates": report.duplicates,
                    "missing": report.missing,
                    "sum(amount) expected / target": (
                        f"{report.amount_expected} / {report.amount_in_target}"
                    ),
                    "batches committed": report.batches,
                    "commit latency p50 / p99 (uninterrupted)": (
                        f"{report.commit_p50_ms} ms / {report.commit_p99_ms} ms"
                    ),
                    "verify": "clean" if report.verify_clean else f"NOT CLEAN {report.verify}",
                }
            ),
            *(
                [
                    "",
                    "two-table job (one xid per batch over "
                    f"{' + '.join(report.two_tables['tables'])}):",
                    kv_table(
                        {
                            "runs": ", ".join(
                                f"{r['crash']}->{r['exit_code']}" for r in report.two_tables["runs"]
                            ),
                            "rows produced / in target / distinct": (
                                f"{report.two_tables['produced']:,} / "
                                f"{report.two_tables['rows_in_target']:,} / "
                                f"{report.two_tables['distinct_ids']:,}"
                            ),
                            "daily counts sum": f"{report.two_tables['daily_orders']:,}",
                            "COMMITTED xids missing a table": (
                                ", ".join(report.two_tables["torn_xids"]) or "none"
                            ),
                            "verify": "clean" if report.two_tables["verify_clean"] else "NOT CLEAN",
                        }
                    ),
                ]
                if report.two_tables
                else []
            ),
            *(
                [
                    "",
                    f"sharded job ({report.shards['table']} on {len(report.shards['per_shard'])} "
                    "shards, shard_by=id, one xid per batch over every shard):",
                    "runs: "
                    + ", ".join(f"{r['crash']}->{r['exit_code']}" for r in report.shards["runs"]),
                    table(
                        report.shards["per_shard"],
                        ["shard", "rows", "distinct_ids", "duplicates", "rows_of_other_shards"],
                    ),
                    kv_table(
                        {
                            "rows produced / in all shards": (
                                f"{report.shards['produced']:,} / "
                                f"{report.shards['rows_in_shards']:,}"
                            ),
                            "verify": "clean" if report.shards["verify_clean"] else "NOT CLEAN",
                        }
                    ),
                ]
                if report.shards
                else []
            ),
            "",
            "EXACT: every produced row is in the target exactly once."
            if report.exact
            else "NOT EXACT: see duplicates / missing above.",
        ]
    )
    return out.result(Exit.OK if ok else Exit.FINDINGS, text, **report.to_json())
