"""Dedup mode's pure state machine (txsink.protocol.dedup): the decision table and the
block-wise walk an executor performs while streaming, which must agree with it."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.unit.fakes import MemoryWarehouse
from txsink.keeper.registry import MemoryRegistry
from txsink.protocol.dedup import (
    BlockAction,
    BlockFingerprint,
    Decision,
    PartitionState,
    Refusal,
    Status,
    after,
    before,
    decide_block,
    decide_end,
    decide_partition,
    needs_before_record,
    partition_key,
    summarize,
    xid_key,
)
from txsink.protocol.states import Mode, StagedPart
from txsink.transaction import Transactor


def fps(*digests: str, rows: int = 10) -> tuple[BlockFingerprint, ...]:
    return tuple(BlockFingerprint(i, rows, d) for i, d in enumerate(digests))


def walk(
    stored: PartitionState | None, incoming: Sequence[BlockFingerprint]
) -> tuple[list[int], Refusal | None]:
    """What an executor does: decide block by block, then at the end."""
    inserted: list[int] = []
    for i, fp in enumerate(incoming):
        step = decide_block(stored, i, fp)
        if step.action is BlockAction.REFUSE:
            return inserted, step.refusal
        if step.action is BlockAction.INSERT:
            inserted.append(i)
    return inserted, decide_end(stored, len(incoming))


# ------------------------------------------------------------------ the decision table


def test_no_state_is_new_and_inserts_every_block() -> None:
    plan = decide_partition(None, fps("a", "b"))
    assert plan.decision is Decision.NEW and plan.insert == (0, 1) and plan.refusal is None


def test_identical_replay_of_a_complete_partition_sends_nothing() -> None:
    plan = decide_partition(after(fps("a", "b"), 0, 1.0), fps("a", "b"))
    assert plan.decision is Decision.SAME and plan.insert == ()


def test_replay_after_a_death_mid_partition_resends_every_block_with_the_same_tokens() -> None:
    plan = decide_partition(before(fps("a"), 0, 1.0), fps("a", "b", "c"))
    assert plan.decision is Decision.RESUME and plan.insert == (0, 1, 2)


def test_changed_block_of_a_complete_partition_is_refused_at_that_block() -> None:
    plan = decide_partition(after(fps("a", "b"), 0, 1.0), fps("a", "X"))
    assert plan.decision is Decision.CHANGED and plan.refusal is not None
    assert plan.refusal.block == 1 and "digest X instead of b" in plan.refusal.detail


def test_changed_row_count_is_named_in_the_refusal() -> None:
    stored = after(fps("a"), 0, 1.0)
    plan = decide_partition(stored, (BlockFingerprint(0, 7, "a"),))
    assert plan.refusal is not None and "recorded 10 rows, the replay has 7" in plan.refusal.detail


def test_replay_shorter_than_a_complete_partition_is_contained_and_refused() -> None:
    plan = decide_partition(after(fps("a", "b"), 0, 1.0), fps("a"))
    assert plan.decision is Decision.CONTAINED and plan.refusal is not None
    assert plan.refusal.block == 1


def test_replay_longer_than_a_complete_partition_is_overlap_and_refused() -> None:
    plan = decide_partition(after(fps("a"), 0, 1.0), fps("a", "b"))
    assert plan.decision is Decision.OVERLAP and plan.refusal is not None
    assert plan.refusal.block == 1


def test_replay_shorter_than_blocks_that_may_have_landed_is_refused() -> None:
    plan = decide_partition(before(fps("a", "b"), 0, 1.0), fps("a"))
    assert plan.decision is Decision.CONTAINED


def test_changed_block_that_may_have_landed_is_refused() -> None:
    plan = decide_partition(before(fps("a", "b"), 0, 1.0), fps("a", "X", "c"))
    assert plan.decision is Decision.CHANGED and plan.refusal is not None
    assert plan.refusal.block == 1


def test_empty_replay_of_an_empty_complete_partition_is_same() -> None:
    assert decide_partition(after((), 0, 1.0), ()).decision is Decision.SAME


@pytest.mark.parametrize("decision", list(Decision))
def test_only_contained_overlap_and_changed_refuse(decision: Decision) -> None:
    assert decision.refuses == (decision.name in {"CONTAINED", "OVERLAP", "CHANGED"})


# ------------------------------------------------------------------ records


def test_state_survives_its_json_round_trip() -> None:
    state = before(fps("a", "b", rows=3), 2, 5.5)
    assert PartitionState.from_json(state.to_json()) == state
    assert state.rows == 6 and state.status is Status.BEFORE
    assert PartitionState.from_json(None) is None


def test_keys_follow_the_keeper_layout() -> None:
    assert partition_key("b7", 3) == "dedup/b7/p3"
    assert partition_key("b7", 3).startswith(xid_key("b7") + "/")


def test_every_block_that_may_land_is_recorded_before_it_is_sent() -> None:
    stored = before(fps("a", "b"), 0, 1.0)
    assert [needs_before_record(stored, i) for i in range(4)] == [False, False, True, True]
    assert needs_before_record(None, 0)


# ------------------------------------------------------------------ block-wise == whole

digests = st.sampled_from(["a", "b", "c"])
blocks = st.lists(st.tuples(st.integers(1, 3), digests), max_size=5).map(
    lambda xs: tuple(BlockFingerprint(i, r, d) for i, (r, d) in enumerate(xs))
)
states = st.one_of(
    st.none(),
    st.builds(
        lambda status, bs: PartitionState(status, bs, sum(b.rows for b in bs), 0, 0.0),
        st.sampled_from(list(Status)),
        blocks,
    ),
)


@given(states, blocks)
def test_block_wise_walk_agrees_with_the_whole_partition_decision(
    stored: PartitionState | None, incoming: tuple[BlockFingerprint, ...]
) -> None:
    plan = decide_partition(stored, incoming)
    inserted, refusal = walk(stored, incoming)
    if plan.decision.refuses:
        assert refusal == plan.refusal
    else:
        assert refusal is None
        assert tuple(inserted) == plan.insert
        skipped = len(incoming) - len(inserted)
        assert summarize(stored, len(inserted), skipped, len(incoming)) is plan.decision


@given(states, blocks)
def test_nothing_recorded_as_landed_is_ever_sent_twice_with_other_content(
    stored: PartitionState | None, incoming: tuple[BlockFingerprint, ...]
) -> None:
    """A token that may have landed is only re-sent with the very content recorded for it."""
    inserted, _ = walk(stored, incoming)
    if stored is not None:
        for i in inserted:
            if i < len(stored.blocks):
                assert stored.blocks[i] == incoming[i]


@given(states, blocks)
def test_a_complete_partition_is_never_sent_again(
    stored: PartitionState | None, incoming: tuple[BlockFingerprint, ...]
) -> None:
    inserted, _ = walk(stored, incoming)
    if stored is not None and stored.status is Status.AFTER:
        assert inserted == []


@given(blocks, st.integers(0, 5))
def test_a_crash_at_any_block_then_an_identical_replay_completes_the_partition(
    incoming: tuple[BlockFingerprint, ...], crash_at: int
) -> None:
    """Records as the executor writes them: BEFORE(0..k) before block k; replay resumes."""
    k = min(crash_at, len(incoming))
    stored = before(incoming[: k + 1], 0, 1.0) if incoming else None
    plan = decide_partition(stored, incoming)
    assert plan.decision in (Decision.NEW, Decision.RESUME)
    assert plan.insert == tuple(range(len(incoming)))


# ------------------------------------------------------------------ cleanup in Keeper


def test_dedup_state_of_an_xid_is_deleted_once_it_is_committed() -> None:
    reg = MemoryRegistry()
    tx = Transactor(reg, MemoryWarehouse(), "j")
    epoch = tx.begin("run-1")
    for xid in ("b0", "b1"):
        reg.put_blob("j", partition_key(xid, 0), after(fps("a"), 0, 1.0).to_json())
    reg.put_blob("j", "runs/run-1", {"started_at": 1.0})
    part = StagedPart("db.t", "0", 10, 1, "d")
    result = tx.commit_batch(epoch, "b0", 0, "db.t", [part], Mode.DEDUP)
    assert result.action == "committed"
    assert reg.get_blob("j", partition_key("b0", 0)) is None
    assert reg.get_blob("j", partition_key("b1", 0)) is not None  # another xid: kept
    assert reg.get_blob("j", "runs/run-1") is not None  # not under dedup/: kept


def test_a_replay_of_a_committed_dedup_xid_removes_leftover_state() -> None:
    reg = MemoryRegistry()
    tx = Transactor(reg, MemoryWarehouse(), "j")
    epoch = tx.begin("run-1")
    part = StagedPart("db.t", "0", 10, 1, "d")
    tx.commit_batch(epoch, "b0", 0, "db.t", [part], Mode.DEDUP)
    # as if the driver died after COMMITTED, before the delete; the restarted run replays
    reg.put_blob("j", partition_key("b0", 0), after(fps("a"), 0, 1.0).to_json())
    epoch = tx.begin("run-2")
    assert tx.commit_batch(epoch, "b0", 0, "db.t", [part], Mode.DEDUP).action == "skipped"
    assert reg.get_blob("j", partition_key("b0", 0)) is None
