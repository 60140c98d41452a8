"""The operations a publish plan is made of: what the runner acts on, in order.

This module owns only the vocabulary, shared by :mod:`txsink.protocol.planner` (which
decides them), :mod:`txsink.protocol.sequence` (which yields them) and the runner
(:mod:`txsink.transactor`, which carries them out). Every operation is a frozen value:
planning the same observations twice yields equal operations, which is what lets a test
compare two plans, or a crashed plan with its re-run.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

# What the driver sees of one staging table: rows per partition id, or None if missing.
StagingView = Mapping[str, Mapping[str, int] | None]

# Every part UUID of a fully staged manifest partition, as a resumed publish sees staging
# now: (staging table, partition id) -> evidence ids of all its parts.
StagedUuids = Mapping[tuple[str, str], tuple[str, ...]]


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
    (``kind``: ``uuid`` | ``protected`` | ``legacy`` | ``cut`` | ``logged``, see
    :func:`txsink.protocol.planner.plan_publish`)."""

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


# -- visibility=batch only (see txsink.protocol.visibility) ---------------------------


@dataclass(frozen=True)
class CreateBatchStaging:
    """Create the batch staging ``table`` like the ``target`` (or, with no target, like
    the task staging table ``like``). ``claimed``: under a name of this finisher's own
    (what :class:`ClaimBatch` would rename it to; the runner answers with the name), so
    that a fresh publish holds it from the start without a RENAME."""

    table: str
    target: str
    like: str  # a task staging table of the same target to copy the structure from
    claimed: str = ""  # the target whose claim this is ("": the table's own name)


@dataclass(frozen=True)
class Consolidate:
    """Move one task staging partition into the batch staging table (invisible)."""

    xid: str
    staging: str
    partition_id: str
    batch_staging: str
    rows: int


ALL_PARTITIONS = ""  # a CopyIntoBatch source's partition id: every partition of the table


@dataclass(frozen=True)
class CopyIntoBatch:
    """``ALTER TABLE batch_staging ATTACH PARTITION ID 'p' FROM s1, ...``: every task
    staging partition of one target copied (hard links, invisible to readers) into its
    batch staging in one statement, whatever the number of tasks. It copies, so it is
    never repeated into the same table: a batch staging that does not hold exactly the
    task staging's parts is dropped and built again (it was never attached from: an
    ATTACH runs only on exact content, and content never changes after)."""

    xid: str
    batch_staging: str
    # (task staging table, partition id), or (table, ALL_PARTITIONS): every partition
    sources: tuple[tuple[str, str], ...]
    rows: int


@dataclass(frozen=True)
class BatchShape:
    """The target as the commit's one read saw it, enough to create its batch staging
    and fill it in the same statement (:class:`CreateGathered`): ``ddl``, what follows
    the table's name in its CREATE (columns, engine, the staging settings), and
    ``layout``, every column's (name, type, kind) in order, which every task staging
    table must show on the server when the rows are read (the new table is made from
    ``ddl``, so nothing is converted)."""

    ddl: str
    layout: tuple[tuple[str, str, str], ...]


@dataclass(frozen=True)
class Gathered:
    """How one target's batch is gathered (:class:`GatherBatch`): its stored columns in
    order, and the bytes its task staging holds (which, unlike copied parts, nothing in
    the target shares: :func:`txsink.protocol.sequence.fresh_batch` drops them waiting
    for the disk to be freed past :data:`DROP_WAIT_BYTES`). ``shape``: the batch staging
    is created and filled in one statement (:class:`CreateGathered`); None where the
    target's CREATE cannot be reproduced exactly (a MATERIALIZED column, a TTL, a
    comment) and the batch staging is created apart."""

    columns: tuple[str, ...]
    staged_bytes: int = 0
    shape: BatchShape | None = None


#: target -> how its batch is gathered: the targets of an xid whose batch goes into one
#: part per partition (:class:`GatherBatch`) rather than copied part by part
Gather = Mapping[str, Gathered]
#: a batch that gathered more than this leaves its task staging's data on disk after a
#: DROP without SYNC (Atomic databases delete it minutes later): its DROP waits instead
DROP_WAIT_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class GatherBatch:
    """``INSERT INTO batch_staging (columns) SELECT columns FROM <every task staging
    table>``: the batch in one part per partition before the ATTACH, in one statement
    (where :func:`txsink.protocol.visibility.compaction` says so: the target's merges
    keep every row, below ``compact_bytes``). The server refuses it, before any row,
    unless every table holds exactly ``columns`` with the same types (nothing is
    converted). It writes new parts, so like :class:`CopyIntoBatch` it is never repeated
    into the same table: a batch staging that does not hold exactly the manifest's rows
    in one part per partition is dropped and built again by copies."""

    xid: str
    batch_staging: str
    tables: tuple[str, ...]  # every task staging table of the target, whole
    columns: tuple[str, ...]  # the target's stored columns, in order
    rows: int


@dataclass(frozen=True)
class CreateGathered:
    """:class:`CreateBatchStaging` (claimed) and :class:`GatherBatch` in one statement:
    ``CREATE TABLE <claimed name> <shape.ddl> AS SELECT columns FROM <every task staging
    table>``; the runner answers with the name. The server checks before any row that
    every task staging table shows ``shape.layout``, else nothing is created; a CREATE
    cut after the table was made leaves a batch staging that the resumed path checks
    like any other (dropped and built again unless it holds exactly the manifest's
    rows in one part per partition)."""

    xid: str
    table: str  # the batch staging's base name (claimed by the runner)
    claimed: str  # the target whose claim this is
    tables: tuple[str, ...]
    columns: tuple[str, ...]
    rows: int
    shape: BatchShape


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
class SealDedup:
    """Write the dedup xid's seal row on the server (:func:`~txsink.protocol.ids.seal_tag`),
    then wait out any of its inserts still running: a block insert checks the seal on the
    server when it starts, so once the seal is written and none runs, no insert of the
    xid can add a row (an attempt frozen between its last check and its send included)."""

    xid: str


@dataclass(frozen=True)
class Reobserve:
    """Stop here, look at staging again and plan afresh (after consolidation)."""


Operation = (
    Publish
    | RecordCommitted
    | SealDedup
    | DropStaging
    | Alarm
    | Evidence
    | RecordCut
    | DropParts
    | CreateBatchStaging
    | Consolidate
    | CopyIntoBatch
    | GatherBatch
    | CreateGathered
    | ClaimBatch
    | AttachAll
    | Reobserve
)
