"""Roll-backs racing prepares on the real engine and ZooKeeper (issue 10, row 5).

ClickHouse-side drops cannot be fenced by ClickHouse; they are fenced by the xid node in
Keeper: every roll-back writes an ABORTED tombstone first, and a prepare that lands later
(its reply was lost, or its writer was paused) can never adopt a dropped table. Each test
ends with the rows a user expects: all of them exactly once, or none and a replay that
writes them.
"""

from __future__ import annotations

import os
import random
import threading
import time
import uuid
from typing import Any

import pyarrow as pa
import pytest

from txsink.config import WriterConfig
from txsink.driver import JobHandle, open_job
from txsink.errors import TxSinkError
from txsink.ports.registry import XidExists
from txsink.protocol import plans
from txsink.protocol.ids import staging_name
from txsink.protocol.states import Mode, StagedPart, Visibility, XidRecord, XidState
from txsink.protocol.visibility import gathering

SCHEMA = pa.schema([("id", pa.int64()), ("p", pa.uint8())])


@pytest.fixture
def target(ch: Any, fresh_db: str) -> str:
    table = f"{fresh_db}.t"
    ch.command(
        f"CREATE TABLE {table} (id Int64, p UInt8) ENGINE = MergeTree PARTITION BY p ORDER BY id"
    )
    return table


@pytest.fixture
def handle(stack: Any, target: str) -> Any:
    config = WriterConfig.from_options(
        {
            "url": stack.url,
            "keeper": stack.keeper,
            "table": target,
            "job": f"race-{uuid.uuid4().hex[:8]}",
        }
    )
    opened = open_job(config)
    opened.warehouse.ensure_staging_db()
    yield opened
    opened.close()


def stage(handle: JobHandle, xid: str, run: str, ids: range) -> list[StagedPart]:
    """One task attempt's staging table holding ``ids`` over two partitions."""
    cfg = handle.config
    name = staging_name(cfg.job, xid, run, 0, 0, ids.start, handle.transactor.namespace).table
    handle.warehouse.create_staging(cfg.table, name)
    block = pa.record_batch({"id": list(ids), "p": [i % 2 for i in ids]}, schema=SCHEMA)
    handle.warehouse.insert_blocks(name, [block], block_rows=10_000, block_bytes=1 << 24)
    view = handle.warehouse.staging_view([name])[name] or {}
    return [StagedPart(name, pid, n) for pid, n in sorted(view.items())]


def prepared_record(handle: JobHandle, epoch: Any, xid: str, parts: list[StagedPart]) -> XidRecord:
    return XidRecord(
        handle.config.job,
        xid,
        int(xid[1:]),
        XidState.PREPARED,
        epoch.number,
        Mode.ATTACH,
        handle.config.table,
        tuple(parts),
        created_at=time.time(),
    )


def counts(ch: Any, table: str) -> tuple[int, int]:
    return tuple(ch.query(f"SELECT count(), uniqExact(id) FROM {table}").result_rows[0])  # type: ignore[return-value]


def test_a_prepare_that_lands_after_the_abort_publishes_nothing_and_the_replay_is_exact(
    handle, ch, target
):
    tx = handle.transactor
    epoch = tx.begin("run-1")
    parts = stage(handle, "b0", "0000000a", range(0, 100))
    tables = sorted({p.table for p in parts})
    late: dict[str, Any] = {}

    def lands_a_second_later() -> None:  # the prepare whose reply the driver never heard
        time.sleep(1.0)
        try:
            late["record"] = handle.registry.prepare(
                epoch, prepared_record(handle, epoch, "b0", parts)
            )
        except XidExists as exc:
            late["refused"] = exc.existing

    flight = threading.Thread(target=lands_a_second_later)
    flight.start()
    assert tx.roll_back("b0", tables) == tables  # Spark's abort(): tombstone, then drop
    flight.join()
    assert "record" not in late and late["refused"].state is XidState.ABORTED
    assert counts(ch, target) == (0, 0)
    assert handle.warehouse.list_staging(tx.prefix) == []

    replay = stage(handle, "b0", "0000000b", range(0, 100))  # the restarted query
    epoch2 = tx.begin("run-2", keep={p.table for p in replay})
    assert tx.commit_batch(epoch2, "b0", 0, target, replay, streaming=True).action == "committed"
    assert counts(ch, target) == (100, 100)


def test_an_abort_after_a_prepare_that_landed_keeps_the_staging_and_recovery_is_exact(
    handle, ch, target
):
    tx = handle.transactor
    epoch = tx.begin("run-1")
    parts = stage(handle, "b0", "0000000a", range(0, 50))
    handle.registry.prepare(epoch, prepared_record(handle, epoch, "b0", parts))  # reply lost
    assert tx.roll_back("b0", sorted({p.table for p in parts})) == []  # abort drops nothing
    tx.begin("run-2")  # the restart's recovery rolls the PREPARED xid forward
    assert counts(ch, target) == (50, 50)
    assert handle.registry.get(handle.config.job, "b0").state is XidState.COMMITTED


def test_a_paused_recoverer_wakes_after_a_newer_writer_prepared_and_drops_nothing(
    stack, handle, ch, target
):
    recoverer_handle = open_job(handle.config)
    try:
        recoverer = recoverer_handle.transactor
        recoverer.begin("txsink-recover@test")
        parts = stage(handle, "b0", "0000000c", range(0, 80))  # a new run's tasks wrote
        stale = plans.plan_recovery(
            handle.config.job,
            recoverer.registry.list(handle.config.job),
            recoverer_handle.warehouse.list_staging(recoverer.prefix),
            recoverer.namespace,
        )
        assert set(stale.roll_back) == {p.table for p in parts}  # orphans, as seen then
        tx = handle.transactor
        epoch = tx.begin("run-2", keep={p.table for p in parts})  # fences the recoverer
        handle.registry.prepare(epoch, prepared_record(handle, epoch, "b0", parts))
        assert recoverer.roll_back_tables(stale.roll_back) == []  # wakes up: drops nothing
        tx.begin("run-3")
        assert counts(ch, target) == (80, 80)
    finally:
        recoverer_handle.close()


RACES = int(os.environ.get("TXSINK_RACE_TRIALS", "5"))  # make test-slow: 30


def test_a_fresh_gathered_commit_racing_a_takeover_publishes_each_batch_once_or_not_at_all(
    handle: JobHandle, ch: Any, target: str
) -> None:
    """The driver's fresh commit of a gathered batch (one CREATE ... AS SELECT makes and
    fills its batch staging, then the epoch check and the ATTACH) while a second writer
    takes the job over after a random pause: before the prepare (the commit is fenced,
    the takeover rolls the orphan back), between the CREATE and the epoch check (the
    commit is fenced, the takeover rolls the xid forward from the batch staging it finds
    or builds), after the check (the takeover claims the table away and waits out the
    ATTACH). Every batch ends published once or not at all, never twice; the takeover's
    recovery needs no operator."""
    rng = random.Random(39)
    other = open_job(handle.config)
    published, outcomes = 0, []
    try:
        epoch = handle.transactor.begin("writer")
        for trial in range(RACES):
            xid, ids = f"b{trial + 1}", range(trial * 200, (trial + 1) * 200)
            parts = [
                p
                for task, half in enumerate((ids[:100], ids[100:]))
                for p in stage_in_blocks(handle, xid, task, half)
            ]
            look = handle.warehouse.commit_look({p.table for p in parts}, views_of=target)
            how = gathering("MergeTree", parts, look.columns, look.sizes, 1 << 30, look.shape)
            assert how is not None and how.shape is not None  # the one-statement CREATE
            errors = race(handle, other, epoch, xid, parts, how, rng.uniform(0.0, 0.25))
            epoch = handle.transactor.begin(f"writer-{trial}")  # whatever is left, finished
            record = handle.registry.get(handle.config.job, xid)
            done = record is not None and record.state is XidState.COMMITTED
            published += len(ids) if done else 0
            outcomes.append(done)
            assert counts(ch, target) == (published, published), (trial, errors)
        assert handle.warehouse.list_staging(handle.transactor.prefix) == []
        assert any(outcomes), outcomes  # the race was not lost every time
    finally:
        other.close()


def race(
    handle: JobHandle, other: JobHandle, epoch: Any, xid: str, parts: Any, how: Any, pause: float
) -> list[str]:
    """``handle``'s fresh commit of ``xid`` and, ``pause`` seconds after it starts,
    ``other``'s takeover; what each refused with."""
    go = threading.Barrier(2)
    errors: list[str] = []
    target = handle.config.table

    def commit() -> None:
        go.wait()
        try:
            handle.transactor.commit_batch(
                epoch, xid, int(xid[1:]), target, parts, Mode.ATTACH,
                visibility=Visibility.BATCH, gather={target: how},
            )  # fmt: skip
        except TxSinkError as exc:
            errors.append(f"commit: {exc}")

    def take_over() -> None:
        go.wait()
        time.sleep(pause)
        try:
            other.transactor.begin(f"taker-{xid}")
        except TxSinkError as exc:
            errors.append(f"takeover: {exc}")

    runners = [threading.Thread(target=commit), threading.Thread(target=take_over)]
    for runner in runners:
        runner.start()
    for runner in runners:
        runner.join(120)
    return errors


def stage_in_blocks(handle: JobHandle, xid: str, task: int, ids: range) -> list[StagedPart]:
    """One task's staging holding ``ids`` over two partitions in two inserts (two parts
    per partition: the batch is gathered), with the part UUIDs a task message carries."""
    cfg = handle.config
    name = staging_name(cfg.job, xid, "0000000a", task, 0, ids.start, handle.transactor.namespace)
    handle.warehouse.create_staging(cfg.table, name.table)
    for chunk in (ids[: len(ids) // 2], ids[len(ids) // 2 :]):
        block = pa.record_batch({"id": list(chunk), "p": [i % 2 for i in chunk]}, schema=SCHEMA)
        handle.warehouse.insert_blocks(name.table, [block], block_rows=1 << 20, block_bytes=1 << 26)
    staged = handle.warehouse.staged_partitions(name.table)
    return [StagedPart(name.table, pid, n, uuids=u) for pid, (n, u) in sorted(staged.items())]
