"""The operator's recovery (``txsink recover``): a plan per job from its status, then the
roll-forward / roll-back under a new writer epoch taken as ``txsink-recover@host:pid``.

Refuses to fence a job whose writer looks live (its heartbeat is younger than the stale
threshold, see :mod:`txsink.ops.liveness`) unless forced: its unreferenced staging may be
a batch in flight."""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from txsink.dedup_state import DISCARDED, open_dedup_batches
from txsink.errors import ConfigError, UnavailableError
from txsink.ops.liveness import (
    STALE_CAP,
)
from txsink.ops.status import DEFAULT_STALE_AFTER, RECOVERED_STATE, liveness_of, recover_owner
from txsink.ops.stores import Stores
from txsink.protocol.codec import JobMeta
from txsink.protocol.commit import RecoveryReport
from txsink.protocol.dedup import OpenBatch
from txsink.protocol.dedup import xid_key as dedup_xid_key
from txsink.protocol.ids import seal_tag, staging_prefix
from txsink.protocol.ops import Alarm
from txsink.protocol.planner import plan_publish
from txsink.protocol.states import Epoch, Mode
from txsink.transactor import Transactor

log = logging.getLogger(__name__)

# --------------------------------------------------------------------------- recover


@dataclass
class RecoveryPlanView:
    """What ``txsink recover`` would do for one job, and whether it may."""

    job: str
    epoch: int | None
    owner: str | None
    heartbeat_age: float | None
    live: bool
    plan: RecoveryReport
    cadence_s: float | None = None
    stale_after_s: float = STALE_CAP
    # how the threshold was reached (txsink.ops.liveness.explain renders it)
    stale_after_source: str = "no-cadence"
    beat_s: float | None = None
    expected_alarms: list[str] = field(default_factory=list)
    roll_forward_rows: dict[str, int] = field(default_factory=dict)
    # dedup batches stopped half-way: recovery cannot finish them, only name them
    open_dedup: list[OpenBatch] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        p = self.plan
        return not (p.rolled_forward or p.rolled_back or p.dropped_leftovers)

    def to_json(self) -> dict[str, Any]:
        return {
            "job": self.job,
            "epoch": self.epoch,
            "owner": self.owner,
            "heartbeat_age": self.heartbeat_age,
            "live": self.live,
            "cadence_s": self.cadence_s,
            "stale_after_s": self.stale_after_s,
            "stale_after_source": self.stale_after_source,
            "beat_s": self.beat_s,
            "plan": self.plan.to_json(),
            "expected_alarms": list(self.expected_alarms),
            "roll_forward_rows": [{"xid": x, "rows": n} for x, n in self.roll_forward_rows.items()],
            "open_dedup": [asdict(b) for b in self.open_dedup],
            "empty": self.empty,
        }


def plan_job_recovery(
    stores: Stores,
    job: str,
    *,
    stale_after: float | None = DEFAULT_STALE_AFTER,
    now: float | None = None,
) -> RecoveryPlanView:
    """The recovery plan of ``job`` (``Transactor.recover(dry_run=True)``); writes nothing.

    Roll-forwards whose staging no longer matches the manifest are listed in
    ``expected_alarms``: carrying out the plan would alarm on them, not publish them.
    """
    now = time.time() if now is None else now
    registry = stores.registry
    meta = registry.job_meta(job) or JobMeta()
    warehouse = stores.warehouse(meta)
    current = registry.current_epoch(job)
    owner = registry.owner(job)
    probe = current or Epoch(job, 0, -1, "")
    report = Transactor(registry, warehouse, job).recover(probe, dry_run=True)
    staging = warehouse.staging_sizes(staging_prefix(job, registry.namespace()))
    verdict = liveness_of(owner, registry.list(job), now, stale_after, staging)
    view = RecoveryPlanView(
        job,
        current.number if current else None,
        current.owner if current else None,
        verdict.heartbeat_age,
        verdict.live,
        report,
        cadence_s=verdict.cadence_s,
        stale_after_s=verdict.stale_after_s,
        stale_after_source=verdict.stale_after_source,
        beat_s=verdict.beat_s,
        open_dedup=open_dedup_batches(registry, job),
    )
    for xid in report.rolled_forward:
        record = registry.get(job, xid)
        if record is None:
            continue
        view.roll_forward_rows[xid] = record.rows
        if record.mode is Mode.ATTACH and record.manifest:
            ops = plan_publish(record, warehouse.staging_view(record.staging_tables))
            view.expected_alarms += [op.reason for op in ops if isinstance(op, Alarm)]
    return view


@dataclass
class RecoveryOutcome:
    """A carried-out recovery: the epoch it took, whom it fenced, and the report."""

    job: str
    epoch: int
    owner: str
    fenced_owner: str | None
    fenced_epoch: int | None
    report: RecoveryReport
    remaining: RecoveryPlanView

    @property
    def clean(self) -> bool:
        return not self.report.alarms and not self.remaining.plan.rolled_forward

    def to_json(self) -> dict[str, Any]:
        return {
            "job": self.job,
            "epoch": self.epoch,
            "owner": self.owner,
            "fenced_owner": self.fenced_owner,
            "fenced_epoch": self.fenced_epoch,
            "report": self.report.to_json(),
            "clean": self.clean,
        }


def carry_out_recovery(
    stores: Stores, job: str, *, stale_after: float | None = DEFAULT_STALE_AFTER
) -> RecoveryOutcome:
    """Take a new writer epoch (fencing the current writer) and recover ``job``.

    The epoch is held by :func:`recover_owner`; its heartbeat is left in state
    ``recovered`` so that status shows the takeover and liveness checks ignore it.
    """
    registry = stores.registry
    meta = registry.job_meta(job) or JobMeta()
    warehouse = stores.warehouse(meta)
    before = registry.current_epoch(job)
    epoch = registry.take_epoch(job, recover_owner())
    log.warning(
        "job %s: recovery took writer epoch %d as %s, fencing %s (epoch %s)",
        job,
        epoch.number,
        epoch.owner,
        before.owner if before else None,
        before.number if before else None,
    )
    previous = before.owner if before else None
    registry.heartbeat(epoch, {"state": "recovering", "previous_owner": previous})
    report = Transactor(registry, warehouse, job).recover(epoch)
    for table in (*report.rolled_back, *report.dropped_leftovers):
        log.warning("job %s: recovery dropped staging %s.%s", job, warehouse.staging_db, table)
    for alarm in report.alarms:
        log.error("job %s: recovery alarm: %s", job, alarm)
    registry.heartbeat(
        epoch,
        {
            "state": RECOVERED_STATE,
            "previous_owner": previous,
            "recovered_at": time.time(),
            "alarms": len(report.alarms),
        },
    )
    remaining = plan_job_recovery(stores, job, stale_after=stale_after)
    return RecoveryOutcome(
        job,
        epoch.number,
        epoch.owner,
        previous,
        before.number if before else None,
        report,
        remaining,
    )


def discard_dedup(stores: Stores, job: str, xid: str) -> tuple[int, OpenBatch]:
    """Give up the half-visible dedup batch ``xid`` of ``job`` (the operator deleted its
    rows from the target, or keeps them knowingly): mark it discarded, so that the job
    writes other batches again and this xid is never written again. Fences the writer
    first (a new epoch), then looks: a task that wrote between a check and the epoch
    would otherwise slip through. Returns (the epoch taken, the batch discarded).

    The partition records stay beside the mark (what was sent, for the audit). A task of
    this xid still running somewhere (a zombie executor) is not fenced by the epoch: dedup
    mode's tasks never are (docs/modes.md#a-dedup-batch-stopped-half-way)."""
    registry = stores.registry

    def the_batch() -> OpenBatch:
        found = {b.xid: b for b in open_dedup_batches(registry, job)}
        if xid not in found:
            raise ConfigError(
                f"job {job}: {xid} is not a dedup batch stopped half-way"
                + (f" (those are: {', '.join(found)})" if found else " (the job has none)")
                + f"; nothing was changed. `txsink status --job {job}` lists them"
            )
        return found[xid]

    the_batch()  # a wrong xid fences nobody
    epoch = registry.take_epoch(job, recover_owner())
    registry.heartbeat(epoch, {"state": "discarding", "xid": xid})
    registry.sync(job)
    batch = the_batch()  # again, behind the epoch: it may have committed meanwhile
    # sealed on the server first: a task of it still alive (a zombie executor) cannot
    # add rows the operator is about to delete or keep (docs/modes.md#attempts-that-
    # outlive-their-batch); a crash before the mark leaves it sealed, and this command
    # is run again
    tag = seal_tag(staging_prefix(job, registry.namespace()), xid)
    warehouse = stores.warehouse(registry.job_meta(job))
    warehouse.seal_dedup(tag)
    if not warehouse.settle([tag]):
        raise UnavailableError(
            f"job {job}: an insert of {xid} still runs on ClickHouse after its seal; "
            "nothing was discarded. Run this command again once it ended"
        )
    mark = {"by": epoch.owner, "at": time.time(), "rows": batch.rows_at_most, "epoch": epoch.number}
    registry.put_blob(job, f"{dedup_xid_key(xid)}/{DISCARDED}", mark)
    registry.heartbeat(
        epoch, {"state": RECOVERED_STATE, "discarded": xid, "recovered_at": time.time()}
    )
    log.warning("job %s: discarded half-visible dedup batch %s (%s)", job, xid, batch.describe())
    return epoch.number, batch
