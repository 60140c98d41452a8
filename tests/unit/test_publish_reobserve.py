"""A ClickHouse failure with an unknown outcome during publish is re-observed, never
repeated blindly (issue 16): the commit waits until the server is quiet, plans again from
what it sees, and ends with every row exactly once, or gives up leaving the xid PREPARED."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from tests.unit.test_transaction_model import JOB, TARGET, stage_batch
from txsink.errors import FencedError, RetryableConflict, TxSinkError, UnavailableError
from txsink.ports.registry_memory import MemoryRegistry
from txsink.ports.warehouse_memory import MemoryWarehouse
from txsink.protocol.states import XidState
from txsink.transactor import Transactor


class LossyWarehouse(MemoryWarehouse):
    """The first ``lost`` MOVEs land but their replies are lost; the first ``busy`` ones
    are refused before anything happens; ``settle`` is busy ``running`` times first."""

    def __init__(self, lost: int = 0, busy: int = 0, running: int = 0) -> None:
        super().__init__()
        self.lost, self.busy, self.running = lost, busy, running
        self.settled: list[tuple[str, ...]] = []

    def move_partition(self, staging: str, partition_id: str, target: str) -> None:
        if self.busy:
            self.busy -= 1
            raise RetryableConflict("code 252: too many parts")
        super().move_partition(staging, partition_id, target)
        if self.lost:
            self.lost -= 1
            raise UnavailableError("connection reset by peer")

    def settle(self, names: Sequence[str]) -> bool:
        self.settled.append(tuple(names))
        if self.running:
            self.running -= 1
            return False
        return True


def commit_one(wh: MemoryWarehouse, **kwargs: float) -> tuple[Transactor, MemoryRegistry]:
    reg = MemoryRegistry()
    tx = Transactor(reg, wh, JOB, sleep=lambda s: None, **kwargs)
    epoch = tx.begin("run-1")
    parts = stage_batch(wh, epoch.number, 0, [(1, "a"), (2, "a"), (3, "b")], 2, 0)
    result = tx.commit_batch(epoch, "b0", 0, TARGET, parts, streaming=True)
    assert result.action == "committed"
    return tx, reg


def test_a_move_whose_reply_was_lost_is_not_moved_again_and_the_batch_commits() -> None:
    wh = LossyWarehouse(lost=2, running=1)
    tx, reg = commit_one(wh)
    assert wh.target_ids(TARGET) == [1, 2, 3]
    assert reg.get(JOB, "b0").state is XidState.COMMITTED  # type: ignore[union-attr]
    assert wh.settled and all(n[0].startswith(tx.prefix + "__b0__") for n in wh.settled)
    assert wh.staging == {}  # staging dropped after COMMITTED


def test_a_busy_server_is_waited_out_within_the_commit() -> None:
    wh = LossyWarehouse(busy=3)
    commit_one(wh)
    assert wh.target_ids(TARGET) == [1, 2, 3]


def test_without_publish_retries_the_xid_stays_prepared_and_recovery_finishes_it() -> None:
    wh = LossyWarehouse(lost=1)
    reg = MemoryRegistry()
    tx = Transactor(reg, wh, JOB, publish_retry_s=0, sleep=lambda s: None)
    epoch = tx.begin("run-1")
    parts = stage_batch(wh, epoch.number, 0, [(1, "a"), (2, "b")], 1, 0)
    with pytest.raises(UnavailableError):
        tx.commit_batch(epoch, "b0", 0, TARGET, parts, streaming=True)
    assert reg.get(JOB, "b0").state is XidState.PREPARED  # type: ignore[union-attr]
    Transactor(reg, wh, JOB).begin("run-2")
    assert wh.target_ids(TARGET) == [1, 2]


def test_a_server_never_seen_quiet_gets_no_second_move_and_the_xid_stays_prepared() -> None:
    wh = LossyWarehouse(lost=1, running=10**9)  # the first MOVE's statement "never ends"
    reg = MemoryRegistry()
    tx = Transactor(reg, wh, JOB, publish_retry_s=0.2, sleep=lambda s: None)
    epoch = tx.begin("run-1")
    parts = stage_batch(wh, epoch.number, 0, [(1, "a"), (2, "b")], 1, 0)
    with pytest.raises(UnavailableError):
        tx.commit_batch(epoch, "b0", 0, TARGET, parts, streaming=True)
    assert wh.moves == 1  # nothing sent while the first statement may still run
    assert reg.get(JOB, "b0").state is XidState.PREPARED  # type: ignore[union-attr]


class FlakyDrop(LossyWarehouse):
    """The DROP of the second staging table fails once after the xid is COMMITTED."""

    def __init__(self) -> None:
        super().__init__()
        self.drops = 0

    def drop_staging(self, table: str) -> None:
        self.drops += 1
        if self.drops == 2:
            raise UnavailableError("connection reset during DROP")
        super().drop_staging(table)


def test_a_rerun_after_the_record_was_committed_drops_leftovers_and_raises_no_alarm() -> None:
    wh = FlakyDrop()
    reg = MemoryRegistry()
    tx = Transactor(reg, wh, JOB, sleep=lambda s: None)
    epoch = tx.begin("run-1")
    parts = stage_batch(wh, epoch.number, 0, [(1, "a"), (2, "b")], 2, 0)  # two tables
    assert tx.commit_batch(epoch, "b0", 0, TARGET, parts, streaming=True).action == "committed"
    assert wh.target_ids(TARGET) == [1, 2] and wh.staging == {}


class TakenOver(LossyWarehouse):
    """A lost MOVE reply, and meanwhile `txsink recover` takes the job."""

    def __init__(self, reg: MemoryRegistry) -> None:
        super().__init__(lost=1)
        self.reg = reg

    def settle(self, names: Sequence[str]) -> bool:
        if not self.settled:
            self.reg.take_epoch(JOB, "txsink-recover")
        return super().settle(names)


def test_a_writer_that_lost_the_job_while_re_observing_moves_nothing_more() -> None:
    reg = MemoryRegistry()
    wh = TakenOver(reg)
    tx = Transactor(reg, wh, JOB, sleep=lambda s: None)
    epoch = tx.begin("run-1")
    parts = stage_batch(wh, epoch.number, 0, [(1, "a"), (2, "b")], 1, 0)
    with pytest.raises(FencedError):
        tx.commit_batch(epoch, "b0", 0, TARGET, parts, streaming=True)
    assert wh.moves == 1


class DropRefused(MemoryWarehouse):
    """Every DROP of staging fails for good (e.g. a statement over max_query_size)."""

    def drop_stagings(self, tables: Sequence[str], *, wait: bool = True) -> None:
        raise TxSinkError("code 62: Max query size exceeded")

    def drop_staging(self, table: str) -> None:
        raise TxSinkError("code 62: Max query size exceeded")


def test_a_commit_recorded_committed_is_not_reported_failed_when_dropping_staging_fails() -> None:
    """Else a save without txn_version, re-run by its caller, writes its rows twice."""
    wh = DropRefused()
    assert_committed_despite_cleanup(wh)
    assert wh.staging  # left for recovery, which drops staging of committed xids


def assert_committed_despite_cleanup(wh: MemoryWarehouse) -> None:
    """One two-row batch committed through ``wh``: reported committed, rows published,
    record COMMITTED, whatever ``wh`` does to the cleanup after COMMITTED."""
    reg = MemoryRegistry()
    tx = Transactor(reg, wh, JOB, publish_retry_s=0.2, sleep=lambda s: None)
    epoch = tx.begin("run-1")
    parts = stage_batch(wh, epoch.number, 0, [(1, "a"), (2, "b")], 2, 0)
    assert tx.commit_batch(epoch, "b0", 0, TARGET, parts, streaming=True).action == "committed"
    assert wh.target_ids(TARGET) == [1, 2]
    assert reg.get(JOB, "b0").state is XidState.COMMITTED


def test_a_committed_xid_whose_server_stays_down_for_the_cleanup_is_not_reported_failed() -> None:
    """The DROP after COMMITTED fails with an unknown outcome and the server is never seen
    quiet again: the give-up path (re-observe deadline) also reads the record first."""

    class DownAfterCommit(MemoryWarehouse):
        def drop_stagings(self, tables: Sequence[str], *, wait: bool = True) -> None:
            raise UnavailableError("connection refused")

        def settle(self, names: Sequence[str]) -> bool:
            return False

    assert_committed_despite_cleanup(DownAfterCommit())


def test_a_publish_that_fails_before_committed_still_raises() -> None:
    class MoveRefused(MemoryWarehouse):
        def move_partition(self, staging: str, partition_id: str, target: str) -> None:
            raise TxSinkError("code 62: Max query size exceeded")

    wh = MoveRefused()
    reg = MemoryRegistry()
    tx = Transactor(reg, wh, JOB, publish_retry_s=0.2, sleep=lambda s: None)
    epoch = tx.begin("run-1")
    parts = stage_batch(wh, epoch.number, 0, [(1, "a")], 1, 0)
    with pytest.raises(TxSinkError, match="code 62"):
        tx.commit_batch(epoch, "b0", 0, TARGET, parts, streaming=True)
    assert reg.get(JOB, "b0").state is XidState.PREPARED


def test_busy_answers_are_waited_out_with_a_doubling_pause() -> None:
    """The backoff between attempts (tenacity, PublishBounds) doubles from pause_s."""
    wh = LossyWarehouse(busy=3)
    reg = MemoryRegistry()
    pauses: list[float] = []
    tx = Transactor(reg, wh, JOB, sleep=pauses.append)
    epoch = tx.begin("run-1")
    parts = stage_batch(wh, epoch.number, 0, [(1, "a"), (2, "b")], 1, 0)
    assert tx.commit_batch(epoch, "b0", 0, TARGET, parts, streaming=True).action == "committed"
    assert pauses == [0.2, 0.4, 0.8]
    assert wh.target_ids(TARGET) == [1, 2]
