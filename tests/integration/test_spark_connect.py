"""txsink through Spark Connect: a local Connect server started from pyspark's own
``sbin/start-connect-server.sh`` (the ``spark-connect`` jar ships in ``pyspark/jars``), and
a client that only holds ``SparkSession.builder.remote("sc://...")``.

The data source runs in the *server's* Python workers, so the server is started with this
interpreter as ``PYSPARK_PYTHON`` and the directory txsink is imported from on its
``PYTHONPATH`` (the source tree, or site-packages when testing an installed wheel).

The injected fault uses the fault-point contract in the server's environment:
``TXSINK_FAULT=driver.after_prepare`` with ``TXSINK_FAULT_TIMES=1`` and a shared counter
file (``TXSINK_FAULT_STATE``). The counter starts far above the crash window, so every
arrival passes (the fault is *disarmed*); a test arms it by writing ``0`` to the counter,
so exactly the next arrival, in whichever Python worker of the server, hard-exits. The
server's environment is fixed when it starts; the counter file is what a test can change.

The tests skip, saying why, when the server cannot start here (no Java, no Connect jar or
script, missing client packages: install ``txsink[connect]``).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import txsink
from tests.integration.conftest import free_port
from tests.integration.sparkjob import assert_exact, new_job, staging_left
from txsink.demo import SOURCE_SCHEMA_DDL
from txsink.protocol.states import XidState

pytestmark = pytest.mark.spark

FAULT_POINT = "driver.after_prepare"
DISARMED = "1000000000"
START_TIMEOUT = 120.0
# module -> distribution of what pyspark[connect] adds on the client
CLIENT_PACKAGES = (
    ("grpc", "grpcio"),
    ("grpc_status", "grpcio-status"),
    ("google.rpc", "googleapis-common-protos"),
    ("zstandard", "zstandard"),
)


@dataclass
class ConnectServer:
    port: int
    dir: Path
    log: Path
    fault_counter: Path

    @property
    def remote(self) -> str:
        return f"sc://127.0.0.1:{self.port}"

    def arm_fault(self) -> None:
        """The next arrival at FAULT_POINT in any server Python worker hard-exits."""
        self.fault_counter.write_text("0")

    def crashes(self) -> int:
        """Arrivals at FAULT_POINT since arm_fault (1 = exactly the one crash)."""
        return int(self.fault_counter.read_text() or 0)

    def log_tail(self, chars: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""


def _spark_home() -> Path:
    import pyspark

    return Path(pyspark.__file__).parent


def _why_not_startable(home: Path) -> str | None:
    """A reason the Connect server cannot run here, or None."""
    script = home / "sbin" / "start-connect-server.sh"
    if not script.is_file():
        return f"pyspark at {home} has no {script.relative_to(home)}"
    if not any((home / "jars").glob("spark-connect_*.jar")):
        return f"pyspark at {home} ships no spark-connect jar in jars/"
    if shutil.which("java") is None:
        return "java is not on PATH (the Connect server is a JVM)"
    missing = [pkg for module, pkg in CLIENT_PACKAGES if not _importable(module)]
    if missing:
        return (
            f"Spark Connect client packages missing ({', '.join(missing)}): "
            "pip install 'txsink[connect]'"
        )
    return None


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a missing parent package (google.rpc without google)
        return False


def _answers(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(1)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """Stop the server's whole process group (JVM and its Python workers)."""
    if proc.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


@pytest.fixture(scope="module")
def connect_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ConnectServer]:
    home = _spark_home()
    reason = _why_not_startable(home)
    if reason:
        pytest.skip(f"Spark Connect server cannot start: {reason}")
    root = tmp_path_factory.mktemp("spark-connect")
    server = ConnectServer(free_port(), root, root / "server.log", root / f"fault.{FAULT_POINT}")
    server.fault_counter.write_text(DISARMED)
    txsink_dir = str(Path(txsink.__file__).resolve().parents[1])
    env = {
        **os.environ,
        "SPARK_HOME": str(home),  # pyspark's own scripts and jars, never another Spark
        "SPARK_LOG_DIR": str(root / "logs"),
        "SPARK_PID_DIR": str(root / "pid"),
        "SPARK_CONF_DIR": str(root / "conf"),
        "PYSPARK_PYTHON": sys.executable,
        "PYTHONPATH": os.pathsep.join(
            p for p in (txsink_dir, os.environ.get("PYTHONPATH", "")) if p
        ),
        "TXSINK_FAULT": FAULT_POINT,
        "TXSINK_FAULT_TIMES": "1",
        "TXSINK_FAULT_STATE": str(root / "fault"),
    }
    (root / "conf").mkdir()
    command = [
        "bash",
        str(home / "sbin" / "start-connect-server.sh"),
        "--wait",  # stay in the foreground: this fixture owns the process
        *("--master", "local[2]"),
        *("--conf", f"spark.connect.grpc.binding.port={server.port}"),
        *("--conf", "spark.connect.grpc.binding.address=127.0.0.1"),
        *("--conf", "spark.driver.host=127.0.0.1"),
        *("--conf", "spark.driver.bindAddress=127.0.0.1"),
        *("--conf", "spark.ui.enabled=false"),
        *("--conf", "spark.sql.shuffle.partitions=2"),
    ]
    with server.log.open("wb") as log:
        proc = subprocess.Popen(
            command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while not _answers(server.port):
            if proc.poll() is not None:
                pytest.skip(
                    f"Spark Connect server exited with {proc.returncode} before answering "
                    f"on port {server.port}:\n{server.log_tail()}"
                )
            if time.monotonic() > deadline:
                pytest.skip(
                    f"Spark Connect server did not answer on port {server.port} within "
                    f"{START_TIMEOUT:.0f} s:\n{server.log_tail()}"
                )
            time.sleep(0.5)
        yield server
    finally:
        _stop(proc)


@pytest.fixture
def remote_spark(connect_server: ConnectServer) -> Iterator[Any]:
    """A Spark Connect client session (no SparkContext) with txsink registered."""
    from pyspark.sql import SparkSession

    # Creating a remote session sets SPARK_CONNECT_MODE_ENABLED (and SPARK_REMOTE) in
    # os.environ; every Spark process later tests start would inherit it and try to be a
    # Connect client. Put the environment back as it was.
    saved = dict(os.environ)
    session = SparkSession.builder.remote(connect_server.remote).create()
    txsink.register(session)
    try:
        yield session
    finally:
        session.stop()
        os.environ.clear()
        os.environ.update(saved)


def _runs(zk: Any, job: str) -> list[str]:
    return zk.get_children(f"/txsink/jobs/{job}/runs")


def _stream(spark: Any, job: Any, *, foreach: bool = False) -> str | None:
    """Run the job's streaming query to the end (availableNow); the error text, or None."""
    options = {"url": job.url, "keeper": job.keeper, "table": job.table, "job": job.name}
    df = spark.readStream.schema(SOURCE_SCHEMA_DDL).option("maxFilesPerTrigger", 2)
    writer = (
        df.parquet(str(job.src))
        .writeStream.option("checkpointLocation", str(job.checkpoint))
        .trigger(availableNow=True)
    )
    if foreach:
        query = writer.foreachBatch(txsink.foreach_batch(**options)).start()
    else:
        query = writer.format("clickhouse_tx").options(**options).start()
    try:
        query.awaitTermination()
    except Exception as exc:  # the client sees the server's StreamingQueryException
        return str(exc)
    return None


def test_batch_save_through_spark_connect_publishes_once_and_its_rerun_writes_nothing(
    remote_spark, stack, ch, fresh_db, zk
):
    table = f"{fresh_db}.t"
    ch.command(
        f"CREATE TABLE {table} (id Int64, day Date) ENGINE = MergeTree "
        "PARTITION BY toYYYYMM(day) ORDER BY id"
    )
    df = remote_spark.range(0, 3000).selectExpr(
        "id", "date_add(DATE'2024-01-01', CAST(id % 90 AS INT)) AS day"
    )
    job = f"connect-batch-{fresh_db}"
    for _ in range(2):
        (
            df.write.format("clickhouse_tx")
            .option("url", stack.url)
            .option("keeper", stack.keeper)
            .option("table", table)
            .option("job", job)
            .option("txn_version", 7)
            .mode("append")
            .save()
        )
        counts = ch.query(f"SELECT count(), uniqExact(id) FROM {table}").result_rows[0]
        assert counts == (3000, 3000)
    assert zk.get_children(f"/txsink/jobs/{job}/xids") == ["b7"]


@pytest.mark.slow  # make test keeps Spark Connect's batch save and foreach_batch
def test_streaming_through_spark_connect_crashed_after_prepare_restarts_exactly_once(
    connect_server, remote_spark, stack, ch, fresh_db, tmp_path
):
    job = new_job(tmp_path, ch, fresh_db, stack.url, stack.keeper, files=4, rows_per_file=1000)
    connect_server.arm_fault()
    error = _stream(remote_spark, job)
    assert error is not None, "the query was supposed to fail: its commit worker hard-exits"
    assert connect_server.crashes() == 1, connect_server.log_tail()
    assert [r.state for r in job.records()] == [XidState.PREPARED]
    assert _stream(remote_spark, job) is None, connect_server.log_tail()
    assert_exact(ch, job)
    assert staging_left(ch, job) == []
    records = job.records()
    assert sorted(r.batch for r in records) == [0, 1]
    assert all(r.state is XidState.COMMITTED for r in records)


def test_foreach_batch_through_spark_connect_is_exact_and_one_run_is_one_writer_run(
    remote_spark, stack, ch, fresh_db, zk, tmp_path
):
    job = new_job(tmp_path, ch, fresh_db, stack.url, stack.keeper, files=4, rows_per_file=1000)
    assert _stream(remote_spark, job, foreach=True) is None
    assert_exact(ch, job)
    assert staging_left(ch, job) == []
    assert sorted(r.batch for r in job.records()) == [0, 1]
    # two batches of one query run: one writer run (no takeover per batch)
    assert len(_runs(zk, job.name)) == 1, _runs(zk, job.name)
