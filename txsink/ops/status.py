"""Operator views of jobs (``txsink status``) and the operator's recovery (``txsink recover``).

Everything here returns plain dataclasses; the CLI (:mod:`txsink.cli.ops_cmd`) renders
them. Reads only, except :func:`carry_out_recovery`, which takes a new writer epoch.

Liveness is judged by :mod:`txsink.ops.liveness` from the owner node's heartbeat (written
by every writer at takeover and after every commit) against a threshold that follows the
job's own commit cadence (or ``--stale-after``): a heartbeat younger than that means a
writer may be mid-batch, so its unreferenced staging is a batch in flight, not an orphan,
and recovery refuses to fence it unless forced. The owner ``txsink-recover@host:pid`` (the
mark recovery leaves behind) is never a live writer.

Warning kinds (each has a runbook section of that name in docs/operations.md):

- ``stuck-prepared``: a PREPARED xid older than ``stuck_after``;
- ``lost-staging``: a PREPARED xid whose staging cannot be published as its manifest says;
- ``orphan-staging``: staging no PREPARED xid references while no live writer holds the job;
- ``stale-owner``: the owner's heartbeat is older than the stale threshold;
- ``fenced-writer``: the job was taken over by ``txsink recover`` (or the heartbeating
  writer's epoch was superseded): the writer that ran before must be restarted;
- ``ledger-evicted`` (info): the ledger folded the totals of its least recently written
  partitions into one number (it keeps ``LEDGER_PARTITIONS``): ``txsink verify``
  reconciles those partitions together, not one by one.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from txsink.clickhouse.client import connect
from txsink.clickhouse.warehouse import DEFAULT_STAGING_DB, ClickHouseWarehouse
from txsink.errors import ConfigError
from txsink.keeper.kazoo_registry import KazooRegistry
from txsink.keeper.ledger import LEDGER_PARTITIONS
from txsink.keeper.registry import Registry
from txsink.ops.liveness import (
    RECOVER_OWNER_PREFIX,
    STALE_CAP,
    Liveness,
    explain,
    heartbeat_age,
    is_recover_owner,
    judge,
)
from txsink.protocol import plans
from txsink.protocol.ids import parse_staging, staging_prefix
from txsink.protocol.states import Epoch, Mode, XidRecord, XidState
from txsink.transactor import RecoveryReport, Transactor

log = logging.getLogger(__name__)

DEFAULT_STUCK_AFTER = 300.0
# None: the stale threshold follows the job's commit cadence (txsink.ops.liveness).
DEFAULT_STALE_AFTER: float | None = None
RECOVERED_STATE = "recovered"


def recover_owner() -> str:
    """The owner name recovery takes epochs under (``txsink-recover@host:pid``)."""
    return f"{RECOVER_OWNER_PREFIX}{socket.gethostname()}:{os.getpid()}"


# --------------------------------------------------------------------------- stores


class Stores:
    """The registry and ClickHouse client an operator command works with.

    Staging databases can differ per job (recorded in the job meta); one warehouse per
    database is made on demand (a warehouse holds no state).
    """

    def __init__(
        self,
        registry: Registry,
        client: Any,
        staging_database: str | None = None,
        connect_shard: Any = None,
    ) -> None:
        self.registry = registry
        self.client = client
        self.staging_database = staging_database
        self._warehouses: dict[Any, Any] = {}
        self._connect_shard = connect_shard  # url -> client, with the command's credentials
        self._shard_clients: dict[str, Any] = {}

    def warehouse(self, meta: Mapping[str, Any] | None = None) -> Any:
        """The warehouse of a job: ``--staging-database`` if given, else the job's own;
        for a sharded job (``shards`` in its meta) every shard behind one
        :class:`~txsink.clickhouse.shards.ShardedWarehouse`, connected with the
        command's credentials."""
        db = (
            self.staging_database
            or str((meta or {}).get("staging_database") or "")
            or DEFAULT_STAGING_DB
        )
        shards = tuple(str(u) for u in (meta or {}).get("shards") or ())
        key = (db, shards)
        if key not in self._warehouses:
            if shards:
                from txsink.clickhouse.shards import ShardedWarehouse

                self._warehouses[key] = ShardedWarehouse(
                    [ClickHouseWarehouse(self.shard_client(u), db) for u in shards]
                )
            else:
                self._warehouses[key] = ClickHouseWarehouse(self.client, db)
        return self._warehouses[key]

    def shard_client(self, url: str) -> Any:
        if url not in self._shard_clients:
            if self._connect_shard is None:
                raise ConfigError(f"this command cannot reach shard {url}: no credentials")
            self._shard_clients[url] = self._connect_shard(url)
        return self._shard_clients[url]

    def close(self) -> None:
        self.registry.close()
        for client in (self.client, *self._shard_clients.values()):
            close = getattr(client, "close", None)
            if close is not None:
                close()

    def __enter__(self) -> Stores:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_stores(
    url: str,
    keeper: str,
    *,
    user: str = "default",
    password: str = "",
    keeper_auth: str | None = None,
    keeper_root: str = "/txsink",
    staging_database: str | None = None,
    timeout: float = 15.0,
) -> Stores:
    """Connect to Keeper and ClickHouse (both fail fast with a named error)."""
    registry = KazooRegistry(
        keeper, "/" + keeper_root.strip("/"), auth=keeper_auth, timeout=timeout
    )
    try:
        client = connect(url, user, password)
    except BaseException:
        registry.close()
        raise
    return Stores(
        registry, client, staging_database, connect_shard=lambda u: connect(u, user, password)
    )


def resolve_jobs(registry: Registry, job: str | None, root: str = "") -> list[str]:
    """``[job]`` if it exists, all jobs when ``job`` is None; ConfigError for a missing one."""
    jobs = registry.list_jobs()
    if job is None:
        return jobs
    if job not in jobs:
        known = ", ".join(jobs) if jobs else "none"
        raise ConfigError(
            f"job {job!r} does not exist in Keeper{f' under {root}' if root else ''} "
            f"(jobs there: {known}); check --job, --keeper and --keeper-root"
        )
    return [job]


# --------------------------------------------------------------------------- status


@dataclass
class Finding:
    """One warning of ``txsink status`` (``kind`` names its runbook section)."""

    kind: str
    level: str  # "warn" | "info"
    message: str
    xid: str | None = None
    table: str | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class PendingXid:
    xid: str
    batch: int | None
    state: str
    age_seconds: float
    rows: int
    staging_tables: list[str]
    epoch: int
    tables: dict[str, int] = field(default_factory=dict)  # rows per target table


@dataclass
class StagingTable:
    table: str
    xid: str
    rows: int
    bytes: int
    referenced_by: str  # "prepared" | "committed" | "none"


@dataclass
class JobStatus:
    job: str
    target: str
    mode: str
    staging_database: str
    epoch: int | None
    owner: str | None
    owner_epoch: int | None
    owner_state: str | None
    heartbeat_age: float | None
    live: bool
    cadence_s: float | None
    stale_after_s: float
    stale_after_source: str
    committed: int
    rows_committed: int
    last_batch: int | None
    last_commit_at: float | None
    last_commit_age: float | None
    pending: list[PendingXid] = field(default_factory=list)
    staging: list[StagingTable] = field(default_factory=list)
    warnings: list[Finding] = field(default_factory=list)
    targets: list[str] = field(default_factory=list)  # every table (multi-table jobs)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["warnings"] = [w.to_json() for w in self.warnings]
        return data


def writer_is_live(
    owner: Mapping[str, Any] | None,
    now: float,
    stale_after: float | None = None,
    records: Iterable[XidRecord] = (),
) -> bool:
    """Whether a writer may be mid-batch: a fresh heartbeat that is not recovery's mark."""
    return liveness_of(owner, records, now, stale_after).live


def liveness_of(
    owner: Mapping[str, Any] | None,
    records: Iterable[XidRecord],
    now: float,
    stale_after: float | None = None,
) -> Liveness:
    """:func:`txsink.ops.liveness.judge` on the commit times of ``records``."""
    times = [r.committed_at for r in records if r.state is XidState.COMMITTED]
    return judge(owner, times, now, stale_after)


def assess(
    job: str,
    *,
    meta: Mapping[str, Any],
    epoch: Epoch | None,
    owner: Mapping[str, Any] | None,
    ledger: Mapping[str, Any],
    records: Iterable[XidRecord],
    staging_sizes: Mapping[str, Mapping[str, int]],
    staging_view: Mapping[str, Mapping[str, int] | None],
    now: float,
    stuck_after: float = DEFAULT_STUCK_AFTER,
    stale_after: float | None = DEFAULT_STALE_AFTER,
    staging_database: str = DEFAULT_STAGING_DB,
) -> JobStatus:
    """The status of one job from what Keeper and ClickHouse show (pure).

    ``staging_view`` holds rows per partition of the staging tables PREPARED xids need
    (None for a missing table), as :meth:`ClickHouseWarehouse.staging_view` returns it.
    """
    records = list(records)
    age = heartbeat_age(owner, now)
    verdict = liveness_of(owner, records, now, stale_after)
    live, stale_after = verdict.live, verdict.stale_after_s
    last_at = ledger.get("last_commit_at")
    status = JobStatus(
        job=job,
        target=str(meta.get("target", "")),
        mode=str(meta.get("mode", "")),
        staging_database=staging_database,
        epoch=epoch.number if epoch else None,
        owner=epoch.owner if epoch else None,
        owner_epoch=None if not owner or owner.get("epoch") is None else int(owner["epoch"]),
        owner_state=None if not owner else str(owner.get("state", "")) or None,
        heartbeat_age=None if age is None else round(age, 1),
        live=live,
        cadence_s=verdict.cadence_s,
        stale_after_s=verdict.stale_after_s,
        stale_after_source=verdict.stale_after_source,
        committed=int(ledger.get("committed", 0)),
        rows_committed=int(ledger.get("rows", 0)),
        last_batch=ledger.get("last_batch"),
        last_commit_at=last_at,
        last_commit_age=None if last_at is None else round(max(0.0, now - float(last_at)), 1),
        targets=sorted(meta["targets"]) if isinstance(meta.get("targets"), dict) else [],
    )
    prepared = [r for r in records if r.state is XidState.PREPARED]
    prepared_tables = {t: r.xid for r in prepared for t in r.staging_tables}
    committed_tables = {
        t for r in records if r.state is XidState.COMMITTED for t in r.staging_tables
    }
    for r in sorted(prepared, key=lambda r: r.created_at):
        status.pending.append(
            PendingXid(
                r.xid,
                r.batch,
                r.state.value,
                round(max(0.0, now - r.created_at), 1),
                r.rows,
                list(r.staging_tables),
                r.epoch,
                r.table_rows(),
            )
        )
    for table, size in sorted(staging_sizes.items()):
        parsed = parse_staging(table)
        ref = (
            "prepared"
            if table in prepared_tables
            else ("committed" if table in committed_tables else "none")
        )
        status.staging.append(
            StagingTable(
                table,
                parsed.xid if parsed else "?",
                int(size.get("rows", 0)),
                int(size.get("bytes", 0)),
                ref,
            )
        )

    w = status.warnings
    for r in prepared:
        if r.mode is Mode.ATTACH:
            alarm = next(
                (op for op in plans.plan_publish(r, staging_view) if isinstance(op, plans.Alarm)),
                None,
            )
            if alarm is not None:
                w.append(
                    Finding(
                        "lost-staging",
                        "warn",
                        f"{alarm.reason}; recovery will not publish it: "
                        "see docs/operations.md#lost-staging",
                        xid=r.xid,
                    )
                )
                continue
        r_age = now - r.created_at
        if r_age > stuck_after:
            w.append(
                Finding(
                    "stuck-prepared",
                    "warn",
                    f"xid {r.xid} (batch {r.batch}) of job {job} has been PREPARED for "
                    f"{r_age:.0f}s "
                    f"(> {stuck_after:g}s) with {r.rows} rows not yet published; "
                    + (
                        "the live writer should finish it; if it does not, "
                        if live
                        else "no live writer will finish it: "
                    )
                    + f"run `txsink recover --job {job}`",
                    xid=r.xid,
                )
            )
    if not live:
        for st in status.staging:
            if st.referenced_by == "prepared":
                continue
            why = (
                f"xid {st.xid} is COMMITTED (leftover)"
                if st.referenced_by == "committed"
                else f"no PREPARED xid references it (xid {st.xid} never prepared)"
            )
            w.append(
                Finding(
                    "orphan-staging",
                    "warn",
                    f"staging table {staging_database}.{st.table} "
                    f"({st.rows} rows, {st.bytes} bytes) "
                    f"is orphaned: {why} and no live writer holds job {job}; "
                    f"`txsink recover --job {job}` drops it",
                    table=st.table,
                    xid=st.xid,
                )
            )
    evicted = int(ledger.get("evicted_partitions", 0) or 0)
    if evicted:
        w.append(
            Finding(
                "ledger-evicted",
                "info",
                f"the ledger of job {job} keeps per-partition totals of its "
                f"{LEDGER_PARTITIONS} most recently written partitions; {evicted} eviction(s) "
                f"folded {int(ledger.get('evicted_rows', 0) or 0)} rows into one total, so "
                "`txsink verify` reconciles those partitions together, not one by one "
                "(see docs/operations.md#keeper-limits)",
            )
        )
    if is_recover_owner(owner):
        w.append(
            Finding(
                "fenced-writer",
                "info",
                f"job {job} was taken over by {owner.get('owner') if owner else '?'} (epoch "
                f"{status.epoch}); the writer that held it before "
                f"({(owner or {}).get('previous_owner') or '?'}) is fenced: its next commit fails "
                f"with FencedError. Restart that Spark query (a new run takes a new epoch)",
            )
        )
    elif owner and status.owner_epoch is not None and epoch and status.owner_epoch < epoch.number:
        w.append(
            Finding(
                "fenced-writer",
                "info",
                f"the last heartbeat of job {job} came from epoch {status.owner_epoch} but epoch "
                f"{epoch.number} ({epoch.owner}) now holds the job: the older writer is fenced",
            )
        )
    elif age is not None and age >= stale_after:
        busy = bool(prepared or status.staging)
        w.append(
            Finding(
                "stale-owner",
                "warn" if busy else "info",
                f"owner {status.owner} (epoch {status.epoch}) of job {job} last heartbeat "
                f"{age:.0f}s ago (> {stale_after:g}s, {explain(verdict)}): the writer "
                "is gone or idle"
                + (
                    f"; its unfinished work stays until `txsink recover --job {job}`"
                    if busy
                    else ""
                ),
            )
        )
    return status


def job_status(
    stores: Stores,
    job: str,
    *,
    now: float | None = None,
    stuck_after: float = DEFAULT_STUCK_AFTER,
    stale_after: float | None = DEFAULT_STALE_AFTER,
) -> JobStatus:
    """Read Keeper and ClickHouse for one job and :func:`assess` it."""
    registry = stores.registry
    meta = registry.job_meta(job) or {}
    warehouse = stores.warehouse(meta)
    records = registry.list(job)
    needed = [t for r in records if r.state is XidState.PREPARED for t in r.staging_tables]
    return assess(
        job,
        meta=meta,
        epoch=registry.current_epoch(job),
        owner=registry.owner(job),
        ledger=registry.ledger(job),
        records=records,
        staging_sizes=warehouse.staging_sizes(staging_prefix(job, registry.namespace())),
        staging_view=warehouse.staging_view(needed) if needed else {},
        now=time.time() if now is None else now,
        stuck_after=stuck_after,
        stale_after=stale_after,
        staging_database=warehouse.staging_db,
    )


def collect_status(
    stores: Stores,
    job: str | None = None,
    *,
    root: str = "",
    stuck_after: float = DEFAULT_STUCK_AFTER,
    stale_after: float | None = DEFAULT_STALE_AFTER,
) -> list[JobStatus]:
    """Status of ``job`` (ConfigError if it does not exist) or of every job."""
    now = time.time()
    return [
        job_status(stores, name, now=now, stuck_after=stuck_after, stale_after=stale_after)
        for name in resolve_jobs(stores.registry, job, root)
    ]


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
    meta = registry.job_meta(job) or {}
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
            ops = plans.plan_publish(record, warehouse.staging_view(record.staging_tables))
            view.expected_alarms += [op.reason for op in ops if isinstance(op, plans.Alarm)]
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
    meta = registry.job_meta(job) or {}
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
