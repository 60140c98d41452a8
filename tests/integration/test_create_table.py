"""``create_table=if_missing`` on real Spark and the real ClickHouse engine: a missing
target is created from the DataFrame's schema, with types that take every value
unaltered (docs/types.md#created-tables), once, whoever races to create it.

One DataFrame holds a column of every type family of docs/types.md (nulls included where
the created type is Nullable); each value is read back with a ClickHouse expression that
shows it unambiguously (epoch microseconds for instants, ``toString`` for wall clocks and
dates, ``hex`` for bytes). The Spark session runs in America/New_York so that no time zone
hides a shift.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
import uuid
from decimal import Decimal
from typing import Any

import pytest

from txsink.errors import TxSinkError

pytestmark = pytest.mark.spark

UTC = dt.UTC


def _micros(*parts: int) -> int:
    return int(dt.datetime(*parts, tzinfo=UTC).timestamp() * 1_000_000)  # type: ignore[misc]


# (column, Spark expression of row 1, of row 2, created type, read-back, value 1, value 2)
COLUMNS: list[tuple[str, str, str, str, str, Any, Any]] = [
    ("i8", "cast(-128 as tinyint)", "cast(null as tinyint)", "Nullable(Int8)", "{c}", -128, None),
    ("i16", "cast(32767 as smallint)", "cast(null as smallint)", "Nullable(Int16)", "{c}",
     32767, None),
    ("i32", "cast(-2147483648 as int)", "cast(7 as int)", "Int32", "{c}", -(2**31), 7),
    ("i64", "cast(9223372036854775807 as bigint)", "cast(null as bigint)", "Nullable(Int64)",
     "{c}", 2**63 - 1, None),
    ("f32", "cast(1.5 as float)", "cast(null as float)", "Nullable(Float32)", "{c}", 1.5, None),
    ("f64", "cast(0.1 as double)", "cast(-1e300 as double)", "Float64", "{c}", 0.1, -1e300),
    ("dec", "cast('-12345678.91' as decimal(10,2))", "cast(null as decimal(10,2))",
     "Nullable(Decimal(10, 2))", "{c}", Decimal("-12345678.91"), None),
    ("dec38", "cast('99999999999999999999999999999999999999' as decimal(38,0))",
     "cast(0 as decimal(38,0))", "Decimal(38, 0)", "{c}", Decimal(10**38 - 1), Decimal(0)),
    ("flag", "true", "cast(null as boolean)", "Nullable(Bool)", "{c}", True, None),
    ("s", "'héllo, ''world'''", "cast(null as string)", "Nullable(String)", "{c}",
     "héllo, 'world'", None),
    ("bin", "X'00FF10'", "cast(null as binary)", "Nullable(String)", "hex({c})", "00FF10", None),
    ("day", "date'1900-01-01'", "date'2299-12-31'", "Date32", "toString({c})", "1900-01-01",
     "2299-12-31"),
    ("ts", "timestamp'2024-01-01 00:00:00.123456Z'", "cast(null as timestamp)",
     "Nullable(DateTime64(6, 'UTC'))", "toUnixTimestamp64Micro({c})",
     _micros(2024, 1, 1) + 123_456, None),
    ("ntz", "timestamp_ntz'2024-03-10 02:30:00.000001'", "timestamp_ntz'1900-01-01 00:00:00'",
     "DateTime64(6, 'UTC')", "toString({c})", "2024-03-10 02:30:00.000001",
     "1900-01-01 00:00:00.000000"),
    ("arr", "array(1, null)", "array()", "Array(Nullable(Int32))", "{c}", [1, None], []),
    ("arr_ntz", "array(timestamp_ntz'2024-01-01 12:00:00')", "array()",
     "Array(DateTime64(6, 'UTC'))", "arrayMap(x -> toString(x), {c})",
     ["2024-01-01 12:00:00.000000"], []),
    ("m", "map('a', 1, 'b', null)", "map('c', 3)", "Map(String, Nullable(Int32))", "{c}",
     {"a": 1, "b": None}, {"c": 3}),
    ("tup", "named_struct('a', 1, 'b', 'x')", "named_struct('a', null, 'b', 'y')",
     "Tuple(a Nullable(Int32), b String)", "toJSONString({c})", '{"a":1,"b":"x"}',
     '{"a":null,"b":"y"}'),
    ("var", """parse_json('{"a": 1, "b": [true, null]}')""", """parse_json('{"c": "2"}')""",
     "JSON", "toJSONString({c})", '{"a":1,"b":[true,null]}', '{"c":"2"}'),
    ("span", "interval '1 02:03:04.000005' day to second",
     "cast(null as interval day to second)", "Nullable(Int64)", "{c}",
     ((24 + 2) * 3600 + 3 * 60 + 4) * 1_000_000 + 5, None),
    ("odd name.x", "'q'", "cast(null as string)", "Nullable(String)", "{c}", "q", None),
    # nullable in Spark, never null, named by the key: created without Nullable
    ("k", "nullif(5, 0)", "nullif(6, 0)", "Int32", "{c}", 5, 6),
]  # fmt: skip


def _save(df: Any, stack: Any, table: str, job: str, **options: str) -> None:
    writer = (
        df.write.format("clickhouse_tx")
        .option("url", stack.url)
        .option("keeper", stack.keeper)
        .option("table", table)
        .option("job", job)
    )
    for key, value in options.items():
        writer = writer.option(key, value)
    writer.mode("append").save()


def test_a_missing_target_is_created_from_the_dataframe_and_every_value_arrives_exactly(
    new_york: Any, stack: Any, ch: Any, fresh_db: str
) -> None:
    table = f"{fresh_db}.created"
    rows = [
        ", ".join(
            [f"cast({i} as bigint) AS id"] + [f"{col[1 + i]} AS `{col[0]}`" for col in COLUMNS]
        )
        for i in (0, 1)
    ]
    rows.append(rows[0].replace("cast(0 as bigint) AS id", "cast(2 as bigint) AS id", 1))
    df = new_york.sql(" UNION ALL ".join(f"SELECT {r}" for r in rows))
    job = f"ct-{uuid.uuid4().hex[:8]}"
    _save(df, stack, table, job, create_table="if_missing", order_by="id, k",
          partition_by="id % 2")  # fmt: skip

    assert df.schema["k"].nullable
    types = dict(ch.query(
        "SELECT name, type FROM system.columns WHERE database = {d:String} AND table = 'created'",
        parameters={"d": fresh_db},
    ).result_rows)  # fmt: skip
    assert types == {"id": "Int64", **{c[0]: c[3] for c in COLUMNS}}
    counts = ch.query(f"SELECT count(), uniqExact(id) FROM {table}").result_rows[0]
    assert counts == (3, 3)
    reads = ", ".join(c[4].format(c=f"`{c[0]}`") for c in COLUMNS)
    got = ch.query(f"SELECT id, {reads} FROM {table} ORDER BY id").result_rows
    wrong = {}
    for row in got:
        want = [c[5] if row[0] != 1 else c[6] for c in COLUMNS]
        for (name, *_), stored, written in zip(COLUMNS, row[1:], want, strict=True):
            if stored != written:
                wrong[f"{name}@{row[0]}"] = (stored, written)
    assert wrong == {}, "column@id: (stored, written)"

    # the table now exists: a second write with the same option is a plain append
    _save(df, stack, table, job, create_table="if_missing", order_by="id")
    counts = ch.query(f"SELECT count(), uniqExact(id) FROM {table}").result_rows[0]
    assert counts == (6, 3)


def test_a_missing_target_without_create_table_is_refused_before_anything_is_written(
    spark: Any, stack: Any, ch: Any, fresh_db: str
) -> None:
    df = spark.sql("SELECT cast(1 as bigint) AS id")
    with pytest.raises(Exception, match="does not exist") as err:
        _save(df, stack, f"{fresh_db}.missing", f"ct-{uuid.uuid4().hex[:8]}")
    assert "create_table=if_missing" in str(err.value)
    assert ch.query(f"EXISTS TABLE {fresh_db}.missing").result_rows[0][0] == 0


def test_two_writers_racing_to_create_one_table_both_succeed_and_one_table_exists(
    stack: Any, ch: Any, fresh_db: str
) -> None:
    from txsink.clickhouse.client import connect
    from txsink.clickhouse.target_ddl import plan_create
    from txsink.clickhouse.warehouse import ClickHouseWarehouse

    fields = [("id", "long", False), ("s", "string", True)]
    failures: list[BaseException] = []
    for k in range(4):
        table = f"{fresh_db}.raced_{k}"
        sql = plan_create(table, fields, engine="MergeTree", order_by="id", partition_by="",
                          table_settings="", dedup_window=None)  # fmt: skip
        clients = [connect(stack.url) for _ in range(2)]
        start = threading.Barrier(2)

        def create(client: Any, table: str = table, sql: str = sql, start: Any = start) -> None:
            start.wait()
            try:
                ClickHouseWarehouse(client).create_target(table, sql)
            except TxSinkError as exc:  # pragma: no cover - the failure being tested for
                failures.append(exc)

        threads = [threading.Thread(target=create, args=(c,)) for c in clients]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        for c in clients:
            c.close()
    assert failures == []
    found = ch.query(
        "SELECT count() FROM system.tables WHERE database = {d:String} AND name LIKE 'raced_%'",
        parameters={"d": fresh_db},
    ).result_rows[0][0]
    assert found == 4


def test_a_table_created_for_dedup_mode_has_the_dedup_window_and_one_found_is_validated(
    stack: Any, ch: Any, fresh_db: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Driver-side only (no Spark job): validation creates (and logs the statement), then
    validates what it finds."""
    from pyspark.sql.types import LongType, StringType, StructField, StructType

    from txsink.config import WriterConfig
    from txsink.errors import SchemaMismatch
    from txsink.spark.validate import validate

    schema = StructType([StructField("id", LongType(), False), StructField("s", StringType())])
    options = {"url": stack.url, "keeper": stack.keeper, "create_table": "if_missing",
               "order_by": "id", "mode": "dedup", "job": f"ct-{uuid.uuid4().hex[:8]}"}  # fmt: skip
    with caplog.at_level(logging.INFO, logger="txsink.spark.validate"):
        plan = validate(WriterConfig.from_options({**options, "table": f"{fresh_db}.dd"}), schema)
    assert plan.mode == "dedup"
    assert f"CREATE TABLE IF NOT EXISTS `{fresh_db}`.`dd`" in caplog.text
    engine = ch.query(
        "SELECT engine_full FROM system.tables WHERE database = {d:String} AND name = 'dd'",
        parameters={"d": fresh_db},
    ).result_rows[0][0]
    assert "non_replicated_deduplication_window = 100" in engine

    # another writer created the table first, with another schema: the usual refusal
    ch.command(f"CREATE TABLE {fresh_db}.other (id String) ENGINE = MergeTree ORDER BY id")
    with pytest.raises(SchemaMismatch, match="column id of"):
        validate(WriterConfig.from_options({**options, "table": f"{fresh_db}.other"}), schema)
