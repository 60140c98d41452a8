"""Dedup mode's executor path: deterministic blocks inserted straight into the target.

Used where partitions cannot be moved (see docs/modes.md). The attach writer's peer (the
same :class:`~txsink.spark.task.PartitionWriter` shape). A partition is a plan run like
the publish: :func:`txsink.protocol.dedup_plan.write_partition` yields each read and write
in its order and :func:`run_plan` carries them out; it talks to ClickHouse only through
:class:`~txsink.clickhouse.dedup_insert.DedupTarget` (no SQL here) and to Keeper through
a pooled registry (:mod:`txsink.spark.dedup_records`). One Spark task attempt:

1. cuts its partition into deterministic blocks: rows in the order Spark delivers them
   (or sorted by ``dedup_order_by``), boundaries every ``block_rows`` rows. Byte limits
   (``block_bytes``) are *not* applied: they are computed from Arrow buffer sizes of
   whatever batches Spark happened to deliver, which may differ run to run, and a
   different cut would give a replayed block a token it never had;
2. fingerprints each block (BLAKE2b over the Arrow IPC stream of the block, one chunk per
   column, so the digest does not depend on how Spark chunked the rows);
3. asks :mod:`txsink.protocol.dedup` what to do with it given the partition's Keeper state
   ``dedup/<xid>/p<partition>``; before sending a block not yet recorded, writes a BEFORE
   record listing it (so any block that may have landed can be verified on replay);
4. unless the batch was prepared or committed meanwhile (the attempt outlived it: it
   stops, :func:`~txsink.spark.dedup_records.sealed`, asked before every block sent),
   inserts it with ``insert_deduplication_token = dedup_token(job, xid, partition, block)``
   (plus every setting dedup relies on, in both spellings where 26.x overrides the old
   one: ``insert_deduplicate=1`` and ``deduplicate_insert='enable'``, ``async_insert=0``,
   ``deduplicate_blocks_in_dependent_materialized_views=1``, ``insert_distributed_sync=1``,
   ``max_partitions_per_insert_block=0``), or skips it (SAME), or raises
   :class:`~txsink.errors.ContentChanged`;
5. writes AFTER once every block is acknowledged and returns a commit message whose parts
   name the target, the Spark partition, rows, blocks and a digest of the partition.

The driver's committer (:mod:`txsink.committer`) then records the xid PREPARED and
COMMITTED (:class:`txsink.transactor.Transactor` with ``Mode.DEDUP``) and deletes
``dedup/<xid>``.

Fingerprints are computed in a worker thread, block n+1's while block n is recorded and
sent (:mod:`txsink.spark.hash_ahead`: when the pure computation runs moves, nothing of
steps 3-5 does).

Memory: without ``dedup_order_by`` at most two blocks (the one being sent, the next one
being hashed; plus the Spark batch being cut), and the next is cut ahead only while the
block in hand is at most half of ``block_bytes``; the next one's size is bounded by
``block_rows`` only (dedup blocks are cut by rows). Larger blocks are held one at a time,
as in attach mode. The target's block counter is read after a block is hashed, never
while: other writers' parts added meanwhile count against its window. With
``dedup_order_by`` the whole partition is materialised and sorted in the Python worker
(about its Arrow size twice, during the sort): keep partitions small (more Spark
partitions) when using it.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import logging
import time
from collections.abc import Callable, Generator, Iterator
from typing import Any

import pyarrow as pa
from pyarrow import ipc

from txsink.clickhouse.blocks import iter_blocks
from txsink.clickhouse.dedup_insert import NO_BYTE_LIMIT, DedupTarget
from txsink.clickhouse.values import NOTHING_WRITTEN, ValueRefused
from txsink.dedup_state import discarded, open_dedup_batches
from txsink.errors import (
    ConfigError,
    ContentChanged,
    DedupWindowExceeded,
    DiscardedBatch,
    FencedError,
    HalfVisibleBatch,
)
from txsink.faults import fault_point
from txsink.protocol import dedup
from txsink.protocol import dedup_plan as dp
from txsink.protocol import dedup_window as dw
from txsink.protocol import job as rules
from txsink.protocol.ids import seal_tag, staging_prefix
from txsink.protocol.states import StagedPart
from txsink.protocol.steps import FaultPoint
from txsink.spark.dedup_records import StateCell, outlived, sealed
from txsink.spark.hash_ahead import BlockFeed
from txsink.spark.messages import TxCommitMessage, WritePlan
from txsink.spark.task import Task, checked

log = logging.getLogger(__name__)

DIGEST_PREFIX = "b3:"  # the hash in use; a stored digest of another kind never matches
LEGACY_PREFIX = "b2:"  # earlier releases: the IPC of the block as sliced (fingerprint)


class _HashSink(io.RawIOBase):
    """A write-only file that feeds what is written into a hash (no copy of the stream)."""

    def __init__(self, digest: Any) -> None:
        self.digest = digest

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        self.digest.update(data)
        return len(data)


def fingerprint(index: int, block: pa.Table, *, legacy: bool = False) -> dedup.BlockFingerprint:
    """Content digest of one block; independent of how its rows were chunked.

    Each column is made one compact array first: Arrow's IPC writer sends the whole
    buffers of a slice that starts at offset 0, so hashing a block cut from the front of
    a longer Spark batch as it is would hash rows that are not in the block (the digest
    would change with the rows after it, and with ``maxRecordsPerBatch``). ``legacy``
    computes the digest the way releases before this one recorded it (prefix ``b2:``),
    so that a replay of a batch they recorded still matches.

    hashlib releases the GIL on large buffers; about 25 ms per million narrow rows
    (4 columns, 31 MB) here, plus about as much for the copy, against about 200 ms to
    insert them.
    """
    digest = hashlib.blake2b(digest_size=16)
    if legacy:
        table = block.combine_chunks()
    else:
        table = pa.table(
            [pa.concat_arrays([*c.chunks, pa.array([], c.type)]) for c in block.columns],
            schema=block.schema,
        )
    with ipc.new_stream(pa.PythonFile(_HashSink(digest), mode="w"), table.schema) as writer:
        writer.write_table(table)
    prefix = LEGACY_PREFIX if legacy else DIGEST_PREFIX
    return dedup.BlockFingerprint(index, block.num_rows, prefix + digest.hexdigest())


def sorted_partition(plan: WritePlan, batches: Iterator[Any], partition: int) -> Iterator[Any]:
    """The whole partition sorted by ``dedup_order_by`` (materialised: see module doc)."""
    order = plan.config.dedup_order_by
    collected = list(batches)
    if not collected:
        return iter(())
    table = pa.Table.from_batches(collected)
    missing = [c for c in order if c not in table.column_names]
    if missing:
        raise ConfigError(
            f"option dedup_order_by names {', '.join(missing)}, which the DataFrame written to "
            f"{plan.config.table} does not have (columns: {', '.join(table.column_names)})"
        )
    log.info(
        "job %s: sorting Spark partition %d (%d rows, %.1f MB) by %s for dedup mode",
        plan.config.job, partition, table.num_rows, table.nbytes / 1e6, ",".join(order),
    )  # fmt: skip
    # pyarrow's sort is stable: rows equal in the sort key keep Spark's order, so the
    # key should be unique for the order to be deterministic.
    return iter(table.sort_by([(c, "ascending") for c in order]).to_batches())


def content_changed(
    plan: WritePlan,
    *,
    xid: str,
    batch: int | None,
    partition: int,
    stored: dedup.PartitionState | None,
    refusal: dedup.Refusal,
) -> ContentChanged:
    job = plan.config.job
    attempt = stored.attempt if stored else "?"
    return ContentChanged(
        f"job {job}: replay of xid {xid} (batch {batch}) differs in Spark partition {partition}, "
        f"block {refusal.block} ({refusal.decision.value}): {refusal.detail}; recorded by task "
        f"attempt {attempt} as {stored.status.value if stored else '-'}. Nothing further of "
        f"this partition was inserted. The source did not replay the same rows in the same "
        f"partitions (docs/modes.md#what-breaks-dedup-mode): restore the batch's input and "
        f"restart. Rows of this xid already in {plan.config.table} are those recorded in "
        f"Keeper at {plan.config.keeper_root}/jobs/{job}/{dedup.xid_key(xid)}."
    )


def window_exceeded(
    plan: WritePlan,
    *,
    xid: str,
    batch: int | None,
    partition: int,
    index: int,
    resend: bool,
    window: dw.Window | None,
    refusal: dw.WindowRefusal,
) -> DedupWindowExceeded:
    cfg = plan.config
    t = cfg.table
    node = f"{cfg.keeper_root}/jobs/{cfg.job}/{dedup.partition_key(xid, partition)}"
    if window is None:
        setting = "the dedup window"
    elif refusal.seconds:
        setting = f"{window.seconds_setting}={window.seconds:.0f}"
    else:
        setting = f"{window.setting}={window.parts}"
    head = (
        f"job {cfg.job}: xid {xid} (batch {batch}), Spark partition {partition}, block "
        f"{index}: target {t} has {setting}; {refusal.detail} ({refusal.problem.value}). "
        f"Block {index} was not sent. "
    )
    if refusal.problem is dw.WindowProblem.NO_ROOM and not resend:
        suggest = max(2 * int(refusal.used) + 10, 100)
        key = window.setting if window else "non_replicated_deduplication_window"
        seconds = (
            f" (or {window.seconds_setting} = {int(2 * refusal.used) + 600})"
            if window is not None and refusal.seconds
            else ""
        )
        return DedupWindowExceeded(
            head + f"The blocks before it are in {t} and recorded at {node}; they are still "
            f"deduplicated, so this partition resumes exactly once the window has room: run "
            f"ALTER TABLE {t} MODIFY SETTING {key} = {suggest}{seconds} and restart the "
            f"query; or write fewer parts per batch (larger block_rows, smaller batches, "
            f"dedup_order_by on the partition key so a block spans fewer partitions), or "
            f"use mode=attach (docs/modes.md#the-dedup-window)."
        )
    return DedupWindowExceeded(
        head + f"Re-sending a block recorded at {node} could insert its rows into {t} a "
        f"second time, so nothing was re-sent and raising the window now does not help. "
        f"Rows of the recorded blocks may be in {t}: follow "
        f"docs/operations.md#runbook-dedup-window-exceeded (find and delete them, delete "
        f"{node}, restart)."
    )


def write_dedup(plan: WritePlan, task: Task, batches: Iterator[Any]) -> TxCommitMessage:
    """A :class:`~txsink.spark.task.PartitionWriter`: insert one Spark partition into the
    target as deterministic blocks (pooled Keeper session and ClickHouse client)."""
    from txsink.driver import borrowed_registry, borrowed_warehouse

    cfg = plan.config
    rows: Iterator[Any] = checked(plan, batches)
    if cfg.dedup_order_by:
        rows = sorted_partition(plan, rows, task.partition)
    blocks = iter_blocks(rows, block_rows=cfg.block_rows, block_bytes=NO_BYTE_LIMIT)
    try:
        # the first block before any borrowing: a bad partition (nulls, a missing sort
        # column) fails here and leaves the pooled connections healthy and lendable
        head = [next(blocks, None)]  # _write takes it out: no frame here keeps block 0
        with contextlib.ExitStack() as stack:
            registry = stack.enter_context(borrowed_registry(cfg))

            def target() -> DedupTarget:  # borrowed only once a block is to be sent
                warehouse = stack.enter_context(borrowed_warehouse(cfg))
                return DedupTarget(warehouse, cfg.table, cfg.settings)

            return _write(plan, task, head, blocks, registry, target)
    except ValueRefused as exc:  # checked as blocks are cut: earlier ones may be sent
        raise ValueRefused(str(exc).replace(NOTHING_WRITTEN, half_written(plan, task))) from None


def half_written(plan: WritePlan, task: Task) -> str:
    """What a value refusal leaves in dedup mode, and the way out."""
    cfg = plan.config
    if task.batch is None:
        rerun = "a save without txn_version cannot be rerun under its xid: see the link"
    elif plan.xid is not None and not cfg.micro_batch:
        rerun = f"save again with txn_version={task.batch}"
    else:
        rerun = "restart the streaming query from its checkpoint"
    return (
        f"Nothing from the refused value on was sent by this task. In dedup mode, blocks of "
        f"xid {task.xid} sent before it (by this task or others), if any, are in "
        f"{cfg.table}; then job {cfg.job} writes no other batch until this one is rerun with "
        f"the value corrected in place, same rows in the same order ({rerun}): it resumes "
        f"and commits exactly once (docs/modes.md#a-dedup-batch-stopped-half-way)."
    )


def _write(
    plan: WritePlan,
    task: Task,
    head: list[pa.Table | None],
    blocks: Iterator[pa.Table],
    registry: Any,
    target: Callable[[], DedupTarget],
) -> TxCommitMessage:
    cfg = plan.config
    xid, batch, partition, attempt = task.xid, task.batch, task.partition, task.attempt
    key = dedup.partition_key(xid, partition)

    def changed(stored: dedup.PartitionState | None, refusal: dedup.Refusal) -> ContentChanged:
        return content_changed(
            plan, xid=xid, batch=batch, partition=partition, stored=stored, refusal=refusal
        )

    def refused_write(why: str) -> ContentChanged:
        return ContentChanged(
            f"job {cfg.job}: xid {xid}, Spark partition {partition}: another attempt changed "
            f"the dedup record {cfg.keeper_root}/jobs/{cfg.job}/{key} and this attempt's "
            f"write was refused: {why}. Nothing further was inserted into {cfg.table}; "
            f"Spark retries the task, which decides against the record as it is now."
        )

    cell = StateCell(registry, cfg.job, key, refused_write)
    initial = cell.state
    first = head.pop()
    if first is None:  # an empty partition inserts nothing and records nothing...
        refusal = dedup.decide_end(initial, 0)  # ...unless an earlier attempt had rows
        if refusal is not None:
            raise changed(initial, refusal)
        return task.message(plan)

    def legacy(index: int) -> bool:  # a block recorded by a release before the b3 digest
        recorded = cell.state.blocks if cell.state else ()
        return index < len(recorded) and recorded[index].digest.startswith(LEGACY_PREFIX)

    # block n+1 is cut and hashed in a worker thread while block n is being sent (see
    # txsink.spark.hash_ahead: only when the pure computation runs moves, no decision)
    with BlockFeed(first, blocks, fingerprint, ahead_bytes=cfg.block_bytes // 2) as feed:
        feed.start(legacy(0))  # block 0 is hashed while Keeper and ClickHouse answer
        del first
        listed = registry.blob_children(cfg.job, "dedup")
        if xid in listed:
            # records of this xid exist: written by a task that passed the fence (a
            # sibling or an earlier attempt); finishing the xid adds nothing new, so no
            # fence, but the operator may have given it up
            mark = discarded(registry, cfg.job, xid)
            gone = rules.discarded_batch(cfg.job, xid, cfg.table, mark, streaming=plan.streaming)
            if gone.verdict is rules.TaskVerdict.SKIP:  # Spark replays it on every restart
                log.warning("%s", gone.reason)
                for _ in blocks:  # the worker holds block 0 only: no other reader
                    pass
                return task.message(plan, skipped=True, extra={"discarded": True})
            if gone.verdict is rules.TaskVerdict.REFUSE:
                raise DiscardedBatch(gone.reason)
        elif listed:
            # another batch of the job stopped half-way: writing this one could add its
            # rows again. A lagging Keeper server may still show one just committed: sync
            # first.
            fence = open_dedup_batches(registry, cfg.job, skip=xid)
            if fence:
                registry.sync(cfg.job)
                fence = open_dedup_batches(registry, cfg.job, skip=xid)
            why = rules.open_dedup_refusal(cfg.job, xid, cfg.table, fence)
            if why is not None:
                raise HalfVisibleBatch(why)
        steps = dp.write_partition(initial, attempt)
        guard = target()
        sent = run_plan(plan, task, steps, feed, cell, guard, legacy, registry)
    if isinstance(sent, dp.Outlived):  # the batch was prepared or committed meanwhile
        return outlived(plan, task, registry, blocks)
    done, inserted, skipped, total, decision = (
        sent.done, sent.inserted, sent.skipped, sent.rows, sent.decision
    )  # fmt: skip
    if decision is dedup.Decision.SAME:
        from txsink.metrics import count

        count(cfg, dedup_skips=1)
    if decision is not dedup.Decision.NEW:
        log.warning(
            "job %s: xid %s partition %d: %s (%d block(s) re-sent with their tokens, %d skipped)",
            cfg.job, xid, partition, decision.value, inserted, skipped,
        )  # fmt: skip
    digest = hashlib.blake2b("".join(b.digest for b in done).encode(), digest_size=8)
    part = StagedPart(cfg.table, str(partition), total, len(done), digest.hexdigest())
    return task.message(
        plan,
        parts=(part,),
        rows=total,
        extra={"decision": decision.value, "inserted": inserted, "skipped": skipped},
    )


def run_plan(
    plan: WritePlan,
    task: Task,
    steps: Generator[dp.DedupStep, Any, dp.Sent | dp.Outlived],
    feed: BlockFeed,
    cell: StateCell,
    guard: DedupTarget,
    legacy: Callable[[int], bool],
    registry: Any,
) -> dp.Sent | dp.Outlived:
    """Carry out the partition's sequence (:func:`txsink.protocol.dedup_plan.write_partition`):
    the block in hand from ``feed``, the window from ``guard``, records through ``cell``,
    the seal from ``registry``; every decision and its order are the sequence's."""
    cfg = plan.config
    job, table = cfg.job, cfg.table
    xid, batch, partition, attempt = task.xid, task.batch, task.partition, task.attempt

    def is_sealed() -> bool:
        return sealed(plan, task, registry)

    seal = seal_tag(staging_prefix(job, plan.namespace), xid)

    block: Any = None
    reply: Any = None
    while True:
        try:
            step = steps.send(reply)
        except StopIteration as end:
            result: dp.Sent | dp.Outlived = end.value
            break
        reply = None
        if isinstance(step, dp.NextBlock):
            block = None  # let the sent block go before the next is cut (memory bound)
            block = feed.next_block(legacy)
            reply = None if block is None else feed.fingerprint(block, legacy)
        elif isinstance(step, dp.ObserveWindow):
            reply = guard.observe()
        elif isinstance(step, dp.ProposeBefore | dp.ProposeAfter):
            record = dedup.before if isinstance(step, dp.ProposeBefore) else dedup.after
            written = cell.propose(record(step.blocks, step.attempt, time.time(), step.track))
            reply = (written, cell.state)
        elif isinstance(step, dp.CutNext):
            feed.cut_next(block, legacy(step.index))
        elif isinstance(step, dp.CheckSealed):
            reply = is_sealed()
        elif isinstance(step, dp.InsertBlock):
            try:  # a retry of the block asks again: it may come long after CheckSealed
                guard.insert(
                    block, job=job, xid=xid, partition=partition, index=step.index,
                    seal=seal, window=step.guard, resend_ok=lambda: not is_sealed(),
                )  # fmt: skip
                reply = True
            except FencedError:
                if not is_sealed():  # a seal row Keeper does not back (a reused xid)
                    raise
                reply = False
        elif isinstance(step, FaultPoint):
            fault_point(step.name)
        elif isinstance(step, dp.RefuseContent):
            raise content_changed(
                plan, xid=xid, batch=batch, partition=partition, stored=step.stored,
                refusal=step.refusal,
            )  # fmt: skip
        else:
            raise window_exceeded(
                plan, xid=xid, batch=batch, partition=partition, index=step.index,
                resend=step.resend, window=step.window, refusal=step.refusal,
            )  # fmt: skip
    if isinstance(result, dp.Outlived) and result.retried:
        log.warning(
            "job %s: xid %s was prepared or committed while block %d of task attempt "
            "%d of Spark partition %d was retried: not sent again to %s",
            job, xid, result.index, attempt, partition, table,
        )  # fmt: skip
    elif isinstance(result, dp.Outlived):
        log.warning(
            "job %s: xid %s was prepared or committed while task attempt %d of "
            "Spark partition %d ran (a zombie or a speculative loser): block %d and "
            "the rest not sent to %s", job, xid, attempt, partition, result.index, table,
        )  # fmt: skip
    return result
