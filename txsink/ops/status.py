"""Operator views of jobs (``txsink status``); the recovery built on them is
:mod:`txsink.ops.recovery`, the stores they read :mod:`txsink.ops.stores`.

Everything here returns plain dataclasses; the CLI (:mod:`txsink.cli.ops_cmd`) renders
them. Reads only.

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
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from txsink.clickhouse.observe import DEFAULT_STAGING_DB
from txsink.dedup_state import open_dedup_batches
from txsink.ops.anomalies import DEFAULT_STUCK_AFTER
from txsink.ops.liveness import (
    RECOVER_OWNER_PREFIX,
    Liveness,
    explain,
    heartbeat_age,
    is_finished,
    is_recover_owner,
    judge,
)
from txsink.ops.stores import Stores
from txsink.ports.ledger import LEDGER_PARTITIONS
from txsink.protocol.codec import (
    JobMeta,
    Ledger,
    OwnerInfo,
    as_job_meta,
    as_ledger,
    as_owner,
)
from txsink.protocol.dedup import OpenBatch
from txsink.protocol.ids import parse_staging, staging_prefix
from txsink.protocol.ops import Alarm
from txsink.protocol.planner import plan_publish
from txsink.protocol.states import Epoch, Mode, XidRecord, XidState

log = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_STALE_AFTER",
    "JobStatus",
    "assess",
    "collect_status",
    "job_status",
    "liveness_of",
    "recover_owner",
    "writer_is_live",
]

# None: the stale threshold follows the job's commit cadence (txsink.ops.liveness).
DEFAULT_STALE_AFTER: float | None = None
RECOVERED_STATE = "recovered"


def recover_owner() -> str:
    """The owner name recovery takes epochs under (``txsink-recover@host:pid``)."""
    return f"{RECOVER_OWNER_PREFIX}{socket.gethostname()}:{os.getpid()}"


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
    # the writer in one word: live | gone | finished (a batch write done) | recovered
    # (txsink recover holds the job) | none (no writer took it yet)
    writer: str = "none"
    beat_s: float | None = None  # the heartbeat interval a writer inside a commit declared

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["warnings"] = [w.to_json() for w in self.warnings]
        data["attention"] = self.attention
        for p in data["pending"]:  # a table's name is data, never a JSON key
            p["tables"] = [{"table": t, "rows": n} for t, n in p["tables"].items()]
        return data

    @property
    def attention(self) -> str | None:
        """The kind of the worst warning (warn before info), None when there is none."""
        ranked = sorted(self.warnings, key=lambda w: LEVELS.get(w.level, 0), reverse=True)
        return ranked[0].kind if ranked else None

    def urgency(self) -> tuple[int, int, int]:
        """Higher needs attention sooner: the worst warning's level, xids not yet
        committed, then a writer that is not live (sort by this, descending)."""
        worst = max((LEVELS.get(w.level, 0) for w in self.warnings), default=0)
        return worst, len(self.pending), int(self.writer == "gone")


#: how much a warning's level needs attention (status sorts jobs by it)
LEVELS = {"warn": 2, "info": 1}


def writer_is_live(
    owner: OwnerInfo | Mapping[str, Any] | None,
    now: float,
    stale_after: float | None = None,
    records: Iterable[XidRecord] = (),
) -> bool:
    """Whether a writer may be mid-batch: a fresh heartbeat that is not recovery's mark."""
    return liveness_of(owner, records, now, stale_after).live


def liveness_of(
    owner: OwnerInfo | Mapping[str, Any] | None,
    records: Iterable[XidRecord],
    now: float,
    stale_after: float | None = None,
    staging: Mapping[str, Mapping[str, float]] | None = None,
) -> Liveness:
    """:func:`txsink.ops.liveness.judge` on ``records`` (the commit times; when the
    newest PREPARED xid of the owner's epoch was prepared) and ``staging`` (the
    job's staging tables as :meth:`Warehouse.staging_sizes` gives them: the newest
    ``modified`` of a table no record references is a run at work)."""
    records = list(records)
    info = as_owner(owner)
    times = [r.committed_at for r in records if r.state is XidState.COMMITTED]
    prepared = [
        r.created_at
        for r in records
        if r.state is XidState.PREPARED and info is not None and r.epoch == info.epoch
    ]
    known = {r.xid for r in records}
    written = [
        float(size["modified"])
        for table, size in (staging or {}).items()
        if size.get("modified") and _xid_of(table) not in ("", *known)
    ]
    return judge(
        owner,
        times,
        now,
        stale_after,
        prepared_at=max(prepared, default=None),
        staged_at=max(written, default=None),
    )


def _xid_of(table: str) -> str:
    parsed = parse_staging(table)
    return parsed.xid if parsed is not None else ""


def assess(
    job: str,
    *,
    meta: JobMeta | Mapping[str, Any],
    epoch: Epoch | None,
    owner: OwnerInfo | Mapping[str, Any] | None,
    ledger: Ledger | Mapping[str, Any],
    records: Iterable[XidRecord],
    staging_sizes: Mapping[str, Mapping[str, float]],
    staging_view: Mapping[str, Mapping[str, int] | None],
    now: float,
    stuck_after: float = DEFAULT_STUCK_AFTER,
    stale_after: float | None = DEFAULT_STALE_AFTER,
    staging_database: str = DEFAULT_STAGING_DB,
    open_dedup: Sequence[OpenBatch] = (),
) -> JobStatus:
    """The status of one job from what Keeper and ClickHouse show (pure).

    ``open_dedup``: the job's dedup batches stopped half-way
    (:func:`txsink.dedup_state.open_dedup_batches`).

    ``staging_view`` holds rows per partition of the staging tables PREPARED xids need
    (None for a missing table), as :meth:`ClickHouseWarehouse.staging_view` returns it.
    """
    records = list(records)
    job_meta = as_job_meta(meta) or JobMeta()
    totals = as_ledger(ledger)
    info = as_owner(owner)
    age = heartbeat_age(info, now)
    verdict = liveness_of(info, records, now, stale_after, staging_sizes)
    live, stale_after = verdict.live, verdict.stale_after_s
    last_at = totals.last_commit_at
    status = JobStatus(
        job=job,
        target=job_meta.target,
        mode=job_meta.mode,
        staging_database=staging_database,
        epoch=epoch.number if epoch else None,
        owner=epoch.owner if epoch else None,
        owner_epoch=None if info is None else info.epoch,
        owner_state=None if info is None else info.state or None,
        heartbeat_age=None if age is None else round(age, 1),
        live=live,
        cadence_s=verdict.cadence_s,
        stale_after_s=verdict.stale_after_s,
        stale_after_source=verdict.stale_after_source,
        committed=totals.committed,
        rows_committed=totals.rows,
        last_batch=totals.last_batch,
        last_commit_at=last_at,
        last_commit_age=None if last_at is None else round(max(0.0, now - last_at), 1),
        targets=sorted(job_meta.targets),
        beat_s=verdict.beat_s,
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

    status.writer = _writer_word(epoch, info, verdict, busy=bool(status.pending or status.staging))
    w = status.warnings
    for r in prepared:
        if r.mode is Mode.ATTACH:
            alarm = next(
                (op for op in plan_publish(r, staging_view) if isinstance(op, Alarm)),
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
        elif live:  # a commit under way, or a writer killed inside one: say which, when
            # the age the verdict used: inside a commit, the younger of the beat and prepare
            wait = max(0.0, stale_after - (verdict.heartbeat_age or 0.0))
            w.append(
                Finding(
                    "pending-prepared",
                    "info",
                    f"xid {r.xid} (batch {r.batch}) of job {job} PREPARED {r_age:.0f}s ago "
                    f"with {r.rows} rows: the live writer publishes it. If that writer was "
                    f"killed, `txsink recover --job {job}` rolls it forward once nothing "
                    f"came from it for {stale_after:g}s (in {wait:.0f}s), or at once with "
                    "--force (fencing the writer)",
                    xid=r.xid,
                )
            )
    state_of = {r.xid: r.state for r in records}
    for b in open_dedup:
        if live and state_of.get(b.xid) is not XidState.ABORTED:
            continue  # the live writer's batch in flight
        w.append(
            Finding(
                "half-visible-dedup",
                "warn",
                f"dedup-mode batch {b.xid} of job {job} stopped half-way: {b.describe()} "
                f"may be in {job_meta.target or 'the target'}. The job writes no other "
                f"batch until it is rerun (it then resumes and commits exactly once) or, "
                f"after its rows are deleted, discarded with `txsink recover --job {job} "
                f"--discard-dedup {b.xid}`: see docs/modes.md#a-dedup-batch-stopped-half-way",
                xid=b.xid,
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
    evicted = totals.evicted_partitions
    if evicted:
        w.append(
            Finding(
                "ledger-evicted",
                "info",
                f"the ledger of job {job} keeps per-partition totals of its "
                f"{LEDGER_PARTITIONS} most recently written partitions; {evicted} eviction(s) "
                f"folded {totals.evicted_rows} rows into one total, so "
                "`txsink verify` reconciles those partitions together, not one by one "
                "(see docs/operations.md#keeper-limits)",
            )
        )
    if is_recover_owner(owner):
        w.append(
            Finding(
                "fenced-writer",
                "info",
                f"job {job} was taken over by {info.owner if info else '?'} (epoch "
                f"{status.epoch}); the writer that held it before "
                f"({(info.details.get('previous_owner') if info else None) or '?'}) is fenced: "
                f"its next commit fails "
                f"with FencedError. Restart that Spark query (a new run takes a new epoch)",
            )
        )
    elif info and status.owner_epoch is not None and epoch and status.owner_epoch < epoch.number:
        w.append(
            Finding(
                "fenced-writer",
                "info",
                f"the last heartbeat of job {job} came from epoch {status.owner_epoch} but epoch "
                f"{epoch.number} ({epoch.owner}) now holds the job: the older writer is fenced",
            )
        )
    elif age is not None and age >= stale_after and status.writer != "finished":
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


def _writer_word(
    epoch: Epoch | None, owner: OwnerInfo | None, verdict: Liveness, *, busy: bool
) -> str:
    """``busy``: the job has xids not yet committed or staging (a finished writer's job
    with either is judged live or gone like any other)."""
    if epoch is None:
        return "none"
    if is_recover_owner(owner):
        return "recovered"
    if is_finished(owner) and not busy:
        return "finished"
    return "live" if verdict.live else "gone"


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
    meta = registry.job_meta(job) or JobMeta()
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
        open_dedup=open_dedup_batches(registry, job),
    )


def collect_status(
    stores: Stores,
    jobs: list[str],
    *,
    stuck_after: float = DEFAULT_STUCK_AFTER,
    stale_after: float | None = DEFAULT_STALE_AFTER,
) -> list[JobStatus]:
    """Status of each of ``jobs`` (names :func:`resolve_jobs` gave), most urgent first
    (:meth:`JobStatus.urgency`), then by name."""
    now = time.time()
    found = [
        job_status(stores, name, now=now, stuck_after=stuck_after, stale_after=stale_after)
        for name in jobs
    ]
    found.sort(key=lambda j: j.job)
    found.sort(key=JobStatus.urgency, reverse=True)
    return found
