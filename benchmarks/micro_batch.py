"""Small micro-batches, end to end: what the transaction adds to Spark's ``addBatch``.

Streaming queries (``availableNow``, 4 Parquet files per trigger, one Spark partition per
file: ``spark.sql.files.openCostInBytes`` is raised so Spark never packs two files into one
task) write micro-batches of 1k, 10k and 100k rows into ClickHouse four ways:

- ``baseline``: ``format("bench_baseline")``, the at-least-once data source
  (benchmarks/sinks.py: each task inserts its Arrow blocks, nothing is recorded);
- ``clickhouse_tx``: ``format("clickhouse_tx")``, mode attach;
- ``foreach_baseline``: ``foreachBatch`` calling ``df.write.format("bench_baseline").save()``;
- ``foreach_batch``: ``foreachBatch(txsink.foreach_batch(...))``.

Each round runs every sink once, in rotated order, over the same files into its own
fresh table; the first batch of a query (start-up) is left out. Figures are Spark's own
``StreamingQueryProgress.durationMs["addBatch"]``. Overheads are *paired*: per round,
p50 of a txsink sink minus p50 of its baseline in the same round; the table gives the
median (min - max) of those differences over rounds, and the p99 overhead from all
batches of all rounds. Rows of one micro-batch carry one event date (fresh data lands in
one target partition); one extra row spreads 10k-row batches over 4 monthly partitions.
"""

from __future__ import annotations

import statistics
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from benchmarks.common import Bench, percentile
from benchmarks.data import DAY0, MONTHS
from benchmarks.throughput import count_rows, create_target

SINKS = ("baseline", "clickhouse_tx", "foreach_baseline", "foreach_batch")
PAIRS = {"clickhouse_tx": "baseline", "foreach_batch": "foreach_baseline"}
FILES_PER_BATCH = 4


def stream_files(root: Path, rows: int, batches: int, spread: bool) -> str:
    """``batches`` x 4 Parquet files of ``rows / 4`` narrow rows; batch b's rows carry
    day ``DAY0 + b`` (or, ``spread``, days over 4 months)."""
    out = root / f"mb-{rows}-{'spread' if spread else 'one'}"
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(rows)
    per_file = max(1, rows // FILES_PER_BATCH)
    start = 0
    for b in range(batches):
        for f in range(FILES_PER_BATCH):
            if spread:
                days = DAY0 + rng.integers(0, 30 * MONTHS, per_file).astype("timedelta64[D]")
            else:
                days = np.full(per_file, DAY0 + np.timedelta64(b % 28, "D"))
            table = pa.table(
                {
                    "id": pa.array(np.arange(start, start + per_file, dtype=np.int64)),
                    "day": pa.array(days, pa.date32()),
                    "customer": pa.array(rng.integers(0, 100_000, per_file, dtype=np.int32)),
                    "amount": pa.array(rng.random(per_file) * 1000),
                }
            )
            # file names sort in batch order: the file source hands them out by name
            pq.write_table(table, out / f"b{b:05d}-f{f}.parquet")
            start += per_file
    return str(out)


def run_query(bench: Bench, src: str, sink: str, table: str) -> list[float]:
    """One availableNow query of ``sink`` over ``src``; addBatch ms per batch (first
    batch left out)."""
    import txsink

    spark = bench.spark
    schema = spark.read.parquet(src).schema
    df = spark.readStream.schema(schema).option("maxFilesPerTrigger", FILES_PER_BATCH).parquet(src)
    writer = (
        df.writeStream.option("checkpointLocation", str(bench.work / f"ck-{uuid.uuid4().hex}"))
        .trigger(availableNow=True)
        .queryName(f"mb_{sink}_{uuid.uuid4().hex[:6]}")
    )
    opts = bench.sink_options(table, mode="attach")
    base = {"url": bench.url, "table": table}
    if sink == "baseline":
        query = writer.format("bench_baseline").options(**base).start()
    elif sink == "clickhouse_tx":
        query = writer.format("clickhouse_tx").options(**opts).start()
    elif sink == "foreach_batch":
        query = writer.foreachBatch(txsink.foreach_batch(**opts)).start()
    else:

        def save(batch_df: Any, batch_id: int) -> None:
            batch_df.write.format("bench_baseline").options(**base).mode("append").save()

        query = writer.foreachBatch(save).start()
    query.awaitTermination()
    progress = [p for p in query.recentProgress if p.get("numInputRows")]
    return [float(p["durationMs"]["addBatch"]) for p in progress][1:]


def one_size(
    bench: Bench, rows: int, rounds: int, batches: int, spread: bool, progress: Any
) -> dict[str, Any]:
    src = stream_files(bench.work, rows, batches + 1, spread)
    per_round: dict[str, list[list[float]]] = {s: [] for s in SINKS}
    for r in range(rounds):
        order = SINKS[r % len(SINKS) :] + SINKS[: r % len(SINKS)]
        for sink in order:
            table = create_target(bench, "narrow", f"mb_{sink}")
            per_round[sink].append(run_query(bench, src, sink, table))
            landed = count_rows(bench, table)
            expected = (batches + 1) * FILES_PER_BATCH * max(1, rows // FILES_PER_BATCH)
            if landed != expected:
                raise AssertionError(f"{sink}: {landed} rows in {table}, expected {expected}")
    out: dict[str, Any] = {"rows": rows, "rounds": rounds, "batches": batches, "spread": spread}
    for sink, runs in per_round.items():
        flat = [m for run in runs for m in run]
        out[sink] = {
            "n": len(flat),
            "p50_ms": percentile(flat, 50),
            "p95_ms": percentile(flat, 95),
            "p99_ms": percentile(flat, 99),
            "round_p50_ms": [statistics.median(run) for run in runs],
        }
    for sink, base in PAIRS.items():
        diffs = [
            a - b for a, b in zip(out[sink]["round_p50_ms"], out[base]["round_p50_ms"], strict=True)
        ]
        out[f"{sink}_overhead"] = {
            "p50_ms": statistics.median(diffs),
            "min_ms": min(diffs),
            "max_ms": max(diffs),
            "p99_ms": out[sink]["p99_ms"] - out[base]["p99_ms"],
            "ratio_p50": out[sink]["p50_ms"] / out[base]["p50_ms"],
        }
    progress(
        f"  {rows:,} rows/batch{' (4 partitions)' if spread else ''}: addBatch p50 "
        + ", ".join(f"{s} {out[s]['p50_ms']:.0f}" for s in SINKS)
        + " ms; overhead p50 "
        + ", ".join(f"{s} {out[f'{s}_overhead']['p50_ms']:+.0f}" for s in PAIRS)
        + " ms"
    )
    return out


def run(bench: Bench, progress: Any) -> dict[str, Any]:
    spark = bench.spark
    spark.conf.set("spark.sql.streaming.numRecentProgressUpdates", "1000")
    old = spark.conf.get("spark.sql.files.openCostInBytes")
    spark.conf.set("spark.sql.files.openCostInBytes", str(1 << 30))  # one file per task
    quick = bench.sizes.name == "quick"
    rounds, batches = (2, 6) if quick else (3, 12)
    try:
        cases = [
            (1_000, False),
            (10_000, False),
            (100_000, False),
            (10_000, True),
        ]
        results = [one_size(bench, n, rounds, batches, spread, progress) for n, spread in cases]
    finally:
        spark.conf.set("spark.sql.files.openCostInBytes", old)
    return {"cases": results, "files_per_batch": FILES_PER_BATCH}
