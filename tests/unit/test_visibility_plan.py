"""plan_batch_publish decides every step of visibility=batch from observations alone."""

from __future__ import annotations

from txsink.protocol import ops as plan_ops
from txsink.protocol import planner
from txsink.protocol import visibility as v
from txsink.protocol.ids import batch_staging_name, parse_staging, staging_prefix
from txsink.protocol.ops import Alarm, Evidence, RecordCommitted
from txsink.protocol.plans import droppable, plan_recovery
from txsink.protocol.states import Mode, StagedPart, Visibility, XidRecord, XidState

PREFIX = staging_prefix("j")
S1, S2 = f"{PREFIX}__b1__r0000000a_p0_a0_t1", f"{PREFIX}__b1__r0000000a_p1_a0_t2"
B = batch_staging_name(PREFIX, "b1", "db.t")
TABLES = {"db.t": B}


def record(state: XidState = XidState.PREPARED) -> XidRecord:
    parts = (StagedPart(S1, "0", 5, uuids=("aa",)), StagedPart(S2, "1", 7, uuids=("bb",)))
    return XidRecord(
        job="j", xid="b1", batch=1, state=state, epoch=1, mode=Mode.ATTACH, target="db.t",
        manifest=parts, created_at=0.0, visibility=Visibility.BATCH,
    )  # fmt: skip


def test_batch_staging_names_parse_back_as_the_jobs_staging_of_the_xid() -> None:
    name = parse_staging(B)
    assert name is not None and name.batch and name.xid == "b1" and name.table == B


def test_fresh_batch_is_copied_in_one_statement_then_replanned() -> None:
    view = {S1: {"0": 5}, S2: {"1": 7}, B: None}
    staged = {(S1, "0"): ("aa",), (S2, "1"): ("bb",)}
    ops = planner.plan_batch_publish(record(), TABLES, view, staged, {}, {})
    assert isinstance(ops[0], plan_ops.CreateBatchStaging)
    assert ops[1:] == [
        plan_ops.CopyIntoBatch("b1", B, ((S1, plan_ops.ALL_PARTITIONS), (S2, "")), 12),
        plan_ops.Reobserve(),
    ]
    view[B] = {}  # created, nothing copied yet: copied, not created again
    ops = planner.plan_batch_publish(record(), TABLES, view, staged, {}, {})
    assert [type(o) for o in ops] == [plan_ops.CopyIntoBatch, plan_ops.Reobserve]


WHOLE = {S1: {"0": 5}, S2: {"1": 7}}
STAGED = {(S1, "0"): ("aa",), (S2, "1"): ("bb",)}


def copied(parts: dict[str, tuple[str, ...]], **kw: object) -> list[plan_ops.Operation]:
    rows = {"0": 5, "1": 7}
    bview = {p: rows[p] * len(u) for p, u in parts.items()}
    uuids = tuple(dict.fromkeys(u for ids in parts.values() for u in ids))
    return planner.plan_batch_publish(
        record(), TABLES, {**WHOLE, B: bview}, STAGED, {B: uuids}, {"db.t": set()},
        batch_parts={B: parts}, **kw,  # type: ignore[arg-type]
    )  # fmt: skip


def test_an_exact_copy_is_claimed_then_attached_and_a_wrong_one_built_again() -> None:
    """Copies leave task staging whole, so a batch staging that is not exactly its parts
    (a copy cut short, or doubled by a late one) was never attached (an ATTACH runs only
    on exact content) and is built again: dropped at once while it has the name no
    finisher attaches from, claimed first otherwise."""
    exact = {"0": ("aa",), "1": ("bb",)}
    assert [type(o) for o in copied(exact)] == [plan_ops.ClaimBatch, plan_ops.Reobserve]
    ops = copied(exact, claimed={"db.t"})
    assert isinstance(ops[0], plan_ops.AttachAll) and isinstance(ops[1], RecordCommitted)
    compacted = {"0": ("m0",), "1": ("m1",)}  # gathered: one new part per partition
    assert isinstance(copied(compacted, claimed={"db.t"})[0], plan_ops.AttachAll)
    for wrong in ({"0": ("aa", "aa"), "1": ("bb",)}, {"0": ("aa",)}, {"0": ("aa", "zz")}):
        assert [type(o) for o in copied(wrong)] == [plan_ops.DropStaging, plan_ops.Reobserve]
        ops = copied(wrong, claimed={"db.t"})
        assert [type(o) for o in ops] == [plan_ops.DropStaging, plan_ops.Reobserve], wrong
    # attached already (its parts in the target): finished, whatever else
    ops = planner.plan_batch_publish(
        record(), TABLES, {**WHOLE, B: {"0": 5, "1": 7}}, STAGED, {B: ("aa", "bb")},
        {"db.t": {"aa", "bb"}}, batch_parts={B: exact},
    )  # fmt: skip
    assert isinstance(ops[0], Evidence) and ops[0].kind == "uuid"


def test_only_a_plain_merge_tree_batch_below_the_limit_is_compacted() -> None:
    assert v.compaction("MergeTree", {"0": 10, "1": 100}, 100)
    assert v.compaction("MergeTree", {"0": 10, "1": 100}, 100, {"0": 1, "1": 2})
    assert not v.compaction("MergeTree", {"0": 10, "1": 100}, 100, {"0": 1, "1": 1})
    assert not v.compaction("MergeTree", {"0": 10, "1": 101}, 100)
    assert not v.compaction("MergeTree", {"0": 10}, 0)
    assert not v.compaction("ReplacingMergeTree", {"0": 10}, 100)
    assert not v.compaction("SummingMergeTree", {"0": 10}, 100)


def test_consolidated_batch_is_claimed_then_attached_once_then_committed() -> None:
    view = {S1: {}, S2: {}, B: {"0": 5, "1": 7}}
    ops = planner.plan_batch_publish(record(), TABLES, view, {}, {B: ("aa", "bb")}, {"db.t": set()})
    assert [type(o) for o in ops] == [
        plan_ops.ClaimBatch,
        plan_ops.Reobserve,
    ]  # never an ATTACH unclaimed
    ops = planner.plan_batch_publish(
        record(), TABLES, view, {}, {B: ("aa", "bb")}, {"db.t": set()}, claimed={"db.t"}
    )
    assert isinstance(ops[0], plan_ops.AttachAll)
    assert isinstance(ops[1], RecordCommitted)
    assert ops[-1] == plan_ops.DropStaging(B, "attached by xid b1")  # only after COMMITTED


def test_an_attach_found_in_the_query_log_is_not_repeated_after_the_target_merged() -> None:
    """The target merged the attached parts and cleaned up the old ones (no UUID shows):
    the finished ATTACH in system.query_log is the evidence; nothing is attached again."""
    view = {S1: {}, S2: {}, B: {"0": 5, "1": 7}}
    ops = planner.plan_batch_publish(
        record(), TABLES, view, {}, {B: ("aa", "bb")}, {"db.t": set()},
        claimed={"db.t"}, logged={"db.t"},
    )  # fmt: skip
    assert not any(isinstance(o, plan_ops.AttachAll) for o in ops)
    assert isinstance(ops[0], Evidence) and ops[0].kind == "logged"
    assert isinstance(ops[1], RecordCommitted)


def test_claimed_batch_staging_names_parse_back_as_the_xids_batch_staging() -> None:
    from txsink.protocol.ids import batch_claim_name

    claimed = batch_claim_name(B, "0123456789")
    name = parse_staging(claimed)
    assert name is not None and name.batch and name.xid == "b1" and name.claim == "01234567"
    assert batch_claim_name(claimed, "89abcdef") == f"{B}_c89abcdef"
    assert plan_recovery("j", [record()], [claimed]).roll_back == ()


def test_an_attach_that_landed_before_a_crash_is_not_attached_again() -> None:
    view = {S1: {}, S2: {}, B: {"0": 5, "1": 7}}
    published = {"db.t": {"aa", "bb"}}
    ops = planner.plan_batch_publish(record(), TABLES, view, {}, {B: ("aa", "bb")}, published)
    assert not any(isinstance(o, plan_ops.AttachAll) for o in ops)
    assert isinstance(ops[0], Evidence)


def test_an_attach_cut_between_parts_or_vanished_rows_is_an_alarm() -> None:
    view = {S1: {}, S2: {}, B: {"0": 5, "1": 7}}
    partly = {"db.t": {"aa"}}
    ops = planner.plan_batch_publish(record(), TABLES, view, {}, {B: ("aa", "bb")}, partly)
    assert isinstance(ops[0], plan_ops.ClaimBatch)  # claimed first: the query log may prove it
    ops = planner.plan_batch_publish(
        record(), TABLES, view, {}, {B: ("aa", "bb")}, partly, claimed={"db.t"}
    )
    assert isinstance(ops[0], Alarm)
    # the target merged some attached parts away: the query log proves the ATTACH
    ops = planner.plan_batch_publish(
        record(), TABLES, view, {}, {B: ("aa", "bb")}, partly, claimed={"db.t"}, logged={"db.t"}
    )
    assert isinstance(ops[0], Evidence) and ops[0].kind == "logged"
    view = {S1: {}, S2: {}, B: {}}
    assert isinstance(planner.plan_batch_publish(record(), TABLES, view, {}, {}, {})[0], Alarm)


def test_a_batch_staging_seen_missing_is_published_only_with_the_query_logs_proof() -> None:
    """Every task partition empty and no batch staging: a finisher renamed it between
    this one's listing and its look (it may never attach: killed, fenced), or an older
    txsink attached and dropped it. Never COMMITTED on that alone."""
    view = {S1: {}, S2: {}, B: None}
    ops = planner.plan_batch_publish(record(), TABLES, view, {}, {}, {})
    assert [type(o) for o in ops] == [plan_ops.Reobserve]
    ops = planner.plan_batch_publish(record(), TABLES, view, {}, {}, {}, logged={"db.t"})
    assert isinstance(ops[0], Evidence) and ops[0].kind == "logged"
    assert any(isinstance(o, RecordCommitted) for o in ops)


def test_a_consolidation_cut_between_parts_is_built_again_from_whole_task_staging() -> None:
    """A server crash cut a copy (or an older txsink's MOVE) of a task partition into the
    batch staging between parts: the task staging still holds every part, so the batch
    staging is dropped and built again (before copies: recorded, dropped, moved)."""
    view = {S1: {"0": 5}, S2: {"1": 7}, B: {"0": 2}}
    staged = {(S1, "0"): ("aa", "cc"), (S2, "1"): ("bb",)}
    ops = planner.plan_batch_publish(
        record(), TABLES, view, staged, {B: ("cc",)}, {}, part_rows={"aa": 3, "cc": 2, "bb": 7},
        batch_parts={B: {"0": ("cc",)}},
    )  # fmt: skip
    assert ops == [plan_ops.DropStaging(B, "not exactly the staging of xid b1: built again"),
                   plan_ops.Reobserve()]  # fmt: skip


def test_partly_consolidated_batch_moves_only_what_is_left() -> None:
    view = {S1: {}, S2: {"1": 7}, B: {"0": 5}}
    staged = {(S2, "1"): ("bb",)}
    ops = planner.plan_batch_publish(record(), TABLES, view, staged, {B: ("aa",)}, {})
    assert [type(o) for o in ops] == [plan_ops.Consolidate, plan_ops.Reobserve]


def test_recovery_keeps_the_batch_staging_of_a_prepared_xid_only() -> None:
    prepared = plan_recovery("j", [record()], [S1, S2, B])
    assert B not in prepared.roll_back and S1 not in prepared.roll_back
    committed = plan_recovery("j", [record(XidState.COMMITTED)], [B])
    assert committed.drop_committed == (B,)
    assert plan_recovery("j", [], [B]).roll_back == (B,)
    assert droppable(record(), [B]) == ()


def test_batch_visibility_is_refused_on_replicated_distributed_and_dedup() -> None:
    assert "non-replicated" in v.batch_refusal("db.t", "ReplicatedMergeTree", "attach")
    assert "non-replicated" in v.batch_refusal("db.t", "Distributed", "attach")
    assert "attach mode" in v.batch_refusal("db.t", "MergeTree", "dedup")
    assert v.batch_refusal("db.t", "ReplacingMergeTree", "attach") == ""


def test_a_gather_names_at_most_so_many_tables_and_bytes_of_columns() -> None:
    assert v.gather_fits(4, ("p", "id"))
    assert not v.gather_fits(4, ())  # columns unknown
    assert v.gather_fits(v.MAX_GATHER_TABLES, ("p", "id"))
    assert not v.gather_fits(v.MAX_GATHER_TABLES + 1, ("p", "id"))
    wide = tuple(f"column_{i:04d}" for i in range(400))  # 200 tables of it: ~1.2 MB
    assert v.gather_fits(10, wide) and not v.gather_fits(200, wide)


def _gathered(parts: dict[str, tuple[str, ...]], rows: dict[str, int]) -> list[str]:
    """What the resumed planner does with a claimed batch staging a gather left as
    ``parts`` (new part ids per partition) holding ``rows``."""
    uuids = tuple(dict.fromkeys(u for ids in parts.values() for u in ids))
    out = planner.plan_batch_publish(
        record(), TABLES, {**WHOLE, B: rows}, STAGED, {B: uuids}, {"db.t": set()},
        claimed={"db.t"}, batch_parts={B: parts},
    )  # fmt: skip
    assert not isinstance(out, Alarm)
    return [type(x).__name__ for x in out]


def test_a_gathered_batch_staging_is_attached_only_whole_in_one_part_per_partition() -> None:
    """A gather cut short, doubled by a late one, or whole but in several parts of a
    partition (several insert blocks) is dropped and built again by copies; only the
    whole batch in one new part per partition is attached."""
    rebuilt = ["DropStaging", "Reobserve"]
    assert _gathered({"0": ("g0",), "1": ("g1",)}, {"0": 5, "1": 3}) == rebuilt  # partial
    assert _gathered({"0": ("g0",)}, {"0": 5}) == rebuilt  # a partition missing
    assert _gathered({"0": ("g0", "h0"), "1": ("g1", "h1")}, {"0": 10, "1": 14}) == rebuilt
    assert _gathered({"0": ("g0", "h0"), "1": ("g1",)}, {"0": 5, "1": 7}) == rebuilt
    assert _gathered({"0": ("g0",), "1": ("g1",)}, {"0": 5, "1": 7})[0] == "AttachAll"
