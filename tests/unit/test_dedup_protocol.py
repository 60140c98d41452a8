"""Dedup mode's pure state machine (txsink.protocol.dedup): the decision table and the
block-wise walk an executor performs while streaming, which must agree with it."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given
from hypothesis import strategies as st

from txsink.ports.registry_memory import MemoryRegistry
from txsink.ports.warehouse_memory import MemoryWarehouse
from txsink.protocol.dedup import (
    BlockAction,
    BlockFingerprint,
    Decision,
    PartitionState,
    Refusal,
    Status,
    WriteVerdict,
    after,
    before,
    check_successor,
    decide_block,
    decide_end,
    decide_partition,
    needs_before_record,
    partition_key,
    summarize,
    xid_key,
)
from txsink.protocol.dedup_window import Mark, Track, Window, WindowProblem, window_step
from txsink.protocol.states import Mode, StagedPart
from txsink.transactor import Transactor


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


# ------------------------------------------------------------------ the dedup window

W100 = Window(parts=100, setting="non_replicated_deduplication_window")
W3 = Window(parts=3, setting="non_replicated_deduplication_window")
REPL = Window(
    parts=10000,
    setting="replicated_deduplication_window",
    seconds=3600.0,
    seconds_setting="replicated_deduplication_window_seconds",
)


def test_the_first_block_of_a_partition_starts_its_track_at_the_counter_now() -> None:
    track, refusal = window_step(None, W100, Mark(40, 5.0), resend=False)
    assert refusal is None and track.first == Mark(40, 5.0) and track.parts_window == 100


def test_the_issue_case_two_part_blocks_stop_before_outgrowing_a_window_of_three() -> None:
    """window=3, blocks of 2 parts: block 1 could evict block 0's first part: stop first."""
    t0, r0 = window_step(None, W3, Mark(0, 0.0), resend=False)
    assert r0 is None
    _, r1 = window_step(t0, W3, Mark(2, 1.0), resend=False, prev_counter=0)
    assert r1 is not None and r1.problem is WindowProblem.NO_ROOM
    assert r1.used == 4 and r1.limit == 3 and "the next block may add 2" in r1.detail


def test_a_resend_after_more_parts_than_the_window_is_refused_as_evicted() -> None:
    track = Track(Mark(0, 0.0), 3, None, 2, 2)
    _, refusal = window_step(track, W3, Mark(4, 1.0), resend=True)
    assert refusal is not None and refusal.problem is WindowProblem.EVICTED


def test_raising_the_window_later_does_not_excuse_parts_the_old_window_forgot() -> None:
    track = Track(Mark(0, 0.0), 3, None, 2, 2)
    big = Window(parts=1000, setting=W3.setting)
    _, refusal = window_step(track, big, Mark(4, 1.0), resend=True)
    assert refusal is not None and refusal.problem is WindowProblem.EVICTED and refusal.limit == 3


def test_raising_the_window_in_time_lets_the_partition_resume() -> None:
    track = Track(Mark(0, 0.0), 3, None, 2, 2)
    big = Window(parts=1000, setting=W3.setting)
    track, refusal = window_step(track, big, Mark(2, 1.0), resend=True)
    assert refusal is None and track.parts_window == 1000
    _, refusal = window_step(track, big, Mark(4, 2.0), resend=False, prev_counter=2)
    assert refusal is None


def test_a_counter_that_went_backwards_cannot_bound_the_window() -> None:
    track = Track(Mark(10, 0.0), 100, None, 20, 1)
    _, refusal = window_step(track, W100, Mark(15, 1.0), resend=True)
    assert refusal is not None and refusal.problem is WindowProblem.BACKWARDS


def test_replicated_tokens_expire_by_time_even_with_room_in_parts() -> None:
    track, _ = window_step(None, REPL, Mark(0, 0.0), resend=False)
    _, late = window_step(track, REPL, Mark(1, 3601.0), resend=True)
    assert late is not None and late.problem is WindowProblem.EVICTED and late.seconds
    _, close = window_step(track, REPL, Mark(1, 3400.0), resend=True)
    assert close is not None and close.problem is WindowProblem.NO_ROOM and close.seconds
    _, fine = window_step(track, REPL, Mark(1, 600.0), resend=True)
    assert fine is None


def test_a_track_survives_its_json_round_trip_inside_the_record() -> None:
    track = Track(Mark(7, 1.5), 100, 3600.0, 9, 2)
    state = before(fps("a"), 0, 1.0, track)
    assert PartitionState.from_json(state.to_json()) == state


marks = st.lists(st.integers(0, 6), min_size=1, max_size=8)


@given(st.integers(1, 40), marks, st.lists(st.booleans(), min_size=8, max_size=8))
def test_a_block_is_only_sent_while_every_part_since_the_first_fits_the_window(
    window: int, steps: list[int], resends: list[bool]
) -> None:
    """Whatever the counter does (it only grows here), a passed check means the parts
    inserted since the partition's first block, plus the next block, fit the window."""
    w = Window(parts=window, setting="non_replicated_deduplication_window")
    track, counter, prev = None, 0, None
    for advance, resend in zip(steps, resends, strict=False):
        counter += advance
        new, refusal = window_step(track, w, Mark(counter, 0.0), resend=resend, prev_counter=prev)
        if refusal is not None:
            break
        assert new.first.counter <= counter
        used = counter - new.first.counter
        assert used + (0 if resend else max(1, new.block_parts)) <= window - window // 10
        track, prev = new, counter


# ------------------------------------------------------------------ records never shrink

records = st.builds(
    lambda status, bs: PartitionState(
        status, bs, sum(b.rows for b in bs), 0, 0.0, Track(Mark(0, 0.0), 100, None, 0)
    ),
    st.sampled_from(list(Status)),
    blocks,
)


@given(st.lists(records, min_size=1, max_size=12))
def test_no_sequence_of_writes_shrinks_rewrites_or_reopens_a_record(
    proposals: list[PartitionState],
) -> None:
    """Attempts racing on one partition propose anything; the rule keeps the record
    growing by appends only, and a complete (AFTER) record final."""
    current: PartitionState | None = None
    for proposed in proposals:
        verdict, _ = check_successor(current, proposed)
        if verdict is not WriteVerdict.WRITE:
            continue
        if current is not None:
            assert proposed.blocks[: len(current.blocks)] == current.blocks
            assert current.status is Status.BEFORE
            if proposed.status is Status.AFTER:
                assert proposed.blocks == current.blocks
        current = proposed


def test_a_shorter_record_from_a_zombie_attempt_is_refused() -> None:
    verdict, why = check_successor(before(fps("a", "b", "c"), 0, 1.0), before(fps("a"), 1, 2.0))
    assert verdict is WriteVerdict.REFUSE and "shrink the record from 3 to 1" in why


def test_a_record_cannot_trade_its_first_mark_for_a_later_one() -> None:
    early = before(fps("a"), 0, 1.0, Track(Mark(0, 0.0), 100, None, 0))
    late = before(fps("a", "b"), 1, 2.0, Track(Mark(50, 9.0), 100, None, 50))
    assert check_successor(early, late)[0] is WriteVerdict.REFUSE


def test_after_must_list_exactly_the_blocks_recorded_before_being_sent() -> None:
    ok = check_successor(before(fps("a", "b"), 0, 1.0), after(fps("a", "b"), 0, 1.0))
    assert ok[0] is WriteVerdict.WRITE
    unrecorded = check_successor(before(fps("a"), 0, 1.0), after(fps("a", "b"), 0, 1.0))
    assert unrecorded[0] is WriteVerdict.REFUSE
    again = check_successor(after(fps("a"), 0, 1.0), after(fps("a"), 1, 2.0))
    assert again[0] is WriteVerdict.NOOP


def test_a_racing_attempt_that_loses_re_reads_and_cannot_shrink_the_record() -> None:
    """The executor's StateCell on the in-memory registry: CAS, re-read, the rule."""
    from txsink.errors import ContentChanged
    from txsink.spark.dedup_records import StateCell

    reg = MemoryRegistry()
    a = StateCell(reg, "j", "dedup/b0/p0", ContentChanged)
    b = StateCell(reg, "j", "dedup/b0/p0", ContentChanged)
    assert a.propose(before(fps("a"), 0, 1.0)) and a.propose(before(fps("a", "b"), 0, 1.0))
    assert not b.propose(before(fps("a"), 1, 2.0))
    with pytest.raises(ContentChanged):
        b.propose(after(fps("a"), 1, 2.0))
    stored = PartitionState.from_json(reg.get_blob("j", "dedup/b0/p0"))
    assert stored == before(fps("a", "b"), 0, 1.0)
