"""Every value arrives exactly as written, or the write is refused before anything is
visible: the type contract (docs/types.md) on real Spark and the real ClickHouse engine,
in attach and dedup mode.

One wide table per mode holds every pair that must round-trip (one save each, then each
column is read back with a ClickHouse expression that shows its value unambiguously:
epoch microseconds for instants, ``toString`` for wall clocks). Each value that would be
stored altered gets its own save, which must fail naming the column, with the target
empty. The Spark session runs in America/New_York so that no time zone hides a shift.
"""

from __future__ import annotations

import datetime as dt
import uuid
from decimal import Decimal
from typing import Any

import pytest

from txsink.errors import TxSinkError

pytestmark = pytest.mark.spark

UTC = dt.UTC


def _micros(*parts: int) -> int:
    return int(dt.datetime(*parts, tzinfo=UTC).timestamp() * 1_000_000)  # type: ignore[misc]


# (column, Spark expression, ClickHouse type, read-back expression, expected value)
EXACT: list[tuple[str, str, str, str, Any]] = [
    ("i_neg", "cast(-5 as int)", "Int32", "{c}", -5),
    ("i_u32", "cast(7 as int)", "UInt32", "{c}", 7),
    ("l_u64", "cast(9223372036854775807 as bigint)", "UInt64", "{c}", 2**63 - 1),
    ("d_u64", "cast('18446744073709551615' as decimal(20,0))", "UInt64", "{c}", 2**64 - 1),
    ("d_i128", "cast('-99999999999999999999999999999999999999' as decimal(38,0))",
     "Int128", "{c}", -(10**38 - 1)),
    ("dec", "cast('12345.67' as decimal(10,2))", "Decimal(12, 3)", "{c}", Decimal("12345.670")),
    ("i_f64", "cast(-2147483648 as int)", "Float64", "{c}", -2147483648.0),
    ("l_f64", "cast(9007199254740992 as bigint)", "Float64", "toInt64({c})", 2**53),
    ("s_f32", "cast(-32768 as smallint)", "Float32", "{c}", -32768.0),
    ("i_dec", "cast(2147483647 as int)", "Decimal(12, 2)", "{c}", Decimal("2147483647.00")),
    ("arr", "array(1, 2)", "Array(Int32)", "{c}", [1, 2]),
    ("arr_null", "array(1, null)", "Array(Nullable(Int32))", "{c}", [1, None]),
    ("map", "map('a', 1)", "Map(String, Int32)", "{c}", {"a": 1}),
    ("tup", "named_struct('a', 1, 'b', 'x')", "Tuple(a Int32, b String)", "{c}", (1, "x")),
    ("ts_dt", "timestamp'2024-01-01 00:00:01Z'", "DateTime", "toUnixTimestamp({c})",
     _micros(2024, 1, 1, 0, 0, 1) // 1_000_000),
    ("ts_dt3", "timestamp'2024-01-01 00:00:00.123Z'", "DateTime64(3)",
     "toUnixTimestamp64Micro({c})", _micros(2024, 1, 1) + 123_000),
    ("ts_dt6_tokyo", "timestamp'2024-01-01 00:00:00.123456Z'", "DateTime64(6, 'Asia/Tokyo')",
     "toUnixTimestamp64Micro({c})", _micros(2024, 1, 1) + 123_456),
    ("ts_edge", "timestamp'2106-02-07 06:28:15Z'", "DateTime", "toUnixTimestamp({c})",
     2**32 - 1),
    ("ntz_tokyo", "timestamp_ntz'2024-01-01 02:30:00.123456'", "DateTime64(6, 'Asia/Tokyo')",
     "toString({c})", "2024-01-01 02:30:00.123456"),
    ("ntz_server", "timestamp_ntz'2024-01-01 02:30:00.123456'", "DateTime64(6)",
     "toString({c})", "2024-01-01 02:30:00.123456"),
    ("day", "date'2024-02-03'", "Date", "toString({c})", "2024-02-03"),
    ("day32", "date'1900-01-02'", "Date32", "toString({c})", "1900-01-02"),
    ("fixed", "'abcd'", "FixedString(4)", "toString({c})", "abcd"),
    ("enum", "'b'", "Enum8('a' = 1, 'b' = 2)", "toString({c})", "b"),
    ("ip4", "'10.1.2.3'", "IPv4", "toString({c})", "10.1.2.3"),
    ("ip6", "'2001:db8::1'", "IPv6", "toString({c})", "2001:db8::1"),
    ("flag", "'true'", "Bool", "{c}", True),
    ("uid", "'61f0c404-5cb3-11e7-907b-a6006ad3dba0'", "UUID", "toString({c})",
     "61f0c404-5cb3-11e7-907b-a6006ad3dba0"),
    ("var", """parse_json('{"a": 1, "b": [true, null], "c": {"d": "x"}}')""", "JSON",
     "toJSONString({c})", '{"a":1,"b":[true,null],"c":{"d":"x"}}'),
    ("span", "interval '1 02:03:04.000005' day to second", "Int64", "{c}",
     ((24 + 2) * 3600 + 3 * 60 + 4) * 1_000_000 + 5),
]  # fmt: skip

# (what, Spark expression, ClickHouse type, a word the refusal must hold)
ALTERED: list[tuple[str, str, str, str]] = [
    ("negative into unsigned", "cast(-1 as int)", "UInt32", "-1"),
    ("bigint below UInt64", "cast(-1 as bigint)", "UInt64", "-1"),
    ("decimal above UInt64", "cast('18446744073709551616' as decimal(20,0))", "UInt64",
     "18446744073709551616"),
    ("bigint Float64 would round", "cast(9007199254740993 as bigint)", "Float64",
     "9007199254740993"),
    ("int beyond the decimal's digits", "cast(1234567 as int)", "Decimal(8, 2)", "1234567"),
    ("null array element", "array(1, cast(null as int))", "Array(Int32)", "c[]"),
    ("null map value", "map('a', cast(null as int))", "Map(String, Int32)", "c{value}"),
    ("null tuple field", "named_struct('a', cast(null as int), 'b', 'x')",
     "Tuple(a Int32, b String)", "c.a"),
    ("microseconds into DateTime", "timestamp'2024-01-01 00:00:00.123456Z'", "DateTime",
     "keeps"),
    ("microseconds into DateTime64(3)", "timestamp'2024-01-01 00:00:00.123456Z'",
     "DateTime64(3)", "keeps"),
    ("before 1970 into DateTime", "timestamp'1969-12-31 23:59:59Z'", "DateTime", "range"),
    ("after 2106 into DateTime", "timestamp'2106-02-07 06:28:16Z'", "DateTime", "range"),
    ("before 1970 into Date", "date'1969-12-31'", "Date", "range"),
    ("too long for FixedString", "'abcde'", "FixedString(4)", "4 bytes"),
    ("outside the enum", "'c'", "Enum8('a' = 1, 'b' = 2)", "'c'"),
    ("variant JSON null into JSON (stored as {})", "parse_json('null')", "JSON", "'null'"),
    ("variant number into JSON", "parse_json('5')", "JSON", "'5'"),
]  # fmt: skip


def _ddl(table: str, columns: list[tuple[str, str]], mode: str) -> str:
    cols = ", ".join(f"`{n}` {t}" for n, t in [("id", "Int64"), *columns])
    window = " SETTINGS non_replicated_deduplication_window = 100" if mode == "dedup" else ""
    return f"CREATE TABLE {table} ({cols}) ENGINE = MergeTree ORDER BY id{window}"


def _save(df: Any, stack: Any, table: str, mode: str) -> str:
    job = f"vc-{uuid.uuid4().hex[:8]}"
    (
        df.write.format("clickhouse_tx")
        .option("url", stack.url)
        .option("keeper", stack.keeper)
        .option("table", table)
        .option("job", job)
        .option("mode", mode)
        .mode("append")
        .save()
    )
    return job


def _transaction(spark: Any, df: Any, stack: Any, table: str) -> None:
    """The same write through ``txsink.transaction`` (mapInArrow: Spark's other Arrow
    conversion; attach mode only)."""
    import txsink

    job = f"vc-{uuid.uuid4().hex[:8]}"
    with txsink.transaction(spark, txn_version=1, url=stack.url, keeper=stack.keeper,
                            job=job) as tx:  # fmt: skip
        tx.write(df, table=table)


@pytest.mark.parametrize(
    ("mode", "api"), [("attach", "save"), ("dedup", "save"), ("attach", "transaction")]
)
def test_every_pair_of_the_contract_round_trips_value_by_value(
    new_york: Any, stack: Any, ch: Any, fresh_db: str, mode: str, api: str
) -> None:
    table = f"{fresh_db}.exact"
    ch.command(_ddl(table, [(n, t) for n, _, t, _, _ in EXACT], mode))
    df = new_york.sql(
        "SELECT cast(1 as bigint) AS id, " + ", ".join(f"{e} AS `{n}`" for n, e, *_ in EXACT)
    )
    if api == "save":  # format("clickhouse_tx") and foreach_batch (its batch save)
        _save(df, stack, table, mode)
    else:
        _transaction(new_york, df, stack, table)
    reads = ", ".join(r.format(c=f"`{n}`") for n, _, _, r, _ in EXACT)
    assert ch.query(f"SELECT count() FROM {table}").result_rows[0][0] == 1
    got = (None, *ch.query(f"SELECT {reads} FROM {table}").result_rows[0])
    wrong = {
        n: (v, want)
        for (n, _, _, _, want), v in zip(EXACT, got[1:], strict=True)
        if v != want and not (isinstance(want, tuple) and tuple(v.values()) == want)
    }
    assert wrong == {}, f"column: (stored, written) in {mode} mode through {api}"


@pytest.mark.parametrize(
    "mode",
    ["attach", pytest.param("dedup", marks=pytest.mark.slow)],  # dedup: make test-slow
)
def test_a_value_that_would_be_stored_altered_is_refused_and_nothing_is_visible(
    new_york: Any, stack: Any, ch: Any, fresh_db: str, mode: str
) -> None:
    failures = []
    for k, (what, expr, ch_type, word) in enumerate(ALTERED):
        table = f"{fresh_db}.altered_{k}"
        ch.command(_ddl(table, [("c", ch_type)], mode))
        df = new_york.sql(f"SELECT cast(17 as bigint) AS id, {expr} AS c")
        try:
            _save(df, stack, table, mode)
        except Exception as exc:
            text = str(exc)
            if "ValueRefused" not in text and "would not be stored" not in text:
                failures.append(f"{what}: refused for another reason: {text[-400:]}")
            elif word not in text or "column c" not in text:
                failures.append(f"{what}: the refusal does not name {word!r}: {text[-400:]}")
        else:
            failures.append(f"{what}: written ({_stored(ch, table)})")
        rows = ch.query(f"SELECT count() FROM {table}").result_rows[0][0]
        if rows:
            failures.append(f"{what}: {rows} row(s) visible after the refusal")
    assert failures == []
    staging = ch.query("SELECT name FROM system.tables WHERE name LIKE 'tx_vc_%'").result_rows
    assert staging == []  # a refused task dropped what it created


def _stored(ch: Any, table: str) -> Any:
    try:
        return ch.query(f"SELECT toString(c) FROM {table}").result_rows
    except TxSinkError as exc:  # pragma: no cover - diagnostics only
        return exc
