"""Throughput of four sinks, side by side, on the same Parquet data (batch ``save()``).

(a) ``bench_noop`` (Spark's ceiling), (b) ``bench_baseline`` (at-least-once
``insert_arrow``), (c) ``clickhouse_tx`` mode=attach, (d) ``clickhouse_tx`` mode=dedup.
Each repetition runs every sink once (rotating the order), each write into a fresh target
(created before, row count checked and dropped after). Ratios are taken per repetition (paired,
so they share the machine's noise) and summarised by median and range.
"""

from __future__ import annotations

import statistics
import uuid
from typing import Any

from benchmarks.common import MIB, Bench, spread, timed
from benchmarks.data import Dataset, target_ddl

SINKS = ("noop", "baseline", "attach", "dedup")
RATIOS = {
    "attach/baseline": ("attach", "baseline"),
    "dedup/baseline": ("dedup", "baseline"),
    "attach/noop": ("attach", "noop"),
    "baseline/noop": ("baseline", "noop"),
}


def create_target(bench: Bench, schema: str, name: str | None = None) -> str:
    table = f"bench.{name or schema}_{uuid.uuid4().hex[:6]}"
    client = bench.client()
    try:
        client.command("CREATE DATABASE IF NOT EXISTS bench")
        client.command(target_ddl(table, schema))
    finally:
        client.close()
    return table


def save(bench: Bench, df: Any, sink: str, table: str, job: str, **extra: str) -> None:
    """One batch write of ``df`` through ``sink``."""
    if sink == "noop":
        df.write.format("bench_noop").mode("append").save()
        return
    if sink == "baseline":
        opts = {"url": bench.url, "table": table, **extra}
        df.write.format("bench_baseline").options(**opts).mode("append").save()
        return
    opts = bench.sink_options(table, job, mode=sink, **extra)
    df.write.format("clickhouse_tx").options(**opts).mode("append").save()


def count_rows(bench: Bench, table: str) -> int:
    client = bench.client()
    try:
        return int(client.command(f"SELECT count() FROM {table}"))
    finally:
        client.close()


def truncate(bench: Bench, table: str) -> None:
    client = bench.client()
    try:
        client.command(f"TRUNCATE TABLE {table} SYNC")
    finally:
        client.close()


def drop(bench: Bench, table: str) -> None:
    client = bench.client()
    try:
        client.command(f"DROP TABLE IF EXISTS {table} SYNC")
    finally:
        client.close()


def one_write(bench: Bench, df: Any, data: Dataset, sink: str, job: str) -> float:
    """One timed write into a table of its own, created before and dropped after (not a
    TRUNCATE: after one, a dedup-mode writer reads the table's block counter as 0 on an
    empty table and then sees it jump by every block ever inserted, a false "window
    exceeded" refusal)."""
    table = create_target(bench, data.schema)
    try:
        seconds, _ = timed(lambda: save(bench, df, sink, table, job))
        if sink != "noop":
            landed = count_rows(bench, table)
            if landed != data.rows:
                raise RuntimeError(f"{sink}: {landed} rows in {table}, expected {data.rows}")
    finally:
        drop(bench, table)
    return seconds


def warm_up(bench: Bench, data: Dataset) -> None:
    """JVM, Python workers and the server's caches, once, on a small slice."""
    df = bench.spark.read.parquet(data.path).limit(200_000)
    table = create_target(bench, data.schema, "warm")
    for sink in SINKS:
        save(bench, df, sink, table, f"warm-{uuid.uuid4().hex[:8]}")


def measure_schema(bench: Bench, data: Dataset, progress: Any) -> dict[str, Any]:
    df = bench.spark.read.parquet(data.path)
    runs: dict[str, list[float]] = {sink: [] for sink in SINKS}
    save(bench, df, "noop", "", "")  # untimed: the first full scan of these files
    for rep in range(bench.sizes.reps):
        order = SINKS[rep % len(SINKS) :] + SINKS[: rep % len(SINKS)]
        for sink in order:
            job = f"tp-{data.schema}-{sink}-{uuid.uuid4().hex[:6]}"
            seconds = one_write(bench, df, data, sink, job)
            runs[sink].append(seconds)
            progress(
                f"  {data.schema:6s} rep {rep + 1} {sink:8s} {seconds:7.2f}s "
                f"{data.rows / seconds:12,.0f} rows/s"
            )
    return summarise(data, runs, df.rdd.getNumPartitions())


def summarise(data: Dataset, runs: dict[str, list[float]], partitions: int) -> dict[str, Any]:
    sinks = {
        sink: {
            "seconds": secs,
            "rows_per_s": spread([data.rows / s for s in secs]),
            "mb_per_s": spread([data.arrow_bytes / MIB / s for s in secs]),
        }
        for sink, secs in runs.items()
    }
    ratios = {}
    for name, (num, den) in RATIOS.items():
        paired = [d / n for n, d in zip(runs[num], runs[den], strict=True)]  # time ratio inverted
        ratios[name] = {
            **spread(paired),
            "of_medians": statistics.median(runs[den]) / statistics.median(runs[num]),
        }
    return {
        "rows": data.rows,
        "columns": data.columns,
        "arrow_mb": data.arrow_bytes / MIB,
        "files": data.files,
        "spark_partitions": partitions,
        "sinks": sinks,
        "ratios": ratios,
    }


def run(bench: Bench, progress: Any) -> dict[str, Any]:
    warm_up(bench, bench.data["narrow"])
    return {schema: measure_schema(bench, data, progress) for schema, data in bench.data.items()}
