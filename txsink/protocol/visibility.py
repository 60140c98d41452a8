"""Pure decisions of ``visibility=batch``: a reader sees a batch of a table whole or not at all.

Mechanism (per target table of an xid): every task's staged partitions are first moved
(``MOVE PARTITION``, invisible to readers) into one *batch staging* table of the xid
(:func:`txsink.protocol.ids.batch_staging_name`), then published by one
``ALTER TABLE target ATTACH PARTITION ALL FROM batch_staging``: on non-replicated MergeTree
ClickHouse commits every cloned part under one lock, so a reader sees all of them or none
(measured by ``tests/integration/test_visibility.py``). ATTACH copies (hard links), so it is
not idempotent and leaves the batch staging full; it is dropped right after.

Every step is decided from observations only (:func:`plan_batch_publish`), as in
:func:`txsink.protocol.plans.plan_publish`, with part UUIDs (kept by MOVE and ATTACH) as the
evidence of what already happened:

- consolidation (PREPARED, batch staging missing or partly filled): a manifest partition
  still in its task staging with its full count is moved into the batch staging, unless
  every one of its parts is there already (a server crash inside MOVE left the source); a
  partition with no rows left must show one of its recorded UUIDs in the batch staging;
  the plan then stops (``Reobserve``): the attach is planned from a fresh look;
- claim (every manifest partition of the table is in the batch staging, counts equal,
  none of its part UUIDs in the target): ``RENAME`` the batch staging to this finisher's
  own name (:class:`ClaimBatch`), wait until no statement on the xid's staging runs,
  re-observe;
- attach (claimed): none of the batch staging's part UUIDs in the target and no finished
  ATTACH of this xid into it in ``system.query_log``: attach, then drop the batch
  staging; all of them, or the log entry: an earlier ATTACH landed (drop only); some of
  the UUIDs: an Alarm;
- batch staging missing under every name and every task staging partition empty with
  UUIDs: counted as published only with the query log's proof (the batch staging is
  dropped after COMMITTED; a missing one is a rename seen half-way: look again).

Two finishers of one xid (a takeover and ``txsink recover --force``, two recoverers, a
superseded driver) can never both ATTACH: each attaches only from the name it renamed the
table to, after it saw the server quiet and found no evidence (part UUIDs, which a merge
in the target removes, or the ATTACH's ``log_comment`` in ``system.query_log``, which it
does not). The window that remains (docs/modes.md#visibility): the *server* crashing
within its log flush interval after an ATTACH committed, the driver dying before it
recorded COMMITTED, and the target merging the attached parts and cleaning up the
replaced ones before the roll-forward looks.
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

from txsink.protocol.plans import (
    Alarm,
    DropParts,
    DropStaging,
    Evidence,
    Publish,
    RecordCommitted,
    RecordCut,
    StagedUuids,
    StagingView,
    repair_cut,
)
from txsink.protocol.states import Mode, StagedPart, XidRecord, XidState

VISIBILITIES = ("partition", "batch")


@dataclass(frozen=True)
class CreateBatchStaging:
    table: str
    target: str
    like: str  # a task staging table of the same target to copy the structure from


@dataclass(frozen=True)
class Consolidate:
    """Move one task staging partition into the batch staging table (invisible)."""

    xid: str
    staging: str
    partition_id: str
    batch_staging: str
    rows: int


@dataclass(frozen=True)
class AttachAll:
    """``ALTER TABLE target ATTACH PARTITION ALL FROM batch_staging``: the publish."""

    xid: str
    batch_staging: str
    target: str
    rows: int


@dataclass(frozen=True)
class ClaimBatch:
    """``RENAME TABLE batch_staging TO`` a name of this finisher's own (then re-observe,
    once no statement on the xid's staging runs): the exclusive step before an ATTACH.
    ATTACH copies, so two finishers must never both reach it: a finisher attaches only
    from the name it renamed the table to, and only after it looked for evidence while
    holding it. A claim taken from another finisher makes that one's ATTACH fail (no such
    table); one already running is waited out before the evidence is read."""

    xid: str
    batch_staging: str
    target: str


@dataclass(frozen=True)
class Reobserve:
    """Stop here, look at staging again and plan afresh (after consolidation)."""


BatchOperation = (
    CreateBatchStaging
    | Consolidate
    | ClaimBatch
    | AttachAll
    | Reobserve
    | RecordCommitted
    | DropStaging
    | Alarm
    | Evidence
    | RecordCut
    | DropParts
)


def batch_refusal(table: str, engine: str, mode: str) -> str:
    """Why ``visibility=batch`` cannot be honoured for ``table`` ("" when it can).

    ATTACH PARTITION ALL commits every part under one lock only on non-replicated
    MergeTree; a replicated table fetches parts replica by replica and a Distributed one
    has no parts; dedup mode inserts block by block."""
    if mode != "attach":
        return (
            f"visibility=batch needs attach mode, but {table} is written in {mode} mode "
            f"(rows are visible block by block); use visibility=partition or make the target "
            f"fit attach mode (docs/modes.md)"
        )
    if not engine.endswith("MergeTree") or engine.startswith(("Replicated", "Shared")):
        return (
            f"visibility=batch needs a non-replicated MergeTree target, {table} is {engine}: "
            f"one ATTACH PARTITION ALL is atomic for readers only there; use "
            f"visibility=partition (docs/modes.md#visibility)"
        )
    return ""


def is_batch(record: XidRecord) -> bool:
    return record.mode is Mode.ATTACH and record.batch_visible


def by_target(record: XidRecord) -> dict[str, list[StagedPart]]:
    """Manifest entries per target table, targets in manifest order."""
    out: dict[str, list[StagedPart]] = {}
    for part in record.manifest:
        out.setdefault(record.part_target(part), []).append(part)
    return out


def plan_batch_publish(
    record: XidRecord,
    batch_tables: Mapping[str, str],
    view: StagingView,
    staged: StagedUuids,
    batch_uuids: Mapping[str, tuple[str, ...]],
    published: Mapping[str, AbstractSet[str]],
    claimed: AbstractSet[str] = frozenset(),
    logged: AbstractSet[str] = frozenset(),
    part_rows: Mapping[str, int] | None = None,
) -> list[BatchOperation]:
    """Operations that finish a ``visibility=batch`` record given what staging shows now.

    ``batch_tables``: target -> its batch staging table name. ``view``: rows per partition
    of every task staging table *and* batch staging table (None: missing). ``staged``:
    every part UUID per (staging table, partition) of task staging partitions that still
    hold rows. ``batch_uuids``: every part UUID of each existing batch staging table.
    ``published``: per target, which of the looked-up UUIDs its parts show.
    ``claimed``: targets whose batch staging (as named in ``batch_tables``) this finisher
    renamed to its own name and found quiet since; ``logged``: targets whose ATTACH of
    this xid the server's ``system.query_log`` shows finished (read while claimed: the
    evidence that outlives the target's merges).
    """
    if record.state is XidState.COMMITTED:
        tables = [*record.staging_tables, *batch_tables.values()]
        why = "published; xid committed"
        return [DropStaging(t, why) for t in tables if view.get(t) is not None]
    ops: list[BatchOperation] = []
    attach: list[BatchOperation] = []
    done: list[BatchOperation] = []
    for target, parts in by_target(record).items():
        bst = batch_tables[target]
        bview = view.get(bst)
        in_batch = set(batch_uuids.get(bst, ()))
        moves: list[BatchOperation] = []
        emptied = 0
        for part in parts:
            have = view.get(part.table)
            if have is None:
                return [_alarm(record, f"staging table {part.table} is missing")]
            rows = have.get(part.partition_id, 0)
            current = staged.get((part.table, part.partition_id), ())
            moved = [u for u in current if u in in_batch]
            where = f"partition {part.partition_id} of {part.table}"
            if rows == part.rows and moved and len(moved) == len(current):
                continue  # a server crash inside MOVE left the source; dropped with the table
            cut = record.cut(part.table, part.partition_id)
            if rows and (cut or (rows == part.rows and moved)):
                # a server crash cut the consolidating MOVE between parts: the same repair
                # as a publish's (plans.repair_cut), into the batch staging
                repair = repair_cut(record, part, rows, current, in_batch, part_rows or {})
                if isinstance(repair, Alarm):
                    return [repair]
                for o in repair:
                    if isinstance(o, Publish):
                        moves.append(Consolidate(o.xid, o.staging, o.partition_id, bst, o.rows))
                    elif isinstance(o, (RecordCut, DropParts)):
                        moves.append(o)
                continue
            if rows == part.rows:
                moves.append(Consolidate(record.xid, part.table, part.partition_id, bst, rows))
            elif rows != 0:
                return [_alarm(record, f"{where}: {rows} rows staged, the manifest says "
                               f"{part.rows}")]  # fmt: skip
            elif not part.uuids:
                return [_alarm(record, f"{where} has no rows left and no part UUIDs recorded")]
            elif bview is not None and not any(u in in_batch for u in part.uuids):
                return [_alarm(record, f"{where} is neither staged nor in batch staging {bst}")]
            else:
                emptied += 1
        if bview is None and emptied and moves:
            return [_alarm(record, f"batch staging {bst} is missing while part of the batch "
                           f"for {target} was moved out of task staging")]  # fmt: skip
        if moves:
            like = next((m.staging for m in moves if isinstance(m, Consolidate)), parts[0].table)
            ops += [CreateBatchStaging(bst, target, like)] if bview is None else []
            ops += moves
            continue
        if bview is None:
            # every task partition empty and no batch staging under any name: proven only
            # by the query log (the batch staging is dropped after COMMITTED, so a missing
            # one is a rename seen half-way, or an xid finished by an older txsink that
            # dropped it right after its ATTACH); otherwise look again
            if target not in logged:
                return [Reobserve()]
            attach += [
                Evidence(record.xid, p.table, p.partition_id, "logged", p.rows) for p in parts
            ]
            continue
        wanted: dict[str, int] = {}
        for part in parts:
            wanted[part.partition_id] = wanted.get(part.partition_id, 0) + part.rows
        got = {p: n for p, n in bview.items() if n}
        if got != wanted:
            return [_alarm(record, f"batch staging {bst} holds {got} rows per partition, the "
                           f"manifest says {wanted} for {target}")]  # fmt: skip
        there = in_batch & set(published.get(target, ()))
        total = sum(wanted.values())
        if there and there == in_batch:
            attach.append(Evidence(record.xid, bst, "all", "uuid", total))
        elif target in logged:  # also when the target merged some attached parts away
            attach.append(Evidence(record.xid, bst, "all", "logged", total))
        elif target not in claimed:
            ops.append(ClaimBatch(record.xid, bst, target))
            continue
        elif there:
            split = f"{len(there)} of the {len(in_batch)} parts of batch staging {bst}"
            return [_alarm(record, f"{split} are in {target} already: an ATTACH cut between parts")]
        else:
            attach.append(AttachAll(record.xid, bst, target, total))
        done.append(DropStaging(bst, f"attached by xid {record.xid}"))
    if ops:
        return [*ops, Reobserve()]
    return [
        *attach,
        RecordCommitted(record.xid),
        *(DropStaging(t, f"published by xid {record.xid}") for t in record.staging_tables),
        *done,  # after COMMITTED: a PREPARED xid keeps its batch staging
    ]


def batch_evidence_wanted(
    record: XidRecord,
    batch_tables: Mapping[str, str],
    batch_uuids: Mapping[str, tuple[str, ...]],
) -> dict[str, tuple[str, ...]]:
    """Per target, the UUIDs to look up in it: every part of its batch staging table."""
    out: dict[str, tuple[str, ...]] = {}
    if record.state is not XidState.PREPARED:
        return out
    for target in by_target(record):
        uuids = batch_uuids.get(batch_tables[target], ())
        if uuids:
            out[target] = uuids
    return out


def _alarm(record: XidRecord, what: str) -> Alarm:
    return Alarm(
        record.xid,
        f"xid {record.xid} (visibility=batch): {what}; nothing is guessed, nothing was "
        f"published for it automatically",
    )
