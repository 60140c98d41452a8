"""What runs inside Spark: the executor-side write of one partition and the driver-side
commit / abort of one batch. Shared by the streaming and the batch writer classes.

Executors know the batch from Spark's local property ``streaming.sql.batchId`` and the
query run from ``spark.jobGroup.id`` (Spark sets both for every micro-batch job). The
commit message is small and picklable: the staging tables and their row counts per
target partition.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pyspark.sql.datasource import WriterCommitMessage

from txsink.config import WriterConfig
from txsink.errors import ConfigError, FencedError, SchemaMismatch, TxSinkError, UnavailableError
from txsink.faults import fault_point
from txsink.protocol.ids import batch_xid, parse_staging, run_tag, staging_name
from txsink.protocol.states import Mode, StagedPart, Visibility, XidState

if TYPE_CHECKING:
    from txsink.driver import JobHandle

log = logging.getLogger(__name__)

BATCH_ID_PROPERTY = "streaming.sql.batchId"
RUN_ID_PROPERTY = "spark.jobGroup.id"
QUERY_ID_PROPERTY = "sql.streaming.queryId"


@dataclass(frozen=True)
class WritePlan:
    """Everything a task needs, decided and validated once on the driver."""

    config: WriterConfig
    mode: str  # "attach" | "dedup" (auto is resolved on the driver)
    not_null: tuple[str, ...] = ()  # target columns that are not Nullable
    target_info: Any = None  # the target's TargetInfo as validation saw it (attach mode)
    shard_infos: tuple[Any, ...] = ()  # a sharded job: the target on each shard, in order
    xid: str | None = None  # batch saves: fixed xid; streaming: from the batch id
    run_id: str = ""  # batch saves: one run per save; streaming: Spark's run id
    batch: int | None = None
    namespace: str = ""  # the Keeper store's id: part of staging names (ids.staging_prefix)

    def target_on(self, shard: int) -> Any:
        """The target as validation saw it on ``shard`` (its replica name, Keeper path)."""
        return self.shard_infos[shard] if shard < len(self.shard_infos) else self.target_info

    @property
    def streaming(self) -> bool:
        """Batch ids are Spark micro-batch ids (format streaming, or foreach_batch)."""
        return self.xid is None or self.config.micro_batch


@dataclass
class TxCommitMessage(WriterCommitMessage):
    run_id: str
    xid: str
    batch: int | None
    parts: tuple[StagedPart, ...] = ()
    staging: tuple[str, ...] = ()
    skipped: bool = False
    rows: int = 0
    seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


def task_identity(plan: WritePlan) -> tuple[str, str, int | None, Any]:
    """(run id, xid, batch, TaskContext) of the running task."""
    from pyspark import TaskContext

    ctx = TaskContext.get()
    if ctx is None:
        raise TxSinkError("txsink writers must run inside a Spark task")
    if plan.xid is not None:
        return plan.run_id, plan.xid, plan.batch, ctx
    raw = ctx.getLocalProperty(BATCH_ID_PROPERTY)
    if raw is None:
        raise TxSinkError("no streaming batch id in this task; is this a streaming query?")
    batch = int(raw)
    run_id = ctx.getLocalProperty(RUN_ID_PROPERTY) or plan.run_id
    return run_id, batch_xid(batch), batch, ctx


def check_nulls(plan: WritePlan, batch: Any) -> None:
    """Refuse nulls bound for a non-Nullable column (ClickHouse would store a default)."""
    for name in plan.not_null:
        idx = batch.schema.get_field_index(name)
        if idx >= 0 and batch.column(idx).null_count:
            raise SchemaMismatch(
                f"column {name!r} of {plan.config.table} is not Nullable but the DataFrame has "
                f"{batch.column(idx).null_count} null value(s) in it; fill them (df.fillna / "
                f"coalesce) or make the column Nullable. Nothing was published."
            )


def _guarded(plan: WritePlan, batches: Iterator[Any], block_rows: int) -> Iterator[Any]:
    """Yield batches after the null check; fire ``executor.mid_write`` once a block went out."""
    sent = 0
    for batch in batches:
        check_nulls(plan, batch)
        if sent >= block_rows:
            fault_point("executor.mid_write")
        sent += batch.num_rows
        yield batch
    fault_point("executor.mid_write")


def already_committed(plan: WritePlan, xid: str, batch: int | None) -> bool:
    """Is ``xid`` committed already (a replay)? Unknown counts as no: writing is safe.

    A batch at or below the ledger's last committed batch whose record retention pruned
    counts as committed (batch ids are monotonic; see ``plans.decide_batch``)."""
    if not plan.config.skip_committed_replays:
        return False
    if plan.xid is not None and plan.batch is None:
        # a batch save without txn_version: its xid is fresh random hex drawn by this save's
        # driver and is committed only after every task finished, so no task can find it
        # committed; skipping the check saves a Keeper session per task
        return False
    from txsink.driver import borrowed_registry

    job = plan.config.job
    last = None
    try:
        with borrowed_registry(plan.config) as registry:
            record = registry.get(job, xid)
            if record is None and batch is not None:
                last = registry.ledger(job).last_batch
    except UnavailableError:
        return False
    if record is not None:
        if record.state is XidState.PREPARED and record.mode.value != plan.mode:
            raise ConfigError(
                f"job {job}: xid {xid} is PREPARED in mode {record.mode.value} but this task "
                f"writes in mode {plan.mode}; nothing was written. Run `txsink recover --job "
                f"{job}` to finish it in its own mode, then restart"
            )
        return record.state is XidState.COMMITTED
    return batch is not None and last is not None and batch <= int(last)


def write_partition(plan: WritePlan, batches: Iterator[Any]) -> TxCommitMessage:
    """Executor: write one task attempt's rows (attach: into its own staging table)."""
    started = time.time()
    run_id, xid, batch, ctx = task_identity(plan)
    # the mode travels with the message: the commit refuses a batch whose tasks wrote in
    # another mode than the one it would publish in (issue: mode changed mid-batch)
    ident = {"query_id": ctx.getLocalProperty(QUERY_ID_PROPERTY) or "", "mode": plan.mode}
    if already_committed(plan, xid, batch):
        for _ in batches:  # drain: Spark expects the input consumed
            pass
        log.info(
            "job %s: xid %s already committed; skipping the replayed write", plan.config.job, xid
        )
        return TxCommitMessage(
            run_id, xid, batch, skipped=True, seconds=time.time() - started, extra=ident
        )
    if plan.mode == Mode.DEDUP.value:
        from txsink.spark.dedup_write import write_partition_dedup

        message: TxCommitMessage = write_partition_dedup(
            plan, batches, run_id, xid, batch, ctx, started
        )
        return message
    first = next(batches, None)
    if first is None:
        return TxCommitMessage(run_id, xid, batch, seconds=time.time() - started, extra=ident)
    from txsink.driver import borrowed_warehouse

    with borrowed_warehouse(plan.config) as warehouse:
        return _stage(plan, warehouse, first, batches, (run_id, xid, batch, ctx), ident, started)


def _stage(
    plan: WritePlan,
    warehouse: Any,
    first: Any,
    batches: Iterator[Any],
    task: tuple[str, str, int | None, Any],
    ident: dict[str, Any],
    started: float,
) -> TxCommitMessage:
    """Executor, attach mode: one task attempt's rows into its own staging table (a
    sharded job: one per shard the rows go to, on that shard)."""
    run_id, xid, batch, ctx = task
    cfg = plan.config

    def name_on(shard: int | None) -> str:
        return staging_name(
            cfg.job,
            xid,
            run_tag(run_id),
            ctx.partitionId(),
            ctx.attemptNumber(),
            ctx.taskAttemptId(),
            plan.namespace,
            shard=shard,
        ).table

    def chained() -> Iterator[Any]:
        yield first
        yield from batches

    rows = _guarded(plan, chained(), cfg.block_rows)
    created: list[str] = []
    try:
        if cfg.shards:
            sent = _stage_sharded(plan, warehouse, rows, name_on, created, ctx.partitionId())
        else:
            name = name_on(None)
            warehouse.create_staging(cfg.table, name, plan.target_info)
            created.append(name)
            stats = warehouse.insert_blocks(
                name, rows, block_rows=cfg.block_rows, block_bytes=cfg.block_bytes
            )
            sent = {name: stats.rows}
    except BaseException:
        # this attempt failed: its staging is garbage (Spark hands abort() no message
        # for a failed task). A hard crash skips this; recovery drops it then.
        with contextlib.suppress(TxSinkError, OSError):
            warehouse.drop_stagings(created)
        raise
    parts: list[StagedPart] = []
    for name, inserted in sent.items():
        staged = warehouse.staged_partitions(name)
        mine = [
            StagedPart(name, pid, n, uuids=uuids) for pid, (n, uuids) in sorted(staged.items()) if n
        ]
        total = sum(p.rows for p in mine)
        if total != inserted:
            raise TxSinkError(
                f"staging table {cfg.staging_database}.{name} holds {total} rows after "
                f"inserting {inserted}; refusing to report it (the batch will be retried)"
            )
        parts += mine
    return TxCommitMessage(
        run_id,
        xid,
        batch,
        tuple(parts),
        tuple(sent),
        rows=sum(sent.values()),
        seconds=time.time() - started,
        extra=ident,
    )


def _stage_sharded(
    plan: WritePlan,
    warehouse: Any,
    rows: Iterator[Any],
    name_on: Any,
    created: list[str],
    offset: int,
) -> dict[str, int]:
    """Cut every batch by shard (:func:`txsink.clickhouse.shards.split_by_shard`) and send
    each shard's rows to its own staging table on that shard, in blocks of at most
    ``block_rows`` / ``block_bytes`` (memory: one pending block per shard)."""
    from txsink.clickhouse.shards import split_by_shard

    cfg = plan.config
    pending: dict[int, list[Any]] = {}
    size: dict[int, tuple[int, int]] = {}
    names: dict[int, str] = {}
    sent: dict[str, int] = {}

    def flush(k: int) -> None:
        if not pending.get(k):
            return
        stats = warehouse.insert_blocks(
            names[k], pending.pop(k), block_rows=cfg.block_rows, block_bytes=cfg.block_bytes
        )
        size.pop(k, None)
        sent[names[k]] = sent.get(names[k], 0) + stats.rows

    for batch in rows:
        for k, piece in split_by_shard(batch, len(cfg.shards), cfg.shard_by, offset).items():
            if k not in names:
                names[k] = name_on(k)
                created.append(names[k])
                warehouse.create_staging(cfg.table, names[k], plan.target_on(k))
                sent[names[k]] = 0
            pending.setdefault(k, []).append(piece)
            n, b = size.get(k, (0, 0))
            size[k] = (n + piece.num_rows, b + piece.nbytes)
            if size[k][0] >= cfg.block_rows or size[k][1] >= cfg.block_bytes:
                flush(k)
        offset += batch.num_rows
    for k in list(pending):
        flush(k)
    return sent


def batch_mode(plan: WritePlan, msgs: list[TxCommitMessage], xid: str) -> Mode:
    """The one mode every task of the batch wrote in; ConfigError if they differ from each
    other or from the mode this commit resolved (the target or the pin changed under the
    batch). Nothing is prepared then: abort rolls the staging back and a replay rewrites
    the batch in the job's mode."""
    written = {str(m.extra["mode"]) for m in msgs if not m.skipped and m.extra.get("mode")}
    if written and written != {plan.mode}:
        raise ConfigError(
            f"job {plan.config.job}: the tasks of xid {xid} wrote in mode "
            f"{'/'.join(sorted(written))} but this commit resolves mode {plan.mode} for "
            f"{plan.config.table} (the job's mode was changed while the batch was in flight). "
            f"Nothing was published; restart the query and the batch is written again in mode "
            f"{plan.mode}"
        )
    return Mode(plan.mode)


def check_no_new_views(handle: Any, plan: WritePlan, xid: str) -> None:
    """Attach mode publishes past materialized views: refuse the batch if one appeared on
    the target since validation (validation is cached, and tasks may have run long)."""
    views = handle.warehouse.dependent_views(plan.config.table)
    if views:
        raise ConfigError(
            f"job {plan.config.job}: materialized view(s) {', '.join(views)} now read from "
            f"{plan.config.table}; attach mode would publish xid {xid} past them (they would "
            f"never see its rows). Nothing was published. Stop the query, run `txsink mode "
            f"--job {plan.config.job} --set dedup`, and restart it: the batch is written again "
            f"in dedup mode, through the views"
        )


def commit_batch(plan: WritePlan, messages: list[Any], batch_id: int | None) -> dict[str, Any]:
    """Driver: prepare + publish + record one batch. Returns the commit result as a dict."""
    msgs = [m for m in messages if isinstance(m, TxCommitMessage)]
    xid = plan.xid or batch_xid(int(batch_id or 0))
    batch = plan.batch if plan.xid is not None else batch_id
    mode = batch_mode(plan, msgs, xid)
    return commit_writes([(plan, msgs)], xid, batch, mode, streaming=plan.streaming)


def commit_writes(
    writes: Sequence[tuple[WritePlan, list[TxCommitMessage]]],
    xid: str,
    batch: int | None,
    mode: Mode,
    *,
    streaming: bool,
    targets: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Driver: prepare ONE xid whose manifest holds the staged parts of every write (each
    entry with its table), publish it, record it. One write is a single-table batch;
    ``targets`` (every table and its mode) makes it a :func:`txsink.transaction`, whose
    record's ``target`` is the job's own table (:func:`txsink.driver.primary_target`)."""
    from txsink.driver import borrowed_job

    config = writes[0][0].config
    with borrowed_job(config) as handle:
        return _commit_writes(handle, writes, xid, batch, mode, streaming, targets)


def _commit_writes(
    handle: JobHandle,
    writes: Sequence[tuple[WritePlan, list[TxCommitMessage]]],
    xid: str,
    batch: int | None,
    mode: Mode,
    streaming: bool,
    targets: dict[str, str] | None,
) -> dict[str, Any]:
    from txsink.driver import check_tables, epoch_for_run, primary_target

    config = handle.config
    msgs = [m for _, ms in writes for m in ms]
    if targets:
        stored = handle.registry.job_meta(config.job)
        config = dataclasses.replace(config, table=primary_target(stored, targets))
        handle.config = config
    run_id = (msgs[0].run_id if msgs else "") or writes[0][0].run_id
    if not run_id:
        current = handle.registry.current_epoch(config.job)
        run_id = current.owner if current else f"adhoc-{uuid.uuid4().hex}"
    incoming = {t for m in msgs for t in m.staging}
    query_id = next((m.extra.get("query_id", "") for m in msgs if m.extra), "")
    from txsink.metrics import count, record_commit

    owner = handle.registry.current_epoch(config.job)
    try:
        epoch = epoch_for_run(
            handle, run_id, mode.value, keep=incoming, query_id=query_id, targets=targets
        )
        if owner is None or owner.owner != run_id:
            count(config, recoveries=1)
        if targets:  # a run checks the job's identity at takeover only: tables per batch
            check_tables(config.job, handle.registry.job_meta(config.job), targets)
        for plan, ms in writes:
            if mode is Mode.ATTACH and any(m.staging for m in ms):
                check_no_new_views(handle, plan, xid)
                check_staging_reachable(handle, plan, ms, xid)
        parts = [
            dataclasses.replace(p, target=plan.config.table)
            for plan, ms in writes
            for m in ms
            for p in m.parts
        ]
        batch_visible = config.visibility == Visibility.BATCH and mode is Mode.ATTACH
        result = handle.transactor.commit_batch(
            epoch, xid, batch, config.table, parts, mode, streaming=streaming,
            tables=sorted(targets) if targets else (),
            visibility=Visibility.BATCH if batch_visible else Visibility.PARTITION,
        )  # fmt: skip
    except FencedError:
        count(config, fencing_events=1)
        raise
    if mode is Mode.ATTACH:
        sweep_strays(handle, xid, incoming)
    record_commit(config, result, sum(m.rows for m in msgs))
    return dict(result.__dict__)


def check_staging_reachable(
    handle: Any, plan: WritePlan, msgs: list[TxCommitMessage], xid: str
) -> None:
    """Before the prepare of a replicated target's batch: every staging table the tasks
    wrote is on the server the driver reaches. Staging lives on one replica; a URL that
    leads to several (a load balancer) would let the tasks stage on one and the driver's
    MOVE run on another, which would find its staging missing after the commit point."""
    info = plan.target_info
    if info is None or not info.is_replicated:
        return
    names = sorted({t for m in msgs for t in m.staging})
    missing = [t for t, rows in handle.warehouse.staging_view(names).items() if rows is None]
    if missing:
        raise ConfigError(
            f"job {plan.config.job}: xid {xid}: staging table(s) {', '.join(missing[:3])} "
            f"written by this batch's tasks are not on the replica of {plan.config.table} "
            f"the driver reaches: the url (or a shard URL) leads to more than one server "
            f"(a load balancer?). Nothing was committed; name one server per shard, or use "
            f"mode=dedup. Tables left on the other replica are dropped by `txsink recover "
            f"--job {plan.config.job}` pointed at it"
        )


def sweep_strays(handle: Any, xid: str, incoming: set[str]) -> None:
    """Drop staging of ``xid`` that no task message named (losing speculative attempts);
    behind the xid's record like every roll-back (:meth:`Transactor.roll_back`)."""
    strays = [
        table
        for table in handle.warehouse.list_staging(handle.transactor.prefix)
        if (parsed := parse_staging(table)) is not None
        and parsed.xid == xid
        and table not in incoming
    ]
    handle.transactor.roll_back(xid, strays)


def abort_batch(plan: WritePlan, messages: list[Any], batch_id: int | None) -> None:
    """Driver: tasks failed (or commit raised). Roll their staging back.

    The roll-back writes an ABORTED tombstone on the xid node before dropping anything,
    so it is safe even if a prepare whose reply was lost lands later, or if this read of
    Keeper lags: a prepare that won keeps its staging, one that comes later cannot adopt
    what was dropped (:meth:`Transactor.roll_back`).
    """
    from txsink.driver import open_job

    xid = plan.xid or batch_xid(int(batch_id or 0))
    msgs = [m for m in messages if isinstance(m, TxCommitMessage)]
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
