"""Exactly-once when the target, the job and the user misbehave (issue 10, rows 1, 3, 6, 12).

Each test does what a user or an operator ordinarily does (create a view mid-stream, save
twice in one foreachBatch, reset a checkpoint, run two Keeper roots on one ClickHouse)
against the real engine, ZooKeeper and Spark, and asserts the outcome a user cares about:
exact rows, or a clear refusal with the target untouched and a way to go on.
"""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
import sys
import threading
import time
import uuid
from typing import Any

import pyarrow as pa
import pytest

from tests.integration.sparkjob import assert_exact, new_job, staging_left
from txsink.config import WriterConfig
from txsink.driver import open_job
from txsink.ops.mode import change_mode
from txsink.ops.stores import open_stores
from txsink.protocol.ids import staging_name
from txsink.protocol.states import StagedPart

pytestmark = pytest.mark.spark

DEDUP_DDL = (
    "CREATE TABLE {table} (id Int64, event_time DateTime64(6, 'UTC'), day Date, "
    "customer LowCardinality(String), amount Int64) "
    "ENGINE = MergeTree PARTITION BY toYYYYMM(day) ORDER BY (day, id) "
    "SETTINGS non_replicated_deduplication_window = 1000"
)


def add_view(ch: Any, table: str) -> str:
    """A materialized view counting rows per customer (its table keeps a dedup window)."""
    db = table.split(".", maxsplit=1)[0]
    ch.command(
        f"CREATE TABLE {db}.per_customer (customer String, n UInt64) "
        "ENGINE = SummingMergeTree ORDER BY customer "
        "SETTINGS non_replicated_deduplication_window = 1000"
    )
    ch.command(
        f"CREATE MATERIALIZED VIEW {db}.per_customer_mv TO {db}.per_customer AS "
        f"SELECT toString(customer) AS customer, count() AS n FROM {table} GROUP BY customer"
    )
    return f"{db}.per_customer"


def txsink_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "txsink.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


# -- row 1: the mode is pinned; a view appearing mid-stream is refused, then switched ------


@pytest.mark.slow  # make test keeps: a view created while a batch is written
def test_a_view_created_mid_stream_is_refused_until_the_operator_switches_mode_then_exact(
    stack, ch, fresh_db, tmp_path
):
    job = new_job(tmp_path, ch, fresh_db, stack.url, stack.keeper, ddl=DEDUP_DDL)
    code = job.run(fault="driver.before_prepare", fault_after=1, files_per_trigger=1)
    assert code != 0, job.log_tail()
    before = ch.query(f"SELECT count() FROM {job.table}").result_rows[0][0]
    assert before > 0  # batch 0 committed in attach mode, batch 1 staged when it died
    view_table = add_view(ch, job.table)

    assert job.run(files_per_trigger=1) != 0  # pinned attach + a view: refused, not switched
    assert "pinned to attach" in job.log_tail() and "txsink mode" in job.log_tail()
    assert ch.query(f"SELECT count() FROM {job.table}").result_rows[0][0] == before
    assert staging_left(ch, job) == []

    changed = txsink_cli(
        "mode",
        "--url",
        stack.url,
        "--keeper",
        stack.keeper,
        "--job",
        job.name,
        "--set",
        "dedup",
        "--force",
        "--json",
    )
    assert changed.returncode == 0, changed.stderr
    assert job.run(files_per_trigger=1, mode="auto") == 0, job.log_tail()  # follows the pin
    assert_exact(ch, job)
    seen = ch.query(f"SELECT sum(n) FROM {view_table}").result_rows[0][0]
    assert seen == job.produced - before  # the view saw every row published after it existed


def test_a_view_created_while_a_batch_is_written_fails_the_batch_and_publishes_nothing(
    spark, stack, ch, fresh_db, tmp_path
):
    table = f"{fresh_db}.t"
    ch.command(DEDUP_DDL.format(table=table))
    options = {
        "url": stack.url,
        "keeper": stack.keeper,
        "table": table,
        "job": f"view-{uuid.uuid4().hex[:8]}",
        "txn_version": "1",
    }
    schema = "id long, event_time timestamp, day date, customer string, amount long"

    started = tmp_path / "tasks-started"

    def slow(batches: Any) -> Any:
        started.touch()
        time.sleep(4)  # the view is created while the tasks are writing
        for b in batches:
            yield pa.RecordBatch.from_pydict(
                {
                    "id": b.column(0),
                    "event_time": pa.array(
                        [1_700_000_000_000_000] * b.num_rows, pa.timestamp("us")
                    ),
                    "day": pa.array([19700] * b.num_rows, pa.date32()),
                    "customer": pa.array(["c"] * b.num_rows),
                    "amount": pa.array([1] * b.num_rows, pa.int64()),
                }
            )

    df = spark.range(0, 2000, numPartitions=2).mapInArrow(slow, schema)

    def create_view_once_tasks_run() -> None:
        deadline = time.monotonic() + 60
        while not started.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        add_view(ch, table)

    creator = threading.Thread(target=create_view_once_tasks_run)
    creator.start()
    with pytest.raises(Exception, match="materialized view"):
        df.write.format("clickhouse_tx").options(**options).mode("append").save()
    creator.join()
    assert ch.query(f"SELECT count() FROM {table}").result_rows[0][0] == 0
    cfg = WriterConfig.from_options(options)
    with open_stores(stack.url, stack.keeper) as stores:
        change_mode(stores, cfg.job, "dedup", stale_after=600, force=True)
    df.write.format("clickhouse_tx").options(**options).mode("append").save()
    assert ch.query(f"SELECT count(), uniqExact(id) FROM {table}").result_rows[0] == (2000, 2000)
    assert ch.query(f"SELECT sum(n) FROM {fresh_db}.per_customer").result_rows[0][0] == 2000


# -- row 3: two saves under one job in one foreachBatch call -------------------------------


def test_two_saves_under_one_job_in_one_foreach_batch_call_fail_loudly_never_silently(
    spark, stack, ch, fresh_db, tmp_path
):
    import txsink

    table = f"{fresh_db}.t"
    ch.command(DEDUP_DDL.format(table=table))
    src = tmp_path / "src"
    spark.range(0, 300).selectExpr(
        "id",
        "cast(id as timestamp) as event_time",
        "date'2024-01-01' as day",
        "'c' as customer",
        "1L as amount",
    ).write.parquet(str(src))
    save = txsink.foreach_batch(
        url=stack.url, keeper=stack.keeper, table=table, job=f"twice-{uuid.uuid4().hex[:8]}"
    )

    def handle(df: Any, batch_id: int) -> None:
        save(df.filter("id % 2 = 0"), batch_id)
        save(df.filter("id % 2 = 1"), batch_id)  # the second save of the same batch

    stream = spark.readStream.schema(
        "id long, event_time timestamp, day date, customer string, amount long"
    ).parquet(str(src))

    def run_once() -> None:
        query = (
            stream.writeStream.foreachBatch(handle)
            .option("checkpointLocation", str(tmp_path / "ckpt"))
            .trigger(availableNow=True)
            .start()
        )
        query.awaitTermination(120)

    for _ in range(2):  # the restart replays the batch: refused again, never skipped
        with pytest.raises(Exception, match="saved"):
            run_once()
        # the first save is committed, the second was refused before it wrote anything
        assert ch.query(f"SELECT count(), countIf(id % 2 = 1) FROM {table}").result_rows[0] == (
            150,
            0,
        )


# -- row 12: a reset checkpoint under the same query ---------------------------------------


@pytest.mark.slow  # a refusal before any write; three job runs
def test_a_reset_checkpoint_of_the_same_query_is_refused_not_skipped(stack, ch, fresh_db, tmp_path):
    job = new_job(tmp_path, ch, fresh_db, stack.url, stack.keeper, files=3, rows_per_file=500)
    assert job.run(files_per_trigger=1) == 0, job.log_tail()
    assert_exact(ch, job)
    for name in ("offsets", "commits", "sources"):  # keep `metadata`: the same query id
        shutil.rmtree(job.checkpoint / name, ignore_errors=True)
    assert job.run(files_per_trigger=1) != 0
    assert "checkpoint was reset" in job.log_tail()
    assert_exact(ch, job)  # nothing skipped silently, nothing written twice
    assert staging_left(ch, job) == []


# -- issue 38 row 6: a new job name or state store on a checkpoint that may replay --------


@pytest.mark.slow  # three spark-submits; a refusal before any write
def test_a_new_job_name_and_store_on_a_checkpoint_that_replays_a_committed_batch_is_refused(
    stack, ch, fresh_db, tmp_path
):
    """The old advice for changing `state`: a new job name. Batch 1 is committed by
    txsink, then the driver dies before Spark records it; the query restarted under a
    new job in the other store must not write batch 1 again. It is refused (the job has
    no record of any batch and Spark hands it batch 1), naming first_batch; the old job
    then finishes the stream exactly."""
    job = new_job(tmp_path, ch, fresh_db, stack.url, stack.keeper, files=3, rows_per_file=400)
    code = job.run(fault="driver.after_record", fault_after=1, files_per_trigger=1)
    assert code != 0, job.log_tail()
    committed = ch.query(f"SELECT count() FROM {job.table}").result_rows[0][0]
    assert committed == 800, job.log_tail()  # batches 0 and 1; Spark recorded only 0

    moved = dataclasses.replace(job, name=f"{job.name}-ch", options={"state": "clickhouse"})
    assert moved.run(files_per_trigger=1) != 0
    assert "first_batch=1" in moved.log_tail(), moved.log_tail()
    count, distinct = ch.query(f"SELECT count(), uniqExact(id) FROM {job.table}").result_rows[0]
    assert (count, distinct) == (800, 800), "batch 1 was written again under the new job"
    assert staging_left(ch, moved) == []

    assert job.run(files_per_trigger=1) == 0, job.log_tail()  # the old job goes on
    assert_exact(ch, job)


# -- row 6: two Keeper roots, one ClickHouse -----------------------------------------------


def test_two_keeper_roots_sharing_one_clickhouse_never_drop_each_others_staging(
    stack, ch, fresh_db
):
    table = f"{fresh_db}.t"
    ch.command(
        f"CREATE TABLE {table} (id Int64, p UInt8) ENGINE = MergeTree PARTITION BY p ORDER BY id"
    )
    job = f"same-{uuid.uuid4().hex[:6]}"
    handles = {
        root: open_job(
            WriterConfig.from_options(
                {
                    "url": stack.url,
                    "keeper": stack.keeper,
                    "table": table,
                    "job": job,
                    "keeper_root": root,
                }
            )
        )
        for root in ("/txsink-a", "/txsink-b")
    }
    try:
        a, b = handles["/txsink-a"], handles["/txsink-b"]
        assert a.transactor.prefix != b.transactor.prefix
        epoch_a = a.transactor.begin("run-a")
        a.warehouse.ensure_staging_db()

        parts = []
        for task in range(2):  # a's batch 0: two tasks staged, then a's driver "died"
            name = staging_name(job, "b0", "0000000a", task, 0, task, a.transactor.namespace)
            a.warehouse.create_staging(table, name.table)
            a.warehouse.insert_blocks(
                name.table,
                [
                    pa.record_batch(
                        {"id": [task * 10 + i for i in range(10)], "p": [task] * 10},
                        schema=pa.schema([("id", pa.int64()), ("p", pa.uint8())]),
                    )
                ],
                block_rows=100,
                block_bytes=1 << 20,
            )
            view = a.warehouse.staging_view([name.table])[name.table] or {}
            parts += [StagedPart(name.table, pid, n) for pid, n in view.items()]
        b.transactor.begin("run-b")  # b's recovery runs while a's batch is staged
        assert len(a.warehouse.list_staging(a.transactor.prefix)) == 2
        result = a.transactor.commit_batch(epoch_a, "b0", 0, table, parts)
        assert result.action == "committed"
        assert ch.query(f"SELECT count(), uniqExact(id) FROM {table}").result_rows[0] == (20, 20)
    finally:
        for handle in handles.values():
            handle.close()
