"""``format("clickhouse_tx")`` on the Spark that is installed: it writes exactly where
pyspark has the Python data source with Arrow writers, and is refused naming the version
(and what works there instead) where it has not. ``make test-matrix`` runs this file on
pyspark 3.5, 4.0 and the newest 4.x; ``foreach_batch`` and ``transaction`` are run there
by their own tests on every version."""

from __future__ import annotations

import importlib
import uuid
from typing import Any

import pyspark
import pytest

import txsink
from txsink.errors import ConfigError

pytestmark = pytest.mark.spark


def _data_source_has(name: str) -> bool:
    try:
        module = importlib.import_module("pyspark.sql.datasource")
    except ImportError:
        return False
    return hasattr(module, name)


def test_format_clickhouse_tx_writes_exactly_or_is_refused_naming_the_spark_version(
    spark: Any, stack: Any, ch: Any, fresh_db: str
) -> None:
    if not _data_source_has("DataSourceArrowWriter"):
        with pytest.raises(ConfigError) as refused:
            txsink.register(spark)
        text = str(refused.value)
        assert f"pyspark {pyspark.__version__}" in text
        assert "txsink.foreach_batch" in text and "txsink.transaction" in text
        return
    table = f"{fresh_db}.versions"
    ch.command(f"CREATE TABLE {table} (id Int64, v String) ENGINE = MergeTree ORDER BY id")
    df = spark.range(0, 500, 1, 3).selectExpr("id", "cast(id as string) AS v")
    (
        df.write.format("clickhouse_tx")
        .option("url", stack.url)
        .option("keeper", stack.keeper)
        .option("table", table)
        .option("job", f"versions-{uuid.uuid4().hex[:8]}")
        .option("txn_version", "1")
        .mode("append")
        .save()
    )
    got = ch.query(f"SELECT count(), uniqExact(id), countIf(v != toString(id)) FROM {table}")
    assert got.result_rows[0] == (500, 500, 0)


def test_streaming_format_writes_exactly_or_is_refused_naming_the_spark_version(
    spark: Any, stack: Any, ch: Any, fresh_db: str, tmp_path: Any
) -> None:
    if not _data_source_has("DataSourceArrowWriter"):
        return  # format itself is refused there (the test above)
    table = f"{fresh_db}.versions_stream"
    ch.command(f"CREATE TABLE {table} (id Int64) ENGINE = MergeTree ORDER BY id")
    source = tmp_path / "in"
    spark.range(0, 300, 1, 2).write.parquet(str(source))
    query = (
        spark.readStream.schema("id long")
        .parquet(str(source))
        .writeStream.format("clickhouse_tx")
        .option("url", stack.url)
        .option("keeper", stack.keeper)
        .option("table", table)
        .option("job", f"versions-{uuid.uuid4().hex[:8]}")
        .option("checkpointLocation", str(tmp_path / "chk"))
        .trigger(availableNow=True)
    )
    if not _data_source_has("DataSourceStreamArrowWriter"):
        with pytest.raises(Exception, match=rf"needs pyspark 4.1 .*pyspark {pyspark.__version__}"):
            query.start().awaitTermination(120)
        assert ch.query(f"SELECT count() FROM {table}").result_rows[0][0] == 0
        return
    query.start().awaitTermination(120)
    got = ch.query(f"SELECT count(), uniqExact(id) FROM {table}").result_rows[0]
    assert got == (300, 300)
