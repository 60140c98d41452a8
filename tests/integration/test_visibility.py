"""visibility=batch on the real engine: a reader polling the target in its own HTTP session,
as fast as it can, never sees part of a batch, across a crash at every driver fault point
(and a kill -9) and its roll-forward. With visibility=partition the same reader is
expected to catch partial batches (counted and printed, not asserted)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.integration.conftest import client_for
from txsink.config import WriterConfig
from txsink.errors import ConfigError

DRIVER = Path(__file__).with_name("visibility_driver.py")
PARTITIONS, TASKS, ROWS = 4, 2, 50
FULL = PARTITIONS * TASKS * ROWS
FAULTS = (
    "driver.before_prepare",
    "driver.after_prepare",
    "driver.after_batch_create",
    "driver.after_copy",
    "driver.before_attach",
    "driver.after_attach",
    "driver.after_commit",
    "driver.after_record",
)


class Reader:
    """Polls ``SELECT b, count()`` in a separate session; notes every partial batch."""

    def __init__(self, stack: Any, table: str) -> None:
        self.client = client_for(stack)
        self.table = table
        self.partial: list[tuple[int, int]] = []
        self.polls = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            rows = self.client.query(f"SELECT b, count() FROM {self.table} GROUP BY b").result_rows
            self.polls += 1
            self.partial += [(int(b), int(n)) for b, n in rows if n != FULL]

    def __enter__(self) -> Reader:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self.client.close()


def drive(
    stack: Any, job: str, table: str, vis: str, first: int, count: int, fault: str = ""
) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, TXSINK_FAULT=fault) if fault else dict(os.environ)
    env.pop("TXSINK_FAULT", None) if not fault else None
    args = [stack.url, stack.keeper, job, table, vis, first, count, PARTITIONS, TASKS]
    return subprocess.run(
        [sys.executable, str(DRIVER), *map(str, args)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def make_target(ch: Any, db: str) -> str:
    ch.command(
        f"CREATE TABLE {db}.t (p UInt32, b UInt32, x UInt64) ENGINE = MergeTree "
        f"PARTITION BY p ORDER BY x"
    )
    return f"{db}.t"


def batches(ch: Any, table: str) -> dict[int, int]:
    return {
        int(b): int(n)
        for b, n in ch.query(f"SELECT b, count() FROM {table} GROUP BY b").result_rows
    }


# `make test` crashes the batch at the points around the copy and the ATTACH (copied,
# attached, recorded); `make test-slow` after every statement of the publish.
KEY_FAULTS = ("driver.after_copy", "driver.after_attach", "driver.after_commit")


@pytest.mark.parametrize(
    "faults",
    [
        pytest.param(KEY_FAULTS, id="key-points"),
        pytest.param(FAULTS, id="every-point", marks=pytest.mark.slow),
    ],
)
def test_batch_visibility_never_shows_part_of_a_batch_across_a_crash_at_every_fault_point(
    stack: Any, ch: Any, fresh_db: str, faults: tuple[str, ...]
) -> None:
    table = make_target(ch, fresh_db)
    job = f"vis-{uuid.uuid4().hex[:8]}"
    b = 0
    with Reader(stack, table) as reader:
        assert drive(stack, job, table, "batch", b, 3).returncode == 0
        b += 3
        for fault in faults:
            crashed = drive(stack, job, table, "batch", b, 1, fault)
            assert crashed.returncode == 137, (fault, crashed.stderr[-2000:])
            again = drive(stack, job, table, "batch", b, 2)  # restart: recover, replay b
            assert again.returncode == 0, (fault, again.stderr[-2000:])
            b += 2
        proc = subprocess.Popen(  # kill -9 somewhere in a stream of batches
            [sys.executable, str(DRIVER), stack.url, stack.keeper, job, table, "batch",
             str(b), "20", str(PARTITIONS), str(TASKS)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        time.sleep(2.5)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        done = max(batches(ch, table), default=-1) + 1
        assert drive(stack, job, table, "batch", done, 2).returncode == 0
    print(f"\nbatch visibility: {reader.polls} polls, {len(reader.partial)} partial observations")
    assert reader.partial == []
    seen = batches(ch, table)
    assert seen == dict.fromkeys(range(max(seen) + 1), FULL)  # exactly once, no gap
    left = ch.query(
        "SELECT name FROM system.tables WHERE database = 'txsink_staging' AND name LIKE {p:String}",
        parameters={"p": f"%{job.replace('-', '_')}%"},
    ).result_rows
    assert left == []


def test_partition_visibility_lets_a_reader_catch_partial_batches(
    stack: Any, ch: Any, fresh_db: str
) -> None:
    """Not an invariant of partition mode: the count is reported, the data must be whole."""
    table = make_target(ch, fresh_db)
    job = f"vis-{uuid.uuid4().hex[:8]}"
    with Reader(stack, table) as reader:
        assert drive(stack, job, table, "partition", 0, 12).returncode == 0
    partial = {b for b, _ in reader.partial}
    print(f"\npartition visibility: {reader.polls} polls, {len(reader.partial)} partial "
          f"observations, {len(partial)} of 12 batches seen partially")  # fmt: skip
    assert batches(ch, table) == dict.fromkeys(range(12), FULL)


def test_batch_visibility_is_refused_before_writing_where_the_target_cannot_honour_it(
    stack: Any, ch: Any, fresh_db: str
) -> None:
    from pyspark.sql.types import LongType, StructField, StructType

    from txsink.spark.validate import validate

    ch.command(
        f"CREATE TABLE {fresh_db}.d (x Int64) ENGINE = MergeTree ORDER BY x "
        f"SETTINGS non_replicated_deduplication_window = 1000"
    )
    opts = {"url": stack.url, "keeper": stack.keeper, "job": f"vis-{uuid.uuid4().hex[:8]}"}
    schema = StructType([StructField("x", LongType(), False)])
    config = WriterConfig.from_options(
        {**opts, "table": f"{fresh_db}.d", "mode": "dedup", "visibility": "batch"}
    )
    with pytest.raises(ConfigError, match="visibility=batch needs attach mode"):
        validate(config, schema)
    ch.command(f"CREATE TABLE {fresh_db}.m (x Int64) ENGINE = Memory")
    config = WriterConfig.from_options(
        {**opts, "table": f"{fresh_db}.m", "mode": "auto", "visibility": "batch"}
    )
    with pytest.raises(ConfigError):
        validate(config, schema)
