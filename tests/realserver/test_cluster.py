"""Replicated and sharded targets on a real ClickHouse cluster (docker-compose.cluster.yml).

What the embedded engine cannot do (its replicas stay read-only): inserts into replicated
staging, ``MOVE PARTITION`` between replicated tables, replication of the published parts
to the other replica of each shard, one xid across two shards of replicated tables, a
crash between the MOVEs of two shards and its roll-forward, and a ``Distributed`` target
(its shards found in ``system.clusters``).

Set ``TXSINK_CLUSTER_SHARDS`` (one replica of each shard, comma-separated HTTP URLs),
``TXSINK_CLUSTER_REPLICAS`` (the other replica of each shard, same order) and
``TXSINK_REAL_KEEPER``. Without them, or when a node does not answer, every test here is
skipped with that reason (never counted as passed).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlparse

import numpy as np
import pyarrow as pa
import pytest

pytestmark = [pytest.mark.realserver, pytest.mark.spark]

SHARDS = [u for u in os.environ.get("TXSINK_CLUSTER_SHARDS", "").split(",") if u]
REPLICAS = [u for u in os.environ.get("TXSINK_CLUSTER_REPLICAS", "").split(",") if u]
KEEPER = os.environ.get("TXSINK_REAL_KEEPER", "")
CLUSTER = "txsink_cluster"
ROWS = 20_000


def _answers(url: str) -> bool:
    u = urlparse(url)
    try:
        with socket.create_connection((u.hostname or "", u.port or 8123), timeout=2):
            return True
    except OSError:
        return False


def _skip_reason() -> str | None:
    if len(SHARDS) < 2 or len(REPLICAS) != len(SHARDS) or not KEEPER:
        return (
            "no real cluster: set TXSINK_CLUSTER_SHARDS, TXSINK_CLUSTER_REPLICAS and "
            "TXSINK_REAL_KEEPER (docker compose -f docker-compose.cluster.yml up -d)"
        )
    down = [u for u in (*SHARDS, *REPLICAS) if not _answers(u)]
    return f"cluster node(s) {', '.join(down)} do not answer" if down else None


REASON = _skip_reason()
skip_without_cluster = pytest.mark.skipif(REASON is not None, reason=REASON or "")


@pytest.fixture
def cluster() -> Iterator[dict[str, Any]]:
    from txsink.clickhouse.client import connect

    clients = {u: connect(u) for u in (*SHARDS, *REPLICAS)}
    db = f"txsink_cluster_{uuid.uuid4().hex[:8]}"
    first = clients[SHARDS[0]]
    first.command(f"CREATE DATABASE {db} ON CLUSTER {CLUSTER}")
    first.command(
        f"CREATE TABLE {db}.t ON CLUSTER {CLUSTER} (id Int64, day Date) "
        "ENGINE = ReplicatedMergeTree('/clickhouse/tables/{shard}/{database}/{table}', "
        "'{replica}') PARTITION BY toYYYYMM(day) ORDER BY id"
    )
    first.command(
        f"CREATE TABLE {db}.t_all ON CLUSTER {CLUSTER} AS {db}.t "
        f"ENGINE = Distributed({CLUSTER}, {db}, t, intHash64(id))"
    )
    try:
        yield {"db": db, "clients": clients}
    finally:
        first.command(f"DROP DATABASE IF EXISTS {db} ON CLUSTER {CLUSTER} SYNC")
        for c in clients.values():
            c.close()


def options(db: str, job: str) -> dict[str, str]:
    return {
        "url": SHARDS[0],
        "shards": ",".join(SHARDS),
        "shard_by": "id",
        "keeper": KEEPER,
        "table": f"{db}.t",
        "job": job,
        "mode": "attach",
        "txn_version": "1",
    }


def routed(n_shards: int) -> list[int]:
    """Rows per shard for ids 0..ROWS-1, as ClickHouse's Distributed would route them."""
    from txsink.clickhouse.shards import shard_of_rows

    batch = pa.RecordBatch.from_pydict({"id": pa.array(np.arange(ROWS), pa.int64())})
    shards = shard_of_rows(batch, n_shards, "id", 0)
    return [int((shards == k).sum()) for k in range(n_shards)]


def assert_exact(cluster: dict[str, Any], job: str) -> None:
    from txsink.protocol.ids import staging_prefix

    db, clients = cluster["db"], cluster["clients"]
    want = routed(len(SHARDS))
    for k, (url, replica) in enumerate(zip(SHARDS, REPLICAS, strict=True)):
        clients[replica].command(f"SYSTEM SYNC REPLICA {db}.t")
        for node in (url, replica):
            got = clients[node].query_rows(
                f"SELECT count(), uniqExact(id), countIf(intHash64(id) % {len(SHARDS)} != {k}) "
                f"FROM {db}.t"
            )[0]
            assert got == (want[k], want[k], 0), (node, got, want[k])
        left = clients[url].query_rows(
            "SELECT count() FROM system.tables WHERE database = 'txsink_staging' "
            f"AND startsWith(name, '{staging_prefix(job)}__')"
        )
        assert left[0][0] == 0, f"staging tables of {job} left on shard {k}"
        staging_paths = clients[url].query_rows(
            "SELECT count() FROM system.zookeeper WHERE path = "
            f"'/clickhouse/tables/0{k + 1}/{db}/t_txsink_staging/txsink_staging'"
        )
        assert staging_paths[0][0] == 0, f"staging Keeper metadata left on shard {k}"
    total = clients[SHARDS[0]].query_rows(f"SELECT count(), uniqExact(id) FROM {db}.t_all")[0]
    assert total == (ROWS, ROWS)


def save(db: str, job: str, fault: str | None = None, opts: dict[str, str] | None = None) -> int:
    """One save of ids 0..ROWS-1 in a fresh Spark driver process; its exit code."""
    opts = opts or options(db, job)
    script = textwrap.dedent(
        f"""
        from pyspark.sql import SparkSession
        import txsink
        spark = SparkSession.builder.master("local[2]").getOrCreate()
        txsink.register(spark)
        df = spark.sql("SELECT id, date_add(DATE'2024-01-01', CAST(id % 90 AS INT)) AS day "
                       "FROM range({ROWS})")
        df.write.format("clickhouse_tx").options(**{opts!r}).mode("append").save()
        """
    )
    env = dict(os.environ, PYSPARK_PYTHON=sys.executable)
    env.pop("TXSINK_FAULT", None)
    if fault:
        env["TXSINK_FAULT"] = fault
    return subprocess.run(
        [sys.executable, "-c", script], check=False, env=env, timeout=600
    ).returncode


def recover(job: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "txsink.cli.main", "recover", "--url", SHARDS[0],
         "--keeper", KEEPER, "--job", job, "--yes", "--json"],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip


@skip_without_cluster
def test_one_xid_across_two_shards_of_replicated_tables_is_exact_on_every_replica(cluster):
    db = cluster["db"]
    job = f"cl-{uuid.uuid4().hex[:8]}"
    assert save(db, job) == 0
    assert save(db, job) == 0  # a replay of the same txn_version publishes nothing
    assert_exact(cluster, job)


@skip_without_cluster
@pytest.mark.parametrize("point", ["driver.after_prepare", "driver.mid_commit"])
def test_a_driver_killed_during_a_cross_shard_commit_is_rolled_forward_on_every_shard(
    cluster, point: str
):
    db = cluster["db"]
    job = f"cl-{uuid.uuid4().hex[:8]}"
    assert save(db, job, fault=point) == 137
    done = recover(job)
    assert done.returncode == 0, done.stdout + done.stderr
    assert_exact(cluster, job)


def _cluster_hosts_resolve() -> bool:
    try:
        socket.gethostbyname("ch-s1r1")
        socket.gethostbyname("ch-s2r1")
    except OSError:
        return False
    return True


@skip_without_cluster
@pytest.mark.skipif(
    not _cluster_hosts_resolve(),
    reason="table= naming the Distributed table makes txsink write to the hosts of "
    "system.clusters (ch-s1r1, ch-s2r1 on port 8123): run the tests inside the compose "
    "network, or map those names to the containers' addresses in /etc/hosts",
)
def test_a_distributed_target_is_one_xid_into_the_local_tables_of_its_cluster(cluster):
    """table= t_all (Distributed over txsink_cluster, intHash64(id)): the shards, the
    local table and shard_by come from the server, the result is the sharded write's."""
    db = cluster["db"]
    job = f"cl-{uuid.uuid4().hex[:8]}"
    opts = options(db, job)
    for key in ("shards", "shard_by"):
        opts.pop(key)
    opts["table"] = f"{db}.t_all"
    assert save(db, job, opts=opts) == 0
    assert_exact(cluster, job)


@skip_without_cluster
def test_tune_on_replicated_shards_uses_scratch_tables_with_their_own_keeper_path(cluster):
    db = cluster["db"]
    first = cluster["clients"][SHARDS[0]]
    first.command(
        f"INSERT INTO {db}.t_all SELECT number, toDate('2024-01-01') + number * 40 "
        "FROM numbers(40)",
        settings={"insert_distributed_sync": 1},
    )
    done = subprocess.run(
        [sys.executable, "-m", "txsink.cli.main", "tune", "--url", SHARDS[0], "--keeper",
         KEEPER, "--table", f"{db}.t", "--shards", ",".join(SHARDS), "--transactions", "2",
         "--json"],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    for url in SHARDS:
        left = cluster["clients"][url].query_rows(
            f"SELECT count() FROM system.tables WHERE database = '{db}' "
            "AND startsWith(name, '__txsink_tune')"
        )
        assert left[0][0] == 0
