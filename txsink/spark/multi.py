"""``txsink.transaction``: several tables, one xid (contract in docs/options.md).

::

    def handle(df, batch_id):
        with txsink.transaction(spark, batch_id, job="orders", url=..., keeper=...) as tx:
            tx.write(df.filter("kind = 'order'"), table="shop.orders")
            tx.write(df.groupBy("day").count(), table="shop.daily_counts")

Each :meth:`Transaction.write` only *stages*: a Spark job (``mapInArrow``) runs the
executor write path of the data source (:func:`txsink.spark.writer.write_partition`) on
every partition and returns each task's commit message to this driver; nothing is
visible and nothing is prepared. Leaving the block without an exception prepares ONE
xid whose manifest holds the staged parts of every table (each entry names its table),
then publishes and records it (:func:`txsink.committer.commit_writes`): the same
protocol, records and recovery as a single-table batch. An exception rolls back every
table's staging (:meth:`txsink.transactor.Transactor.roll_back`: tombstone first).

The xid is ``b<batch_id>`` (or ``b<txn_version>`` for batch jobs), so a replay of a
committed batch is a no-op for every table: the executors skip writing, the commit
finds the record COMMITTED.

Only attach-mode tables take part. A dedup-mode table is refused: its rows are inserted
into the target while it is written, before any prepare, so an exception (or a batch
that is never replayed) would leave them visible without the other tables' rows, which
is exactly what the transaction promises never to show.

Spark returns only the first successful attempt of each task; losing speculative or
retried attempts may still have created staging. The commit sweeps every staging table
of the xid that no returned message names (:func:`txsink.committer.sweep_strays`).
"""

from __future__ import annotations

import dataclasses
import logging
import pickle
import uuid
from types import TracebackType
from typing import Any

from txsink import committer
from txsink.config import WriterConfig
from txsink.errors import ConfigError
from txsink.faults import fault_point
from txsink.protocol.ids import adhoc_xid, batch_xid
from txsink.protocol.states import Mode
from txsink.spark.messages import TxCommitMessage, WritePlan
from txsink.spark.writer import write_partition

log = logging.getLogger(__name__)

# Where the placeholder table stands in while the shared options are checked up front.
_PLACEHOLDER = "txsink.transaction"
_INTERNAL = ("table", "txn_version", "micro_batch", "run_id")


def arrow_map_refusal(pyspark_version: str, problem: str) -> str:
    """What to say when ``df.mapInArrow`` (the executor write of ``foreach_batch`` and
    ``transaction``) cannot run: pyspark builds it on pandas and pyarrow of its minimum
    versions, on the driver and on every executor, and installs neither; ``problem`` is
    pyspark's own check's words."""
    return (
        f"pyspark {pyspark_version} runs DataFrame.mapInArrow (how txsink's foreach_batch "
        f"and transaction write) only with pandas and pyarrow of the versions it names, on "
        f"the driver and on every executor: {problem}. Install them where Spark's Python "
        f"runs (the wheel's `spark` extra names pandas) and start again; nothing was "
        f"created or written (docs/install.md#spark-versions)"
    )


def require_arrow_map() -> None:
    """ConfigError, before anything is created, where pyspark's own checks of what
    ``mapInArrow`` needs (pandas, pyarrow) fail on this driver."""
    import pyspark
    from pyspark.sql.pandas.utils import (
        require_minimum_pandas_version,
        require_minimum_pyarrow_version,
    )

    try:
        require_minimum_pandas_version()
        require_minimum_pyarrow_version()
    except ImportError as exc:  # pyspark's PySparkImportError is one
        raise ConfigError(arrow_map_refusal(pyspark.__version__, str(exc))) from None


def save_plan(plan: WritePlan) -> WritePlan:
    """``plan`` for one save: xid ``b<txn_version>`` (or a fresh ad-hoc one without a
    ``txn_version``) and the run (the caller's ``run_id``, else a fresh one)."""
    config = plan.config
    run_id = config.run_id or f"save-{uuid.uuid4().hex}"
    if config.txn_version is not None:
        xid, batch = batch_xid(config.txn_version), config.txn_version
    else:
        xid, batch = adhoc_xid(uuid.uuid4().hex), None
    return dataclasses.replace(plan, xid=xid, run_id=run_id, batch=batch)


def save(df: Any, config: WriterConfig) -> dict[str, Any] | None:
    """One table, one xid, through ``mapInArrow``: :func:`txsink.foreach_batch`'s write on
    every Spark version (3.5 has no Python data source). The same executor write and the
    same commit as ``format("clickhouse_tx")``; where a task fails (or the commit raises)
    the batch's staging is rolled back as Spark's ``abort`` would (tombstone first)."""
    from txsink.spark.validate import validate

    if config.txn_version is None:
        raise ConfigError("txsink's mapInArrow save needs a txn_version (the batch id)")
    plan = save_plan(validate(config, df.schema))
    batch = plan.batch
    messages: list[TxCommitMessage] = []
    try:
        messages = stage(plan, df)
        return committer.commit_batch(plan, messages, batch)
    except BaseException:
        # safe whatever the outcome: a landed prepare keeps its manifest's staging, and
        # staging of tasks whose messages were lost is found by its xid and run
        committer.abort_batch(plan, messages, batch)
        raise


def stage(plan: WritePlan, df: Any) -> list[TxCommitMessage]:
    """Run the executor write of ``plan`` over ``df``; the task messages, on the driver."""
    import pyarrow as pa

    schema = pa.schema([("message", pa.binary())])

    def write(batches: Any) -> Any:
        message = write_partition(plan, iter(batches))
        yield pa.RecordBatch.from_pydict({"message": [pickle.dumps(message)]}, schema=schema)

    rows = df.mapInArrow(write, "message binary").collect()
    # our own executors' messages, produced by the function just above
    return [pickle.loads(row["message"]) for row in rows]  # noqa: S301


class Transaction:
    """The driver side of one multi-table transaction; use :func:`transaction`."""

    def __init__(
        self,
        spark: Any,
        batch_id: int | None,
        txn_version: int | None,
        options: dict[str, Any],
    ) -> None:
        if (batch_id is None) == (txn_version is None):
            raise ConfigError(
                "txsink.transaction needs exactly one of batch_id (inside foreachBatch) or "
                "txn_version= (batch jobs)"
            )
        given = sorted(k for k in options if k.lower() in _INTERNAL)
        if given:
            raise ConfigError(
                f"txsink.transaction sets {', '.join(given)} itself: pass the table to "
                f"tx.write(df, table=...) and the batch as batch_id / txn_version"
            )
        WriterConfig.from_options({**options, "table": _PLACEHOLDER})  # fail fast
        require_arrow_map()
        self.options = {k: v for k, v in options.items() if v is not None}
        self.streaming = batch_id is not None
        self.batch = int(batch_id if batch_id is not None else txn_version)  # type: ignore[arg-type]
        self.xid = batch_xid(self.batch)
        self.run_id = self._run_id(spark) if self.streaming else ""
        self.run_id = self.run_id or f"txn-{uuid.uuid4().hex}"
        self.writes: list[tuple[WritePlan, list[TxCommitMessage]]] = []
        self.tried: list[WritePlan] = []
        self.asked: list[WriterConfig] = []  # each write's options as given (visibility)
        self.result: dict[str, Any] | None = None
        self.closed = False

    @staticmethod
    def _run_id(spark: Any) -> str:
        """The streaming query's run id (Spark's job group inside foreachBatch)."""
        try:
            return str(spark.sparkContext.getLocalProperty("spark.jobGroup.id") or "")
        except Exception:  # noqa: BLE001 - Spark Connect sessions have no SparkContext
            return ""

    def _config(self, table: str, options: dict[str, Any]) -> WriterConfig:
        return WriterConfig.from_options(
            {
                **self.options,
                **options,
                "table": table,
                "txn_version": str(self.batch),
                "micro_batch": "true" if self.streaming else "false",
                "run_id": self.run_id,
            }
        )

    def write(self, df: Any, table: str, **options: Any) -> int:
        """Stage ``df`` for ``table`` (executors write staging; nothing is visible).
        ``options`` override the transaction's options for this table. Returns the rows
        staged (a replay of a committed batch is staged too, and skipped by the commit)."""
        if self.closed:
            raise ConfigError(f"transaction {self.xid} is finished; write inside its `with` block")
        if self.writes:
            fault_point("driver.between_writes")
        config = self._config(table, options)
        refusal = (
            f"table {table} of job {config.job} is in dedup mode; a transaction over several "
            f"tables takes attach-mode tables only: dedup mode inserts rows into the target "
            f"while they are written, before the prepare, so they would be visible without "
            f"the other tables' rows (and stay so if the transaction fails). Write it with "
            f"txsink.foreach_batch under its own job, or make it attach-capable"
        )
        if config.mode == Mode.DEDUP.value:
            raise ConfigError(refusal)
        if self.asked and config.visibility != self.asked[0].visibility:
            first = self.asked[0]
            raise ConfigError(
                f"table {config.table} is written with visibility={config.visibility} and "
                f"{first.table} with visibility={first.visibility}: one transaction is one "
                f"xid, published one way for all its tables. Give every tx.write (or "
                f"txsink.transaction itself) the same visibility option. Nothing of "
                f"{config.table} was written; the staging of the others is rolled back"
            )
        from txsink.spark.validate import validate

        plan = validate(config, df.schema)
        if plan.mode != Mode.ATTACH.value:
            raise ConfigError(f"{refusal} (docs/modes.md)")
        if self.tried and plan.config.shard_urls != self.tried[0].config.shard_urls:
            first = self.tried[0].config
            raise ConfigError(
                f"table {plan.config.table} lives on {', '.join(plan.config.shard_urls)} and "
                f"{first.table} on {', '.join(first.shard_urls)}: one transaction publishes on "
                f"one server, or one list of shards, for all its tables (a Distributed table "
                f"is written on its cluster's shards). Nothing of this table was written"
            )
        plan = dataclasses.replace(plan, xid=self.xid, run_id=self.run_id, batch=self.batch)
        self.tried.append(plan)
        self.asked.append(config)
        messages = stage(plan, df)
        committer.batch_mode(plan, messages, self.xid)
        self.writes.append((plan, messages))
        return sum(m.rows for m in messages)

    def commit(self) -> dict[str, Any] | None:
        """Prepare one xid over every staged table, publish, record (the `with` exit)."""
        self.closed = True
        if not self.writes:
            return None
        targets = {plan.config.table: plan.mode for plan, _ in self.writes}
        self.result = committer.commit_writes(
            self.writes,
            self.xid,
            self.batch,
            Mode.ATTACH,
            streaming=self.streaming,
            targets=targets,
        )
        return self.result

    def abort(self) -> None:
        """Roll back every table's staging of this transaction (tombstone first)."""
        self.closed = True
        if not self.tried:
            return
        messages = [m for _, ms in self.writes for m in ms]
        committer.abort_batch(self.tried[0], list(messages), self.batch)

    def __enter__(self) -> Transaction:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is not None:
            log.warning("transaction %s: %s inside the block; rolling back", self.xid, exc_type)
            self.abort()
            return
        try:
            self.commit()
        except BaseException:
            # safe whatever the outcome: a landed prepare keeps its manifest's staging
            self.abort()
            raise


def transaction(
    spark: Any,
    batch_id: int | None = None,
    *,
    txn_version: int | None = None,
    **options: Any,
) -> Transaction:
    """One xid over every table written in the ``with`` block (see the module doc)."""
    return Transaction(spark, batch_id, txn_version, options)
