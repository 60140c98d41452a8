"""The commit steps of the runner (:class:`~txsink.publisher.StepRunner` inherits them):
it carries out what a commit, takeover, recovery, roll-back or prune sequence yields
(:mod:`txsink.protocol.commit`) against the Registry and the Warehouse, including the
publish's re-observing retries (tenacity) and the prepare's compare-and-set.

Owned by the runner, like :mod:`txsink.publisher`: every effect, no decision. A step that
writes for a writer (prepare, publish, heartbeat, delete) is fenced by the epoch the
sequence runs under; a TakeEpoch's answer becomes that epoch for what follows.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Generator, Mapping
from typing import Any, cast

import tenacity

from txsink.dedup_state import DISCARDED
from txsink.errors import (
    CommitOutcomeUnknown,
    ConfigError,
    RecoveryAlarm,
    RetryableConflict,
    TxSinkError,
    UnavailableError,
)
from txsink.ports.cas import MAX_CAS_ROUNDS
from txsink.ports.registry import BlobPresent, Registry, XidExists
from txsink.ports.warehouse import Warehouse
from txsink.protocol import ops, sequence, steps
from txsink.protocol.dedup import xid_key as dedup_xid_key
from txsink.protocol.states import Epoch, Mode, XidRecord, XidState

log = logging.getLogger("txsink.publisher")  # one runner, one logger
# a fill of a batch staging (its CREATE ... AS SELECT) older than this runs no more
LEFTOVER_FILL_S = 3600.0


class CommitSteps:
    """What :class:`~txsink.publisher.StepRunner` does with a commit sequence's steps."""

    registry: Registry
    warehouse: Warehouse
    job: str
    prefix: Callable[[], str]
    bounds: steps.PublishBounds
    clock: Callable[[], float]
    sleep: Callable[[float], None]
    rested: bool

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
        raise NotImplementedError

    def act(
        self, epoch: Epoch, step: steps.Step, deadline: float, failure: TxSinkError | None
    ) -> Any:
        raise NotImplementedError

    def check_fence(self, epoch: Epoch) -> None:
        raise NotImplementedError

    def run_commit(
        self, epoch: Epoch | None, sequence: Generator[steps.CommitStep, Any, Any]
    ) -> tuple[Any, dict[str, float]]:
        """Drive a commit, roll-back or prune sequence to its end: its return value, and
        the times (clock) of its :class:`~txsink.protocol.steps.Mark` steps. ``epoch``:
        the writer's, for the fenced writes (None: a roll-back, fenced by its tombstone)."""
        marks: dict[str, float] = {}
        reply: Any = None
        try:
            while True:
                try:
                    step = sequence.send(reply)
                except StopIteration as done:
                    return done.value, marks
                reply = self.commit_act(epoch, step, marks)
                if isinstance(step, steps.TakeEpoch):
                    epoch = reply  # the new writer's: it fences what follows
        finally:
            sequence.close()

    def commit_act(
        self, epoch: Epoch | None, step: steps.CommitStep, marks: dict[str, float]
    ) -> Any:
        """Carry out one step of a commit sequence; what the sequence receives back."""
        reg, job = self.registry, self.job

        def need() -> Epoch:  # the fenced steps' epoch
            if epoch is None:
                raise TypeError(f"{type(step).__name__} needs the writer's epoch")
            return epoch

        if isinstance(step, steps.Sync):
            reg.sync(job)
        elif isinstance(step, steps.ReadBatchState):
            return reg.get(job, step.xid), reg.ledger(job).last_batch
        elif isinstance(step, steps.ReadDiscarded):
            return reg.get_blob(job, f"{dedup_xid_key(step.xid)}/{DISCARDED}")
        elif isinstance(step, steps.ReadDedupRecords):
            return reg.blob_children(job, dedup_xid_key(step.xid))
        elif isinstance(step, steps.Prepare):
            return self.prepare(need(), step.record)
        elif isinstance(step, steps.Abort):
            return reg.abort(job, step.xid, step.tables, self.clock())
        elif isinstance(step, steps.PublishXid):
            try:
                done = self.publish(
                    need(), step.record, resumed=step.resumed, gather=step.gather, rest=step.rest
                )
            except RecoveryAlarm as exc:
                if not step.alarms:
                    raise
                return steps.Alarmed(str(exc))
            return done, self.rested
        elif isinstance(step, steps.EnsureJob):
            return reg.ensure_job(job, step.meta)
        elif isinstance(step, steps.ReadEpoch):
            return reg.current_epoch(job)
        elif isinstance(step, steps.ReadRunMark):
            return reg.get_blob(job, f"runs/{step.run_id}")
        elif isinstance(step, steps.PutRunMark):
            reg.put_blob(job, f"runs/{step.run_id}", {"started_at": self.clock()})
        elif isinstance(step, steps.ReadCommittedCount):
            return reg.ledger(job).committed
        elif isinstance(step, steps.TakeEpoch):
            return reg.take_epoch(job, step.owner)
        elif isinstance(step, steps.Heartbeat):
            try:
                reg.heartbeat(need(), step.facts)
            except TxSinkError as exc:
                if not step.best_effort:
                    raise  # only a verdict's patience depends on a resting beat: logged
                log.info("job %s: resting heartbeat not written: %s", job, exc)
        elif isinstance(step, steps.ForgetDedupState):
            try:  # best effort: a replay is skipped by the record, not by this state
                reg.delete_blobs(job, dedup_xid_key(step.xid))
            except TxSinkError as exc:
                log.warning(
                    "job %s: could not delete dedup state of xid %s: %s", job, step.xid, exc
                )
                return False
            return True
        elif isinstance(step, steps.ListRecords):
            return reg.list(job), self.clock()
        elif isinstance(step, steps.DeleteRecords):
            reg.delete(need(), list(step.xids))
        elif isinstance(step, steps.DropLeftoverFills):
            try:  # a server killed during a gathered CREATE left its fill behind
                self.warehouse.drop_leftover_fills(LEFTOVER_FILL_S)
            except TxSinkError as exc:
                log.warning("job %s: leftover fills not swept: %s", job, exc)
        elif isinstance(step, steps.Note):
            log.log(logging.INFO if step.level == "info" else logging.WARNING,
                    "job %s: %s", job, step.message)  # fmt: skip
        elif isinstance(step, steps.Mark):
            marks[step.name] = self.clock()
        elif isinstance(step, steps.CheckFence):
            self.check_fence(need())
        else:  # a drop, a fault point, a stop: as in a publish (no epoch needed)
            return self.act(cast(Epoch, epoch), step, time.monotonic(), None)
        return None

    def prepare(self, epoch: Epoch, record: XidRecord) -> XidRecord | steps.Taken:
        """Write ``record`` PREPARED; :class:`~txsink.protocol.steps.Taken` if the xid's
        node exists. An attach prepare proves in the same Keeper transaction that the xid
        has no dedup state: some of its rows would be in the target already (the job's
        mode changed while a dedup task ran), staging them again would duplicate them."""
        key = dedup_xid_key(record.xid)
        try:
            if record.mode is not Mode.ATTACH:
                return self.registry.prepare(epoch, record)
            for _ in range(MAX_CAS_ROUNDS):
                try:
                    return self.registry.prepare(epoch, record, unless_blob=key)
                except BlobPresent:  # (gone meanwhile: prove again)
                    if self.registry.blob_children(self.job, key):
                        raise ConfigError(
                            f"job {self.job}: xid {record.xid} has dedup-mode state "
                            f"(dedup/{record.xid}): part of it may already be in the target. "
                            f"Nothing was published. Finish it in dedup mode (`txsink mode "
                            f"--job {self.job} --set dedup`, restart until it commits), then "
                            f"switch back"
                        ) from None
        except XidExists as exc:
            return steps.Taken(exc.existing)
        except UnavailableError as exc:
            raise CommitOutcomeUnknown(
                f"job {self.job}: preparing xid {record.xid} failed with an unknown outcome "
                f"({exc}); the batch will be rolled forward or back on restart or by "
                f"`txsink recover --job {self.job}`"
            ) from exc
        raise RetryableConflict(
            f"job {self.job}: xid {record.xid}: its dedup state kept appearing and vanishing"
        )

    def publish(
        self,
        epoch: Epoch,
        record: XidRecord,
        *,
        resumed: bool = True,
        gather: ops.Gather | None = None,
        rest: Mapping[str, Any] | None = None,
    ) -> XidRecord:
        """Finish ``record`` (:func:`sequence.publish_attempt`), re-observed after
        ClickHouse failures whose outcome is unknown; ``rest``: the owner's facts,
        written with COMMITTED (:meth:`run`).

        A MOVE (or ATTACH) whose reply was lost may have landed, may still be running on
        the server, or may have been cut by a server crash; repeating it blindly could
        publish rows twice. So a resumed publish (the record existed before: an earlier
        attempt, a crashed writer, a superseded one may have a statement in flight) and
        every re-run after such a failure is a fresh attempt: it waits until the server
        answers and no statement on this xid's staging is running, checks that this
        writer still holds the job, re-reads the record, and only then plans the whole
        publish again as a resumed one (part UUIDs decide what landed). Busy answers
        (nothing happened) are re-planned the same way, with a doubling pause
        (tenacity). If the server is not seen quiet within ``publish_retry_s`` seconds,
        the last error is raised and nothing more is sent: the xid stays as it is and the
        next commit or ``txsink recover`` finishes it."""
        bounds = self.bounds
        deadline = time.monotonic() + bounds.retry_s
        failure: TxSinkError | None = None

        def attempt() -> XidRecord:
            nonlocal failure, resumed
            plan = sequence.publish_attempt(
                record, self.prefix(), bounds, resumed=resumed,
                after_failure=failure is not None, gather=gather,
            )  # fmt: skip
            try:
                return self.run(
                    epoch, plan, deadline=deadline, failure=failure, xid=record.xid, rest=rest
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
