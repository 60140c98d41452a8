"""The publish planner: given what staging and the target show, which operations finish
an xid. One planner serves both visibilities.

Every manifest partition is checked by one function (:func:`_check_part`), whatever the
visibility: the staging table must exist, its rows must equal the manifest's count or be
gone, a MOVE cut between parts is repaired (:func:`repair_cut`), a partition with no rows
left needs evidence, and no staging partition may hold rows the manifest does not list.
The variants differ only in the *sink* the partition moves into and what follows:

- ``visibility=partition`` (:func:`plan_publish`): the sink is the target itself
  (:class:`~txsink.protocol.ops.Publish`); a target merges, so UUIDs it no longer shows
  are ``protected`` evidence (staging that records UUIDs never empties on its own);
- ``visibility=batch`` (:func:`plan_batch_publish`): the sink is the xid's batch staging
  (:class:`~txsink.protocol.ops.Consolidate`), which never merges, so UUIDs it does not
  show are an Alarm; then claim, ATTACH PARTITION ALL, proven by UUIDs or the query log
  (:mod:`txsink.protocol.visibility` tells the whole story).

Invariants: pure (observations in, operations out, never I/O); an operation that already
landed is never planned again when the plan is re-made from a fresh look; an Alarm is the
whole plan (nothing is guessed); RecordCommitted comes only after every manifest entry is
published or proven, and staging is dropped only after it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet

from txsink.protocol.ids import parse_staging
from txsink.protocol.ops import (
    ALL_PARTITIONS,
    Alarm,
    AttachAll,
    ClaimBatch,
    Consolidate,
    CopyIntoBatch,
    CreateBatchStaging,
    DropParts,
    DropStaging,
    Evidence,
    Operation,
    Publish,
    RecordCommitted,
    RecordCut,
    Reobserve,
    SealDedup,
    StagedUuids,
    StagingView,
)
from txsink.protocol.states import Mode, StagedPart, XidRecord, XidState


def by_target(record: XidRecord) -> dict[str, list[StagedPart]]:
    """Manifest entries per target table, targets in manifest order."""
    out: dict[str, list[StagedPart]] = {}
    for part in record.manifest:
        out.setdefault(record.part_target(part), []).append(part)
    return out


def evidence_by_target(
    record: XidRecord,
    view: StagingView,
    *,
    resumed: bool = True,
    staged: StagedUuids | None = None,
) -> dict[str, tuple[str, ...]]:
    """Part UUIDs worth looking up before :func:`plan_publish`, per target table (each
    entry's own target: a multi-table xid looks each table's evidence up in that table).

    Those of manifest partitions whose staging table exists but holds no rows of them any
    more, and, when ``resumed`` (the record was PREPARED before this attempt: a MOVE may
    have run), also those still staged in full: a server crash inside MOVE PARTITION can
    leave the rows in both tables (the destination commits first). For those, ``staged``
    (every current part's UUID) is what is looked up, not the manifest's few."""
    if record.mode is Mode.DEDUP or record.state is not XidState.PREPARED:
        return {}
    out: dict[str, list[str]] = {}
    for part in record.manifest:
        have = view.get(part.table)
        if have is None:
            continue
        if not have.get(part.partition_id, 0):
            out.setdefault(record.part_target(part), []).extend(part.uuids)
        elif resumed:
            current = (staged or {}).get((part.table, part.partition_id), part.uuids)
            out.setdefault(record.part_target(part), []).extend(current)
    return {t: tuple(dict.fromkeys(u)) for t, u in out.items() if u}


def batch_evidence_wanted(
    record: XidRecord,
    batch_tables: Mapping[str, str],
    batch_uuids: Mapping[str, tuple[str, ...]],
) -> dict[str, tuple[str, ...]]:
    """Per target, the UUIDs to look up in it: every part of its batch staging table."""
    if record.state is not XidState.PREPARED:
        return {}
    out: dict[str, tuple[str, ...]] = {}
    for target in by_target(record):
        uuids = batch_uuids.get(batch_tables[target], ())
        if uuids:
            out[target] = uuids
    return out


def _check_part(
    record: XidRecord,
    part: StagedPart,
    view: StagingView,
    current: tuple[str, ...],
    sink: AbstractSet[str],
    part_rows: Mapping[str, int],
    *,
    batch_staging: str | None = None,
    batch_exists: bool = False,
    detached: Mapping[str, Mapping[str, int]] | None = None,
) -> tuple[list[Operation], bool] | Alarm:
    """The checks of one manifest partition, shared by both variants: what to run for it
    and whether it is *emptied* (no rows left, its parts shown by ``sink`` or the sink
    gone), or an Alarm.

    ``current``: UUIDs of every part the partition's staging holds now; ``sink``: which
    UUIDs the sink shows (the target's looked-up ones, or the batch staging's parts).
    ``batch_staging`` is None when the sink is the target (visibility=partition).
    ``detached``: detached parts per staging table and partition id ("" unknown)."""
    have = view.get(part.table)
    where = f"partition {part.partition_id}"
    if have is None:
        return Alarm(
            record.xid,
            f"staging table {part.table} of PREPARED xid {record.xid} is missing; "
            f"its {part.rows} rows of {where} cannot be published",
        )
    rows = have.get(part.partition_id, 0)
    there = [u for u in current if u in sink]
    if rows and (
        record.cut(part.table, part.partition_id)
        or (rows == part.rows and there and len(there) < len(current))
    ):
        repair = repair_cut(record, part, rows, current, sink, part_rows)
        if isinstance(repair, Alarm) or batch_staging is None:
            return repair if isinstance(repair, Alarm) else (repair, False)
        return [_into(o, batch_staging) for o in repair if not isinstance(o, Evidence)], False
    if rows == part.rows and there:  # every part (a partial set was repaired above)
        # a server crash inside MOVE left the source; dropped with the table
        done = Evidence(record.xid, part.table, part.partition_id, "uuid", part.rows)
        return ([done] if batch_staging is None else []), False
    if rows == part.rows:
        move = Publish(record.xid, part.table, part.partition_id, record.part_target(part), rows)
        return [move if batch_staging is None else _into(move, batch_staging)], False
    if rows != 0:
        return Alarm(
            record.xid,
            f"staging table {part.table} holds {rows} rows of {where}, the manifest of "
            f"xid {record.xid} says {part.rows}",
        )
    lost = detached_here(part, detached)
    if lost and batch_staging is None:  # rows the server set aside read as "moved"
        return Alarm(
            record.xid,
            f"staging table {part.table} holds no rows of {where} and system.detached_parts "
            f"lists {lost} detached part(s) of it (a server that found them broken at "
            f"start-up, or a hand): its {part.rows} rows are not proven published",
        )
    if part.uuids:
        landed = any(u in sink for u in part.uuids)
        if batch_staging is None:
            kind = "uuid" if landed else "protected"
            return [Evidence(record.xid, part.table, part.partition_id, kind, part.rows)], False
        if batch_exists and not landed:  # batch staging never merges: its parts stay
            return Alarm(
                record.xid,
                f"{where} of {part.table} is neither staged nor in batch staging {batch_staging}",
            )
        return [], True
    legacy = not any(p.uuids for p in record.manifest)
    if legacy and batch_staging is None:  # written before evidence was recorded
        return [Evidence(record.xid, part.table, part.partition_id, "legacy", part.rows)], False
    return Alarm(
        record.xid,
        f"staging table {part.table} holds no rows of {where} and the manifest of xid "
        f"{record.xid} has no part UUIDs for it: nothing shows its {part.rows} rows were "
        f"published",
    )


def detached_here(part: StagedPart, detached: Mapping[str, Mapping[str, int]] | None) -> int:
    """Detached parts of ``part``'s staging partition (or of unknown partition)."""
    mine = (detached or {}).get(part.table) or {}
    return mine.get(part.partition_id, 0) + mine.get("", 0)


def emptied_tables(record: XidRecord, view: StagingView) -> tuple[str, ...]:
    """Staging tables of ``record`` with a manifest partition that reads empty: where
    ``system.detached_parts`` is read before emptiness counts as published."""
    if record.mode is Mode.DEDUP or record.state is not XidState.PREPARED:
        return ()
    out = [
        p.table
        for p in record.manifest
        if view.get(p.table) is not None and not (view.get(p.table) or {}).get(p.partition_id)
    ]
    return tuple(sorted(set(out)))


def _into(op: Operation, batch_staging: str) -> Operation:
    """A repair's or a publish's MOVE redirected into the batch staging."""
    if isinstance(op, Publish):
        return Consolidate(op.xid, op.staging, op.partition_id, batch_staging, op.rows)
    return op


def _unlisted(record: XidRecord, view: StagingView) -> Alarm | None:
    """Rows in a staging table of the manifest, in partitions the manifest does not list."""
    listed: dict[str, set[str]] = {}
    for part in record.manifest:
        listed.setdefault(part.table, set()).add(part.partition_id)
    for table, pids in listed.items():
        extra = {p: n for p, n in (view.get(table) or {}).items() if p not in pids and n}
        if extra:
            return Alarm(
                record.xid,
                f"staging table {table} holds partitions {sorted(extra)} that the "
                f"manifest of xid {record.xid} does not list",
            )
    return None


def _drop_committed(record: XidRecord, view: StagingView, tables: Sequence[str]) -> list[Operation]:
    why = "published; xid committed"
    return [DropStaging(t, why) for t in tables if view.get(t) is not None]


def plan_publish(
    record: XidRecord,
    view: StagingView,
    published: AbstractSet[str] | None = None,
    staged: StagedUuids | None = None,
    part_rows: Mapping[str, int] | None = None,
    detached: Mapping[str, Mapping[str, int]] | None = None,
) -> list[Operation]:
    """Operations that finish ``record`` (visibility=partition) given staging as it is now.

    A manifest partition whose staging rows equal the manifest's count is published,
    unless its parts are already in the target. ``staged`` (given when the publish
    resumes an earlier attempt) holds the UUIDs of *every* part the partition's staging
    holds now: all of them in the target (``published``) means a server crash inside an
    earlier MOVE left the source behind after the destination committed, and moving
    again would duplicate it (Evidence ``uuid``; the staging copy is dropped with the
    table); none of them means the MOVE did not happen; some but not all is a MOVE the
    crash cut between parts (ClickHouse renames parts one by one), repaired
    (:func:`repair_cut`; ``part_rows`` gives each staged part's rows). MOVE PARTITION is
    atomic per (staging table, partition), so one with no rows left was published before
    a crash, *given evidence*:

    - ``uuid``: one of the part UUIDs recorded for it is among ``published`` (the
      evidence ids :func:`evidence_by_target` asked for that the target's
      ``system.parts``, active or outdated, still shows);
    - ``protected``: UUIDs were recorded but the target no longer shows them (a merge or
      TTL merge in the target replaced the moved parts and the old ones were cleaned
      up). Staging that records UUIDs was created without TTL, with merges disabled by
      table settings and inserts without deduplication, so nothing txsink or ClickHouse
      does on its own empties its partition except the MOVE. The remaining window
      (docs/operations.md#evidence-of-publish): an operator dropping a staging
      partition (parts the server detached are an Alarm, below);
    - ``legacy``: a record written before evidence was recorded (no part has UUIDs):
      the old rule, "0 rows left" means moved.

    A partition with no rows left whose staging table has detached parts of it
    (``detached``, from ``system.detached_parts``: a server detaches broken parts at
    start-up) is an Alarm whatever the evidence. An empty partition without UUIDs in a
    record whose other partitions have some is not guessed at, nor is anything else (a
    staging table missing while PREPARED, a partial count, rows the manifest does not
    list): the plan is a single Alarm.

    Several tables in one xid: every entry is published into its own target
    (:meth:`XidRecord.part_target`), in manifest order; the record turns COMMITTED only
    after every entry of every table is published or shown to be.
    """
    if record.mode is Mode.DEDUP:
        # Dedup mode inserted straight into the target; finishing is sealing the xid on
        # the server (no late insert of it can land after) and the record.
        if record.state is XidState.COMMITTED:
            return []
        return [SealDedup(record.xid), RecordCommitted(record.xid)]
    if record.state is XidState.COMMITTED:
        return _drop_committed(record, view, record.staging_tables)
    ops: list[Operation] = []
    found = published or frozenset()
    for part in record.manifest:
        current = (staged or {}).get((part.table, part.partition_id), ())
        step = _check_part(record, part, view, current, found, part_rows or {}, detached=detached)
        if isinstance(step, Alarm):
            return [step]
        ops += step[0]
    unlisted = _unlisted(record, view)
    if unlisted is not None:
        return [unlisted]
    ops.append(RecordCommitted(record.xid))
    ops.extend(DropStaging(t, f"published by xid {record.xid}") for t in record.staging_tables)
    return ops


def repair_cut(
    record: XidRecord,
    part: StagedPart,
    rows: int,
    current: tuple[str, ...],
    found: AbstractSet[str],
    part_rows: Mapping[str, int],
) -> list[Operation] | Alarm:
    """Finish a staging partition whose MOVE a server crash cut between parts.

    ClickHouse renames a MOVE's parts into the target one by one and removes them from
    the source afterwards, so a crash can leave some parts in both tables. Proof that a
    staged part is in the target: its UUID there (``found``), or the record's cut facts
    (written by an earlier repair, before it dropped anything: they survive the target's
    merges). The repair records new facts (fenced), drops the proven parts from staging,
    and moves the rest; every step re-plans to the same end after a crash. The counts must
    add up: rows still staged plus rows of cut parts no longer staged equal the manifest's;
    anything else is an Alarm."""
    where = f"partition {part.partition_id} of staging table {part.table}"
    cut = record.cut(part.table, part.partition_id)
    new = {u: part_rows[u] for u in current if u in found and u not in cut and u in part_rows}
    if any(u in found and u not in cut and u not in part_rows for u in current):
        return Alarm(
            record.xid,
            f"{where} is partly in {record.part_target(part)} already: a ClickHouse server "
            f"crash cut a MOVE between parts, and the rows of those parts could not be "
            f"read. `txsink recover --job {record.job}` retries; see "
            f"docs/operations.md#evidence-of-publish",
        )
    facts = {**cut, **new}
    proven = tuple(u for u in current if u in facts)
    gone = sum(n for u, n in facts.items() if u not in current)
    if rows + gone != part.rows:
        return Alarm(
            record.xid,
            f"{where} holds {rows} rows and {gone} rows of its parts are recorded as in "
            f"{record.part_target(part)} already, the manifest of xid {record.xid} says "
            f"{part.rows}: inspect with `txsink status --job {record.job}` "
            f"(docs/operations.md#evidence-of-publish)",
        )
    ops: list[Operation] = []
    if new:
        ops.append(RecordCut(record.xid, part.table, part.partition_id, facts))
    if proven:
        ops.append(DropParts(record.xid, part.table, part.partition_id, proven))
    left = rows - sum(facts[u] for u in proven)
    if left > 0:
        target = record.part_target(part)
        ops.append(Publish(record.xid, part.table, part.partition_id, target, left))
    else:
        ops.append(Evidence(record.xid, part.table, part.partition_id, "cut", part.rows))
    return ops


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
    batch_parts: Mapping[str, Mapping[str, tuple[str, ...]]] | None = None,
) -> list[Operation]:
    """Operations that finish a ``visibility=batch`` record given what staging shows now:
    the checks of :func:`plan_publish` with the batch staging as the sink, then claim,
    attach and commit (:mod:`txsink.protocol.visibility`).

    ``batch_tables``: target -> its batch staging table name. ``view``: rows per partition
    of every task staging table *and* batch staging table (None: missing). ``staged``:
    every part UUID per (staging table, partition) of task staging partitions that still
    hold rows. ``batch_uuids``: every part UUID of each existing batch staging table;
    ``batch_parts``: the same per partition id, one per part (what tells a batch staging
    built exactly from one that a copy cut short or a late copy doubled).
    ``published``: per target, which of the looked-up UUIDs its parts show.
    ``claimed``: targets whose batch staging (as named in ``batch_tables``) this finisher
    renamed to its own name and found quiet since; ``logged``: targets whose ATTACH of
    this xid the server's ``system.query_log`` shows finished (read while claimed: the
    evidence that outlives the target's merges).

    A table whose task staging is whole (every manifest partition holds its rows) was
    built, or is to be built, by copying (:class:`CopyIntoBatch`): its task staging is
    left as it is until COMMITTED, so a batch staging that is not exact is dropped (once
    claimed, or while it still has the name no finisher attaches from) and built again.
    One whose task partitions were emptied was consolidated by MOVE (a record an older
    txsink prepared): nothing can be built again, every difference is an Alarm.
    """
    if record.state is XidState.COMMITTED:
        return _drop_committed(record, view, [*record.staging_tables, *batch_tables.values()])
    ops: list[Operation] = []
    attach: list[Operation] = []
    done: list[Operation] = []
    for target, parts in by_target(record).items():
        bst = batch_tables[target]
        bview = view.get(bst)
        in_batch = set(batch_uuids.get(bst, ()))
        if _copied(record, parts, view):
            copy = _plan_copy(
                record, target, parts, bst, view, staged, (batch_parts or {}).get(bst),
                in_batch, published.get(target, frozenset()), target in claimed,
                target in logged,
            )  # fmt: skip
            if isinstance(copy, Alarm):
                return [copy]
            first, then = copy
            ops += first
            attach += then
            if then:
                done.append(DropStaging(bst, f"attached by xid {record.xid}"))
            continue
        moves: list[Operation] = []
        emptied = 0
        for part in parts:
            current = staged.get((part.table, part.partition_id), ())
            step = _check_part(
                record, part, view, current, in_batch, part_rows or {},
                batch_staging=bst, batch_exists=bview is not None,
            )  # fmt: skip
            if isinstance(step, Alarm):
                return [_batch_alarm(record, step.reason)]
            moves += step[0]
            emptied += step[1]
        if bview is None and emptied and moves:
            return [_batch_alarm(record, f"batch staging {bst} is missing while part of the "
                                 f"batch for {target} was moved out of task staging")]  # fmt: skip
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
        wanted = record.partition_rows(target)
        got = {p: n for p, n in bview.items() if n}
        if got != wanted:
            return [_batch_alarm(record, f"batch staging {bst} holds {got} rows per partition, "
                                 f"the manifest says {wanted} for {target}")]  # fmt: skip
        proof = _attach_proof(
            record, bst, target, in_batch, published.get(target, frozenset()),
            target in claimed, target in logged, wanted,
        )  # fmt: skip
        if isinstance(proof, Alarm):
            return [proof]
        if proof is None:
            ops.append(ClaimBatch(record.xid, bst, target))
            continue
        attach.append(proof)
        done.append(DropStaging(bst, f"attached by xid {record.xid}"))
    unlisted = _unlisted(record, view)
    if unlisted is not None:
        return [_batch_alarm(record, unlisted.reason)]
    if ops:
        return [*ops, Reobserve()]
    return [
        *attach,
        RecordCommitted(record.xid),
        *(DropStaging(t, f"published by xid {record.xid}") for t in record.staging_tables),
        *done,  # after COMMITTED: a PREPARED xid keeps its batch staging
    ]


def _attach_proof(
    record: XidRecord,
    bst: str,
    target: str,
    in_batch: AbstractSet[str],
    published: AbstractSet[str],
    claimed: bool,
    logged: bool,
    wanted: Mapping[str, int],
) -> Operation | None:
    """What finishes an exact batch staging: Evidence that it was attached already, the
    AttachAll (claimed by this finisher and no evidence), an Alarm (an ATTACH cut between
    parts), or None (claim it first). ``published``: which UUIDs the target shows;
    ``claimed`` / ``logged``: this finisher holds it / the query log shows its ATTACH."""
    there = set(in_batch) & set(published)
    total = sum(wanted.values())
    if there and there == set(in_batch):
        return Evidence(record.xid, bst, "all", "uuid", total)
    if logged:  # also when the target merged some attached parts away
        return Evidence(record.xid, bst, "all", "logged", total)
    if not claimed:
        return None
    if there:
        split = f"{len(there)} of the {len(in_batch)} parts of batch staging {bst}"
        return _batch_alarm(record, f"{split} are in {target} already: an ATTACH cut between parts")
    return AttachAll(record.xid, bst, target, total)


def _copied(record: XidRecord, parts: Sequence[StagedPart], view: StagingView) -> bool:
    """Whether a table's batch is built by copying: every task staging partition of it
    still holds rows (none was moved out by an older txsink's consolidation) and none
    has a cut MOVE recorded."""
    return all(
        (view.get(p.table) or {}).get(p.partition_id) and not record.cut(p.table, p.partition_id)
        for p in parts
    )


def _plan_copy(
    record: XidRecord,
    target: str,
    parts: Sequence[StagedPart],
    bst: str,
    view: StagingView,
    staged: StagedUuids,
    bparts: Mapping[str, tuple[str, ...]] | None,
    in_batch: AbstractSet[str],
    published: AbstractSet[str],
    claimed: bool,
    logged: bool,
) -> tuple[list[Operation], list[Operation]] | Alarm:
    """One table of a copied batch: (operations before a fresh look, operations that
    finish it), or an Alarm."""
    for part in parts:
        rows = (view.get(part.table) or {}).get(part.partition_id, 0)
        if not staged.get((part.table, part.partition_id)):
            where = f"partition {part.partition_id} of staging table {part.table}"
            return _batch_alarm(record, f"the parts of {where} carry no UUIDs: a batch "
                                "staging copied from it could not be checked")  # fmt: skip
        if rows != part.rows:
            where = f"partition {part.partition_id}"
            return _batch_alarm(record, f"staging table {part.table} holds {rows} rows of "
                                f"{where}, the manifest says {part.rows}")  # fmt: skip
    total = sum(p.rows for p in parts)
    # every partition of each table (a plan with rows the manifest does not list is an
    # Alarm as a whole: _unlisted)
    sources = tuple((t, ALL_PARTITIONS) for t in dict.fromkeys(p.table for p in parts))
    if view.get(bst) is None:
        if _is_claim_name(bst):  # renamed away since it was listed: look again
            return [Reobserve()], []
        # only ever built under the name no finisher attaches from (never re-created
        # under a finisher's own name: its holder may be about to ATTACH from it)
        return [
            CreateBatchStaging(bst, target, parts[0].table),
            CopyIntoBatch(record.xid, bst, sources, total),
        ], []
    if not any((view.get(bst) or {}).values()) and not in_batch and not _is_claim_name(bst):
        # created, nothing copied yet (the resumed publish waited out any copy in flight)
        return [CopyIntoBatch(record.xid, bst, sources, total)], []
    wanted = record.partition_rows(target)
    exact = _exact(parts, staged, bparts or {}, view.get(bst) or {}, wanted)
    if exact or claimed or logged:
        proof = _attach_proof(record, bst, target, in_batch, published, claimed, logged, wanted)
        if isinstance(proof, Alarm):
            return proof
        if proof is None:
            return [ClaimBatch(record.xid, bst, target)], []
        if not isinstance(proof, AttachAll):
            return [], [proof]
        if exact:
            return [], [proof]
    # not exact and not attached (an ATTACH runs only on exact content): a copy cut
    # short or doubled by a late one; built again from the task staging, which is whole
    if claimed or not _is_claim_name(bst):
        return [DropStaging(bst, f"not exactly the staging of xid {record.xid}: built again")], []
    return [ClaimBatch(record.xid, bst, target)], []


def _exact(
    parts: Sequence[StagedPart],
    staged: StagedUuids,
    bparts: Mapping[str, tuple[str, ...]],
    bview: Mapping[str, int],
    wanted: Mapping[str, int],
) -> bool:
    """Whether a batch staging holds exactly the task staging's parts: per partition the
    same parts (one each), or one part of the same rows that none of them is (a
    compaction, which runs only once the copy was found exact)."""
    if {p: n for p, n in bview.items() if n} != dict(wanted):
        return False
    expected: dict[str, Counter[str]] = {}
    for part in parts:
        current = staged.get((part.table, part.partition_id), ())
        if not current:
            return False
        expected.setdefault(part.partition_id, Counter()).update(current)
    for pid, want in expected.items():
        have = Counter(bparts.get(pid, ()))
        if have == want:
            continue
        if len(have) == 1 and sum(have.values()) == 1 and not (set(have) & set(want)):
            continue  # compacted
        return False
    return set(bparts) <= set(expected)


def _is_claim_name(table: str) -> bool:
    name = parse_staging(table)
    return name is not None and bool(name.claim)


def _batch_alarm(record: XidRecord, what: str) -> Alarm:
    return Alarm(
        record.xid,
        f"xid {record.xid} (visibility=batch): {what}; nothing is guessed, nothing was "
        f"published for it automatically",
    )
