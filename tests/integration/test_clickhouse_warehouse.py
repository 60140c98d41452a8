"""ClickHouseWarehouse against the real engine, through HTTP (the ``stack`` fixture).

What is checked here is ClickHouse 26.9 behaviour txsink relies on: ``CREATE TABLE AS``
yields a staging table MOVE PARTITION accepts for every target shape, a repeated MOVE is a
no-op, ``system.parts`` reports what was staged, blocks are cut and streamed, and errors
reach the caller as txsink errors naming the table. Every test works in its own databases
(``fresh_db`` for targets, ``<fresh_db>_stg`` for staging).
"""

from __future__ import annotations

import datetime as dt
import re
import socket
import time
from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import pytest
from clickhouse_connect.driver import exceptions as ch_exc

from txsink.clickhouse.blockers import attach_blockers, dedup_blockers
from txsink.clickhouse.client import Client, connect
from txsink.clickhouse.error_map import error_code, map_error
from txsink.clickhouse.retry import RetryPolicy
from txsink.clickhouse.warehouse import ClickHouseWarehouse
from txsink.errors import ConfigError, RecoveryAlarm, RetryableConflict, UnavailableError
from txsink.names import quote_ident, split_table
from txsink.protocol import ids

pytestmark = pytest.mark.integration

JOB = "wh-test"
COLS = "d Date, k UInt64, v String"


def stg(task: int, xid: str = "b1") -> str:
    """A txsink staging name (whatever the run/epoch component currently looks like)."""
    run: Any = ids.run_tag("test-run") if hasattr(ids, "run_tag") else 0
    return ids.staging_name(JOB, xid, run, 0, 0, task).table


@pytest.fixture
def client(stack: Any) -> Iterator[Client]:
    c = connect(stack.url, getattr(stack, "user", None), getattr(stack, "password", None))
    yield c
    c.close()


@pytest.fixture
def wh(client: Client, ch: Any, fresh_db: str) -> Iterator[ClickHouseWarehouse]:
    w = ClickHouseWarehouse(client, staging_db=f"{fresh_db}_stg")
    w.ensure_staging_db()
    yield w
    ch.command(f"DROP DATABASE IF EXISTS `{fresh_db}_stg` SYNC")


def rows_batch(n: int, start: int = 0, days: int = 45) -> pa.RecordBatch:
    base = dt.date(2024, 1, 1)
    return pa.record_batch(
        {
            "d": pa.array([base + dt.timedelta(days=(start + i) % days) for i in range(n)]),
            "k": pa.array(range(start, start + n), pa.uint64()),
            "v": pa.array([f"v{start + i}" for i in range(n)]),
        }
    )


def count(ch: Any, table: str) -> int:
    return int(ch.command(f"SELECT count() FROM {table}"))


TARGETS = {
    "by_month": f"({COLS}) ENGINE = MergeTree PARTITION BY toYYYYMM(d) ORDER BY (k, d)",
    "by_tuple": f"({COLS}) ENGINE = MergeTree PARTITION BY (toYYYYMM(d), k % 3) ORDER BY k",
    "unpartitioned": f"({COLS}) ENGINE = MergeTree ORDER BY k",
    "skip_index": f"({COLS}, INDEX ix_v v TYPE bloom_filter GRANULARITY 2, "
    "INDEX ix_k k TYPE minmax GRANULARITY 1) "
    "ENGINE = MergeTree PARTITION BY toYYYYMM(d) ORDER BY k",
    "projection": f"({COLS}, PROJECTION per_day (SELECT d, count() GROUP BY d)) "
    "ENGINE = MergeTree PARTITION BY toYYYYMM(d) ORDER BY k",
    "settings": f"({COLS}) ENGINE = MergeTree PARTITION BY toYYYYMM(d) ORDER BY k "
    "SETTINGS index_granularity = 256, non_replicated_deduplication_window = 50",
    "codecs_ttl_sample": "(d Date CODEC(Delta, ZSTD(3)), k UInt64, v String DEFAULT 'x', "
    "n Nullable(Int32)) ENGINE = MergeTree PARTITION BY toYYYYMM(d) "
    "ORDER BY (k, intHash32(k), d) PRIMARY KEY (k, intHash32(k)) "
    "SAMPLE BY intHash32(k) TTL d + INTERVAL 200 YEAR",
    "replacing": f"({COLS}) ENGINE = ReplacingMergeTree PARTITION BY toYYYYMM(d) ORDER BY k",
}


@pytest.mark.parametrize("shape", sorted(TARGETS))
def test_staging_mirror_is_accepted_by_move_and_moves_exactly_the_staged_rows(
    wh: ClickHouseWarehouse, ch: Any, fresh_db: str, shape: str
) -> None:
    target = f"{fresh_db}.tgt"
    ch.command(f"CREATE TABLE {target} {TARGETS[shape]}")
    ch.command(f"INSERT INTO {target} (d, k, v) VALUES ('2024-01-01', 999999, 'pre')")
    name = stg(1)
    wh.create_staging(target, name)
    info = wh.target_info(f"{wh.staging_db}.{name}")
    assert info.columns == wh.target_info(target).columns
    assert attach_blockers(wh.target_info(target)) == []

    stats = wh.insert_blocks(name, iter([rows_batch(300)]), block_rows=100, block_bytes=1 << 30)
    assert (stats.rows, stats.blocks) == (300, 3)
    view = wh.staging_view([name])[name]
    assert view is not None and sum(view.values()) == 300
    if shape == "unpartitioned":
        assert set(view) == {"all"}

    before = wh.partition_rows(target)
    for pid in view:
        wh.move_partition(name, pid, target)
    assert count(ch, target) == 301
    after = wh.partition_rows(target)
    for pid, n in view.items():
        assert after[pid] == before.get(pid, 0) + n
    assert wh.staging_view([name]) == {name: {}}

    for pid in view:  # a crash after the MOVE landed makes the driver repeat it
        wh.move_partition(name, pid, target)
    assert count(ch, target) == 301
    assert wh.partition_rows(target) == after


def test_replacing_staging_keeps_every_sent_row(
    wh: ClickHouseWarehouse, ch: Any, fresh_db: str
) -> None:
    """optimize_on_insert=0 on staging inserts: staged rows equal sent rows, so the
    manifest count is what system.parts shows; the target's merges replace later."""
    target = f"{fresh_db}.tgt"
    ch.command(f"CREATE TABLE {target} {TARGETS['replacing']}")
    name = stg(2)
    wh.create_staging(target, name)
    dup = pa.concat_batches([rows_batch(50), rows_batch(50)])
    stats = wh.insert_blocks(name, iter([dup]), block_rows=1000, block_bytes=1 << 30)
    view = wh.staging_view([name])[name] or {}
    assert stats.rows == sum(view.values()) == 100


def test_a_target_with_low_part_limits_does_not_wedge_a_task_that_stages_many_blocks(
    wh: ClickHouseWarehouse, ch: Any, fresh_db: str
) -> None:
    """Staging never merges, so it keeps a part per block: the target's back-pressure
    limits (inherited by CREATE AS) would refuse the task's later blocks with
    TOO_MANY_PARTS on every retry. Staging lifts them; the MOVE is not an insert."""
    target = f"{fresh_db}.tgt"
    ch.command(
        f"CREATE TABLE {target} ({COLS}) ENGINE = MergeTree ORDER BY k "
        "SETTINGS parts_to_delay_insert = 2, parts_to_throw_insert = 3"
    )
    name = stg(3)
    wh.create_staging(target, name)
    stats = wh.insert_blocks(name, iter([rows_batch(100)]), block_rows=10, block_bytes=1 << 30)
    assert stats.blocks == 10
    assert wh.staging_view([name])[name] == {"all": 100}
    wh.move_partition(name, "all", target)
    assert count(ch, target) == 100


def test_create_staging_replaces_a_leftover_table_of_the_same_name(
    wh: ClickHouseWarehouse, ch: Any, fresh_db: str
) -> None:
    target = f"{fresh_db}.tgt"
    ch.command(f"CREATE TABLE {target} {TARGETS['by_month']}")
    name = stg(3)
    wh.create_staging(target, name)
    wh.insert_blocks(name, iter([rows_batch(10)]), block_rows=100, block_bytes=1 << 30)
    wh.create_staging(target, name)
    assert wh.staging_view([name]) == {name: {}}


def test_create_staging_with_a_stale_expected_target_rereads_the_altered_target(
    wh: ClickHouseWarehouse, ch: Any, fresh_db: str
) -> None:
    target = f"{fresh_db}.tgt"
    ch.command(f"CREATE TABLE {target} {TARGETS['by_month']}")
    seen_by_driver = wh.target_info(target)
    ch.command(f"ALTER TABLE {target} ADD COLUMN note String DEFAULT ''")
    name = stg(4)
    wh.create_staging(target, name, seen_by_driver)  # mismatch -> re-read -> accepted
    assert "note" in [c.name for c in wh.target_info(f"{wh.staging_db}.{name}").columns]


def test_staging_view_reports_partitions_and_none_for_missing_tables(
    wh: ClickHouseWarehouse, ch: Any, fresh_db: str
) -> None:
    target = f"{fresh_db}.tgt"
    ch.command(f"CREATE TABLE {target} {TARGETS['by_month']}")
    a, b, empty, missing = stg(10), stg(11), stg(12), stg(13)
    for t in (a, b, empty):
        wh.create_staging(target, t)
    wh.insert_blocks(a, iter([rows_batch(45)]), block_rows=7, block_bytes=1 << 30)
    wh.insert_blocks(b, iter([rows_batch(5)]), block_rows=100, block_bytes=1 << 30)
    view = wh.staging_view([a, b, empty, missing])
    assert view == {
        a: {"202401": 31, "202402": 14},
        b: {"202401": 5},
        empty: {},
        missing: None,
    }
    assert wh.list_staging(ids.staging_prefix(JOB)) == sorted([a, b, empty])
    sizes = wh.staging_sizes(ids.staging_prefix(JOB))
    assert sizes[a]["rows"] == 45 and sizes[a]["bytes"] > 0 and sizes[empty]["rows"] == 0
    wh.drop_staging(a)
    wh.drop_staging(a)  # idempotent
    assert wh.staging_view([a])[a] is None


def test_the_commit_read_of_thousands_of_tables_selects_them_by_their_prefix(
    wh: ClickHouseWarehouse, ch: Any, fresh_db: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past MAX_LISTED_NAMES the names' common prefix selects them (a request parameter
    cannot carry thousands); tables outside the asked set but with that prefix are not
    reported."""
    from txsink.clickhouse import observe

    target = f"{fresh_db}.tgt"
    ch.command(f"CREATE TABLE {target} {TARGETS['by_month']}")
    asked = [stg(11), stg(12), stg(13)]
    for name in [*asked, stg(14)]:
        wh.create_staging(target, name)
    wh.insert_blocks(asked[0], iter([rows_batch(10)]), block_rows=100, block_bytes=1 << 30)
    listed = wh.staged_partitions_of(asked)
    monkeypatch.setattr(observe, "MAX_LISTED_NAMES", 1)
    by_prefix = wh.staged_partitions_of([*asked, stg(15)])
    assert by_prefix == {**listed, stg(15): None}
    assert sum(n for n, _ in (listed[asked[0]] or {}).values()) == 10
    assert listed[asked[1]] == {} and stg(14) not in by_prefix


def test_foreign_tables_are_never_touched(wh: ClickHouseWarehouse, ch: Any, fresh_db: str) -> None:
    ch.command(f"CREATE TABLE `{wh.staging_db}`.users (k UInt64) ENGINE = MergeTree ORDER BY k")
    ch.command(f"INSERT INTO `{wh.staging_db}`.users VALUES (1)")
    for action in (
        lambda: wh.drop_staging("users"),
        lambda: wh.create_staging(f"{fresh_db}.users", "users"),
        lambda: wh.move_partition("users", "all", f"{fresh_db}.users"),
        lambda: wh.insert_blocks("users", iter([]), block_rows=1, block_bytes=1),
    ):
        with pytest.raises(ConfigError, match="users"):
            action()
    assert count(ch, f"`{wh.staging_db}`.users") == 1


def test_insert_blocks_cuts_blocks_and_streams_with_one_block_in_memory(
    wh: ClickHouseWarehouse, ch: Any, fresh_db: str
) -> None:
    target = f"{fresh_db}.tgt"
    ch.command(f"CREATE TABLE {target} {TARGETS['by_month']}")
    name = stg(20)
    wh.create_staging(target, name)
    batch_rows, n_batches, block_rows = 100, 200, 1000
    pulled = 0
    seen_at_insert: list[tuple[int, int]] = []

    def source() -> Iterator[pa.RecordBatch]:
        nonlocal pulled
        for i in range(n_batches):
            pulled += 1
            yield rows_batch(batch_rows, start=i * batch_rows)

    real_insert = wh.client.insert_arrow
    sent = 0

    def spy(db: str, table: str, arrow_table: Any, **kw: Any) -> Any:
        nonlocal sent
        seen_at_insert.append((pulled, arrow_table.num_rows))
        sent += arrow_table.num_rows
        assert pulled * batch_rows - sent <= batch_rows  # never more than one batch ahead
        return real_insert(db, table, arrow_table, **kw)

    wh.client.insert_arrow = spy  # type: ignore[method-assign]
    stats = wh.insert_blocks(name, source(), block_rows=block_rows, block_bytes=1 << 30)
    assert stats.blocks == n_batches * batch_rows // block_rows == len(seen_at_insert)
    assert all(n == block_rows for _, n in seen_at_insert)
    assert sum((wh.staging_view([name])[name] or {}).values()) == n_batches * batch_rows

    # Byte limit: one 250-row batch is cut into blocks of at most block_bytes each.
    big = rows_batch(250)
    limit = big.nbytes // 4 + 1
    sizes: list[int] = []
    wh.client.insert_arrow = lambda db, t, tbl, **kw: (  # type: ignore[method-assign]
        sizes.append(tbl.nbytes),
        real_insert(db, t, tbl, **kw),
    )[1]
    stats = wh.insert_blocks(name, iter([big]), block_rows=10_000, block_bytes=limit)
    assert stats.rows == 250 and stats.blocks == len(sizes) in (4, 5)
    assert all(size <= limit for size in sizes) and sum(sizes) == big.nbytes


def test_insert_blocks_passes_per_block_settings(
    wh: ClickHouseWarehouse, ch: Any, fresh_db: str
) -> None:
    """Dedup mode: a per-block insert_deduplication_token makes a replay a no-op."""
    target = f"{fresh_db}.tgt"
    ch.command(f"CREATE TABLE {target} {TARGETS['settings']}")
    info = wh.target_info(target)
    assert info.dedup_window == 50 and dedup_blockers(info, min_window=10) == []

    def tokens(i: int) -> dict[str, str]:
        return {"insert_deduplication_token": ids.dedup_token(JOB, "b7", 0, i)}

    for _ in range(2):
        stats = wh.insert_blocks(
            target, iter([rows_batch(30)]), block_rows=10, block_bytes=1 << 30, settings=tokens
        )
        assert stats.blocks == 3
    assert count(ch, target) == 30


def test_target_info_sees_dependent_materialized_views(
    wh: ClickHouseWarehouse, ch: Any, fresh_db: str
) -> None:
    db = fresh_db
    ch.command(f"CREATE TABLE {db}.src {TARGETS['by_month']}")
    ch.command(f"CREATE TABLE {db}.agg (k UInt64, c UInt64) ENGINE = SummingMergeTree ORDER BY k")
    ch.command(
        f"CREATE MATERIALIZED VIEW {db}.mv TO {db}.agg "
        f"AS SELECT k, count() AS c FROM {db}.src GROUP BY k"
    )
    info = wh.target_info(f"{db}.src")
    assert info.dependent_views == (f"{db}.mv",)
    (blocker,) = attach_blockers(info)
    assert f"{db}.mv" in blocker and "mode=dedup" in blocker
    assert wh.target_info(f"{db}.agg").dependent_views == ()
    assert wh.dependent_views(f"{db}.src") == (f"{db}.mv",)
    assert wh.commit_look([], views_of=f"{db}.src").views == (f"{db}.mv",)  # the commit's
    assert wh.commit_look([], views_of=f"{db}.agg").views == ()


@pytest.mark.parametrize("engine", ["Memory", "Log", "TinyLog"])
def test_target_info_flags_engines_without_partitions(
    wh: ClickHouseWarehouse, ch: Any, fresh_db: str, engine: str
) -> None:
    ch.command(f"CREATE TABLE {fresh_db}.t ({COLS}) ENGINE = {engine}")
    info = wh.target_info(f"{fresh_db}.t")
    assert info.engine == engine and not info.is_merge_tree
    assert any(engine in b and "mode=dedup" in b for b in attach_blockers(info))


def test_unknown_tables_are_config_errors_naming_the_table(
    wh: ClickHouseWarehouse, client: Client, fresh_db: str
) -> None:
    with pytest.raises(ConfigError, match=f"{fresh_db}.nope") as e:
        wh.target_info(f"{fresh_db}.nope")
    assert e.value.code == 60
    with pytest.raises(ConfigError, match="nope") as e:
        client.query_rows(f"SELECT * FROM `{fresh_db}`.nope")
    assert e.value.code == 60
    with pytest.raises(ConfigError) as e:
        client.query_rows("SELECT * FROM no_such_db_txsink.t")
    assert e.value.code == 81
    name = stg(30)
    with pytest.raises(ConfigError, match="nope"):
        wh.create_staging(f"{fresh_db}.nope", name)
    with pytest.raises(ConfigError, match=r"not of the form db\.table"):
        wh.target_info("no_dot")


def test_a_closed_port_is_unavailable_naming_the_url() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sleeps: list[float] = []
    url = f"http://127.0.0.1:{port}"
    with pytest.raises(UnavailableError, match=url) as e:
        connect(url, connect_timeout=2, retry=RetryPolicy(attempts=3, sleep=sleeps.append))
    assert "txsink embedded status" in str(e.value)
    assert len(sleeps) == 2  # connection refused is classified transient and retried


# --------------------------------------------------------------------------- client helpers
# (pure; here because they belong to the adapter this file covers)


def test_split_table_validates_and_quote_ident_escapes(
    wh: ClickHouseWarehouse, ch: Any, fresh_db: str
) -> None:
    assert split_table("db.events") == ("db", "events")
    assert split_table("`my.db`.`odd``name`") == ("my.db", "odd`name")
    for bad in ("events", "a.b.c", "db.", ".t", "db.t-x", "db.t; DROP TABLE x", ""):
        with pytest.raises(ConfigError, match=r"db\.table"):
            split_table(bad)
    odd = "we`ird name"
    ch.command(
        f"CREATE TABLE {fresh_db}.{quote_ident(odd)} (k UInt64) ENGINE = MergeTree ORDER BY k"
    )
    info = wh.target_info(f"{fresh_db}.{quote_ident(odd)}")
    assert info.table == odd and info.columns[0].name == "k"


class FakeServerError(ch_exc.DatabaseError):
    pass


def _flaky(errors: list[BaseException]) -> Any:
    calls = {"n": 0}

    def fn() -> str:
        calls["n"] += 1
        if errors:
            raise errors.pop(0)
        return "ok"

    fn.calls = calls  # type: ignore[attr-defined]
    return fn


def test_only_classified_transient_errors_are_retried() -> None:
    sleeps: list[float] = []
    policy = RetryPolicy(attempts=4, max_wait=1.0, sleep=sleeps.append)
    too_many_parts = FakeServerError("Code: 252. DB::Exception: Too many parts (TOO_MANY_PARTS)")
    assert error_code(too_many_parts) == 252
    fn = _flaky([too_many_parts, too_many_parts])
    assert policy.run(fn, idempotent=False, what="insert") == "ok"  # rejected: safe to repeat
    assert fn.calls["n"] == 3 and len(sleeps) == 2 and all(s <= 1.0 for s in sleeps)

    timeout = ch_exc.OperationalError("Error HTTPConnectionPool: Read timed out.")
    with pytest.raises(ch_exc.OperationalError):  # ambiguous, not idempotent: no retry
        policy.run(_flaky([timeout]), idempotent=False, what="insert")
    assert policy.run(_flaky([timeout]), idempotent=True, what="move") == "ok"

    syntax = FakeServerError("Code: 62. DB::Exception: Syntax error (SYNTAX_ERROR)")
    fn = _flaky([syntax])
    with pytest.raises(FakeServerError):
        policy.run(fn, idempotent=True, what="select")
    assert fn.calls["n"] == 1

    mapped = map_error(too_many_parts, url="http://h:1", what="INSERT into db.t")
    assert isinstance(mapped, RetryableConflict) and mapped.code == 252
    assert isinstance(map_error(timeout, url="http://h:1", what="x"), UnavailableError)


# --------------------------------------------------------------------------- staging keeps rows
# Issue 10 rows 2, 7 and 9, and evidence of publish, on the engine.


def old_rows(n: int, start: int = 0) -> pa.RecordBatch:
    """Rows dated 2001: far older than any TTL the tests give their targets."""
    batch = rows_batch(n, start, days=28)
    return batch.set_column(0, "d", pa.array([dt.date(2001, 1, 1 + i % 28) for i in range(n)]))


def test_staging_of_a_ttl_target_keeps_rows_older_than_the_ttl_until_moved(
    wh: ClickHouseWarehouse, ch: Any, fresh_db: str
) -> None:
    """Row 2: a copy made with CREATE TABLE AS loses such rows to a TTL merge within
    seconds (the control below); staging has no table or column TTL and still moves."""
    target = f"{fresh_db}.tgt"
    ch.command(
        f"CREATE TABLE {target} (d Date, k UInt64, v String TTL d + INTERVAL 1 DAY) "
        "ENGINE = MergeTree PARTITION BY toYYYYMM(d) ORDER BY k TTL d + INTERVAL 1 DAY"
    )
    ch.command(f"SYSTEM STOP TTL MERGES {target}")  # keep what was moved countable
    control = f"{fresh_db}.control"
    ch.command(f"CREATE TABLE {control} AS {target}")
    name = stg(40)
    wh.create_staging(target, name)
    ddl = ch.command(f"SHOW CREATE TABLE `{wh.staging_db}`.`{name}`")
    assert "TTL" not in ddl and "assign_part_uuids = 1" in ddl
    wh.insert_blocks(name, iter([old_rows(100)]), block_rows=1000, block_bytes=1 << 30)
    ch.command(f"INSERT INTO {control} SETTINGS async_insert=0 SELECT d, k, v FROM "
               f"`{wh.staging_db}`.`{name}`")  # fmt: skip
    deadline = time.monotonic() + 30
    while count(ch, control) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert count(ch, control) == 0, "the engine's TTL merge never ran: the test proves nothing"
    view = wh.staging_view([name])[name] or {}
    assert view == {"200101": 100}
    assert int(ch.command(f"SELECT countIf(v != '') FROM `{wh.staging_db}`.`{name}`")) == 100
    wh.move_partition(name, "200101", target)
    assert count(ch, target) == 100 and wh.staging_view([name])[name] == {}


def test_staging_insert_of_two_identical_blocks_keeps_both_despite_a_dedup_window(
    wh: ClickHouseWarehouse, ch: Any, fresh_db: str
) -> None:
    """Row 9: the target (hence the copy) deduplicates identical blocks in a window."""
    target = f"{fresh_db}.tgt"
    ch.command(f"CREATE TABLE {target} {TARGETS['by_month']} "
               "SETTINGS non_replicated_deduplication_window = 100")  # fmt: skip
    name = stg(41)
    wh.create_staging(target, name)
    same = rows_batch(50)
    stats = wh.insert_blocks(name, iter([same, same, same]), block_rows=50, block_bytes=1 << 30)
    assert stats.blocks == 3
    assert sum((wh.staging_view([name])[name] or {}).values()) == 150
    for pid in wh.staging_view([name])[name] or {}:
        wh.move_partition(name, pid, target)
    assert count(ch, target) == 150


def test_moved_parts_carry_their_recorded_uuids_into_the_target(
    wh: ClickHouseWarehouse, ch: Any, fresh_db: str
) -> None:
    """Evidence of publish: staged parts get UUIDs, staging never merges them away, and
    the target shows them after MOVE until a merge there replaces the parts."""
    target = f"{fresh_db}.tgt"
    ch.command(f"CREATE TABLE {target} {TARGETS['replacing']}")
    name = stg(42)
    wh.create_staging(target, name)
    for i in range(3):
        wh.insert_blocks(name, iter([rows_batch(20, i * 20)]), block_rows=100, block_bytes=1 << 30)
    staged = wh.staged_partitions(name)
    assert {pid: rows for pid, (rows, _) in staged.items()} == {"202401": 46, "202402": 14}
    assert {pid: len(ids) for pid, (_, ids) in staged.items()} == {"202401": 3, "202402": 2}
    # merges are off by table settings: neither a background merge nor OPTIMIZE (without
    # FINAL, which an operator would have to type) replaces a recorded part
    ch.command(f"OPTIMIZE TABLE `{wh.staging_db}`.`{name}`")
    time.sleep(2)
    assert wh.staged_partitions(name) == staged
    ids = staged["202401"][1]
    assert wh.published_uuids(target, ids) == frozenset()
    wh.move_partition(name, "202401", target)
    assert wh.published_uuids(target, ids) == frozenset(ids)
    assert wh.published_uuids(target, staged["202402"][1]) == frozenset()
    ch.command(f"OPTIMIZE TABLE {target} FINAL")
    active = ch.query(
        f"SELECT count() FROM system.parts WHERE database = '{fresh_db}' AND table = 'tgt' "
        "AND active AND uuid != toUUID('00000000-0000-0000-0000-000000000000')"
    ).result_rows[0][0]
    assert active == 0  # the window: only outdated parts, until cleanup, still show them


def test_a_column_added_to_the_target_while_staged_is_added_to_staging_before_the_move(
    wh: ClickHouseWarehouse, ch: Any, fresh_db: str
) -> None:
    """Row 7: MOVE fails with code 122 on its own; txsink adds the target's new columns
    (any position, with defaults, codecs, MATERIALIZED) to staging and moves."""
    target = f"{fresh_db}.tgt"
    ch.command(f"CREATE TABLE {target} {TARGETS['by_month']}")
    name = stg(43)
    wh.create_staging(target, name)
    wh.insert_blocks(name, iter([rows_batch(60)]), block_rows=1000, block_bytes=1 << 30)
    ch.command(
        f"ALTER TABLE {target} ADD COLUMN note String DEFAULT concat('n', v) CODEC(ZSTD(1)) "
        "AFTER k, ADD COLUMN f UInt8 FIRST, ADD COLUMN m UInt64 MATERIALIZED k * 2"
    )
    for pid in wh.staging_view([name])[name] or {}:
        wh.move_partition(name, pid, target)
    assert count(ch, target) == 60
    assert ch.query(
        f"SELECT countIf(note = concat('n', v)), countIf(m = k * 2), countIf(f = 0) FROM {target}"
    ).result_rows[0] == (60, 60, 60)
    assert wh.target_info(f"{wh.staging_db}.{name}").columns == wh.target_info(target).columns


@pytest.mark.parametrize(
    ("alter", "named"),
    [
        ("DROP COLUMN v", "no longer has column(s) v"),
        ("MODIFY COLUMN v LowCardinality(String)", "String -> LowCardinality(String)"),
    ],
)
def test_a_target_that_lost_or_retyped_a_staged_column_is_refused_with_the_next_step(
    wh: ClickHouseWarehouse, ch: Any, fresh_db: str, alter: str, named: str
) -> None:
    target = f"{fresh_db}.tgt"
    ch.command(f"CREATE TABLE {target} {TARGETS['by_month']}")
    name = stg(44)
    wh.create_staging(target, name)
    wh.insert_blocks(name, iter([rows_batch(10)]), block_rows=1000, block_bytes=1 << 30)
    ch.command(f"ALTER TABLE {target} {alter}")
    with pytest.raises(RecoveryAlarm, match=re.escape(named)) as e:
        wh.move_partition(name, "202401", target)
    assert target in str(e.value) and "txsink recover" in str(e.value)
    assert count(ch, target) == 0 and wh.staging_view([name])[name] == {"202401": 10}


def test_a_gather_copies_every_stored_value_and_refuses_tables_that_store_other_columns(
    wh: ClickHouseWarehouse, ch: Any, fresh_db: str
) -> None:
    """The batch's INSERT ... SELECT writes what the task staging holds, MATERIALIZED
    values included (not computed again: ``m`` would differ), leaves ALIAS and
    EPHEMERAL columns alone, and one part per partition; a task staging whose column
    type changed (a value would be converted) is refused before any row, as is one
    that lacks a column."""
    target = f"{fresh_db}.tgt"
    ch.command(
        f"CREATE TABLE {target} ({COLS}, m UInt64 MATERIALIZED rand64(), "
        "a String ALIAS concat(v, '!'), e UInt8 EPHEMERAL) "
        "ENGINE = MergeTree PARTITION BY toYYYYMM(d) ORDER BY k"
    )
    one, two = stg(1), stg(2)
    for t, start in ((one, 0), (two, 100)):
        wh.create_staging(target, t)
        wh.insert_blocks(t, iter([rows_batch(40, start)]), block_rows=15, block_bytes=1 << 30)
    look = wh.commit_look([one, two], views_of=target)
    assert look.columns == ("d", "k", "v", "m")
    batch = ids.batch_staging_name(ids.staging_prefix(JOB), "b1", target)
    wh.create_batch_staging(batch, "", target)
    wh.gather_into_batch(batch, [one, two], look.columns, 80)
    sdb = wh.staging_db
    both = f"SELECT d, k, v, m FROM {sdb}.`{one}` UNION ALL SELECT d, k, v, m FROM {sdb}.`{two}`"
    source = f"SELECT * FROM ({both})"
    mine = f"SELECT d, k, v, m FROM {sdb}.`{batch}`"
    assert count(ch, f"({source} EXCEPT {mine})") == 0
    assert count(ch, f"({mine} EXCEPT {source})") == 0 and count(ch, f"{sdb}.`{batch}`") == 80
    parts = ch.query(
        "SELECT partition_id, count() FROM system.parts WHERE active AND database = "
        "{d:String} AND table = {t:String} GROUP BY partition_id",
        parameters={"d": sdb, "t": batch},
    ).result_rows  # fmt: skip
    assert sorted(n for _, n in parts) == [1, 1]  # two months, one part each

    ch.command(f"ALTER TABLE {sdb}.`{two}` MODIFY COLUMN m UInt32 SETTINGS mutations_sync = 2")
    again = ids.batch_staging_name(ids.staging_prefix(JOB), "b2", target)
    wh.create_batch_staging(again, "", target)
    with pytest.raises(RetryableConflict, match="store different columns"):
        wh.gather_into_batch(again, [one, two], look.columns, 80)
    ch.command(f"ALTER TABLE {sdb}.`{two}` DROP COLUMN m SETTINGS mutations_sync = 2")
    with pytest.raises(RetryableConflict, match="was refused"):
        wh.gather_into_batch(again, [one, two], look.columns, 80)
    assert count(ch, f"{sdb}.`{again}`") == 0  # refused before any row


def test_a_batch_staging_made_and_gathered_in_one_statement_is_the_target_s_twin(
    wh: ClickHouseWarehouse, ch: Any, fresh_db: str
) -> None:
    """``CREATE TABLE batch <the target's CREATE> AS SELECT``: the look reproduces the
    target's columns (ALIAS, EPHEMERAL, DEFAULT, a codec), index, projection and keys
    with the staging settings, the rows land unchanged in one part per partition with
    part UUIDs, and the ATTACH into the target takes it. A task staging whose column
    type changed is refused before any row and nothing is created; a target the CREATE
    cannot reproduce (MATERIALIZED, TTL, comment) has no shape (created apart)."""
    target = f"{fresh_db}.`tg t`"
    ch.command(
        f"CREATE TABLE {target} (d Date, k UInt64 CODEC(Delta, ZSTD), v String DEFAULT 'x', "
        "a String ALIAS concat(v, '!'), e UInt8 EPHEMERAL, INDEX iv v TYPE bloom_filter "
        "GRANULARITY 1, PROJECTION pk (SELECT d, count() GROUP BY d)) ENGINE = MergeTree "
        "PARTITION BY toYYYYMM(d) ORDER BY k SETTINGS index_granularity = 1024, "
        "non_replicated_deduplication_window = 10"
    )
    one, two = stg(1), stg(2)
    for t, start in ((one, 0), (two, 100)):
        wh.create_staging(target, t)
        wh.insert_blocks(t, iter([rows_batch(40, start)]), block_rows=15, block_bytes=1 << 30)
    look = wh.commit_look([one, two], views_of=target)
    assert look.shape is not None and "assign_part_uuids = 1" in look.shape.ddl
    assert "non_replicated_deduplication_window = 10" not in look.shape.ddl
    batch = ids.batch_staging_name(ids.staging_prefix(JOB), "b1", target)
    wh.gather_into_batch(batch, [one, two], look.columns, 80, create=look.shape)
    sdb = wh.staging_db
    both = f"SELECT d, k, v FROM {sdb}.`{one}` UNION ALL SELECT d, k, v FROM {sdb}.`{two}`"
    mine = f"SELECT d, k, v FROM {sdb}.`{batch}`"
    assert count(ch, f"(SELECT * FROM ({both}) EXCEPT {mine})") == 0
    assert count(ch, f"({mine} EXCEPT SELECT * FROM ({both}))") == 0
    parts = ch.query(
        "SELECT partition_id, count(), countIf(uuid != toUUID('00000000-0000-0000-0000-"
        "000000000000')) FROM system.parts WHERE active AND database = {d:String} AND "
        "table = {t:String} GROUP BY partition_id",
        parameters={"d": sdb, "t": batch},
    ).result_rows  # fmt: skip
    assert sorted((n, u) for _, n, u in parts) == [(1, 1), (1, 1)]  # a part a month, UUIDs
    wh.attach_all(batch, target)
    assert count(ch, target) == 80

    retype = "MODIFY COLUMN v LowCardinality(String) SETTINGS mutations_sync = 2"
    ch.command(f"ALTER TABLE {sdb}.`{two}` {retype}")
    again = ids.batch_staging_name(ids.staging_prefix(JOB), "b2", target)
    with pytest.raises(RetryableConflict, match="store different columns"):
        wh.gather_into_batch(again, [one, two], look.columns, 80, create=look.shape)
    assert again not in wh.list_staging(ids.staging_prefix(JOB))  # nothing created
    with pytest.raises(RetryableConflict, match="wrote 40 rows"):  # the server's count
        wh.gather_into_batch(again, [one], look.columns, 80, create=look.shape)

    for other in (
        f"(d Date, k UInt64, m UInt64 MATERIALIZED k) {TARGETS['by_month'].split(')', 1)[1]}",
        f"({COLS}) ENGINE = MergeTree PARTITION BY toYYYYMM(d) ORDER BY k TTL d + INTERVAL 1 DAY",
        f"({COLS}) ENGINE = MergeTree PARTITION BY toYYYYMM(d) ORDER BY k COMMENT 'c'",
    ):
        ch.command(f"DROP TABLE IF EXISTS {fresh_db}.other SYNC")
        ch.command(f"CREATE TABLE {fresh_db}.other {other}")
        assert wh.commit_look([], views_of=f"{fresh_db}.other").shape is None, other


def test_a_gathered_create_reads_the_target_s_columns_as_the_target_has_them(
    stack: Any, ch: Any, fresh_db: str
) -> None:
    """A writer whose profile makes every type Nullable (``data_type_default_nullable``)
    still creates the batch staging with the target's types (the CREATE carries its own
    settings): the ATTACH takes it and values are unchanged. A Nested column (which
    ``flatten_nested`` would reshape) has no one-statement shape. A fill a killed server
    left under its internal name is swept once old enough."""
    nullable = connect(stack.url, settings={"data_type_default_nullable": 1, "flatten_nested": 1})
    wh = ClickHouseWarehouse(nullable, staging_db=f"{fresh_db}_stg")
    try:
        wh.ensure_staging_db()
        target = f"{fresh_db}.tgt"
        ch.command(f"CREATE TABLE {target} {TARGETS['by_month']}")
        one = stg(1)
        wh.create_staging(target, one)
        wh.insert_blocks(one, iter([rows_batch(30)]), block_rows=10, block_bytes=1 << 30)
        look = wh.commit_look([one], views_of=target)
        assert look.shape is not None
        batch = ids.batch_staging_name(ids.staging_prefix(JOB), "b1", target)
        wh.gather_into_batch(batch, [one], look.columns, 30, create=look.shape)
        types = ch.query(
            "SELECT groupArray(type) FROM system.columns WHERE database = {d:String} "
            "AND table = {t:String}",
            parameters={"d": wh.staging_db, "t": batch},
        ).result_rows[0][0]  # fmt: skip
        assert types == ["Date", "UInt64", "String"]
        wh.attach_all(batch, target)
        assert count(ch, target) == 30

        ch.command(
            f"CREATE TABLE {fresh_db}.nested (k UInt64, n Nested(x String)) "
            "ENGINE = MergeTree ORDER BY k",
            settings={"flatten_nested": 0},
        )
        assert wh.commit_look([], views_of=f"{fresh_db}.nested").shape is None

        sdb = wh.staging_db
        ch.command(
            f"CREATE TABLE {sdb}._tmp_replace_0123_4567 (k UInt64) ENGINE = MergeTree ORDER BY k"
        )
        assert wh.drop_leftover_fills(3600) == []  # young: a fill may still run
        time.sleep(1.1)  # metadata times are in seconds
        assert wh.drop_leftover_fills(0) == ["_tmp_replace_0123_4567"]
        left = ch.query(
            "SELECT count() FROM system.tables WHERE database = {d:String} "
            "AND startsWith(name, '_tmp')",
            parameters={"d": sdb},
        ).result_rows[0][0]  # fmt: skip
        assert left == 0 and count(ch, f"{sdb}.`{one}`") == 30
    finally:
        nullable.close()


def _counted(client: Client, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The statements ``client`` sends from now on (a spy on the real calls)."""
    sent: list[str] = []
    for method in ("command", "query_rows"):
        real = getattr(client, method)

        def spy(sql: str, *args: Any, _real: Any = real, **kwargs: Any) -> Any:
            sent.append(sql.split(" ", 2)[0] + " " + sql.split(" ", 2)[1])
            return _real(sql, *args, **kwargs)

        monkeypatch.setattr(client, method, spy)
    return sent


@pytest.mark.parametrize("shape", ["by_month", "codecs_ttl_sample"])
def test_a_task_s_create_goes_without_its_read_back_once_the_server_kept_the_settings(
    wh: ClickHouseWarehouse,
    client: Client,
    ch: Any,
    fresh_db: str,
    shape: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Deliverable 2 of issue 39: the first CREATE through a client is read back (the
    server must be seen keeping the staging settings of CREATE ... AS); later ones are
    the CREATE alone (and the ALTER removing a TTL the driver saw). The commit's one
    read then finds the staging fit to publish."""
    target = f"{fresh_db}.tgt"
    ch.command(f"CREATE TABLE {target} {TARGETS[shape]}")
    info = wh.target_info(target)
    client.facts.clear()
    sent = _counted(client, monkeypatch)
    wh.create_staging(target, stg(1), info, read_back=False)
    assert len(sent) >= 2 and any(s.startswith("SELECT") for s in sent), sent
    sent.clear()
    wh.create_staging(target, stg(2), info, read_back=False)
    assert sent == ["CREATE TABLE"] + (["ALTER TABLE"] if info.table_ttl else []), sent
    ddl = ch.command(f"SHOW CREATE TABLE `{wh.staging_db}`.`{stg(2)}`")
    assert "assign_part_uuids = 1" in ddl and "TTL" not in ddl
    wh.insert_blocks(stg(2), iter([rows_batch(20)]), block_rows=1000, block_bytes=1 << 30)
    validated = [(c.name, c.type) for c in info.columns]
    look = wh.commit_look([stg(1), stg(2)], views_of=target, validated=validated)
    assert look.unfit == {}
    assert sum(n for n, _ in (look.staged[stg(2)] or {}).values()) == 20


def test_the_commit_read_names_every_staging_table_unfit_to_publish(
    wh: ClickHouseWarehouse, ch: Any, fresh_db: str
) -> None:
    """What a task no longer reads back is checked by the commit's one read: staging made
    without the staging settings, with a TTL, or whose columns differ from those the
    values were checked for (the target retyped after the driver's validation). A column
    the target gained meanwhile is no reason (the publish adds it)."""
    target = f"{fresh_db}.tgt"
    ch.command(f"CREATE TABLE {target} {TARGETS['by_month']}")
    validated = [(c.name, c.type) for c in wh.target_info(target).columns]
    sdb = wh.staging_db
    settings = "SETTINGS assign_part_uuids = 1, non_replicated_deduplication_window = 0"
    ch.command(f"CREATE TABLE `{sdb}`.`{stg(1)}` AS {target}")  # the server ignored SETTINGS
    ch.command(f"ALTER TABLE {target} ADD COLUMN note String DEFAULT ''")
    wh.create_staging(target, stg(2))
    ch.command(f"ALTER TABLE {target} MODIFY COLUMN v LowCardinality(String)")
    wh.create_staging(target, stg(3))
    ttl = f"{fresh_db}.ttl"
    ch.command(f"CREATE TABLE {ttl} ({COLS}) ENGINE = MergeTree ORDER BY k TTL d + INTERVAL 1 DAY")
    ch.command(f"CREATE TABLE `{sdb}`.`{stg(4)}` AS {ttl} {settings}")
    col_ttl = f"{fresh_db}.col_ttl"
    ch.command(
        f"CREATE TABLE {col_ttl} (d Date, k UInt64, v String TTL d + INTERVAL 1 DAY) "
        "ENGINE = MergeTree ORDER BY k"
    )
    ch.command(f"CREATE TABLE `{sdb}`.`{stg(5)}` AS {col_ttl} {settings}")
    look = wh.commit_look([stg(k) for k in (1, 2, 3, 4, 5)], validated=validated)
    assert set(look.unfit) == {stg(1), stg(3), stg(4), stg(5)}, look.unfit
    assert "staging settings" in look.unfit[stg(1)]
    assert "columns differ" in look.unfit[stg(3)]
    assert "TTL" in look.unfit[stg(4)] and "TTL" in look.unfit[stg(5)]
    assert wh.commit_look([stg(3)]).unfit == {}  # no columns asked for: no column check


def test_a_task_s_create_without_read_back_survives_a_ttl_removed_since_validation(
    wh: ClickHouseWarehouse, client: Client, ch: Any, fresh_db: str
) -> None:
    """The driver saw a TTL that an operator removed since: the ALTER removing it from
    the staging fails (the copy has none), and the task falls back to its read-back."""
    target = f"{fresh_db}.tgt"
    ch.command(f"CREATE TABLE {target} {TARGETS['codecs_ttl_sample']}")
    info = wh.target_info(target)
    assert info.table_ttl
    wh.create_staging(target, stg(1), info, read_back=False)  # read back: the fact learnt
    assert client.facts
    ch.command(f"ALTER TABLE {target} REMOVE TTL")
    wh.create_staging(target, stg(2), info, read_back=False)
    ddl = ch.command(f"SHOW CREATE TABLE `{wh.staging_db}`.`{stg(2)}`")
    assert "TTL" not in ddl and "assign_part_uuids = 1" in ddl
