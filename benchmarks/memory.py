"""Peak RSS of the executor's Python worker writing one big partition vs one 10x smaller.

The rows (``id``, ``day``, a ~1 KB string ``payload``) are generated inside the JVM by
``spark.range`` in ONE partition, so one Python worker receives the whole partition. A
sampler thread reads ``VmRSS`` of every PySpark Python process under this driver every
``SAMPLE_SECONDS``; the figure is the largest single-process RSS seen during the write.
txsink streams blocks of ``block_rows`` / ``block_bytes`` (default 256 MiB), so the peak
should not grow with the partition. Workers are reused across tasks (Spark's default), so
the small partition runs first: memory it leaves allocated can only inflate the big
partition's figure, never hide growth.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from benchmarks.common import MIB, Bench, timed

SAMPLE_SECONDS = 0.05
PAYLOAD = 1000  # bytes of the string column per row
ROW_BYTES = PAYLOAD + 8 + 4 + 4  # Arrow: payload + offset, id, day
DDL = (
    "CREATE TABLE {table} (id Int64, day Date, payload String) ENGINE = MergeTree "
    "PARTITION BY toYYYYMM(day) ORDER BY id"
)


def _parent(pid: str) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[1])


def pyspark_workers(root: int) -> list[int]:
    """PySpark Python processes descending from ``root`` (daemon and forked workers)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                parents[int(entry)] = _parent(entry)
            except (OSError, IndexError, ValueError):
                continue
    found, frontier = set(), {root}
    while frontier:
        frontier = {pid for pid, ppid in parents.items() if ppid in frontier} - found
        found |= frontier
    out = []
    for pid in found:
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        exe = Path(cmd.split(b"\0")[0].decode(errors="replace")).name
        if exe.startswith("python") and b"pyspark" in cmd:
            out.append(pid)
    return out


def rss_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class Sampler(threading.Thread):
    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak = 0
        self.stop = threading.Event()

    def run(self) -> None:
        me = os.getpid()
        while not self.stop.is_set():
            for pid in pyspark_workers(me):
                self.peak = max(self.peak, rss_bytes(pid))
            self.stop.wait(SAMPLE_SECONDS)


def one_write(bench: Bench, nbytes: int, sink: str) -> dict[str, Any]:
    rows = nbytes // ROW_BYTES
    df = bench.spark.range(0, rows, numPartitions=1).selectExpr(
        "id",
        "date_add(DATE'2024-01-01', CAST(id % 120 AS INT)) AS day",
        f"concat(CAST(id AS STRING), repeat('x', {PAYLOAD} - length(CAST(id AS STRING)))) "
        "AS payload",
    )
    table = f"bench.memory_{uuid.uuid4().hex[:6]}"
    client = bench.client()
    client.command(DDL.format(table=table))
    sampler = Sampler()
    sampler.start()
    if sink == "noop":
        seconds, _ = timed(lambda: df.write.format("bench_noop").mode("append").save())
    else:
        opts = bench.sink_options(table, mode="attach")
        seconds, _ = timed(
            lambda: df.write.format("clickhouse_tx").options(**opts).mode("append").save()
        )
    time.sleep(3 * SAMPLE_SECONDS)
    sampler.stop.set()
    sampler.join()
    landed = int(client.command(f"SELECT count() FROM {table}"))
    client.command(f"DROP TABLE {table} SYNC")
    client.close()
    if sink != "noop" and landed != rows:
        raise RuntimeError(f"memory bench: {landed} rows landed, expected {rows}")
    return {
        "sink": sink,
        "partition_mb": rows * ROW_BYTES / MIB,
        "rows": rows,
        "seconds": seconds,
        "peak_rss_mb": sampler.peak / MIB,
    }


def run(bench: Bench, progress: Any) -> dict[str, Any]:
    big = bench.sizes.memory_big_bytes
    runs = [
        one_write(bench, big // 10, "noop"),
        one_write(bench, big // 10, "attach"),
        one_write(bench, big, "attach"),
    ]
    for r in runs:
        progress(
            f"  {r['sink']:6s} {r['partition_mb']:8,.0f} MiB partition: peak worker RSS "
            f"{r['peak_rss_mb']:6,.0f} MiB ({r['seconds']:.1f}s)"
        )
    small, large = runs[1]["peak_rss_mb"], runs[2]["peak_rss_mb"]
    return {"runs": runs, "block_bytes_mb": 256, "growth": large / small if small else None}
