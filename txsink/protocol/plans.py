"""Pure decisions: given what Keeper and ClickHouse show, which operations to run.

The driver observes, calls one of these functions, and executes the returned operations
in order (:mod:`txsink.transactor`). Re-observing after a crash and planning again is
what makes every step idempotent: an operation that already landed is simply not
planned a second time.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field

from txsink.protocol.ids import parse_staging, staging_prefix
from txsink.protocol.states import Mode, StagedPart, XidRecord, XidState

# What the driver sees of one staging table: rows per partition id, or None if missing.
StagingView = Mapping[str, Mapping[str, int] | None]


@dataclass(frozen=True)
class Prepare:
    record: XidRecord


@dataclass(frozen=True)
class Publish:
    """Move one partition of one staging table into the target."""

    xid: str
    staging: str
    partition_id: str
    target: str
    rows: int


@dataclass(frozen=True)
class RecordCommitted:
    xid: str


@dataclass(frozen=True)
class DropStaging:
    table: str
    reason: str


@dataclass(frozen=True)
class Alarm:
    xid: str
    reason: str


@dataclass(frozen=True)
class Evidence:
    """Nothing to run: why a staged partition with no rows left counts as published
    (``kind``: ``uuid`` | ``protected`` | ``legacy``, see :func:`plan_publish`)."""

    xid: str
    staging: str
    partition_id: str
    kind: str
    rows: int


@dataclass(frozen=True)
class RecordCut:
    """Write into the PREPARED record (fenced) which parts of one staging partition a
    cut MOVE left in the target, with their rows: ``cut`` (evidence id -> rows), every
    such part known so far. Written before they are dropped from staging, so the record
    still accounts for them once staging no longer shows them and the target has merged
    them away."""

    xid: str
    staging: str
    partition_id: str
    cut: Mapping[str, int]


@dataclass(frozen=True)
class DropParts:
    """Drop from one staging partition the parts ``evidence`` (evidence ids) that are in
    the target already (recorded by :class:`RecordCut`), so the MOVE of the rest cannot
    publish them twice."""

    xid: str
    staging: str
    partition_id: str
    evidence: tuple[str, ...]


Operation = (
    Prepare | Publish | RecordCommitted | DropStaging | Alarm | Evidence | RecordCut | DropParts
)


# Every part UUID of a fully staged manifest partition, as a resumed publish sees staging
# now: (staging table, partition id) -> evidence ids of all its parts.
StagedUuids = Mapping[tuple[str, str], tuple[str, ...]]


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


def evidence_wanted(
    record: XidRecord,
    view: StagingView,
    *,
    resumed: bool = True,
    staged: StagedUuids | None = None,
) -> tuple[str, ...]:
    """Every UUID of :func:`evidence_by_target`, in one tuple."""
    wanted = evidence_by_target(record, view, resumed=resumed, staged=staged)
    return tuple(dict.fromkeys(u for uuids in wanted.values() for u in uuids))


def plan_publish(
    record: XidRecord,
    view: StagingView,
    published: AbstractSet[str] | None = None,
    staged: StagedUuids | None = None,
    part_rows: Mapping[str, int] | None = None,
) -> list[Operation]:
    """Operations that finish ``record`` given the staging tables as they are now.

    A manifest partition whose staging rows equal the manifest's count is published,
    unless its parts are already in the target. ``staged`` (given when the publish
    resumes an earlier attempt) holds the UUIDs of *every* part the partition's staging
    holds now: all of them in the target (``published``) means a server crash inside an
    earlier MOVE left the source behind after the destination committed, and moving
    again would duplicate it (Evidence ``uuid``; the staging copy is dropped with the
    table); none of them means the MOVE did not happen; some but not all is a MOVE the
    crash cut between parts (ClickHouse renames parts one by one): an Alarm, never a
    guess in either direction, but a repair (:func:`_repair_cut`: the parts found in
    the target are recorded, dropped from staging, and the rest moved; ``part_rows``
    gives each staged part's rows). MOVE PARTITION is atomic per (staging table,
    partition), so one with no rows left
    was published before a crash, *given evidence*:

    - ``uuid``: one of the part UUIDs recorded for it is among ``published`` (the
      evidence ids :func:`evidence_wanted` asked for that the target's ``system.parts``,
      active or outdated, still shows);
    - ``protected``: UUIDs were recorded but the target no longer shows them (a merge or
      TTL merge in the target replaced the moved parts and the old ones were cleaned
      up). Staging that records UUIDs was created without TTL, with merges disabled by
      table settings and inserts without deduplication, so nothing txsink or ClickHouse
      does on its own empties its partition except the MOVE. The remaining window
      (docs/operations.md#evidence-of-publish): an operator dropping a staging
      partition, or the server detaching staged parts as broken after a crash;
    - ``legacy``: a record written before evidence was recorded (no part has UUIDs):
      the old rule, "0 rows left" means moved.

    An empty partition without UUIDs in a record whose other partitions have some is
    not guessed at, nor is anything else (a staging table missing while PREPARED, a
    partial count, rows the manifest does not list): the plan is a single Alarm.

    Several tables in one xid: every entry is published into its own target
    (:meth:`XidRecord.part_target`), in manifest order; the record turns COMMITTED only
    after every entry of every table is published or shown to be.
    """
    if record.mode is Mode.DEDUP:
        # Dedup mode inserted straight into the target; finishing is only the record.
        return [] if record.state is XidState.COMMITTED else [RecordCommitted(record.xid)]
    if record.state is XidState.COMMITTED:
        return [
            DropStaging(t, "published; xid committed")
            for t in record.staging_tables
            if view.get(t) is not None
        ]
    ops: list[Operation] = []
    listed: dict[str, set[str]] = {}
    legacy = not any(p.uuids for p in record.manifest)
    found = published or frozenset()
    for part in record.manifest:
        listed.setdefault(part.table, set()).add(part.partition_id)
        have = view.get(part.table)
        if have is None:
            return [
                Alarm(
                    record.xid,
                    f"staging table {part.table} of PREPARED xid {record.xid} is missing; "
                    f"its {part.rows} rows of partition {part.partition_id} cannot be published",
                )
            ]
        rows = have.get(part.partition_id, 0)
        landed = any(u in found for u in part.uuids)
        current = (staged or {}).get((part.table, part.partition_id), ())
        there = [u for u in current if u in found]
        cut = record.cut(part.table, part.partition_id)
        if rows and (cut or (rows == part.rows and there and len(there) < len(current))):
            repair = repair_cut(record, part, rows, current, found, part_rows or {})
            if isinstance(repair, Alarm):
                return [repair]
            ops.extend(repair)
            continue
        if rows == part.rows and current and there:
            ops.append(Evidence(record.xid, part.table, part.partition_id, "uuid", part.rows))
        elif rows == part.rows:
            target = record.part_target(part)
            ops.append(Publish(record.xid, part.table, part.partition_id, target, rows))
        elif rows != 0:
            return [
                Alarm(
                    record.xid,
                    f"staging table {part.table} holds {rows} rows of partition "
                    f"{part.partition_id}, the manifest of xid {record.xid} says {part.rows}",
                )
            ]
        elif part.uuids:
            kind = "uuid" if landed else "protected"
            ops.append(Evidence(record.xid, part.table, part.partition_id, kind, part.rows))
        elif legacy:
            ops.append(Evidence(record.xid, part.table, part.partition_id, "legacy", part.rows))
        else:
            return [
                Alarm(
                    record.xid,
                    f"staging table {part.table} holds no rows of partition "
                    f"{part.partition_id} and the manifest of xid {record.xid} has no part "
                    f"UUIDs for it: nothing shows its {part.rows} rows were published",
                )
            ]
    for table, pids in listed.items():
        extra = {p: n for p, n in (view.get(table) or {}).items() if p not in pids and n}
        if extra:
            return [
                Alarm(
                    record.xid,
                    f"staging table {table} holds partitions {sorted(extra)} that the "
                    f"manifest of xid {record.xid} does not list",
                )
            ]
    ops.append(RecordCommitted(record.xid))
    ops.extend(DropStaging(t, f"published by xid {record.xid}") for t in listed)
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


@dataclass(frozen=True)
class BatchDecision:
    """What to do with a finished batch whose tasks staged ``incoming``.

    ``drop`` lists staging the batch brought that no record will ever need; the caller
    rolls it back (tombstone first, see :func:`droppable`). ``refuse``: nothing is
    prepared and the caller raises with ``reason`` (``retry``: a replay can succeed;
    otherwise it is a configuration mistake)."""

    action: str  # "prepare" | "roll_forward_existing" | "skip_committed" | "refuse"
    drop: tuple[str, ...] = ()
    reason: str = ""
    retry: bool = False


def decide_batch(
    existing: XidRecord | None,
    incoming: XidRecord,
    last_batch: int | None = None,
    *,
    streaming: bool = False,
    epoch: int | None = None,
) -> BatchDecision:
    """Decide between preparing the new staging and honouring an earlier record.

    Spark replays a batch with the same id after a restart. Once an xid is PREPARED its
    manifest is the truth: a replay's fresh staging is dropped and the recorded manifest
    rolled forward (or, if COMMITTED, nothing is published again).

    ``last_batch`` is the highest batch id the job's ledger has committed. Batch ids are
    monotonic (Spark micro-batches; ``txn_version`` like Delta Lake's txnVersion), so a
    batch at or below it without a record was committed and then pruned by retention:
    a ``txn_version`` save is skipped, never published a second time. A *streaming* job
    (``streaming``) is stricter: Spark replays only its newest batch, so a batch below
    ``last_batch`` is a reset or foreign checkpoint, refused rather than skipped.

    ``epoch`` is the deciding writer's epoch number: a COMMITTED record that this very
    epoch both prepared and committed means the batch was written twice in one run (two
    saves under one job in one ``foreachBatch`` call): refused, never dropped silently.
    (A record this epoch only rolled forward at takeover was prepared by an older one.)

    An ABORTED tombstone lets the batch prepare afresh unless the new manifest names a
    table the tombstone rolled back.
    """
    batch = incoming.batch
    stray = tuple(
        t for t in incoming.staging_tables if existing is None or t not in existing.staging_tables
    )
    below = batch is not None and last_batch is not None and batch < last_batch
    if streaming and below:
        return BatchDecision(
            "refuse",
            stray,
            f"batch {batch} of job {incoming.job} is below the job's last committed batch "
            f"{last_batch}. Spark replays only its newest batch, so this query's checkpoint "
            f"was reset or belongs to another query; nothing was written. Restore the "
            f"checkpoint, or write with a new job name",
        )
    if existing is None or existing.state is XidState.ABORTED:
        if batch is not None and last_batch is not None and batch <= last_batch:
            return BatchDecision(
                "skip_committed",
                stray,
                f"batch {batch} is not newer than the last committed batch {last_batch}",
            )
        if existing is not None:
            clash = sorted(existing.aborted_tables & set(incoming.staging_tables))
            if clash:
                return BatchDecision(
                    "refuse",
                    stray,
                    f"xid {incoming.xid}: staging {', '.join(clash)} was rolled back (ABORTED "
                    f"tombstone) while this commit was on its way; the batch must be written "
                    f"again (restart the query: Spark replays it)",
                    retry=True,
                )
            return BatchDecision("prepare", reason="xid rolled back before; preparing afresh")
        return BatchDecision("prepare", reason="new xid")
    if existing.state is XidState.COMMITTED:
        if epoch is not None and existing.epoch == epoch == existing.committed_epoch:
            return BatchDecision(
                "refuse",
                stray,
                f"xid {existing.xid} of job {existing.job} was already committed by this same "
                f"writer run (epoch {epoch}): the batch was saved twice under one job, e.g. two "
                f"saves in one foreachBatch call. The second save was NOT written. Write every "
                f"table of a batch inside one `txsink.transaction(...)`, or keep this job for "
                f"the first save and give the second its own job name",
            )
        return BatchDecision("skip_committed", stray, f"xid {existing.xid} already committed")
    return BatchDecision(
        "roll_forward_existing", stray, f"xid {existing.xid} already prepared; finishing it"
    )


def droppable(record: XidRecord | None, tables: Iterable[str]) -> tuple[str, ...]:
    """Which of ``tables`` may be dropped after a roll-back tombstone was attempted.

    ``record`` is the xid's record as the tombstone write left it. ABORTED: exactly the
    tables it names (they can never be prepared now). PREPARED or COMMITTED: a prepare
    won the race; its manifest is final, so every table it does not name is garbage and
    the ones it names are not ours to drop. None (the tombstone could not be written):
    nothing.
    """
    wanted = list(dict.fromkeys(tables))
    if record is None:
        return ()
    if record.state is XidState.ABORTED:
        return tuple(t for t in wanted if t in record.aborted_tables)
    mine = set(record.staging_tables)
    if record.state is XidState.PREPARED:  # its batch staging (visibility=batch) too
        mine |= {t for t in wanted if (n := parse_staging(t)) and n.batch and n.xid == record.xid}
    return tuple(t for t in wanted if t not in mine)


@dataclass(frozen=True)
class RecoveryPlan:
    roll_forward: tuple[XidRecord, ...] = ()
    roll_back: tuple[str, ...] = ()
    drop_committed: tuple[str, ...] = ()
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def empty(self) -> bool:
        return not (self.roll_forward or self.roll_back or self.drop_committed)


def plan_recovery(
    job: str, records: Iterable[XidRecord], staging_tables: Iterable[str], namespace: str = ""
) -> RecoveryPlan:
    """Roll PREPARED xids forward; drop every staging table of ``job`` no PREPARED xid needs.

    Only tables whose name parses as this job's staging (in this ``namespace``) are ever
    considered, so nothing outside the job's own prefix can be touched. ``roll_back`` is
    dropped only behind an ABORTED tombstone (:func:`droppable`).
    """
    prefix = staging_prefix(job, namespace)
    records = list(records)
    prepared = tuple(
        sorted(
            (r for r in records if r.state is XidState.PREPARED),
            key=lambda r: (r.batch is None, r.batch or 0, r.created_at),
        )
    )
    needed = {t for r in prepared for t in r.staging_tables}
    committed_tables = {
        t for r in records if r.state is XidState.COMMITTED for t in r.staging_tables
    }
    mine = sorted(t for t in staging_tables if (n := parse_staging(t)) and n.prefix == prefix)
    # batch staging (visibility=batch) is named by its xid, not listed in the manifest
    by_state = {r.xid: r.state for r in records}
    for table in mine:
        name = parse_staging(table)
        if name is not None and name.batch:
            state = by_state.get(name.xid)
            if state is XidState.PREPARED:
                needed.add(table)
            elif state is XidState.COMMITTED:
                committed_tables.add(table)
    roll_back = tuple(t for t in mine if t not in needed and t not in committed_tables)
    leftover = tuple(t for t in mine if t in committed_tables and t not in needed)
    return RecoveryPlan(prepared, roll_back, leftover)


# An ABORTED tombstone outlives any prepare that can still be in flight (a Keeper request
# lives at most a session timeout; a paused writer is fenced by its epoch long before).
TOMBSTONE_SECONDS = 3600.0


def plan_prune(
    records: Iterable[XidRecord],
    keep: int,
    now: float | None = None,
    tombstone_seconds: float = TOMBSTONE_SECONDS,
) -> list[str]:
    """COMMITTED xids beyond the newest ``keep`` (by batch, then commit time), and
    ABORTED tombstones older than ``tombstone_seconds`` (when ``now`` is given)."""
    records = list(records)
    committed = sorted(
        (r for r in records if r.state is XidState.COMMITTED),
        key=lambda r: (r.committed_at or 0.0, r.batch if r.batch is not None else -1),
    )
    excess = len(committed) - max(keep, 0)
    doomed = [r.xid for r in committed[:excess]] if excess > 0 else []
    if now is not None:
        doomed += [
            r.xid
            for r in records
            if r.state is XidState.ABORTED and now - r.created_at > tombstone_seconds
        ]
    return doomed
