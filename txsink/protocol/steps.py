"""The steps a publish sequence yields (:mod:`txsink.protocol.sequence`): observations,
whose results the runner sends back, and actions, which it carries out.

This module owns only this vocabulary and the bounds of the loops (:class:`PublishBounds`);
the commit around a publish (:mod:`txsink.protocol.commit`) yields the steps of its own
section below.
The plan's own operations (:mod:`txsink.protocol.ops`) are steps too; the ones here add
what a plan needs around them: what to look at, one round trip for a run of moves or
drops, the Keeper writes with the record they apply to, the fault points, the end.
"""

from __future__ import annotations

import enum
from collections.abc import Generator, Mapping
from dataclasses import dataclass
from typing import Any

from txsink.protocol.codec import BEAT_KEY, WAIT_KEY
from txsink.protocol.ops import Gather, Operation, RecordCommitted, RecordCut
from txsink.protocol.states import XidRecord


@dataclass(frozen=True)
class PublishBounds:
    """How long and how often a publish looks again: protocol parameters, carried out
    by the runner. ``retry_s``: how long a publish re-observes after failures whose
    outcome is unknown, and how long it waits for the server to be quiet; ``pause_s`` /
    ``max_pause_s``: the backoff between attempts (doubling); ``settle_pause_s``: between
    two looks for statements still running; ``heartbeat_s``: how often a waiting writer
    shows it is alive; ``statement_s``: the longest the writer waits on one statement's
    reply (its client's send_receive_timeout + connect_timeout: a publish beats between
    statements, never during one); ``batch_rounds``: how many consolidate / claim / attach rounds a
    ``visibility=batch`` finish plans before it calls the staging unstable."""

    retry_s: float = 60.0
    pause_s: float = 0.2
    max_pause_s: float = 5.0
    settle_pause_s: float = 0.5
    heartbeat_s: float = 5.0
    statement_s: float = 310.0
    batch_rounds: int = 8

    def promise(self, state: str, **details: Any) -> dict[str, Any]:
        """The owner-node heartbeat of a writer inside a commit: ``state`` with the beat
        it promises between statements and the longest statement it may wait on."""
        return {"state": state, **details, BEAT_KEY: self.heartbeat_s, WAIT_KEY: self.statement_s}


# -- observations (the runner sends back the result) -----------------------------------


@dataclass(frozen=True)
class ListStaging:
    """-> ``list[str]``: staging tables whose name starts with ``prefix``."""

    prefix: str


@dataclass(frozen=True)
class ObserveStaging:
    """-> :data:`StagingView`: rows per partition of each table (None: missing)."""

    tables: tuple[str, ...]


@dataclass(frozen=True)
class ObservePartRows:
    """-> ``{partition id: {evidence id: rows}}`` of every part ``table`` holds."""

    table: str


@dataclass(frozen=True)
class ObserveBatchParts:
    """-> ``dict[str, tuple[str, ...]]``: evidence ids of every part of batch staging
    ``table`` per partition id (one per part: a part copied twice shows twice)."""

    table: str


@dataclass(frozen=True)
class ObservePublished:
    """-> ``frozenset[str]``: which of ``uuids`` the parts of ``target`` show."""

    target: str
    uuids: tuple[str, ...]


@dataclass(frozen=True)
class ObserveAttachLog:
    """-> ``bool``: ``system.query_log`` shows a finished ATTACH into ``target`` with
    ``log_comment`` ``tag``, since ``since`` (the record's ``created_at``)."""

    target: str
    tag: str
    since: float


@dataclass(frozen=True)
class ObserveEvidenceLife:
    """-> :class:`~txsink.protocol.evidence_life.EvidenceLife` of ``target``, its
    ``age_s`` the runner's clock minus ``since`` (the record's ``created_at``). Asked only
    by a resumed publish about to move or attach: never on a fresh commit."""

    target: str
    since: float


@dataclass(frozen=True)
class ObserveDetached:
    """-> ``{table: {partition id: detached parts}}`` of the staging ``tables`` in
    ``system.detached_parts`` (partition id "" when the server could not parse one);
    tables without any are left out. Asked only when a staging partition reads empty."""

    tables: tuple[str, ...]


@dataclass(frozen=True)
class HeldClaims:
    """-> ``{target: name}``: batch staging tables of ``xid`` this runner renamed to its
    own name (:class:`~txsink.protocol.ops.ClaimBatch`) and has not attached from yet."""

    xid: str


@dataclass(frozen=True)
class Settle:
    """-> ``bool``: ClickHouse answered, with no statement running on a table whose name
    contains one of ``needles``, within the publish's time (``fresh``: a full
    :attr:`PublishBounds.retry_s` from now)."""

    xid: str
    needles: tuple[str, ...]
    fresh: bool = False


@dataclass(frozen=True)
class SealRow:
    """Write seal row ``tag`` on the server (every shard): no block insert carrying this
    tag starts after it (:class:`~txsink.protocol.ops.SealDedup`)."""

    tag: str


@dataclass(frozen=True)
class CheckFence:
    """-> None: raises (FencedError) unless this writer's epoch still holds the job."""


@dataclass(frozen=True)
class ReadRecord:
    """-> ``XidRecord | None``: the xid's record as Keeper has it now."""

    xid: str


# -- actions ---------------------------------------------------------------------------


@dataclass(frozen=True)
class MovePartitions:
    """Consecutive :class:`~txsink.protocol.ops.Publish` steps of one staging table into
    one target: one ``ALTER TABLE staging MOVE PARTITION ..., MOVE PARTITION ...`` round
    trip. Each command stays atomic per (staging table, partition); a failure part-way
    leaves moved and unmoved partitions, which a resumed publish tells apart as always."""

    staging: str
    target: str
    partition_ids: tuple[str, ...]


@dataclass(frozen=True)
class DropTables:
    """Consecutive :class:`~txsink.protocol.ops.DropStaging` steps: one ``DROP TABLE``.
    ``wait``: the statement returns once the data is gone (``SYNC``); without it the
    server frees the names at once and the disk later (a batch's staging after its
    COMMITTED record: non-replicated tables, names never used again, nothing left to read
    from them)."""

    tables: tuple[str, ...]
    wait: bool = True


@dataclass(frozen=True)
class Attach:
    """:class:`~txsink.protocol.ops.AttachAll` with the ``log_comment`` every finisher of
    this prepare gives it (:func:`attach_tag`). The runner forgets its claim first: a
    claim serves one ATTACH, never a second one from the same name."""

    xid: str
    batch_staging: str
    target: str
    tag: str


@dataclass(frozen=True)
class Write:
    """-> ``XidRecord``: a fenced Keeper write of ``op`` onto ``record`` (its version is
    the compare-and-set): the cut facts of a repair, or COMMITTED."""

    record: XidRecord
    op: RecordCut | RecordCommitted


@dataclass(frozen=True)
class FaultPoint:
    """A point where a crash is tested (:mod:`txsink.faults`); nothing to carry out."""

    name: str


class Failure(enum.Enum):
    """How a :class:`Stop` ends the publish (the runner maps each to an error)."""

    ALARM = "alarm"  # needs an operator: RecoveryAlarm
    UNAVAILABLE = "unavailable"  # ClickHouse not seen quiet: UnavailableError
    NOT_QUIET = "not_quiet"  # as UNAVAILABLE, but the failure that made us look wins
    CONFLICT = "conflict"  # look again later: RetryableConflict
    CONFIG = "config"  # a refusal a replay cannot cure: ConfigError
    DISCARDED = "discarded"  # a dedup batch given up by an operator: DiscardedBatch
    CONTENT_CHANGED = "content_changed"  # a replay that differs: ContentChanged
    FENCED = "fenced"  # another run holds the job: FencedError


@dataclass(frozen=True)
class Stop:
    """End the publish with ``failure``; the runner raises, the generator never resumes.
    ``bare``: the message names the job itself (the runner adds nothing)."""

    failure: Failure
    message: str
    bare: bool = False


# -- the commit around the publish (txsink.protocol.commit) ---------------------------


@dataclass(frozen=True)
class Sync:
    """-> None: the job's reads from here on see every write before this step."""


@dataclass(frozen=True)
class ReadBatchState:
    """-> ``(XidRecord | None, int | None)``: the xid's record and the job's last
    committed batch (its ledger)."""

    xid: str


@dataclass(frozen=True)
class ReadDiscarded:
    """-> the operator's mark on a dedup xid given up (``recover --discard-dedup``), or
    None."""

    xid: str


@dataclass(frozen=True)
class ReadDedupRecords:
    """-> the names under a dedup xid's state (``p<partition>`` per Spark partition)."""

    xid: str


@dataclass(frozen=True)
class Taken:
    """What :class:`Prepare` answers when the xid's node exists already: its record."""

    existing: XidRecord | None


@dataclass(frozen=True)
class Prepare:
    """-> ``XidRecord`` (written PREPARED, fenced by its epoch) or :class:`Taken`. An
    outcome the runner cannot know (a lost reply) is CommitOutcomeUnknown: recovery
    finishes or rolls back whatever landed."""

    record: XidRecord


@dataclass(frozen=True)
class Abort:
    """-> ``XidRecord | None``: the ABORTED tombstone written on the xid node for
    ``tables`` (or the node's state that kept it from being written)."""

    xid: str
    tables: tuple[str, ...]


@dataclass(frozen=True)
class PublishXid:
    """-> ``(XidRecord, bool)``: ``record`` published to COMMITTED by the runner's
    re-observing retries around :func:`txsink.protocol.sequence.publish_attempt`, and
    whether the COMMITTED write carried ``rest`` (the owner's facts). ``alarms``: a
    publish that needs an operator answers :class:`Alarmed` (recovery goes on with the
    other xids) instead of raising."""

    record: XidRecord
    resumed: bool = True
    gather: Gather | None = None
    rest: Mapping[str, Any] | None = None
    alarms: bool = False


@dataclass(frozen=True)
class Alarmed:
    """What :class:`PublishXid` answers (``alarms``) for a publish that needs an operator."""

    message: str


@dataclass(frozen=True)
class EnsureJob:
    """-> ``JobMeta``: the job's node made (with ``meta``) if it is missing; the meta it
    records (``meta`` filled in on a blank node)."""

    meta: Any  # JobMeta or its mapping


@dataclass(frozen=True)
class ReadEpoch:
    """-> ``Epoch | None``: the job's current writer epoch."""


@dataclass(frozen=True)
class ReadRunMark:
    """-> the mark a run left when it took the job (``runs/<run_id>``), or None."""

    run_id: str


@dataclass(frozen=True)
class PutRunMark:
    """-> None: ``runs/<run_id>`` written: this run took the job (a later run that finds
    its epoch gone knows it was superseded, not new)."""

    run_id: str


@dataclass(frozen=True)
class ReadCommittedCount:
    """-> int: how many xids the job's ledger counts as committed."""


@dataclass(frozen=True)
class TakeEpoch:
    """-> ``Epoch``: a new writer epoch of ``owner``, fencing every older writer; the
    runner fences the steps after it with it."""

    owner: str


@dataclass(frozen=True)
class Heartbeat:
    """-> None: the owner's facts written (fenced); ``best_effort``: a failure is logged."""

    facts: Mapping[str, Any]
    best_effort: bool = False


@dataclass(frozen=True)
class ForgetDedupState:
    """-> bool: a dedup xid's state deleted (False: it could not be; logged unless
    ``strict``, where the caller decides)."""

    xid: str
    strict: bool = False


@dataclass(frozen=True)
class ListRecords:
    """-> ``(list[XidRecord], float)``: every record of the job, and the time now."""


@dataclass(frozen=True)
class DeleteRecords:
    """-> None: the records of ``xids`` deleted (fenced)."""

    xids: tuple[str, ...]


@dataclass(frozen=True)
class DropLeftoverFills:
    """-> None: what killed servers left of gathered CREATEs dropped (best effort)."""


@dataclass(frozen=True)
class Note:
    """-> None: ``message`` logged at ``level`` ("info", "warning") for the job."""

    level: str
    message: str


@dataclass(frozen=True)
class Mark:
    """-> None: the runner notes the time (``prepared``: the commit's timings)."""

    name: str


Step = (
    ListStaging
    | ObserveStaging
    | ObservePartRows
    | ObserveBatchParts
    | ObservePublished
    | ObserveAttachLog
    | ObserveEvidenceLife
    | ObserveDetached
    | HeldClaims
    | Settle
    | SealRow
    | CheckFence
    | ReadRecord
    | MovePartitions
    | DropTables
    | Attach
    | Write
    | FaultPoint
    | Stop
    | Operation
)

# A publish sequence: yields steps, receives their results, returns the final record.
Run = Generator[Step, Any, XidRecord]

# What a commit sequence yields besides the publish's steps (which it runs as one
# :class:`PublishXid`).
CommitStep = (
    Sync
    | EnsureJob
    | ReadEpoch
    | ReadRunMark
    | PutRunMark
    | ReadCommittedCount
    | TakeEpoch
    | ListStaging
    | ReadBatchState
    | ReadDiscarded
    | ReadDedupRecords
    | Prepare
    | Abort
    | PublishXid
    | Heartbeat
    | ForgetDedupState
    | ListRecords
    | DeleteRecords
    | DropLeftoverFills
    | DropTables
    | CheckFence
    | FaultPoint
    | Note
    | Mark
    | Stop
)
