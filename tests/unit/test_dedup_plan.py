"""A dedup task's partition as a plan (txsink.protocol.dedup_plan): the order of its reads
and writes, walked with a scripted runner (no Keeper, no ClickHouse, no Spark)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from txsink.protocol import dedup
from txsink.protocol import dedup_plan as dp
from txsink.protocol import dedup_window as dw

F = dedup.BlockFingerprint
WINDOW = (dw.Mark(10, 0.0), dw.Window(100, "non_replicated_deduplication_window"))


def run(
    initial: dedup.PartitionState | None,
    blocks: Sequence[dedup.BlockFingerprint],
    *,
    sealed: bool = False,
    rival: Callable[[dp.ProposeBefore], dedup.PartitionState] | None = None,
) -> tuple[list[str], Any]:
    """Walk the plan; the names of the steps it yielded and how it ended."""
    seen: list[str] = []
    record = initial
    steps = dp.write_partition(initial, attempt=0)
    reply: Any = None
    while True:
        try:
            step = steps.send(reply)
        except StopIteration as end:
            return seen, end.value
        seen.append(type(step).__name__)
        reply = None
        if isinstance(step, dp.NextBlock):
            reply = blocks[step.index] if step.index < len(blocks) else None
        elif isinstance(step, dp.ObserveWindow):
            reply = WINDOW
        elif isinstance(step, dp.ProposeBefore) and rival is not None:
            record, rival = rival(step), None  # another attempt wrote first
            reply = (False, record)
        elif isinstance(step, dp.ProposeBefore | dp.ProposeAfter):
            make = dedup.before if isinstance(step, dp.ProposeBefore) else dedup.after
            record = make(step.blocks, step.attempt, 1.0, step.track)
            reply = (True, record)
        elif isinstance(step, dp.CheckSealed):
            reply = sealed
        elif isinstance(step, dp.InsertBlock):
            reply = True
        elif isinstance(step, dp.RefuseContent | dp.RefuseWindow):
            return seen, step


def test_a_new_block_is_observed_then_recorded_then_sealed_checked_then_inserted() -> None:
    seen, end = run(None, [F(0, 2, "b3:a"), F(1, 1, "b3:b")])
    block = ["ObserveWindow", "ProposeBefore", "CutNext", "CheckSealed", "InsertBlock"]
    assert seen == [
        "NextBlock",
        *block,
        "FaultPoint",
        "NextBlock",
        *block,
        "NextBlock",
        "ProposeAfter",
    ]
    assert end == dp.Sent((F(0, 2, "b3:a"), F(1, 1, "b3:b")), 2, 0, 3, dedup.Decision.NEW)


def test_a_resent_block_is_observed_but_not_recorded_and_a_landed_one_only_skipped() -> None:
    track = dw.start_track(WINDOW[1], WINDOW[0])
    half = dedup.before([F(0, 2, "b3:a")], 0, 1.0, track)
    seen, end = run(half, [F(0, 2, "b3:a")])
    assert seen == [
        "NextBlock", "ObserveWindow", "CutNext", "CheckSealed", "InsertBlock", "FaultPoint",
        "NextBlock", "ProposeAfter",
    ]  # fmt: skip
    assert end.decision is dedup.Decision.RESUME
    complete = dedup.after([F(0, 2, "b3:a")], 0, 1.0, track)
    seen, end = run(complete, [F(0, 2, "b3:a")])
    assert seen == ["NextBlock", "CutNext", "FaultPoint", "NextBlock", "ProposeAfter"]
    assert (end.inserted, end.skipped, end.decision) == (0, 1, dedup.Decision.SAME)


def test_a_sealed_batch_stops_before_the_insert_and_after_the_record() -> None:
    seen, end = run(None, [F(0, 2, "b3:a")], sealed=True)
    assert seen[-3:] == ["ProposeBefore", "CutNext", "CheckSealed"]
    assert end == dp.Outlived(0, retried=False)


def test_a_lost_race_decides_the_block_again_on_the_winners_record() -> None:
    def twin(step: dp.ProposeBefore) -> dedup.PartitionState:
        return dedup.before([F(0, 2, "b3:other")], 1, 1.0, step.track)

    seen, end = run(None, [F(0, 2, "b3:a")], rival=twin)
    assert seen == ["NextBlock", "ObserveWindow", "ProposeBefore", "RefuseContent"]
    assert end.refusal.decision is dedup.Decision.CHANGED


fps = st.lists(st.sampled_from(["x", "y"]), max_size=4).map(
    lambda ds: [F(i, 1, f"b3:{d}") for i, d in enumerate(ds)]
)


@given(stored=fps, after=st.booleans(), incoming=fps)
def test_the_plan_sends_and_refuses_exactly_where_the_partition_table_says(
    stored: list[dedup.BlockFingerprint], after: bool, incoming: list[dedup.BlockFingerprint]
) -> None:
    make = dedup.after if after else dedup.before
    initial = make(stored, 0, 1.0, dw.start_track(WINDOW[1], WINDOW[0])) if stored else None
    table = dedup.decide_partition(initial, incoming)
    seen, end = run(initial, incoming)
    if table.refusal is not None:
        assert isinstance(end, dp.RefuseContent) and end.refusal == table.refusal
    else:
        assert isinstance(end, dp.Sent) and end.decision is table.decision
        assert seen.count("InsertBlock") == len(table.insert)
    for i, name in enumerate(seen):  # the seal is asked right before every insert...
        if name == "InsertBlock":
            assert seen[i - 1] == "CheckSealed"
        if name == "ProposeBefore":  # ...and the window read right before every record
            assert seen[i - 1] == "ObserveWindow"
