"""Commit overhead per batch: prepare + publish + record, for batches touching 1, 4, 16,
64 target partitions, published as the default does on a MergeTree target
(``visibility=batch``: the batch gathered into the batch staging, one ATTACH), measured two
ways (end to end in streaming queries: benchmarks/micro_batch.py).

1. ``Transactor.commit_batch`` driven directly (the protocol path alone): staging is
   created with ``ClickHouseWarehouse.create_staging`` + ``insert_blocks`` outside the
   timing; the figure is ``CommitResult.seconds`` (prepare + publish + record) and the
   wall time of the call (plus heartbeat and, every 50 batches, the prune).
2. ``txsink.committer.commit_batch`` (what Spark's driver-side ``commit`` runs, minus
   the Python worker start): borrows Keeper and ClickHouse connections (the pooled ones
   of this process after the first batch, as in Spark's reused Python workers), checks
   the run's epoch and the target's views, commits, sweeps stray staging.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import numpy as np
import pyarrow as pa

from benchmarks.common import Bench, latency_summary
from txsink import committer
from txsink.config import WriterConfig
from txsink.driver import open_job
from txsink.protocol.ids import batch_xid, run_tag, staging_name
from txsink.protocol.ops import Gathered
from txsink.protocol.states import StagedPart, Visibility
from txsink.spark import writer

PARTITIONS = (1, 4, 16, 64)
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


def config_for(bench: Bench, table: str, **options: str) -> WriterConfig:
    return WriterConfig.from_options(bench.sink_options(table, mode="attach", **options))


def transactor_path(bench: Bench, partitions: int, batches: int) -> dict[str, Any]:
    cfg = config_for(bench, commit_target(bench))
    handle = open_job(cfg)
    run_id = f"bench-{uuid.uuid4().hex[:8]}"
    try:
        handle.warehouse.ensure_staging_db()
        epoch = handle.transactor.begin(run_id)
        columns = handle.warehouse.commit_look([], views_of=cfg.table).columns
        results, walls = [], []
        for b in range(batches):
            xid = batch_xid(b)
            parts = stage(handle, run_id, xid, b, partitions)
            started = time.perf_counter()
            result = handle.transactor.commit_batch(
                epoch, xid, b, cfg.table, parts, visibility=Visibility.BATCH,
                gather={cfg.table: Gathered(columns)},
            )  # fmt: skip
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


def driver_path(
    bench: Bench, partitions: int, batches: int, *, raw: bool = False, **options: str
) -> Any:
    """``committer.commit_batch`` per batch: its latency summary (the list with ``raw``)."""
    cfg = config_for(bench, commit_target(bench), **({"visibility": "batch"} | options))
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
            committer.commit_batch(plan, [msg], b)
            if b:
                walls.append(time.perf_counter() - started)
    finally:
        handle.close()
    return walls if raw else latency_summary(walls)


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
    return out
