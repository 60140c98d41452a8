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
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from txsink.errors import (
    RecoveryAlarm,
)
from txsink.faults import fault_point
from txsink.ports.registry import Registry
from txsink.ports.warehouse import Warehouse
from txsink.protocol import commit, sequence, steps
from txsink.protocol.codec import (
    FINISHED_STATE,
    IDLE_STATE,
    WAIT_KEY,
    JobMeta,
    Ledger,
)
from txsink.protocol.commit import RecoveryReport
from txsink.protocol.ids import (
    staging_prefix,
)
from txsink.protocol.ops import Gather
from txsink.protocol.states import Epoch, Mode, StagedPart, Visibility, XidRecord, XidState
from txsink.protocol.steps import PublishBounds
from txsink.publisher import StepRunner

log = logging.getLogger(__name__)


@dataclass
class CommitResult:
    xid: str
    action: str  # "committed" | "rolled_forward" | "skipped"
    rows: int = 0
    partitions: int = 0
    seconds: float = 0.0
    timings: dict[str, float] = field(default_factory=dict)


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
        run = commit.take_over(
            self.job, owner or default_owner(), JobMeta() if meta is None else meta,
            namespace=self.namespace, prefix=self.prefix, keep=frozenset(keep),
            retention=self.retention, promise=self.runner.bounds.promise("running"),
        )  # fmt: skip
        taken: tuple[Epoch, RecoveryReport]
        taken, _ = self.runner.run_commit(None, run)
        self._raise_alarms(taken[1])
        return taken[0]

    def take_run(
        self,
        run_id: str,
        meta: JobMeta,
        *,
        keep: Iterable[str] = (),
        current: Epoch | None = commit.UNREAD,
    ) -> tuple[Epoch, RecoveryReport | None]:
        """The epoch of the Spark run ``run_id`` (:func:`commit.run_epoch`): its own, or
        a takeover's, with that takeover's recovery report (None: no takeover).
        ``current``: the job's epoch as the caller read it after a sync."""
        run = commit.run_epoch(
            self.job, run_id, meta, current=current, namespace=self.namespace,
            prefix=self.prefix, keep=frozenset(keep), retention=self.retention,
            promise=self.runner.bounds.promise("running"),
        )  # fmt: skip
        taken: tuple[Epoch, RecoveryReport | None]
        taken, _ = self.runner.run_commit(None, run)
        if taken[1] is not None:
            self._raise_alarms(taken[1])
        return taken

    def _raise_alarms(self, report: RecoveryReport) -> None:
        if report.alarms:
            raise RecoveryAlarm(
                f"job {self.job}: recovery needs an operator: {'; '.join(report.alarms)}. "
                f"Inspect with `txsink status --job {self.job}`, then "
                f"`txsink recover --job {self.job}`."
            )

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
        resting = IDLE_STATE if streaming else FINISHED_STATE
        ask = commit.Ask(
            incoming, streaming=streaming, own_batches=own_batches, first_batch=first_batch,
            gather=gather, synced=synced,
            seen=None if seen is None else (seen[0], seen[1].last_batch),
            rest={"state": resting, WAIT_KEY: self.runner.bounds.statement_s},
            idle={"state": resting}, retention=self.retention,
        )  # fmt: skip
        result: commit.Committed
        result, marks = self.runner.run_commit(epoch, commit.commit(ask))
        finished = self.clock()
        done = result.record
        if done is None:
            return CommitResult(xid, result.action, seconds=finished - started)
        finished = marks.get("published", finished)  # the upkeep after it is not the commit's
        prepared_at = marks.get("prepared", started)
        return CommitResult(
            xid,
            result.action,
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
        """Finish ``record``, re-observed after ClickHouse failures whose outcome is
        unknown (:meth:`StepRunner.publish`)."""
        return self.runner.publish(epoch, record, resumed=resumed, gather=gather, rest=rest)

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

    def _check_fence(self, epoch: Epoch) -> None:
        """FencedError unless ``epoch`` still holds the job (synced)."""
        self.runner.check_fence(epoch)

    def roll_back(self, xid: str, tables: Sequence[str]) -> list[str]:
        """Drop staging ``tables`` of ``xid`` that no record can ever need, behind an
        ABORTED tombstone (:func:`commit.roll_back`); returns them."""
        dropped: list[str] = self.runner.run_commit(None, commit.roll_back(self.job, xid, tables))[
            0
        ]
        return dropped

    def roll_back_tables(self, tables: Sequence[str]) -> list[str]:
        """:meth:`roll_back` for staging of any xids (grouped by the xid in the name)."""
        dropped: list[str]
        dropped, _ = self.runner.run_commit(None, commit.roll_back_tables(self.job, tables))
        return dropped

    def release(self, run_id: str) -> bool:
        """Mark the job's writer finished after a clean stop of ``run_id``'s query
        (:func:`commit.release`): one read of the epoch, one fenced heartbeat."""
        current = self.registry.current_epoch(self.job)
        released: bool
        released, _ = self.runner.run_commit(current, commit.release(run_id, current))
        return released

    def prune(self, epoch: Epoch) -> list[str]:
        """Delete the records past the retention (:func:`commit.prune`)."""
        pruned: list[str]
        pruned, _ = self.runner.run_commit(epoch, commit.prune(self.job, self.retention))
        return pruned

    def forget_dedup_state(self, xid: str) -> None:
        """Delete ``dedup/<xid>`` of a COMMITTED dedup xid, best effort: a replay of a
        committed xid is skipped by the xid record, not by this state; what a failed
        delete leaves is retried at the next skip, recovery or prune."""
        self.runner.commit_act(None, steps.ForgetDedupState(xid), {})

    # -- recovery -------------------------------------------------------------------

    def recover(
        self,
        epoch: Epoch,
        *,
        dry_run: bool = False,
        keep: set[str] | frozenset[str] = frozenset(),
    ) -> RecoveryReport:
        """Roll PREPARED xids forward and drop staging no PREPARED xid references
        (:func:`commit.recover`)."""
        run = commit.recover(
            self.job, self.namespace, self.prefix, epoch.number, dry_run=dry_run,
            keep=frozenset(keep), retention=self.retention,
        )  # fmt: skip
        report: RecoveryReport
        report, _ = self.runner.run_commit(epoch, run)
        return report
