"""The attach writer's task on the real engine, without Spark: the staging table is made
while the task waits for its first batch (issue 29), and every way out of that wait
leaves no staging behind."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import pytest

from txsink.config import WriterConfig
from txsink.errors import ConfigError
from txsink.spark.attach_write import write_attach
from txsink.spark.messages import WritePlan
from txsink.spark.task import Task

TARGET = "CREATE TABLE {t} (id Int64, p UInt8) ENGINE = MergeTree PARTITION BY p ORDER BY id"
STAGING_DB = "txsink_staging"


class _Ctx:
    """The TaskContext calls the executor path makes."""

    def partitionId(self) -> int:
        return 3

    def attemptNumber(self) -> int:
        return 0

    def taskAttemptId(self) -> int:
        return 77

    def getLocalProperty(self, key: str) -> str | None:
        return None


@pytest.fixture(autouse=True)
def staging_db(ch: Any) -> None:
    ch.command(f"CREATE DATABASE IF NOT EXISTS {STAGING_DB}")  # validation makes it


def plan_for(stack: Any, table: str) -> WritePlan:
    job = f"aw-{uuid.uuid4().hex[:8]}"
    opts = {"url": stack.url, "keeper": stack.keeper, "table": table, "mode": "attach"}
    return WritePlan(WriterConfig.from_options({**opts, "job": job}), "attach")


def task() -> Task:
    return Task.of(_Ctx(), "run-aw", "b0", 0, time.time())


def staging_of(ch: Any, plan: WritePlan) -> list[str]:
    rows = ch.query(
        "SELECT name FROM system.tables WHERE database = {db:String} "
        "AND position(name, {job:String}) > 0",
        parameters={"db": STAGING_DB, "job": plan.config.job.replace("-", "_")},
    ).result_rows
    return [r[0] for r in rows]


def rows(n: int) -> pa.RecordBatch:
    return pa.RecordBatch.from_pydict(
        {"id": pa.array(range(n), pa.int64()), "p": pa.array([i % 2 for i in range(n)], pa.uint8())}
    )


def test_the_staging_is_made_while_the_task_waits_for_its_first_batch(stack, ch, fresh_db):
    """Spark hands a task its first batch after reading the file (tens of ms): the
    CREATE and its read-back run in that wait. The input below looks for the staging
    table before it yields anything; without the table made ahead it never sees it."""
    table = f"{fresh_db}.t"
    ch.command(TARGET.format(t=table))
    plan = plan_for(stack, table)
    seen: list[list[str]] = []

    def slow_source() -> Iterator[pa.RecordBatch]:
        deadline = time.monotonic() + 10
        while not staging_of(ch, plan) and time.monotonic() < deadline:
            time.sleep(0.02)
        seen.append(staging_of(ch, plan))
        yield rows(10)

    message = write_attach(plan, task(), slow_source())
    assert seen[0], "no staging table was made before the first batch arrived"
    assert list(message.staging) == seen[0]
    # what it sent, not what it read back: the commit reads every task's staging at once
    assert message.rows == 10 and message.inserted == ((seen[0][0], 10),) and not message.parts
    got = ch.query(f"SELECT count(), uniqExact(id), sum(id) FROM {STAGING_DB}.{seen[0][0]}")
    assert got.result_rows == [(10, 10, 45)]


def test_an_empty_partition_makes_nothing_or_drops_what_it_made_ahead(stack, ch, fresh_db):
    """An empty partition that ends at once (a sparse shuffle partition) sends no
    statement at all; one that ends after the grace drops the table made ahead."""
    table = f"{fresh_db}.t"
    ch.command(TARGET.format(t=table))
    plan = plan_for(stack, table)
    before = statements(ch)
    message = write_attach(plan, task(), iter(()))
    assert message.rows == 0 and not message.staging and not message.parts
    assert statements(ch) == before, "an empty partition sent statements"

    def slow_empty() -> Iterator[pa.RecordBatch]:
        time.sleep(0.3)
        if staging_of(ch, plan):
            made.append(1)
        return
        yield rows(1)  # pragma: no cover - makes this a generator

    made: list[int] = []
    message = write_attach(plan, task(), slow_empty())
    assert made, "nothing was made ahead while the partition was being read"
    assert message.rows == 0 and not message.staging
    assert staging_of(ch, plan) == []
    assert statements(ch) >= before + 2  # the count sees the CREATE and the DROP


def statements(ch: Any) -> int:
    """Statements the server has run that name the staging database."""
    ch.command("SYSTEM FLUSH LOGS")
    return int(
        ch.query(
            "SELECT count() FROM system.query_log WHERE type = 'QueryStart' "
            "AND position(query, {db:String}) > 0 AND position(query, 'system.') = 0",
            parameters={"db": STAGING_DB},
        ).result_rows[0][0]
    )


def test_an_input_that_fails_before_its_first_batch_leaves_no_staging(stack, ch, fresh_db):
    table = f"{fresh_db}.t"
    ch.command(TARGET.format(t=table))
    plan = plan_for(stack, table)

    def broken() -> Iterator[pa.RecordBatch]:
        time.sleep(0.05)
        raise RuntimeError("the file is gone")
        yield rows(1)  # pragma: no cover - makes this a generator

    with pytest.raises(RuntimeError, match="the file is gone"):
        write_attach(plan, task(), broken())
    assert staging_of(ch, plan) == []


@pytest.mark.parametrize("wait_s", [0.0, 0.3], ids=["first-batch-at-once", "made-ahead"])
def test_a_create_that_fails_fails_the_task_before_a_row_is_sent(stack, ch, fresh_db, wait_s):
    """The target dropped after validation: the CREATE fails (made ahead or after the
    first batch); the task fails with its error, and nothing is staged."""
    table = f"{fresh_db}.t"
    plan = plan_for(stack, table)  # no such table
    pulled: list[int] = []

    def source() -> Iterator[pa.RecordBatch]:
        time.sleep(wait_s)
        pulled.append(1)
        yield rows(5)
        pulled.append(2)  # never reached: nothing past the first batch is read

    with pytest.raises(ConfigError) as err:
        write_attach(plan, task(), source())
    assert table in str(err.value)
    assert pulled == [1]
    assert staging_of(ch, plan) == []
