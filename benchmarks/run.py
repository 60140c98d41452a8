"""``make bench``: every txsink benchmark in one run, on a private embedded stack.

Starts its own ClickHouse (chdb over HTTP) + ZooKeeper in a temporary directory on free
ports (never the developer's stack), one Spark ``local[2]`` session, generates the data
once, runs the sections and writes ``benchmarks/results.json`` and ``docs/benchmarks.md``
(plus ``docs/trigger_sweep.png``).

    .venv/bin/python benchmarks/run.py            # full run (20-30 minutes)
    .venv/bin/python benchmarks/run.py --quick    # smoke run (small sizes)
    .venv/bin/python benchmarks/run.py --quick --only throughput,commit
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="benchmarks/run.py", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small sizes (smoke run)")
    parser.add_argument("--only", default=",".join(MODULES), help="comma-separated sections")
    parser.add_argument("--results", default=str(ROOT / "benchmarks" / "results.json"))
    parser.add_argument("--doc", default=str(ROOT / "docs" / "benchmarks.md"))
    parser.add_argument("--plot", default=str(ROOT / "docs" / "trigger_sweep.png"))
    parser.add_argument(
        "--merge",
        action="store_true",
        help="replace only the sections run in the existing results (the report names the "
        "sections measured by this later run)",
    )
    return parser.parse_args(argv)


MODULES = {
    "throughput": "throughput",
    "commit": "commit_overhead",
    "latency": "micro_batch",
    "shards": "shards",
    "recovery": "recovery",
    "sweep": "trigger_sweep",
    "memory": "memory",
    "profile": "hotpath",
    "values": "value_checks",
    "state": "state_store",
    "counts": "counts",
    "shapes": "shapes",
}


def section(name: str) -> Callable[..., Any]:
    """The ``run(bench, log)`` function of one section (imported lazily)."""
    return importlib.import_module(f"benchmarks.{MODULES[name]}").run  # type: ignore[no-any-return]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # run as a script, sys.path[0] is benchmarks/: its modules must not shadow the stdlib
    sys.path[:] = [str(ROOT), *(p for p in sys.path if Path(p or ".").resolve() != HERE)]
    from benchmarks import common, data, report

    logging.getLogger("txsink").setLevel(logging.ERROR)  # takeovers are expected here

    sizes = common.QUICK if args.quick else common.FULL
    wanted = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = set(wanted) - set(MODULES)
    if unknown:
        raise SystemExit(f"unknown section(s) {sorted(unknown)}; known: {', '.join(MODULES)}")
    command = "benchmarks/run.py " + " ".join(argv if argv is not None else sys.argv[1:])
    earlier: dict[str, Any] = json.loads(Path(args.results).read_text()) if args.merge else {}
    results: dict[str, Any] = {
        "command": f".venv/bin/python {command.strip()}",
        "sizes": sizes.__dict__,
        "machine": common.machine(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
    started = time.monotonic()
    with common.scratch_dir("txsink-bench-") as work:
        log(f"starting a private embedded stack in {work / 'stack'}")
        with common.private_stack(work / "stack") as info:
            spark = common.spark_session()
            bench = common.Bench(info.url, info.keeper, spark, sizes, work)
            bench.client().command("CREATE DATABASE IF NOT EXISTS bench")
            try:
                for schema, rows in (("narrow", sizes.narrow_rows), ("wide", sizes.wide_rows)):
                    ds = data.generate(schema, work / "data", rows, sizes.files)
                    bench.data[schema] = ds
                    log(f"generated {schema}: {ds.rows:,} rows, {ds.arrow_bytes / 2**20:,.0f} MiB")
                results["data"] = {k: v.__dict__ for k, v in bench.data.items()}
                for name in wanted:
                    log(f"section {name}")
                    results.setdefault("load", {})[name] = [round(x, 1) for x in os.getloadavg()]
                    t0 = time.monotonic()
                    results[name] = section(name)(bench, log)
                    results[name + "_seconds"] = round(time.monotonic() - t0, 1)
                    write_json(args.results, results)
            finally:
                spark.stop()
    results["total_seconds"] = round(time.monotonic() - started, 1)
    if earlier:  # the earlier run, with this run's sections in place of its own
        later = {k: results[k] for k in ("command", "started", "total_seconds")}
        merged_load = {**earlier.get("load", {}), **results.get("load", {})}
        results = {**earlier, **{k: v for k, v in results.items() if k not in later}}
        results["load"] = merged_load
        results["merged"] = {**later, "sections": wanted}
    write_json(args.results, results)
    report.write(results, Path(args.doc), Path(args.plot))
    log(f"wrote {args.results}, {args.doc} in {results['total_seconds']:.0f}s")
    return 0


def write_json(path: str, results: dict[str, Any]) -> None:
    Path(path).write_text(json.dumps(results, indent=1, default=str) + "\n")


if __name__ == "__main__":
    sys.exit(main())
