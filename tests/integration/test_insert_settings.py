"""Insert settings on the real engine (issue 23, rows 5, 7 and 8).

- Row 5: one task's rows span 150 target partitions (a backfill into a table partitioned
  by day): staging and dedup inserts lift ``max_partitions_per_insert_block``; both modes
  end exact. The endpoint answers such a refused insert as ClickHouse does (code 252).
- Row 7: a settings profile that sets ``deduplicate_insert='disable'`` (the 26.x
  spelling that overrides ``insert_deduplicate``) on a separate endpoint started with
  that profile: a dedup-mode replay stays exact. Staging that keeps a dedup window does
  not deduplicate a task's identical slices.
- Row 8: an AggregatingMergeTree target with ``SimpleAggregateFunction`` columns, written
  through Spark, gets exact values.
- Issue 38 row 5: a settings-profile constraint on a ``log_*`` setting the ATTACH of
  ``visibility=batch`` sends refuses the job before anything is staged (it used to fail
  every ATTACH after PREPARE, with no way to finish the batch); partition visibility runs.

Spark tests use the session's ``spark`` fixture (local[2]); the others need no Spark.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import shutil
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pyarrow as pa
import pytest
from clickhouse_connect.driver.exceptions import DatabaseError

from tests.integration.conftest import client_for, free_port
from tests.integration.test_dedup_mode import _Ctx, config, dying_after
from txsink.clickhouse.client import connect
from txsink.clickhouse.warehouse import ClickHouseWarehouse
from txsink.driver import open_registry
from txsink.embedded.stack import QUERY_LOG_CONFIG
from txsink.protocol import ids
from txsink.spark import validate
from txsink.spark.dedup_write import write_dedup
from txsink.spark.messages import WritePlan
from txsink.spark.task import Task

DAYS = 150  # more than ClickHouse's default max_partitions_per_insert_block (100)
BY_DAY = (
    "CREATE TABLE {t} (id Int64, day Date, v Int64) ENGINE = MergeTree "
    "PARTITION BY day ORDER BY id SETTINGS non_replicated_deduplication_window = 10000"
)


def backfill(n_rows: int, days: int = DAYS, chunk: int = 50) -> list[pa.RecordBatch]:
    """Rows of ``days`` consecutive days, one Arrow batch of ``chunk`` rows at a time."""
    start = dt.date(2024, 1, 1)
    ids_ = list(range(n_rows))
    table = pa.table(
        {
            "id": pa.array(ids_, pa.int64()),
            "day": pa.array([start + dt.timedelta(days=i % days) for i in ids_], pa.date32()),
            "v": pa.array([i * 3 for i in ids_], pa.int64()),
        }
    )
    return table.to_batches(max_chunksize=chunk)


def counts(ch: Any, table: str) -> tuple[int, int, int]:
    row = ch.query(f"SELECT count(), uniqExact(id), uniqExact(day) FROM {table}").result_rows[0]
    return int(row[0]), int(row[1]), int(row[2])


def dedup_write(plan: WritePlan, batches: Any, attempt: int) -> Any:
    return write_dedup(plan, Task.of(_Ctx(0, attempt), "run", "b0", 0, 0.0), iter(batches))


# ------------------------------------------------------------------ the endpoint


def test_an_insert_refused_for_too_many_partitions_is_an_error_not_a_silent_success(
    ch: Any, fresh_db: str
) -> None:
    """chdb's streaming insert reports a block refused for spanning more than 100
    partitions as a success with nothing written; the endpoint answers code 252."""
    table = f"{fresh_db}.t"
    ch.command(BY_DAY.format(t=table))
    block = pa.Table.from_batches(backfill(DAYS))
    with pytest.raises(DatabaseError, match="Too many partitions for single INSERT block"):
        ch.insert_arrow(table, block, settings={"async_insert": 0})
    assert counts(ch, table)[0] == 0
    ch.insert_arrow(
        table, block, settings={"async_insert": 0, "max_partitions_per_insert_block": 0}
    )
    assert counts(ch, table) == (DAYS, DAYS, DAYS)


# ------------------------------------------------------------------ row 5: many partitions


def test_a_dedup_task_spanning_150_partitions_lands_exactly_once_and_its_replay_adds_nothing(
    stack: Any, ch: Any, fresh_db: str
) -> None:
    table = f"{fresh_db}.t"
    ch.command(BY_DAY.format(t=table))
    plan = WritePlan(config(stack, table, mode="dedup", block_rows="400"), "dedup")
    rows = backfill(1000)  # blocks of 400 rows, each over all 150 days
    with pytest.raises(RuntimeError):
        dedup_write(plan, dying_after(rows, 12), attempt=0)  # block 0 landed, then lost
    assert counts(ch, table) == (400, 400, DAYS)
    message = dedup_write(plan, rows, attempt=1)
    assert message.rows == 1000 and message.extra["decision"] == "RESUME"
    assert counts(ch, table) == (1000, 1000, DAYS)
    assert dedup_write(plan, rows, attempt=2).extra["decision"] == "SAME"
    assert counts(ch, table) == (1000, 1000, DAYS)


@pytest.mark.spark
def test_an_attach_task_spanning_150_partitions_publishes_every_row_once(
    spark: Any, stack: Any, ch: Any, fresh_db: str
) -> None:
    table = f"{fresh_db}.t"
    ch.command(BY_DAY.format(t=table))
    start = dt.date(2024, 1, 1)
    df = spark.createDataFrame(
        [(i, start + dt.timedelta(days=i % DAYS), i * 3) for i in range(3000)],
        "id long, day date, v long",
    ).coalesce(1)  # one task: every block of it spans all 150 days
    job = f"many-{uuid.uuid4().hex[:8]}"
    opts = {"url": stack.url, "keeper": stack.keeper, "table": table, "job": job}
    (
        df.write.format("clickhouse_tx")
        .options(**opts, mode="attach", txn_version="1")
        .mode("append")
        .save()
    )
    assert counts(ch, table) == (3000, 3000, DAYS)
    total = ch.query(f"SELECT sum(v) FROM {table}").result_rows[0][0]
    assert total == sum(i * 3 for i in range(3000))
    (  # the same version again is a no-op
        df.write.format("clickhouse_tx")
        .options(**opts, mode="attach", txn_version="1")
        .mode("append")
        .save()
    )
    assert counts(ch, table) == (3000, 3000, DAYS)


# ------------------------------------------------------------------ row 7: profiles


@contextlib.contextmanager
def endpoint(stack: Any, data: Path, *args: str) -> Iterator[SimpleNamespace]:
    """A second embedded endpoint (its own engine in ``data``, started with ``args``),
    up until the block ends."""
    port = free_port()
    argv = [sys.executable, "-m", "txsink.embedded.server", "--data", str(data)]
    proc = subprocess.Popen(
        [*argv, "--port", str(port), *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(url + "/ping", timeout=1) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise
                time.sleep(0.3)
        yield SimpleNamespace(url=url, keeper=stack.keeper)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(data, ignore_errors=True)


@pytest.fixture
def profiled(stack: Any, tmp_path: Path) -> Iterator[SimpleNamespace]:
    """A second endpoint whose every connection starts from a settings profile with
    ``deduplicate_insert='disable'`` (chdb has no users: the endpoint applies it)."""
    with endpoint(stack, tmp_path / "profiled", "--setting", "deduplicate_insert=disable") as ep:
        yield ep


def test_a_dedup_replay_stays_exact_under_a_profile_that_disables_deduplicate_insert(
    profiled: Any,
) -> None:
    ch = client_for(profiled)  # type: ignore[arg-type]
    try:
        assert ch.query(
            "SELECT value, changed FROM system.settings WHERE name = 'deduplicate_insert'"
        ).result_rows == [("disable", 1)]
        ch.command("CREATE DATABASE IF NOT EXISTS p")
        table = f"p.t_{uuid.uuid4().hex[:8]}"
        ch.command(BY_DAY.format(t=table))
        cfg = config(profiled, table, mode="dedup", block_rows="2")
        client = connect(cfg.url)
        try:  # the writer's user's profile is read and overriding it is accepted
            validate.check_insert_settings(cfg, ClickHouseWarehouse(client), "dedup")
        finally:
            client.close()
        plan = WritePlan(cfg, "dedup")
        rows = backfill(8, days=2, chunk=1)
        with pytest.raises(RuntimeError):
            dedup_write(plan, dying_after(rows, 5), attempt=0)  # blocks 0, 1 landed
        assert counts(ch, table)[:2] == (4, 4)
        message = dedup_write(plan, rows, attempt=1)  # blocks 0, 1 re-sent with their tokens
        assert message.extra["decision"] == "RESUME"
        n, unique, _ = counts(ch, table)
        assert (n, unique) == (8, 8), f"{n - unique} duplicated row(s)"
    finally:
        ch.close()


def test_staging_that_keeps_a_dedup_window_keeps_identical_slices_of_a_task(
    stack: Any, ch: Any, fresh_db: str
) -> None:
    """A replicated staging keeps the target's replicated_deduplication_window (its
    inserts cannot be run here: embedded replicas are read-only); a staging with a
    non-replicated window stands in. deduplicate_insert (default 'enable' on 26.x)
    overrides insert_deduplicate=0: staging inserts send 'disable' too."""
    target = f"{fresh_db}.t"
    ch.command(BY_DAY.format(t=target))
    client = connect(stack.url)
    try:
        wh = ClickHouseWarehouse(client, staging_db=f"{fresh_db}_stg")
        wh.ensure_staging_db()
        name = ids.staging_name("set-test", "b1", ids.run_tag("r"), 0, 0, 1).table
        wh.create_staging(target, name)
        ch.command(
            f"ALTER TABLE {fresh_db}_stg.`{name}` "
            "MODIFY SETTING non_replicated_deduplication_window = 100"
        )
        block = backfill(4, days=2)
        for _ in range(2):  # two identical slices of one task
            wh.insert_blocks(name, block, block_rows=100, block_bytes=1 << 20)
        assert sum(wh.partition_rows(name, db=f"{fresh_db}_stg").values()) == 8
    finally:
        client.close()
        ch.command(f"DROP DATABASE IF EXISTS {fresh_db}_stg SYNC")


# ------------------------------------------------------------------ row 8


@pytest.mark.spark
def test_an_aggregating_target_with_simple_aggregate_function_columns_gets_exact_values(
    spark: Any, stack: Any, ch: Any, fresh_db: str
) -> None:
    table = f"{fresh_db}.agg"
    ch.command(
        f"CREATE TABLE {table} (k Int64, total SimpleAggregateFunction(sum, UInt64), "
        "top SimpleAggregateFunction(max, Int64), last SimpleAggregateFunction(anyLast, "
        "Nullable(String))) ENGINE = AggregatingMergeTree ORDER BY k"
    )
    data = [(i % 7, i, -i, f"s{i}" if i % 3 else None) for i in range(500)]
    df = spark.createDataFrame(data, "k long, total long, top long, last string")
    (
        df.write.format("clickhouse_tx")
        .options(
            url=stack.url,
            keeper=stack.keeper,
            table=table,
            job=f"agg-{uuid.uuid4().hex[:8]}",
            txn_version="1",
        )
        .mode("append")
        .save()
    )
    got = ch.query(f"SELECT k, sum(total), max(top) FROM {table} GROUP BY k ORDER BY k")
    want = [
        (k, sum(i for i in range(500) if i % 7 == k), max(-i for i in range(500) if i % 7 == k))
        for k in range(7)
    ]
    assert [tuple(r) for r in got.result_rows] == want
    ch.command(f"OPTIMIZE TABLE {table} FINAL")
    assert ch.query(f"SELECT count(), sum(total) FROM {table}").result_rows == [
        (7, sum(range(500)))
    ]


# ------------------------------------------------------------------ issue 38 row 5


USERS_XML = """<clickhouse>
  <profiles><default>
    <log_comment>etl</log_comment>
    <constraints><log_comment><readonly/></log_comment></constraints>
  </default></profiles>
  <users><default>
    <profile>default</profile><networks><ip>::/0</ip></networks><password></password>
    <quota>default</quota>
  </default></users>
  <quotas><default></default></quotas>
</clickhouse>
"""


@pytest.fixture
def constrained(stack: Any, tmp_path: Path) -> Iterator[SimpleNamespace]:
    """A second endpoint whose one user has a settings profile that tags every query's
    log entry ``log_comment='etl'`` and forbids changing it (a real server's users.xml,
    read by the engine through ``<user_directories>``)."""
    (tmp_path / "users.xml").write_text(USERS_XML)
    config = tmp_path / "config.xml"
    config.write_text(
        f"<clickhouse>{QUERY_LOG_CONFIG}<user_directories><users_xml>"
        f"<path>{tmp_path / 'users.xml'}</path></users_xml></user_directories></clickhouse>\n"
    )
    with endpoint(stack, tmp_path / "data", "--config-file", str(config)) as ep:
        yield ep


@pytest.mark.spark
def test_a_profile_constraint_on_the_publish_log_settings_refuses_the_job_before_staging(
    spark: Any, constrained: Any
) -> None:
    ch = client_for(constrained)  # type: ignore[arg-type]
    try:
        ch.command("CREATE DATABASE IF NOT EXISTS p")
        table = f"p.t_{uuid.uuid4().hex[:8]}"
        ch.command(BY_DAY.format(t=table))
        df = spark.createDataFrame(
            [(i, dt.date(2024, 1, 1 + i % 3), i) for i in range(30)], "id long, day date, v long"
        )
        job = f"logc-{uuid.uuid4().hex[:8]}"
        opts = {"url": constrained.url, "keeper": constrained.keeper, "table": table}
        with pytest.raises(Exception, match=r"log_comment") as refused:
            (
                df.write.format("clickhouse_tx")
                .options(**opts, job=job, mode="attach", visibility="batch", txn_version="1")
                .mode("append")
                .save()
            )
        text = str(refused.value)
        assert "log_comment=etl is fixed for user default" in text, text
        assert "use visibility=partition" in text and "nothing was written" in text, text
        assert ch.query(f"SELECT count() FROM {table}").result_rows == [(0,)]
        staged = ch.query(
            "SELECT count() FROM system.tables WHERE name LIKE {j:String}",
            parameters={"j": f"{job}%"},
        ).result_rows
        assert staged == [(0,)], "the refused job staged rows"
        registry = open_registry(config(constrained, table))
        try:
            assert registry.list(job) == [], "the refused job prepared an xid"
        finally:
            registry.close()
        # the way around it the message names: partition visibility publishes by MOVE
        (
            df.write.format("clickhouse_tx")
            .options(**opts, job=f"{job}-p", mode="attach", txn_version="1")
            .mode("append")
            .save()
        )
        assert counts(ch, table) == (30, 30, 3)
    finally:
        ch.close()
