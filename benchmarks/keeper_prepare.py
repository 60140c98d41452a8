"""Prepare latency of bounded Keeper nodes: ``KazooRegistry.prepare`` and ``get`` of
manifests of 100 / 1,000 / 10,000 entries (staging names as executors write them) against
a real ZooKeeper, median of 7; then ``list`` of every record written.

    PYTHONPATH=$PWD python -m benchmarks.keeper_prepare 127.0.0.1:2181

Writes under a fresh root (``/bench-<hex>``) and deletes the job at the end.
"""

from __future__ import annotations

import statistics
import sys
import time
import uuid

from tests.registry_contract import JOB, grid_record
from txsink.keeper.kazoo_registry import KazooRegistry

SHAPES = ((100, 10, 10), (1_000, 100, 10), (10_000, 200, 50))


def main(keeper: str) -> None:
    reg = KazooRegistry(keeper, f"/bench-{uuid.uuid4().hex[:8]}", timeout=10)
    try:
        epoch = reg.take_epoch(JOB, "bench")
        for entries, tasks, parts in SHAPES:
            prepares, gets = [], []
            for rep in range(7):
                record = grid_record(f"b{entries}{rep}", tasks=tasks, partitions=parts)
                t = time.perf_counter()
                stored = reg.prepare(epoch, record)
                prepares.append(time.perf_counter() - t)
                t = time.perf_counter()
                if reg.get(JOB, record.xid) != stored:
                    raise SystemExit(f"{record.xid} did not read back equal")
                gets.append(time.perf_counter() - t)
            print(
                f"{entries:>6} entries ({tasks} tasks x {parts} partitions): prepare median "
                f"{statistics.median(prepares) * 1000:.1f} ms (min {min(prepares) * 1000:.1f}, "
                f"max {max(prepares) * 1000:.1f}); get median {statistics.median(gets) * 1000:.1f}"
                f" ms; chunk nodes so far {len(reg.manifest_chunks(JOB))}"
            )
        t = time.perf_counter()
        records = reg.list(JOB)
        print(f"list of {len(records)} records: {(time.perf_counter() - t) * 1000:.1f} ms")
        reg.delete_job(JOB)
    finally:
        reg.close()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "127.0.0.1:2181")
