"""What travels between the driver and the executors of one write: small, picklable.

:class:`WritePlan` goes out to every task (decided and validated once on the driver);
:class:`TxCommitMessage` comes back from every task to the driver-side committer
(:mod:`txsink.committer`). Both writers (attach and dedup) use the same shapes, so the
committer never needs to know which one ran. Only data here: no I/O, no decisions.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

try:  # the Python data source API (Spark 4.0+); the mapInArrow routes need none of it
    from pyspark.sql.datasource import WriterCommitMessage
except ImportError:  # pragma: no cover - Spark 3.5 (make test-matrix)

    class WriterCommitMessage:  # type: ignore[no-redef]
        """Stand-in base where Spark has no Python data source (Spark 3.5)."""


from txsink.clickhouse.values import Rule
from txsink.config import WriterConfig
from txsink.protocol.states import StagedPart

# Spark local properties every micro-batch job carries to its tasks.
BATCH_ID_PROPERTY = "streaming.sql.batchId"
RUN_ID_PROPERTY = "spark.jobGroup.id"
QUERY_ID_PROPERTY = "sql.streaming.queryId"


@dataclass(frozen=True)
class WritePlan:
    """Everything a task needs, decided and validated once on the driver."""

    config: WriterConfig
    mode: str  # "attach" | "dedup" (auto is resolved on the driver)
    # what each batch's values must pass (or how they are converted) before they are
    # sent: nulls into non-Nullable types, ranges, precision (txsink.clickhouse.values)
    values: tuple[Rule, ...] = ()
    target_info: Any = None  # the target's TargetInfo as validation saw it (attach mode)
    shard_infos: tuple[Any, ...] = ()  # a sharded job: the target on each shard, in order
    xid: str | None = None  # batch saves: fixed xid; streaming: from the batch id
    run_id: str = ""  # batch saves: one run per save; streaming: Spark's run id
    batch: int | None = None
    namespace: str = ""  # the Keeper store's id: part of staging names (ids.staging_prefix)
    written: tuple[str, ...] = ()  # the DataFrame's columns: what the values were checked for

    def target_on(self, shard: int) -> Any:
        """The target as validation saw it on ``shard`` (its replica name, Keeper path)."""
        return self.shard_infos[shard] if shard < len(self.shard_infos) else self.target_info

    @property
    def streaming(self) -> bool:
        """Batch ids are Spark micro-batch ids (format streaming, or foreach_batch)."""
        return self.xid is None or self.config.micro_batch


@dataclass
class TxCommitMessage(WriterCommitMessage):
    """One task attempt's report. ``extra`` carries ``query_id`` and the ``mode`` the
    task wrote in (the committer checks both), and the dedup writer's counters.

    An attach task reports ``inserted``: the rows it sent into each staging table (the
    commit reads the staged parts of all of a batch's tables in one statement and checks
    them against it); a dedup task reports its ``parts``."""

    run_id: str
    xid: str
    batch: int | None
    parts: tuple[StagedPart, ...] = ()
    staging: tuple[str, ...] = ()
    inserted: tuple[tuple[str, int], ...] = ()
    skipped: bool = False
    rows: int = 0
    seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


def reports(messages: Iterable[Any]) -> list[TxCommitMessage]:
    """The task messages among what Spark hands the driver (None for a failed task)."""
    return [m for m in messages if isinstance(m, TxCommitMessage)]
