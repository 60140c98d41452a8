"""visibility=auto asks the server whether the writer's user may run the statements of a
batch publish before it chooses batch (the decisions on the twin:
tests/unit/test_visibility_grant.py).

Second embedded endpoints whose one user (``default``: chdb runs every statement as it)
has a real server's least privileges, read from a users.xml through
``<user_directories>``. chdb has no writable user storage (``CREATE USER`` fails with
ACCESS_STORAGE_FOR_INSERTION_NOT_FOUND), so the grants live in the file; the engine
checks them as a server does. Database ``p`` lets the user MOVE partitions in (INSERT)
but not ATTACH them from another table (no ALTER DELETE, which ClickHouse asks for
``ATTACH PARTITION ... FROM``); ``q`` lets it do both. Staging database ``stg_noopt``
lacks OPTIMIZE, which a batch no longer needs (it is gathered by an INSERT). Before the
probes, a batch into ``p`` was PREPARED and its ATTACH refused after the prepare, for
good.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from tests.integration.conftest import client_for
from tests.integration.test_dedup_mode import config
from tests.integration.test_insert_settings import endpoint
from txsink.clickhouse.client import connect
from txsink.clickhouse.warehouse import ClickHouseWarehouse
from txsink.config import WriterConfig
from txsink.driver import open_registry
from txsink.embedded.stack import QUERY_LOG_CONFIG
from txsink.errors import ConfigError
from txsink.protocol.states import Visibility
from txsink.spark import validate

NO_OPTIMIZE = "stg_noopt"  # a staging database without the OPTIMIZE grant
GRANTS = (
    "GRANT CREATE DATABASE ON *.*",  # the test's databases; the staging databases
    "GRANT SYSTEM FLUSH LOGS ON *.*",  # visibility=batch reads the query log
    "GRANT SELECT ON system.query_log",
    "GRANT CREATE TABLE, DROP TABLE, SELECT, INSERT, ALTER, OPTIMIZE ON txsink_staging.*",
    f"GRANT CREATE TABLE, DROP TABLE, SELECT, INSERT, ALTER ON {NO_OPTIMIZE}.*",
    "GRANT CREATE TABLE, SELECT, INSERT, ALTER MOVE PARTITION ON p.*",  # MOVE, not ATTACH
    "GRANT CREATE TABLE, SELECT, INSERT, ALTER MOVE PARTITION, ALTER DELETE ON q.*",
)
USERS_XML = """<clickhouse>
  <profiles><default></default></profiles>
  <users><default>
    <profile>default</profile><networks><ip>::/0</ip></networks><password></password>
    <quota>default</quota><grants>{grants}</grants>
  </default></users>
  <quotas><default></default></quotas>
</clickhouse>
"""
TABLE = "CREATE TABLE {t} (id Int64, p Int32) ENGINE = MergeTree PARTITION BY p ORDER BY id"


@contextlib.contextmanager
def granting(stack: Any, root: Any, grants: tuple[str, ...]) -> Iterator[SimpleNamespace]:
    """A second endpoint whose user holds ``grants`` and nothing else, with databases
    ``p`` and ``q``; ``.ch`` is a client on it."""
    root.mkdir(parents=True, exist_ok=True)
    users = "".join(f"<query>{g}</query>" for g in grants)
    (root / "users.xml").write_text(USERS_XML.format(grants=users))
    config_file = root / "config.xml"
    config_file.write_text(
        f"<clickhouse>{QUERY_LOG_CONFIG}<user_directories><users_xml>"
        f"<path>{root / 'users.xml'}</path></users_xml></user_directories></clickhouse>\n"
    )
    with endpoint(stack, root / "data", "--config-file", str(config_file)) as ep:
        ch = client_for(ep)  # type: ignore[arg-type]
        try:
            for db in ("p", "q"):
                ch.command(f"CREATE DATABASE IF NOT EXISTS {db}")
            ep.ch = ch
            yield ep
        finally:
            ch.close()


@pytest.fixture(scope="module")
def granted(stack: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimpleNamespace]:
    with granting(stack, tmp_path_factory.mktemp("granted"), GRANTS) as ep:
        yield ep


@pytest.fixture(scope="module")
def unlogged(stack: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimpleNamespace]:
    """The same user without SELECT on system.query_log (readable by a plain SELECT,
    but not to merge(), which lists only the log tables a user was granted)."""
    grants = tuple(g for g in GRANTS if "query_log" not in g)
    with granting(stack, tmp_path_factory.mktemp("unlogged"), grants) as ep:
        yield ep


def new_table(ep: Any, db: str) -> str:
    table = f"{db}.t_{uuid.uuid4().hex[:8]}"
    ep.ch.command(TABLE.format(t=table))
    return table


def probe_tables(ch: Any) -> list[tuple[Any, ...]]:
    return list(
        ch.query(
            "SELECT database, name FROM system.tables WHERE name LIKE 'txsink_probe%'"
        ).result_rows
    )


def visibilities(ep: Any, table: str, job: str) -> list[Visibility]:
    registry = open_registry(config(ep, table, job=job))
    try:
        return [r.visibility for r in registry.list(job)]
    finally:
        registry.close()


def write(spark: Any, ep: Any, table: str, job: str, **opts: str) -> None:
    df = spark.createDataFrame([(i, i % 3) for i in range(30)], "id long, p int")
    options = {"url": ep.url, "keeper": ep.keeper, "table": table, "job": job, **opts}
    df.write.format("clickhouse_tx").options(**options, txn_version="1").mode("append").save()


def counts(ep: Any, table: str) -> list[tuple[Any, ...]]:
    return list(ep.ch.query(f"SELECT count(), uniqExact(id) FROM {table}").result_rows)


# ------------------------------------------------------------------ the probes


def test_the_server_refuses_the_probes_without_their_grants_and_nothing_changes(
    granted: Any,
) -> None:
    denied, allowed = new_table(granted, "p"), new_table(granted, "q")
    granted.ch.command(f"INSERT INTO {denied} VALUES (1, 1), (2, 2)")
    wh = ClickHouseWarehouse(connect(granted.url))
    try:
        said = wh.attach_refusal(denied)
        assert "Not enough privileges" in said and "ALTER DELETE" in said, said
        assert wh.attach_refusal(allowed) == ""
    finally:
        wh.client.close()
    assert counts(granted, denied) == [(2, 2)]
    assert counts(granted, allowed) == [(0, 0)]
    assert probe_tables(granted.ch) == []


def test_a_query_log_this_user_was_not_granted_makes_auto_choose_partition(
    unlogged: Any,
) -> None:
    """merge() over the log tables answers CANNOT_EXTRACT_TABLE_STRUCTURE to a user
    without SELECT on system.query_log: auto used to fail the job with it."""
    table = new_table(unlogged, "q")
    cfg = WriterConfig.from_options(
        {"url": unlogged.url, "keeper": unlogged.keeper, "table": table, "job": "unlogged"}
    )
    wh = ClickHouseWarehouse(connect(unlogged.url))
    try:
        with pytest.raises(ConfigError, match=r"needs system\.query_log"):
            wh.attach_logged(table, "txsink probe unlogged", 0.0)
        info = wh.target_info(table)
        assert validate.chosen_visibility(cfg, info, "attach", wh) == "partition"
    finally:
        wh.client.close()


# ------------------------------------------------------------------ writes through Spark


@pytest.mark.spark
def test_auto_without_the_attach_grant_publishes_by_move_and_an_explicit_batch_is_refused(
    spark: Any, granted: Any
) -> None:
    table = new_table(granted, "p")
    job = f"grant-{uuid.uuid4().hex[:8]}"
    with pytest.raises(Exception, match=r"GRANT ALTER DELETE, INSERT ON") as refused:
        write(spark, granted, table, job, mode="attach", visibility="batch")
    text = str(refused.value)
    assert f"visibility=batch publishes into {table}" in text, text
    assert "the privilege ALTER DELETE on" in text and "Missing permissions" in text, text
    assert "or use visibility=partition" in text and "Nothing was written" in text, text
    assert counts(granted, table) == [(0, 0)]
    staged = granted.ch.query(
        "SELECT count() FROM system.tables WHERE database = 'txsink_staging' "
        "AND name LIKE {j:String}",
        parameters={"j": f"tx_{job.replace('-', '_')}%"},
    ).result_rows
    assert staged == [(0,)], "the refused job staged rows"
    assert visibilities(granted, table, job) == [], "the refused job prepared an xid"

    # the default (auto) chooses partition visibility: MOVE needs no ALTER DELETE
    write(spark, granted, table, f"{job}-auto", mode="attach")
    assert counts(granted, table) == [(30, 30)]
    assert visibilities(granted, table, f"{job}-auto") == [Visibility.PARTITION]
    assert probe_tables(granted.ch) == []


@pytest.mark.spark
def test_auto_with_the_grants_publishes_the_batch_in_one_attach(spark: Any, granted: Any) -> None:
    table = new_table(granted, "q")
    job = f"grant-{uuid.uuid4().hex[:8]}"
    write(spark, granted, table, job)
    assert counts(granted, table) == [(30, 30)]
    assert visibilities(granted, table, job) == [Visibility.BATCH]


@pytest.mark.spark
def test_without_optimize_in_staging_a_batch_is_still_gathered_into_one_part_per_partition(
    spark: Any, granted: Any
) -> None:
    """The batch's one part per partition is an INSERT into the batch staging (the grants
    the tasks' inserts need already), not an OPTIMIZE: a staging database without that
    grant publishes batches as any other."""
    table = new_table(granted, "q")
    job = f"grant-{uuid.uuid4().hex[:8]}"
    write(spark, granted, table, job, staging_database=NO_OPTIMIZE)
    assert visibilities(granted, table, job) == [Visibility.BATCH]
    assert counts(granted, table) == [(30, 30)]
    db, name = table.split(".")
    parts = granted.ch.query(
        "SELECT count() FROM system.parts WHERE active AND database = {d:String} "
        "AND table = {t:String}", parameters={"d": db, "t": name},
    ).result_rows  # fmt: skip
    assert parts == [(3,)]  # two tasks' rows over three values: one part per value
