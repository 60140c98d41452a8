"""Fixtures for integration tests: one embedded stack (chdb HTTP endpoint + ZooKeeper) per
test session, started in a temporary directory on free ports and stopped at the end.

- ``stack`` (session): a :class:`txsink.embedded.stack.StackInfo` (``.url``, ``.keeper``,
  ``.dir``). ``TXSINK_URL`` and ``TXSINK_KEEPER`` are exported to ``os.environ`` so
  subprocesses (CLI, Spark workers) reach the same stack.
- ``ch``: a stock ``clickhouse_connect`` client on the stack (fresh per test).
- ``zk``: a started kazoo client on the stack's ZooKeeper (stopped after the test).
- ``fresh_db``: a unique database name, created before and dropped after the test.
- ``spark`` (session): a local[2] SparkSession with txsink registered.
- ``fast_job_start`` (session, automatic): job subprocesses start their JVM from a
  class-data archive (:mod:`txsink.demo.jvm`).

Set ``TXSINK_TEST_STACK_DIR`` to keep the stack's directory (logs, data) after the run.
Every test under ``tests/integration`` gets the ``integration`` marker.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import socket
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import clickhouse_connect
import pytest
from clickhouse_connect.driver.client import Client
from kazoo.client import KazooClient

from txsink.demo import jvm
from txsink.embedded import stack as embedded
from txsink.embedded.stack import StackInfo
from txsink.errors import ConfigError

HERE = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test here is ``integration``; one that starts Spark (the ``spark`` session,
    job processes of :mod:`tests.integration.sparkjob`, the nemesis' jobs) is ``spark``
    too: ``make test`` runs those beside the others (scripts/pytest_pair.py)."""
    for item in items:
        path = Path(str(item.fspath))
        if not path.is_relative_to(HERE):
            continue
        item.add_marker(pytest.mark.integration)
        module = getattr(item, "module", None)
        if (
            "spark" in getattr(item, "fixturenames", ())
            or path.is_relative_to(HERE / "nemesis")
            or getattr(module, "new_job", None) is not None
        ):
            item.add_marker(pytest.mark.spark)


# below Linux's ephemeral range (32768-60999): a port a test stops listening on and
# starts again (a stack taken down and up) is not taken meanwhile as the source port of
# one of the suite's many outbound connections (a CI run failed so)
_PORTS = (20000, 32000)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now, outside the ephemeral range."""
    for _ in range(200):
        port = random.randint(*_PORTS)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {_PORTS}")


@pytest.fixture(scope="session", autouse=True)
def fast_job_start(request: pytest.FixtureRequest) -> Iterator[None]:
    """Job processes (``python -m txsink.demo job``) start their Spark JVM from a class-data
    archive kept in ``.txsink/jvm`` (made once, ~30 s; each of the suite's ~80 job starts
    then saves ~6 s). See :mod:`txsink.demo.jvm`. Not made for a session that starts no
    Spark (``make test``'s other half: on a fresh clone both halves made it at once)."""
    if not any(item.get_closest_marker("spark") for item in request.session.items):
        yield
        return
    saved = os.environ.get(jvm.JAVA_OPTIONS_ENV)
    note = jvm.enable(HERE.parent.parent / ".txsink" / "jvm")
    print(f"\njob JVM start-up: {note}")
    yield
    if saved is None:
        os.environ.pop(jvm.JAVA_OPTIONS_ENV, None)
    else:
        os.environ[jvm.JAVA_OPTIONS_ENV] = saved


@pytest.fixture(scope="session")
def stack() -> Iterator[StackInfo]:
    keep = os.environ.get("TXSINK_TEST_STACK_DIR")
    root = Path(keep) if keep else Path(tempfile.mkdtemp(prefix="txsink-stack-"))
    info = embedded.up(root, free_port(), free_port(), timeout=90)
    saved = {k: os.environ.get(k) for k in ("TXSINK_URL", "TXSINK_KEEPER")}
    os.environ["TXSINK_URL"] = info.url
    os.environ["TXSINK_KEEPER"] = info.keeper
    try:
        yield info
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        embedded.down(root)
        if not keep:
            shutil.rmtree(root, ignore_errors=True)


def client_for(info: StackInfo, **kwargs: object) -> Client:
    """A clickhouse_connect client on ``info``'s endpoint (kwargs go to get_client)."""
    host, port = info.url.rsplit("/", 1)[-1].split(":")
    return clickhouse_connect.get_client(host=host, port=int(port), **kwargs)


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    """One local[2] SparkSession for the in-process tests (txsink registered)."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    import txsink

    session = (
        SparkSession.builder.master("local[2]")
        .appName("txsink-tests")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.ui.enabled", "false")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    with contextlib.suppress(ConfigError):  # Spark 3.5 (make test-matrix): no data source
        txsink.register(session)
    yield session
    session.stop()


@pytest.fixture
def new_york(spark: Any) -> Iterator[Any]:
    """The Spark session with its session time zone set to America/New_York (a zone
    neither UTC nor the server's), restored afterwards."""
    before = spark.conf.get("spark.sql.session.timeZone")
    spark.conf.set("spark.sql.session.timeZone", "America/New_York")
    yield spark
    spark.conf.set("spark.sql.session.timeZone", before)


@pytest.fixture
def ch(stack: StackInfo) -> Iterator[Client]:
    client = client_for(stack)
    try:
        yield client
    finally:
        client.close()


@pytest.fixture
def zk(stack: StackInfo) -> Iterator[KazooClient]:
    client = KazooClient(hosts=stack.keeper, timeout=10)
    client.start(timeout=15)
    try:
        yield client
    finally:
        client.stop()
        client.close()


@pytest.fixture
def fresh_db(ch: Client) -> Iterator[str]:
    name = f"t_{uuid.uuid4().hex[:12]}"
    ch.command(f"CREATE DATABASE {name}")
    try:
        yield name
    finally:
        ch.command(f"DROP DATABASE IF EXISTS {name} SYNC")
