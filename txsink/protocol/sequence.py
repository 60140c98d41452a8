"""The publish of one xid as a protocol sequence: generators that yield what to observe
and what to do next (:mod:`txsink.protocol.steps`) and receive each observation's result
through ``send()``; the generator's return value is the record as it ends.

This module owns the *order* of a publish: which observations a plan needs, the order
its operations run in, where a claim is fenced and waited out, where a crash is worth
testing (:class:`~txsink.protocol.steps.FaultPoint`), when to look again and when to
give up. The runner (:class:`txsink.publisher.StepRunner`) owns every effect: it carries
each step out against Keeper and ClickHouse, sleeps, retries (tenacity) and raises. The
split is tenacity's own, ``iter()`` decides and ``__call__`` acts: everything here is
pure, never sleeps and reads no clock.

Invariants:
- a sequence is restartable from scratch: a runner that loses a step's reply (or
  crashes after any step) abandons the generator and later starts a fresh one on what
  the stores show then; re-observing is what keeps every step idempotent;
- nothing is moved or attached unless the observations that decided it were made by
  this same generator (no reply is carried over from another sequence);
- an Alarm of a plan becomes a :class:`~txsink.protocol.steps.Stop` before anything of
  that plan runs; a :class:`~txsink.protocol.ops.ClaimBatch` is preceded by
  :class:`~txsink.protocol.steps.CheckFence` (a superseded finisher takes nothing from
  the live one) and followed by :class:`~txsink.protocol.steps.Settle` (a statement
  another finisher sent before the rename is waited out before evidence is read).
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from dataclasses import replace
from typing import Any

from txsink.protocol.evidence_life import EvidenceLife, guard_late_publish, moving_targets
from txsink.protocol.ids import batch_staging_name, seal_tag
from txsink.protocol.ops import (
    ALL_PARTITIONS,
    DROP_WAIT_BYTES,
    Alarm,
    AttachAll,
    ClaimBatch,
    Consolidate,
    CopyIntoBatch,
    CreateBatchStaging,
    CreateGathered,
    DropStaging,
    Gather,
    GatherBatch,
    Operation,
    Publish,
    RecordCommitted,
    RecordCut,
    Reobserve,
    SealDedup,
    StagedUuids,
    StagingView,
)
from txsink.protocol.planner import (
    batch_evidence_wanted,
    by_target,
    emptied_tables,
    evidence_by_target,
    plan_batch_publish,
    plan_publish,
)
from txsink.protocol.states import Mode, XidRecord, XidState
from txsink.protocol.steps import (
    Attach,
    CheckFence,
    DropTables,
    Failure,
    FaultPoint,
    HeldClaims,
    ListStaging,
    MovePartitions,
    ObserveAttachLog,
    ObserveBatchParts,
    ObserveDetached,
    ObserveEvidenceLife,
    ObservePartRows,
    ObservePublished,
    ObserveStaging,
    PublishBounds,
    ReadRecord,
    Run,
    SealRow,
    Settle,
    Step,
    Stop,
    Write,
)
from txsink.protocol.visibility import is_batch

PARTITION_HINT = "Nothing was published for it automatically; see docs/operations.md#lost-staging"
BATCH_HINT = "See docs/modes.md#visibility"


def settle_needles(prefix: str, record: XidRecord) -> tuple[str, ...]:
    """Name fragments of every staging table of ``record`` (every staging name of an
    xid starts with one prefix; odd ones, e.g. renamed by hand, are listed unless there
    are so many that the job's whole prefix is cheaper)."""
    common = f"{prefix}__{record.xid}__"
    odd = sorted({t for t in record.staging_tables if not t.startswith(common)})
    return (common, *odd) if len(odd) < 100 else (common, f"{prefix}__")


def attach_tag(prefix: str, record: XidRecord, target: str) -> str:
    """The ``log_comment`` of the ATTACH that publishes ``record`` into ``target``: the
    same for every finisher of this prepare (its ``created_at`` tells it from an xid of
    the same name in a job deleted and created again), so any finisher finds any
    other's in the query log."""
    return f"txsink attach {prefix} {record.xid} {record.created_at:.6f} {target}"


def publish_attempt(
    record: XidRecord,
    prefix: str,
    bounds: PublishBounds,
    *,
    resumed: bool,
    after_failure: bool,
    gather: Gather | None = None,
) -> Run:
    """One attempt of a publish. ``resumed`` (the record existed before: an earlier
    attempt, a crashed or superseded writer may have a statement in flight): first wait
    until no statement on the xid's staging runs. ``after_failure``: an earlier attempt
    of this publish failed with an unknown outcome; check the fence and re-read the
    record before planning again."""
    if resumed:
        quiet = yield Settle(record.xid, settle_needles(prefix, record))
        if not quiet:
            yield Stop(
                Failure.NOT_QUIET,
                f"xid {record.xid}: statements on its staging are still running on "
                f"ClickHouse after {bounds.retry_s:g}s; nothing was published again. "
                f"`txsink recover --job {record.job}` finishes it",
            )
    if after_failure:
        yield CheckFence()  # a writer that lost the job must not go on
        record = (yield ReadRecord(record.xid)) or record
    return (yield from finish(record, prefix, bounds, resumed=resumed, gather=gather))


def finish(
    record: XidRecord,
    prefix: str,
    bounds: PublishBounds,
    *,
    resumed: bool = True,
    gather: Gather | None = None,
) -> Run:
    """Run the publish plan of a PREPARED (or COMMITTED) record to its end.

    ``resumed``: the record existed before this attempt (a MOVE may have run), so the
    target is searched for the part UUIDs of fully staged partitions too."""
    if is_batch(record):
        return (yield from finish_batch(record, prefix, bounds, resumed=resumed, gather=gather))
    view: StagingView = (yield ObserveStaging(record.staging_tables)) if record.manifest else {}
    part_rows: dict[str, int] = {}
    staged = (yield from staged_uuids(record, view, part_rows)) if resumed else {}
    found: frozenset[str] = frozenset()
    by_table = evidence_by_target(record, view, resumed=resumed, staged=staged)
    for table, wanted in by_table.items():
        found |= yield ObservePublished(table, wanted)
    emptied = emptied_tables(record, view)
    detached: dict[str, dict[str, int]] = (yield ObserveDetached(emptied)) if emptied else {}
    ops = plan_publish(record, view, found, staged, part_rows, detached)
    if resumed:
        ops = yield from guard_late(record, ops)
    return (yield from carry_out(record, prefix, bounds, ops, PARTITION_HINT))


def guard_late(record: XidRecord, ops: list[Operation]) -> Generator[Step, Any, list[Operation]]:
    """``ops`` of a resumed publish, or an Alarm if what it moves or attaches goes into a
    target whose evidence of an earlier move or attach may have been erased since the
    PREPARE (:mod:`txsink.protocol.evidence_life`); one read per such target, none
    when the plan moves nothing."""
    lives: dict[str, EvidenceLife] = {}
    for target in moving_targets(ops):
        lives[target] = yield ObserveEvidenceLife(target, record.created_at)
    return guard_late_publish(record.xid, record.job, ops, lives) if lives else ops


def finish_batch(
    record: XidRecord,
    prefix: str,
    bounds: PublishBounds,
    *,
    resumed: bool = True,
    gather: Gather | None = None,
) -> Run:
    """:func:`finish` of a ``visibility=batch`` record: consolidate every task's staging
    of each table into its batch staging, claim it, then one ATTACH PARTITION ALL per
    table (:func:`~txsink.protocol.planner.plan_batch_publish`, re-planned from a fresh
    look after each round that ends in Reobserve, up to ``bounds.batch_rounds``).
    ``resumed``: an earlier finisher may have attached; an ATTACH is then planned only
    while its absence is provable (:func:`guard_late`). A fresh publish goes straight
    through (:func:`fresh_batch`)."""
    if not resumed and record.state is XidState.PREPARED and record.manifest:
        return (yield from fresh_batch(record, prefix, gather or {}))
    ops: list[Operation] = []
    missing: set[str] = set()
    logged: set[str] = set()
    for _ in range(bounds.batch_rounds):
        tables, twins = yield from batch_tables(record, prefix)
        landed: set[str] = set()
        if twins and record.state is XidState.PREPARED:
            landed = yield from retire_twins(record, prefix, bounds, twins)
        elif twins:  # COMMITTED: leftovers
            yield DropTables(tuple(n for names in twins.values() for n in names))
        view: StagingView = yield ObserveStaging((*record.staging_tables, *tables.values()))
        part_rows: dict[str, int] = {}
        staged = yield from staged_uuids(record, view, part_rows)
        batch_parts: dict[str, dict[str, tuple[str, ...]]] = {}
        for table in tables.values():
            if view.get(table) is not None and record.state is XidState.PREPARED:
                batch_parts[table] = yield ObserveBatchParts(table)
        batch_uuids = {t: every_uuid(by_pid) for t, by_pid in batch_parts.items()}
        published: dict[str, frozenset[str]] = {}
        for target, uuids in batch_evidence_wanted(record, tables, batch_uuids).items():
            published[target] = yield ObservePublished(target, uuids)
        held: dict[str, str] = yield HeldClaims(record.xid)
        claimed = {t for t, name in tables.items() if held.get(t) == name}
        # the query log is read while this finisher holds the claim (nobody can attach
        # meanwhile), or when no batch staging shows at all and every task partition
        # of the table is empty (nothing else can prove such a batch published)
        missing = {
            t
            for t, parts in by_target(record).items()
            if view.get(tables[t]) is None
            and not any((view.get(p.table) or {}).get(p.partition_id) for p in parts)
        }
        logged = set(landed)  # a twin's parts in the target prove it as the log does
        for target in sorted((claimed | missing) - landed):
            if record.state is not XidState.PREPARED:
                continue
            tag = attach_tag(prefix, record, target)
            if (yield ObserveAttachLog(target, tag, record.created_at)):
                logged.add(target)
        ops = plan_batch_publish(
            record, tables, view, staged, batch_uuids, published, claimed, logged, part_rows,
            batch_parts,
        )  # fmt: skip
        if resumed and any(isinstance(op, AttachAll) for op in ops):
            ops = yield from guard_late(record, ops)
        record = yield from carry_out(record, prefix, bounds, ops, BATCH_HINT)
        if not ops or not isinstance(ops[-1], Reobserve):
            return record
    if missing - logged and len(ops) == 1:  # looked again and again: not a rename
        yield Stop(
            Failure.ALARM,
            f"xid {record.xid} (visibility=batch): its task staging is empty, its batch "
            f"staging for {sorted(missing - logged)} is missing under every name, and "
            f"system.query_log shows no ATTACH of it: nothing proves it was published, "
            f"nothing was guessed. See docs/operations.md#lost-staging",
        )
    yield Stop(  # re-observed by the runner's retries until PublishBounds.retry_s
        Failure.CONFLICT,
        f"xid {record.xid} (visibility=batch): its staging kept changing (another "
        f"finisher at work?); see docs/modes.md#visibility",
    )
    raise AssertionError("the runner never resumes a sequence after Stop")


def fresh_batch(record: XidRecord, prefix: str, gather: Gather | None = None) -> Run:
    """The publish of a record this very attempt prepared, with no observation: its task
    staging holds exactly the manifest's rows (read in the one statement before the
    prepare), and no other finisher knows the xid unless one took the job over since.
    Per target: create the batch staging under a name of this finisher's own (claimed
    from the start), fill it in one statement (targets in ``gather``: every task staging
    table's rows inserted into one part per partition, :class:`GatherBatch`, in the
    CREATE itself where the target's shape allows, :class:`CreateGathered`; the others:
    their parts copied, :class:`CopyIntoBatch`), check the fence, ATTACH it; then
    COMMITTED and one DROP. The statements are the same whatever the number of tasks
    and partitions: 4 with the one read before the prepare (a gathered shape), else 5.

    Why no look is needed: a finisher that took the job over before the fence check
    makes it fail (nothing of this attempt is attached); one that took it over after
    the check finds this batch staging (it existed before the check), claims it away
    and waits out an ATTACH already sent before it looks for evidence. Any failure
    sends the publish to the resumed path, which observes everything."""
    claimed: list[str] = []
    gathered = 0
    for target, parts in by_target(record).items():
        base = batch_staging_name(prefix, record.xid, target)
        tables = tuple(dict.fromkeys(p.table for p in parts))  # each one's every partition
        rows = sum(p.rows for p in parts)
        how = (gather or {}).get(target)
        name: str
        if how is not None and how.columns and how.shape is not None:
            name = yield CreateGathered(
                record.xid, base, target, tables, how.columns, rows, how.shape
            )
            yield FaultPoint("driver.after_batch_create")
            gathered += how.staged_bytes
        else:
            name = yield CreateBatchStaging(base, "", parts[0].table, claimed=target)
            yield FaultPoint("driver.after_batch_create")
            if how is not None and how.columns:
                yield GatherBatch(record.xid, name, tables, how.columns, rows)
                gathered += how.staged_bytes
            else:
                sources = tuple((t, ALL_PARTITIONS) for t in tables)
                yield CopyIntoBatch(record.xid, name, sources, rows)
        yield FaultPoint("driver.after_copy")
        yield CheckFence()
        yield FaultPoint("driver.before_attach")
        yield Attach(record.xid, name, target, attach_tag(prefix, record, target))
        yield FaultPoint("driver.after_attach")
        yield FaultPoint("driver.mid_commit")  # a table published, maybe more to go
        claimed.append(name)
    yield FaultPoint("driver.after_commit")
    record = yield Write(record, RecordCommitted(record.xid))
    yield FaultPoint("driver.after_record")
    yield DropTables((*record.staging_tables, *claimed), wait=gathered > DROP_WAIT_BYTES)
    return record


def batch_tables(
    record: XidRecord, prefix: str
) -> Generator[Step, Any, tuple[dict[str, str], dict[str, tuple[str, ...]]]]:
    """Target -> batch staging table of a ``visibility=batch`` record, under the name a
    finisher holds it by if one does (:class:`~txsink.protocol.ops.ClaimBatch`), and
    target -> its *twins*: other batch staging tables with rows.

    Twins are copies of the same whole task staging: a finisher's late build after
    another claimed its own, or a fresh commit's build racing a takeover's. The one kept
    is this finisher's own, else one held by another finisher, else the unclaimed one;
    the others are retired (:func:`retire_twins`). A twin of an xid consolidated by MOVE
    is empty (nothing is left to move into it) and is dropped with the xid's staging."""
    listed: list[str] = yield ListStaging(f"{prefix}__{record.xid}")
    held: dict[str, str] = yield HeldClaims(record.xid)
    out: dict[str, str] = {}
    twins: dict[str, tuple[str, ...]] = {}
    for target in by_target(record):
        base = batch_staging_name(prefix, record.xid, target)
        names = [t for t in listed if t == base or t.startswith(f"{base}_c")]
        if len(names) > 1:
            sizes: StagingView = yield ObserveStaging(tuple(names))
            full = [n for n in names if any((sizes.get(n) or {}).values())]
            full.sort(key=lambda n: (n != held.get(target), n == base, n))
            if len(full) > 1:
                twins[target] = tuple(full[1:])
            names = full or names
        out[target] = names[0] if names else base
    return out, twins


def retire_twins(
    record: XidRecord, prefix: str, bounds: PublishBounds, twins: dict[str, tuple[str, ...]]
) -> Generator[Step, Any, set[str]]:
    """Drop the twins of each target's batch staging (:func:`batch_tables`) and return
    the targets into which one of them is proven attached already.

    A twin may be the table another finisher holds and is about to ATTACH from, so it is
    dropped only after this finisher's fence check, and its parts are looked for in the
    target only once the server is quiet: a later ATTACH from it finds no table, one
    already running is waited out. Every part UUID of a twin in the target: that copy of
    the batch landed; some only: an ATTACH cut between parts, an alarm."""
    seen: dict[str, list[tuple[str, tuple[str, ...]]]] = {}
    for target, names in twins.items():
        for name in names:
            parts: dict[str, tuple[str, ...]] = yield ObserveBatchParts(name)
            seen.setdefault(target, []).append((name, every_uuid(parts)))
    yield CheckFence()
    yield DropTables(tuple(n for names in twins.values() for n in names))
    yield from settle_before_looking(record, prefix, bounds)
    landed: set[str] = set()
    for target, copies in seen.items():
        for name, ids in copies:
            found = (yield ObservePublished(target, ids)) if ids else frozenset()
            if found and set(found) == set(ids):
                landed.add(target)
            elif found:
                yield Stop(
                    Failure.ALARM,
                    f"xid {record.xid} (visibility=batch): {len(found)} of the {len(ids)} "
                    f"parts of batch staging {name} are in {target}: an ATTACH cut between "
                    f"parts; nothing was attached. {BATCH_HINT}",
                )
    return landed


def every_uuid(by_pid: dict[str, tuple[str, ...]]) -> tuple[str, ...]:
    """The evidence ids of every part of a batch staging (each once), from its parts per
    partition id (:class:`~txsink.protocol.steps.ObserveBatchParts`)."""
    return tuple(dict.fromkeys(u for ids in by_pid.values() for u in ids))


def settle_before_looking(record: XidRecord, prefix: str, bounds: PublishBounds) -> Run:
    """Wait until no statement on the xid's staging runs (an ATTACH another finisher sent
    before this one claimed or dropped its table), or stop: nothing is looked at, nor
    attached, while one may still land."""
    quiet = yield Settle(record.xid, settle_needles(prefix, record), fresh=True)
    if not quiet:
        yield Stop(
            Failure.UNAVAILABLE,
            f"xid {record.xid}: statements on its staging still run after "
            f"{bounds.retry_s:g}s; nothing was attached",
        )
    return record


def staged_uuids(
    record: XidRecord, view: StagingView, part_rows: dict[str, int]
) -> Generator[Step, Any, StagedUuids]:
    """UUIDs of every part of each manifest partition still staged (a resumed publish:
    an earlier MOVE may have been cut between parts by a server crash); each part's
    rows are added to ``part_rows`` (what a repair of a cut MOVE records)."""
    if record.mode is Mode.DEDUP or record.state is not XidState.PREPARED:
        return {}
    tables = {p.table for p in record.manifest if (view.get(p.table) or {}).get(p.partition_id)}
    out: dict[tuple[str, str], tuple[str, ...]] = {}
    for table in sorted(tables):
        rows: dict[str, dict[str, int]] = yield ObservePartRows(table)
        for pid, parts in rows.items():
            out[(table, pid)] = tuple(parts)
            part_rows.update(parts)
    return out


def grouped(ops: Sequence[Operation]) -> list[Operation | MovePartitions | DropTables]:
    """``ops`` with runs of moves out of one staging table into one target, and runs of
    drops, merged into one step each (the warehouse cuts a long one into statements the
    server parses); the order of everything else is kept."""
    out: list[Operation | MovePartitions | DropTables] = []
    for op in ops:
        last = out[-1] if out else None
        if isinstance(op, Publish):
            if isinstance(last, MovePartitions) and (last.staging, last.target) == (
                op.staging,
                op.target,
            ):
                out[-1] = replace(last, partition_ids=(*last.partition_ids, op.partition_id))
            else:
                out.append(MovePartitions(op.staging, op.target, (op.partition_id,)))
        elif isinstance(op, DropStaging):
            if isinstance(last, DropTables):
                out[-1] = DropTables((*last.tables, op.table))
            else:
                out.append(DropTables((op.table,)))
        else:
            out.append(op)
    return out


def carry_out(
    record: XidRecord, prefix: str, bounds: PublishBounds, ops: Sequence[Operation], hint: str
) -> Run:
    """Yield the steps of a publish plan in order, with its fault points and the claim's
    fence and wait; returns the record as the plan's Keeper writes left it."""
    moved = False
    for op in grouped(ops):
        if isinstance(op, Alarm):
            yield Stop(Failure.ALARM, f"{op.reason}. {hint}")
        elif isinstance(op, Reobserve):
            continue
        elif isinstance(op, ClaimBatch):
            yield CheckFence()
            yield op  # the runner renames the table to a name of its own and holds it
            yield from settle_before_looking(record, prefix, bounds)
        elif isinstance(op, AttachAll):
            yield FaultPoint("driver.before_attach")
            yield Attach(op.xid, op.batch_staging, op.target, attach_tag(prefix, record, op.target))
            yield FaultPoint("driver.after_attach")
        elif isinstance(op, RecordCommitted):
            yield FaultPoint("driver.after_commit")
            record = yield Write(record, op)
            yield FaultPoint("driver.after_record")
        elif isinstance(op, RecordCut):
            record = yield Write(record, op)
        elif isinstance(op, SealDedup):
            tag = seal_tag(prefix, op.xid)
            yield SealRow(tag)
            yield FaultPoint("driver.after_seal")
            quiet = yield Settle(record.xid, (tag,), fresh=True)
            if not quiet:
                yield Stop(
                    Failure.UNAVAILABLE,
                    f"xid {record.xid}: a block insert of it still runs on ClickHouse "
                    f"{bounds.retry_s:g}s after its seal (an attempt that outlived its "
                    "batch); not recorded COMMITTED yet. The next commit or `txsink "
                    f"recover --job {record.job}` finishes it",
                )
        else:
            yield op
            if isinstance(op, (MovePartitions, Consolidate, CopyIntoBatch)) and not moved:
                moved = True
                yield FaultPoint("driver.mid_commit")
    return record
