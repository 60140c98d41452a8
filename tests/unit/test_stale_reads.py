"""Reads from a Keeper server that lags its leader (issue 23): every read that decides an
action no fenced write re-checks is synced first.

``Lagging`` plays a session on a ZooKeeper follower: after ``lag()`` its reads answer from
the tree as it was then, until the session syncs or writes (ZooKeeper shows a session its
own writes, not other sessions'). Each test first shows that the lag is observable (the
control), then that the decision made through the Transactor is the fresh one. Without
the ``sync`` before the decisive read each test fails.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Sequence
from typing import Any

import pytest

from tests.unit.test_publish_reobserve import LossyWarehouse
from tests.unit.test_transaction_model import JOB, TARGET, stage_batch
from txsink.errors import FencedError
from txsink.ports.registry_memory import MemoryRegistry
from txsink.ports.warehouse_memory import MemoryWarehouse
from txsink.protocol.states import XidState
from txsink.transactor import Transactor

READS = frozenset(
    {"job_meta", "blob_children", "list_jobs", "current_epoch", "owner", "get", "list",
     "ledger", "get_blob", "get_blob_versioned", "manifest_chunks", "batch_view"}
)  # fmt: skip
CATCH_UP = frozenset({"sync", "close", "namespace"})


class Lagging:
    """A session on a lagging server in front of the shared twin ``leader``."""

    def __init__(self, leader: MemoryRegistry) -> None:
        self.leader = leader
        self.frozen: MemoryRegistry | None = None
        self.syncs = 0

    def lag(self) -> None:
        """From now on reads see the tree as it is now, until a sync or a write."""
        snapshot = MemoryRegistry.__new__(MemoryRegistry)
        state = {k: v for k, v in vars(self.leader).items() if k not in ("_lock", "_clock")}
        vars(snapshot).update(copy.deepcopy(state))
        snapshot._lock = threading.RLock()
        snapshot._clock = self.leader._clock
        self.frozen = snapshot

    def sync(self, job: str) -> None:
        self.syncs += 1
        self.frozen = None

    def __getattr__(self, name: str) -> Any:
        if name in READS and self.frozen is not None:
            return getattr(self.frozen, name)
        if name not in READS and name not in CATCH_UP:
            self.frozen = None  # a write goes through the leader: the session catches up
        return getattr(self.leader, name)


class TakenOverWhileLagging(LossyWarehouse):
    """A lost MOVE reply; meanwhile the writer's server falls behind and another runner
    (`txsink recover`) takes the job on the leader."""

    def __init__(self, session: Lagging) -> None:
        super().__init__(lost=1)
        self.session = session

    def settle(self, names: Sequence[str]) -> bool:
        if not self.settled:
            self.session.lag()
            self.session.leader.take_epoch(JOB, "txsink-recover")
            stale = self.session.current_epoch(JOB)
            assert stale is not None and stale.owner == "run-1"  # the control: it lags
        return super().settle(names)


def test_a_superseded_writer_on_a_lagging_server_moves_nothing_more() -> None:
    leader = MemoryRegistry()
    session = Lagging(leader)
    wh = TakenOverWhileLagging(session)
    tx = Transactor(session, wh, JOB, sleep=lambda s: None)  # type: ignore[arg-type]
    epoch = tx.begin("run-1")
    parts = stage_batch(wh, epoch.number, 0, [(1, "a"), (2, "b")], 1, 0)
    with pytest.raises(FencedError):
        tx.commit_batch(epoch, "b0", 0, TARGET, parts, streaming=True)
    assert wh.moves == 1


def test_a_batch_committed_by_a_recoverer_is_skipped_not_rolled_forward_from_a_lagging_read() -> (
    None
):
    """A writer's new session lands on a server that has not seen `txsink recover` commit
    the batch: without a sync it would roll forward a PREPARED record whose staging is
    gone (a false lost-staging alarm); synced, the replay is a no-op."""
    leader, wh = MemoryRegistry(), MemoryWarehouse()
    first = Transactor(leader, wh, JOB, sleep=lambda s: None)
    epoch = first.begin("run-1")
    parts = stage_batch(wh, epoch.number, 0, [(1, "a"), (2, "b")], 1, 0)
    first.fault = lambda point: _crash(point, "driver.after_prepare")
    with pytest.raises(_Crash):
        first.commit_batch(epoch, "b0", 0, TARGET, parts, streaming=True)
    session = Lagging(leader)
    session.lag()  # the new session's server saw the prepare, not what follows
    Transactor(leader, wh, JOB, sleep=lambda s: None).begin("txsink-recover")
    stale = session.get(JOB, "b0")
    assert stale is not None and stale.state is XidState.PREPARED  # the control
    again = Transactor(session, wh, JOB, sleep=lambda s: None)  # type: ignore[arg-type]
    result = again.commit_batch(epoch, "b0", 0, TARGET, parts, streaming=True)
    assert result.action == "skipped"
    assert wh.target_ids(TARGET) == [1, 2]
    assert session.syncs >= 1


def test_recovery_lists_records_after_a_sync() -> None:
    leader, wh = MemoryRegistry(), MemoryWarehouse()
    session = Lagging(leader)
    tx = Transactor(session, wh, JOB, sleep=lambda s: None)  # type: ignore[arg-type]
    epoch = tx.begin("run-1")
    session.lag()
    before = session.syncs
    tx.recover(epoch, dry_run=True)
    assert session.syncs == before + 1 and session.frozen is None


class _Crash(Exception):
    pass


def _crash(point: str, at: str) -> None:
    if point == at:
        raise _Crash(point)


def test_a_commit_in_a_new_python_worker_on_a_lagging_server_keeps_its_runs_epoch() -> None:
    """Spark runs each micro-batch's commit in a fresh Python worker: the next batch's
    session may sit on a server that has not seen this run take the job. The committer
    syncs before its one read, so the run goes on under its epoch; read stale, it would
    take the job over again from itself (a new epoch, a second recovery)."""
    from txsink import committer
    from txsink.config import WriterConfig
    from txsink.driver import job_handle
    from txsink.protocol.ids import run_tag, staging_name
    from txsink.protocol.states import Mode
    from txsink.spark.messages import TxCommitMessage, WritePlan

    leader, wh = MemoryRegistry(), MemoryWarehouse()
    config = WriterConfig.from_options(
        {"url": "http://h:8123", "keeper": "k:2181", "table": TARGET, "job": JOB}
    )
    session = Lagging(leader)
    session.lag()  # the second worker's server: behind from before the run began

    def commit(handle: Any, batch: int) -> None:
        xid = f"b{batch}"
        table = staging_name(JOB, xid, run_tag("run-2"), 0, 0, batch, handle.transactor.namespace)
        wh.stage(table.table, {"202401": [batch]})
        msg = TxCommitMessage(
            "run-2", xid, batch, staging=(table.table,), inserted=((table.table, 1),),
            extra={"mode": "attach"},
        )  # fmt: skip
        plan = WritePlan(config, "attach")
        committer._commit_writes(handle, [(plan, [msg])], xid, batch, Mode.ATTACH, False, None)

    commit(job_handle(config, leader, wh), 0)  # the first worker takes the job, commits
    taken = leader.current_epoch(JOB)
    assert taken is not None and session.current_epoch(JOB) is None  # the control: it lags
    commit(job_handle(config, session, wh), 1)  # type: ignore[arg-type]
    assert leader.current_epoch(JOB) == taken  # no second takeover
    assert wh.target_ids(TARGET) == [0, 1]
