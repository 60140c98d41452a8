"""The dedup seal (issue 38, row 1's last window): the commit of a dedup xid writes a seal
row and waits out the xid's running inserts before COMMITTED; every block insert carries the
seal and the window bounds its task just checked, for the server to check when it starts.

Pure parts here (the publish sequence, the guard's bounds, the statement, the error
mapping, the twin); tests/integration/test_zombie_attempts.py freezes a real attempt
between its last check and its send on the real engine.
"""

from __future__ import annotations

import pyarrow as pa
import pytest

from txsink.clickhouse.dedup_insert import SEAL_TABLE, guarded_insert_sql
from txsink.clickhouse.error_map import THROW_IF, map_error
from txsink.errors import ConfigError, FencedError, RetryableConflict
from txsink.ports.warehouse import InsertGuard
from txsink.ports.warehouse_memory import MemoryWarehouse
from txsink.protocol import dedup_window as dw
from txsink.protocol import ops, sequence, steps
from txsink.protocol.ids import seal_tag, staging_prefix
from txsink.protocol.states import Mode, XidRecord, XidState

PREFIX = staging_prefix("j")
BOUNDS = steps.PublishBounds(retry_s=1.0)


def dedup_record() -> XidRecord:
    return XidRecord(
        job="j", xid="b1", batch=1, state=XidState.PREPARED, epoch=1, mode=Mode.DEDUP,
        target="db.t", manifest=(), created_at=1.0,
    )  # fmt: skip


def drive(quiet: bool) -> list[object]:
    """The steps of a dedup publish, with ``quiet`` as every Settle's answer."""
    record = dedup_record()
    run = sequence.finish(record, PREFIX, BOUNDS, resumed=False)
    seen: list[object] = []
    reply: object = None
    while True:
        try:
            step = run.send(reply)
        except StopIteration:
            return seen
        seen.append(step)
        reply = None
        if isinstance(step, steps.Settle):
            reply = quiet
        elif isinstance(step, steps.Write):
            reply = record
        elif isinstance(step, steps.Stop):
            return seen


def test_a_dedup_commit_seals_its_xid_and_waits_out_its_inserts_before_committed() -> None:
    seen = drive(quiet=True)
    tag = seal_tag(PREFIX, "b1")
    kinds = [type(s).__name__ for s in seen]
    assert kinds.index("SealRow") < kinds.index("Settle") < kinds.index("Write"), kinds
    assert steps.SealRow(tag) in seen
    settle = next(s for s in seen if isinstance(s, steps.Settle))
    assert settle.needles == (tag,) and settle.fresh
    write = next(s for s in seen if isinstance(s, steps.Write))
    assert isinstance(write.op, ops.RecordCommitted)


def test_an_insert_still_running_after_the_seal_keeps_the_xid_uncommitted() -> None:
    seen = drive(quiet=False)
    assert not any(isinstance(s, steps.Write) for s in seen)
    stop = seen[-1]
    assert isinstance(stop, steps.Stop) and stop.failure is steps.Failure.UNAVAILABLE


@pytest.mark.parametrize("replicated", [False, True])
@pytest.mark.parametrize("resend", [False, True])
def test_the_server_side_bounds_are_the_window_check_itself(replicated: bool, resend: bool) -> None:
    """Any counter (and clock) the guard lets through passes :func:`dw.window_step` for the
    same block, and one part past the bound is refused by both."""
    seconds = 3600.0 if replicated else None
    window = dw.Window(100, "w", seconds)
    first = dw.Mark(1000, 50.0)
    track = dw.Track(first, 100, seconds, 1040, block_parts=3)
    now = dw.Mark(1040, 60.0)
    checked, refusal = dw.window_step(track, window, now, resend=resend)
    assert refusal is None
    guard = dw.insert_guard(checked, window, resend=resend)
    assert guard.counter_min == 1040
    for counter in range(guard.counter_min, guard.counter_max + 1):
        at = guard.deadline if guard.deadline is not None else 60.0
        assert dw.window_step(checked, window, dw.Mark(counter, at), resend=resend)[1] is None
    past = dw.Mark(guard.counter_max + 1, 60.0)
    assert dw.window_step(checked, window, past, resend=resend)[1] is not None
    if guard.deadline is not None:
        late = dw.Mark(guard.counter_min, guard.deadline + 1.0)
        assert dw.window_step(checked, window, late, resend=resend)[1] is not None


def test_the_guarded_statement_checks_the_seal_and_the_window_when_the_insert_starts() -> None:
    guard = InsertGuard(
        "txsink-seal:tx_j:b1", (("id", "Int64"), ("s", "Nullable(String)")),
        dw.Guard(10, 20, None),
    )  # fmt: skip
    sql = guarded_insert_sql("db", "t", ["id", "s"], guard, "txsink_staging")
    assert sql.startswith("INSERT INTO `db`.`t` (`id`, `s`) SELECT * FROM input(")
    assert "'`id` Int64, `s` Nullable(String)'" in sql
    assert f"`txsink_staging`.`{SEAL_TABLE}` WHERE tag = 'txsink-seal:tx_j:b1'" in sql
    assert "mx < 10 OR mx > 20" in sql and "now64" not in sql
    assert sql.endswith("FORMAT Arrow")
    with pytest.raises(ConfigError, match="no column"):
        guarded_insert_sql("db", "t", ["id", "extra"], guard, "txsink_staging")


class Refusal(Exception):
    code = THROW_IF


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("Code: 395. DB::Exception: txsink-sealed: while executing", FencedError),
        ("Code: 395. DB::Exception: txsink-window: while executing", RetryableConflict),
    ],
)
def test_a_refusal_of_the_guard_maps_to_what_the_task_does_next(
    text: str, error: type[Exception]
) -> None:
    assert isinstance(map_error(Refusal(text), url="http://h", what="INSERT"), error)


def test_the_twin_refuses_a_guarded_insert_once_its_xid_is_sealed() -> None:
    wh = MemoryWarehouse()
    wh.add_table("db.t", dedup_window=10)
    guard = InsertGuard("seal-1", (("id", "Int64"),))
    rows = pa.table({"id": pa.array([1, 2], pa.int64())}).to_batches()
    wh.insert_blocks("db.t", rows, block_rows=10, block_bytes=1 << 30, guard=guard)
    wh.seal_dedup("seal-2")
    wh.insert_blocks("db.t", rows, block_rows=10, block_bytes=1 << 30, guard=guard)
    wh.seal_dedup("seal-1")
    with pytest.raises(FencedError):
        wh.insert_blocks("db.t", rows, block_rows=10, block_bytes=1 << 30, guard=guard)
