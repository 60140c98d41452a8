"""The attach writer: one task attempt's rows into its own staging table(s).

Executor side, attach mode. The task creates a staging table named after its job, xid,
run, partition and attempt (:func:`txsink.protocol.ids.staging_name`), inserts its Arrow
batches in bounded blocks, and reports the rows it staged per target partition, with the
part UUIDs the publish step later checks. A sharded job cuts every batch by shard and
stages each shard's rows on that shard. Nothing is visible in the target: the driver's
committer publishes (:mod:`txsink.committer`).

Invariant: a message reports exactly the rows inserted (the staged row count is read back
and compared); an attempt that fails drops what it created (a hard crash leaves it to
recovery, which finds it by name).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from txsink.errors import TxSinkError
from txsink.faults import fault_point
from txsink.protocol.ids import run_tag, staging_name
from txsink.protocol.states import StagedPart
from txsink.spark.messages import TxCommitMessage, WritePlan
from txsink.spark.task import Task, check_values


def write_attach(plan: WritePlan, task: Task, batches: Iterator[Any]) -> TxCommitMessage:
    """A :class:`~txsink.spark.task.PartitionWriter`: stage ``batches`` on a pooled client.

    The staging table is made while the task waits for its first batch (Spark's read of
    the file or topic: tens of milliseconds, on this stack longer than the CREATE and its
    read-back), in one thread of the task's own that is done before anything else uses
    the client. A partition that turns out empty drops it again. A sharded job makes a
    shard's staging when the first of that shard's rows arrive."""
    from txsink.driver import borrowed_warehouse

    with borrowed_warehouse(plan.config) as warehouse:
        if plan.config.shards:
            first = next(batches, None)
            if first is None:
                return task.message(plan)
            return _stage(plan, warehouse, task, _chained(first, batches))
        name = _staging_name(plan, task, None)
        created = [name]
        with ThreadPoolExecutor(1, thread_name_prefix="txsink-staging") as ahead:
            making = ahead.submit(
                warehouse.create_staging, plan.config.table, name, plan.target_info
            )
            try:
                first = next(batches, None)
            except BaseException:
                _drop_when_made(warehouse, making, created)
                raise
            if first is None:  # nothing to stage: the table made ahead goes again
                _drop_when_made(warehouse, making, created)
                return task.message(plan)
            try:
                making.result()  # a failed CREATE (or its checks) is this task's failure
            except BaseException:
                _drop_when_made(warehouse, making, created)  # a CREATE that landed
                raise
        return _stage(plan, warehouse, task, _chained(first, batches), created)


def _chained(first: Any, rest: Iterator[Any]) -> Iterator[Any]:
    yield first
    yield from rest


def _drop_when_made(warehouse: Any, making: Future[None], created: list[str]) -> None:
    """Wait for the staging made ahead, then drop it (it holds no rows). A CREATE that
    failed left nothing to drop (:meth:`create_staging` drops what it refuses); a drop
    that fails leaves an empty table that the commit's stray sweep or recovery drops."""
    with contextlib.suppress(Exception):
        making.result()
    with contextlib.suppress(TxSinkError, OSError):
        warehouse.drop_stagings(created)


def _staging_name(plan: WritePlan, task: Task, shard: int | None) -> str:
    return staging_name(
        plan.config.job,
        task.xid,
        run_tag(task.run_id),
        task.partition,
        task.attempt,
        task.attempt_id,
        plan.namespace,
        shard=shard,
    ).table


def _guarded(plan: WritePlan, batches: Iterator[Any], block_rows: int) -> Iterator[Any]:
    """Yield batches after the value checks; fire ``executor.mid_write`` once a block went
    out."""
    sent = 0
    for raw in batches:
        batch = check_values(plan, raw)
        if sent >= block_rows:
            fault_point("executor.mid_write")
        sent += batch.num_rows
        yield batch
    fault_point("executor.mid_write")


def _stage(
    plan: WritePlan,
    warehouse: Any,
    task: Task,
    batches: Iterator[Any],
    made: list[str] | None = None,
) -> TxCommitMessage:
    """Insert ``batches`` into the task's staging (``made``: the table, made already; a
    sharded job's are made here) and report what it holds."""
    cfg = plan.config
    rows = _guarded(plan, batches, cfg.block_rows)
    created: list[str] = list(made or [])
    try:
        if cfg.shards:
            sent = _stage_sharded(
                plan, warehouse, rows, lambda k: _staging_name(plan, task, k), created,
                task.partition,
            )  # fmt: skip
        else:
            (name,) = created
            stats = warehouse.insert_blocks(
                name,
                rows,
                block_rows=cfg.block_rows,
                block_bytes=cfg.block_bytes,
                settings=dict(cfg.settings) or None,
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
    return task.message(plan, parts=tuple(parts), staging=tuple(sent), rows=sum(sent.values()))


def _stage_sharded(
    plan: WritePlan,
    warehouse: Any,
    rows: Iterator[Any],
    name_on: Callable[[int | None], str],
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
            names[k],
            pending.pop(k),
            block_rows=cfg.block_rows,
            block_bytes=cfg.block_bytes,
            settings=dict(cfg.settings) or None,
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
