"""The public API as a user's type checker sees it (``make typecheck`` runs mypy on this
file with ``warn_unused_ignores``): each ``type: ignore`` below is an error mypy must
report, so a signature that stops catching it fails the check."""

from __future__ import annotations

from typing import TYPE_CHECKING

import txsink

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession


def typed(spark: SparkSession, df: DataFrame) -> None:
    sink = txsink.foreach_batch(url="http://ch:8123", table="db.t", block_rows=10_000)
    sink(df, 7)
    txsink.foreach_batch(url="http://ch:8123", tabel="db.t")  # type: ignore[call-arg]
    txsink.foreach_batch(mode="atach")  # type: ignore[arg-type]
    txsink.foreach_batch(verify="no", keeper_timeout=2.5, state="clickhouse")
    txsink.foreach_batch(block_rows=[1])  # type: ignore[arg-type]
    with txsink.transaction(spark, 7, job="j", url="http://ch:8123", keeper="zk:2181") as tx:
        tx.write(df, table="db.t")
    with txsink.transaction(spark, txn_version=3, job="j", url="http://ch:8123") as tx:
        tx.write(df, table="db.t")
    txsink.transaction(spark, 1, visibility="whole")  # type: ignore[arg-type]
    txsink.progress_listener(url="http://ch:8123", job="j")
    txsink.register(spark)
    txsink.register(spark, "orders_ch", url="http://ch:8123", table="db.t", job="j")
    txsink.register(spark, "orders_ch", tabel="db.t")  # type: ignore[call-arg]
