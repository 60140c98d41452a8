"""The commit of one batch, a takeover and its recovery, the roll-backs and the pruning,
as sequences: each yields what to read or do next (:mod:`txsink.protocol.steps`) and
decides from what it receives; the runner (:class:`txsink.publisher.StepRunner`) carries
the steps out.

Pure: no I/O, no clock, no logging (a :class:`~txsink.protocol.steps.Note` asks the
runner to log). The decisions themselves are :func:`txsink.protocol.plans.decide_batch`,
:func:`txsink.protocol.job.discarded_batch`, :func:`txsink.protocol.plans.droppable` and
:func:`txsink.protocol.plans.plan_prune`; the publish is :mod:`txsink.protocol.sequence`,
run by the runner with its re-observing retries (:class:`~txsink.protocol.steps.PublishXid`).

Invariants (the order is the protocol):
- a PREPARED record is written only once every read that decides it was synced, and
  only by a writer whose epoch the prepare's own compare-and-set checks;
- a roll-back writes its ABORTED tombstone before any drop, and drops only what the
  node's final state leaves to it;
- a refused batch checks the fence first: a superseded writer hears that, not the
  refusal.
"""

from __future__ import annotations

from collections.abc import Generator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from txsink.protocol import job as rules
from txsink.protocol import plans
from txsink.protocol.codec import FINISHED_STATE, JobMeta
from txsink.protocol.ids import parse_staging
from txsink.protocol.ops import Gather
from txsink.protocol.states import Epoch, Mode, XidRecord, XidState
from txsink.protocol.steps import (
    Abort,
    Alarmed,
    CheckFence,
    CommitStep,
    DeleteRecords,
    DropLeftoverFills,
    DropTables,
    EnsureJob,
    Failure,
    FaultPoint,
    ForgetDedupState,
    Heartbeat,
    ListRecords,
    ListStaging,
    Mark,
    Note,
    Prepare,
    PublishXid,
    PutRunMark,
    ReadBatchState,
    ReadCommittedCount,
    ReadDedupRecords,
    ReadDiscarded,
    ReadEpoch,
    ReadRunMark,
    Stop,
    Sync,
    TakeEpoch,
    Taken,
)

#: a commit of a batch whose number is a multiple of this prunes old records after it
PRUNE_EVERY = 50


@dataclass(frozen=True)
class Committed:
    """How a commit ended: ``action`` ("committed", "rolled_forward", "skipped",
    "discarded") and the record it published (None when it published nothing)."""

    action: str
    record: XidRecord | None = None


@dataclass(frozen=True)
class Ask:
    """What a commit knows before it reads: the record its tasks staged (PREPARED, this
    writer's epoch), how its batch id is read (``streaming``: a micro-batch id, replays
    repeat the newest batch only; ``own_batches``/``first_batch``:
    :func:`~txsink.protocol.plans.decide_batch`), which targets a fresh publish gathers,
    whether the caller synced since the batch began (``synced``), the record and last
    batch it read after that sync (``seen``: no reads of its own), the owner's facts
    once the record is COMMITTED (``rest``) and the records kept (``retention``)."""

    incoming: XidRecord
    streaming: bool = False
    own_batches: bool = False
    first_batch: int | None = None
    gather: Gather | None = None
    synced: bool = False
    seen: tuple[XidRecord | None, int | None] | None = None
    rest: Mapping[str, Any] | None = None
    idle: Mapping[str, Any] | None = None
    retention: int = 1000


CommitRun = Generator[CommitStep, Any, Committed]


def commit(ask: Ask) -> CommitRun:
    """Decide the batch (prepare, roll forward, skip, refuse), prepare it, roll back what
    no record will need, publish, then the after-commit upkeep."""
    incoming = ask.incoming
    xid, job, target = incoming.xid, incoming.job, incoming.target
    # decisive reads (skip, roll forward, refuse, drop strays): synced, so a lagging
    # Keeper server cannot show a record as it was before another runner moved it
    if not ask.synced:
        yield Sync()
    if ask.seen is None:
        existing, last_batch = yield ReadBatchState(xid)
    else:
        existing, last_batch = ask.seen

    def decide(existing: XidRecord | None) -> plans.BatchDecision:
        return plans.decide_batch(
            existing, incoming, last_batch, streaming=ask.streaming, epoch=incoming.epoch,
            own_batches=ask.own_batches, first_batch=ask.first_batch,
        )  # fmt: skip

    decision = decide(existing)
    fresh = decision.action is plans.BatchAction.PREPARE
    if fresh and incoming.mode is Mode.DEDUP:
        mark = yield ReadDiscarded(xid)
        gone = rules.discarded_batch(job, xid, target, mark, streaming=ask.streaming)
        if gone.verdict is rules.TaskVerdict.SKIP:  # its tasks skipped: Spark moves on
            yield Note("warning", gone.reason)
            yield Heartbeat(ask.idle or {}, best_effort=True)
            return Committed("discarded")
        if gone.verdict is rules.TaskVerdict.REFUSE:
            yield Stop(Failure.DISCARDED, gone.reason, bare=True)
        recorded: Sequence[str] = yield ReadDedupRecords(xid)
        why = rules.dedup_coverage_refusal(
            job,
            xid,
            {n[1:] for n in recorded if n.startswith("p") and n[1:].isdigit()},
            {p.partition_id for p in incoming.manifest},
        )
        if why is not None:
            yield Stop(Failure.CONTENT_CHANGED, why, bare=True)
    record: XidRecord | None = None
    if fresh:
        yield FaultPoint("driver.before_prepare")
        got: XidRecord | Taken = yield Prepare(incoming)
        if isinstance(got, Taken):  # another attempt prepared it first
            existing = got.existing
            decision = decide(existing)
        else:
            record = got
            yield FaultPoint("driver.after_prepare")
    yield Mark("prepared")
    if decision.drop:
        yield from roll_back(job, xid, decision.drop)
    if decision.action is plans.BatchAction.REFUSE:
        yield CheckFence()  # a superseded writer hears FencedError first
        yield Stop(Failure.CONFLICT if decision.retry else Failure.CONFIG, decision.reason)
    if decision.action is plans.BatchAction.SKIP:
        yield Note("info", f"{decision.reason}; replay is a no-op")
        if existing is not None and existing.mode is Mode.DEDUP:
            yield ForgetDedupState(xid)  # a crash may have come before the cleanup
        yield Heartbeat(ask.idle or {}, best_effort=True)
        return Committed("skipped")
    if decision.action is plans.BatchAction.ROLL_FORWARD:
        assert existing is not None
        yield Note("warning", decision.reason)
        record = existing
    assert record is not None
    fresh = decision.action is plans.BatchAction.PREPARE
    rest = dict(ask.rest or {}) | {"last_xid": record.xid, "last_batch": record.batch}
    done: XidRecord
    rested: bool
    done, rested = yield PublishXid(
        record, resumed=not fresh, gather=ask.gather if fresh else None, rest=rest
    )
    yield Mark("published")
    yield from after_commit(done, None if rested else rest, ask.retention)
    return Committed("committed" if fresh else "rolled_forward", done)


def after_commit(
    record: XidRecord, rest: Mapping[str, Any] | None, retention: int
) -> Generator[CommitStep, Any, None]:
    """The upkeep after ``record`` is COMMITTED: its dedup state goes, the owner's facts
    (``rest``, if the COMMITTED write did not carry them), and every
    :data:`PRUNE_EVERY` batches old records and leftover fills."""
    if record.mode is Mode.DEDUP:
        yield ForgetDedupState(record.xid)
    if rest is not None:
        yield Heartbeat(rest)
    if record.batch is not None and record.batch % PRUNE_EVERY == 0:
        yield from prune(record.job, retention)
        yield DropLeftoverFills()


def roll_back(job: str, xid: str, tables: Sequence[str]) -> Generator[CommitStep, Any, list[str]]:
    """Drop staging ``tables`` of ``xid`` that no record can ever need; returns them.

    An ABORTED tombstone is written on the xid node first: Keeper then orders this
    roll-back against every prepare of the xid (one whose reply was lost, a paused
    zombie's, one a lagging read did not show), and only tables the node's final state
    leaves to us are dropped (:func:`plans.droppable`). Synced, so that the tombstone's
    first read rarely has to be paid for with a write."""
    if not tables:
        return []
    yield Sync()
    record: XidRecord | None = yield Abort(xid, tuple(tables))
    doomed = plans.droppable(record, tables)
    kept = sorted(set(tables) - set(doomed))
    if kept:  # a COMMITTED record's own staging is its publish's to drop: no news
        state = record.state if record is not None else "unknown"
        level = "info" if record is not None and record.state is XidState.COMMITTED else "warning"
        yield Note(level, f"xid {xid} is {state}; not dropping its staging {kept}")
    if doomed:
        yield DropTables(tuple(doomed))
    return list(doomed)


def release(run_id: str, current: Epoch | None) -> Generator[CommitStep, Any, bool]:
    """A clean stop of ``run_id``'s query: its writer rests ``finished`` (a fenced
    heartbeat of ``current``, the job's epoch as read), so ``txsink status`` reads the job
    stopped, not live, and ``txsink recover`` needs no ``--force``. A run that no longer
    owns the job (taken over since) writes nothing, and neither does one that left a
    PREPARED xid (not a clean stop: its heartbeat must go stale for recovery to act).
    True when released."""
    if current is None or current.owner != run_id:
        return False
    records: list[XidRecord]
    records, _ = yield ListRecords()
    if any(r.state is XidState.PREPARED for r in records):
        return False
    yield Heartbeat({"state": FINISHED_STATE})
    return True


def prune(job: str, retention: int) -> Generator[CommitStep, Any, list[str]]:
    """Delete the records past ``retention`` (:func:`plans.plan_prune`); a dedup xid's
    state goes first, strictly (without its COMMITTED record it would read as a batch
    stopped half-way and fence the job): one whose state cannot be deleted stays."""
    records: list[XidRecord]
    now: float
    records, now = yield ListRecords()
    doomed = plans.plan_prune(records, retention, now=now)
    dedup_xids = {r.xid for r in records if r.mode is Mode.DEDUP}
    kept: list[str] = []
    for xid in doomed:
        # a dedup xid's state is normally gone already (left by a crash after COMMITTED)
        if xid in dedup_xids and not (yield ForgetDedupState(xid, strict=True)):
            yield Note("warning", f"keeping xid {xid} for now: its dedup state stays (above)")
            kept.append(xid)
    doomed = [x for x in doomed if x not in kept]
    if doomed:
        yield DeleteRecords(tuple(doomed))
    return doomed


@dataclass
class RecoveryReport:
    """What a recovery did (or, ``dry_run``, would do) to one job."""

    job: str
    epoch: int
    dry_run: bool
    rolled_forward: list[str] = field(default_factory=list)
    rolled_back: list[str] = field(default_factory=list)
    dropped_leftovers: list[str] = field(default_factory=list)
    alarms: list[str] = field(default_factory=list)
    pruned: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def take_over(
    job: str,
    owner: str,
    meta: JobMeta | Mapping[str, Any],
    *,
    namespace: str,
    prefix: str,
    keep: frozenset[str],
    retention: int,
    promise: Mapping[str, Any],
    ensured: bool = False,
) -> Generator[CommitStep, Any, tuple[Epoch, RecoveryReport]]:
    """Take a new writer epoch (fencing every older writer), then recover the job
    (:func:`recover`); the owner's ``promise`` (how often it beats) is written once
    recovery needs no operator (the caller raises on the report's alarms). ``ensured``:
    the job's node is known to exist (:func:`run_epoch` made sure)."""
    if not ensured:
        yield EnsureJob(meta)
    epoch: Epoch = yield TakeEpoch(owner)
    yield Heartbeat({"state": "recovering"})
    report = yield from recover(
        job, namespace, prefix, epoch.number, keep=keep, retention=retention
    )
    if not report.alarms:  # inside its first commit it declares how often it beats
        yield Heartbeat(promise)
    return epoch, report


def recover(
    job: str,
    namespace: str,
    prefix: str,
    epoch: int,
    *,
    dry_run: bool = False,
    keep: frozenset[str] = frozenset(),
    retention: int = 1000,
) -> Generator[CommitStep, Any, RecoveryReport]:
    """Roll PREPARED xids forward, roll back staging no PREPARED xid references (``keep``:
    a batch in flight's, left alone), drop committed xids' leftovers, prune
    (:func:`plans.plan_recovery`); ``dry_run``: only the report of what it would do."""
    yield Sync()  # the listing decides every roll-forward and drop
    records: list[XidRecord]
    records, _ = yield ListRecords()
    listed: list[str] = yield ListStaging(prefix)
    tables = [t for t in listed if t not in keep]
    plan = plans.plan_recovery(job, records, tables, namespace)
    report = RecoveryReport(
        job, epoch, dry_run, rolled_forward=[r.xid for r in plan.roll_forward],
        rolled_back=list(plan.roll_back), dropped_leftovers=list(plan.drop_committed),
    )  # fmt: skip
    if dry_run:
        return report
    for record in plan.roll_forward:
        done = yield PublishXid(record, alarms=True)
        if isinstance(done, Alarmed):
            report.alarms.append(done.message)
            continue
        yield Note("warning", f"rolled xid {record.xid} forward")
        if record.mode is Mode.DEDUP:
            yield ForgetDedupState(record.xid)
    report.rolled_back = yield from roll_back_tables(job, plan.roll_back)
    if plan.drop_committed:
        yield DropTables(tuple(plan.drop_committed))
        yield Note("info", f"dropped staging {list(plan.drop_committed)}")
    report.pruned = yield from prune(job, retention)
    return report


def roll_back_tables(job: str, tables: Sequence[str]) -> Generator[CommitStep, Any, list[str]]:
    """:func:`roll_back` for staging of any xids (grouped by the xid in the name)."""
    by_xid: dict[str, list[str]] = {}
    for table in tables:
        parsed = parse_staging(table)
        if parsed is not None:
            by_xid.setdefault(parsed.xid, []).append(table)
    dropped: list[str] = []
    for xid, group in by_xid.items():
        dropped += yield from roll_back(job, xid, group)
    return dropped


class _NeedsLedger(Exception):
    """:func:`txsink.protocol.job.takeover_refusal` asked for the committed count."""


UNREAD: Any = object()  # run_epoch's ``current`` when the caller did not read it


def run_epoch(
    job: str,
    run_id: str,
    meta: JobMeta,
    *,
    current: Epoch | None = UNREAD,
    namespace: str,
    prefix: str,
    keep: frozenset[str],
    retention: int,
    promise: Mapping[str, Any],
) -> Generator[CommitStep, Any, tuple[Epoch, RecoveryReport | None]]:
    """The epoch of the Spark run ``run_id``: the current one if the run owns the job,
    else a takeover (:func:`take_over`, which also returns its recovery's report).
    ``current``: the job's epoch as the caller read it after a sync. A run whose mark is
    there but whose epoch is gone was superseded: it must stop, never take the job back.
    A run whose ``meta`` (query, table, shards, mode) would reuse another's xids is
    refused (:func:`txsink.protocol.job.takeover_refusal`) before it takes anything."""
    if current is UNREAD:
        # synced: a new Python worker's session may sit on a server that has not seen
        # this run take the job yet, and would make the run take it over from itself
        yield Sync()
        current = yield ReadEpoch()
    if current is not None and current.owner == run_id:
        return current, None
    if (yield ReadRunMark(run_id)) is not None:
        yield Stop(
            Failure.FENCED,
            f"run {run_id} was superseded by run {current.owner if current else '?'} (epoch "
            f"{current.number if current else '?'}); this query must stop. Two queries must "
            f"not write with the same job name.",
        )
    stored: JobMeta = yield EnsureJob(meta)  # records the meta at the job's first run

    def refusal(committed: int | None) -> str | None:
        def count() -> int:
            if committed is None:
                raise _NeedsLedger
            return committed

        facts = rules.JobFacts
        return rules.takeover_refusal(job, facts.of(stored), facts.from_meta(meta), count)

    try:
        why = refusal(None)
    except _NeedsLedger:
        why = refusal((yield ReadCommittedCount()))
    if why:
        yield Stop(Failure.CONFIG, why, bare=True)
    yield PutRunMark(run_id)
    epoch, report = yield from take_over(
        job, run_id, meta, namespace=namespace, prefix=prefix, keep=keep,
        retention=retention, promise=promise, ensured=True,
    )  # fmt: skip
    if current is not None and not report.alarms:
        yield Note(
            "warning",
            f"run {run_id} took over from {current.owner} (epoch {current.number} -> "
            f"{epoch.number})",
        )
    return epoch, report
