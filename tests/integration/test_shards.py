"""One xid across shards (issue 11) on an embedded cluster of three independent ClickHouse
endpoints (each its own chdb engine, data directory and port) and one ZooKeeper.

The invariants: whatever crashes, the total over the shards is exact, each shard holds
exactly the rows routed to it (``intHash64(id) % 3``, the shard a Distributed table with
that sharding key would choose), and nothing is published twice on any shard; a shard
that is down during a commit keeps the xid PREPARED until it is back, then recovery
finishes it there.
"""

from __future__ import annotations

import contextlib
import json
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from tests.integration.conftest import client_for
from tests.integration.sparkjob import Job, new_job
from tests.nemesis.services import Services
from txsink.clickhouse.shards import shard_of_rows
from txsink.config import WriterConfig
from txsink.demo import target_ddl
from txsink.driver import open_job
from txsink.embedded import stack as embedded
from txsink.embedded.stack import StackInfo
from txsink.errors import TxSinkError
from txsink.faults import POINTS
from txsink.ops.verify import verify_job
from txsink.protocol.ids import batch_xid, run_tag, staging_name
from txsink.protocol.states import StagedPart, XidState

SHARDS = 3


def _free_run(n: int) -> int:
    """A port p with p .. p+n-1 all free on 127.0.0.1 now."""
    for _ in range(200):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            base = int(sock.getsockname()[1])
        if base + n > 65535:
            continue
        ok = True
        for port in range(base, base + n):
            with socket.socket() as probe:
                try:
                    probe.bind(("127.0.0.1", port))
                except OSError:
                    ok = False
                    break
        if ok:
            return base
    raise RuntimeError(f"no run of {n} free ports")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Services]:
    root = tmp_path_factory.mktemp("shards-stack")
    info = embedded.up(root, _free_run(SHARDS), _free_run(1), timeout=120, shards=SHARDS)
    try:
        yield Services(info)
    finally:
        embedded.down(root)


def shard_clients(info: StackInfo) -> list[Any]:
    return [client_for(StackInfo(info.dir, url, info.keeper, 0, 0)) for url in info.shards]


@pytest.fixture
def shards(cluster: Services) -> Iterator[list[Any]]:
    clients = shard_clients(cluster.info)
    yield clients
    for c in clients:
        c.close()


@pytest.fixture
def db(shards: list[Any]) -> Iterator[str]:
    name = f"sh_{uuid.uuid4().hex[:10]}"
    for c in shards:
        c.command(f"CREATE DATABASE {name}")
    yield name
    for c in shards:
        with contextlib.suppress(Exception):
            c.command(f"DROP DATABASE IF EXISTS {name} SYNC")


def per_shard(shards: list[Any], table: str) -> list[tuple[int, int, int, int]]:
    """(count, uniqExact(id), rows on the wrong shard, sum(amount)) of every shard."""
    return [
        tuple(
            c.query(
                f"SELECT count(), uniqExact(id), countIf(intHash64(id) % {SHARDS} != {k}), "
                f"sum(amount) FROM {table}"
            ).result_rows[0]
        )
        for k, c in enumerate(shards)
    ]


def assert_exact_on_shards(shards: list[Any], job: Job) -> None:
    rows = per_shard(shards, job.table)
    for k, (count, distinct, misplaced, _) in enumerate(rows):
        assert count == distinct, f"shard {k}: {count} rows, {distinct} distinct: duplicates"
        assert misplaced == 0, f"shard {k}: {misplaced} rows that belong to another shard"
    assert sum(r[0] for r in rows) == job.produced, f"{rows} vs produced {job.produced}"
    assert sum(r[3] for r in rows) == job.amount
    assert all(r[0] > 0 for r in rows), f"a shard got no rows: {rows}"


def sharded_job(tmp_path: Path, shards: list[Any], info: StackInfo, db: str, **kw: Any) -> Job:
    table = f"{db}.orders"
    for c in shards[1:]:
        c.command(target_ddl(table))
    return new_job(tmp_path, shards[0], db, info.url, info.keeper, **kw)


def shard_options(info: StackInfo) -> list[str]:
    return ["--option", f"shards={','.join(info.shards)}", "--option", "shard_by=id"]


def staging_on_shards(shards: list[Any], job: Job) -> list[str]:
    return [
        r[0]
        for c in shards
        for r in c.query(
            "SELECT name FROM system.tables WHERE database = 'txsink_staging' "
            "AND name LIKE {p:String}",
            parameters={"p": f"%{job.name.replace('-', '_')}%"},
        ).result_rows
    ]


def test_routing_matches_the_engines_int_hash64_for_every_integer_type(
    shards: list[Any],
) -> None:
    values = [0, 1, 2, 42, -1, -5, 123456789, 2**40 + 7, -(2**63), 2**63 - 1]
    for ch_type, arrow_type, vals in (
        ("Int64", pa.int64(), values),
        ("Int32", pa.int32(), [v for v in values if -(2**31) <= v < 2**31]),
        ("UInt64", pa.uint64(), [v % 2**64 for v in values]),
        ("UInt8", pa.uint8(), [0, 1, 2, 200, 255]),
    ):
        literal = ", ".join(f"to{ch_type}({v})" for v in vals)
        engine = (
            shards[0]
            .query(f"SELECT arrayMap(x -> intHash64(x) % {SHARDS}, [{literal}])")
            .result_rows[0][0]
        )
        batch = pa.record_batch({"k": pa.array(vals, arrow_type)})
        mine = shard_of_rows(batch, SHARDS, "k", 0).tolist()
        assert mine == [int(x) for x in engine], ch_type


@pytest.mark.parametrize(
    "points",
    [
        # make test keeps a shard killed during the commit (below)
        pytest.param(("driver.mid_commit",), id="key-points", marks=pytest.mark.slow),
        pytest.param(
            tuple(p for p in POINTS if p not in ("driver.after_record", "executor.mid_write")),
            id="every-point",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_sharded_stream_crashed_at_every_fault_point_is_exact_on_every_shard(
    cluster: Services, shards: list[Any], db: str, tmp_path: Path, points: tuple[str, ...]
) -> None:
    """Every fault point where shards change what recovery does, in turn, then a clean
    run: the total over 3 shards is exact, each shard holds exactly its rows, no staging
    is left on any shard, every xid COMMITTED. (``driver.after_record`` leaves only a
    stray sweep, and ``executor.mid_write`` a task Spark reruns whose half-written
    staging that sweep drops, the same on one server as on three; a driver's kill -9
    lands between these points: they are crashed on one server by the every-point
    matrices, tests/integration/test_spark_cluster.py and test_spark_crashes.py.)"""
    info = cluster.info
    job = sharded_job(tmp_path, shards, info, db, files=8, rows_per_file=600)
    extra = shard_options(info)
    for point in points:
        crashed = job.run(*extra, fault=point, fault_after=1, files_per_trigger=1)
        assert crashed != 0, f"the job was supposed to die at {point}\n{job.log_tail()}"
    assert job.run(*extra) == 0, job.log_tail()
    assert_exact_on_shards(shards, job)
    assert staging_on_shards(shards, job) == []
    records = job.records()
    assert records and all(r.state is XidState.COMMITTED for r in records)
    staged_shards = {p.table.rsplit("_s", 1)[1] for r in records for p in r.manifest}
    assert staged_shards == {"0", "1", "2"}  # the manifests name every shard

    config = WriterConfig.from_options(
        {"url": info.url, "keeper": info.keeper, "table": job.table, "job": job.name,
         "shards": ",".join(info.shards), "shard_by": "id"}
    )  # fmt: skip
    result = verify_job(config)
    assert result.clean, result.to_json()
    checked = result.checked["shards"]
    assert [c["target_rows"] for c in checked] == [r[0] for r in per_shard(shards, job.table)]
    assert [c["ledger_rows"] for c in checked] == [c["target_rows"] for c in checked]

    # one row moved from shard 1 to shard 0: the total still matches, the shards do not
    row = shards[1].query(f"SELECT * FROM {job.table} ORDER BY id LIMIT 1")
    shards[0].insert(job.table, row.result_rows, column_names=list(row.column_names))
    shards[1].command(
        f"ALTER TABLE {job.table} DELETE WHERE id = {row.result_rows[0][0]}",
        settings={"mutations_sync": 2},  # rewrites the part: system.parts counts it gone
    )
    result = verify_job(config)
    where = {(a.kind, a.message.partition(" on shard ")[2][:1]) for a in result.anomalies}
    assert where == {("reconciliation", "0"), ("reconciliation", "1")}, result.to_json()


def stage_on_shards(handle: Any, xid: str, ids: range) -> list[StagedPart]:
    """One task attempt's rows routed to the 3 shards, each into its staging there."""
    cfg = handle.config
    batch = pa.record_batch(
        {
            "id": pa.array(np.array(ids, dtype=np.int64)),
            "p": pa.array([i % 2 for i in ids], pa.uint8()),
        }
    )
    parts: list[StagedPart] = []
    where = shard_of_rows(batch, SHARDS, "id", 0)
    for k in range(SHARDS):
        name = staging_name(
            cfg.job, xid, run_tag("r1"), 0, 0, ids.start, handle.transactor.namespace, shard=k
        ).table
        handle.warehouse.create_staging(cfg.table, name)
        handle.warehouse.insert_blocks(
            name, [batch.filter(pa.array(where == k))], block_rows=10**6, block_bytes=10**9
        )
        parts += [
            StagedPart(name, pid, n, uuids=u)
            for pid, (n, u) in sorted(handle.warehouse.staged_partitions(name).items())
        ]
    return parts


def test_a_shard_killed_during_the_commit_keeps_the_xid_prepared_until_recovery_finishes_it(
    cluster: Services, shards: list[Any], db: str
) -> None:
    table = f"{db}.t"
    for c in shards:
        c.command(
            f"CREATE TABLE {table} (id Int64, p UInt8) ENGINE = MergeTree PARTITION BY p "
            f"ORDER BY id"
        )
    info = cluster.info
    config = WriterConfig.from_options(
        {
            "shards": ",".join(info.shards),
            "keeper": info.keeper,
            "table": table,
            "job": f"shk-{uuid.uuid4().hex[:8]}",
            "publish_retry_s": "1",
            "retry_attempts": "1",
            "connect_timeout": "2",
        }
    )
    handle = open_job(config)
    try:
        handle.warehouse.ensure_staging_db()
        tx = handle.transactor
        epoch = tx.begin("run-1")
        parts = stage_on_shards(handle, batch_xid(0), range(0, 3000))

        def kill_shard_1(point: str) -> None:
            if point == "driver.mid_commit":  # shard 0's MOVE is done, shard 1's is next
                cluster.kill("clickhouse-1")

        tx.fault = kill_shard_1
        with pytest.raises(TxSinkError):
            tx.commit_batch(epoch, batch_xid(0), 0, table, parts, streaming=True)
        record = handle.registry.get(config.job, batch_xid(0))
        assert record is not None and record.state is XidState.PREPARED
    finally:
        handle.close()
    cluster.restart()
    handle = open_job(config)
    try:
        report = handle.transactor.recover(handle.registry.take_epoch(config.job, "recover"))
        assert report.rolled_forward == [batch_xid(0)] and not report.alarms
    finally:
        handle.close()
    fresh = shard_clients(cluster.info)
    try:
        counts = [
            c.query(
                f"SELECT count(), uniqExact(id), countIf(intHash64(id) % {SHARDS} != {k}) "
                f"FROM {table}"
            ).result_rows[0]
            for k, c in enumerate(fresh)
        ]
    finally:
        for c in fresh:
            c.close()
    assert [c[0] for c in counts] == [c[1] for c in counts]  # nothing twice on any shard
    assert all(c[2] == 0 for c in counts)
    assert sum(c[0] for c in counts) == 3000


def test_tune_measures_every_shard_and_combines_them_leaving_nothing_behind(
    cluster: Services, shards: list[Any], db: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from txsink.cli.main import main

    info = cluster.info
    table = f"{db}.orders"
    for c in shards:
        c.command(target_ddl(table))
        c.command(
            f"INSERT INTO {table} (id, event_time, day, customer, amount) SELECT number, "
            "now64(6), toDate('2024-01-01') + number * 40, 'c', 1 FROM numbers(20)"
        )
    capsys.readouterr()
    code = main(
        ["tune", "--url", info.url, "--keeper", info.keeper, "--table", table,
         "--shards", ",".join(info.shards), "--transactions", "2", "--json"]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    doc = json.loads(out)
    assert [s["url"] for s in doc["shards"]] == list(info.shards)
    assert all(s["commit_s"]["p50"] > 0 for s in doc["shards"])
    slowest = max(s["commit_s"]["p50"] for s in doc["shards"])
    assert doc["commit_s"]["p50"] >= slowest  # commits add up over the shards
    for c in shards:
        left = c.query(
            f"SELECT name FROM system.tables WHERE database = '{db}' AND name LIKE '__txsink%'"
        ).result_rows
        assert left == [] and c.query(f"SELECT count() FROM {table}").result_rows[0][0] == 20


def test_create_table_creates_the_missing_target_on_every_shard_that_lacks_it(
    cluster: Services, shards: list[Any], db: str
) -> None:
    """Driver-side only: validation creates the table where it is missing (here: on every
    shard but the first, which has it already), then validates all of them."""
    from pyspark.sql.types import LongType, StringType, StructField, StructType

    from txsink.spark.validate import validate

    info = cluster.info
    shards[0].command(
        f"CREATE TABLE {db}.made (`id` Int64, `s` Nullable(String)) ENGINE = MergeTree ORDER BY id"
    )
    schema = StructType([StructField("id", LongType()), StructField("s", StringType())])
    config = WriterConfig.from_options(
        {"keeper": info.keeper, "table": f"{db}.made", "job": f"mk-{uuid.uuid4().hex[:8]}",
         "shards": ",".join(info.shards), "create_table": "if_missing", "order_by": "id"}
    )  # fmt: skip
    assert validate(config, schema).mode == "attach"
    columns = [
        c.query(f"SELECT name, type FROM system.columns WHERE database = '{db}' AND "
                "table = 'made' ORDER BY position").result_rows
        for c in shards
    ]  # fmt: skip
    assert columns == [[("id", "Int64"), ("s", "Nullable(String)")]] * SHARDS
