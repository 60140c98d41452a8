"""visibility=batch publishes with ATTACH, which copies: two finishers of one PREPARED xid
(a takeover and a forced recover, two recoverers, a superseded driver) must never both
attach it, and a roll-forward that comes after the target merged the attached parts away
(their UUIDs gone) must still see that the ATTACH landed. Real engine behind the real
HTTP endpoint, real ZooKeeper, the real Transactor, one connection per finisher.

The invariant: count() == uniqExact(id) == rows produced, after every trial.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from typing import Any

import pytest

from tests.integration.conftest import client_for
from tests.integration.nemesis.test_clickhouse_faults import copy_some_parts, stage_parts
from tests.integration.nemesis.test_keeper_faults import at, open_handle
from tests.integration.test_rollback_races import counts, prepared_record
from tests.nemesis.services import Services
from txsink.driver import JobHandle, open_job
from txsink.errors import RecoveryAlarm, TxSinkError
from txsink.protocol.sequence import attach_tag
from txsink.protocol.states import Visibility, XidRecord, XidState

TRIALS = int(os.environ.get("TXSINK_RACE_TRIALS", "5"))  # make test-slow: 30
ROWS = 200


def batch_prepared(handle: JobHandle, epoch: Any, xid: str, ids: range) -> XidRecord:
    """``ids`` staged by one task (two blocks) and ``xid`` PREPARED with visibility=batch:
    the record as Keeper holds it."""
    parts = stage_parts(handle, xid, ids, blocks=2)
    record = prepared_record(handle, epoch, xid, parts)
    record = dataclasses.replace(record, visibility=Visibility.BATCH)
    handle.registry.prepare(epoch, record)
    stored = handle.registry.get(handle.config.job, xid)
    assert stored is not None and stored.state is XidState.PREPARED
    return stored


def test_two_finishers_racing_on_a_batch_xid_never_attach_it_twice(
    nemesis: Services, ch: Any, target: str
) -> None:
    first = open_handle(nemesis, target)
    second = open_job(first.config)
    try:
        epoch = first.transactor.begin("writer")
        for trial in range(TRIALS):
            xid = f"b{trial + 1}"
            batch_prepared(first, epoch, xid, range(trial * ROWS, (trial + 1) * ROWS))
            go = threading.Barrier(2)
            failures: list[str] = []

            def finish(
                handle: JobHandle,
                owner: str,
                failures: list[str] = failures,
                go: threading.Barrier = go,
            ) -> None:
                go.wait()
                try:
                    handle.transactor.begin(owner)  # takes the job, rolls the xid forward
                except TxSinkError as exc:  # the loser is fenced or finds it done
                    failures.append(f"{owner}: {exc}")

            runners = [
                threading.Thread(target=finish, args=(h, f"{n}-{trial}"))
                for n, h in (("recover-a", first), ("recover-b", second))
            ]
            for runner in runners:
                runner.start()
            for runner in runners:
                runner.join(120)
            epoch = first.transactor.begin(f"writer-{trial}")  # whatever is left, finished
            assert counts(ch, target) == ((trial + 1) * ROWS, (trial + 1) * ROWS), failures
            record = first.registry.get(first.config.job, xid)
            assert record is not None and record.state is XidState.COMMITTED
        assert first.warehouse.list_staging(first.transactor.prefix) == []
    finally:
        first.close()
        second.close()


class Crash(BaseException):
    """The driver dies here (nothing below catches a BaseException)."""


def attached_then_merged_away(crashed: Any, ch: Any, target: str) -> Any:
    """Batch b1 prepared and attached by ``crashed``, whose driver then dies before it
    records COMMITTED; the target merges the attached parts away and cleans them up.
    Returns the PREPARED record."""
    tx = crashed.transactor
    epoch = tx.begin("run-1")
    record = batch_prepared(crashed, epoch, "b1", range(0, ROWS))

    def die() -> None:
        raise Crash

    tx.fault = at("driver.after_attach", die)
    with pytest.raises(Crash):
        tx.publish(epoch, record, resumed=False)  # the first attempt
    assert counts(ch, target) == (ROWS, ROWS)
    merge_attached_parts_away(ch, target)
    return record


def merge_attached_parts_away(ch: Any, target: str) -> None:
    """Merge the parts an ATTACH put in ``target`` and wait until the replaced (outdated)
    ones are cleaned up too, so that no part UUID shows the ATTACH; ``target`` needs
    ``old_parts_lifetime = 1, cleanup_delay_period = 1, cleanup_delay_period_random_add
    = 0``. The server drops replaced parts when it loads a table (a restart), not only
    after old_parts_lifetime: detach and attach it rather than wait for the cleanup (a
    server that loads outdated parts back keeps them until the cleanup thread runs)."""
    ch.command(f"OPTIMIZE TABLE {target} FINAL")
    ch.command(f"DETACH TABLE {target} SYNC")
    ch.command(f"ATTACH TABLE {target}")
    db, name = target.split(".")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # the attached parts merged and cleaned up
        left = ch.query(
            "SELECT count() FROM system.parts WHERE database = {d:String} AND "
            "table = {t:String} AND level = 0",
            parameters={"d": db, "t": name},
        ).result_rows[0][0]
        if left == 0:
            return
        time.sleep(0.5)
    raise AssertionError("the target kept the attached parts: the test proves nothing")


def test_a_roll_forward_after_the_target_merged_the_attached_parts_away_attaches_nothing(
    nemesis: Services, ch: Any, target: str
) -> None:
    """The driver dies right after the ATTACH; the target then merges the attached parts
    and cleans up the replaced ones (seconds here, ``old_parts_lifetime`` on a server), so
    no UUID shows the ATTACH landed. The finished ATTACH in system.query_log does."""
    ch.command(
        f"ALTER TABLE {target} MODIFY SETTING old_parts_lifetime = 1, "
        "cleanup_delay_period = 1, cleanup_delay_period_random_add = 0"
    )
    crashed = open_handle(nemesis, target)
    try:
        attached_then_merged_away(crashed, ch, target)
        later = open_job(crashed.config)  # the restart, another process
        try:
            later.transactor.begin("run-2")
        finally:
            later.close()
        fresh = client_for(nemesis.info)
        try:
            assert counts(fresh, target) == (ROWS, ROWS)
        finally:
            fresh.close()
        done = crashed.registry.get(crashed.config.job, "b1")
        assert done is not None and done.state is XidState.COMMITTED
    finally:
        crashed.close()


def test_a_column_added_between_two_tasks_of_a_batch_xid_is_published_exact(
    nemesis: Services, ch: Any, target: str
) -> None:
    """``ALTER TABLE target ADD COLUMN`` after the first task staged and before the second:
    the batch staging is made from the target as it is at publish time, so the older
    task's staging catches up with it and the newer one moves as it is (before, the batch
    staging copied the first task's older staging and every publish raised RecoveryAlarm)."""
    handle = open_handle(nemesis, target)
    try:
        tx = handle.transactor
        epoch = tx.begin("run-1")
        old = stage_parts(handle, "b1", range(0, ROWS), blocks=1)
        ch.command(f"ALTER TABLE {target} ADD COLUMN note String DEFAULT 'added'")
        newer = stage_parts(handle, "b1", range(ROWS, 2 * ROWS), blocks=1, task=1)
        record = prepared_record(handle, epoch, "b1", [*old, *newer])
        record = dataclasses.replace(record, visibility=Visibility.BATCH)
        handle.registry.prepare(epoch, record)
        stored = handle.registry.get(handle.config.job, "b1")
        assert stored is not None
        tx.publish(epoch, stored, resumed=False)
        assert counts(ch, target) == (2 * ROWS, 2 * ROWS)
        notes = ch.query(f"SELECT uniqExact(note), any(note) FROM {target}").result_rows[0]
        assert notes == (1, "added")
        done = handle.registry.get(handle.config.job, "b1")
        assert done is not None and done.state is XidState.COMMITTED
        assert handle.warehouse.list_staging(tx.prefix) == []
    finally:
        handle.close()


def test_a_consolidation_cut_between_parts_repairs_itself_with_no_operator(
    nemesis: Services, ch: Any, target: str
) -> None:
    """The server crashed inside the copy (or an older txsink's MOVE) of a task partition
    into the batch staging: half of its parts are in the batch staging, all still in the
    task staging (made as the crash leaves it). The restart's recovery builds the batch
    staging again from the whole task staging and publishes the batch exactly once."""
    handle = open_handle(nemesis, target)
    try:
        tx = handle.transactor
        epoch = tx.begin("run-1")
        record = batch_prepared(handle, epoch, "b1", range(0, ROWS))
        part = record.manifest[0]
        staging_db = handle.warehouse.staging_db
        bst = tx.batch_tables(record)[target]
        handle.warehouse.create_batch_staging(bst, part.table, target)
        pid = part.partition_id
        source, dest = f"{staging_db}.{part.table}", f"{staging_db}.{bst}"
        assert copy_some_parts(ch, source, dest, pid, keep=1) == 2
        tx.begin("run-2")  # the restart's recovery
        assert counts(ch, target) == (ROWS, ROWS)
        done = handle.registry.get(handle.config.job, "b1")
        assert done is not None and done.state is XidState.COMMITTED
        assert not done.cut(part.table, pid)  # nothing left the task staging: built again
        assert handle.warehouse.list_staging(tx.prefix) == []
    finally:
        handle.close()


def test_a_batch_xid_whose_staging_vanished_is_an_alarm_not_committed(
    nemesis: Services, ch: Any, target: str
) -> None:
    """Task staging emptied by a hand and no batch staging under any name: before, read as
    "attached and dropped" and recorded COMMITTED with nothing in the target (a silent
    loss). Only the query log may prove such a batch; without it, an alarm."""
    handle = open_handle(nemesis, target)
    try:
        tx = handle.transactor
        epoch = tx.begin("run-1")
        record = batch_prepared(handle, epoch, "b1", range(0, ROWS))
        for part in record.manifest:
            ch.command(
                f"ALTER TABLE {handle.warehouse.staging_db}.{part.table} "
                f"DROP PARTITION ID '{part.partition_id}'"
            )
        with pytest.raises(RecoveryAlarm, match="nothing proves"):
            tx.begin("run-2")
        assert counts(ch, target) == (0, 0)
        still = handle.registry.get(handle.config.job, "b1")
        assert still is not None and still.state is XidState.PREPARED
    finally:
        handle.close()


def test_a_late_roll_forward_whose_attach_log_line_a_ttl_deleted_is_an_alarm_not_a_second_attach(
    nemesis: Services, ch: Any, target: str
) -> None:
    """The roll-forward above, once the query log's TTL has deleted the ATTACH's line
    too, with no server restart (issue 38 row 3): nothing proves the ATTACH landed any
    more. The old code attached the batch a second time; it must be a RecoveryAlarm that
    names the query log's TTL, nothing attached."""
    ch.command(
        f"ALTER TABLE {target} MODIFY SETTING old_parts_lifetime = 1, "
        "cleanup_delay_period = 1, cleanup_delay_period_random_add = 0"
    )
    # the server must not look restarted since the PREPARE (uptime() counts whole
    # seconds, clocks may be CLOCK_SKEW_S apart): a fresh stack is up for a few seconds
    deadline = time.monotonic() + 30
    while ch.query("SELECT uptime()").result_rows[0][0] < 4 and time.monotonic() < deadline:
        time.sleep(0.2)
    crashed = open_handle(nemesis, target)
    try:
        tx = crashed.transactor
        record = attached_then_merged_away(crashed, ch, target)
        tag = attach_tag(tx.prefix, record, target)
        ch.command("SYSTEM FLUSH LOGS")
        assert logged_attaches(ch, tag) == 1, "no ATTACH line to delete: proves nothing"
        ch.command("ALTER TABLE system.query_log MODIFY TTL event_time + INTERVAL 1 SECOND")
        try:
            deadline = time.monotonic() + 30
            while logged_attaches(ch, tag) and time.monotonic() < deadline:
                time.sleep(0.5)  # the line expires a second after the ATTACH
                ch.command("OPTIMIZE TABLE system.query_log FINAL")  # the TTL deletes it
            assert logged_attaches(ch, tag) == 0, "the TTL kept the ATTACH's line"
            later = open_job(crashed.config)
            try:
                with pytest.raises(RecoveryAlarm, match=r"system\.query_log keeps lines"):
                    later.transactor.begin("run-2")
            finally:
                later.close()
        finally:
            ch.command("ALTER TABLE system.query_log REMOVE TTL")
        assert counts(ch, target) == (ROWS, ROWS)  # attached once, not twice
        still = crashed.registry.get(crashed.config.job, "b1")
        assert still is not None and still.state is XidState.PREPARED
    finally:
        crashed.close()


def logged_attaches(ch: Any, tag: str) -> int:
    """Finished ATTACHes tagged ``tag`` that ``system.query_log`` holds."""
    return int(
        ch.query(
            "SELECT count() FROM system.query_log WHERE log_comment = {tag:String} "
            "AND type = 'QueryFinish'",
            parameters={"tag": tag},
        ).result_rows[0][0]
    )
