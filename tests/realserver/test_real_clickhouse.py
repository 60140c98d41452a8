"""The same end-to-end checks against a real ClickHouse server and Keeper.

Point ``TXSINK_REAL_URL`` (http://host:8123) and ``TXSINK_REAL_KEEPER`` (host:9181) at a
server, e.g. the one ``docker compose up -d`` starts. Without them, or when they do not
answer, every test here is skipped with that reason (never counted as passed).
"""

from __future__ import annotations

import os
import socket
import sys
import uuid
from urllib.parse import urlparse

import pytest

pytestmark = [pytest.mark.realserver, pytest.mark.spark]

URL = os.environ.get("TXSINK_REAL_URL", "")
KEEPER = os.environ.get("TXSINK_REAL_KEEPER", "")


def _reachable(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=2):
            return True
    except OSError:
        return False


def _skip_reason() -> str | None:
    if not URL or not KEEPER:
        return "no real server: set TXSINK_REAL_URL and TXSINK_REAL_KEEPER (docker compose up -d)"
    u = urlparse(URL)
    if not _reachable(u.hostname or "", u.port or 8123):
        return f"real ClickHouse {URL} does not answer"
    host, _, port = KEEPER.split("/")[0].split(",")[0].partition(":")
    if not _reachable(host, int(port or 2181)):
        return f"real Keeper {KEEPER} does not answer"
    return None


REASON = _skip_reason()


@pytest.mark.skipif(REASON is not None, reason=REASON or "")
def test_batch_save_with_txn_version_is_exactly_once_on_a_real_server(tmp_path) -> None:
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    import txsink
    from txsink.clickhouse.client import connect

    client = connect(URL)
    db = f"txsink_real_{uuid.uuid4().hex[:8]}"
    client.command(f"CREATE DATABASE {db}")
    try:
        client.command(
            f"CREATE TABLE {db}.t (id Int64, day Date) ENGINE = MergeTree "
            "PARTITION BY toYYYYMM(day) ORDER BY id"
        )
        spark = SparkSession.builder.master("local[2]").getOrCreate()
        txsink.register(spark)
        df = spark.sql(
            "SELECT id, date_add(DATE'2024-01-01', CAST(id % 90 AS INT)) AS day FROM range(10000)"
        )
        for _ in range(2):
            (
                df.write.format("clickhouse_tx")
                .option("url", URL)
                .option("keeper", KEEPER)
                .option("table", f"{db}.t")
                .option("job", f"real-{db}")
                .option("txn_version", 1)
                .mode("append")
                .save()
            )
        assert client.query_rows(f"SELECT count(), uniqExact(id) FROM {db}.t")[0] == (10000, 10000)
    finally:
        client.command(f"DROP DATABASE IF EXISTS {db}")
