"""The driver-side transaction runner: observes, asks :mod:`txsink.protocol.plans`, acts.

One :class:`Transactor` serves one job. It owns the order of the protocol steps and the
fault points between them; the decisions themselves are pure functions, and the stores
sit behind :class:`txsink.keeper.registry.Registry` and
:class:`txsink.clickhouse.warehouse.Warehouse`.

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

import contextlib
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from txsink.errors import (
    CommitOutcomeUnknown,
    ConfigError,
    RecoveryAlarm,
    RetryableConflict,
    TxSinkError,
    UnavailableError,
)
from txsink.faults import fault_point
from txsink.keeper.registry import Registry, XidExists, superseded
from txsink.ports.warehouse import Warehouse
from txsink.protocol import plans, visibility
from txsink.protocol.codec import JobMeta
from txsink.protocol.dedup import xid_key as dedup_xid_key
from txsink.protocol.ids import (
    batch_claim_name,
    batch_staging_name,
    parse_staging,
    staging_prefix,
)
from txsink.protocol.states import (
    Cut,
    Epoch,
    Mode,
    StagedPart,
    Visibility,
    XidRecord,
    XidState,
)

log = logging.getLogger(__name__)


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


@dataclass(frozen=True)
class _Moves:
    """Consecutive :class:`plans.Publish` steps of one staging table into one target: one
    ``ALTER TABLE staging MOVE PARTITION ..., MOVE PARTITION ...`` round trip. Each
    command stays atomic per (staging table, partition), as one by one; a failure part-way
    leaves moved and unmoved partitions, which a resumed publish tells apart as always."""

    staging: str
    target: str
    partition_ids: tuple[str, ...]


@dataclass(frozen=True)
class _Drops:
    """Consecutive :class:`plans.DropStaging` steps: one ``DROP TABLE a, b, ...``."""

    tables: tuple[str, ...]


def _grouped(ops: Sequence[Any]) -> list[Any]:
    """``ops`` with runs of moves out of one staging table, and runs of drops, merged
    into one call each (the warehouse cuts a long one into statements the server
    parses); the order of everything else is kept."""
    out: list[Any] = []
    for op in ops:
        last = out[-1] if out else None
        if isinstance(op, plans.Publish):
            if isinstance(last, _Moves) and (last.staging, last.target) == (op.staging, op.target):
                out[-1] = replace(last, partition_ids=(*last.partition_ids, op.partition_id))
            else:
                out.append(_Moves(op.staging, op.target, (op.partition_id,)))
        elif isinstance(op, plans.DropStaging):
            if isinstance(last, _Drops):
                out[-1] = _Drops((*last.tables, op.table))
            else:
                out.append(_Drops((op.table,)))
        else:
            out.append(op)
    return out


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
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.registry = registry
        self.warehouse = warehouse
        self.job = job
        self.retention = retention
        self.clock = clock
        self.fault = fault
        self.publish_retry_s = publish_retry_s
        self.sleep = sleep
        self._namespace = ""
        # (xid, target) -> the name this runner renamed that batch staging table to
        self._claims: dict[tuple[str, str], str] = {}

    @property
    def namespace(self) -> str:
        """The coordination store's id, part of this job's staging names."""
        if not self._namespace:
            self._namespace = self.registry.namespace()
        return self._namespace

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
        report = self.recover(epoch, keep=keep)
        if report.alarms:
            raise RecoveryAlarm(
                f"job {self.job}: recovery needs an operator: {'; '.join(report.alarms)}. "
                f"Inspect with `txsink status --job {self.job}`, then "
                f"`txsink recover --job {self.job}`."
            )
        self.registry.heartbeat(epoch, {"state": "running"})
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
    ) -> CommitResult:
        """Prepare and publish one batch whose tasks all succeeded.

        ``streaming``: the batch id is a Spark micro-batch id (replays only ever repeat the
        newest batch), not a ``txn_version``; see :func:`plans.decide_batch`.

        Several tables in one xid: ``target`` is the job's own table and each part names
        its table in ``StagedPart.target`` (normalised to ``""`` when it is ``target``, so
        the manifest stays small); ``tables`` lists every table written."""
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
        self.registry.sync(self.job)
        existing = self.registry.get(self.job, xid)
        last_batch = self.registry.ledger(self.job).last_batch

        def decide(existing: XidRecord | None) -> plans.BatchDecision:
            return plans.decide_batch(
                existing, incoming, last_batch, streaming=streaming, epoch=epoch.number
            )

        decision = decide(existing)
        if decision.action == "prepare" and mode is Mode.ATTACH:
            self._refuse_dedup_leftovers(xid)
        if decision.action == "prepare":
            self.fault("driver.before_prepare")
            try:
                record = self.registry.prepare(epoch, incoming)
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
        if decision.action == "refuse":
            self._check_fence(epoch)  # a superseded writer hears FencedError first
            if decision.retry:
                raise RetryableConflict(f"job {self.job}: {decision.reason}")
            raise ConfigError(f"job {self.job}: {decision.reason}")
        if decision.action == "skip_committed":
            log.info("job %s: %s; replay is a no-op", self.job, decision.reason)
            if existing is not None and existing.mode is Mode.DEDUP:
                self.forget_dedup_state(xid)  # a crash may have come before the cleanup
            return CommitResult(xid, "skipped", seconds=self.clock() - started)
        if decision.action == "roll_forward_existing":
            assert existing is not None
            log.warning("job %s: %s", self.job, decision.reason)
            record = existing
        done = self.publish(epoch, record, resumed=decision.action != "prepare")
        action = "committed" if decision.action == "prepare" else "rolled_forward"
        finished = self.clock()
        self._after_commit(epoch, done)
        return CommitResult(
            xid,
            action,
            rows=done.rows,
            partitions=len(done.ledger_rows()),
            seconds=finished - started,
            timings={"prepare": prepared_at - started, "publish": finished - prepared_at},
        )

    def publish(self, epoch: Epoch, record: XidRecord, *, resumed: bool = True) -> XidRecord:
        """:meth:`finish`, re-observed after ClickHouse failures whose outcome is unknown.

        A MOVE (or ATTACH) whose reply was lost may have landed, may still be running on
        the server, or may have been cut by a server crash; repeating it blindly could
        publish rows twice. So a resumed publish (the record existed before: an earlier
        attempt, a crashed writer, a superseded one may have a statement in flight) and
        every re-run after such a failure first waits until the server answers and no
        statement on this xid's staging is running (:meth:`Warehouse.settle`), checks
        that this writer still holds the job, re-reads the record, and only then runs
        the whole plan again as a resumed one (part UUIDs decide what landed). Busy
        answers (nothing happened) are re-planned the same way. If the server is not
        seen quiet within ``publish_retry_s`` seconds, the last error is raised and
        nothing more is sent: the xid stays as it is and the next commit or ``txsink
        recover`` finishes it."""
        deadline = time.monotonic() + self.publish_retry_s
        pause = 0.2
        failure: TxSinkError | None = None
        while True:
            try:  # every way out of here asks Keeper whether the xid is COMMITTED already
                if resumed and not self._settle(epoch, record, deadline):
                    raise failure or UnavailableError(
                        f"job {self.job}: xid {record.xid}: statements on its staging are "
                        f"still running on ClickHouse after {self.publish_retry_s:g}s; "
                        f"nothing was published again. `txsink recover --job {self.job}` "
                        f"finishes it"
                    )
                if failure is not None:
                    self._check_fence(epoch)  # a writer that lost the job must not go on
                    record = self.registry.get(self.job, record.xid) or record
                return self.finish(epoch, record, resumed=resumed)
            except (UnavailableError, RetryableConflict) as exc:
                left = deadline - time.monotonic()
                if left <= 0:
                    return self._committed_anyway(record, exc)
                log.warning(
                    "job %s: xid %s: publishing failed with an unknown outcome (%s); "
                    "re-observing before going on",
                    self.job, record.xid, exc,
                )  # fmt: skip
                failure, resumed = exc, True
                self.sleep(min(pause, left))
                pause = min(pause * 2, 5.0)
            except TxSinkError as exc:
                return self._committed_anyway(record, exc)

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

    def _settle(self, epoch: Epoch, record: XidRecord, deadline: float) -> bool:
        """Whether ClickHouse answered, before ``deadline``, with no statement running on
        the staging of ``record`` (every staging name of an xid starts with one prefix).
        Heartbeats while it waits, so the writer does not read as dead."""
        common = f"{self.prefix}__{record.xid}__"
        odd = sorted({t for t in record.staging_tables if not t.startswith(common)})
        needles = [common, *odd] if len(odd) < 100 else [common, f"{self.prefix}__"]
        beat = 0.0
        while True:
            try:
                if self.warehouse.settle(needles):
                    return True
                log.info("job %s: xid %s: a statement on its staging still runs", self.job,
                         record.xid)  # fmt: skip
            except TxSinkError as exc:  # not answering yet (or not letting us look)
                log.info("job %s: ClickHouse not settled yet: %s", self.job, exc)
            if time.monotonic() >= deadline:
                return False
            if time.monotonic() - beat > 5.0:
                beat = time.monotonic()
                with contextlib.suppress(TxSinkError):
                    self.registry.heartbeat(epoch, {"state": "publishing", "xid": record.xid})
            self.sleep(min(0.5, max(0.0, deadline - time.monotonic())))

    def finish(self, epoch: Epoch, record: XidRecord, *, resumed: bool = True) -> XidRecord:
        """Run the publish plan of a PREPARED (or COMMITTED) record to its end.

        ``resumed``: the record existed before this attempt (a MOVE may have run), so the
        target is searched for the part UUIDs of fully staged partitions too."""
        if visibility.is_batch(record):
            return self._finish_batch(epoch, record)
        view = self.warehouse.staging_view(record.staging_tables) if record.manifest else {}
        part_rows: dict[str, int] = {}
        staged = self._staged_uuids(record, view, part_rows) if resumed else {}
        found: frozenset[str] = frozenset()
        by_target = plans.evidence_by_target(record, view, resumed=resumed, staged=staged)
        for table, wanted in by_target.items():
            found |= self.warehouse.published_uuids(table, wanted)
        ops = plans.plan_publish(record, view, found, staged, part_rows)
        hint = "Nothing was published for it automatically; see docs/operations.md#lost-staging"
        return self._execute(epoch, record, ops, hint)

    def _execute(
        self, epoch: Epoch, record: XidRecord, ops: Sequence[Any], alarm_hint: str
    ) -> XidRecord:
        """Carry out a publish plan (:func:`plans.plan_publish` or
        :func:`visibility.plan_batch_publish`) in order, with the fault points between
        its steps; an Alarm stops it before anything else runs."""
        moved = 0
        for op in _grouped(ops):
            if isinstance(op, _Moves):
                self.warehouse.move_partitions(op.staging, op.partition_ids, op.target)
                moved += 1
                if moved == 1:
                    self.fault("driver.mid_commit")
                continue
            if isinstance(op, _Drops):
                self.warehouse.drop_stagings(op.tables)
                continue
            if isinstance(op, plans.RecordCut):
                log.warning(
                    "job %s: xid %s: a server crash cut the MOVE of partition %s of %s between "
                    "parts; %d of them are in the target already: recording them, dropping "
                    "them from staging, moving the rest",
                    self.job, record.xid, op.partition_id, op.staging, len(op.cut),
                )  # fmt: skip
                # amend merges it into the record's cuts of other partitions
                record = self.registry.amend(
                    epoch, record, [Cut(op.staging, op.partition_id, op.cut)]
                )
                continue
            if isinstance(op, plans.DropParts):
                self.warehouse.drop_parts(op.staging, op.partition_id, op.evidence)
                continue
            if isinstance(op, plans.Evidence) and op.kind not in ("uuid", "cut"):
                log.warning(
                    "job %s: xid %s: partition %s of %s has no rows left; counted as "
                    "published on %s evidence (docs/operations.md#evidence-of-publish)",
                    self.job, record.xid, op.partition_id, op.staging, op.kind,
                )  # fmt: skip
            if isinstance(op, plans.Alarm):
                raise RecoveryAlarm(f"job {self.job}: {op.reason}. {alarm_hint}")
            if isinstance(op, (plans.Publish, visibility.Consolidate)):
                if isinstance(op, plans.Publish):
                    self.warehouse.move_partition(op.staging, op.partition_id, op.target)
                else:
                    self.warehouse.consolidate(op.staging, op.partition_id, op.batch_staging)
                moved += 1
                if moved == 1:
                    self.fault("driver.mid_commit")
            elif isinstance(op, visibility.CreateBatchStaging):
                self.warehouse.create_batch_staging(op.table, op.like, op.target)
            elif isinstance(op, visibility.ClaimBatch):
                self._check_fence(epoch)  # a superseded finisher takes nothing from the live one
                claimed = batch_claim_name(op.batch_staging, uuid.uuid4().hex)
                self.warehouse.claim_staging(op.batch_staging, claimed)
                self._claims[(record.xid, op.target)] = claimed
                # a statement another finisher sent before the rename may still run
                if not self._settle(epoch, record, time.monotonic() + self.publish_retry_s):
                    raise UnavailableError(
                        f"job {self.job}: xid {record.xid}: statements on its staging still "
                        f"run after {self.publish_retry_s:g}s; nothing was attached"
                    )
            elif isinstance(op, visibility.AttachAll):
                # a claim serves one ATTACH: one whose outcome is unknown (a lost reply, a
                # request still queued on the server) is never followed by a second from
                # the same name; the next round renames again, which makes it fail
                self._claims.pop((record.xid, op.target), None)
                self.fault("driver.before_attach")
                tag = self.attach_tag(record, op.target)
                self.warehouse.attach_all(op.batch_staging, op.target, tag)
                self.fault("driver.after_attach")
            elif isinstance(op, plans.RecordCommitted):
                self.fault("driver.after_commit")
                record = self._record_committed(epoch, record)
                self.fault("driver.after_record")
            elif isinstance(op, plans.DropStaging):
                self.warehouse.drop_staging(op.table)
        return record

    def batch_tables(self, record: XidRecord) -> dict[str, str]:
        """Target -> batch staging table of a ``visibility=batch`` record, under the name
        a finisher claimed it with if one did (:class:`visibility.ClaimBatch`)."""
        listed = self.warehouse.list_staging(f"{self.prefix}__{record.xid}")
        out: dict[str, str] = {}
        for target in visibility.by_target(record):
            base = batch_staging_name(self.prefix, record.xid, target)
            names = [t for t in listed if t == base or t.startswith(f"{base}_c")]
            if len(names) > 1:
                # a finisher's late CREATE IF NOT EXISTS after another claimed the full one
                # makes an empty twin (nothing can be moved into it: every task partition
                # is consolidated before a claim); it is dropped with the xid's staging
                sizes = self.warehouse.staging_view(names)
                full = [n for n in names if any((sizes.get(n) or {}).values())]
                if len(full) > 1:
                    raise RecoveryAlarm(
                        f"job {self.job}: xid {record.xid} (visibility=batch) has several "
                        f"batch staging tables with rows for {target}: {full}; nothing was "
                        f"attached. Inspect them (docs/modes.md#visibility), then `txsink "
                        f"recover --job {self.job}`"
                    )
                names = full or names
            out[target] = names[0] if names else base
        return out

    def attach_tag(self, record: XidRecord, target: str) -> str:
        """The ``log_comment`` of the ATTACH that publishes ``record`` into ``target``: the
        same for every finisher of this prepare (its ``created_at`` tells it from an xid
        of the same name in a job deleted and created again), so any finisher finds any
        other's in the query log."""
        return f"txsink attach {self.prefix} {record.xid} {record.created_at:.6f} {target}"

    def _finish_batch(self, epoch: Epoch, record: XidRecord) -> XidRecord:
        """:meth:`finish` of a ``visibility=batch`` record: consolidate every task's staging
        of each table into its batch staging, then one ATTACH PARTITION ALL per table
        (:func:`visibility.plan_batch_publish`, re-planned from a fresh look after the
        consolidation)."""
        for _ in range(8):
            batch_tables = self.batch_tables(record)
            view = self.warehouse.staging_view([*record.staging_tables, *batch_tables.values()])
            part_rows: dict[str, int] = {}
            staged = self._staged_uuids(record, view, part_rows)
            batch_uuids: dict[str, tuple[str, ...]] = {}
            for table in batch_tables.values():
                if view.get(table) is not None and record.state is XidState.PREPARED:
                    parts = self.warehouse.staged_partitions(table, every_part=True).values()
                    batch_uuids[table] = tuple(u for _, uuids in parts for u in uuids)
            wanted = visibility.batch_evidence_wanted(record, batch_tables, batch_uuids)
            published = {t: self.warehouse.published_uuids(t, u) for t, u in wanted.items()}
            claimed = {
                t for t, name in batch_tables.items() if self._claims.get((record.xid, t)) == name
            }
            # the query log is read while this finisher holds the claim (nobody can attach
            # meanwhile), or when no batch staging shows at all and every task partition
            # of the table is empty (nothing else can prove such a batch published)
            missing = {
                t
                for t, parts in visibility.by_target(record).items()
                if view.get(batch_tables[t]) is None
                and not any((view.get(p.table) or {}).get(p.partition_id) for p in parts)
            }
            logged = {
                t
                for t in sorted(claimed | missing)
                if record.state is XidState.PREPARED
                and self.warehouse.attach_logged(t, self.attach_tag(record, t), record.created_at)
            }
            ops = visibility.plan_batch_publish(
                record, batch_tables, view, staged, batch_uuids, published, claimed, logged,
                part_rows,
            )  # fmt: skip
            record = self._execute(epoch, record, ops, "See docs/modes.md#visibility")
            if not ops or not isinstance(ops[-1], visibility.Reobserve):
                return record
        if missing - logged and len(ops) == 1:  # looked again and again: not a rename
            raise RecoveryAlarm(
                f"job {self.job}: xid {record.xid} (visibility=batch): its task staging is "
                f"empty, its batch staging for {sorted(missing - logged)} is missing under "
                f"every name, and system.query_log shows no ATTACH of it: nothing proves "
                f"it was published, nothing was guessed. See docs/operations.md#lost-staging"
            )
        raise RetryableConflict(  # re-observed by publish() until publish_retry_s
            f"job {self.job}: xid {record.xid} (visibility=batch): its staging kept changing "
            f"(another finisher at work?); see docs/modes.md#visibility"
        )

    def _staged_uuids(
        self,
        record: XidRecord,
        view: plans.StagingView,
        part_rows: dict[str, int] | None = None,
    ) -> dict[tuple[str, str], tuple[str, ...]]:
        """UUIDs of every part of each manifest partition still staged (a resumed publish:
        an earlier MOVE may have been cut between parts by a server crash); each part's
        rows are added to ``part_rows`` (what a repair of a cut MOVE records)."""
        if record.mode is Mode.DEDUP or record.state is not XidState.PREPARED:
            return {}
        tables = {p.table for p in record.manifest if (view.get(p.table) or {}).get(p.partition_id)}
        out: dict[tuple[str, str], tuple[str, ...]] = {}
        for table in sorted(tables):
            for pid, parts in self.warehouse.staged_part_rows(table).items():
                out[(table, pid)] = tuple(parts)
                if part_rows is not None:
                    part_rows.update(parts)
        return out

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

    def _check_fence(self, epoch: Epoch) -> None:
        """FencedError unless ``epoch`` still holds the job. Synced: a server that lags
        the leader would show a superseded writer its own epoch, and the check guards
        ClickHouse statements (MOVEs) that no Keeper write fences."""
        self.registry.sync(self.job)
        current = self.registry.current_epoch(self.job)
        if current is None or current.token != epoch.token:
            raise superseded(epoch, current)

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
        if kept:
            log.warning(
                "job %s: xid %s is %s; not dropping its staging %s",
                self.job,
                xid,
                record.state,
                kept,
            )
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

    def _record_committed(self, epoch: Epoch, record: XidRecord) -> XidRecord:
        try:
            return self.registry.commit(epoch, record, self.clock())
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

    def _after_commit(self, epoch: Epoch, record: XidRecord) -> None:
        if record.mode is Mode.DEDUP:
            self.forget_dedup_state(record.xid)
        self.registry.heartbeat(
            epoch, {"state": "running", "last_xid": record.xid, "last_batch": record.batch}
        )
        if record.batch is not None and record.batch % 50 == 0:
            self.prune(epoch)

    def prune(self, epoch: Epoch) -> list[str]:
        records = self.registry.list(self.job)
        doomed = plans.plan_prune(records, self.retention, now=self.clock())
        if doomed:
            self.registry.delete(epoch, doomed)
        dedup_xids = {r.xid for r in records if r.mode is Mode.DEDUP}
        for xid in doomed:
            if xid in dedup_xids:  # normally gone already; left by a crash after COMMITTED
                self.forget_dedup_state(xid)
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
