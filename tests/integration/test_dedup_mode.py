"""Dedup mode end to end: real Spark (local[2], in a subprocess), the embedded stack over HTTP.

The Spark runs go through ``python -m txsink.demo job`` (:mod:`tests.integration.sparkjob`)
so fault points end real processes. Targets here feed a materialized view, which makes
``mode=auto`` choose dedup; the view stores into a SummingMergeTree that must end exact too.
Fast start-up checks (mode choice, refusals) need no Spark.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pyspark.sql.types import LongType, StringType, StructField, StructType

from tests.integration.sparkjob import NO_KEEPER, STATE_IN_CLICKHOUSE, Job, assert_exact, new_job
from txsink.clickhouse.dedup_insert import insert_settings
from txsink.config import WriterConfig
from txsink.driver import open_registry
from txsink.errors import ConfigError, ContentChanged, DedupWindowExceeded
from txsink.faults import POINTS
from txsink.protocol import dedup, dedup_window
from txsink.protocol.states import Mode, XidState
from txsink.spark import validate
from txsink.spark.dedup_records import StateCell
from txsink.spark.dedup_write import write_dedup
from txsink.spark.messages import WritePlan
from txsink.spark.task import Task

ORDERS = (
    "CREATE TABLE {table} (id Int64, event_time DateTime64(6, 'UTC'), day Date, "
    "customer LowCardinality(String), amount Int64) ENGINE = MergeTree "
    "PARTITION BY toYYYYMM(day) ORDER BY (day, id) "
    "SETTINGS non_replicated_deduplication_window = 1000"
)
# small blocks: every partition is several deterministic blocks
SINK = ("--option", "block_rows=300")


def with_view(ch: Any, db: str, *, engine: str = "SummingMergeTree", window: int = 1000) -> None:
    ch.command(
        f"CREATE TABLE {db}.totals (customer String, n UInt64, amount Int64) ENGINE = {engine} "
        f"ORDER BY customer SETTINGS non_replicated_deduplication_window = {window}"
    )
    ch.command(
        f"CREATE MATERIALIZED VIEW {db}.mv TO {db}.totals AS SELECT toString(customer) AS "
        f"customer, count() AS n, sum(amount) AS amount FROM {db}.orders GROUP BY customer"
    )


def assert_view_exact(ch: Any, db: str, job: Job) -> None:
    target = ch.query(
        f"SELECT toString(customer), count(), sum(amount) FROM {db}.orders GROUP BY 1 ORDER BY 1"
    ).result_rows
    view = ch.query(
        f"SELECT customer, sum(n), sum(amount) FROM {db}.totals GROUP BY 1 ORDER BY 1"
    ).result_rows
    assert view == target, job.log_tail()
    assert sum(r[1] for r in view) == job.produced and sum(r[2] for r in view) == job.amount


# ------------------------------------------------------------------ Spark, crashes


EVERY_POINT = ["executor.mid_write", "driver.before_prepare", "driver.after_prepare",
               "driver.after_record", "driver.mid_commit"]  # fmt: skip


@pytest.mark.spark
@pytest.mark.parametrize(
    "order",
    [  # `make test-slow` only (`make test` keeps dedup's kill -9 in test_spark_crashes)
        pytest.param(
            ["executor.mid_write", "driver.after_prepare", "driver.mid_commit"],
            id="key-points",
            marks=pytest.mark.slow,
        ),
        pytest.param(EVERY_POINT, id="every-point", marks=pytest.mark.slow),
    ],
)
def test_crash_at_every_fault_point_then_restart_is_exact_in_target_and_view(
    stack, ch, zk, fresh_db, tmp_path, order
):
    """One job, one crash per fault point in turn, each restart replaying the crashed batch.
    Its state lives in ClickHouse (``state=clickhouse``) and its Keeper address answers
    nothing: executors record dedup state through SQL.

    Order matters: each driver point lets one arrival pass (the replay of the batch the
    previous run crashed in) and kills the next batch. ``driver.mid_commit`` is never
    reached in dedup mode (nothing is moved), so its run finishes the job.
    ``driver.after_commit`` is left out: a dedup xid's publish is its record alone
    (``planner.plan_publish``), so a crash there leaves what ``driver.after_prepare``
    leaves (PREPARED, every row in the target); the memory-twin matrices crash there.
    """
    job = new_job(tmp_path, ch, fresh_db, stack.url, NO_KEEPER, files=12, rows_per_file=1000,
                  ddl=ORDERS, options=STATE_IN_CLICKHOUSE)  # fmt: skip
    with_view(ch, fresh_db)
    assert sorted([*EVERY_POINT, "driver.after_commit"]) == sorted(POINTS)
    for point in order:
        code = job.run(*SINK, mode="auto", fault=point, fault_after=0 if point == order[0] else 1)
        if point == "driver.mid_commit":
            assert code == 0, f"the last run must finish\n{job.log_tail()}"
        else:
            assert code != 0, f"the job was supposed to die at {point}\n{job.log_tail()}"
    assert "chose dedup" in job.log.read_text(errors="replace")
    assert_exact(ch, job)
    assert_view_exact(ch, fresh_db, job)
    records = job.records()
    assert records and all(r.state is XidState.COMMITTED and r.mode is Mode.DEDUP for r in records)
    assert sorted(r.batch for r in records) == list(range(6))
    registry = open_registry(job.config())
    try:  # the state lives in ClickHouse: nothing in Keeper, no dedup state left there
        assert registry.blob_children(job.name, "dedup") == [], "dedup state must be deleted"
    finally:
        registry.close()
    assert not zk.exists(f"/txsink/jobs/{job.name}"), "state=clickhouse wrote to Keeper"
    # blocks that were re-sent after the executor crash were dropped by ClickHouse, not the view
    assert "RESUME" in job.log.read_text(errors="replace")


@pytest.mark.slow  # make test keeps dedup's crash (test_spark_crashes)
@pytest.mark.spark
def test_replay_whose_content_changed_is_refused_not_duplicated(stack, ch, zk, fresh_db, tmp_path):
    job = new_job(tmp_path, ch, fresh_db, stack.url, stack.keeper, files=4, rows_per_file=1000,
                  ddl=ORDERS)  # fmt: skip
    with_view(ch, fresh_db)
    # every partition of batch 0 is inserted and recorded AFTER; the driver dies before PREPARE
    assert job.run(*SINK, mode="auto", fault="driver.before_prepare", fault_after=0) != 0
    landed = ch.query(f"SELECT count(), sum(amount) FROM {job.table}").result_rows[0]
    assert landed[0] == 2000, job.log_tail()
    # the source of batch 0 changes under the same file name: same ids, other amounts
    first = job.src / "part-00000.parquet"
    table = pq.read_table(first)
    amounts = pa.array([a + 1 for a in table.column("amount").to_pylist()], pa.int64())
    pq.write_table(table.set_column(table.schema.get_field_index("amount"), "amount", amounts),
                   first)  # fmt: skip
    assert job.run(*SINK, mode="auto") != 0, "a changed replay must fail loudly"
    log = job.log.read_text(errors="replace")
    assert "ContentChanged" in log or "differs in Spark partition" in log, job.log_tail()
    assert "xid b0" in log and "CHANGED" in log
    after = ch.query(f"SELECT count(), uniqExact(id), sum(amount) FROM {job.table}").result_rows
    assert after[0] == (2000, 2000, landed[1]), "nothing of the changed replay may land"
    assert all(r.state is not XidState.COMMITTED for r in job.records())


# ------------------------------------------------------------------ start-up checks

SCHEMA = StructType([StructField("id", LongType(), False)])
OCA = StructType(
    [
        StructField("id", LongType(), False),
        StructField("customer", StringType(), False),
        StructField("amount", LongType(), False),
    ]
)


def config(stack: Any, table: str, mode: str = "auto", **extra: str) -> WriterConfig:
    opts = {"url": stack.url, "keeper": stack.keeper, "table": table, "mode": mode}
    opts["job"] = f"v-{uuid.uuid4().hex[:8]}"
    return WriterConfig.from_options({**opts, **extra})


def no_job_in_keeper(cfg: WriterConfig) -> bool:
    registry = open_registry(cfg)
    try:
        return registry.job_meta(cfg.job) is None
    finally:
        registry.close()


def test_auto_picks_dedup_for_a_target_feeding_a_view_and_attach_for_plain_merge_tree(
    stack, ch, fresh_db, caplog
):
    ch.command(f"CREATE TABLE {fresh_db}.plain (id Int64) ENGINE = MergeTree ORDER BY id")
    ch.command(
        f"CREATE TABLE {fresh_db}.orders (id Int64) ENGINE = MergeTree ORDER BY id "
        "SETTINGS non_replicated_deduplication_window = 100"
    )
    ch.command(
        f"CREATE TABLE {fresh_db}.ids (n UInt64) ENGINE = SummingMergeTree ORDER BY tuple() "
        "SETTINGS non_replicated_deduplication_window = 100"
    )
    ch.command(
        f"CREATE MATERIALIZED VIEW {fresh_db}.mv TO {fresh_db}.ids AS "
        f"SELECT count() AS n FROM {fresh_db}.orders"
    )
    with caplog.at_level(logging.INFO, logger="txsink.spark.validate"):
        assert validate.validate(config(stack, f"{fresh_db}.plain"), SCHEMA).mode == "attach"
        assert validate.validate(config(stack, f"{fresh_db}.orders"), SCHEMA).mode == "dedup"
    text = caplog.text
    assert "chose attach" in text
    assert f"chose dedup for {fresh_db}.orders because" in text and f"{fresh_db}.mv" in text


def test_dedup_window_of_zero_is_refused_before_anything_is_written(stack, ch, fresh_db):
    ch.command(f"CREATE TABLE {fresh_db}.nowin (id Int64) ENGINE = MergeTree ORDER BY id")
    cfg = config(stack, f"{fresh_db}.nowin", mode="dedup")
    with pytest.raises(ConfigError) as err:
        validate.validate(cfg, SCHEMA)
    msg = str(err.value)
    assert "non_replicated_deduplication_window=0" in msg
    assert f"ALTER TABLE {fresh_db}.nowin MODIFY SETTING non_replicated_deduplication_window" in msg
    assert no_job_in_keeper(cfg)
    assert ch.query(f"SELECT count() FROM {fresh_db}.nowin").result_rows[0][0] == 0


def test_a_view_table_without_a_dedup_window_is_refused_by_dedup_mode(stack, ch, fresh_db):
    ch.command(
        f"CREATE TABLE {fresh_db}.orders (id Int64, customer String, amount Int64) "
        "ENGINE = MergeTree ORDER BY id SETTINGS non_replicated_deduplication_window = 100"
    )
    with_view(ch, fresh_db, window=0)
    with pytest.raises(ConfigError) as err:
        validate.validate(config(stack, f"{fresh_db}.orders"), OCA)
    assert f"{fresh_db}.totals" in str(err.value) and "counted" in str(err.value)


@pytest.mark.parametrize("engine", ["Memory", "Log"])
def test_engines_without_block_dedup_are_refused_by_dedup_mode(stack, ch, fresh_db, engine):
    ch.command(f"CREATE TABLE {fresh_db}.t (id Int64) ENGINE = {engine}")
    with pytest.raises(ConfigError) as err:
        validate.validate(config(stack, f"{fresh_db}.t", mode="dedup"), SCHEMA)
    assert engine in str(err.value) and "does not deduplicate" in str(err.value)


def test_mode_attach_on_a_target_feeding_a_view_fails_before_writing_and_names_it(
    stack, ch, fresh_db
):
    ch.command(
        f"CREATE TABLE {fresh_db}.orders (id Int64, customer String, amount Int64) "
        "ENGINE = MergeTree ORDER BY id"
    )
    with_view(ch, fresh_db)
    cfg = config(stack, f"{fresh_db}.orders", mode="attach")
    with pytest.raises(ConfigError) as err:
        validate.validate(cfg, OCA)
    assert "mode=attach is impossible" in str(err.value) and f"{fresh_db}.mv" in str(err.value)
    assert no_job_in_keeper(cfg)


# ------------------------------------------------------------------ ClickHouse facts relied on


def test_views_count_a_replayed_block_once_only_with_dedup_in_dependent_views(ch, fresh_db):
    """What dedup mode sends per block, checked on this ClickHouse (chdb 26.9)."""
    ch.command(
        f"CREATE TABLE {fresh_db}.orders (id Int64, customer String, amount Int64) "
        "ENGINE = MergeTree ORDER BY id SETTINGS non_replicated_deduplication_window = 100"
    )
    with_view(ch, fresh_db)
    block = pa.table({"id": [1, 2], "customer": ["a", "b"], "amount": [10, 20]})
    settings = insert_settings("job", "b0", 0, 0)
    assert settings["deduplicate_blocks_in_dependent_materialized_views"] == 1
    for _ in range(2):
        ch.insert_arrow(f"{fresh_db}.orders", block, settings=settings)
    totals = f"SELECT sum(n), sum(amount) FROM {fresh_db}.totals"
    assert ch.query(totals).result_rows == [(2, 30)]
    without = {**insert_settings("job", "b1", 0, 0),
               "deduplicate_blocks_in_dependent_materialized_views": 0}  # fmt: skip
    for _ in range(2):
        ch.insert_arrow(f"{fresh_db}.orders", block, settings=without)
    assert ch.query(f"SELECT count() FROM {fresh_db}.orders").result_rows == [(4,)]
    assert ch.query(totals).result_rows == [(6, 90)], "the view counted the replay again"


def test_zookeeper_registry_deletes_the_dedup_state_of_one_xid(stack, zk):
    cfg = config(stack, "db.t")
    registry = open_registry(cfg)
    try:
        registry.put_blob(cfg.job, "dedup/b1/p0", {"status": "AFTER"})
        registry.put_blob(cfg.job, "dedup/b1/p1", {"status": "BEFORE"})
        registry.put_blob(cfg.job, "dedup/b2/p0", {"status": "AFTER"})
        registry.delete_blobs(cfg.job, "dedup/b1")
        registry.delete_blobs(cfg.job, "dedup/b9")  # absent: nothing to do
        assert registry.get_blob(cfg.job, "dedup/b1/p0") is None
        assert registry.get_blob(cfg.job, "dedup/b2/p0") == {"status": "AFTER"}
    finally:
        registry.close()
    assert zk.get_children(f"/txsink/jobs/{cfg.job}/dedup") == ["b2"]


# ------------------------------------------------------------------ the dedup window (no Spark)


class _Ctx:
    """The TaskContext calls the executor path makes."""

    def __init__(self, partition: int, attempt: int) -> None:
        self._p, self._a = partition, attempt

    def partitionId(self) -> int:
        return self._p

    def attemptNumber(self) -> int:
        return self._a

    def taskAttemptId(self) -> int:
        return 1000 * self._p + self._a

    def getLocalProperty(self, key: str) -> str | None:
        return None


TWO_PARTITIONS = (
    "CREATE TABLE {t} (id Int64, p UInt8) ENGINE = MergeTree PARTITION BY p ORDER BY id"
)


def two_partition_rows(n_blocks: int) -> list[pa.RecordBatch]:
    """Blocks of 2 rows (block_rows=2), each spanning partitions 1 and 2: 2 parts a block."""
    ids = list(range(1, 2 * n_blocks + 1))
    return [pa.RecordBatch.from_pydict({"id": [i], "p": [1 + (i % 2)]}) for i in ids]


def dying_after(batches: list[pa.RecordBatch], n: int) -> Iterator[pa.RecordBatch]:
    """The first ``n`` batches, then the executor dies (as a lost task would)."""
    yield from batches[:n]
    raise RuntimeError("executor lost")


def dedup_plan(stack: Any, table: str) -> WritePlan:
    return WritePlan(config(stack, table, mode="dedup", block_rows="2"), "dedup")


def write(plan: WritePlan, batches: Any, attempt: int) -> Any:
    return write_dedup(plan, Task.of(_Ctx(0, attempt), "run", "b0", 0, 0.0), iter(batches))


def counts(ch: Any, table: str) -> tuple[int, int]:
    return tuple(ch.query(f"SELECT count(), uniqExact(id) FROM {table}").result_rows[0])


def test_a_replay_after_the_window_forgot_the_first_blocks_is_refused_not_duplicated(
    stack, ch, fresh_db
):
    """The issue's case: window=3, blocks of 2 partitions (2 parts each), a replay of the
    first block after more than 3 parts were inserted: refused, the target keeps no copy."""
    table = f"{fresh_db}.t"
    ch.command(TWO_PARTITIONS.format(t=table) + " SETTINGS non_replicated_deduplication_window=3")
    plan = dedup_plan(stack, table)
    rows = two_partition_rows(3)
    with pytest.raises((DedupWindowExceeded, RuntimeError)):
        write(plan, dying_after(rows, 5), attempt=0)
    # another writer inserts into both partitions: the window now lacks block 0's parts
    ch.insert_arrow(table, pa.table({"id": [100, 101], "p": [1, 2]}))
    with pytest.raises(DedupWindowExceeded) as err:
        write(plan, rows, attempt=1)
    msg = str(err.value)
    assert table in msg and "non_replicated_deduplication_window=3" in msg
    assert "EVICTED" in msg and "runbook-dedup-window-exceeded" in msg
    n, unique = counts(ch, table)
    assert n == unique, f"{n - unique} duplicated row(s)"
    # raising the window now cannot bring the forgotten tokens back: still refused
    ch.command(f"ALTER TABLE {table} MODIFY SETTING non_replicated_deduplication_window = 1000")
    with pytest.raises(DedupWindowExceeded):
        write(plan, rows, attempt=2)
    assert counts(ch, table) == (n, unique)


def test_a_partition_stops_before_it_outgrows_the_window_and_resumes_once_raised(
    stack, ch, fresh_db
):
    table = f"{fresh_db}.t"
    ch.command(TWO_PARTITIONS.format(t=table) + " SETTINGS non_replicated_deduplication_window=3")
    plan = dedup_plan(stack, table)
    rows = two_partition_rows(3)
    with pytest.raises(DedupWindowExceeded) as err:
        write(plan, rows, attempt=0)
    msg = str(err.value)
    assert "block 1" in msg and "NO_ROOM" in msg and "the next block may add 2" in msg
    assert f"ALTER TABLE {table} MODIFY SETTING non_replicated_deduplication_window =" in msg
    assert counts(ch, table) == (2, 2), "block 0 only: block 1 must not be sent"
    ch.command(f"ALTER TABLE {table} MODIFY SETTING non_replicated_deduplication_window = 100")
    message = write(plan, rows, attempt=1)
    assert message.extra["decision"] == "RESUME"
    assert counts(ch, table) == (6, 6)


def test_a_replay_within_the_window_resumes_and_deduplicates(stack, ch, fresh_db):
    table = f"{fresh_db}.t"
    ch.command(TWO_PARTITIONS.format(t=table) + " SETTINGS non_replicated_deduplication_window=100")
    plan = dedup_plan(stack, table)
    rows = two_partition_rows(4)
    with pytest.raises(RuntimeError):
        write(plan, dying_after(rows, 5), attempt=0)  # blocks 0, 1 landed; 2 recorded
    assert counts(ch, table) == (4, 4)
    message = write(plan, rows, attempt=1)
    assert message.extra["decision"] == "RESUME" and message.rows == 8
    assert counts(ch, table) == (8, 8)


# ------------------------------------------------------------------ the record never shrinks


def test_a_stale_attempt_cannot_shrink_the_partition_record_on_zookeeper(stack):
    """Two attempts of one partition read the record, the first records three blocks, the
    second (a zombie with the old read) tries to record one: it loses, re-reads, and a
    shorter write is refused. The record keeps three blocks."""
    cfg = config(stack, "db.t")
    reg_a, reg_b = open_registry(cfg), open_registry(cfg)
    key = dedup.partition_key("b0", 0)
    blocks = tuple(dedup.BlockFingerprint(i, 2, f"b2:{i}") for i in range(3))
    track = dedup_window.Track(dedup_window.Mark(0, 1.0), 100, None, 0)
    try:
        refused = ContentChanged
        a = StateCell(reg_a, cfg.job, key, refused)
        b = StateCell(reg_b, cfg.job, key, refused)  # read before a wrote anything
        for n in (1, 2, 3):
            assert a.propose(dedup.before(blocks[:n], 0, 1.0, track))
        assert not b.propose(dedup.before(blocks[:1], 1, 2.0, track)), "the stale write won"
        assert b.state is not None and len(b.state.blocks) == 3  # b re-read the record
        with pytest.raises(ContentChanged, match="shrink the record from 3 to 1"):
            b.propose(dedup.after(blocks[:1], 1, 2.0, track))
        stored = dedup.PartitionState.from_json(reg_a.get_blob(cfg.job, key))
        assert stored is not None and stored.blocks == blocks
        assert stored.status is dedup.Status.BEFORE
    finally:
        reg_a.close()
        reg_b.close()
