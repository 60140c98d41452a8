"""Sharded writes (issue 11): one xid across 1, 2 and 3 shards, side by side.

A cluster of its own (``txsink embedded up --shards 3``: three chdb endpoints, each its
own engine, data directory and port, and one ZooKeeper) next to the run's stack. On a
2-core machine every shard shares the same two cores, so this shows what sharding
*costs*, not how it scales: rows/s in total and per shard, and the commit of one batch
whose staging lies on k shards.

1. Throughput: batch ``save()`` of the narrow dataset with ``clickhouse_tx`` (attach,
   ``shard_by=id``) into the first k shards, for k = 1, 2, 3, in rotated order per
   repetition, each into fresh tables (row counts checked over the shards).
2. Commit: ``Transactor.commit_batch`` of batches staged on k shards (1,000 rows in one
   partition per shard), p50/p99 of ``CommitResult.seconds``.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from benchmarks.common import Bench, free_port, latency_summary, spread, timed
from benchmarks.data import target_ddl
from txsink.config import WriterConfig
from txsink.driver import open_job
from txsink.protocol.ids import batch_xid, run_tag, staging_name
from txsink.protocol.states import StagedPart

SHARD_COUNTS = (1, 2, 3)


def _client(url: str) -> Any:
    import clickhouse_connect

    host, port = url.rsplit("/", 1)[-1].split(":")
    return clickhouse_connect.get_client(host=host, port=int(port), autogenerate_session_id=False)


def on_every_shard(urls: list[str], *sql: str) -> None:
    for url in urls:
        client = _client(url)
        try:
            for statement in sql:
                client.command(statement)
        finally:
            client.close()


def rows_per_shard(urls: list[str], table: str) -> list[int]:
    out = []
    for url in urls:
        client = _client(url)
        try:
            out.append(int(client.command(f"SELECT count() FROM {table}")))
        finally:
            client.close()
    return out


def throughput(bench: Bench, urls: list[str], keeper: str, progress: Any) -> dict[str, Any]:
    data = bench.data["narrow"]
    df = bench.spark.read.parquet(data.path)
    runs: dict[int, list[float]] = {k: [] for k in SHARD_COUNTS}
    per_shard: dict[int, list[int]] = {}
    for rep in range(max(1, bench.sizes.reps - 1)):
        order = SHARD_COUNTS[rep % 3 :] + SHARD_COUNTS[: rep % 3]
        for k in order:
            shards = urls[:k]
            table = f"bench.sh_{uuid.uuid4().hex[:8]}"
            on_every_shard(
                shards, "CREATE DATABASE IF NOT EXISTS bench", target_ddl(table, "narrow")
            )
            options = {
                "shards": ",".join(shards),
                "keeper": keeper,
                "table": table,
                "job": f"sh-{uuid.uuid4().hex[:8]}",
                "mode": "attach",
                "shard_by": "id",
            }
            seconds, _ = timed(
                lambda o=options: (
                    df.write.format("clickhouse_tx").options(**o).mode("append").save()
                )
            )
            counts = rows_per_shard(shards, table)
            if sum(counts) != data.rows:
                raise AssertionError(f"{k} shards: {counts} rows, expected {data.rows}")
            per_shard[k] = counts
            on_every_shard(shards, f"DROP TABLE IF EXISTS {table} SYNC")
            runs[k].append(seconds)
            progress(
                f"  {k} shard(s) rep {rep + 1}: {seconds:.2f}s {data.rows / seconds:,.0f} rows/s"
            )
    return {
        str(k): {
            "rows_per_s": spread([data.rows / s for s in secs]),
            "rows_per_s_per_shard": spread([data.rows / s / k for s in secs]),
            "rows_on_each_shard": per_shard[k],
            "seconds": secs,
        }
        for k, secs in runs.items()
    }


def commit(urls: list[str], keeper: str, batches: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k in SHARD_COUNTS:
        shards = urls[:k]
        table = f"bench.shc_{uuid.uuid4().hex[:8]}"
        on_every_shard(
            shards,
            "CREATE DATABASE IF NOT EXISTS bench",
            f"CREATE TABLE {table} (id Int64, p UInt8) ENGINE = MergeTree PARTITION BY p "
            "ORDER BY id",
        )
        config = WriterConfig.from_options(
            {
                "shards": ",".join(shards),
                "keeper": keeper,
                "table": table,
                "job": f"shc-{k}-{uuid.uuid4().hex[:6]}",
            }
        )
        handle = open_job(config)
        results = []
        try:
            handle.warehouse.ensure_staging_db()
            epoch = handle.transactor.begin("bench")
            for b in range(batches + 1):
                xid = batch_xid(b)
                parts: list[StagedPart] = []
                for s in range(k):
                    name = staging_name(
                        config.job,
                        xid,
                        run_tag("bench"),
                        0,
                        0,
                        b,
                        handle.transactor.namespace,
                        shard=s,
                    ).table
                    handle.warehouse.create_staging(table, name)
                    block = pa.table(
                        {
                            "id": pa.array(np.arange(1000, dtype=np.int64) + b * 1000),
                            "p": pa.array(np.zeros(1000, dtype=np.uint8)),
                        }
                    )
                    handle.warehouse.insert_blocks(
                        name, [block.to_batches()[0]], block_rows=10**6, block_bytes=10**9
                    )
                    parts += [
                        StagedPart(name, pid, n, uuids=u)
                        for pid, (n, u) in handle.warehouse.staged_partitions(name).items()
                    ]
                result = handle.transactor.commit_batch(epoch, xid, b, table, parts, streaming=True)
                if b:
                    results.append(result.seconds)
        finally:
            handle.close()
            on_every_shard(shards, f"DROP TABLE IF EXISTS {table} SYNC")
        out[str(k)] = latency_summary(results)
    return out


def run(bench: Bench, progress: Any) -> dict[str, Any]:
    from txsink.embedded import stack as embedded

    root = Path(bench.work) / "cluster"
    base = free_port()
    while any(not _free(base + i) for i in range(len(SHARD_COUNTS))):
        base = free_port()
    info = embedded.up(root, base, free_port(), timeout=120, shards=max(SHARD_COUNTS))
    try:
        urls = list(info.shards)
        out = {"throughput": throughput(bench, urls, info.keeper, progress)}
        out["commit"] = commit(urls, info.keeper, bench.sizes.commit_batches // 2)
        for k, c in out["commit"].items():
            progress(
                f"  commit over {k} shard(s): p50 {c['p50_ms']:.1f} ms, p99 {c['p99_ms']:.1f} ms"
            )
        return out
    finally:
        embedded.down(root)


def _free(port: int) -> bool:
    import socket

    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
