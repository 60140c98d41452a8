"""The embedded endpoint serves ``INSERT ... SELECT ... FROM input('<structure>') ... FORMAT
Arrow`` with the Arrow file in the body, as a ClickHouse server does (the dedup writer's
insert shape): settings apply, a false WHERE writes nothing, a throwIf in the WHERE fails
the insert with its code, values round-trip exactly, the spooled body is removed."""

from __future__ import annotations

import datetime as dt
import io
from pathlib import Path

import pyarrow as pa
import pyarrow.ipc
import pytest
from clickhouse_connect.driver.client import Client
from clickhouse_connect.driver.exceptions import DatabaseError

from txsink.embedded.stack import StackInfo

STRUCTURE = "'`id` Int64, `s` Nullable(String), `ts` DateTime64(6, \\'UTC\\')'"


def _arrow_file(table: pa.Table) -> bytes:
    sink = io.BytesIO()
    with pyarrow.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue()


def _rows(start: int) -> pa.Table:
    utc = dt.UTC
    return pa.table(
        {
            "id": pa.array([start, start + 1, start + 2], pa.int64()),
            "s": pa.array(["a", None, "ü'\\"], pa.string()),
            "ts": pa.array(
                [
                    dt.datetime(1969, 12, 31, 23, 59, 59, 999999, tzinfo=utc),
                    dt.datetime(2026, 11, 28, 6, 7, 8, 123456, tzinfo=utc),
                    dt.datetime(2262, 4, 11, tzinfo=utc),
                ],
                pa.timestamp("us", tz="UTC"),
            ),
        }
    )


def _insert(table: str, where: str) -> str:
    return (
        f"INSERT INTO {table} (`id`, `s`, `ts`) SELECT `id`, `s`, `ts` FROM input({STRUCTURE}) "
        f"WHERE {where} FORMAT Arrow"
    )


def test_insert_select_from_input_reads_the_body(
    stack: StackInfo, ch: Client, fresh_db: str
) -> None:
    table = f"`{fresh_db}`.`t`"
    ch.command(
        f"CREATE TABLE {table} (id Int64, s Nullable(String), ts DateTime64(6, 'UTC')) "
        "ENGINE = MergeTree ORDER BY id SETTINGS non_replicated_deduplication_window = 10"
    )
    # the statement is in system.processes, its WHERE's literal included, while it runs
    seen = (
        "(SELECT count() FROM system.processes "
        "WHERE multiSearchAny(query, ['txsink-seal j x'])) = 1"
    )
    body = _arrow_file(_rows(1))
    token = {"insert_deduplication_token": "t1"}
    first = ch.command(_insert(table, seen), data=body, settings=token)
    ch.command(_insert(table, seen), data=body, settings=token)  # deduplicated by the token
    assert getattr(first, "written_rows", None) == 3
    assert ch.query(f"SELECT count() FROM {table}").result_rows == [(3,)]

    ch.command(_insert(table, "0 = 1"), data=_arrow_file(_rows(10)))
    assert ch.query(f"SELECT count() FROM {table}").result_rows == [(3,)]

    sealed = "(SELECT throwIf(count() > 0, 'txsink: sealed') FROM numbers(1)) = 0"
    with pytest.raises(DatabaseError, match=r"Code: 395\..*txsink: sealed") as info:
        ch.command(_insert(table, sealed), data=_arrow_file(_rows(20)))
    assert "395" in str(info.value)
    assert ch.query(f"SELECT count() FROM {table}").result_rows == [(3,)]

    back = ch.query_arrow(f"SELECT id, s, ts FROM {table} ORDER BY id")
    assert back.column("s").to_pylist() == ["a", None, "ü'\\"]
    assert back.column("ts").cast(pa.timestamp("us", tz="UTC")).equals(_rows(1).column("ts"))
    assert list(Path(stack.dir).glob("*/input/input-*")) == []  # every spooled body removed
