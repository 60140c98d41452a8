"""txsink: exactly-once, transactional writes from Spark into ClickHouse.

Public entry points (contract, see docs/options.md)::

    import txsink
    txsink.register(spark)                      # registers format "clickhouse_tx"
    df.writeStream.format("clickhouse_tx").option("url", ...).option("table", ...)...
    df.writeStream.foreachBatch(txsink.foreach_batch(url=..., table=..., keeper=..., job=...))

    def handle(df, batch_id):                   # several tables, one xid
        with txsink.transaction(spark, batch_id, job=..., url=..., keeper=...) as tx:
            tx.write(df, table="db.facts")
            tx.write(df.groupBy("day").count(), table="db.daily")
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

__version__ = "0.1.0.dev0"

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession
    from typing_extensions import Unpack

    from txsink.spark.multi import Transaction
    from txsink.spark.progress import TxProgressListener
    from txsink.writer_options import WriterOptions


def register(
    spark: SparkSession, name: str | None = None, **options: Unpack[WriterOptions]
) -> None:
    """Register the ``clickhouse_tx`` Python data source with ``spark`` (Spark 4.0+; on an
    older Spark a ConfigError names the version and what works there instead).

    With ``name``, also a source of that name with ``options`` bound, for SQL: ``CREATE
    TABLE orders (id BIGINT, ...) USING <name>`` then ``INSERT INTO orders SELECT ...``
    (Spark hands a Python data source no table OPTIONS; docs/options.md#sql)."""
    if options and name is None:
        from txsink.errors import ConfigError

        raise ConfigError(
            "txsink.register(spark, **options): options are bound to a source of a name of "
            "its own: txsink.register(spark, 'orders_ch', url=..., table=...) "
            "(docs/options.md#sql)"
        )
    try:
        from txsink.spark.datasource import ClickHouseTxDataSource, bound_source
    except ImportError as exc:  # an older Spark: no Python data source with Arrow writers
        import pyspark

        from txsink.errors import ConfigError

        raise ConfigError(
            f"format('clickhouse_tx') needs Spark's Python data source API with Arrow "
            f"writers, which pyspark {pyspark.__version__} does not have ({exc}). On this "
            f"Spark, write with txsink.foreach_batch(...) inside writeStream.foreachBatch, "
            f"or with txsink.transaction(...): both run on Spark 3.5 and later "
            f"(docs/install.md#spark-versions)"
        ) from None
    spark.dataSource.register(ClickHouseTxDataSource)
    if name is not None:
        spark.dataSource.register(bound_source(name, options))


def foreach_batch(**options: Unpack[WriterOptions]) -> Callable[[DataFrame, int], None]:
    """A function for ``df.writeStream.foreachBatch(...)`` that writes each micro-batch
    exactly once, with the guarantees of ``format("clickhouse_tx")`` and on Spark 3.5 too:
    the micro-batch id is the xid (a replayed batch is a no-op), the query's run id
    fences older runs. The options are checked here, before the query starts."""
    from txsink.spark.foreach import make_foreach_batch

    return make_foreach_batch(**options)


def transaction(
    spark: SparkSession,
    batch_id: int | None = None,
    **options: Unpack[WriterOptions],
) -> Transaction:
    """``with txsink.transaction(spark, batch_id, job=..., url=..., keeper=...) as tx:
    tx.write(df, table="db.t")``: every table written in the block commits as one xid
    (``txn_version=`` instead of ``batch_id`` for batch jobs)."""
    from txsink.spark.multi import transaction as _transaction

    version = options.get("txn_version")
    txn_version = None if version is None or version == "" else int(version)
    rest = {k: v for k, v in options.items() if k != "txn_version"}
    return _transaction(spark, batch_id, txn_version=txn_version, **rest)


def progress_listener(**options: Unpack[WriterOptions]) -> TxProgressListener:
    """A ``StreamingQueryListener`` that logs what txsink committed in each micro-batch
    (xid, mode, rows, commit milliseconds): ``spark.streams.addListener(
    txsink.progress_listener(url=..., keeper=..., table=..., job=...))``."""
    from txsink.spark.progress import progress_listener as _listener

    return _listener(**options)


__all__ = ["__version__", "foreach_batch", "progress_listener", "register", "transaction"]
