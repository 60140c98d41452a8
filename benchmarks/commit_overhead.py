"""Commit overhead per batch: prepare + publish + record, for batches touching 1, 4, 16
target partitions, measured three ways.

1. ``Transactor.commit_batch`` driven directly (the protocol path alone): staging is
   created with ``ClickHouseWarehouse.create_staging`` + ``insert_blocks`` outside the
   timing; the figure is ``CommitResult.seconds`` (prepare + publish + record) and the
   wall time of the call (plus heartbeat and, every 50 batches, the prune).
2. ``txsink.spark.writer.commit_batch`` (what Spark's driver-side ``commit`` runs, minus
   the Python worker start): opens Keeper and ClickHouse, checks the run's epoch,
   commits, sweeps stray staging, closes.
3. End to end in a streaming query (``availableNow`` over small Parquet files, one file
   per micro-batch): Spark's ``addBatch`` duration per batch for clickhouse_tx vs the
   at-least-once baseline, and the prepare-to-COMMITTED window recorded in Keeper.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from benchmarks.common import Bench, latency_summary
from benchmarks.data import generate
from benchmarks.throughput import create_target
from txsink.config import WriterConfig
from txsink.driver import open_job
from txsink.protocol.ids import batch_xid, run_tag, staging_name
from txsink.protocol.states import StagedPart
from txsink.spark import writer

PARTITIONS = (1, 4, 16)
ROWS_PER_PARTITION = 1000
COMMIT_DDL = (
    "CREATE TABLE {table} (id Int64, p UInt8) ENGINE = MergeTree PARTITION BY p ORDER BY id"
)


def commit_target(bench: Bench) -> str:
    table = f"bench.commit_{uuid.uuid4().hex[:6]}"
    client = bench.client()
    try:
        client.command("CREATE DATABASE IF NOT EXISTS bench")
        client.command(COMMIT_DDL.format(table=table))
    finally:
        client.close()
    return table


def stage(handle: Any, run_id: str, xid: str, tid: int, partitions: int) -> list[StagedPart]:
    """One task attempt's staging table holding ``partitions`` partitions (not timed)."""
    cfg = handle.config
    name = staging_name(cfg.job, xid, run_tag(run_id), 0, 0, tid, handle.transactor.namespace).table
    handle.warehouse.create_staging(cfg.table, name)
    n = partitions * ROWS_PER_PARTITION
    block = pa.table(
        {
            "id": pa.array(np.arange(n, dtype=np.int64)),
            "p": pa.array(np.repeat(np.arange(partitions, dtype=np.uint8), ROWS_PER_PARTITION)),
        }
    )
    handle.warehouse.insert_blocks(
        name, [block.to_batches()[0]], block_rows=cfg.block_rows, block_bytes=cfg.block_bytes
    )
    view = handle.warehouse.staging_view([name])[name] or {}
    return [StagedPart(name, pid, rows) for pid, rows in sorted(view.items())]


def config_for(bench: Bench, table: str) -> WriterConfig:
    return WriterConfig.from_options(bench.sink_options(table, mode="attach"))


def transactor_path(bench: Bench, partitions: int, batches: int) -> dict[str, Any]:
    cfg = config_for(bench, commit_target(bench))
    handle = open_job(cfg)
    run_id = f"bench-{uuid.uuid4().hex[:8]}"
    try:
        handle.warehouse.ensure_staging_db()
        epoch = handle.transactor.begin(run_id)
        results, walls = [], []
        for b in range(batches):
            xid = batch_xid(b)
            parts = stage(handle, run_id, xid, b, partitions)
            started = time.perf_counter()
            result = handle.transactor.commit_batch(epoch, xid, b, cfg.table, parts)
            walls.append(time.perf_counter() - started)
            results.append(result)
    finally:
        handle.close()
    out = {
        "commit": latency_summary([r.seconds for r in results]),
        "wall": latency_summary(walls),
    }
    for step in results[0].timings:
        out[step] = latency_summary([r.timings[step] for r in results])
    return out


def driver_path(bench: Bench, partitions: int, batches: int) -> dict[str, Any]:
    cfg = config_for(bench, commit_target(bench))
    plan = writer.WritePlan(cfg, "attach", run_id="")
    run_id = f"bench-{uuid.uuid4().hex[:8]}"
    handle = open_job(cfg)
    walls = []
    try:
        handle.warehouse.ensure_staging_db()
        for b in range(batches + 1):  # batch 0 takes the epoch (takeover): not counted
            xid = batch_xid(b)
            parts = stage(handle, run_id, xid, b, partitions)
            msg = writer.TxCommitMessage(
                run_id, xid, b, tuple(parts), (parts[0].table,), rows=sum(p.rows for p in parts)
            )
            started = time.perf_counter()
            writer.commit_batch(plan, [msg], b)
            if b:
                walls.append(time.perf_counter() - started)
    finally:
        handle.close()
    return latency_summary(walls)


# ------------------------------------------------------------------ streaming, end to end


def stream_files(bench: Bench, rows_per_file: int = 10_000) -> str:
    ds = generate(
        "narrow",
        bench.work / "stream",
        bench.sizes.stream_batches * rows_per_file,
        bench.sizes.stream_batches,
        seed=5,
    )
    return ds.path


def run_stream(bench: Bench, src: str, fmt: str, options: dict[str, str]) -> list[dict[str, Any]]:
    """availableNow, one file per micro-batch; Spark's progress of every batch."""
    spark = bench.spark
    schema = spark.read.parquet(src).schema
    df = spark.readStream.schema(schema).option("maxFilesPerTrigger", 1).parquet(src)
    ckpt = Path(bench.work) / f"ckpt-{uuid.uuid4().hex[:8]}"
    query = (
        df.writeStream.format(fmt)
        .options(**options)
        .option("checkpointLocation", str(ckpt))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()
    return [p for p in query.recentProgress if p.get("numInputRows")]


def add_batch_ms(progress: list[dict[str, Any]]) -> list[float]:
    return [float(p["durationMs"]["addBatch"]) for p in progress]


def streaming_e2e(bench: Bench, progress_log: Any) -> dict[str, Any]:
    src = stream_files(bench)
    out: dict[str, Any] = {}
    spark = bench.spark
    spark.conf.set("spark.sql.streaming.numRecentProgressUpdates", "1000")
    for name, fmt in (("baseline", "bench_baseline"), ("attach", "clickhouse_tx")):
        table = create_target(bench, "narrow", f"stream_{name}")
        opts = {"url": bench.url, "table": table}
        job = f"stream-{uuid.uuid4().hex[:8]}"
        if fmt == "clickhouse_tx":
            opts = bench.sink_options(table, job, mode="attach")
        ms = add_batch_ms(run_stream(bench, src, fmt, opts))[1:]  # first batch: start-up
        out[name] = latency_summary([m / 1000 for m in ms])
        if fmt == "clickhouse_tx":
            out["keeper_window"] = keeper_window(bench, table, job)
        progress_log(
            f"  streaming {name}: {len(ms)} batches, addBatch p50 {out[name]['p50_ms']:.0f} ms"
        )
    out["overhead_p50_ms"] = out["attach"]["p50_ms"] - out["baseline"]["p50_ms"]
    return out


def keeper_window(bench: Bench, table: str, job: str) -> dict[str, Any]:
    """prepare (record created) to COMMITTED, from the xid records in Keeper."""
    from txsink.driver import open_registry

    registry = open_registry(WriterConfig.from_options(bench.sink_options(table, job)))
    try:
        records = registry.list(job)
    finally:
        registry.close()
    windows = [r.committed_at - r.created_at for r in records if r.committed_at]
    return latency_summary(windows[1:])


def run(bench: Bench, progress: Any) -> dict[str, Any]:
    n = bench.sizes.commit_batches
    out: dict[str, Any] = {"batches": n, "rows_per_partition": ROWS_PER_PARTITION}
    for k in PARTITIONS:
        out[f"transactor_{k}"] = transactor_path(bench, k, n)
        out[f"driver_{k}"] = driver_path(bench, k, n)
        progress(
            f"  {k:2d} partitions: Transactor p50/p99 "
            f"{out[f'transactor_{k}']['commit']['p50_ms']:.1f}/"
            f"{out[f'transactor_{k}']['commit']['p99_ms']:.1f} ms, driver commit p50/p99 "
            f"{out[f'driver_{k}']['p50_ms']:.1f}/{out[f'driver_{k}']['p99_ms']:.1f} ms"
        )
    out["streaming"] = streaming_e2e(bench, progress)
    return out
