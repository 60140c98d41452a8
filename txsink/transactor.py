"""The driver-side transaction runner: prepare, publish, record, recover for one job.

One :class:`Transactor` serves one job. The decisions are pure: whether to prepare, roll
forward, skip or refuse (:mod:`txsink.protocol.plans`), and the whole publish, which is a
protocol sequence (:mod:`txsink.protocol.sequence`) yielding what to observe and what to
do next; :class:`txsink.publisher.StepRunner` carries each step out against
:class:`txsink.ports.registry.Registry` and :class:`txsink.clickhouse.warehouse.Warehouse`
and sends the result back. This module keeps the order of prepare and publish, the
retries around a publish (tenacity), roll-back, recovery and pruning.

Invariants:
- the xid record in Keeper is created PREPARED (the commit point) only after every task
  of the batch succeeded, and only by the writer holding the current epoch;
- a PREPARED xid is only ever rolled forward; its staging is dropped only after COMMITTED;
- staging not referenced by a PREPARED xid is dropped at recovery, and every such drop
  (recovery, abort, a replay's strays) is preceded by an ABORTED tombstone on the xid node
  (:meth:`Transactor.roll_back`): a prepare that lands later can never adopt a dropped
  table, whatever reads were stale and whoever was paused;
- a failure whose outcome is unknown raises CommitOutcomeUnknown, never an abort;
- a ClickHouse failure during publish whose outcome is unknown (a lost reply, a reset
  connection, a restarted server) is re-observed, never repeated blindly: the publish
  waits until the server answers and no statement on the xid's staging still runs
  (:meth:`Warehouse.settle`), then plans again from what it sees, for up to
  ``publish_retry_s`` seconds (:meth:`Transactor.publish`).
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import tenacity

from txsink.dedup_state import discarded
from txsink.errors import (
    CommitOutcomeUnknown,
    ConfigError,
    ContentChanged,
    DiscardedBatch,
    RecoveryAlarm,
    RetryableConflict,
    TxSinkError,
    UnavailableError,
)
from txsink.faults import fault_point
from txsink.ports.cas import MAX_CAS_ROUNDS
from txsink.ports.registry import BlobPresent, Registry, XidExists
from txsink.ports.warehouse import Warehouse
from txsink.protocol import job as rules
from txsink.protocol import plans, sequence
from txsink.protocol.codec import (
    FINISHED_STATE,
    IDLE_STATE,
    WAIT_KEY,
    JobMeta,
    Ledger,
)
from txsink.protocol.dedup import xid_key as dedup_xid_key
from txsink.protocol.ids import (
    parse_staging,
    staging_prefix,
)
from txsink.protocol.ops import Gather
from txsink.protocol.states import Epoch, Mode, StagedPart, Visibility, XidRecord, XidState
from txsink.protocol.steps import PublishBounds
from txsink.publisher import StepRunner

log = logging.getLogger(__name__)
# a fill of a batch staging (its CREATE ... AS SELECT) older than this runs no more
LEFTOVER_FILL_S = 3600.0


@dataclass
class CommitResult:
    xid: str
    action: str  # "committed" | "rolled_forward" | "skipped"
    rows: int = 0
    partitions: int = 0
    seconds: float = 0.0
    timings: dict[str, float] = field(default_factory=dict)


@dataclass
class RecoveryReport:
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


def default_owner() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


class Transactor:
    """Runs prepare / publish / record / recover for one job."""

    def __init__(
        self,
        registry: Registry,
        warehouse: Warehouse,
        job: str,
        *,
        retention: int = 1000,
        clock: Callable[[], float] = time.time,
        fault: Callable[[str], None] = fault_point,
        publish_retry_s: float = 60.0,
        statement_s: float = PublishBounds.statement_s,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.registry = registry
        self.warehouse = warehouse
        self.job = job
        self.retention = retention
        self._namespace = ""
        self.last_recovery: RecoveryReport | None = None  # of the last begin(): metrics
        # carries out every publish step; owns the clock, fault hook and sleep (the
        # properties below), so one set on this Transactor later reaches it too
        self.runner = StepRunner(
            registry,
            warehouse,
            job,
            lambda: self.prefix,
            bounds=PublishBounds(retry_s=publish_retry_s, statement_s=statement_s),
            clock=clock,
            fault=fault,
            sleep=sleep,
        )

    @property
    def clock(self) -> Callable[[], float]:
        return self.runner.clock

    @clock.setter
    def clock(self, clock: Callable[[], float]) -> None:
        self.runner.clock = clock

    @property
    def fault(self) -> Callable[[str], None]:
        return self.runner.fault

    @fault.setter
    def fault(self, fault: Callable[[str], None]) -> None:
        self.runner.fault = fault

    @property
    def sleep(self) -> Callable[[float], None]:
        return self.runner.sleep

    @sleep.setter
    def sleep(self, sleep: Callable[[float], None]) -> None:
        self.runner.sleep = sleep

    @property
    def namespace(self) -> str:
        """The coordination store's id, part of this job's staging names: read once,
        unless the caller knows it (a commit: the one its write's tasks named their
        staging with)."""
        if not self._namespace:
            self._namespace = self.registry.namespace()
        return self._namespace

    @namespace.setter
    def namespace(self, namespace: str) -> None:
        self._namespace = namespace

    @property
    def prefix(self) -> str:
        return staging_prefix(self.job, self.namespace)

    # -- start-up -------------------------------------------------------------------

    def begin(
        self,
        owner: str | None = None,
        *,
        meta: JobMeta | Mapping[str, Any] | None = None,
        keep: set[str] | frozenset[str] = frozenset(),
    ) -> Epoch:
        """Take a new writer epoch (fencing any older writer) and recover the job.

        ``keep``: staging tables of a batch in flight that recovery must not roll back.
        """
        self.registry.ensure_job(self.job, JobMeta() if meta is None else meta)
        epoch = self.registry.take_epoch(self.job, owner or default_owner())
        self.registry.heartbeat(epoch, {"state": "recovering"})
        report = self.last_recovery = self.recover(epoch, keep=keep)
        if report.alarms:
            raise RecoveryAlarm(
                f"job {self.job}: recovery needs an operator: {'; '.join(report.alarms)}. "
                f"Inspect with `txsink status --job {self.job}`, then "
                f"`txsink recover --job {self.job}`."
            )
        # inside its first commit: it declares how often it beats until that commit ends
        # (publish waits beat; txsink.ops.liveness judges it by this, not by a cadence)
        self.registry.heartbeat(epoch, self.runner.bounds.promise("running"))
        return epoch

    # -- one batch ------------------------------------------------------------------

    def commit_batch(
        self,
        epoch: Epoch,
        xid: str,
        batch: int | None,
        target: str,
        parts: Sequence[StagedPart],
        mode: Mode = Mode.ATTACH,
        *,
        streaming: bool = False,
        tables: Sequence[str] = (),
        visibility: Visibility = Visibility.PARTITION,
        own_batches: bool = False,
        first_batch: int | None = None,
        gather: Gather | None = None,
        synced: bool = False,
        seen: tuple[XidRecord | None, Ledger] | None = None,
    ) -> CommitResult:
        """Prepare and publish one batch whose tasks all succeeded.

        ``streaming``: the batch id is a Spark micro-batch id (replays only ever repeat the
        newest batch), not a ``txn_version``; ``own_batches``/``first_batch``: whether a
        job that committed nothing checks that the batch is its own; see
        :func:`plans.decide_batch`.

        Several tables in one xid: ``target`` is the job's own table and each part names
        its table in ``StagedPart.target`` (normalised to ``""`` when it is ``target``, so
        the manifest stays small); ``tables`` lists every table written. ``gather``: the
        tables (with their stored columns) whose batch a fresh ``visibility=batch``
        publish gathers into one part per partition
        (:func:`txsink.protocol.visibility.compaction`). ``synced``:
        the caller synced this registry's session since the batch began (its epoch read),
        so the decisive reads need no sync of their own; ``seen``: the xid's record and
        the ledger as the caller read them after that sync (no reads of their own)."""
        started = self.clock()
        parts = [replace(p, target="") if p.target == target else p for p in parts]
        incoming = XidRecord(
            job=self.job,
            xid=xid,
            batch=batch,
            state=XidState.PREPARED,
            epoch=epoch.number,
            mode=mode,
            target=target,
            manifest=tuple(p for p in parts if p.rows > 0),
            created_at=started,
            tables=tuple(tables),
            visibility=visibility,
        )
        # Decisive reads (skip, roll forward, refuse, drop strays): synced, so a lagging
        # Keeper server cannot show a record as it was before another runner moved it.
        if not synced:
            self.registry.sync(self.job)
        if seen is None:
            seen = self.registry.get(self.job, xid), self.registry.ledger(self.job)
        existing, last_batch = seen[0], seen[1].last_batch

        def decide(existing: XidRecord | None) -> plans.BatchDecision:
            return plans.decide_batch(
                existing, incoming, last_batch, streaming=streaming, epoch=epoch.number,
                own_batches=own_batches, first_batch=first_batch,
            )  # fmt: skip

        decision = decide(existing)
        if decision.action is plans.BatchAction.PREPARE and mode is Mode.DEDUP:
            mark = discarded(self.registry, self.job, xid)
            gone = rules.discarded_batch(self.job, xid, target, mark, streaming=streaming)
            if gone.verdict is rules.TaskVerdict.SKIP:  # its tasks skipped: Spark moves on
                log.warning("%s", gone.reason)
                self._rest(epoch, streaming=streaming)
                return CommitResult(xid, "discarded", seconds=self.clock() - started)
            if gone.verdict is rules.TaskVerdict.REFUSE:
                raise DiscardedBatch(gone.reason)
            self._check_dedup_coverage(xid, parts)
        if decision.action is plans.BatchAction.PREPARE:
            self.fault("driver.before_prepare")
            try:
                record = self._prepare(epoch, incoming)
            except XidExists as exc:
                existing = exc.existing
                decision = decide(existing)
            except UnavailableError as exc:
                raise CommitOutcomeUnknown(
                    f"job {self.job}: preparing xid {xid} failed with an unknown outcome ({exc}); "
                    f"the batch will be rolled forward or back on restart or by `txsink recover "
                    f"--job {self.job}`"
                ) from exc
            else:
                self.fault("driver.after_prepare")
        prepared_at = self.clock()
        if decision.drop:
            self.roll_back(xid, decision.drop)
        if decision.action is plans.BatchAction.REFUSE:
            self._check_fence(epoch)  # a superseded writer hears FencedError first
            if decision.retry:
                raise RetryableConflict(f"job {self.job}: {decision.reason}")
            raise ConfigError(f"job {self.job}: {decision.reason}")
        if decision.action is plans.BatchAction.SKIP:
            log.info("job %s: %s; replay is a no-op", self.job, decision.reason)
            if existing is not None and existing.mode is Mode.DEDUP:
                self.forget_dedup_state(xid)  # a crash may have come before the cleanup
            self._rest(epoch, streaming=streaming)
            return CommitResult(xid, "skipped", seconds=self.clock() - started)
        if decision.action is plans.BatchAction.ROLL_FORWARD:
            assert existing is not None
            log.warning("job %s: %s", self.job, decision.reason)
            record = existing
        fresh = decision.action is plans.BatchAction.PREPARE
        rest = self._resting(record, streaming=streaming)
        done = self.publish(
            epoch, record, resumed=not fresh, gather=gather if fresh else None, rest=rest
        )
        action = "committed" if decision.action is plans.BatchAction.PREPARE else "rolled_forward"
        finished = self.clock()
        self._after_commit(epoch, done, rest=None if self.runner.rested else rest)
        return CommitResult(
            xid,
            action,
            rows=done.rows,
            partitions=len(done.ledger_rows()),
            seconds=finished - started,
            timings={"prepare": prepared_at - started, "publish": finished - prepared_at},
        )

    def publish(
        self,
        epoch: Epoch,
        record: XidRecord,
        *,
        resumed: bool = True,
        gather: Gather | None = None,
        rest: Mapping[str, Any] | None = None,
    ) -> XidRecord:
        """Finish ``record`` (:func:`sequence.finish`), re-observed after ClickHouse
        failures whose outcome is unknown; ``rest``: the owner's facts, written with
        COMMITTED (:meth:`StepRunner.run`).

        A MOVE (or ATTACH) whose reply was lost may have landed, may still be running on
        the server, or may have been cut by a server crash; repeating it blindly could
        publish rows twice. So a resumed publish (the record existed before: an earlier
        attempt, a crashed writer, a superseded one may have a statement in flight) and
        every re-run after such a failure is a fresh :func:`sequence.publish_attempt`: it
        waits until the server answers and no statement on this xid's staging is
        running, checks that this writer still holds the job, re-reads the record, and
        only then plans the whole publish again as a resumed one (part UUIDs decide what
        landed). Busy answers (nothing happened) are re-planned the same way, with a
        doubling pause (tenacity). If the server is not seen quiet within
        ``publish_retry_s`` seconds, the last error is raised and nothing more is sent:
        the xid stays as it is and the next commit or ``txsink recover`` finishes it."""
        bounds = self.runner.bounds
        deadline = time.monotonic() + bounds.retry_s
        failure: TxSinkError | None = None

        def attempt() -> XidRecord:
            nonlocal failure, resumed
            steps = sequence.publish_attempt(
                record, self.prefix, bounds, resumed=resumed, after_failure=failure is not None,
                gather=gather,
            )  # fmt: skip
            try:
                return self.runner.run(
                    epoch, steps, deadline=deadline, failure=failure, xid=record.xid, rest=rest
                )
            except (UnavailableError, RetryableConflict) as exc:
                failure, resumed = exc, True
                raise

        def pause(state: tenacity.RetryCallState) -> float:
            doubling: float = bounds.pause_s * 2.0 ** (state.attempt_number - 1)
            return min(doubling, bounds.max_pause_s, max(0.0, deadline - time.monotonic()))

        def warn(_state: tenacity.RetryCallState) -> None:
            log.warning(
                "job %s: xid %s: publishing failed with an unknown outcome (%s); "
                "re-observing before going on",
                self.job, record.xid, failure,
            )  # fmt: skip

        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception_type((UnavailableError, RetryableConflict)),
            stop=lambda _state: time.monotonic() >= deadline,
            wait=pause,
            sleep=self.sleep,
            before_sleep=warn,
            reraise=True,
        )
        try:  # every way out of here asks Keeper whether the xid is COMMITTED already
            done: XidRecord = retrying(attempt)
        except TxSinkError as exc:
            return self._committed_anyway(record, exc)
        return done

    def _committed_anyway(self, record: XidRecord, exc: TxSinkError) -> XidRecord:
        """The record, if Keeper says the publish that failed with ``exc`` had already
        recorded it COMMITTED (what failed was dropping its staging, a leftover that
        recovery drops); else ``exc`` is raised. A commit reported failed after COMMITTED
        would make a caller re-running a save without ``txn_version`` write it twice."""
        try:
            self.registry.sync(self.job)  # another runner may have recorded it
            now = self.registry.get(self.job, record.xid)
        except TxSinkError:
            now = None
        if now is None or now.state is not XidState.COMMITTED:
            raise exc
        log.warning(
            "job %s: xid %s is committed; cleaning up its staging failed (%s): `txsink "
            "recover` or the job's next run drops what is left",
            self.job, record.xid, exc,
        )  # fmt: skip
        return now

    def finish(self, epoch: Epoch, record: XidRecord, *, resumed: bool = True) -> XidRecord:
        """Run the publish plan of a PREPARED (or COMMITTED) record to its end, once
        (:func:`sequence.finish`; :meth:`publish` re-observes after failures)."""
        steps = sequence.finish(record, self.prefix, self.runner.bounds, resumed=resumed)
        deadline = time.monotonic() + self.runner.bounds.retry_s
        return self.runner.run(epoch, steps, deadline=deadline, xid=record.xid)

    def batch_tables(self, record: XidRecord) -> dict[str, str]:
        """Target -> batch staging table of a ``visibility=batch`` record, under the name
        a finisher claimed it with if one did (:func:`sequence.batch_tables`)."""
        tables: dict[str, str] = self.runner.drive(sequence.batch_tables(record, self.prefix))[0]
        return tables

    def _prepare(self, epoch: Epoch, record: XidRecord) -> XidRecord:
        """The prepare of ``record``; an attach one proves in the same Keeper transaction
        that the xid has no dedup state (:meth:`_refuse_dedup_leftovers`)."""
        if record.mode is not Mode.ATTACH:
            return self.registry.prepare(epoch, record)
        key = dedup_xid_key(record.xid)
        for _ in range(MAX_CAS_ROUNDS):
            try:
                return self.registry.prepare(epoch, record, unless_blob=key)
            except BlobPresent:
                self._refuse_dedup_leftovers(record.xid)  # (gone meanwhile: prove again)
        raise RetryableConflict(
            f"job {self.job}: xid {record.xid}: its dedup state kept appearing and vanishing"
        )

    def _refuse_dedup_leftovers(self, xid: str) -> None:
        """An attach prepare of an xid that has dedup state: some of its rows were
        inserted straight into the target in dedup mode (the job's mode changed while a
        dedup task ran). Staging them again would duplicate them."""
        if self.registry.blob_children(self.job, dedup_xid_key(xid)):
            raise ConfigError(
                f"job {self.job}: xid {xid} has dedup-mode state (dedup/{xid}): part of it may "
                f"already be in the target. Nothing was published. Finish it in dedup mode "
                f"(`txsink mode --job {self.job} --set dedup`, restart until it commits), then "
                f"switch back"
            )

    def _check_dedup_coverage(self, xid: str, parts: Sequence[StagedPart]) -> None:
        """A dedup batch commits only if every Spark partition with a record came back:
        a rerun over fewer partitions would otherwise commit, and the cleanup would then
        erase the record of rows the missing partitions already sent."""
        names = self.registry.blob_children(self.job, dedup_xid_key(xid))
        recorded = {n[1:] for n in names if n.startswith("p") and n[1:].isdigit()}
        why = rules.dedup_coverage_refusal(
            self.job, xid, recorded, {p.partition_id for p in parts if p.rows > 0}
        )
        if why is not None:
            raise ContentChanged(why)

    def _check_fence(self, epoch: Epoch) -> None:
        """FencedError unless ``epoch`` still holds the job (synced)."""
        self.runner.check_fence(epoch)

    def roll_back(self, xid: str, tables: Sequence[str]) -> list[str]:
        """Drop staging ``tables`` of ``xid`` that no record can ever need; returns them.

        An ABORTED tombstone is written on the xid node first: Keeper then orders this
        roll-back against every prepare of the xid (one whose reply was lost, a paused
        zombie's, one a lagging read did not show), and only tables the node's final
        state leaves to us are dropped (:func:`plans.droppable`).
        """
        if not tables:
            return []
        # The tombstone's create / compare-and-set orders the roll-back whatever abort()
        # read first; synced so that first read rarely has to be paid for with a write.
        self.registry.sync(self.job)
        record = self.registry.abort(self.job, xid, tables, self.clock())
        doomed = plans.droppable(record, tables)
        kept = sorted(set(tables) - set(doomed))
        if kept:  # a COMMITTED record's own staging is its publish's to drop: no news
            log.log(
                logging.INFO if record is not None and record.state is XidState.COMMITTED
                else logging.WARNING,
                "job %s: xid %s is %s; not dropping its staging %s",
                self.job, xid, record.state if record is not None else "unknown", kept,
            )  # fmt: skip
        for table in doomed:
            self.warehouse.drop_staging(table)
        return list(doomed)

    def roll_back_tables(self, tables: Sequence[str]) -> list[str]:
        """:meth:`roll_back` for staging of any xids (grouped by the xid in the name)."""
        by_xid: dict[str, list[str]] = {}
        for table in tables:
            parsed = parse_staging(table)
            if parsed is not None:
                by_xid.setdefault(parsed.xid, []).append(table)
        dropped: list[str] = []
        for xid, group in by_xid.items():
            dropped += self.roll_back(xid, group)
        return dropped

    def _resting(self, record: XidRecord, *, streaming: bool) -> dict[str, Any]:
        """The owner's facts once ``record`` is committed: between batches a stream is
        idle (judged by its commit cadence); a batch write is finished: nothing of it is
        in flight any more. The wait it declares holds for its next commit too."""
        return {
            "state": IDLE_STATE if streaming else FINISHED_STATE,
            "last_xid": record.xid,
            "last_batch": record.batch,
            WAIT_KEY: self.runner.bounds.statement_s,
        }

    def _after_commit(
        self, epoch: Epoch, record: XidRecord, *, rest: Mapping[str, Any] | None
    ) -> None:
        """``rest``: the owner's facts if the commit did not write them already."""
        if record.mode is Mode.DEDUP:
            self.forget_dedup_state(record.xid)
        if rest is not None:
            self.registry.heartbeat(epoch, rest)
        if record.batch is not None and record.batch % 50 == 0:
            self.prune(epoch)
            try:  # a server killed during a gather's CREATE left its fill behind
                self.warehouse.drop_leftover_fills(LEFTOVER_FILL_S)
            except TxSinkError as exc:
                log.warning("job %s: leftover fills not swept: %s", self.job, exc)

    def _rest(self, epoch: Epoch, *, streaming: bool) -> None:
        """A commit that published nothing (a replay skipped, a discarded batch) still
        ends the writer's promise to beat: the owner rests as after a commit."""
        try:
            self.registry.heartbeat(epoch, {"state": IDLE_STATE if streaming else FINISHED_STATE})
        except TxSinkError as exc:  # only a verdict's patience depends on it; a fenced
            # writer hears FencedError at its next prepare, as it would have before
            log.info("job %s: resting heartbeat not written: %s", self.job, exc)

    def prune(self, epoch: Epoch) -> list[str]:
        records = self.registry.list(self.job)
        doomed = plans.plan_prune(records, self.retention, now=self.clock())
        dedup_xids = {r.xid for r in records if r.mode is Mode.DEDUP}
        kept = []
        for xid in doomed:
            if xid in dedup_xids:  # normally gone already; left by a crash after COMMITTED
                # first, and strictly: dedup state without its COMMITTED record would read
                # as a batch stopped half-way (rules.is_open_dedup) and fence the job
                try:
                    self.registry.delete_blobs(self.job, dedup_xid_key(xid))
                except TxSinkError as exc:
                    log.warning("job %s: keeping xid %s for now: %s", self.job, xid, exc)
                    kept.append(xid)
        doomed = [x for x in doomed if x not in kept]
        if doomed:
            self.registry.delete(epoch, doomed)
        return doomed

    def forget_dedup_state(self, xid: str) -> None:
        """Delete ``dedup/<xid>`` (per-partition BEFORE/AFTER) of a COMMITTED dedup xid.

        Best effort: a replay of a committed xid is skipped by the xid record, not by this
        state; what a failed delete leaves is retried at the next skip, recovery or prune.
        """
        try:
            self.registry.delete_blobs(self.job, dedup_xid_key(xid))
        except TxSinkError as exc:
            log.warning("job %s: could not delete dedup state of xid %s: %s", self.job, xid, exc)

    # -- recovery -------------------------------------------------------------------

    def recover(
        self,
        epoch: Epoch,
        *,
        dry_run: bool = False,
        keep: set[str] | frozenset[str] = frozenset(),
    ) -> RecoveryReport:
        """Roll PREPARED xids forward and drop staging no PREPARED xid references."""
        self.registry.sync(self.job)  # the listing decides every roll-forward and drop
        records = self.registry.list(self.job)
        tables = [t for t in self.warehouse.list_staging(self.prefix) if t not in keep]
        plan = plans.plan_recovery(self.job, records, tables, self.namespace)
        report = RecoveryReport(self.job, epoch.number, dry_run)
        report.rolled_forward = [r.xid for r in plan.roll_forward]
        report.rolled_back = list(plan.roll_back)
        report.dropped_leftovers = list(plan.drop_committed)
        if dry_run:
            return report
        for record in plan.roll_forward:
            try:
                self.publish(epoch, record)
                log.warning("job %s: rolled xid %s forward", self.job, record.xid)
                if record.mode is Mode.DEDUP:
                    self.forget_dedup_state(record.xid)
            except RecoveryAlarm as exc:
                report.alarms.append(str(exc))
        report.rolled_back = self.roll_back_tables(plan.roll_back)
        for table in plan.drop_committed:
            self.warehouse.drop_staging(table)
            log.info("job %s: dropped staging %s", self.job, table)
        report.pruned = self.prune(epoch)
        return report
