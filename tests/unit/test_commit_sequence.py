"""The commit of one batch as a sequence (txsink.protocol.commit): what it reads, decides
and writes, in which order, driven by a scripted runner (no stores). The stores' side
of each step is the runner's (tests/unit/test_transaction_model.py and the integration
tests run the same sequence on the memory twins and on the real engine)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from txsink.protocol import commit, steps
from txsink.protocol.states import Mode, StagedPart, XidRecord, XidState

PART = StagedPart("j__b1__r__0", "0", 10)


def record(xid: str = "b1", state: XidState = XidState.PREPARED, **kw: Any) -> XidRecord:
    fields: dict[str, Any] = dict(
        job="j", xid=xid, batch=int(xid[1:]), state=state, epoch=1, mode=Mode.ATTACH,
        target="d.t", manifest=(PART,), created_at=1.0,
    )  # fmt: skip
    return XidRecord(**(fields | kw))


def drive(run: Any, answer: Callable[[Any], Any]) -> tuple[Any, list[Any]]:
    """Send ``answer(step)`` back for each step; the return value and the steps seen."""
    seen: list[Any] = []
    reply: Any = None
    while True:
        try:
            step = run.send(reply)
        except StopIteration as done:
            return done.value, seen
        seen.append(step)
        if isinstance(step, steps.Stop):
            return step, seen
        reply = answer(step)


def stores(existing: XidRecord | None = None, last: int | None = None) -> Callable[[Any], Any]:
    def answer(step: Any) -> Any:
        if isinstance(step, steps.ReadBatchState):
            return existing, last
        if isinstance(step, steps.Prepare):
            return steps.Taken(existing) if existing is not None else step.record
        if isinstance(step, steps.PublishXid):
            return step.record.with_state(XidState.COMMITTED, committed_at=2.0), True
        if isinstance(step, steps.Abort):
            return record(state=XidState.ABORTED)
        return None

    return answer


def kinds(seen: list[Any]) -> list[str]:
    return [type(s).__name__ for s in seen if not isinstance(s, (steps.FaultPoint, steps.Note))]


def test_a_fresh_batch_reads_synced_prepares_then_publishes_with_the_owner_s_facts() -> None:
    done, seen = drive(commit.commit(commit.Ask(record(), rest={"state": "idle"})), stores())
    assert done.action == "committed" and done.record.state is XidState.COMMITTED
    assert kinds(seen) == ["Sync", "ReadBatchState", "Prepare", "Mark", "PublishXid", "Mark"]
    publish = next(s for s in seen if isinstance(s, steps.PublishXid))
    assert not publish.resumed and publish.rest == {"state": "idle", "last_xid": "b1",
                                                    "last_batch": 1}  # fmt: skip
    faults = [s.name for s in seen if isinstance(s, steps.FaultPoint)]
    assert faults == ["driver.before_prepare", "driver.after_prepare"]


def test_a_caller_that_read_after_its_sync_makes_the_commit_read_nothing() -> None:
    ask = commit.Ask(record(), synced=True, seen=(None, 0))
    _, seen = drive(commit.commit(ask), stores())
    assert kinds(seen)[:2] == ["Prepare", "Mark"]


def test_a_prepare_that_finds_the_xid_committed_skips_it_and_rests() -> None:
    """Another attempt prepared and committed it between the read and the prepare."""
    done_before = record(state=XidState.COMMITTED, committed_at=1.5)
    answer = stores()

    def racing(step: Any) -> Any:
        if isinstance(step, steps.Prepare):
            return steps.Taken(done_before)
        return answer(step)

    done, seen = drive(commit.commit(commit.Ask(record(), idle={"state": "idle"})), racing)
    assert done == commit.Committed("skipped")
    assert kinds(seen)[-1] == "Heartbeat" and seen[-1].best_effort
    assert not any(isinstance(s, steps.PublishXid) for s in seen)


def test_a_prepared_xid_of_another_attempt_is_rolled_forward_as_it_is() -> None:
    theirs = record(manifest=(StagedPart("j__b1__other__0", "0", 10),))
    done, seen = drive(commit.commit(commit.Ask(record())), stores(existing=theirs))
    assert done.action == "rolled_forward"
    publish = next(s for s in seen if isinstance(s, steps.PublishXid))
    assert publish.resumed and publish.record.manifest == theirs.manifest
    assert not any(isinstance(s, steps.Prepare) for s in seen)


def test_a_refused_batch_checks_the_fence_before_it_refuses() -> None:
    """A batch older than the job's last (a stream replaying an old batch id) is refused;
    a superseded writer hears FencedError (CheckFence) first."""
    stop, seen = drive(commit.commit(commit.Ask(record(), streaming=True)), stores(last=5))
    assert isinstance(stop, steps.Stop)
    assert kinds(seen)[-2:] == ["CheckFence", "Stop"]
    assert not any(isinstance(s, steps.Prepare) for s in seen)


def test_every_50th_batch_prunes_and_sweeps_leftover_fills() -> None:
    answer = stores()

    def listing(step: Any) -> Any:
        if isinstance(step, steps.ListRecords):
            return [record("b1", XidState.COMMITTED, committed_at=1.0)], 10.0
        return answer(step)

    ask = commit.Ask(record("b50"), retention=0)
    _, seen = drive(commit.commit(ask), listing)
    assert kinds(seen)[-3:] == ["ListRecords", "DeleteRecords", "DropLeftoverFills"]
    assert next(s for s in seen if isinstance(s, steps.DeleteRecords)).xids == ("b1",)


@pytest.mark.parametrize("state", [XidState.ABORTED, XidState.PREPARED, XidState.COMMITTED])
def test_a_roll_back_drops_only_what_the_tombstone_leaves_to_it(state: XidState) -> None:
    """Tombstone first (synced); a PREPARED or COMMITTED node keeps its tables."""
    tables = (PART.table, "j__b1__stray__1")

    def answer(step: Any) -> Any:
        node = record(state=state, aborted_tables=tables if state is XidState.ABORTED else ())
        return node if isinstance(step, steps.Abort) else None

    dropped, seen = drive(commit.roll_back("j", "b1", tables), answer)
    assert kinds(seen)[:2] == ["Sync", "Abort"]
    if state is XidState.ABORTED:
        assert dropped == list(tables) and kinds(seen)[-1] == "DropTables"
    else:
        assert PART.table not in dropped and all(
            PART.table not in s.tables for s in seen if isinstance(s, steps.DropTables)
        )


def test_a_dedup_xid_whose_state_cannot_be_deleted_is_not_pruned() -> None:
    old = record("b1", XidState.COMMITTED, committed_at=1.0, mode=Mode.DEDUP)

    def answer(step: Any) -> Any:
        if isinstance(step, steps.ListRecords):
            return [old], 10.0
        if isinstance(step, steps.ForgetDedupState):
            return False
        return None

    pruned, seen = drive(commit.prune("j", 0), answer)
    assert pruned == [] and not any(isinstance(s, steps.DeleteRecords) for s in seen)


def run_epoch(current: Any, **kw: Any) -> Any:
    from txsink.protocol.codec import JobMeta

    meta = kw.pop("meta", JobMeta())
    return commit.run_epoch(
        "j", "run-2", meta, current=current, namespace="n", prefix="j_n",
        keep=frozenset(), retention=10, promise={"state": "running"},
    )  # fmt: skip


def test_a_run_that_holds_the_job_takes_nothing() -> None:
    from txsink.protocol.states import Epoch

    mine = Epoch("j", 3, 3, "run-2")
    (epoch, report), seen = drive(run_epoch(mine), lambda step: None)
    assert (epoch, report, seen) == (mine, None, [])


def test_a_superseded_run_stops_and_never_takes_the_job_back() -> None:
    from txsink.protocol.states import Epoch

    theirs = Epoch("j", 4, 4, "run-3")

    def answer(step: Any) -> Any:
        return {"started_at": 1.0} if isinstance(step, steps.ReadRunMark) else None

    stop, seen = drive(run_epoch(theirs), answer)
    assert isinstance(stop, steps.Stop) and stop.failure is steps.Failure.FENCED
    assert "run-3" in stop.message
    assert not any(isinstance(s, (steps.TakeEpoch, steps.PutRunMark)) for s in seen)


def test_a_takeover_reads_synced_marks_the_run_takes_the_epoch_then_recovers() -> None:
    from txsink.protocol.codec import JobMeta
    from txsink.protocol.states import Epoch

    new = Epoch("j", 5, 5, "run-2")

    def answer(step: Any) -> Any:
        if isinstance(step, steps.ReadEpoch):
            return Epoch("j", 4, 4, "run-1")
        if isinstance(step, steps.EnsureJob):
            return JobMeta()
        if isinstance(step, steps.TakeEpoch):
            return new
        if isinstance(step, steps.ListRecords):
            return [], 1.0
        if isinstance(step, steps.ListStaging):
            return []
        return None

    (epoch, report), seen = drive(run_epoch(commit.UNREAD), answer)
    assert epoch == new and report is not None and report.alarms == []
    assert kinds(seen)[:6] == [
        "Sync", "ReadEpoch", "ReadRunMark", "EnsureJob", "PutRunMark", "TakeEpoch",
    ]  # fmt: skip
    assert sum(isinstance(s, steps.EnsureJob) for s in seen) == 1
    assert isinstance(seen[-2], steps.Heartbeat) and seen[-2].facts == {"state": "running"}


def test_a_new_query_under_a_job_with_committed_batches_is_refused_before_it_takes_it() -> None:
    """The ledger is read only because the query ids differ (a new checkpoint)."""
    from txsink.protocol.codec import JobMeta

    def answer(step: Any) -> Any:
        if isinstance(step, steps.EnsureJob):
            return JobMeta(query_id="q-old")
        if isinstance(step, steps.ReadCommittedCount):
            return 3
        return None

    stop, seen = drive(run_epoch(None, meta=JobMeta(query_id="q-new")), answer)
    assert isinstance(stop, steps.Stop) and stop.failure is steps.Failure.CONFIG and stop.bare
    assert "q-old" in stop.message and kinds(seen)[-2:] == ["ReadCommittedCount", "Stop"]
