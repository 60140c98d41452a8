"""The driver-side committer: takes the job over for a run, commits or aborts a batch.

Executors write (:mod:`txsink.spark.writer`); this module, next to the
:class:`~txsink.transactor.Transactor` it drives, turns the tasks' reports into one
transaction: the run's writer epoch (a takeover fences every older run and recovers
the job), the checks the cached validation could have missed (the tasks' mode, new
materialized views, staging on another replica), the prepare/publish/record of the
Transactor, the sweep of losing attempts' staging; or the roll-back of a failed batch.
It asks :mod:`txsink.protocol.job` for every job-level decision and decides none.

Spark-free: a plan and a task report are read through :class:`Plan` and :class:`Report`
(the Spark layer's :class:`~txsink.spark.messages.WritePlan` and
:class:`~txsink.spark.messages.TxCommitMessage` fit them).

Takeover: a Spark streaming query runs its driver-side ``commit`` in a fresh Python
worker for every micro-batch, so nothing survives in memory between batches. What
identifies one query *run* is Spark's run id (the ``spark.jobGroup.id`` executors see,
carried here in the task reports). The first commit of a run takes a new writer epoch in
Keeper and recovers the job; later commits of the same run find their run id as the
epoch's owner and go straight on. A run that was once superseded can never take the job
back (``runs/<run id>`` remembers it).
"""

from __future__ import annotations

import dataclasses
import logging
import uuid
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from txsink.config import WriterConfig
from txsink.driver import JobHandle, borrowed_job, job_meta, open_job
from txsink.errors import ConfigError, FencedError, TxSinkError, UnavailableError
from txsink.ports.registry import BatchView
from txsink.ports.warehouse import CommitLook
from txsink.protocol import commit as commit_plan
from txsink.protocol import job as rules
from txsink.protocol.commit import RecoveryReport
from txsink.protocol.ids import batch_xid, parse_staging, run_tag
from txsink.protocol.ops import Gathered
from txsink.protocol.states import Epoch, Mode, StagedPart, Visibility
from txsink.protocol.visibility import gathering

log = logging.getLogger(__name__)


class Plan(Protocol):
    """What the committer reads of a write plan."""

    @property
    def config(self) -> WriterConfig: ...
    @property
    def mode(self) -> str: ...
    @property
    def target_info(self) -> Any: ...
    @property
    def run_id(self) -> str: ...
    @property
    def xid(self) -> str | None: ...
    @property
    def batch(self) -> int | None: ...
    @property
    def namespace(self) -> str: ...
    @property
    def streaming(self) -> bool: ...


class Report(Protocol):
    """What the committer reads of one task's commit message."""

    @property
    def run_id(self) -> str: ...
    @property
    def parts(self) -> tuple[StagedPart, ...]: ...
    @property
    def staging(self) -> tuple[str, ...]: ...
    @property
    def inserted(self) -> tuple[tuple[str, int], ...]: ...
    @property
    def skipped(self) -> bool: ...
    @property
    def rows(self) -> int: ...
    @property
    def extra(self) -> dict[str, Any]: ...


Write = tuple[Plan, Sequence[Report]]


# ------------------------------------------------------------------------- takeover


def epoch_for_run(
    handle: JobHandle,
    run_id: str,
    mode: str,
    keep: Iterable[str] = (),
    query_id: str = "",
    targets: dict[str, str] | None = None,
    view: BatchView | None = None,
) -> Epoch:
    """The epoch of ``run_id``: the current one if the run owns the job, else a takeover
    (:meth:`Transactor.take_run`). ``keep`` lists staging tables of the batch being
    committed: the takeover's recovery must not roll them back. ``view``: the job's state
    read (synced) by the caller."""
    meta = job_meta(handle.config, mode, query_id, targets)
    current = commit_plan.UNREAD if view is None else view.epoch
    return handle.transactor.take_run(run_id, meta, keep=keep, current=current)[0]


# ------------------------------------------------------------------------- checks


def batch_mode(plan: Plan, msgs: Sequence[Report], xid: str) -> Mode:
    """The one mode every task of the batch wrote in; ConfigError where
    :func:`txsink.protocol.job.written_mode_refusal` refuses the batch."""
    written = {str(m.extra["mode"]) for m in msgs if not m.skipped and m.extra.get("mode")}
    refusal = rules.written_mode_refusal(
        plan.config.job, xid, plan.config.table, written, plan.mode
    )
    if refusal:
        raise ConfigError(refusal)
    return Mode(plan.mode)


def refuse_new_views(plan: Plan, xid: str, views: Sequence[str]) -> None:
    """Attach mode publishes past materialized views: refuse the batch if one appeared on
    the target since validation (validation is cached, and tasks may have run long)."""
    if views:
        raise ConfigError(
            f"job {plan.config.job}: materialized view(s) {', '.join(views)} now read from "
            f"{plan.config.table}; attach mode would publish xid {xid} past them (they would "
            f"never see its rows). Nothing was published. Stop the query, run `txsink mode "
            f"--job {plan.config.job} --set dedup`, and restart it: the batch is written again "
            f"in dedup mode, through the views"
        )


def staged_parts(
    handle: Any,
    plan: Plan,
    msgs: Sequence[Report],
    xid: str,
    *,
    views: bool = False,
    listing: str | None = None,
) -> tuple[list[StagedPart], CommitLook]:
    """The manifest entries of one write's attach tasks, read from every staging table they
    report in one statement (per shard), before the prepare: each table must hold exactly
    the rows its task sent (:attr:`TxCommitMessage.inserted`). A dedup task's message
    carries its entries. A table missing behind a replicated target means staging went to
    another replica: a URL that leads to several (a load balancer) would let the tasks
    stage on one and the driver's MOVE run on another. The same statement reads the bytes
    staged per partition id, the target's materialized views (``views``: refused if any)
    and the staging tables named ``listing*`` (:meth:`Warehouse.commit_look`); refuses a
    staging table unfit to publish (a task sends its CREATE without reading it back)."""
    sent = {t: n for m in msgs for t, n in m.inserted}
    parts = [p for m in msgs if not m.inserted for p in m.parts]
    if not sent and not views and listing is None:
        return parts, CommitLook({})
    info = plan.target_info
    written = set(getattr(plan, "written", ()))
    validated = (  # a sharded job's shards may differ: each checked its own at the task
        tuple((c.name, c.type) for c in info.columns if not written or c.name in written)
        if sent and info is not None and not plan.config.shards
        else None
    )
    look = handle.warehouse.commit_look(
        sent, views_of=plan.config.table if views else None, listing=listing, validated=validated
    )
    refuse_new_views(plan, xid, look.views)
    if look.unfit:
        table, why = min(look.unfit.items())
        raise TxSinkError(
            f"job {plan.config.job}: xid {xid}: staging table "
            f"{handle.warehouse.staging_db}.{table} cannot be published: {why} (the target "
            f"{plan.config.table} changed while the batch ran, or the server ignored the "
            f"SETTINGS of CREATE TABLE ... AS). Nothing was committed; the batch is rolled "
            f"back and, on retry or restart, written again against the target as it is now"
        )
    now = look.target_types  # read with the views: the target as it is now
    changed = [
        f"{n} ({t} -> {now.get(n, 'dropped')})"
        for n, t in validated or ()
        if now and now.get(n) != t
    ]
    if changed:  # a MOVE or ATTACH would fail after the prepare, for an operator to repair
        raise TxSinkError(
            f"job {plan.config.job}: xid {xid}: the target {plan.config.table} changed while "
            f"the batch ran: column(s) {', '.join(changed)}. Nothing was committed; the batch "
            f"is rolled back and, on retry or restart, written again against the target as "
            f"it is now"
        )
    missing = sorted(t for t, staged in look.staged.items() if staged is None)
    if missing and info is not None and info.is_replicated:
        raise ConfigError(
            f"job {plan.config.job}: xid {xid}: staging table(s) {', '.join(missing[:3])} "
            f"written by this batch's tasks are not on the replica of {plan.config.table} "
            f"the driver reaches: the url (or a shard URL) leads to more than one server "
            f"(a load balancer?). Nothing was committed; name one server per shard, or use "
            f"mode=dedup. Tables left on the other replica are dropped by `txsink recover "
            f"--job {plan.config.job}` pointed at it"
        )
    for table, n in sorted(sent.items()):
        staged = look.staged.get(table) or {}
        held = sum(rows for rows, _ in staged.values())
        if held != n:
            raise TxSinkError(
                f"job {plan.config.job}: xid {xid}: staging table "
                f"{handle.warehouse.staging_db}.{table} holds {held} rows after its task "
                f"inserted {n}; nothing was committed (the batch is retried; `txsink recover "
                f"--job {plan.config.job}` drops the staging)"
            )
        parts += [StagedPart(table, pid, k, uuids=u) for pid, (k, u) in sorted(staged.items()) if k]
    return parts, look


# ------------------------------------------------------------------------- commit


def commit_batch(plan: Plan, msgs: Sequence[Report], batch_id: int | None) -> dict[str, Any]:
    """Prepare + publish + record one batch. Returns the commit result as a dict."""
    xid = plan.xid or batch_xid(int(batch_id or 0))
    batch = plan.batch if plan.xid is not None else batch_id
    mode = batch_mode(plan, msgs, xid)
    return commit_writes([(plan, msgs)], xid, batch, mode, streaming=plan.streaming)


def commit_writes(
    writes: Sequence[Write],
    xid: str,
    batch: int | None,
    mode: Mode,
    *,
    streaming: bool,
    targets: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Prepare ONE xid whose manifest holds the staged parts of every write (each entry
    with its table), publish it, record it. One write is a single-table batch;
    ``targets`` (every table and its mode) makes it a :func:`txsink.transaction`, whose
    record's ``target`` is the job's own table (:func:`txsink.protocol.job.primary_target`)."""
    config = writes[0][0].config
    with borrowed_job(config) as handle:
        return _commit_writes(handle, writes, xid, batch, mode, streaming, targets)


def _commit_writes(
    handle: JobHandle,
    writes: Sequence[Write],
    xid: str,
    batch: int | None,
    mode: Mode,
    streaming: bool,
    targets: dict[str, str] | None,
) -> dict[str, Any]:
    from txsink.metrics import count, record_commit, serve

    config = handle.config
    serve(config)  # the scrape endpoint (metrics_port), once per process
    msgs = [m for _, ms in writes for m in ms]
    if targets:
        stored = rules.JobFacts.of(handle.registry.job_meta(config.job))
        config = dataclasses.replace(config, table=rules.primary_target(stored, targets))
        handle.config = config
    run_id = (msgs[0].run_id if msgs else "") or writes[0][0].run_id
    if not run_id:
        current = handle.registry.current_epoch(config.job)
        run_id = current.owner if current else f"adhoc-{uuid.uuid4().hex}"
    incoming = {t for m in msgs for t in m.staging}
    query_id = next((m.extra.get("query_id", "") for m in msgs if m.extra), "")
    if writes[0][0].namespace:  # the store's id the tasks named their staging with
        handle.transactor.namespace = writes[0][0].namespace
    try:
        # Synced: a new Python worker's session may sit on a server that has not seen
        # this run take the job yet (it would take it over again from itself), and the
        # batch's decisive reads must not show a record as it was before another runner
        # moved it. One round trip reads all three.
        handle.registry.sync(config.job)
        view: BatchView | None = handle.registry.batch_view(config.job, xid)
        epoch, took = handle.transactor.take_run(
            run_id, job_meta(config, mode.value, query_id, targets), keep=incoming,
            current=commit_plan.UNREAD if view is None else view.epoch,
        )  # fmt: skip
        if took is not None:  # this commit took the job over
            view = None  # its recovery moved records and the ledger: read them again
            count(config, recoveries=1, **rolled_forward_at_takeover(handle, took))
        if targets:  # a run checks the job's identity at takeover only: tables per batch
            stored = rules.JobFacts.of(handle.registry.job_meta(config.job))
            refusal = rules.tables_refusal(config.job, stored, targets)
            if refusal:
                raise ConfigError(refusal)
        parts: list[StagedPart] = []
        gather: dict[str, Gathered] = {}
        strays: list[str] = []
        # attach mode: the job's staging, listed by the first write's read; what no task
        # message names of this xid and of the stream's previous batch (losing attempts,
        # late ones too) is dropped once the batch is committed
        listing = f"{handle.transactor.prefix}__" if mode is Mode.ATTACH else None
        for plan, ms in writes:
            views = mode is Mode.ATTACH and any(m.staging for m in ms)
            found, look = staged_parts(handle, plan, ms, xid, views=views, listing=listing)
            parts += [dataclasses.replace(p, target=plan.config.table) for p in found]
            strays += [t for t in look.listed if t not in incoming]
            listing = None
            engine = plan.target_info.engine if plan.target_info is not None else ""
            how = gathering(
                engine, found, look.columns, look.sizes, plan.config.compact_bytes, look.shape
            )
            if how is not None:
                gather[plan.config.table] = how
        # one xid is published one way: batch only if every table's validation chose it
        batch_visible = mode is Mode.ATTACH and all(
            plan.config.visibility == Visibility.BATCH for plan, _ in writes
        )
        result = handle.transactor.commit_batch(
            epoch, xid, batch, config.table, parts, mode, streaming=streaming,
            tables=sorted(targets) if targets else (),
            visibility=Visibility.BATCH if batch_visible else Visibility.PARTITION,
            own_batches=streaming, first_batch=config.first_batch,
            gather=gather, synced=True,
            seen=None if view is None else (view.record, view.ledger),
        )  # fmt: skip
    except FencedError:
        count(config, fencing_events=1)
        raise
    previous = batch_xid(batch - 1) if streaming and batch and xid == batch_xid(batch) else ""
    sweep_strays(handle, (xid, previous) if previous else (xid,), strays)
    record_commit(config, result)
    return dict(result.__dict__)


def rolled_forward_at_takeover(handle: JobHandle, report: RecoveryReport) -> dict[str, int]:
    """The batches (and their rows) the takeover's recovery just rolled forward, for the
    metrics: a few record reads, only when there were any."""
    from txsink.metrics import store_of

    if not report.rolled_forward or store_of(handle.config) is None:
        return {}
    rows = 0
    for xid in report.rolled_forward:
        record = handle.registry.get(handle.config.job, xid)
        rows += record.rows if record is not None else 0
    return {"batches_rolled_forward": len(report.rolled_forward), "rows_committed": rows}


def sweep_strays(handle: Any, xids: Sequence[str], strays: Iterable[str]) -> None:
    """Drop the staging of ``xids`` among ``strays`` (tables no task message named, listed
    before the prepare): losing speculative attempts of the batch just committed, and of
    the stream's previous batch those that made their staging after its commit read.
    Behind each xid's record like every roll-back (:meth:`Transactor.roll_back`): a table
    a record names is left to its publish. A failure is logged, never raised: the batch
    is committed, and the job's next takeover or ``txsink recover`` drops what is left."""
    by_xid: dict[str, list[str]] = {}
    for table in strays:
        parsed = parse_staging(table)
        if parsed is not None and parsed.xid in xids:
            by_xid.setdefault(parsed.xid, []).append(table)
    for xid, tables in sorted(by_xid.items()):
        try:
            handle.transactor.roll_back(xid, sorted(tables))
        except TxSinkError as exc:  # never report a committed batch failed for this
            log.warning(
                "job %s: dropping losing attempts' staging %s of xid %s failed (%s): the "
                "job's next takeover or `txsink recover` drops it", handle.config.job,
                tables, xid, exc,
            )  # fmt: skip


# ------------------------------------------------------------------------- abort


def abort_batch(plan: Plan, msgs: Sequence[Report], batch_id: int | None) -> None:
    """Tasks failed (or commit raised). Roll their staging back.

    The roll-back writes an ABORTED tombstone on the xid node before dropping anything,
    so it is safe even if a prepare whose reply was lost lands later, or if this read of
    Keeper lags: a prepare that won keeps its staging, one that comes later cannot adopt
    what was dropped (:meth:`Transactor.roll_back`).
    """
    xid = plan.xid or batch_xid(int(batch_id or 0))
    tables = {t for m in msgs for t in m.staging}
    runs = {run_tag(r) for r in [plan.run_id, *(m.run_id for m in msgs)] if r}
    try:
        handle = open_job(plan.config)
    except UnavailableError as exc:
        log.warning("abort of xid %s: cannot reach stores (%s); recovery will clean up", xid, exc)
        return
    try:
        # also attempts that died after creating their staging (no message): same xid, same run
        for table in handle.warehouse.list_staging(handle.transactor.prefix):
            parsed = parse_staging(table)
            if parsed is not None and parsed.xid == xid and parsed.run in runs:
                tables.add(table)
        handle.transactor.roll_back(xid, sorted(tables))
    except UnavailableError as exc:
        log.warning("abort of xid %s: stores unavailable (%s); recovery will clean up", xid, exc)
    finally:
        handle.close()
