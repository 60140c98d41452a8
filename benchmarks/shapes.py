"""Batch ``save()`` wall time at many tasks and partition values (issue 39's shapes):
the at-least-once baseline and ``clickhouse_tx`` attach mode side by side, and the parts
each adds to the target.

    flock /tmp/txsink-heavy.lock .venv/bin/python -m benchmarks.shapes [--reps N] \\
        [--shapes 200x1,20x50] [--json]

``ROWS`` (200,000) narrow rows (``id``, ``day``, ``customer``, ``amount`` of
:mod:`benchmarks.data`, ids 0 .. ROWS-1) get a column ``p = id % P`` and are spread
round-robin over ``T`` Spark partitions (``df.repartition(T)``), so every one of the T
tasks writes rows of every one of the P partition values. The repartitioned DataFrame
is cached and counted before the saves: both sinks read the same cached partitions, and
the wall time is Spark's hand-over to the Python writers plus the sink's own work.

Each repetition, for each shape, runs both sinks in rotated order (baseline first on even
repetitions, attach first on odd ones), each into a fresh ``MergeTree PARTITION BY p ORDER
BY id`` target whose merges are stopped (``SYSTEM STOP MERGES``), so the active parts after
the save are the parts it added. After each save: ``count()`` and ``uniqExact(id)`` must
both equal ``ROWS``, the active parts are counted, and for attach mode the query log says
how the batch was published (``ATTACH PARTITION ALL`` into the target: ``visibility=batch``,
else ``partition``); the target is dropped. Attach mode gets no option beyond ``mode``
(default ``visibility=auto``), a fresh job name per save.

Reported per shape: median seconds of each sink, the paired speed ratio attach/baseline
(baseline seconds / attach seconds of the same repetition, as in the throughput section:
1.0 = as fast as the baseline) as median (min - max), and the median parts added per save.

``make bench`` runs it as the ``shapes`` section (``benchmarks/run.py``); ``make
bench-shapes`` runs it alone on a private stack.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
import uuid
from typing import Any

SHAPES = ((200, 1), (20, 50))  # (tasks, partition values), issue 39's
ROWS = 200_000
SINKS = ("baseline", "attach")
COLUMNS = "id Int64, day Date, customer Int32, amount Float64, p Int32"


def command(bench: Any, sql: str) -> Any:
    client = bench.client()
    try:
        return client.command(sql)
    finally:
        client.close()


def scalar(bench: Any, sql: str) -> int:
    return int(command(bench, sql))


def create_target(bench: Any) -> str:
    """A fresh target partitioned by ``p``, merges stopped (its parts can be counted)."""
    table = f"bench.shapes_{uuid.uuid4().hex[:8]}"
    command(bench, "CREATE DATABASE IF NOT EXISTS bench")
    command(
        bench, f"CREATE TABLE {table} ({COLUMNS}) ENGINE = MergeTree PARTITION BY p ORDER BY id"
    )
    command(bench, f"SYSTEM STOP MERGES {table}")
    return table


def active_parts(bench: Any, table: str, where: str = "1") -> int:
    db, name = table.split(".")
    return scalar(
        bench,
        f"SELECT count() FROM system.parts WHERE database = '{db}' AND table = '{name}' "
        f"AND active AND {where}",
    )


def published_by(bench: Any, table: str) -> str:
    """``batch`` when the query log holds an ``ATTACH PARTITION ALL`` into ``table`` (the
    publish of visibility=batch), else ``partition``; ``unknown`` when it cannot be read."""
    from txsink.names import qualified

    db, name = table.split(".")
    head = f"ALTER TABLE {qualified(db, name)} ATTACH PARTITION ALL".replace("'", "\\'")
    try:
        with contextlib.suppress(Exception):
            command(bench, "SYSTEM FLUSH LOGS")
        found = scalar(
            bench,
            "SELECT count() FROM system.query_log WHERE type = 'QueryFinish' "
            f"AND startsWith(query, '{head}')",
        )
    except Exception:
        return "unknown"
    return "batch" if found else "partition"


def frame(bench: Any, tasks: int, values: int, rows: int = ROWS) -> Any:
    """``rows`` narrow rows with ``p = id % values``, round-robin over ``tasks`` partitions,
    cached and counted."""
    from pyspark.sql import functions as F

    data = bench.data["narrow"]
    if data.rows < rows:
        raise RuntimeError(f"the narrow dataset has {data.rows:,} rows, {rows:,} needed")
    df = (
        bench.spark.read.parquet(data.path)
        .where(F.col("id") < rows)
        .withColumn("p", (F.col("id") % values).cast("int"))
        .repartition(tasks)
        .cache()
    )
    if df.count() != rows:
        raise RuntimeError(f"{tasks} x {values}: the DataFrame does not hold {rows:,} rows")
    return df


def save(bench: Any, df: Any, sink: str, table: str) -> None:
    """One batch write of ``df`` through ``sink`` (attach: default visibility)."""
    if sink == "baseline":
        opts = {"url": bench.url, "table": table}
        df.write.format("bench_baseline").options(**opts).mode("append").save()
        return
    job = f"shapes-{uuid.uuid4().hex[:10]}"
    opts = bench.sink_options(table, job, mode="attach")
    df.write.format("clickhouse_tx").options(**opts).mode("append").save()


def one_save(bench: Any, df: Any, sink: str, rows: int = ROWS) -> dict[str, Any]:
    """A timed save into a target of its own: seconds, parts added, how it was published."""
    from benchmarks.common import timed

    table = create_target(bench)
    try:
        before = active_parts(bench, table)
        seconds, _ = timed(lambda: save(bench, df, sink, table))
        landed = scalar(bench, f"SELECT count() FROM {table}")
        unique = scalar(bench, f"SELECT uniqExact(id) FROM {table}")
        if landed != rows or unique != rows:
            raise RuntimeError(
                f"{sink}: {landed:,} rows ({unique:,} ids) in {table}, expected {rows:,}"
            )
        out: dict[str, Any] = {
            "seconds": round(seconds, 3),
            "parts_added": active_parts(bench, table) - before,
            # level > 0: a merged part (attach: the batch staging's compaction, expected)
            "merged_parts": active_parts(bench, table, "level > 0"),
        }
        if sink == "attach":
            out["visibility"] = published_by(bench, table)
        return out
    finally:
        command(bench, f"DROP TABLE IF EXISTS {table} SYNC")


def order(rep: int) -> tuple[str, ...]:
    """The sinks of repetition ``rep``: baseline first on even ones, attach first on odd."""
    return SINKS if rep % 2 == 0 else SINKS[::-1]


def summarise(tasks: int, values: int, runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """One shape's figures from its saves (``runs[sink][rep]``)."""
    from benchmarks.common import spread

    seconds = {sink: [x["seconds"] for x in runs[sink]] for sink in SINKS}
    paired = [b / a for b, a in zip(seconds["baseline"], seconds["attach"], strict=True)]
    visibilities = sorted({x.get("visibility", "unknown") for x in runs["attach"]})
    return {
        "tasks": tasks,
        "values": values,
        "rows": ROWS,
        "reps": len(paired),
        "sinks": {
            sink: {
                "seconds": spread(seconds[sink]),
                "parts_added": statistics.median(x["parts_added"] for x in runs[sink]),
                "merged_parts": max(x["merged_parts"] for x in runs[sink]),
                "runs": runs[sink],
            }
            for sink in SINKS
        },
        "ratio": spread(paired),  # attach/baseline speed: baseline s / attach s, paired
        "visibility": ",".join(visibilities),
    }


def warm_up(bench: Any) -> None:
    """JVM, Python workers, the sinks' imports and pools, once, on a small frame."""
    df = frame(bench, 2, 2, 10_000)
    try:
        for sink in SINKS:
            one_save(bench, df, sink, 10_000)
    finally:
        df.unpersist()


def measure(
    bench: Any,
    shapes: tuple[tuple[int, int], ...] = SHAPES,
    reps: int = 3,
    progress: Any = None,
) -> dict[str, Any]:
    warm_up(bench)
    frames = {shape: frame(bench, *shape) for shape in shapes}
    runs: dict[tuple[int, int], dict[str, list[dict[str, Any]]]] = {
        shape: {sink: [] for sink in SINKS} for shape in shapes
    }
    try:
        for rep in range(reps):
            for shape in shapes:
                for sink in order(rep):
                    x = one_save(bench, frames[shape], sink)
                    runs[shape][sink].append(x)
                    if progress:
                        vis = f" visibility={x['visibility']}" if "visibility" in x else ""
                        progress(
                            f"  rep {rep + 1} {shape[0]} x {shape[1]} {sink:8s} "
                            f"{x['seconds']:6.2f} s, {x['parts_added']} parts added{vis}"
                        )
    finally:
        for df in frames.values():
            df.unpersist()
    return {
        "rows": ROWS,
        "reps": reps,
        "shapes": [summarise(t, p, runs[(t, p)]) for t, p in shapes],
    }


def table(out: dict[str, Any]) -> list[str]:
    """The markdown table of :func:`measure`'s result."""
    lines = [
        "| tasks x partition values | baseline s | attach s | attach/baseline, paired "
        "median (min - max) | parts added: baseline | attach | attach visibility |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in out["shapes"]:
        b, a, r = s["sinks"]["baseline"], s["sinks"]["attach"], s["ratio"]
        merged = f" ({b['merged_parts']:g} merged)" if b.get("merged_parts") else ""
        lines.append(
            f"| {s['tasks']} x {s['values']} | {b['seconds']['median']:.2f} | "
            f"{a['seconds']['median']:.2f} | {r['median']:.3f} ({r['min']:.3f} - "
            f"{r['max']:.3f}) | {b['parts_added']:g}{merged} | {a['parts_added']:g} | "
            f"{s['visibility']} |"
        )
    return lines


def run(bench: Any, progress: Any) -> dict[str, Any]:
    """The ``shapes`` section of ``make bench``."""
    return measure(bench, SHAPES, bench.sizes.reps, progress)


def parse_shapes(text: str) -> tuple[tuple[int, int], ...]:
    """``"200x1,20x50"`` -> ``((200, 1), (20, 50))``."""
    return tuple((int(t), int(p)) for t, p in (s.strip().split("x") for s in text.split(",") if s))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks.shapes", description=__doc__)
    parser.add_argument("--reps", type=int, default=3, help="repetitions (default 3)")
    parser.add_argument("--shapes", default=",".join(f"{t}x{p}" for t, p in SHAPES))
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args(argv)
    import dataclasses
    import logging

    from benchmarks import data
    from benchmarks.common import QUICK, Bench, private_stack, scratch_dir, spark_session

    logging.getLogger("txsink").setLevel(logging.ERROR)
    shapes = parse_shapes(args.shapes)
    progress = None if args.json else (lambda m: print(m, file=sys.stderr, flush=True))
    started = time.monotonic()
    with scratch_dir("txsink-shapes-") as work, private_stack(work / "stack") as info:
        spark = spark_session()
        sizes = dataclasses.replace(QUICK, reps=args.reps)
        bench = Bench(info.url, info.keeper, spark, sizes, work)
        try:
            bench.data["narrow"] = data.generate("narrow", work / "data", ROWS, 2)
            out = measure(bench, shapes, args.reps, progress)
        finally:
            from txsink.driver import close_pooled

            spark.stop()
            close_pooled()  # before the stack stops: kazoo would retry its ZooKeeper
    out["seconds"] = round(time.monotonic() - started, 1)
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        print(
            f"batch save() of {ROWS:,} narrow rows, median of {args.reps} paired "
            f"repetition(s) ({out['seconds']:.0f} s)"
        )
        print("\n".join(table(out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
