"""Commit latency of visibility=batch vs visibility=partition (p50/p99) on a running stack.

    txsink embedded up --json        # note url and keeper
    PYTHONPATH=. python benchmarks/visibility_latency.py URL KEEPER [BATCHES]

For 1, 4 and 16 target partitions per batch (2 task staging tables each, 50 rows per task
and partition), runs BATCHES commits through tests/integration/visibility_driver.py (the
Transactor's own publish path) and prints p50/p99 of commit_batch (prepare + publish +
record + drops). Not part of `make test`.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import uuid
from pathlib import Path

import clickhouse_connect

DRIVER = Path(__file__).parents[1] / "tests" / "integration" / "visibility_driver.py"


def main() -> None:
    url, keeper = sys.argv[1], sys.argv[2]
    n = int(sys.argv[3]) if len(sys.argv) > 3 else 40
    host, port = url.rsplit("/", 1)[-1].split(":")
    ch = clickhouse_connect.get_client(host=host, port=int(port))
    db = f"bench_{uuid.uuid4().hex[:8]}"
    ch.command(f"CREATE DATABASE {db}")
    print(f"{'visibility':<10} {'partitions':>10} {'p50 ms':>8} {'p99 ms':>8}")
    try:
        for parts in (1, 4, 16):
            for vis in ("partition", "batch"):
                table = f"{db}.t_{vis}_{parts}"
                ch.command(
                    f"CREATE TABLE {table} (p UInt32, b UInt32, x UInt64) ENGINE = MergeTree "
                    f"PARTITION BY p ORDER BY x"
                )
                job = f"bench-{uuid.uuid4().hex[:8]}"
                out = subprocess.run(
                    [sys.executable, str(DRIVER), url, keeper, job, table, vis, "0", str(n),
                     str(parts), "2"],
                    capture_output=True, text=True, check=True,
                )  # fmt: skip
                lat = sorted(json.loads(out.stdout.splitlines()[-1])["latencies"][1:])
                p50 = statistics.median(lat) * 1000
                p99 = lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1000
                print(f"{vis:<10} {parts:>10} {p50:>8.1f} {p99:>8.1f}")
    finally:
        ch.command(f"DROP DATABASE IF EXISTS {db} SYNC")


if __name__ == "__main__":
    main()
