"""The Spark Python data source ``clickhouse_tx`` (contract in docs/options.md).

Thin by design: options are parsed into a :class:`txsink.config.WriterConfig`, the target
is validated on the driver before any task runs (:mod:`txsink.spark.validate`), the
executors write (:mod:`txsink.spark.writer`) and the driver commits
(:mod:`txsink.committer`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from pyspark.sql.datasource import (  # batch writes: pyspark 4.0+
    DataSource,
    DataSourceArrowWriter,
    WriterCommitMessage,
)
from pyspark.sql.types import StructType

try:  # streaming writes through Arrow: pyspark 4.1+
    from pyspark.sql.datasource import DataSourceStreamArrowWriter
except ImportError:  # pragma: no cover - pyspark 4.0 (make test-matrix)
    DataSourceStreamArrowWriter = None  # type: ignore[assignment,misc]

from txsink import committer
from txsink.config import WriterConfig
from txsink.errors import ConfigError
from txsink.spark.messages import WritePlan, reports
from txsink.spark.multi import save_plan
from txsink.spark.writer import write_partition

FORMAT = "clickhouse_tx"


class ClickHouseTxDataSource(DataSource):
    """``format("clickhouse_tx")``: exactly-once writes into a ClickHouse table."""

    # the options of a source registered under a name of its own (bound_source)
    BOUND: dict[str, str] = {}  # replaced by bound_source, never mutated

    @classmethod
    def name(cls) -> str:
        return FORMAT

    def _config(self) -> WriterConfig:
        return WriterConfig.from_options({**self.BOUND, **dict(self.options)})

    def writer(self, schema: StructType, overwrite: bool) -> ClickHouseTxBatchWriter:
        if overwrite:
            raise ConfigError(
                "clickhouse_tx only appends; use .mode('append') (overwrite would need "
                "REPLACE PARTITION semantics txsink does not offer)"
            )
        from txsink.spark.validate import validate

        return ClickHouseTxBatchWriter(save_plan(validate(self._config(), schema)))

    def streamWriter(self, schema: StructType, overwrite: bool) -> ClickHouseTxStreamWriter:
        if DataSourceStreamArrowWriter is None:
            import pyspark

            raise ConfigError(
                f"writeStream.format('clickhouse_tx') needs pyspark 4.1 or newer (a Python "
                f"streaming data source with Arrow batches); this is pyspark "
                f"{pyspark.__version__}, where batch saves work. For streaming here, use "
                f"writeStream.foreachBatch(txsink.foreach_batch(...)) "
                f"(docs/install.md#spark-versions)"
            )
        if overwrite:
            raise ConfigError("clickhouse_tx streaming supports outputMode('append') only")
        from txsink.spark.validate import validate

        return ClickHouseTxStreamWriter(validate(self._config(), schema))


class ClickHouseTxBatchWriter(DataSourceArrowWriter):
    """One ``save()`` = one transaction (xid from ``txn_version`` when given)."""

    def __init__(self, plan: WritePlan) -> None:
        self.plan = plan

    def write(self, iterator: Iterator[Any]) -> WriterCommitMessage:
        return write_partition(self.plan, iterator)

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        committer.commit_batch(self.plan, reports(messages), self.plan.batch)

    def abort(self, messages: list[WriterCommitMessage | None]) -> None:
        committer.abort_batch(self.plan, reports(messages), self.plan.batch)


class ClickHouseTxStreamWriter(DataSourceStreamArrowWriter or object):  # type: ignore[misc]
    """One micro-batch = one transaction, xid ``b<batchId>``."""

    def __init__(self, plan: WritePlan) -> None:
        self.plan = plan

    def write(self, iterator: Iterator[Any]) -> WriterCommitMessage:
        return write_partition(self.plan, iterator)

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        committer.commit_batch(self.plan, reports(messages), batchId)

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        committer.abort_batch(self.plan, reports(messages), batchId)


def bound_source(name: str, options: Mapping[str, object]) -> type[ClickHouseTxDataSource]:
    """``clickhouse_tx`` under the name ``name``, with ``options`` bound: what a SQL table
    (``CREATE TABLE t (...) USING <name>``, then ``INSERT INTO t``) writes through. Spark
    4.x hands a Python data source writer none of a table's OPTIONS or TBLPROPERTIES
    (measured on pyspark 4.3), so they are bound here; options given to a write add to
    them. The class travels to the executors by value, its options with it."""
    if not name.isidentifier() or name.lower() == FORMAT:
        raise ConfigError(
            f"txsink.register(spark, {name!r}, ...): the name of a bound source must be an "
            f"identifier other than {FORMAT!r} (it is what `CREATE TABLE ... USING <name>` "
            f"names)"
        )
    bound = {k: str(v) for k, v in options.items() if v is not None}
    if any(k.lower() in ("txn_version", "txnversion") for k in bound):
        raise ConfigError(
            f"txsink.register(spark, {name!r}, txn_version=...): a bound txn_version would "
            f"make every INSERT after the first a replay, skipped; leave it out (each "
            f"INSERT is one transaction of its own)"
        )
    WriterConfig.from_options(bound)  # fail fast: a wrong option is named now, not at INSERT

    def source_name(cls: type) -> str:
        return name

    attrs = {"BOUND": bound, "name": classmethod(source_name), "__module__": __name__}
    return type(f"ClickHouseTx_{name}", (ClickHouseTxDataSource,), attrs)
