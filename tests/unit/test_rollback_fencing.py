"""Roll-backs, replays and namespaces against the in-memory twins (issue 10, rows 3, 5, 6, 12).

Every staging drop that is not the cleanup of a COMMITTED xid goes behind an ABORTED
tombstone on the xid node, so the interleavings below (a prepare whose reply was lost, a
paused recoverer, a lagging read) can never drop staging a PREPARED xid needs.
"""

from __future__ import annotations

import pytest

from tests.unit.test_transaction_model import JOB, TARGET, stage_batch
from txsink.errors import ConfigError, RetryableConflict
from txsink.ports.registry_memory import MemoryRegistry
from txsink.ports.warehouse_memory import MemoryWarehouse
from txsink.protocol import job as rules
from txsink.protocol import plans
from txsink.protocol.ids import batch_xid, staging_name, staging_prefix
from txsink.protocol.states import Mode, XidRecord, XidState
from txsink.transactor import Transactor


def committed_batches(tx: Transactor, wh: MemoryWarehouse, upto: int) -> None:
    epoch = tx.begin("run-1")
    for b in range(upto + 1):
        parts = stage_batch(wh, epoch.number, b, [(b, "a")], 1, 0)
        tx.commit_batch(epoch, batch_xid(b), b, TARGET, parts, streaming=True)


# -- row 5: roll-backs never race a prepare -------------------------------------------------


def test_abort_after_a_prepare_whose_reply_was_lost_keeps_the_prepared_staging() -> None:
    reg, wh = MemoryRegistry(), MemoryWarehouse()
    tx = Transactor(reg, wh, JOB)
    epoch = tx.begin("run-1")
    parts = stage_batch(wh, epoch.number, 0, [(1, "a"), (2, "b")], 1, 0)
    record = XidRecord(JOB, "b0", 0, XidState.PREPARED, epoch.number, Mode.ATTACH, TARGET,
                       tuple(parts))  # fmt: skip
    reg.prepare(epoch, record)  # landed; the driver only heard "connection lost"
    tables = sorted({p.table for p in parts})
    assert tx.roll_back("b0", tables) == []  # Spark's abort(): nothing dropped
    assert all(t in wh.staging for t in tables)
    Transactor(reg, wh, JOB).begin("run-2")  # recovery rolls it forward
    assert wh.target_ids(TARGET) == [1, 2]


def test_a_prepare_that_lands_after_the_abort_never_publishes_dropped_staging() -> None:
    reg, wh = MemoryRegistry(), MemoryWarehouse()
    tx = Transactor(reg, wh, JOB)
    epoch = tx.begin("run-1")
    parts = stage_batch(wh, epoch.number, 0, [(1, "a")], 1, 0)
    tables = sorted({p.table for p in parts})
    assert tx.roll_back("b0", tables) == tables  # abort won: tombstone, then drop
    with pytest.raises(RetryableConflict, match="rolled back"):
        tx.commit_batch(epoch, "b0", 0, TARGET, parts, streaming=True)  # the late prepare
    assert reg.get(JOB, "b0").state is XidState.ABORTED  # type: ignore[union-attr]
    replay = stage_batch(wh, epoch.number + 1, 0, [(1, "a")], 1, 0)
    epoch2 = Transactor(reg, wh, JOB).begin("run-2", keep={p.table for p in replay})
    assert tx.commit_batch(epoch2, "b0", 0, TARGET, replay, streaming=True).action == "committed"
    assert wh.target_ids(TARGET) == [1]
    assert reg.get(JOB, "b0").state is XidState.COMMITTED  # type: ignore[union-attr]


def test_a_paused_recoverer_cannot_drop_staging_a_newer_writer_prepared() -> None:
    reg, wh = MemoryRegistry(), MemoryWarehouse()
    recoverer = Transactor(reg, wh, JOB)
    stale_epoch = recoverer.begin("txsink-recover")
    parts = stage_batch(wh, 7, 0, [(1, "a"), (2, "b")], 2, 0)  # a new run's tasks wrote
    stale_plan = plans.plan_recovery(JOB, reg.list(JOB), wh.list_staging(recoverer.prefix))
    assert set(stale_plan.roll_back) == {p.table for p in parts}  # orphans, as seen then
    writer = Transactor(reg, wh, JOB)
    epoch = writer.begin("run-2", keep={p.table for p in parts})  # fences the recoverer
    writer.fault = lambda point: None
    record = XidRecord(JOB, "b0", 0, XidState.PREPARED, epoch.number, Mode.ATTACH, TARGET,
                       tuple(parts))  # fmt: skip
    reg.prepare(epoch, record)
    assert recoverer.roll_back_tables(stale_plan.roll_back) == []  # wakes up: drops nothing
    assert stale_epoch.number < epoch.number
    writer.finish(epoch, reg.get(JOB, "b0"))  # type: ignore[arg-type]
    assert wh.target_ids(TARGET) == [1, 2]


def test_tombstones_expire_only_after_their_lifetime() -> None:
    stone = XidRecord(JOB, "b1", 1, XidState.ABORTED, 0, Mode.ATTACH, "", created_at=100.0)
    assert plans.plan_prune([stone], keep=10, now=100.0 + plans.TOMBSTONE_SECONDS) == []
    assert plans.plan_prune([stone], keep=10, now=101.0 + plans.TOMBSTONE_SECONDS) == ["b1"]


# -- row 3: a second write of a batch in the same run ---------------------------------------


def test_a_second_save_of_a_batch_in_the_same_run_is_refused_not_dropped() -> None:
    reg, wh = MemoryRegistry(), MemoryWarehouse()
    tx = Transactor(reg, wh, JOB)
    epoch = tx.begin("run-1")
    first = stage_batch(wh, epoch.number, 4, [(1, "a")], 1, 0)
    tx.commit_batch(epoch, "b4", 4, TARGET, first, streaming=True)
    with pytest.raises(ConfigError, match="saved twice under one job"):
        tx.commit_batch(epoch, "b4", 4, TARGET, [], streaming=True)


def test_a_replay_after_a_takeover_that_rolled_the_batch_forward_is_skipped() -> None:
    reg, wh = MemoryRegistry(), MemoryWarehouse()
    tx = Transactor(reg, wh, JOB, fault=lambda p: exec("raise KeyboardInterrupt")
                    if p == "driver.after_prepare" else None)  # fmt: skip
    epoch = tx.begin("run-1")
    with pytest.raises(KeyboardInterrupt):
        tx.commit_batch(epoch, "b0", 0, TARGET, stage_batch(wh, 1, 0, [(1, "a")], 1, 0))
    tx2 = Transactor(reg, wh, JOB)
    epoch2 = tx2.begin("run-2")  # recovery commits b0 under epoch 2
    assert tx2.commit_batch(epoch2, "b0", 0, TARGET, [], streaming=True).action == "skipped"
    assert wh.target_ids(TARGET) == [1]


# -- row 12: a streaming batch far below the last committed one ----------------------------


def test_a_streaming_batch_below_the_last_committed_one_is_refused_not_skipped() -> None:
    reg, wh = MemoryRegistry(), MemoryWarehouse()
    tx = Transactor(reg, wh, JOB, retention=2)
    committed_batches(tx, wh, 5)
    epoch = Transactor(reg, wh, JOB).begin("reset-checkpoint")
    for b in (0, 4):  # record pruned (b0) or kept (b4): a reset checkpoint either way
        again = stage_batch(wh, epoch.number, b, [(100 + b, "a")], 1, 0)
        with pytest.raises(ConfigError, match="checkpoint was reset"):
            tx.commit_batch(epoch, batch_xid(b), b, TARGET, again, streaming=True)
    assert wh.target_ids(TARGET) == [0, 1, 2, 3, 4, 5]
    assert wh.staging == {}  # the refused batches' staging was rolled back
    assert tx.commit_batch(epoch, "b5", 5, TARGET, [], streaming=True).action == "skipped"


def test_a_txn_version_below_the_last_committed_one_is_still_a_no_op() -> None:
    reg, wh = MemoryRegistry(), MemoryWarehouse()
    tx = Transactor(reg, wh, JOB)
    committed_batches(tx, wh, 3)
    epoch = Transactor(reg, wh, JOB).begin("save-2")
    late = stage_batch(wh, epoch.number, 1, [(9, "a")], 1, 0)
    assert tx.commit_batch(epoch, "b1", 1, TARGET, late).action == "skipped"
    assert wh.target_ids(TARGET) == [0, 1, 2, 3]


# -- row 6: namespaces ----------------------------------------------------------------------


def test_recovery_never_touches_staging_of_the_same_job_name_in_another_namespace() -> None:
    wh = MemoryWarehouse()
    here, there = MemoryRegistry(namespace="ns-a"), MemoryRegistry(namespace="ns-b")
    assert staging_prefix(JOB, "ns-a") != staging_prefix(JOB, "ns-b")
    theirs = staging_name(JOB, "b0", "0000000a", 0, 0, 0, "ns-b").table
    mine = staging_name(JOB, "b0", "0000000a", 0, 0, 0, "ns-a").table
    wh.stage(theirs, {"a": [1]})
    wh.stage(mine, {"a": [2]})
    Transactor(here, wh, JOB).begin("run-a")
    assert theirs in wh.staging and mine not in wh.staging
    Transactor(there, wh, JOB).begin("run-b")
    assert theirs not in wh.staging


# -- issue 38 row 6: a new job name or store on a checkpoint another job wrote -------------


@pytest.mark.parametrize(
    ("batch", "first_batch", "refused"),
    [
        (0, None, False),  # a fresh checkpoint starts at batch 0
        (3, None, True),  # another job's checkpoint: batch 3 may be its committed replay
        (3, 3, False),  # the operator says the query stopped cleanly before batch 3
        (4, 3, False),
        (2, 3, True),  # before the job's first batch: the earlier writer's
    ],
)
def test_a_job_that_committed_nothing_refuses_a_batch_it_cannot_tell_from_another_jobs(
    batch: int, first_batch: int | None, refused: bool
) -> None:
    reg, wh = MemoryRegistry(), MemoryWarehouse()
    tx = Transactor(reg, wh, JOB)
    epoch = tx.begin("run-1")
    parts = stage_batch(wh, epoch.number, batch, [(1, "a")], 1, 0)

    def commit() -> str:
        return tx.commit_batch(
            epoch, batch_xid(batch), batch, TARGET, parts, streaming=True,
            own_batches=True, first_batch=first_batch,
        ).action  # fmt: skip

    task = rules.task_replay(
        JOB, batch_xid(batch), "attach", None, None, batch, None,
        streaming=True, first_batch=first_batch,
    )  # fmt: skip
    if refused:
        with pytest.raises(ConfigError, match=r"first_batch|first batch"):
            commit()
        assert task.verdict is rules.TaskVerdict.REFUSE and "nothing was written" in task.reason
        assert wh.target_ids(TARGET) == []
        tombstone = reg.get(JOB, batch_xid(batch))  # its staging rolled back
        assert tombstone is not None and tombstone.state is XidState.ABORTED
        again = rules.task_replay(
            JOB, batch_xid(batch), "attach", XidState.ABORTED, "attach", batch, None,
            streaming=True, first_batch=first_batch,
        )  # fmt: skip
        assert again.verdict is rules.TaskVerdict.REFUSE  # the rerun's tasks refuse too
    else:
        assert commit() == "committed" and task.verdict is rules.TaskVerdict.WRITE
    # a job with history, a batch save (txn_version) and the bare Transactor are unaffected
    assert rules.unowned_batch_refusal(JOB, batch, 0, first_batch) is None
    assert rules.task_replay(JOB, "b", "attach", None, None, batch, None).verdict is not (
        rules.TaskVerdict.REFUSE
    )


def test_the_refusal_names_the_batch_first_batch_and_the_other_ways_out() -> None:
    text = rules.unowned_batch_refusal(JOB, 7, None, None) or ""
    assert "micro-batch 7" in text and "first_batch=7" in text and "commits/" in text
    assert "txsink recover" in text and "new checkpoint location" in text


def test_a_task_of_a_batch_rolled_back_after_the_jobs_first_commit_writes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A job that committed batch 0, died with batch 1 staged (rolled back to a tombstone
    by the restart's recovery): the rerun's tasks of batch 1 read the ledger too, so the
    tombstone does not read as "a job that committed nothing" and they write
    (test_misbehaving_users' view created mid-stream hit this on the real stack)."""
    import contextlib

    from txsink import driver
    from txsink.config import WriterConfig
    from txsink.spark.messages import WritePlan
    from txsink.spark.task import Task
    from txsink.spark.writer import already_committed

    reg, wh = MemoryRegistry(), MemoryWarehouse()
    tx = Transactor(reg, wh, JOB)
    committed_batches(tx, wh, 0)
    staged = stage_batch(wh, 1, 1, [(1, "a")], 1, 0)
    tx.roll_back(batch_xid(1), [p.table for p in staged])
    tombstone = reg.get(JOB, batch_xid(1))
    assert tombstone is not None and tombstone.state is XidState.ABORTED
    monkeypatch.setattr(driver, "borrowed_registry", lambda _c: contextlib.nullcontext(reg))
    options = {"url": "http://h:8123", "keeper": "k:2181", "table": TARGET, "job": JOB}
    plan = WritePlan(WriterConfig.from_options(options), "dedup")
    assert plan.streaming
    task = Task("run-2", batch_xid(1), 1, 0, 0, 1, "q", 0.0)
    assert already_committed(plan, task) is False  # written, not refused
