"""The publish sequence, driven op by op by a scripted executor (no services, no Transactor).

A small world of staging tables, targets and parts with UUIDs stands in for ClickHouse and
one record for Keeper. Every crash point (the runner stops after any yielded step, with or
without carrying it out) and every lost reply (the step landed, the runner got an error)
must converge, from a fresh generator on the state left behind, to the same end: every row
in its target exactly once, the record COMMITTED, no staging left.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from txsink.protocol import ops, sequence, steps
from txsink.protocol.evidence_life import EvidenceLife
from txsink.protocol.ids import batch_claim_name, staging_prefix
from txsink.protocol.planner import plan_batch_publish, plan_publish
from txsink.protocol.states import Cut, Mode, StagedPart, Visibility, XidRecord, XidState

PREFIX = staging_prefix("j")
S1, S2 = f"{PREFIX}__b1__r0000000a_p0_a0_t1", f"{PREFIX}__b1__r0000000a_p1_a0_t2"
TARGET = "db.t"
BOUNDS = steps.PublishBounds(retry_s=1.0)
# staging table -> partition -> part uuid -> rows
STAGED = {S1: {"0": {"u1": 2, "u2": 3}, "1": {"u3": 4}}, S2: {"0": {"u4": 1}}}


class LostReply(Exception):
    """The step landed; its reply did not reach the runner."""


class Crash(Exception):
    """The runner died (before or after carrying out a step)."""


def with_cut(record: XidRecord, staging: str, partition_id: str, cut: dict[str, int]) -> XidRecord:
    """The record with cut facts written, merged as :meth:`Registry.amend` merges them."""
    return record.with_cuts([Cut(staging, partition_id, cut)])


def make_record(visibility: str) -> XidRecord:
    manifest = tuple(
        StagedPart(table, pid, sum(parts.values()), uuids=tuple(parts))
        for table, pids in STAGED.items()
        for pid, parts in pids.items()
    )
    vis = Visibility.BATCH if visibility == "batch" else Visibility.PARTITION
    return XidRecord(
        job="j", xid="b1", batch=1, state=XidState.PREPARED, epoch=1, mode=Mode.ATTACH,
        target=TARGET, manifest=manifest, created_at=1.0, visibility=vis,
    )  # fmt: skip


@dataclass
class World:
    """ClickHouse (tables of parts; a MOVE keeps part UUIDs, an ATTACH copies them, a
    RENAME keeps the table) and Keeper (one record), as the scripted executor sees them."""

    record: XidRecord
    tables: dict[str, dict[str, dict[str, int]]] = field(default_factory=dict)
    query_log: set[tuple[str, str]] = field(default_factory=set)
    gather: dict[str, ops.Gathered] = field(default_factory=dict)  # a fresh publish's

    @classmethod
    def fresh(cls, visibility: str) -> World:
        """``gathered``: a batch whose fresh publish gathers it (GatherBatch);
        ``created``: whose fresh publish creates its batch staging gathered
        (CreateGathered)."""
        tables = {t: {p: dict(parts) for p, parts in pids.items()} for t, pids in STAGED.items()}
        shape = ops.BatchShape("ddl", (("p", "Int32", ""),)) if visibility == "created" else None
        gather = (
            {TARGET: ops.Gathered(("p", "id"), 1, shape)}
            if shape or visibility == "gathered"
            else {}
        )
        return cls(make_record("batch" if gather else visibility), tables, gather=gather)

    def view(self, tables: tuple[str, ...]) -> dict[str, dict[str, int] | None]:
        out: dict[str, dict[str, int] | None] = {}
        for t in tables:
            pids = self.tables.get(t)
            out[t] = None if pids is None else {p: sum(v.values()) for p, v in pids.items() if v}
        return out

    def move(self, source: str, pid: str, dest: str) -> None:
        parts = self.tables[source].pop(pid, {})
        self.tables.setdefault(dest, {}).setdefault(pid, {}).update(parts)

    def target_rows(self) -> dict[str, int]:
        return {p: sum(v.values()) for p, v in self.tables.get(TARGET, {}).items()}


@dataclass
class Executor:
    """A scripted runner: carries out each step on the world (its claims are its memory)."""

    world: World
    claims: dict[str, str] = field(default_factory=dict)
    acts: int = 0

    def __call__(self, step: steps.Step) -> Any:
        w = self.world
        if isinstance(step, steps.Stop):
            raise AssertionError(f"the publish stopped: {step.failure}: {step.message}")
        if isinstance(step, steps.ListStaging):
            return sorted(t for t in w.tables if t.startswith(step.prefix))
        if isinstance(step, steps.ObserveStaging):
            return w.view(step.tables)
        if isinstance(step, steps.ObservePartRows):
            return {p: dict(v) for p, v in w.tables.get(step.table, {}).items() if v}
        if isinstance(step, steps.ObserveBatchParts):
            return {p: tuple(v) for p, v in w.tables.get(step.table, {}).items() if v}
        if isinstance(step, steps.ObservePublished):
            there = {u for v in w.tables.get(step.target, {}).values() for u in v}
            return frozenset(u for u in step.uuids if u in there)
        if isinstance(step, steps.ObserveAttachLog):
            return (step.target, step.tag) in w.query_log
        if isinstance(step, steps.HeldClaims):
            return dict(self.claims)
        if isinstance(step, steps.ObserveEvidenceLife):  # no restart, a fresh record
            return EvidenceLife(uptime_s=float("inf"), parts_lifetime_s=480.0)
        if isinstance(step, steps.ObserveDetached):
            return {}
        if isinstance(step, (steps.Settle,)):
            return True
        if isinstance(step, (steps.CheckFence, steps.FaultPoint, ops.Evidence)):
            return None
        if isinstance(step, steps.ReadRecord):
            return w.record
        self.acts += 1
        if isinstance(step, steps.MovePartitions):
            for pid in step.partition_ids:
                w.move(step.staging, pid, step.target)
        elif isinstance(step, ops.Consolidate):
            w.move(step.staging, step.partition_id, step.batch_staging)
        elif isinstance(step, ops.CopyIntoBatch):
            for table, pid in step.sources:  # copies: UUIDs kept, the source unchanged
                for p, parts in w.tables[table].items():
                    if pid in ("", p):
                        w.tables[step.batch_staging].setdefault(p, {}).update(parts)
        elif isinstance(step, (ops.GatherBatch, ops.CreateGathered)):  # one part a partition
            into = getattr(step, "batch_staging", "")
            if isinstance(step, ops.CreateGathered):
                into = batch_claim_name(step.table, f"{self.acts:08x}")
                self.claims[step.claimed] = into
                w.tables[into] = {}
            rows: dict[str, int] = {}
            for table in step.tables:
                for p, parts in w.tables[table].items():
                    rows[p] = rows.get(p, 0) + sum(parts.values())
            for p, n in rows.items():
                w.tables[into].setdefault(p, {})[f"g{self.acts}{p}"] = n
            return into
        elif isinstance(step, steps.DropTables):
            for t in step.tables:
                w.tables.pop(t, None)
        elif isinstance(step, ops.CreateBatchStaging):
            name = step.table
            if step.claimed:
                name = batch_claim_name(step.table, f"{self.acts:08x}")
                self.claims[step.claimed] = name
            w.tables.setdefault(name, {})
            return name
        elif isinstance(step, ops.ClaimBatch):
            name = batch_claim_name(step.batch_staging, f"{self.acts:08x}")
            w.tables[name] = w.tables.pop(step.batch_staging)
            self.claims[step.target] = name
            return name
        elif isinstance(step, steps.Attach):
            self.claims.pop(step.target, None)
            for pid, parts in w.tables[step.batch_staging].items():
                w.tables.setdefault(step.target, {}).setdefault(pid, {}).update(parts)
            w.query_log.add((step.target, step.tag))
        elif isinstance(step, ops.DropParts):
            for u in step.evidence:
                w.tables[step.staging][step.partition_id].pop(u, None)
        elif isinstance(step, steps.Write) and isinstance(step.op, ops.RecordCut):
            w.record = with_cut(w.record, step.op.staging, step.op.partition_id, dict(step.op.cut))
            return w.record
        elif isinstance(step, steps.Write):
            w.record = w.record.with_state(XidState.COMMITTED, committed_at=2.0)
            return w.record
        else:
            raise AssertionError(f"unexpected step {step!r}")
        return None


def is_act(step: steps.Step) -> bool:
    observing = (
        steps.ListStaging, steps.ObserveStaging, steps.ObservePartRows, steps.ObserveBatchParts,
        steps.ObservePublished, steps.ObserveAttachLog, steps.HeldClaims, steps.Settle,
        steps.CheckFence, steps.ReadRecord, steps.FaultPoint, ops.Evidence,
    )  # fmt: skip
    return not isinstance(step, observing)


def drive(
    run: steps.Run, execute: Executor, *, stop_at: int | None = None, how: str = ""
) -> tuple[XidRecord | None, list[steps.Step]]:
    """Send each step's result back; at step ``stop_at``: ``before`` (crash, not carried
    out), ``after`` (crash once carried out) or ``lost`` (carried out, reply lost)."""
    seen: list[steps.Step] = []
    reply: Any = None
    try:
        while True:
            step = run.send(reply)
            seen.append(step)
            if len(seen) - 1 == stop_at and how == "before":
                raise Crash
            reply = execute(step)
            if len(seen) - 1 == stop_at:
                raise Crash if how == "after" else LostReply
    except StopIteration as done:
        return done.value, seen
    except (Crash, LostReply):
        run.close()
        return None, seen


def attempt(world: World, *, resumed: bool, after_failure: bool = False) -> steps.Run:
    return sequence.publish_attempt(
        world.record, PREFIX, BOUNDS, resumed=resumed, after_failure=after_failure,
        gather=world.gather,
    )  # fmt: skip


def assert_published_once(world: World) -> None:
    assert world.record.state is XidState.COMMITTED
    assert world.target_rows() == world.record.partition_rows()
    assert [t for t in world.tables if t != TARGET] == []


@pytest.mark.parametrize("visibility", ["partition", "batch"])
def test_an_uninterrupted_publish_ends_committed_with_every_row_once(visibility: str) -> None:
    world = World.fresh(visibility)
    record, seen = drive(attempt(world, resumed=False), Executor(world))
    assert record is not None and record == world.record
    assert_published_once(world)
    kinds = {type(s).__name__ for s in seen}
    assert ("Attach" in kinds) is (visibility == "batch")
    assert ("MovePartitions" in kinds) is (visibility == "partition")


def full_run(visibility: str) -> list[steps.Step]:
    world = World.fresh(visibility)
    return drive(attempt(world, resumed=False), Executor(world))[1]


@pytest.mark.parametrize("how", ["before", "after"])
@pytest.mark.parametrize("visibility", ["partition", "batch", "gathered", "created"])
def test_a_crash_after_any_step_converges_from_a_fresh_sequence(visibility: str, how: str) -> None:
    """The runner dies at step k; a new runner (no claims) starts a fresh, resumed
    sequence on what the stores show. Same end for every k."""
    for k in range(len(full_run(visibility))):
        world = World.fresh(visibility)
        first, _ = drive(attempt(world, resumed=False), Executor(world), stop_at=k, how=how)
        assert first is None
        again, _ = drive(attempt(world, resumed=True), Executor(world))
        assert again is not None, k
        assert_published_once(world)


@pytest.mark.parametrize("visibility", ["partition", "batch", "gathered", "created"])
def test_a_lost_reply_of_any_act_is_re_observed_never_repeated(visibility: str) -> None:
    """The act landed and the runner got an error: the same runner (its claims kept)
    looks again from a fresh sequence after a failure; nothing lands twice."""
    acts = [i for i, s in enumerate(full_run(visibility)) if is_act(s)]
    assert acts
    for k in acts:
        world = World.fresh(visibility)
        execute = Executor(world)
        drive(attempt(world, resumed=False), execute, stop_at=k, how="lost")
        again, _ = drive(attempt(world, resumed=True, after_failure=True), execute)
        assert again is not None, k
        assert_published_once(world)


def test_a_claim_is_fenced_before_and_waited_out_after() -> None:
    """A fresh publish is fenced before its claim (a finisher that took the job over
    later claims the table away and waits out its ATTACH); a resumed one also waits out
    every statement another finisher sent before its claim, then looks again."""
    seen = full_run("batch")
    i = next(i for i, s in enumerate(seen) if isinstance(s, steps.Attach))
    assert steps.CheckFence() in seen[:i]  # created held, fenced before the ATTACH
    assert not any(isinstance(s, ops.ClaimBatch) for s in seen)
    world = World.fresh("batch")  # a finisher that created its batch staging, then died
    made = next(i for i, s in enumerate(seen) if isinstance(s, ops.CreateBatchStaging))
    drive(attempt(world, resumed=False), Executor(world), stop_at=made, how="after")
    _, seen = drive(attempt(world, resumed=True), Executor(world))
    i = next(i for i, s in enumerate(seen) if isinstance(s, ops.ClaimBatch))
    assert isinstance(seen[i - 1], steps.CheckFence)
    assert isinstance(seen[i + 1], steps.Settle) and seen[i + 1].fresh  # type: ignore[union-attr]


def test_a_fresh_batch_publish_sends_the_same_statements_whatever_the_tasks() -> None:
    """The fresh path copies every task partition in one statement: its acts do not
    grow with the number of task staging tables (here 2; see benchmarks/counts.py for
    200 on the real engine)."""
    kinds = [type(s).__name__ for s in full_run("batch") if is_act(s)]
    assert kinds == ["CreateBatchStaging", "CopyIntoBatch", "Attach", "Write", "DropTables"]
    gathered = World.fresh("batch")
    run = sequence.publish_attempt(
        gathered.record, PREFIX, BOUNDS, resumed=False, after_failure=False,
        gather={TARGET: ops.Gathered(("p", "id"), 1)},
    )  # fmt: skip
    _, seen = drive(run, Executor(gathered))
    kinds = [type(s).__name__ for s in seen if is_act(s)]
    assert kinds == ["CreateBatchStaging", "GatherBatch", "Attach", "Write", "DropTables"]
    assert_published_once(gathered)
    assert all(len(parts) == 1 for parts in gathered.tables[TARGET].values())
    kinds = [type(s).__name__ for s in full_run("created") if is_act(s)]
    assert kinds == ["CreateGathered", "Attach", "Write", "DropTables"]  # 4 + the one read


def test_only_the_drop_after_a_committed_batch_publish_leaves_out_sync() -> None:
    """The fresh batch publish's one DROP, after COMMITTED, does not wait for the data to
    go (its tables are never read or named again); every drop a finisher makes before
    its record says COMMITTED (twins, a batch staging built again) and every drop of the
    partition path (replicated staging, whose Keeper path must go with it) waits."""
    drops = [s for s in full_run("batch") if isinstance(s, steps.DropTables)]
    assert [d.wait for d in drops] == [False]
    drops = [s for s in full_run("gathered") if isinstance(s, steps.DropTables)]
    assert [d.wait for d in drops] == [False]  # a small gathered batch
    big = World.fresh("gathered")  # its task staging's data is in no target part
    big.gather = {TARGET: ops.Gathered(("p", "id"), ops.DROP_WAIT_BYTES + 1)}
    _, seen = drive(attempt(big, resumed=False), Executor(big))
    assert [s.wait for s in seen if isinstance(s, steps.DropTables)] == [True]
    assert all(s.wait for s in full_run("partition") if isinstance(s, steps.DropTables))
    world = World.fresh("batch")  # a finisher that created its batch staging, then died
    seen = full_run("batch")
    made = next(i for i, s in enumerate(seen) if isinstance(s, ops.CreateBatchStaging))
    drive(attempt(world, resumed=False), Executor(world), stop_at=made, how="after")
    _, resumed = drive(attempt(world, resumed=True), Executor(world))
    assert all(s.wait for s in resumed if isinstance(s, steps.DropTables))


def test_an_alarm_stops_the_sequence_before_anything_of_its_plan_runs() -> None:
    world = World.fresh("partition")
    world.tables[S1]["0"]["u9"] = 7  # rows the manifest does not account for
    run = attempt(world, resumed=False)
    execute = Executor(world)
    reply: Any = None
    while not isinstance(step := run.send(reply), steps.Stop):
        assert not is_act(step)
        reply = execute(step)
    assert step.failure is steps.Failure.ALARM


# -- one planner: the batch variant makes the same checks on the same manifest ------------

B = "batch_staging"


def variants(view: dict[str, dict[str, int] | None], **kw: Any) -> tuple[list[str], list[str]]:
    """Op kinds of both planners on one observation (Consolidate read as Publish)."""
    part, batch = make_record("partition"), make_record("batch")
    staged = {(t, p): tuple(parts) for t, pids in STAGED.items() for p, parts in pids.items()}
    found = kw.get("found", frozenset())
    rows = {u: n for pids in STAGED.values() for parts in pids.values() for u, n in parts.items()}
    a = plan_publish(part, view, found, staged, rows)
    bview = {**view, B: {}}
    b = plan_batch_publish(batch, {TARGET: B}, bview, staged, {B: tuple(found)}, {}, part_rows=rows)
    name = {"Consolidate": "Publish"}
    return [type(o).__name__ for o in a], [name.get(type(o).__name__, type(o).__name__) for o in b]


def full() -> dict[str, dict[str, int] | None]:
    return {t: {p: sum(v.values()) for p, v in pids.items()} for t, pids in STAGED.items()}


@pytest.mark.parametrize(
    "case",
    ["fresh", "missing table", "count differs", "unlisted partition", "cut move", "all moved"],
)
def test_both_visibilities_make_the_same_checks_on_the_same_manifest(case: str) -> None:
    view, found = full(), frozenset[str]()
    if case == "missing table":
        view[S2] = None
    elif case == "count differs":
        view[S1] = {"0": 4, "1": 4}
    elif case == "unlisted partition":
        view[S2] = {"0": 1, "9": 3}
    elif case == "cut move":
        found = frozenset({"u1"})  # u1 in the sink, u2 not: a MOVE cut between parts
    elif case == "all moved":
        found = frozenset({"u1", "u2"})
    partition, batch = variants(view, found=found)
    if case in ("missing table", "count differs", "unlisted partition"):
        assert partition == batch == ["Alarm"]
        return
    assert partition[-3:] == ["RecordCommitted", "DropStaging", "DropStaging"]
    # task staging is whole: the batch variant copies it (again, if a copy or a cut MOVE
    # left part of it in the batch staging) and attaches from a fresh look
    assert batch[-2] in ("CopyIntoBatch", "DropStaging") and batch[-1] == "Reobserve"


# -- copies of one batch: review findings of the copy-built batch staging ----------------


def batch_copy(world: World, token: str) -> str:
    """A full copy of the task staging under a finisher's name (a finisher's build)."""
    base = sequence.batch_staging_name(PREFIX, "b1", TARGET)
    name = batch_claim_name(base, token)
    merged: dict[str, dict[str, int]] = {}
    for t in (S1, S2):
        for p, v in world.tables[t].items():
            merged.setdefault(p, {}).update(v)
    world.tables[name] = merged
    return name


def test_twin_copies_of_a_batch_are_retired_and_the_batch_published_once() -> None:
    """A fresh commit's build raced a takeover's: two full copies under finishers' names.
    Before, every later recovery stopped on an alarm; now the twin is dropped after the
    fence check and the server waited quiet, and one copy is attached."""
    world = World.fresh("batch")
    batch_copy(world, "aaaaaaaa")
    batch_copy(world, "bbbbbbbb")
    record, seen = drive(attempt(world, resumed=True), Executor(world))
    assert record is not None
    assert_published_once(world)
    assert sum(isinstance(s, steps.Attach) for s in seen) == 1


def test_a_twin_already_attached_proves_the_batch_and_nothing_is_attached_again() -> None:
    world = World.fresh("batch")
    first = batch_copy(world, "aaaaaaaa")
    batch_copy(world, "bbbbbbbb")
    for pid, parts in world.tables[first].items():  # one copy landed, then its finisher died
        world.tables.setdefault(TARGET, {}).setdefault(pid, {}).update(parts)
    record, seen = drive(attempt(world, resumed=True), Executor(world))
    assert record is not None and record.state is XidState.COMMITTED
    assert not any(isinstance(s, steps.Attach) for s in seen)
    assert_published_once(world)


def test_a_batch_staging_renamed_away_is_never_created_again_under_its_holders_name() -> None:
    """Listed under a finisher's name, then renamed away before it was read: looked at
    again, never re-created under that name (its holder may ATTACH from it); the runner
    refuses a copy into a name it does not hold."""
    base = sequence.batch_staging_name(PREFIX, "b1", TARGET)
    held = batch_claim_name(base, "cccccccc")
    record = make_record("batch")
    staged = {(t, p): tuple(v) for t, pids in STAGED.items() for p, v in pids.items()}
    view = {S1: {"0": 5, "1": 4}, S2: {"0": 1}, held: None}
    ops_ = plan_batch_publish(record, {TARGET: held}, view, staged, {}, {})
    assert ops_ == [ops.Reobserve(), ops.Reobserve()]


def test_a_copy_with_no_part_uuids_to_check_it_by_is_an_alarm_not_a_loop() -> None:
    record = make_record("batch")
    view = {S1: {"0": 5, "1": 4}, S2: {"0": 1}, "batch_staging": None}
    plan = plan_batch_publish(record, {TARGET: "batch_staging"}, view, {}, {}, {})
    assert [type(o) for o in plan] == [ops.Alarm]


def test_the_runner_never_builds_under_a_name_another_finisher_holds() -> None:
    """The runner's backstop of the rule above: a copy into, or a plain CREATE of, a
    batch staging under a finisher's name it does not hold is refused before any
    statement; under its own name (created held) it goes ahead."""
    from txsink.errors import RetryableConflict
    from txsink.ports.registry_memory import MemoryRegistry
    from txsink.ports.warehouse_memory import MemoryWarehouse
    from txsink.transactor import Transactor

    wh = MemoryWarehouse()
    tx = Transactor(MemoryRegistry(), wh, "j")
    base = sequence.batch_staging_name(tx.prefix, "b1", TARGET)
    foreign = batch_claim_name(base, "dddddddd")
    epoch = tx.begin("run-1")
    for step in (
        ops.CopyIntoBatch("b1", foreign, ((S1, ""),), 1),
        ops.CreateBatchStaging(foreign, "", S1),
    ):
        with pytest.raises(RetryableConflict, match="another finisher's name"):
            tx.runner.act(epoch, step, deadline=0.0, failure=None)
    assert foreign not in wh.staging
