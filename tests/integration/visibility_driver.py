"""A driver process for the visibility tests and benchmark: stages ``tasks`` staging
tables per batch, each with rows in ``partitions`` target partitions (every row carries
its batch id ``b``), and commits them through :meth:`Transactor.commit_batch`, the same
publish code a Spark job runs. Fault points (``TXSINK_FAULT``) make it exit hard.

    python visibility_driver.py URL KEEPER JOB TABLE VISIBILITY FIRST COUNT PARTITIONS TASKS
"""

from __future__ import annotations

import json
import os
import sys
import time

from txsink.clickhouse.insert_settings import STAGING_INSERT_SETTINGS
from txsink.config import WriterConfig
from txsink.driver import open_job
from txsink.names import qualified
from txsink.protocol.ids import batch_xid, run_tag, staging_name
from txsink.protocol.ops import Gathered
from txsink.protocol.states import Mode, StagedPart, Visibility

ROWS = 50  # per task and partition


def main(argv: list[str]) -> None:
    url, keeper, job, table, visibility = argv[:5]
    first, count, partitions, tasks = (int(a) for a in argv[5:9])
    config = WriterConfig.from_options({"url": url, "keeper": keeper, "job": job, "table": table})
    handle = open_job(config)
    tx, wh = handle.transactor, handle.warehouse
    wh.ensure_staging_db()
    owner = f"driver-{os.getpid()}"
    epoch = tx.begin(owner, meta={"target": table, "mode": "attach"})
    run = run_tag(owner)
    latencies = []
    for b in range(first, first + count):
        parts = []
        for k in range(tasks):
            name = staging_name(job, batch_xid(b), run, k, 0, b * 100 + k, tx.namespace).table
            wh.create_staging(table, name)
            wh.client.command(
                f"INSERT INTO {qualified(wh.staging_db, name)} (p, b, x) SELECT number % "
                f"{partitions}, {b}, {k * 1_000_000} + number FROM numbers({ROWS * partitions})",
                settings=dict(STAGING_INSERT_SETTINGS),
                idempotent=False,
            )
            for pid, (rows, uuids) in sorted(wh.staged_partitions(name).items()):
                parts.append(StagedPart(name, pid, rows, uuids=uuids))
        shown = Visibility.BATCH if visibility == "batch" else Visibility.PARTITION
        t0 = time.perf_counter()
        tx.commit_batch(
            epoch, batch_xid(b), b, table, parts, Mode.ATTACH, streaming=True, visibility=shown,
            gather={table: Gathered(("p", "b", "x"))},  # a small batch of a plain MergeTree
        )  # fmt: skip
        latencies.append(time.perf_counter() - t0)
    handle.close()
    print(json.dumps({"latencies": latencies}))


if __name__ == "__main__":
    main(sys.argv[1:])
