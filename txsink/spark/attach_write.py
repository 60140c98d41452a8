"""The attach writer: one task attempt's rows into its own staging table(s).

Executor side, attach mode. The task creates a staging table named after its job, xid,
run, partition and attempt (:func:`txsink.protocol.ids.staging_name`), inserts its Arrow
batches in bounded blocks, and reports the rows it sent into each table. A sharded job
cuts every batch by shard and stages each shard's rows on that shard. Nothing is visible
in the target: the driver's committer reads what every task staged (one statement for
the batch) and publishes (:mod:`txsink.committer`).

Invariant: a message reports exactly the rows inserted (the commit compares them with
what the tables hold); an attempt that fails drops what it created (a hard crash leaves
it to recovery, which finds it by name). On its critical path a task sends its inserts
only: its staging table is made while it waits for its first batch.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

from txsink.errors import TxSinkError
from txsink.faults import fault_point
from txsink.protocol.ids import run_tag, staging_name
from txsink.spark.messages import TxCommitMessage, WritePlan
from txsink.spark.task import Task, check_values

# a partition whose first batch (or its end) is there by then makes nothing ahead: an
# empty shuffle partition of a stateful query costs no CREATE and DROP
AHEAD_GRACE_S = 0.005


def write_attach(plan: WritePlan, task: Task, batches: Iterator[Any]) -> TxCommitMessage:
    """A :class:`~txsink.spark.task.PartitionWriter`: stage ``batches`` on a pooled client.

    The staging table is made while the task waits for its first batch (Spark's read of
    the file or topic: tens of milliseconds, on this stack longer than the CREATE and its
    read-back), by a thread of the task's own (:class:`_MadeAhead`) that is joined before
    anything else uses the client. It starts only if the batch is not there within
    ``AHEAD_GRACE_S``; a partition that turns out empty after that drops the table again.
    A sharded job makes a shard's staging when the first of that shard's rows arrive, and
    borrows nothing for an empty partition."""
    from txsink.driver import borrowed_warehouse

    if plan.config.shards:
        first = next(batches, None)
        if first is None:
            return task.message(plan)
        with borrowed_warehouse(plan.config) as warehouse:
            return _stage(plan, warehouse, task, itertools.chain([first], batches))
    with borrowed_warehouse(plan.config) as warehouse:
        name = _staging_name(plan, task, None)
        with _MadeAhead(
            lambda: warehouse.create_staging(
                plan.config.table, name, plan.target_info, read_back=False
            )
        ) as ahead:
            try:
                first = next(batches, None)
                made = ahead.settle()  # a failed CREATE is this task's failure
            except BaseException:
                ahead.close()
                with contextlib.suppress(TxSinkError, OSError):  # a CREATE that landed
                    warehouse.drop_stagings([name])
                raise
        if first is None:
            if made:  # a failed DROP fails the task: the loan then closes the client
                warehouse.drop_stagings([name])
            return task.message(plan)
        if not made:  # the one statement on the critical path besides the inserts
            warehouse.create_staging(plan.config.table, name, plan.target_info, read_back=False)
        return _stage(plan, warehouse, task, itertools.chain([first], batches), [name])


class _MadeAhead:
    """``make`` (the staging CREATE) in a thread of its own, started unless :meth:`settle`
    is called within ``AHEAD_GRACE_S``. :meth:`close` (the ``with``'s end) joins the
    thread on every way out, interrupts included, so the client it uses is never lent on
    or closed while it runs."""

    def __init__(self, make: Callable[[], None]) -> None:
        self._settled = threading.Event()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="txsink-staging")
        self._made: Future[bool] = self._pool.submit(self._run, make)

    def _run(self, make: Callable[[], None]) -> bool:
        if self._settled.wait(AHEAD_GRACE_S):
            return False
        make()
        return True

    def settle(self) -> bool:
        """Whether the table was made (waits for a CREATE under way; raises its error)."""
        self._settled.set()
        return self._made.result()

    def close(self) -> None:
        self._settled.set()
        interrupted: BaseException | None = None
        while not self._made.done():
            try:
                wait([self._made])
            except BaseException as exc:  # noqa: BLE001 - joined first, raised after
                interrupted = exc
        self._pool.shutdown(wait=False)
        if interrupted is not None:
            raise interrupted

    def __enter__(self) -> _MadeAhead:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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
    sharded job's are made here) and report what it sent."""
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
    # what the staging tables hold is read by the commit, for all of the batch's tasks
    # in one statement (txsink.committer.staged_parts)
    return task.message(
        plan, staging=tuple(sent), inserted=tuple(sent.items()), rows=sum(sent.values())
    )


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
