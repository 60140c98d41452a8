"""The Cloud flow against a real ClickHouse Cloud service (docs/cloud.md): no Keeper
endpoint, a SharedMergeTree target, the state in KeeperMap (``state=clickhouse``).

Set ``TXSINK_CLOUD_URL`` (https://<service>.clickhouse.cloud:8443) and
``TXSINK_CLOUD_USER`` / ``TXSINK_CLOUD_PASSWORD``. Without them, or when the service does
not answer, every test here is skipped with that reason (never counted as passed).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import uuid
from pathlib import Path
from urllib.parse import urlparse

import pytest

pytestmark = [pytest.mark.realserver, pytest.mark.spark]

URL = os.environ.get("TXSINK_CLOUD_URL", "")
USER = os.environ.get("TXSINK_CLOUD_USER", "default")
PASSWORD = os.environ.get("TXSINK_CLOUD_PASSWORD", "")


def _skip_reason() -> str | None:
    if not URL or not PASSWORD:
        return "no Cloud service: set TXSINK_CLOUD_URL, TXSINK_CLOUD_USER, TXSINK_CLOUD_PASSWORD"
    u = urlparse(URL)
    try:
        with socket.create_connection((u.hostname or "", u.port or 8443), timeout=5):
            return None
    except OSError:
        return f"Cloud service {URL} does not answer"


REASON = _skip_reason()


@pytest.mark.skipif(REASON is not None, reason=REASON or "")
def test_check_then_dedup_saves_and_a_crashed_stream_are_exact_with_state_in_clickhouse(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    import txsink
    from txsink.cli.main import main
    from txsink.clickhouse.client import connect
    from txsink.demo import job_args, make_source, run_job_once, target_ddl

    client = connect(URL, USER, PASSWORD)
    db = f"txsink_cloud_{uuid.uuid4().hex[:8]}"
    state_db = f"{db}_state"
    flags = ["--url", URL, "--user", USER, "--state", "clickhouse", "--state-database",
             state_db, "--json"]  # fmt: skip
    os.environ["TXSINK_PASSWORD"] = PASSWORD
    client.command(f"CREATE DATABASE {db}")
    try:
        client.command(
            f"CREATE TABLE {db}.t (id Int64, day Date) ENGINE = SharedMergeTree "
            "PARTITION BY toYYYYMM(day) ORDER BY id"
        )
        capsys.readouterr()
        assert main(["check", *flags, "--table", f"{db}.t"]) == 0
        report = json.loads(capsys.readouterr().out)
        assert report["can_run"] and report["mode"] == "dedup", report

        spark = SparkSession.builder.master("local[2]").getOrCreate()
        txsink.register(spark)
        df = spark.sql(
            "SELECT id, date_add(DATE'2024-01-01', CAST(id % 90 AS INT)) AS day FROM range(10000)"
        )
        for _ in range(2):  # the rerun of txn_version 1 writes nothing
            (df.write.format("clickhouse_tx").option("url", URL).option("user", USER)
             .option("password", PASSWORD).option("table", f"{db}.t")
             .option("job", f"cloud-{db}").option("state", "clickhouse")
             .option("state_database", state_db).option("txn_version", 1)
             .mode("append").save())  # fmt: skip
        assert client.query_rows(f"SELECT count(), uniqExact(id) FROM {db}.t")[0] == (10000, 10000)

        # a stream crashed after PREPARE, restarted from its checkpoint
        client.command(target_ddl(f"{db}.orders").replace("ENGINE = MergeTree",
                                                          "ENGINE = SharedMergeTree"))  # fmt: skip
        source = make_source(tmp_path / "src", 4, 1000)
        u = urlparse(URL)
        authed = f"{u.scheme}://{USER}:{PASSWORD}@{u.hostname}:{u.port or 8443}"
        args = job_args(tmp_path / "src", tmp_path / "ckpt", f"{db}.orders", f"cloud-s-{db}",
                        authed, "", "--option", "state=clickhouse", "--option",
                        f"state_database={state_db}", mode="dedup")  # fmt: skip
        assert run_job_once(args, fault="driver.after_prepare", fault_after=1) != 0
        assert run_job_once(args) == 0
        count, distinct = client.query_rows(f"SELECT count(), uniqExact(id) FROM {db}.orders")[0]
        assert (count, distinct) == (source["rows"], source["rows"])
        for command in ("status", "verify", "recover"):
            capsys.readouterr()
            assert main([command, *flags, "--job", f"cloud-s-{db}"]) == 0, command
    finally:
        client.command(f"DROP DATABASE IF EXISTS {db} SYNC")
        client.command(f"DROP DATABASE IF EXISTS {state_db} SYNC")
