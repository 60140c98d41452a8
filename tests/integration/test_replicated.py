"""Replicated targets in attach mode, as far as the embedded engine can take them.

chdb 26.9 given a ZooKeeper (``txsink embedded up --replicated``) creates
``Replicated*MergeTree`` tables and registers them in Keeper, but keeps every replica
read-only (no interserver address). So this file checks what can be checked here, against
the real engine and a real ZooKeeper: the staging DDL (replicated, a Keeper path of its
own, the target's keys and settings), the Keeper paths, their cleanup, the repair of a
leftover replica, and that a write the replica refuses fails loudly with nothing left
behind. Inserting, ``MOVE PARTITION`` into a replicated target and its replication to the
other replicas run in ``tests/realserver/test_cluster.py`` (docker-compose.cluster.yml).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kazoo.client import KazooClient

from tests.integration.conftest import client_for, free_port
from txsink.clickhouse.blockers import attach_blockers, check_move_compat
from txsink.clickhouse.client import connect
from txsink.clickhouse.replicated_ddl import staging_keeper_path
from txsink.clickhouse.staging import STAGING_SETTINGS
from txsink.clickhouse.warehouse import ClickHouseWarehouse
from txsink.embedded import stack as embedded
from txsink.protocol.ids import staging_name

TARGET = (
    "CREATE TABLE {table} (id Int64, day Date, v String, "
    "INDEX iv v TYPE bloom_filter GRANULARITY 1, PROJECTION by_v (SELECT id, v ORDER BY v)) "
    "ENGINE = ReplicatedReplacingMergeTree('/clickhouse/tables/{{shard}}/{{database}}/{{table}}', "
    "'{{replica}}', id) PARTITION BY toYYYYMM(day) ORDER BY id TTL day + INTERVAL 1 YEAR "
    "SETTINGS deduplicate_merge_projection_mode = 'drop', parts_to_throw_insert = 50"
)


@pytest.fixture(scope="module")
def rstack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[embedded.StackInfo]:
    root = tmp_path_factory.mktemp("replicated-stack")
    info = embedded.up(root, free_port(), free_port(), timeout=90, replicated=True)
    try:
        yield info
    finally:
        embedded.down(root)


@pytest.fixture
def env(rstack: embedded.StackInfo) -> Iterator[dict[str, Any]]:
    ch = client_for(rstack)
    zk = KazooClient(hosts=rstack.keeper, timeout=10)
    zk.start(timeout=15)
    db = f"r_{uuid.uuid4().hex[:10]}"
    staging_db = f"s_{db}"
    ch.command(f"CREATE DATABASE {db}")
    ch.command(TARGET.format(table=f"{db}.t"))
    client = connect(rstack.url)
    wh = ClickHouseWarehouse(client, staging_db)
    wh.ensure_staging_db()
    try:
        yield {"ch": ch, "zk": zk, "db": db, "wh": wh, "staging_db": staging_db}
    finally:
        for d in (db, staging_db):
            ch.command(f"DROP DATABASE IF EXISTS {d} SYNC")
        client.close()
        ch.close()
        zk.stop()
        zk.close()


def replica_row(ch: Any, db: str, table: str) -> tuple[Any, ...]:
    rows = ch.query(
        "SELECT zookeeper_path, replica_name, is_readonly FROM system.replicas "
        f"WHERE database = '{db}' AND table = '{table}'"
    ).result_rows
    assert len(rows) == 1, rows
    return tuple(rows[0])


def test_the_stack_gives_clickhouse_a_keeper_but_replicas_stay_read_only(env) -> None:
    path, replica, readonly = replica_row(env["ch"], env["db"], "t")
    assert (path, replica) == (f"/clickhouse/tables/01/{env['db']}/t", "r1")
    assert env["zk"].exists(f"{path}/replicas/r1") is not None
    assert readonly == 1  # chdb: no interserver address, so no insert can run here


def test_a_replicated_target_is_not_blocked_and_its_staging_has_its_own_keeper_path(env):
    ch, zk, wh, db = env["ch"], env["zk"], env["wh"], env["db"]
    target = wh.target_info(f"{db}.t")
    assert attach_blockers(target) == []
    name = staging_name("rjob", "b1", "00000000", 0, 0, 7).table
    wh.create_staging(f"{db}.t", name)

    path, replica, _ = replica_row(ch, env["staging_db"], name)
    assert path == staging_keeper_path(target, env["staging_db"], name)
    assert path.startswith(target.zookeeper_path + "_txsink_staging/")  # a sibling, not inside
    assert replica == "r1"
    assert zk.exists(f"{path}/replicas/r1") is not None
    assert zk.get_children(f"{target.zookeeper_path}/replicas") == ["r1"]  # target untouched

    staged = wh.target_info(f"{env['staging_db']}.{name}", staging=True)
    assert staged.engine == "ReplicatedReplacingMergeTree"
    assert check_move_compat(staged, target) is None  # keys, columns, indices, projections
    assert not staged.table_ttl  # staging keeps every row (and needed no ALTER)
    for key, value in STAGING_SETTINGS.items():
        assert staged.settings[key] == str(value), key  # its own SETTINGS clause
    assert "deduplicate_merge_projection_mode = 'drop'" in staged.engine_full

    wh.drop_stagings([name])
    assert zk.exists(path) is None  # DROP ... SYNC took its Keeper metadata with it
    assert zk.get_children(f"{target.zookeeper_path}/replicas") == ["r1"]


def test_a_leftover_keeper_replica_of_a_staging_name_is_dropped_and_the_staging_created(env):
    """A staging DROP that never reached Keeper leaves its replica there; CREATE then fails
    REPLICA_ALREADY_EXISTS on every retry (a wedge) unless txsink clears it."""
    ch, zk, wh, db = env["ch"], env["zk"], env["wh"], env["db"]
    target = wh.target_info(f"{db}.t")
    name = staging_name("rjob", "b2", "00000000", 1, 0, 9).table
    path = staging_keeper_path(target, env["staging_db"], name)
    ch.command(
        f"CREATE TABLE {env['staging_db']}.decoy (id Int64, day Date) "
        f"ENGINE = ReplicatedMergeTree('{path}', 'r1') ORDER BY id"
    )
    ch.command(f"DETACH TABLE {env['staging_db']}.decoy PERMANENTLY")  # Keeper keeps it
    assert zk.exists(f"{path}/replicas/r1") is not None

    wh.create_staging(f"{db}.t", name)
    assert replica_row(ch, env["staging_db"], name)[0] == path
    staged = wh.target_info(f"{env['staging_db']}.{name}", staging=True)
    assert check_move_compat(staged, target) is None
    wh.drop_stagings([name])
    assert zk.exists(path) is None


@pytest.mark.spark
def test_a_save_the_read_only_replica_refuses_fails_loudly_and_leaves_no_staging(
    spark, env, rstack, tmp_path: Path
) -> None:
    ch, zk, db = env["ch"], env["zk"], env["db"]
    target = env["wh"].target_info(f"{db}.t")
    options = {
        "url": rstack.url,
        "keeper": rstack.keeper,
        "table": f"{db}.t",
        "job": f"r-{uuid.uuid4().hex[:8]}",
        "mode": "attach",
        "staging_database": env["staging_db"],
        "txn_version": "1",
        "retry_attempts": "1",
    }
    df = spark.range(0, 1000, numPartitions=2).selectExpr(
        "id", "date_add(date'2024-01-01', cast(id % 40 as int)) AS day", "'x' AS v"
    )
    with pytest.raises(Exception, match="TABLE_IS_READ_ONLY"):
        df.write.format("clickhouse_tx").options(**options).mode("append").save()
    assert ch.query(f"SELECT count() FROM {db}.t").result_rows[0][0] == 0
    left = ch.query(f"SELECT name FROM system.tables WHERE database = '{env['staging_db']}'")
    assert left.result_rows == []
    parent = f"{target.zookeeper_path}_txsink_staging/{env['staging_db']}"
    assert not zk.exists(parent) or zk.get_children(parent) == []
