"""Evidence of publish (pure): part UUIDs in the manifest, plan_publish's use of them, and
the column catch-up planner for a target altered while a batch was staged."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from txsink.clickhouse.blockers import plan_column_catch_up
from txsink.ports.warehouse import ColumnInfo, TargetInfo
from txsink.protocol import ops as plan_ops
from txsink.protocol import planner
from txsink.protocol.codec import decode_part, encode_part
from txsink.protocol.states import (
    MAX_PART_UUIDS,
    UUID_PREFIX_CHARS,
    Cut,
    Mode,
    StagedPart,
    XidRecord,
    XidState,
    short_uuids,
)

U1, U2, U3 = "a" * 16, "b" * 16, "c" * 16


def record(*parts: StagedPart) -> XidRecord:
    return XidRecord(
        job="j", xid="b1", batch=1, state=XidState.PREPARED, epoch=1,
        mode=Mode.ATTACH, target="db.t", manifest=parts,
    )  # fmt: skip


def kinds(ops: list[plan_ops.Operation]) -> list[str]:
    return [o.kind if isinstance(o, plan_ops.Evidence) else type(o).__name__ for o in ops]


# ------------------------------------------------------------------ manifest format


def test_a_record_written_before_uuids_existed_still_loads() -> None:
    old = {"table": "s1", "partition_id": "202401", "rows": 5, "blocks": 0, "fingerprint": ""}
    part = decode_part(old)
    assert part.uuids == () and encode_part(part) == old  # no new key for old entries


def test_uuids_round_trip_as_one_compact_string() -> None:
    part = StagedPart("s1", "202401", 5, uuids=(U1, U2))
    data = encode_part(part)
    assert data["uuids"] == f"{U1},{U2}"
    assert decode_part(data) == part


def test_short_uuids_keep_the_largest_parts_and_skip_nil_uuids() -> None:
    parts = [(rows, f"{i:08x}-0000-4000-8000-{i:012x}") for i, rows in enumerate([5, 50, 1, 7, 9])]
    parts.append((1000, "00000000-0000-0000-0000-000000000000"))
    ids = short_uuids(parts)
    assert len(ids) == MAX_PART_UUIDS and all(len(u) == UUID_PREFIX_CHARS for u in ids)
    assert ids[0] == "000000010000" + "4000"  # the 50-row part first
    assert "0" * UUID_PREFIX_CHARS not in ids


def evidence_wanted(record: XidRecord, view: plan_ops.StagingView, **kw: Any) -> tuple[str, ...]:
    """Every UUID :func:`planner.evidence_by_target` asks for, in one tuple."""
    wanted = planner.evidence_by_target(record, view, **kw)
    return tuple(dict.fromkeys(u for uuids in wanted.values() for u in uuids))


# ------------------------------------------------------------------ plan_publish


def test_an_empty_staging_partition_whose_uuid_is_in_the_target_counts_as_published() -> None:
    rec = record(StagedPart("s1", "p1", 5, uuids=(U1, U2)), StagedPart("s1", "p2", 3, uuids=(U3,)))
    view = {"s1": {"p2": 3}}
    assert evidence_wanted(rec, view, resumed=False) == (U1, U2)
    ops = planner.plan_publish(rec, view, frozenset({U2}))
    assert kinds(ops) == ["uuid", "Publish", "RecordCommitted", "DropStaging"]


def test_uuids_gone_from_the_target_fall_back_to_protected_staging_evidence() -> None:
    rec = record(StagedPart("s1", "p1", 5, uuids=(U1,)))
    ops = planner.plan_publish(rec, {"s1": {}}, frozenset())
    assert kinds(ops) == ["protected", "RecordCommitted", "DropStaging"]


def test_a_record_from_before_uuids_keeps_the_old_rule_and_says_so() -> None:
    rec = record(StagedPart("s1", "p1", 5), StagedPart("s1", "p2", 3))
    assert evidence_wanted(rec, {"s1": {"p2": 3}}) == ()
    ops = planner.plan_publish(rec, {"s1": {"p2": 3}})
    assert kinds(ops) == ["legacy", "Publish", "RecordCommitted", "DropStaging"]


def test_an_empty_partition_without_evidence_in_a_new_record_is_an_alarm_not_a_guess() -> None:
    rec = record(StagedPart("s1", "p1", 5, uuids=(U1,)), StagedPart("s1", "p2", 3))
    ops = planner.plan_publish(rec, {"s1": {"p1": 5}}, frozenset())
    assert kinds(ops) == ["Alarm"]
    assert isinstance(ops[0], plan_ops.Alarm) and "p2" in ops[0].reason and "s1" in ops[0].reason


def test_a_partial_partition_is_an_alarm_whatever_the_uuids_say() -> None:
    rec = record(StagedPart("s1", "p1", 5, uuids=(U1,)))
    assert kinds(planner.plan_publish(rec, {"s1": {"p1": 2}}, frozenset({U1}))) == ["Alarm"]


def test_no_lookup_is_wanted_for_committed_dedup_or_missing_staging() -> None:
    part = StagedPart("s1", "p1", 5, uuids=(U1,))
    assert evidence_wanted(record(part), {"s1": None}) == ()
    done = XidRecord("j", "b1", 1, XidState.COMMITTED, 1, Mode.ATTACH, "db.t", (part,))
    assert evidence_wanted(done, {"s1": {}}) == ()


# ------------------------------------------------------------------ column catch-up


def table(name: str, cols: list[ColumnInfo], **kw: str) -> TargetInfo:
    db, t = name.split(".")
    base = {"partition_key": "toYYYYMM(d)", "sorting_key": "k", "primary_key": "k"}
    return TargetInfo(db, t, "MergeTree", columns=tuple(cols), **{**base, **kw})


D, K, V = ColumnInfo("d", "Date"), ColumnInfo("k", "UInt64"), ColumnInfo("v", "String")


def test_columns_the_target_gained_anywhere_are_added_after_their_neighbour() -> None:
    first = ColumnInfo("f", "UInt8")
    mid = ColumnInfo("note", "String", "DEFAULT", "'n/a'", "CODEC(ZSTD(1))")
    last = ColumnInfo("m", "UInt64", "MATERIALIZED", "k * 2")
    staging = table("stg.s", [D, K, V])
    target = table("db.t", [first, D, K, mid, V, last])
    adds, problem = plan_column_catch_up(staging, target)
    assert problem is None
    assert [(a.column, a.after) for a in adds] == [(first, None), (mid, "k"), (last, "v")]


def test_a_dropped_column_is_refused_naming_table_column_and_next_step() -> None:
    adds, problem = plan_column_catch_up(table("stg.s", [D, K, V]), table("db.t", [D, K]))
    assert adds == [] and problem is not None
    assert "db.t" in problem and " v " in f" {problem.split('column(s) ')[1]}"
    assert "ADD COLUMN" in problem and "txsink recover" in problem


def test_a_retyped_column_or_a_changed_key_is_refused() -> None:
    _, problem = plan_column_catch_up(
        table("stg.s", [D, K, V]), table("db.t", [D, ColumnInfo("k", "Int64"), V])
    )
    assert problem and "k (UInt64 -> Int64)" in problem
    _, problem = plan_column_catch_up(
        table("stg.s", [D, K, V]), table("db.t", [D, K, V], sorting_key="k, d")
    )
    assert problem and "sorting key" in problem and "db.t" in problem


def test_a_partition_both_staged_and_in_the_target_is_not_moved_twice() -> None:
    """A server crash inside MOVE PARTITION (destination committed, source not yet
    removed) leaves the rows in both: the UUIDs in the target say it landed."""
    rec = record(StagedPart("s1", "p1", 5, uuids=(U1,)), StagedPart("s1", "p2", 3, uuids=(U2,)))
    view = {"s1": {"p1": 5, "p2": 3}}
    staged = {("s1", "p1"): (U1,), ("s1", "p2"): (U2,)}  # every part staging holds now
    assert evidence_wanted(rec, view, resumed=False) == ()
    assert evidence_wanted(rec, view, staged=staged) == (U1, U2)
    ops = planner.plan_publish(rec, view, frozenset({U1}), staged)
    assert kinds(ops) == ["uuid", "Publish", "RecordCommitted", "DropStaging"]
    assert [o.partition_id for o in ops if isinstance(o, plan_ops.Publish)] == ["p2"]


def test_a_move_cut_between_parts_is_repaired_without_publishing_a_part_twice() -> None:
    """ClickHouse renames a MOVE's parts into the target one by one: a crash between two
    renames leaves some parts in the target and all rows still in staging. Neither
    moving again (duplicates) nor calling it published (loses the rest) is sound: the
    parts found in the target are recorded, dropped from staging, the rest moved."""
    small = "c" * 16  # a small part the manifest did not record (it keeps the 4 largest)
    rec = record(StagedPart("s1", "p1", 10, uuids=(U1,)))
    view = {"s1": {"p1": 10}}
    staged = {("s1", "p1"): (U1, small)}
    rows = {U1: 7, small: 3}
    assert evidence_wanted(rec, view, staged=staged) == (U1, small)
    ops = planner.plan_publish(rec, view, frozenset({small}), staged, rows)
    assert kinds(ops) == ["RecordCut", "DropParts", "Publish", "RecordCommitted", "DropStaging"]
    assert ops[0].cut == {small: 3}  # type: ignore[union-attr]
    assert ops[1].evidence == (small,)  # type: ignore[union-attr]
    assert ops[2].rows == 7  # type: ignore[union-attr]
    # without the rows of the parts found, nothing is guessed
    blind = planner.plan_publish(rec, view, frozenset({small}), staged)
    assert kinds(blind) == ["Alarm"] and "partly in" in blind[0].reason  # type: ignore[union-attr]
    both = planner.plan_publish(rec, view, frozenset({U1, small}), staged, rows)
    assert kinds(both) == ["uuid", "RecordCommitted", "DropStaging"]
    none = planner.plan_publish(rec, view, frozenset(), staged, rows)
    assert kinds(none) == ["Publish", "RecordCommitted", "DropStaging"]


def test_a_cut_repair_interrupted_at_every_step_replans_to_the_same_end() -> None:
    """The recorded cut outlives the target's merges: after the record, after the drop,
    after the move, a fresh look plans only what is left, even when the target no longer
    shows the UUIDs of the parts it got from the cut MOVE."""
    small = "c" * 16
    cut = record(StagedPart("s1", "p1", 10, uuids=(U1,)))
    cut = replace(cut, cuts=(Cut("s1", "p1", {small: 3}),))
    rows = {U1: 7, small: 3}
    # recorded, not yet dropped; the target merged the cut part away (no UUID shows)
    ops = planner.plan_publish(
        cut, {"s1": {"p1": 10}}, frozenset(), {("s1", "p1"): (U1, small)}, rows
    )
    assert kinds(ops) == ["DropParts", "Publish", "RecordCommitted", "DropStaging"]
    assert ops[1].rows == 7  # type: ignore[union-attr]
    # dropped, not yet moved
    ops = planner.plan_publish(cut, {"s1": {"p1": 7}}, frozenset(), {("s1", "p1"): (U1,)}, {U1: 7})
    assert kinds(ops) == ["Publish", "RecordCommitted", "DropStaging"]
    # moved: the usual evidence of an empty partition
    ops = planner.plan_publish(cut, {"s1": {"p1": 0}}, frozenset({U1}), {}, {})
    assert kinds(ops) == ["uuid", "RecordCommitted", "DropStaging"]
    # counts that do not add up are never guessed at
    ops = planner.plan_publish(cut, {"s1": {"p1": 5}}, frozenset(), {("s1", "p1"): (U1,)}, {U1: 5})
    assert kinds(ops) == ["Alarm"]
