"""The executor side of a write: which writer runs a task, and whether it writes at all.

:func:`write_partition` is what every Spark task calls (the data source's ``write``, the
``mapInArrow`` stage of :func:`txsink.transaction`). It asks
:func:`txsink.protocol.job.task_replay` whether the batch is a replay of a committed one
(write nothing, report ``skipped``), then hands the partition to the writer of the
plan's mode: :func:`~txsink.spark.attach_write.write_attach` or
:func:`~txsink.spark.dedup_write.write_dedup`, peers of one shape
(:class:`~txsink.spark.task.PartitionWriter`). Committing is the driver's job
(:mod:`txsink.committer`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from txsink.errors import ConfigError, UnavailableError
from txsink.protocol import job as rules
from txsink.protocol.states import Mode, XidState
from txsink.spark.attach_write import write_attach
from txsink.spark.dedup_write import write_dedup
from txsink.spark.messages import TxCommitMessage, WritePlan
from txsink.spark.task import PartitionWriter, Task, current_task

log = logging.getLogger(__name__)

WRITERS: dict[Mode, PartitionWriter] = {Mode.ATTACH: write_attach, Mode.DEDUP: write_dedup}

__all__ = [
    "already_committed",
    "write_partition",
]


def already_committed(plan: WritePlan, task: Task) -> bool:
    """Is ``task``'s batch a replay of a committed one (:func:`rules.task_replay`)?
    Stores that cannot be read count as no: writing is safe, the commit decides."""
    if not plan.config.skip_committed_replays or plan.mode == Mode.ATTACH.value:
        # attach mode only stages: the commit skips a committed replay and drops what it
        # staged, so its tasks ask no store (a batch's Keeper requests do not grow with
        # its tasks)
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
            record = registry.get(job, task.xid)
            # no record, or the tombstone of a rolled-back attempt: the ledger tells a
            # replay (no record) and whether the job committed any batch before this one
            unsettled = record is None or record.state is XidState.ABORTED
            if unsettled and task.batch is not None:
                last = registry.ledger(job).last_batch
    except UnavailableError:
        return False
    decision = rules.task_replay(
        job,
        task.xid,
        plan.mode,
        record.state if record is not None else None,
        record.mode.value if record is not None else None,
        task.batch,
        None if last is None else int(last),
        streaming=plan.streaming,
        first_batch=plan.config.first_batch,
    )
    if decision.verdict is rules.TaskVerdict.REFUSE:
        raise ConfigError(decision.reason)
    return decision.verdict is rules.TaskVerdict.SKIP


def write_partition(plan: WritePlan, batches: Iterator[Any]) -> TxCommitMessage:
    """Executor: write one task attempt's rows with the writer of the plan's mode."""
    task = current_task(plan)
    if already_committed(plan, task):
        for _ in batches:  # drain: Spark expects the input consumed
            pass
        log.info(
            "job %s: xid %s already committed; skipping the replayed write",
            plan.config.job,
            task.xid,
        )
        return task.message(plan, skipped=True)
    return WRITERS[Mode(plan.mode)](plan, task, batches)
