"""The executor side's common shape: one running task, and the interface of a writer.

Executors write, the driver commits (:mod:`txsink.committer`). The attach writer
(:mod:`txsink.spark.attach_write`) and the dedup writer (:mod:`txsink.spark.dedup_write`)
are peers: each is a :class:`PartitionWriter`, called with the plan, the running
:class:`Task` and the partition's Arrow batches, returning one
:class:`~txsink.spark.messages.TxCommitMessage`. Which one runs, and whether the task
writes at all (a replay of a committed batch writes nothing), is decided by
:func:`txsink.spark.writer.write_partition` from :mod:`txsink.protocol.job`.

Executors know the batch from Spark's local property ``streaming.sql.batchId`` and the
query run from ``spark.jobGroup.id`` (Spark sets both for every micro-batch job).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from txsink.clickhouse.values import apply as apply_rules
from txsink.errors import TxSinkError
from txsink.protocol.ids import batch_xid
from txsink.spark.messages import (
    BATCH_ID_PROPERTY,
    QUERY_ID_PROPERTY,
    RUN_ID_PROPERTY,
    TxCommitMessage,
    WritePlan,
)


@dataclass(frozen=True)
class Task:
    """One task attempt of one batch, as the writers see it."""

    run_id: str
    xid: str
    batch: int | None
    partition: int  # Spark's partition id
    attempt: int  # Spark's attempt number of this partition
    attempt_id: int  # Spark's task attempt id (unique in the application)
    query_id: str  # the streaming query id ("" outside streaming)
    started: float

    @classmethod
    def of(cls, ctx: Any, run_id: str, xid: str, batch: int | None, started: float) -> Task:
        """The task of TaskContext ``ctx``."""
        return cls(
            run_id,
            xid,
            batch,
            int(ctx.partitionId()),
            int(ctx.attemptNumber()),
            int(ctx.taskAttemptId()),
            ctx.getLocalProperty(QUERY_ID_PROPERTY) or "",
            started,
        )

    def message(self, plan: WritePlan, **fields: Any) -> TxCommitMessage:
        """This task's commit message. Its ``extra`` always names the query (checked
        against the job's at takeover) and the mode the task wrote in (the commit refuses
        a batch whose tasks wrote in another mode than the one it would publish in)."""
        extra = {"query_id": self.query_id, "mode": plan.mode, **fields.pop("extra", {})}
        return TxCommitMessage(
            self.run_id,
            self.xid,
            self.batch,
            seconds=time.time() - self.started,
            extra=extra,
            **fields,
        )


class PartitionWriter(Protocol):
    """An executor-side writer of one Spark partition (attach or dedup mode)."""

    def __call__(self, plan: WritePlan, task: Task, batches: Iterator[Any]) -> TxCommitMessage:
        """Write ``batches`` (Arrow record batches, not empty) as ``task``; the message."""
        ...


def current_task(plan: WritePlan) -> Task:
    """The running Spark task, with the xid and batch it writes."""
    from pyspark import TaskContext

    started = time.time()
    ctx = TaskContext.get()
    if ctx is None:
        raise TxSinkError("txsink writers must run inside a Spark task")
    if plan.xid is not None:
        return Task.of(ctx, plan.run_id, plan.xid, plan.batch, started)
    raw = ctx.getLocalProperty(BATCH_ID_PROPERTY)
    if raw is None:
        raise TxSinkError("no streaming batch id in this task; is this a streaming query?")
    batch = int(raw)
    run_id = ctx.getLocalProperty(RUN_ID_PROPERTY) or plan.run_id
    return Task.of(ctx, run_id, batch_xid(batch), batch, started)


def check_values(plan: WritePlan, batch: Any) -> Any:
    """``batch`` as it will be sent, after the plan's value rules: a value ClickHouse
    would store altered (a null into a non-Nullable type, a negative into an unsigned
    one, a lost fraction of a second, ...) raises ValueRefused naming it
    (:mod:`txsink.clickhouse.values`)."""
    return apply_rules(plan.values, batch, plan.config.table)


def checked(plan: WritePlan, batches: Iterator[Any]) -> Iterator[Any]:
    """``batches``, each after :func:`check_values`."""
    for batch in batches:
        yield check_values(plan, batch)
