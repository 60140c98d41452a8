"""txsink: exactly-once, transactional writes from Spark into ClickHouse.

Public entry points (contract, see docs/options.md)::

    import txsink
    txsink.register(spark)                      # registers format "clickhouse_tx"
    df.writeStream.format("clickhouse_tx").option("url", ...).option("table", ...)...
    df.writeStream.foreachBatch(txsink.foreach_batch(url=..., table=..., keeper=..., job=...))
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0.dev0"

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


def register(spark: SparkSession) -> None:
    """Register the ``clickhouse_tx`` Python data source with ``spark``."""
    from txsink.spark.datasource import ClickHouseTxDataSource

    spark.dataSource.register(ClickHouseTxDataSource)


def foreach_batch(**options: Any) -> Any:
    """A callable for ``writeStream.foreachBatch`` with the same exactly-once guarantees."""
    from txsink.spark.foreach import make_foreach_batch

    return make_foreach_batch(**options)


__all__ = ["__version__", "foreach_batch", "register"]
