"""Value rules (txsink.clickhouse.values): what ClickHouse would store altered is refused,
naming the column, the count and an example; what fits passes untouched."""

from __future__ import annotations

import datetime as dt
from decimal import Decimal
from typing import Any

import pyarrow as pa
import pytest

from txsink.clickhouse.chtypes import SparkField
from txsink.clickhouse.values import Check, ValueRefused, apply, plan_rules
from txsink.ports.warehouse import ColumnInfo

UTC = dt.UTC


def run(spark_type: str, ch_type: str, arr: pa.Array, zone: str = "UTC") -> pa.RecordBatch:
    rules = plan_rules([SparkField("c", spark_type)], [ColumnInfo("c", ch_type)], server_zone=zone)
    return apply(rules, pa.record_batch({"c": arr}), "db.t")


def refused(spark_type: str, ch_type: str, arr: pa.Array, zone: str = "UTC") -> str:
    with pytest.raises(ValueRefused) as err:
        run(spark_type, ch_type, arr, zone)
    return str(err.value)


def test_a_negative_into_an_unsigned_column_is_refused_with_count_and_example() -> None:
    msg = refused("int", "UInt32", pa.array([1, -1, 5, -7], pa.int32()))
    assert "column c of db.t is UInt32: 2 value(s)" in msg and "-1" in msg
    assert "Nothing was written" in msg
    run("int", "UInt32", pa.array([0, 2**31 - 1], pa.int32()))
    run("int", "Int64", pa.array([-1], pa.int32()))  # fits: no rule at all
    rules = plan_rules([SparkField("c", "int", False)], [ColumnInfo("c", "Int64")])
    assert [r.check for r in rules] == [Check.NOT_NULL]  # nothing but the null count


def test_bigint_into_uint64_and_decimal_into_integers_are_checked_at_their_bounds() -> None:
    refused("bigint", "UInt64", pa.array([-(2**63)], pa.int64()))
    run("bigint", "UInt64", pa.array([2**63 - 1], pa.int64()))
    d20 = pa.decimal128(20, 0)
    run("decimal(20,0)", "UInt64", pa.array([Decimal(2**64 - 1), Decimal(0)], d20))
    msg = refused("decimal(20,0)", "UInt64", pa.array([Decimal(2**64)], d20))
    assert str(2**64) in msg
    rules = plan_rules(
        [SparkField("c", "decimal(38,0)", False)], [ColumnInfo("c", "Nullable(Int128)")]
    )
    assert rules == ()  # every decimal(38,0) fits Int128


@pytest.mark.parametrize(
    ("spark_type", "ch_type", "arr", "path"),
    [
        ("array<int>", "Array(Int32)", pa.array([[1, None]], pa.list_(pa.int32())), "c[]"),
        (
            "map<string,int>",
            "Map(String, Int32)",
            pa.array([[("a", None)]], pa.map_(pa.string(), pa.int32())),
            "c{value}",
        ),
        (
            "struct<a:int,b:string>",
            "Tuple(a Int32, b String)",
            pa.array([{"a": None, "b": "x"}], pa.struct([("a", pa.int32()), ("b", pa.string())])),
            "c.a",
        ),
        ("int", "Int32", pa.array([None], pa.int32()), "c"),
    ],
)
def test_a_null_at_any_depth_into_a_non_nullable_type_is_refused(
    spark_type: str, ch_type: str, arr: pa.Array, path: str
) -> None:
    msg = refused(spark_type, ch_type, arr)
    assert f"column {path} of db.t" in msg and "not Nullable" in msg and "1 null value(s)" in msg


def test_nulls_into_nullable_elements_pass() -> None:
    run("array<int>", "Array(Nullable(Int32))", pa.array([[1, None], []], pa.list_(pa.int32())))
    # a null array itself would become []: refused
    refused("array<int>", "Array(Nullable(Int32))", pa.array([None], pa.list_(pa.int32())))
    run("int", "Nullable(Int32)", pa.array([None], pa.int32()))


def ts(*values: dt.datetime, tz: str | None = "UTC") -> pa.Array:
    return pa.array(list(values), pa.timestamp("us", tz))


def test_sub_second_values_into_coarser_columns_are_refused_whole_ones_pass() -> None:
    fine = dt.datetime(2024, 1, 1, 0, 0, 0, 123456, tzinfo=UTC)
    whole = dt.datetime(2024, 1, 1, 0, 0, 1, tzinfo=UTC)
    assert "keeps" in refused("timestamp", "DateTime", ts(whole, fine))
    run("timestamp", "DateTime", ts(whole))
    refused("timestamp", "DateTime64(3)", ts(fine))
    run("timestamp", "DateTime64(3)", ts(dt.datetime(2024, 1, 1, 0, 0, 0, 123000, tzinfo=UTC)))
    run("timestamp", "DateTime64(6)", ts(fine))


@pytest.mark.parametrize(
    ("ch_type", "value"),
    [
        ("DateTime", dt.datetime(1969, 12, 31, 23, 59, 59, tzinfo=UTC)),
        ("DateTime", dt.datetime(2106, 2, 7, 6, 28, 16, tzinfo=UTC)),
        ("DateTime64(6)", dt.datetime(1899, 12, 31, 23, 59, 59, tzinfo=UTC)),
    ],
)
def test_instants_outside_a_columns_range_are_refused_not_clamped(
    ch_type: str, value: dt.datetime
) -> None:
    assert "range" in refused("timestamp", ch_type, ts(value))


def test_the_edges_of_datetime_pass() -> None:
    run("timestamp", "DateTime", ts(dt.datetime(1970, 1, 1, tzinfo=UTC)))
    run("timestamp", "DateTime", ts(dt.datetime(2106, 2, 7, 6, 28, 15, tzinfo=UTC)))


def test_dates_outside_date_are_refused_date32_holds_them() -> None:
    old = pa.array([dt.date(1969, 12, 31)], pa.date32())
    refused("date", "Date", old)
    run("date", "Date32", old)


def test_timestamp_ntz_is_stored_as_the_instant_showing_its_wall_clock_in_the_zone() -> None:
    wall = dt.datetime(2024, 1, 1, 2, 30, 0, 123456)
    out = run("timestamp_ntz", "DateTime64(6, 'Asia/Tokyo')", ts(wall, tz=None))
    instant = out.column(0)[0].as_py()
    assert instant.astimezone(dt.timezone(dt.timedelta(hours=9))).replace(tzinfo=None) == wall
    # a zone-less column: the server's zone
    out = run("timestamp_ntz", "DateTime64(6)", ts(wall, tz=None), zone="Europe/Berlin")
    assert out.column(0)[0].as_py() == dt.datetime(2024, 1, 1, 1, 30, 0, 123456, tzinfo=UTC)
    same = ts(wall, tz=None)  # a UTC column needs no conversion
    assert run("timestamp_ntz", "DateTime64(6, 'UTC')", same).column(0) is not None


def test_a_wall_clock_the_zone_skips_is_refused() -> None:
    gap = dt.datetime(2024, 3, 31, 2, 30)  # Europe/Berlin jumps 02:00 -> 03:00
    assert "one instant" in refused("timestamp_ntz", "DateTime('Europe/Berlin')", ts(gap, tz=None))


def test_fixed_string_and_enum_values_the_server_would_refuse_half_way_are_refused() -> None:
    assert "4 bytes" in refused("string", "FixedString(4)", pa.array(["abcd", "abcde"]))
    assert "pads" in refused("string", "FixedString(4)", pa.array(["abcd", "ab"]))  # 'ab\0\0'
    run("string", "FixedString(4)", pa.array(["abcd", "wxyz"]))
    run("binary", "FixedString(2)", pa.array([b"\x00\x01"]))
    msg = refused("string", "Enum8('a' = 1, 'it''s' = 2)", pa.array(["a", "c"]))
    assert "'c'" in msg
    run("string", "Enum8('a' = 1, 'b\\'c' = 2)", pa.array(["a", "b'c"]))
    run("string", "Enum8('a\\nb' = 1)", pa.array(["a\nb"]))  # C escapes, as ClickHouse prints
    refused("string", "Enum8('a\\nb' = 1)", pa.array(["anb"]))


def test_datetime64_9_ends_in_2262() -> None:
    late = ts(dt.datetime(2270, 1, 1, tzinfo=UTC))
    assert "range" in refused("timestamp", "DateTime64(9)", late)
    run("timestamp", "DateTime64(6)", late)


@pytest.mark.parametrize("zone", ["UCT", "Etc/Universal", "Etc/GMT", "Universal"])
def test_every_name_of_utc_needs_no_conversion(zone: str) -> None:
    wall = pa.array([[dt.datetime(2024, 1, 1, 2, 30)]], pa.list_(pa.timestamp("us")))
    run("array<timestamp_ntz>", f"Array(DateTime64(6, '{zone}'))", wall)


def test_a_null_in_a_column_spark_calls_non_nullable_is_still_refused() -> None:
    rules = plan_rules([SparkField("c", "int", False)], [ColumnInfo("c", "Int32")])
    with pytest.raises(ValueRefused, match="not Nullable"):
        apply(rules, pa.record_batch({"c": pa.array([None], pa.int32())}), "db.t")


def test_rules_survive_pickling_to_executors() -> None:
    import pickle

    rules: Any = plan_rules([SparkField("c", "array<int>")], [ColumnInfo("c", "Array(UInt8)")])
    assert pickle.loads(pickle.dumps(rules)) == rules
    assert {r.check for r in rules} == {Check.NOT_NULL, Check.RANGE}


def test_a_variant_column_is_sent_as_its_json_text_and_a_null_stays_null() -> None:
    import pyarrow as pa

    types = pytest.importorskip("pyspark.sql.types")
    if not hasattr(types, "VariantVal"):
        pytest.skip("this pyspark has no variant type (Spark 3.5)")
    VariantVal = types.VariantVal

    from txsink.clickhouse.chtypes import SparkField
    from txsink.clickhouse.values import Check, apply, plan_rules
    from txsink.ports.warehouse import ColumnInfo

    rules = plan_rules([SparkField("v", "variant", True)], [ColumnInfo("v", "JSON")])
    assert [r.check for r in rules] == [Check.VARIANT_JSON, Check.NOT_NULL]  # converted first
    # {"a": 1} in Spark's variant encoding (as parse_json writes it)
    value, metadata = b"\x02\x01\x00\x00\x02\x0c\x01", b"\x01\x01\x00\x01a"
    assert VariantVal(value, metadata).toJson() == '{"a":1}'
    struct = pa.array(
        [{"value": value, "metadata": metadata}],
        pa.struct([("value", pa.binary()), ("metadata", pa.binary())]),
    )
    batch = pa.record_batch({"v": struct})
    out = apply(rules, batch, "db.t")
    assert out.column(0).type == pa.string() and out.column(0).to_pylist() == ['{"a":1}']
    nullable = plan_rules([SparkField("v", "variant", True)], [ColumnInfo("v", "Nullable(JSON)")])
    with_null = pa.record_batch({"v": pa.array([None], struct.type)})
    assert apply(nullable, with_null, "db.t").column(0).to_pylist() == [None]
    # a variant JSON null would be stored as {}, a number refused mid-write: both refused
    # here, naming the column and the value
    from txsink.clickhouse.values import ValueRefused

    empty_meta = b"\x01\x00\x00"
    for encoded, shown in ((b"\x00", "'null'"), (bytes([3 << 2, 5]), "'5'")):
        odd = pa.array([{"value": value, "metadata": metadata},
                        {"value": encoded, "metadata": empty_meta}], struct.type)  # fmt: skip
        with pytest.raises(ValueRefused) as refused:
            apply(nullable, pa.record_batch({"v": odd}), "db.t")
        assert "column v of db.t" in str(refused.value) and shown in str(refused.value)
        assert "JSON objects" in str(refused.value)


def test_whole_numbers_into_floats_and_decimals_are_refused_where_they_would_not_fit() -> None:
    import pyarrow as pa

    from txsink.clickhouse.chtypes import SparkField
    from txsink.clickhouse.values import Check, ValueRefused, apply, plan_rules
    from txsink.ports.warehouse import ColumnInfo

    def rules(spark: str, ch: str) -> tuple:  # type: ignore[type-arg]
        return plan_rules([SparkField("c", spark, False)], [ColumnInfo("c", ch)])

    assert [r.check for r in rules("int", "Float64")] == [Check.NOT_NULL]  # always exact
    assert [r.check for r in rules("int", "Decimal(12, 2)")] == [Check.NOT_NULL]
    for spark, ch, ok, bad in [
        ("bigint", "Float64", 2**53, 2**53 + 1),
        ("int", "Float32", -(2**24), -(2**24) - 1),
        ("int", "Decimal(8, 2)", 999_999, 1_000_000),
    ]:
        planned = rules(spark, ch)
        kind = pa.int64() if spark == "bigint" else pa.int32()
        apply(planned, pa.record_batch({"c": pa.array([ok], kind)}), "db.t")
        with pytest.raises(ValueRefused, match=f"e.g. {bad}"):
            apply(planned, pa.record_batch({"c": pa.array([ok, bad], kind)}), "db.t")
