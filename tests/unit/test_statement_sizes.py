"""Grouped statements stay under ClickHouse's default max_query_size, and a commit whose
record is COMMITTED is not reported failed because dropping its staging failed."""

from __future__ import annotations

from typing import Any

from txsink.clickhouse.observe import MAX_COMMANDS
from txsink.clickhouse.warehouse import ClickHouseWarehouse
from txsink.protocol.ids import batch_xid, run_tag, staging_name

MAX_QUERY_SIZE = 262_144  # ClickHouse's default


class Recorder:
    url = "http://x"

    def __init__(self) -> None:
        self.sql: list[str] = []

    def command(self, sql: str, **_: Any) -> None:
        self.sql.append(sql)


def name(p: int) -> str:
    return staging_name(
        "orders_backfill_" + "x" * 40, batch_xid(7), run_tag("run-1"), p, 0, 10_000 + p
    ).table


def test_a_task_with_5000_partitions_is_published_in_statements_the_server_parses() -> None:
    rec = Recorder()
    pids = [f"{'f' * 31}{i:05d}" for i in range(5000)]  # 36-char ids (hash partition keys)
    ClickHouseWarehouse(rec).move_partitions(name(0), pids, "analytics.events")  # type: ignore[arg-type]
    assert len(rec.sql) == 5000 // MAX_COMMANDS
    assert max(len(s.encode()) for s in rec.sql) <= MAX_QUERY_SIZE // 4
    moved = [p for s in rec.sql for p in pids if f"'{p}'" in s]
    assert sorted(moved) == sorted(pids)  # each exactly once


def test_a_batch_of_4000_tasks_drops_its_staging_in_statements_the_server_parses() -> None:
    rec = Recorder()
    names = [name(p) for p in range(4000)]
    ClickHouseWarehouse(rec).drop_stagings(names)  # type: ignore[arg-type]
    assert 1 < len(rec.sql) <= 4000 // MAX_COMMANDS
    assert max(len(s.encode()) for s in rec.sql) <= MAX_QUERY_SIZE // 4
    dropped = [n for s in rec.sql for n in names if f"`{n}`" in s]
    assert sorted(dropped) == sorted(names)  # each exactly once


def test_200_tasks_and_their_batch_staging_are_dropped_in_one_statement() -> None:
    rec = Recorder()
    ClickHouseWarehouse(rec).drop_stagings([name(p) for p in range(201)])  # type: ignore[arg-type]
    assert len(rec.sql) == 1


def test_a_bad_partition_id_anywhere_stops_the_publish_before_its_first_statement() -> None:
    import pytest

    from txsink.errors import ConfigError

    rec = Recorder()
    pids = [f"2024{i:04d}" for i in range(MAX_COMMANDS + 5)] + ["bad id'; DROP"]
    with pytest.raises(ConfigError, match="not a ClickHouse partition id"):
        ClickHouseWarehouse(rec).move_partitions(name(0), pids, "analytics.events")  # type: ignore[arg-type]
    assert rec.sql == []
