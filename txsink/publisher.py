"""The runner of publish sequences: carries out each step a protocol generator yields
(:mod:`txsink.protocol.sequence`) against the Registry and the Warehouse, and sends the
result back.

This module owns every effect of a publish and nothing of its decisions: the Keeper
writes (fenced), the ClickHouse statements, the waits (tenacity, with an injectable
sleep), the fault points, the errors a :class:`~txsink.protocol.steps.Stop` maps to, and
the one piece of memory a runner keeps across sequences: the batch staging tables it
claimed (renamed to a name of its own) and has not attached from yet.

Invariants:
- a step's failure propagates and the generator is closed, never resumed: the caller
  starts a fresh sequence, which re-observes (a lost reply is never answered by a guess);
- a claim serves one ATTACH: it is forgotten before the ATTACH is sent, so one whose
  outcome is unknown is never followed by a second from the same name.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import Callable, Generator, Mapping
from typing import Any, assert_never

import tenacity

from txsink.commit_runner import CommitSteps
from txsink.errors import (
    CommitOutcomeUnknown,
    ConfigError,
    ContentChanged,
    DiscardedBatch,
    FencedError,
    RecoveryAlarm,
    RetryableConflict,
    TxSinkError,
    UnavailableError,
)
from txsink.ports.registry import Registry
from txsink.ports.warehouse import Warehouse
from txsink.protocol import ops, steps
from txsink.protocol.ids import batch_claim_name, parse_staging
from txsink.protocol.states import Cut, Epoch, XidRecord, XidState

log = logging.getLogger(__name__)

_FAILURES: dict[steps.Failure, type[TxSinkError]] = {
    steps.Failure.ALARM: RecoveryAlarm,
    steps.Failure.UNAVAILABLE: UnavailableError,
    steps.Failure.NOT_QUIET: UnavailableError,
    steps.Failure.CONFLICT: RetryableConflict,
    steps.Failure.CONFIG: ConfigError,
    steps.Failure.DISCARDED: DiscardedBatch,
    steps.Failure.CONTENT_CHANGED: ContentChanged,
    steps.Failure.FENCED: FencedError,
}


class StepRunner(CommitSteps):
    """Carries out publish steps for one job (one per :class:`~txsink.transactor.Transactor`)."""

    def __init__(
        self,
        registry: Registry,
        warehouse: Warehouse,
        job: str,
        prefix: Callable[[], str],
        *,
        bounds: steps.PublishBounds,
        clock: Callable[[], float],
        fault: Callable[[str], None],
        sleep: Callable[[float], None],
    ) -> None:
        self.registry = registry
        self.warehouse = warehouse
        self.job = job
        self.prefix = prefix
        self.bounds = bounds
        self.clock = clock
        self.fault = fault
        self.sleep = sleep
        # (xid, target) -> the name this runner renamed that batch staging table to
        self.claims: dict[tuple[str, str], str] = {}
        self._beat_at = float("-inf")  # when (clock) a publish last beat
        # the owner's facts once the running publish is recorded COMMITTED (written by
        # the same Keeper transaction), and whether that write went out
        self._rest: Mapping[str, Any] | None = None
        self.rested = False

    def run(
        self,
        epoch: Epoch,
        sequence: steps.Run,
        *,
        deadline: float,
        failure: TxSinkError | None = None,
        xid: str = "",
        rest: Mapping[str, Any] | None = None,
    ) -> XidRecord:
        """Drive ``sequence`` to its end; its return value. ``deadline`` (monotonic) bounds
        the waits for a quiet server; ``failure``: the error that made the caller look
        again (raised instead when the server is not seen quiet); ``xid``: the one it
        publishes (named in the beats of a long publish); ``rest``: the owner's facts
        once the record is COMMITTED, written with it (:attr:`rested` says whether)."""
        reply: Any = None
        self._rest, self.rested = rest, False
        self._beat_at = self.clock()  # the xid's PREPARE (or the last beat) is as fresh
        try:
            while True:
                try:
                    step = sequence.send(reply)
                except StopIteration as done:
                    record: XidRecord = done.value
                    return record
                self._beat_between(epoch, step, xid)
                reply = self.act(epoch, step, deadline, failure)
        finally:
            sequence.close()

    def _beat_between(self, epoch: Epoch, step: steps.Step, xid: str) -> None:
        """Beat (state ``publishing``) before a statement once ``heartbeat_s`` passed
        since the last: a long publish (many MOVEs, each up to ``statement_s``) never
        goes longer than one statement plus a beat without one. A commit that takes less
        than ``heartbeat_s`` writes none (its PREPARE shows it alive)."""
        if isinstance(step, (steps.Stop, steps.FaultPoint, steps.Settle)) or self.rested:
            return  # (rested: the owner's facts after COMMITTED are written; they stand)
        if self.clock() - self._beat_at <= self.bounds.heartbeat_s:
            return
        self._beat_at = self.clock()
        with contextlib.suppress(TxSinkError):  # a missed beat is only late
            self.registry.heartbeat(epoch, self.bounds.promise("publishing", xid=xid))

    def _own_or_unclaimed(self, batch_staging: str, action: str) -> None:
        """A batch staging is built only under the name no finisher attaches from, or
        under one this runner holds: never under another finisher's name (its holder
        may be about to ATTACH from it)."""
        name = parse_staging(batch_staging)
        if name is not None and name.claim and batch_staging not in self.claims.values():
            raise RetryableConflict(
                f"job {self.job}: not going to {action} batch staging {batch_staging}: "
                f"another finisher's name; re-observing"
            )

    @staticmethod
    def _xid_of(batch_staging: str) -> str:
        name = parse_staging(batch_staging)
        if name is None:
            raise ValueError(f"{batch_staging} is not a staging table name")
        return name.xid

    def drive(self, sequence: Generator[steps.Step, Any, Any]) -> Any:
        """Drive a sequence of observations only (no epoch, no waits); its return value."""
        reply: Any = None
        while True:
            try:
                step = sequence.send(reply)
            except StopIteration as done:
                return done.value
            reply = self.observe(step)

    def act(
        self, epoch: Epoch, step: steps.Step, deadline: float, failure: TxSinkError | None
    ) -> Any:
        """Carry out one step; what the sequence receives back."""
        wh = self.warehouse
        if isinstance(step, steps.Stop):
            if step.failure is steps.Failure.NOT_QUIET and failure is not None:
                raise failure
            raise self.stopped(step)
        if isinstance(step, steps.FaultPoint):
            self.fault(step.name)
        elif isinstance(step, steps.Settle):
            until = time.monotonic() + self.bounds.retry_s if step.fresh else deadline
            return self.settle(epoch, step.xid, step.needles, until)
        elif isinstance(step, steps.CheckFence):
            self.check_fence(epoch)
        elif isinstance(step, steps.ReadRecord):
            return self.registry.get(self.job, step.xid)
        elif isinstance(step, steps.MovePartitions):
            wh.move_partitions(step.staging, step.partition_ids, step.target)
        elif isinstance(step, steps.DropTables):
            wh.drop_stagings(step.tables, wait=step.wait)
        elif isinstance(step, ops.Consolidate):
            wh.consolidate(step.staging, step.partition_id, step.batch_staging)
        elif isinstance(step, ops.CopyIntoBatch):
            self._own_or_unclaimed(step.batch_staging, "copy into")
            wh.copy_into_batch(step.batch_staging, step.sources)
        elif isinstance(step, ops.GatherBatch):
            self._own_or_unclaimed(step.batch_staging, "gather into")
            wh.gather_into_batch(step.batch_staging, step.tables, step.columns, step.rows)
        elif isinstance(step, ops.CreateGathered):  # created held, as below
            name = batch_claim_name(step.table, uuid.uuid4().hex)
            self.claims[(step.xid, step.claimed)] = name
            wh.gather_into_batch(name, step.tables, step.columns, step.rows, create=step.shape)
            return name
        elif isinstance(step, ops.CreateBatchStaging):
            name = step.table
            if step.claimed:  # created held: no other finisher attaches from this name
                name = batch_claim_name(step.table, uuid.uuid4().hex)
                self.claims[(self._xid_of(step.table), step.claimed)] = name
            else:
                self._own_or_unclaimed(name, "create")
            wh.create_batch_staging(name, step.like, step.target)
            return name
        elif isinstance(step, ops.ClaimBatch):
            claimed = batch_claim_name(step.batch_staging, uuid.uuid4().hex)
            wh.claim_staging(step.batch_staging, claimed)
            self.claims[(step.xid, step.target)] = claimed
            return claimed
        elif isinstance(step, steps.Attach):
            self.claims.pop((step.xid, step.target), None)
            wh.attach_all(step.batch_staging, step.target, step.tag)
        elif isinstance(step, steps.SealRow):
            wh.seal_dedup(step.tag)
        elif isinstance(step, ops.DropParts):
            wh.drop_parts(step.staging, step.partition_id, step.evidence)
        elif isinstance(step, steps.Write):
            return self.write(epoch, step.record, step.op)
        elif isinstance(step, ops.Evidence):
            if step.kind not in ("uuid", "cut"):
                log.warning(
                    "job %s: xid %s: partition %s of %s has no rows left; counted as "
                    "published on %s evidence (docs/operations.md#evidence-of-publish)",
                    self.job, step.xid, step.partition_id, step.staging, step.kind,
                )  # fmt: skip
        else:
            return self.observe(step)
        return None

    def observe(self, step: steps.Step) -> Any:
        """Answer one observation step."""
        wh = self.warehouse
        if isinstance(step, steps.ListStaging):
            return wh.list_staging(step.prefix)
        if isinstance(step, steps.ObserveStaging):
            return wh.staging_view(list(step.tables))
        if isinstance(step, steps.ObservePartRows):
            return wh.staged_part_rows(step.table)
        if isinstance(step, steps.ObserveBatchParts):
            return {p: u for p, (_, u) in wh.staged_partitions(step.table, every_part=True).items()}
        if isinstance(step, steps.ObservePublished):
            return wh.published_uuids(step.target, step.uuids)
        if isinstance(step, steps.ObserveAttachLog):
            return wh.attach_logged(step.target, step.tag, step.since)
        if isinstance(step, steps.ObserveEvidenceLife):
            life = wh.evidence_life(step.target)
            return dataclasses.replace(life, age_s=max(0.0, self.clock() - step.since))
        if isinstance(step, steps.ObserveDetached):
            return wh.detached_parts(list(step.tables))
        if isinstance(step, steps.HeldClaims):
            return {t: name for (x, t), name in self.claims.items() if x == step.xid}
        if isinstance(step, steps.Stop):
            raise self.stopped(step)
        # bare Publish / DropStaging / AttachAll / Alarm never reach a runner: the
        # sequence turns them into MovePartitions / DropTables / Attach / Stop
        raise TypeError(f"{type(step).__name__} is not a step a runner carries out")

    def write(
        self, epoch: Epoch, record: XidRecord, op: ops.RecordCut | ops.RecordCommitted
    ) -> XidRecord:
        """The Keeper write of ``op`` onto ``record`` (fenced by ``epoch``)."""
        if isinstance(op, ops.RecordCommitted):
            return self.record_committed(epoch, record)
        if isinstance(op, ops.RecordCut):
            log.warning(
                "job %s: xid %s: a server crash cut the MOVE of partition %s of %s between "
                "parts; %d of them are in the target already: recording them, dropping "
                "them from staging, moving the rest",
                self.job, record.xid, op.partition_id, op.staging, len(op.cut),
            )  # fmt: skip
            # amend merges it into the record's cuts of other partitions
            return self.registry.amend(epoch, record, [Cut(op.staging, op.partition_id, op.cut)])
        assert_never(op)

    def record_committed(self, epoch: Epoch, record: XidRecord) -> XidRecord:
        try:
            done = self.registry.commit(epoch, record, self.clock(), self._rest)
            self.rested = self._rest is not None
            return done
        except RetryableConflict:
            now = self.registry.get(self.job, record.xid)
            if now is not None and now.state is XidState.COMMITTED:
                return now  # another runner (recovery) finished it: same outcome
            raise
        except UnavailableError as exc:
            raise CommitOutcomeUnknown(
                f"job {self.job}: xid {record.xid} is published but recording COMMITTED failed "
                f"({exc}); `txsink recover --job {self.job}` will record it"
            ) from exc

    def stopped(self, step: steps.Stop) -> TxSinkError:
        """The error a :class:`~txsink.protocol.steps.Stop` ends its sequence with."""
        return _FAILURES[step.failure](
            step.message if step.bare else f"job {self.job}: {step.message}"
        )

    def check_fence(self, epoch: Epoch) -> None:
        """FencedError unless ``epoch`` still holds the job: it guards ClickHouse
        statements (MOVE, ATTACH) that no Keeper write fences, so it is never answered by
        a server that lags the leader (:meth:`Registry.fence`)."""
        self.registry.fence(epoch)

    def settle(self, epoch: Epoch, xid: str, needles: tuple[str, ...], deadline: float) -> bool:
        """Whether ClickHouse answered, before ``deadline`` (monotonic), with no statement
        running on a table whose name contains one of ``needles``. Heartbeats while it
        waits, so the writer does not read as dead."""
        beat = [float("-inf")]

        def probe() -> bool:
            try:
                if self.warehouse.settle(list(needles)):
                    return True
                log.info("job %s: xid %s: a statement on its staging still runs", self.job, xid)
            except TxSinkError as exc:  # not answering yet (or not letting us look)
                log.info("job %s: ClickHouse not settled yet: %s", self.job, exc)
            return False

        def heartbeat(_state: tenacity.RetryCallState) -> None:
            if time.monotonic() - beat[0] > self.bounds.heartbeat_s:
                beat[0] = time.monotonic()
                with contextlib.suppress(TxSinkError):  # a missed beat is only late
                    self.registry.heartbeat(epoch, self.bounds.promise("publishing", xid=xid))

        waiting = tenacity.Retrying(
            retry=tenacity.retry_if_result(lambda quiet: not quiet),
            stop=lambda _state: time.monotonic() >= deadline,
            wait=lambda _state: min(
                self.bounds.settle_pause_s, max(0.0, deadline - time.monotonic())
            ),
            sleep=self.sleep,
            before_sleep=heartbeat,
            retry_error_callback=lambda _state: False,
        )
        quiet: bool = waiting(probe)
        return quiet
