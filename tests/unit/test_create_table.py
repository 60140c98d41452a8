"""``create_table=if_missing``: the types a created table gets, its DDL, the options.

The mapping is the inverse of the value contract (docs/types.md): every created type must
be one :func:`check_schema` accepts for the Spark type it was made from, and one whose
value rules never alter a value (no precision cut, no wall-clock conversion, no padding).
"""

from __future__ import annotations

from typing import Any

import pytest

from txsink.clickhouse.chtypes import SparkField, check_schema, created_type
from txsink.clickhouse.target_ddl import (
    DEDUP_WINDOW_SETTING,
    check_engine,
    create_sql,
    created_columns,
    parse_table_settings,
    plan_create,
    with_dedup_window,
)
from txsink.clickhouse.values import Check, plan_rules
from txsink.config import WriterConfig
from txsink.errors import ConfigError, SchemaMismatch
from txsink.ports.warehouse import ColumnInfo

BASE = {"url": "http://127.0.0.1:8123", "keeper": "127.0.0.1:2181", "table": "db.t", "job": "j"}


def _array(elem: Any, nulls: bool = True) -> dict[str, Any]:
    return {"type": "array", "elementType": elem, "containsNull": nulls}


def _map(key: Any, value: Any, nulls: bool = True) -> dict[str, Any]:
    return {"type": "map", "keyType": key, "valueType": value, "valueContainsNull": nulls}


def _struct(*fields: tuple[str, Any, bool]) -> dict[str, Any]:
    return {
        "type": "struct",
        "fields": [{"name": n, "type": t, "nullable": b, "metadata": {}} for n, t, b in fields],
    }


# Every type family of docs/types.md: (Spark JSON type, its simpleString, created type of a
# non-nullable field)
FAMILIES: list[tuple[Any, str, str]] = [
    ("byte", "tinyint", "Int8"),
    ("short", "smallint", "Int16"),
    ("integer", "int", "Int32"),
    ("long", "bigint", "Int64"),
    ("float", "float", "Float32"),
    ("double", "double", "Float64"),
    ("decimal(10,2)", "decimal(10,2)", "Decimal(10, 2)"),
    ("decimal(20,0)", "decimal(20,0)", "Decimal(20, 0)"),
    ("decimal(38,18)", "decimal(38,18)", "Decimal(38, 18)"),
    ("boolean", "boolean", "Bool"),
    ("string", "string", "String"),
    ("char(4)", "char(4)", "String"),
    ("varchar(9)", "varchar(9)", "String"),
    ("binary", "binary", "String"),
    ("date", "date", "Date32"),
    ("timestamp", "timestamp", "DateTime64(6, 'UTC')"),
    ("timestamp_ntz", "timestamp_ntz", "DateTime64(6, 'UTC')"),
    (_array("integer"), "array<int>", "Array(Nullable(Int32))"),
    (_array("integer", False), "array<int>", "Array(Int32)"),
    (_array(_array("string", False)), "array<array<string>>", "Array(Array(String))"),
    (_array("timestamp_ntz"), "array<timestamp_ntz>", "Array(Nullable(DateTime64(6, 'UTC')))"),
    (_map("string", "integer"), "map<string,int>", "Map(String, Nullable(Int32))"),
    (_map("long", "double", False), "map<bigint,double>", "Map(Int64, Float64)"),
    (_struct(("a", "integer", True), ("b", "string", False)), "struct<a:int,b:string>",
     "Tuple(`a` Nullable(Int32), `b` String)"),
    (_struct(("x y", _array("date"), True)), "struct<x y:array<date>>",
     "Tuple(`x y` Array(Nullable(Date32)))"),
    ("variant", "variant", "JSON"),
    ("interval day to second", "interval day to second", "Int64"),
    ("interval hour to minute", "interval hour to minute", "Int64"),
]  # fmt: skip

# what a created column may still check per value: nothing that alters, only refusals of
# what no ClickHouse type holds (nulls where Nullable is impossible, dates beyond 1900-2299)
HARMLESS = {Check.NOT_NULL, Check.RANGE, Check.VARIANT_JSON}


@pytest.mark.parametrize(("spark", "simple", "want"), FAMILIES, ids=[f[1] for f in FAMILIES])
def test_every_type_family_is_created_as_a_type_the_contract_takes_unaltered(
    spark: Any, simple: str, want: str
) -> None:
    assert created_type(spark, False) == want
    nullable = created_type(spark, True)
    wrapper = want.startswith(("Array", "Map", "Tuple", "JSON"))
    assert nullable == (want if wrapper else f"Nullable({want})")
    for ch in (want, nullable):
        field = SparkField("c", simple, False)
        assert check_schema([field], [ColumnInfo("c", ch)], table="t") == []
        rules = plan_rules([field], [ColumnInfo("c", ch)], server_zone="Asia/Tokyo")
        assert {r.check for r in rules} <= HARMLESS, (ch, rules)
        ranged = [r for r in rules if r.check is Check.RANGE]
        assert all(r.ch_type.startswith(("Date32", "DateTime64")) for r in ranged), ranged


def test_a_timestamp_ntz_needs_no_conversion_even_where_the_server_runs_in_another_zone() -> None:
    """A created UTC column holds a wall clock as its instant: no WALL_CLOCK rule, so a
    nested timestamp_ntz (which that rule would refuse) is accepted too."""
    for spark, simple in (("timestamp_ntz", "timestamp_ntz"),
                          (_array("timestamp_ntz"), "array<timestamp_ntz>")):  # fmt: skip
        ch = created_type(spark, True)
        rules = plan_rules(
            [SparkField("c", simple)], [ColumnInfo("c", ch)], server_zone="Europe/Berlin"
        )
        assert Check.WALL_CLOCK not in {r.check for r in rules}


@pytest.mark.parametrize(
    ("spark", "word"),
    [
        ("interval year to month", "year * 12 + month"),
        ("interval", "cast it in Spark"),  # CalendarIntervalType
        ("void", "nulls only"),
        (_array("variant"), "variant inside"),
        (_struct(("a`b", "integer", True)), "backquote"),
        ({"type": "udt", "class": "x.Point"}, "udt"),
    ],
)
def test_a_type_no_created_column_can_hold_is_refused_naming_the_column(
    spark: Any, word: str
) -> None:
    with pytest.raises(SchemaMismatch, match="column c") as err:
        created_columns([("c", spark, True)])
    assert word in str(err.value)


def test_the_ddl_quotes_every_name_and_keeps_the_dataframes_order() -> None:
    columns = created_columns(
        [("id", "long", False), ("odd`name", "string", True), ("with space.dot", "date", True),
         ("ünï", "double", True)]
    )  # fmt: skip
    sql = create_sql(
        "`my db`.`t``1`", columns, order_by="id", partition_by="toYYYYMM(`with space.dot`)"
    )
    assert sql == (
        "CREATE TABLE IF NOT EXISTS `my db`.`t\\`1`\n(\n"
        "    `id` Int64,\n"
        "    `odd\\`name` Nullable(String),\n"
        "    `with space.dot` Nullable(Date32),\n"
        "    `ünï` Nullable(Float64)\n"
        ")\nENGINE = MergeTree\nPARTITION BY toYYYYMM(`with space.dot`)\nORDER BY id"
    )


def test_a_column_list_key_is_parenthesised_settings_and_engine_arguments_pass_through() -> None:
    sql = create_sql(
        "db.t",
        [ColumnInfo("id", "Int64"), ColumnInfo("v", "UInt32")],
        engine="ReplacingMergeTree(v)",
        order_by="id, intHash32(id)",
        partition_by="id % 4, v",
        settings=parse_table_settings("index_granularity=8192, storage_policy='s,3'"),
    )
    assert "ENGINE = ReplacingMergeTree(v)\n" in sql
    assert "PARTITION BY (id % 4, v)\nORDER BY (id, intHash32(id))\n" in sql
    assert sql.endswith("SETTINGS index_granularity = 8192, storage_policy = 's,3'")


def test_a_table_made_for_dedup_mode_gets_the_window_the_writer_requires() -> None:
    fields = [("id", "long", False)]
    common = {"engine": "MergeTree", "order_by": "id", "partition_by": ""}
    dedup = plan_create("db.t", fields, table_settings="", dedup_window=100, **common)
    assert dedup.endswith(f"SETTINGS {DEDUP_WINDOW_SETTING} = 100")
    attach = plan_create("db.t", fields, table_settings="", dedup_window=None, **common)
    assert "SETTINGS" not in attach
    own = plan_create("db.t", fields, table_settings=f"{DEDUP_WINDOW_SETTING}=5000",
                      dedup_window=100, **common)  # fmt: skip
    assert own.endswith(f"SETTINGS {DEDUP_WINDOW_SETTING} = 5000")
    # a replicated engine keeps the server's replicated_deduplication_window
    assert with_dedup_window("ReplicatedMergeTree", (), 100) == ()
    assert with_dedup_window("ReplacingMergeTree(v)", (("a", "1"),), 7) == (
        ("a", "1"), (DEDUP_WINDOW_SETTING, "7"))  # fmt: skip


def test_creating_without_order_by_is_refused_naming_the_option() -> None:
    with pytest.raises(ConfigError, match="needs option order_by") as err:
        plan_create("db.t", [("id", "long", False)], engine="MergeTree", order_by=" ",
                    partition_by="", table_settings="", dedup_window=None)  # fmt: skip
    assert "db.t does not exist" in str(err.value)


@pytest.mark.parametrize(
    ("option", "value", "word"),
    [
        ("engine", "Memory", "MergeTree family"),
        ("engine", "MergeTree ORDER BY id", "MergeTree family"),
        ("engine", "MergeTree; DROP TABLE x", "MergeTree family"),
        ("engine", "ReplacingMergeTree(v", "MergeTree family"),
        ("engine", "ReplacingMergeTree(v)) (", "MergeTree family"),
        ("engine", "ReplacingMergeTree(');') ; x", "MergeTree family"),
        ("engine", "ReplacingMergeTree(v) SETTINGS a = (1)", "MergeTree family"),
        ("engine", "ReplacingMergeTree(v) ORDER BY (id)", "MergeTree family"),
        ("engine", "", "MergeTree family"),
        ("order_by", "(id", "not one SQL clause"),
        ("order_by", "id); DROP TABLE t; --", "not one SQL clause"),
        ("partition_by", "toYYYYMM(ts", "not one SQL clause"),
        ("partition_by", "'abc", "not one SQL clause"),
        ("table_settings", "index_granularity", "not name=value"),
        ("table_settings", "a=1, a=2", "names a twice"),
        ("table_settings", "a=1; DROP TABLE t", "not name=value"),
        ("create_table", "always", "never, if_missing"),
    ],
)
def test_a_malformed_creation_option_is_refused_when_the_config_is_parsed(
    option: str, value: str, word: str
) -> None:
    with pytest.raises(ConfigError, match=option) as err:
        WriterConfig.from_options({**BASE, option: value})
    assert word in str(err.value)


def test_well_formed_creation_options_parse() -> None:
    cfg = WriterConfig.from_options(
        {
            **BASE,
            "create_table": "IF_MISSING",
            "order_by": "id, ts",
            "partition_by": "toDate(ts)",
            "engine": "ReplicatedMergeTree('/clickhouse/tables/{shard}/t', '{replica}')",
            "table_settings": "index_granularity=8192,storage_policy='default'",
        }
    )
    assert cfg.create_table == "if_missing"
    assert check_engine(cfg.engine) == cfg.engine
    assert WriterConfig.from_options(BASE).create_table == "never"


# ------------------------------------------------------------------ the driver's hook


class _Warehouse:
    """The target missing until created; records the statements."""

    def __init__(self, exists: bool = False) -> None:
        self.exists = exists
        self.created: list[str] = []

    def target_info(self, table: str) -> Any:
        if not self.exists:
            raise ConfigError(f"table {table} does not exist on http://x; create it", code=60)
        return table

    def create_target(self, table: str, sql: str) -> None:
        self.created.append(sql)
        self.exists = True


def _schema() -> Any:
    from pyspark.sql.types import LongType, StringType, StructField, StructType

    return StructType([StructField("id", LongType(), False), StructField("s", StringType())])


def test_a_missing_target_is_created_once_and_then_read_as_found() -> None:
    from txsink.spark.validate import read_target

    cfg = WriterConfig.from_options(
        {**BASE, "create_table": "if_missing", "order_by": "id", "mode": "dedup"}
    )
    warehouse = _Warehouse()
    assert read_target(cfg, _schema(), warehouse) == ["db.t"]
    assert len(warehouse.created) == 1
    assert "`s` Nullable(String)" in warehouse.created[0]
    assert warehouse.created[0].endswith(f"{DEDUP_WINDOW_SETTING} = 100")
    assert read_target(cfg, _schema(), warehouse) == ["db.t"]
    assert len(warehouse.created) == 1  # found: nothing more to do


def test_a_missing_target_without_create_table_is_the_error_it_was_with_the_way_out() -> None:
    from txsink.spark.validate import read_target

    warehouse = _Warehouse()
    with pytest.raises(ConfigError, match="does not exist") as err:
        read_target(WriterConfig.from_options(BASE), _schema(), warehouse)
    assert "create_table=if_missing" in str(err.value) and err.value.code == 60
    assert warehouse.created == []


class _Client:
    url = "http://ch:8123"

    def __init__(self, error: Exception | None) -> None:
        self.error = error
        self.sent: list[str] = []

    def command(self, sql: str, **_: Any) -> None:
        self.sent.append(sql)
        if self.error is not None:
            raise self.error


def test_a_create_that_loses_the_race_to_another_writer_succeeds() -> None:
    """A concurrent CREATE ... IF NOT EXISTS may answer TABLE_ALREADY_EXISTS (57)."""
    from txsink.clickhouse.warehouse import ClickHouseWarehouse
    from txsink.errors import TxSinkError

    client = _Client(TxSinkError("Code: 57. Table db.t already exists", code=57))
    ClickHouseWarehouse(client).create_target("db.t", "CREATE TABLE IF NOT EXISTS db.t ...")  # type: ignore[arg-type]
    assert client.sent == ["CREATE TABLE IF NOT EXISTS db.t ..."]


def test_a_create_the_server_refuses_names_the_options_and_shows_the_statement() -> None:
    from txsink.clickhouse.warehouse import ClickHouseWarehouse
    from txsink.errors import TxSinkError, UnavailableError

    client = _Client(TxSinkError("Code: 47. Unknown identifier nope", code=47))
    with pytest.raises(ConfigError, match="order_by, partition_by, engine") as err:
        ClickHouseWarehouse(client).create_target("db.t", "CREATE TABLE x ORDER BY nope")  # type: ignore[arg-type]
    assert "ORDER BY nope" in str(err.value) and err.value.code == 47
    down = _Client(UnavailableError("ClickHouse at http://ch:8123 is unreachable"))
    with pytest.raises(UnavailableError):  # passing trouble stays what it is
        ClickHouseWarehouse(down).create_target("db.t", "CREATE TABLE x")  # type: ignore[arg-type]


def test_a_sharded_job_creates_the_table_on_every_shard() -> None:
    from txsink.clickhouse.shards import ShardedWarehouse
    from txsink.clickhouse.warehouse import ClickHouseWarehouse

    clients = [_Client(None), _Client(None), _Client(None)]
    sharded = ShardedWarehouse([ClickHouseWarehouse(c) for c in clients])  # type: ignore[arg-type]
    sharded.create_target("db.t", "CREATE TABLE IF NOT EXISTS db.t ...")
    assert [c.sent for c in clients] == [["CREATE TABLE IF NOT EXISTS db.t ..."]] * 3


def test_key_columns_are_created_without_nullable_unless_nullable_keys_are_allowed() -> None:
    """ClickHouse refuses a Nullable sorting or partition key by default; Spark marks most
    columns nullable. A null in such a column is then refused per value (NOT_NULL)."""
    fields = [("id", "long", True), ("odd`ts", "timestamp", True), ("v", "string", True)]
    common = {"engine": "MergeTree", "dedup_window": None}
    sql = plan_create("db.t", fields, order_by="id", partition_by="toYYYYMM(`odd\\`ts`)",
                      table_settings="", **common)  # fmt: skip
    assert "`id` Int64," in sql and "`odd\\`ts` DateTime64(6, 'UTC')," in sql
    assert "`v` Nullable(String)" in sql
    allowed = plan_create("db.t", fields, order_by="id", partition_by="",
                          table_settings="allow_nullable_key=1", **common)  # fmt: skip
    assert "`id` Nullable(Int64)," in allowed
    rules = plan_rules([SparkField("id", "bigint")], [ColumnInfo("id", "Int64")])
    assert [r.check for r in rules] == [Check.NOT_NULL]
