"""The operator's recovery (``txsink recover``): a plan per job from its status, then the
roll-forward / roll-back under a new writer epoch taken as ``txsink-recover@host:pid``.

Refuses to fence a job whose writer looks live (its heartbeat is younger than the stale
threshold, see :mod:`txsink.ops.liveness`) unless forced: its unreferenced staging may be
a batch in flight."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from txsink.ops.liveness import (
    STALE_CAP,
)
from txsink.ops.status import DEFAULT_STALE_AFTER, RECOVERED_STATE, liveness_of, recover_owner
from txsink.ops.stores import Stores
from txsink.protocol.codec import JobMeta
from txsink.protocol.ops import Alarm
from txsink.protocol.planner import plan_publish
from txsink.protocol.states import Epoch, Mode
from txsink.transactor import RecoveryReport, Transactor

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
    expected_alarms: list[str] = field(default_factory=list)
    roll_forward_rows: dict[str, int] = field(default_factory=dict)

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
            "plan": self.plan.to_json(),
            "expected_alarms": list(self.expected_alarms),
            "roll_forward_rows": dict(self.roll_forward_rows),
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
    verdict = liveness_of(owner, registry.list(job), now, stale_after)
    view = RecoveryPlanView(
        job,
        current.number if current else None,
        current.owner if current else None,
        verdict.heartbeat_age,
        verdict.live,
        report,
        cadence_s=verdict.cadence_s,
        stale_after_s=verdict.stale_after_s,
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
