"""``table=`` naming a ``Distributed`` table (issue 11): the shards come from
``system.clusters``, the local table and ``shard_by`` from the table's engine, and the write
is one sharded attach-mode xid, exactly as if ``shards``/``shard_by`` had been given.

Three real embedded ClickHouse servers listen on 127.0.0.1, 127.0.0.2 and 127.0.0.3, all on
one port (every address of 127/8 is loopback on Linux), so a cluster definition naming the
hosts maps to their HTTP URLs the way a production cluster with one HTTP port does. Inserts
*through* the Distributed table need ClickHouse's native protocol, which the embedded
servers do not speak; txsink's attach path never does that.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import clickhouse_connect
import pytest
from pyspark.sql.types import LongType, StructField, StructType

from tests.integration.conftest import free_port
from txsink.clickhouse.blockers import attach_blockers
from txsink.config import WriterConfig
from txsink.driver import borrowed_warehouse, open_registry
from txsink.embedded.stack import StackInfo
from txsink.errors import ConfigError, UnavailableError
from txsink.ops.check import run_check
from txsink.ops.verify import verify_job
from txsink.spark.validate import validate

HOSTS = ("127.0.0.1", "127.0.0.2", "127.0.0.3")
CLUSTER = "three"
SCHEMA = StructType(
    [StructField("id", LongType(), False), StructField("amount", LongType(), False)]
)


def cluster_config(hosts: tuple[str, ...]) -> str:
    """``<remote_servers>``: cluster ``three`` (one replica per host), ``weighted``
    (weights 1, 2, 1), ``replicas`` (shard 2 lists a second replica, on 127.0.0.9) and
    ``one`` (the first host alone); macro ``{cluster}`` = ``three``."""

    def replica(host: str) -> str:
        return f"<replica><host>{host}</host><port>9000</port></replica>"

    three = "".join(f"<shard>{replica(h)}</shard>" for h in hosts)
    weighted = "".join(
        f"<shard><weight>{w}</weight>{replica(h)}</shard>"
        for h, w in zip(hosts, (1, 2, 1), strict=True)
    )
    replicas = "".join(
        f"<shard>{replica(h)}{replica('127.0.0.9') if k == 1 else ''}</shard>"
        for k, h in enumerate(hosts)
    )
    return (
        f"<clickhouse><macros><cluster>{CLUSTER}</cluster></macros><remote_servers>"
        f"<{CLUSTER}>{three}</{CLUSTER}><weighted>{weighted}</weighted>"
        f"<replicas>{replicas}</replicas><one><shard>{replica(hosts[0])}</shard></one>"
        f"</remote_servers></clickhouse>\n"
    )


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/ping", timeout=1) as reply:
            return bool(reply.status == 200)
    except OSError:
        return False


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    root: Path = tmp_path_factory.mktemp("distributed")
    config = root / "cluster.xml"
    config.write_text(cluster_config(HOSTS))
    port = free_port()
    urls = [f"http://{h}:{port}" for h in HOSTS]
    procs = []
    for k, host in enumerate(HOSTS):
        argv = [sys.executable, "-m", "txsink.embedded.server", "--data", str(root / f"s{k}")]
        argv += ["--port", str(port), "--host", host, "--config-file", str(config)]
        out = open(root / f"s{k}.out", "ab")  # noqa: SIM115 - closed with the process
        procs.append((subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT), out))
    try:
        deadline = time.monotonic() + 120
        while not all(_answers(u) for u in urls):
            dead = [p.args for p, _ in procs if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                logs = "\n".join((root / f"s{k}.out").read_text()[-2000:] for k in range(3))
                pytest.fail(f"embedded servers on {HOSTS} did not answer ({dead}):\n{logs}")
            time.sleep(0.3)
        yield urls
    finally:
        for proc, out in procs:
            proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(20)
            if proc.poll() is None:
                proc.kill()
            out.close()


def client(url: str) -> Any:
    host, port = url.rsplit("/", 1)[-1].split(":")
    return clickhouse_connect.get_client(host=host, port=int(port))


@pytest.fixture
def db(servers: list[str]) -> Iterator[str]:
    """A database holding ``local`` on every server and Distributed tables on the first:
    ``dist`` (intHash64(id)), ``dist_rand`` (rand()), ``dist_macro`` (cluster
    ``'{cluster}'``), ``dist_mod`` (id % 3, which txsink cannot reproduce),
    ``dist_weighted`` (shard weights), ``dist_replicas`` (a shard with two replicas over
    a local table that is not replicated), ``dist_nokey`` (no sharding key) and
    ``dist_one`` (no key, cluster ``one``)."""
    name = f"dt_{uuid.uuid4().hex[:10]}"
    clients = [client(u) for u in servers]
    for c in clients:
        c.command(f"CREATE DATABASE {name}")
        c.command(
            f"CREATE TABLE {name}.local (id Int64, amount Int64) ENGINE = MergeTree "
            f"PARTITION BY id % 4 ORDER BY id"
        )
    for table, cluster, key in (
        ("dist", CLUSTER, "intHash64(id)"),
        ("dist_rand", CLUSTER, "rand()"),
        ("dist_macro", "{cluster}", "intHash64(id)"),
        ("dist_replicas", "replicas", "intHash64(id)"),
        ("dist_mod", CLUSTER, "id % 3"),
        ("dist_weighted", "weighted", "intHash64(id)"),
        ("dist_nokey", CLUSTER, ""),
        ("dist_one", "one", ""),
    ):
        clients[0].command(
            f"CREATE TABLE {name}.{table} AS {name}.local "
            f"ENGINE = Distributed('{cluster}', '{name}', 'local'{', ' + key if key else ''})"
        )
    yield name
    for c in clients:
        with contextlib.suppress(Exception):
            c.command(f"DROP DATABASE IF EXISTS {name} SYNC")
        c.close()


def config(url: str, table: str, keeper: str, **extra: str) -> WriterConfig:
    return WriterConfig.from_options(
        {"url": url, "table": table, "keeper": keeper, "job": f"dt-{uuid.uuid4().hex[:8]}"} | extra
    )


def test_validation_resolves_the_cluster_of_a_distributed_table(
    servers: list[str], db: str, stack: StackInfo
) -> None:
    entry = config(servers[0], f"{db}.dist", stack.keeper)
    with borrowed_warehouse(entry) as warehouse:  # the table itself cannot take MOVE
        info = warehouse.target_info(entry.table)
    assert info.engine == "Distributed"
    assert any("Distributed" in b and "mode=dedup" in b for b in attach_blockers(info))
    plan = validate(entry, SCHEMA)
    assert plan.mode == "attach"
    assert plan.config.table == f"{db}.local"
    assert plan.config.shards == tuple(servers)
    assert plan.config.url == servers[0]
    assert plan.config.shard_by == "id"

    spread = validate(config(servers[0], f"{db}.dist_rand", stack.keeper), SCHEMA).config
    assert (spread.shards, spread.shard_by) == (tuple(servers), "")
    macro = validate(config(servers[0], f"{db}.dist_macro", stack.keeper), SCHEMA).config
    assert (macro.shards, macro.table) == (tuple(servers), f"{db}.local")

    # the port of every shard's server can differ from the entry URL's
    other = config(servers[0], f"{db}.dist", stack.keeper, shard_http_port="8123")
    with pytest.raises(UnavailableError, match=r"127\.0\.0\.1:8123.*set shard_http_port"):
        validate(other, SCHEMA)


def test_a_sharding_key_txsink_cannot_reproduce_is_refused_or_left_to_dedup(
    servers: list[str], db: str, stack: StackInfo
) -> None:
    with pytest.raises(ConfigError, match=r"id % 3.*cannot reproduce"):
        validate(config(servers[0], f"{db}.dist_mod", stack.keeper, mode="attach"), SCHEMA)
    with pytest.raises(ConfigError, match="weights"):
        validate(config(servers[0], f"{db}.dist_weighted", stack.keeper, mode="attach"), SCHEMA)
    with pytest.raises(ConfigError, match=r"several replicas.*not a replicated table"):
        validate(config(servers[0], f"{db}.dist_replicas", stack.keeper, mode="attach"), SCHEMA)
    # mode=auto keeps what it did before: dedup through the Distributed table itself
    for table in ("dist_mod", "dist_replicas"):
        auto = validate(config(servers[0], f"{db}.{table}", stack.keeper), SCHEMA)
        assert (auto.mode, auto.config.table, auto.config.shards) == ("dedup", f"{db}.{table}", ())
    # and mode=dedup never discovers shards
    dedup = validate(config(servers[0], f"{db}.dist", stack.keeper, mode="dedup"), SCHEMA)
    assert (dedup.mode, dedup.config.shards) == ("dedup", ())
    for url in servers:
        with client(url) as c:
            assert c.query(f"SELECT count() FROM {db}.local").result_rows[0][0] == 0


def test_dedup_through_a_distributed_table_a_replay_could_split_otherwise_is_refused(
    servers: list[str], db: str, stack: StackInfo
) -> None:
    """Issue 38 row 2: each shard deduplicates its own part of a block by the block's
    token, so a replay is exact only if it is split as the first attempt was. A key that
    is not deterministic (rand()) or missing over several shards is refused before
    anything is written, in mode=dedup and in mode=auto's fallback, naming the key and
    the fix; `txsink check` says the same. A deterministic key keeps the fallback."""
    clients = [client(u) for u in servers]
    try:
        for c in clients:  # attach is blocked on the shards: the local table feeds a view
            c.command(f"CREATE TABLE {db}.viewed AS {db}.local")
            c.command(f"CREATE TABLE {db}.sums (n Int64) ENGINE = MergeTree ORDER BY n")
            c.command(
                f"CREATE MATERIALIZED VIEW {db}.mv TO {db}.sums AS "
                f"SELECT count() AS n FROM {db}.viewed"
            )
        for table, key in (("dist_mv_rand", "rand()"), ("dist_mv_hash", "cityHash64(id)")):
            clients[0].command(
                f"CREATE TABLE {db}.{table} AS {db}.viewed "
                f"ENGINE = Distributed('{CLUSTER}', '{db}', 'viewed', {key})"
            )
        fix = r".*cityHash64\(<key column>\).*shards="
        jobs = []

        def refused(table: str, match: str, **extra: str) -> None:
            entry = config(servers[0], f"{db}.{table}", stack.keeper, **extra)
            jobs.append(entry)
            with pytest.raises(ConfigError, match=match + fix):
                validate(entry, SCHEMA)

        refused("dist_rand", r"mode=dedup is unsafe.*sharding key rand\(\).*not deterministic",
                mode="dedup")  # fmt: skip
        refused("dist_nokey", "without a sharding key over 3 shards", mode="dedup")
        refused("dist_mv_rand", r"mode=auto.*neither attach.*materialized view.*nor dedup.*rand")
        one = config(servers[0], f"{db}.dist_one", stack.keeper, mode="dedup")
        assert validate(one, SCHEMA).mode == "dedup"  # one shard: a replay goes where it went
        hashed = validate(config(servers[0], f"{db}.dist_mv_hash", stack.keeper), SCHEMA)
        assert (hashed.mode, hashed.config.table) == ("dedup", f"{db}.dist_mv_hash")

        report = run_check(config(servers[0], f"{db}.dist_rand", stack.keeper, mode="dedup"))
        (mode,) = [c for c in report.checks if c.name == "mode"]
        assert mode.status == "fail" and "rand()" in mode.detail and "cityHash64" in mode.detail
        assert not report.can_run

        for c in clients:  # nothing written, nothing staged, no job recorded
            for table in ("local", "viewed", "sums"):
                assert c.query(f"SELECT count() FROM {db}.{table}").result_rows[0][0] == 0
            staged = c.query(
                "SELECT count() FROM system.tables WHERE database = 'txsink_staging' "
                "AND name LIKE 'dt-%'"
            ).result_rows[0][0]
            assert staged == 0
        registry = open_registry(jobs[0])
        try:
            assert all(registry.job_meta(j.job) is None for j in jobs)
        finally:
            registry.close()
    finally:
        for c in clients:
            c.close()


def test_spark_save_into_a_distributed_table_is_one_exact_xid_over_its_shards(
    spark: Any, servers: list[str], db: str, stack: StackInfo
) -> None:
    job = f"dt-{uuid.uuid4().hex[:8]}"
    produced = 0
    for version, (lo, hi) in enumerate(((0, 3000), (3000, 5000)), start=1):
        df = spark.range(lo, hi, numPartitions=3).selectExpr("id", "id * 3 AS amount")
        (
            df.write.format("clickhouse_tx")
            .option("url", servers[0])
            .option("table", f"{db}.dist")
            .option("keeper", stack.keeper)
            .option("job", job)
            .option("txn_version", str(version))
            .mode("append")
            .save()
        )
        produced += hi - lo
    total = distinct = 0
    for k, url in enumerate(servers):
        with client(url) as c:
            count, uniq, misplaced, staged = c.query(
                f"SELECT count(), uniqExact(id), countIf(intHash64(id) % 3 != {k}), "
                f"(SELECT count() FROM system.tables WHERE database = 'txsink_staging' "
                f"AND name LIKE '{job}%') FROM {db}.local"
            ).result_rows[0]
        assert misplaced == 0, f"shard {k} holds rows Distributed would send elsewhere"
        assert staged == 0, f"shard {k} kept staging tables of {job}"
        assert count > 0
        total, distinct = total + count, distinct + uniq
    assert total == distinct == produced

    registry = open_registry(config(servers[0], f"{db}.dist", stack.keeper))
    try:
        meta = registry.job_meta(job)
    finally:
        registry.close()
    assert meta is not None and meta.shards == tuple(servers)
    assert meta.target == f"{db}.local"

    sharded = WriterConfig.from_options(
        {"shards": ",".join(servers), "table": f"{db}.local", "keeper": stack.keeper, "job": job}
    )
    result = verify_job(sharded)
    assert result.clean, result.to_json()
    checked = result.checked["shards"]
    assert sum(c["target_rows"] for c in checked) == produced
    assert [c["ledger_rows"] for c in checked] == [c["target_rows"] for c in checked]
