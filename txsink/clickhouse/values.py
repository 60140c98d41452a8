"""Values that types alone cannot vouch for: checked, batch by batch, before a row is sent.

A Spark type that fits a ClickHouse type (:mod:`txsink.clickhouse.chtypes`) can still
carry values ClickHouse would store altered: ``-1`` into ``UInt32`` wraps, a null inside
an array becomes ``0``, ``12:00:00.123456`` into ``DateTime`` loses its fraction,
1969 into ``DateTime`` is clamped, a ``timestamp_ntz`` read in a column's zone moves.
The driver plans one :class:`Rule` per such (column, nested element) from the two types
(:func:`plan_rules`); executors apply them to every Arrow record batch (:func:`apply`)
before it reaches a table, vectorized with ``pyarrow.compute``. A value a rule refuses
raises :class:`ValueRefused` naming the table, the column (with its nested path), how
many values and one of them, and the fix. One rule converts instead of refusing, because
the user's meaning is unambiguous: a ``timestamp_ntz`` (a wall clock) is stored as the
instant showing that wall clock in the column's time zone (or the server's).

Pure (pyarrow only). Rules are plain frozen dataclasses: they travel to executors inside
the write plan.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from txsink.clickhouse.chtypes import (
    PARSED_FROM_TEXT,
    SPARK_INT_BITS,
    STRINGISH,
    CHType,
    SparkField,
    SparkType,
    decimal_ps,
    parse_ch_type,
    parse_spark_type,
    unwrap,
)
from txsink.errors import SchemaMismatch
from txsink.ports.warehouse import ColumnInfo

US = 1_000_000
DAY_US = 86_400 * US
# ClickHouse's ranges (docs: DateTime, DateTime64, Date, Date32), in Spark's units
DATETIME_US = (0, (2**32 - 1) * US)
DATETIME64_US = (-2_208_988_800 * US, 10_413_791_999 * US + 999_999)  # 1900-01-01 .. 2299-12-31
DATETIME64_9_MAX_US = 9_223_372_036_854_775  # 2262-04-11 23:47:16.854775: Int64 nanoseconds
DATE_DAYS = (0, 65_535)  # 1970-01-01 .. 2149-06-06
DATE32_DAYS = (-25_567, 120_529)  # 1900-01-01 .. 2299-12-31
# whole numbers a float type holds exactly: +-2^24 (Float32), +-2^53 (Float64)
_WHOLE_RANGE = {"Float32": (-(2**24), 2**24), "Float64": (-(2**53), 2**53)}
_INT_RANGE = {
    **{f"Int{b}": (-(2 ** (b - 1)), 2 ** (b - 1) - 1) for b in (8, 16, 32, 64, 128, 256)},
    **{f"UInt{b}": (0, 2**b - 1) for b in (8, 16, 32, 64, 128, 256)},
}
_WHOLE_TARGETS = {**_INT_RANGE, **_WHOLE_RANGE}  # where Spark integers are range-checked
UTC_NAMES = frozenset(
    f"{prefix}{name}"
    for prefix in ("", "Etc/")
    for name in ("UTC", "UCT", "GMT", "GMT0", "GMT+0", "GMT-0", "Zulu", "Universal", "Greenwich")
)
_TIMESTAMPS = ("timestamp", "timestamp_ntz")


NOTHING_WRITTEN = "Nothing was written."  # every refusal ends so (dedup mode amends it)


class ValueRefused(SchemaMismatch):
    """A value ClickHouse would store altered (or refuse half-way): nothing was sent."""


class Check(enum.Enum):
    NOT_NULL = "not null"  # a null would become the type's default (0, '', [])
    RANGE = "range"  # outside [low, high] would wrap or be clamped
    WHOLE = "whole"  # finer than ``unit`` would be truncated
    EXACT_BYTES = "exact bytes"  # FixedString(N): longer is refused, shorter padded with \0
    ENUM = "enum"  # outside an Enum's names is refused by the server
    WALL_CLOCK = "wall clock"  # timestamp_ntz: converted to the instant in ``zone``
    VARIANT_JSON = "variant as JSON"  # variant: converted to its JSON text (server parses)


@dataclass(frozen=True)
class Rule:
    """One check (or the one conversion) of one column's values, or of a nested element.

    ``path``: steps from the top-level column to the element: ``[]`` (array element),
    ``{key}`` / ``{value}`` (map), ``.name`` (struct field)."""

    check: Check
    column: str
    ch_type: str  # the ClickHouse type the values go into (for the message)
    path: tuple[str, ...] = ()
    low: int | None = None
    high: int | None = None
    unit: str = ""  # WHOLE: pyarrow temporal unit ("second", "millisecond", ...)
    multiple: int = 1
    limit: int = 0  # EXACT_BYTES
    names: tuple[str, ...] = ()  # ENUM
    zone: str = ""  # WALL_CLOCK

    @property
    def where(self) -> str:
        return self.column + "".join(self.path)


# ------------------------------------------------------------------------- planning


def plan_rules(
    fields: Sequence[SparkField], columns: Sequence[ColumnInfo], *, server_zone: str = "UTC"
) -> tuple[Rule, ...]:
    """The rules for writing ``fields`` into ``columns`` (types already found compatible
    by :func:`txsink.clickhouse.chtypes.check_schema`). Every non-Nullable column and
    nested element gets a NOT_NULL rule, whatever Spark's nullability says (its type
    string does not say whether an array may hold nulls; a null count costs nothing)."""
    by_name = {c.name: c for c in columns}
    rules: list[Rule] = []
    for f in fields:
        col = by_name.get(f.name)
        if col is None:
            continue
        ch, nullable = unwrap(parse_ch_type(col.type))
        if not nullable:
            rules.append(Rule(Check.NOT_NULL, f.name, col.type))
        rules += _rules_for(parse_spark_type(f.type_string), ch, f.name, (), server_zone)
    # conversions first: the checks then see the values as they will be stored
    return tuple(sorted(rules, key=lambda r: r.check not in CONVERSIONS))


def _rules_for(
    spark: SparkType, ch: CHType, column: str, path: tuple[str, ...], server_zone: str
) -> list[Rule]:
    s, n, shown = spark.name, ch.name, ch.text
    out: list[Rule] = []

    def rule(check: Check, **kw: Any) -> Rule:
        return Rule(check, column, shown, path, **kw)

    targets = _INT_RANGE if s == "decimal" else _WHOLE_TARGETS
    if (s in SPARK_INT_BITS or s == "decimal") and n in targets:
        low, high = targets[n]
        if s == "decimal":
            digits = int(spark.args[0]) - int(spark.args[1])
            span = (-(10**digits) + 1, 10**digits - 1)
        else:
            bits = SPARK_INT_BITS[s]
            span = (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
        if span[0] < low or span[1] > high:
            out.append(rule(Check.RANGE, low=low, high=high))
    elif s in SPARK_INT_BITS and (ps := decimal_ps(ch)) is not None:
        digits = ps[0] - ps[1]  # whole numbers into a decimal: its integer digits
        bits = SPARK_INT_BITS[s]
        if 2 ** (bits - 1) > 10**digits - 1:
            out.append(rule(Check.RANGE, low=-(10**digits) + 1, high=10**digits - 1))
    elif s in _TIMESTAMPS and n in ("DateTime", "DateTime64"):
        zone = _zone_of(ch) or server_zone
        if s == "timestamp_ntz" and zone not in UTC_NAMES:
            out.append(rule(Check.WALL_CLOCK, zone=zone))
        if n == "DateTime":
            out.append(rule(Check.RANGE, low=DATETIME_US[0], high=DATETIME_US[1]))
            out.append(rule(Check.WHOLE, unit="second"))
        else:
            precision = _precision(ch)
            high = DATETIME64_9_MAX_US if precision >= 9 else DATETIME64_US[1]
            out.append(rule(Check.RANGE, low=DATETIME64_US[0], high=high))
            if precision < 6:
                unit, multiple = _UNITS[precision]
                out.append(rule(Check.WHOLE, unit=unit, multiple=multiple))
    elif s == "variant" and n == "JSON" and not path:
        out.append(rule(Check.VARIANT_JSON))
    elif s == "date" and n in ("Date", "Date32"):
        low, high = DATE_DAYS if n == "Date" else DATE32_DAYS
        out.append(rule(Check.RANGE, low=low, high=high))
    elif (s in STRINGISH or s == "binary") and n == "FixedString":
        out.append(rule(Check.EXACT_BYTES, limit=int(ch.args[0])))
    elif s in STRINGISH and n in ("Enum8", "Enum16", "Enum"):
        out.append(rule(Check.ENUM, names=enum_names(ch)))
    elif s == "array" and n == "Array":
        inner, nullable = unwrap(ch.arg_type(0))
        step = (*path, "[]")
        if not nullable:
            out.append(Rule(Check.NOT_NULL, column, inner.text, step))
        out += _rules_for(parse_spark_type(spark.args[0]), inner, column, step, server_zone)
    elif s == "map" and n == "Map":
        for i, step_name in ((0, "{key}"), (1, "{value}")):
            inner, nullable = unwrap(ch.arg_type(i))
            step = (*path, step_name)
            if not nullable and i == 1:  # map keys are never null in Spark
                out.append(Rule(Check.NOT_NULL, column, inner.text, step))
            out += _rules_for(parse_spark_type(spark.args[i]), inner, column, step, server_zone)
    elif s == "struct" and n == "Tuple":
        for i, (fname, ftype) in enumerate(spark.fields):
            inner, nullable = unwrap(ch.arg_type(i))
            step = (*path, f".{fname}")
            if not nullable:
                out.append(Rule(Check.NOT_NULL, column, inner.text, step))
            out += _rules_for(parse_spark_type(ftype), inner, column, step, server_zone)
    return out


_UNITS = {0: ("second", 1), 1: ("millisecond", 100), 2: ("millisecond", 10),
          3: ("millisecond", 1), 4: ("microsecond", 100), 5: ("microsecond", 10)}  # fmt: skip


def _precision(ch: CHType) -> int:
    try:
        return int(ch.args[0]) if ch.args else 3
    except ValueError:
        return 3


def _zone_of(ch: CHType) -> str:
    """The time zone a DateTime / DateTime64 column names ('' if none)."""
    args = ch.args if ch.name == "DateTime" else ch.args[1:]
    return args[0].strip().strip("'") if args else ""


_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "0": "\0", "b": "\b", "f": "\f", "a": "\a",
            "v": "\v", "e": "\x1b"}  # fmt: skip
_ESCAPES_RE = re.compile(r"\\(x[0-9A-Fa-f]{2}|.)", re.DOTALL)


def _unescape(m: re.Match[str]) -> str:
    """One C-style escape of a quoted ClickHouse literal (as system.columns prints it)."""
    code = m.group(1)
    if len(code) == 3 and code[0] == "x":
        return chr(int(code[1:], 16))
    return _ESCAPES.get(code, code)


def enum_names(ch: CHType) -> tuple[str, ...]:
    """The names of ``Enum8('a' = 1, 'b' = 2)``."""
    names = []
    for arg in ch.args:
        m = re.match(r"^\s*'((?:[^'\\]|\\.)*)'", arg)
        if m:
            names.append(_ESCAPES_RE.sub(_unescape, m.group(1)))
    return tuple(names)


# ------------------------------------------------------------------------- applying


def apply(rules: Sequence[Rule], batch: Any, table: str) -> Any:
    """``batch`` with the conversions done; ValueRefused at the first value a rule
    refuses (nothing of the batch has been sent)."""
    if not rules:
        return batch
    import pyarrow as pa

    columns = list(batch.columns)
    names = batch.schema.names
    converted = False
    for r in rules:
        if r.column not in names:
            continue
        i = names.index(r.column)
        if r.check in CONVERSIONS and not r.path:  # nested: refused by _check
            columns[i] = CONVERSIONS[r.check](columns[i], r, table)
            converted = True
            continue
        _check(r, _leaf(columns[i], r.path), table)
    if not converted:
        return batch
    return pa.RecordBatch.from_arrays(columns, schema=pa.schema(
        [batch.schema.field(j).with_type(columns[j].type) for j in range(len(columns))]
    ))  # fmt: skip


def _leaf(arr: Any, path: tuple[str, ...]) -> Any:
    import pyarrow as pa
    import pyarrow.compute as pc

    for step in path:
        if step == "[]":
            arr = pc.list_flatten(arr)
        elif step in ("{key}", "{value}"):
            # a map is a list of key/value structs (MapArray.keys would ignore a slice)
            kv = pa.list_(pa.struct([arr.type.key_field, arr.type.item_field]))
            arr = pc.list_flatten(arr.view(kv)).field(0 if step == "{key}" else 1)
        else:
            index = arr.type.get_field_index(step[1:])
            if index < 0:  # Spark allows two fields of one name; a Tuple check cannot
                raise ValueRefused(
                    f"struct column {path[0] if path else ''} has more than one field named "
                    f"{step[1:]!r}: rename them in Spark (each value is checked by name)"
                )
            arr = pc.struct_field(arr, [index])
    return arr


def _check(r: Rule, arr: Any, table: str) -> None:
    import pyarrow as pa
    import pyarrow.compute as pc

    if r.check is Check.NOT_NULL:
        if arr.null_count:
            raise ValueRefused(
                f"column {r.where} of {table} is {r.ch_type}, not Nullable, but the DataFrame "
                f"has {arr.null_count} null value(s) there: {_NULL_FIX}. " + NOTHING_WRITTEN
            )
        return
    if len(arr) == arr.null_count:
        return
    if r.check is Check.RANGE:
        values = _numeric(arr)
        low, high = r.low or 0, r.high or 0
        least, most = (v.as_py() for v in pc.min_max(values).values())
        if least < low or most > high:  # the error path may be slow: Python ints are exact
            outside = pa.array([v is not None and not low <= v <= high for v in values.to_pylist()])
            _refuse_where(r, arr, outside, table, _range_fix(r))
    elif r.check is Check.WHOLE:
        plain = arr.cast(pa.timestamp(arr.type.unit)) if arr.type.tz else arr
        floored = pc.floor_temporal(plain, multiple=r.multiple, unit=r.unit)
        _refuse_where(r, arr, pc.not_equal(floored, plain), table, _whole_fix(r))
    elif r.check is Check.EXACT_BYTES:
        _refuse_where(
            r, arr, pc.not_equal(pc.binary_length(arr), r.limit), table,
            f"values that are not exactly {r.limit} bytes: ClickHouse refuses longer ones "
            "and pads shorter ones with zero bytes; use String, or pad or trim in Spark",
        )  # fmt: skip
    elif r.check is Check.ENUM:
        outside = pc.invert(pc.is_in(arr, value_set=pa.array(r.names, arr.type)))
        _refuse_where(
            r, arr, outside, table,
            f"values outside the enum ({', '.join(map(repr, r.names[:8]))}"
            f"{', ...' if len(r.names) > 8 else ''}): map them in Spark or add them to the enum",
        )  # fmt: skip
    elif r.check is Check.WALL_CLOCK:
        _refuse(r, table, len(arr), "(nested)", _NESTED_NTZ_FIX.format(zone=r.zone))


def _numeric(arr: Any) -> Any:
    """Temporal values as integers in their own unit (timestamps: microseconds from
    Spark; dates: days)."""
    import pyarrow as pa

    if pa.types.is_timestamp(arr.type):
        # range only: a sub-microsecond rest (never from Spark) cannot move a bound
        us = arr.cast(pa.timestamp("us", arr.type.tz), safe=False) if arr.type.unit != "us" else arr
        return us.view(pa.int64())
    if pa.types.is_date32(arr.type):
        return arr.view(pa.int32())
    return arr


def _wall_clock(arr: Any, r: Rule, table: str) -> Any:
    """timestamp_ntz values (wall clocks) as the instants showing them in ``r.zone``."""
    import pyarrow as pa
    import pyarrow.compute as pc

    try:
        return pc.assume_timezone(arr, r.zone)
    except pa.ArrowInvalid as exc:  # a wall clock the zone skips or shows twice (DST)
        raise ValueRefused(
            f"column {r.where} of {table} ({r.ch_type}): a timestamp_ntz value does not "
            f"name one instant in {r.zone} ({exc}); write it as a timestamp (an instant) "
            "instead. " + NOTHING_WRITTEN
        ) from None


def _variant_json(arr: Any, r: Rule, table: str) -> Any:
    """Variant values (Spark's binary encoding: a struct of value and metadata) as their
    JSON text, which the server parses into the JSON column. The server would otherwise
    store the struct itself, bytes and all. One Python call per value: variant columns
    are rare, and no vectorized decoder exists."""
    import pyarrow as pa
    from pyspark.sql.types import VariantVal

    texts = [
        None if v is None else VariantVal(v["value"], v["metadata"]).toJson()
        for v in arr.to_pylist()
    ]
    # a JSON column holds objects: the server stores a JSON null as {} (altered) and
    # refuses a number, string or array half-way through a write; refuse them all here
    others = [t for t in texts if t is not None and not t.lstrip().startswith("{")]
    if others:
        _refuse(r, table, len(others), others[0], _VARIANT_FIX)
    return pa.array(texts, pa.string())


def _refuse_where(r: Rule, arr: Any, mask: Any, table: str, fix: str) -> None:
    import pyarrow.compute as pc

    count = pc.sum(mask).as_py() or 0
    if count:
        example = pc.filter(arr, mask)[0].as_py()
        _refuse(r, table, count, example, fix)


def _refuse(r: Rule, table: str, count: int, example: Any, fix: str) -> None:
    raise ValueRefused(
        f"column {r.where} of {table} is {r.ch_type}: {count} value(s) would not be stored "
        f"as written (e.g. {example!r}): {fix}. " + NOTHING_WRITTEN
    )


_NULL_FIX = (
    "ClickHouse stores a null there as the type's default (0, '', []); fill the nulls in "
    "Spark (coalesce / fillna) or make the element type Nullable"
)
_VARIANT_FIX = (
    "a JSON column holds JSON objects; a variant null would be stored as {} and a number, "
    "string or array is refused by the server; wrap the value in an object in Spark "
    "(e.g. parse_json(concat('{\"v\":', to_json(col), '}'))) or write to_json(col) into "
    "a String column"
)
_NESTED_NTZ_FIX = (
    "a timestamp_ntz inside an array, map or struct would be read in {zone}; cast it to "
    "timestamp in Spark (an instant), or store it in a UTC column"
)


def _range_fix(r: Rule) -> str:
    if r.ch_type.startswith(("DateTime", "Date")):
        return (
            f"outside the range {r.ch_type} can hold, where ClickHouse would clamp or wrap "
            "it; filter those rows in Spark or use DateTime64 / Date32, which hold 1900-2299"
        )
    if r.ch_type.startswith("Float"):
        return (
            f"outside [{r.low}, {r.high}], where {r.ch_type} would round it to another whole "
            "number; use an integer or Decimal column, or Float64 for values up to 2^53"
        )
    if r.ch_type.startswith("Decimal"):
        return (
            f"outside [{r.low}, {r.high}], more integer digits than {r.ch_type} has; widen "
            "the column's precision or filter those rows in Spark"
        )
    return (
        f"outside [{r.low}, {r.high}], where ClickHouse would wrap it; filter or fix those "
        "rows in Spark, or widen the column (a signed or wider type)"
    )


def _whole_fix(r: Rule) -> str:
    return (
        f"finer than {r.ch_type} keeps, where ClickHouse would truncate it; round in Spark "
        "(date_trunc) if that is meant, or use DateTime64(6) to keep microseconds"
    )


# ------------------------------------------------------------------------- the contract

_CONTRACT: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("tinyint / smallint / int", ("Int32", "Int64", "Int16", "UInt32", "UInt64", "UInt16",
                                  "Float64", "Float32", "Decimal(12, 2)", "Decimal(9, 2)")),
    ("bigint", ("Int64", "Int128", "UInt64", "Int32", "Decimal(38, 0)", "Float64")),
    ("float", ("Float32", "Float64")),
    ("double", ("Float64", "Float32")),
    ("decimal(10,2)", ("Decimal(10, 2)", "Decimal(18, 4)", "Decimal(10, 1)", "Int64")),
    ("decimal(20,0)", ("UInt64", "Int128", "Decimal(20, 0)")),
    ("decimal(38,0)", ("Int128", "Int256", "Decimal(38, 0)")),
    ("boolean", ("Bool", "UInt8")),
    ("string", ("String", "LowCardinality(String)", "FixedString(4)", "Enum8('a' = 1)",
                "UUID", "IPv4", "IPv6", "Bool", "JSON", "Int64", "Date")),
    ("binary", ("String", "FixedString(16)")),
    ("date", ("Date", "Date32", "DateTime")),
    ("timestamp", ("DateTime", "DateTime('Asia/Tokyo')", "DateTime64(3)", "DateTime64(6)",
                   "DateTime64(6, 'Asia/Tokyo')", "Date")),
    ("timestamp_ntz", ("DateTime64(6)", "DateTime64(6, 'Asia/Tokyo')", "DateTime")),
    ("array<int>", ("Array(Int32)", "Array(Nullable(Int32))", "Array(UInt32)", "Array(Int16)")),
    ("map<string,int>", ("Map(String, Int32)", "Map(String, Nullable(Int32))")),
    ("struct<a:int,b:string>", ("Tuple(a Int32, b String)", "Tuple(x Int32, b String)")),
    ("variant", ("JSON", "String")),
    ("interval day to second", ("Int64", "UInt64")),
    ("interval year to month", ("Int32",)),
)  # fmt: skip

_SAYS = {
    Check.NOT_NULL: "nulls inside refused",
    Check.RANGE: "values outside the column's range refused",
    Check.WHOLE: "finer values than the column keeps refused",
    Check.EXACT_BYTES: "values of another length refused (shorter ones would be padded)",
    Check.ENUM: "values outside the enum refused",
    Check.WALL_CLOCK: "stored as the instant showing its wall clock in the column's zone "
    "(or the server's)",
    Check.VARIANT_JSON: "sent as its JSON text (Spark's `to_json`), typed by the server "
    "path by path; a value that is not a JSON object (null, a number, a string, an array) "
    "is refused",
}
# the rules that convert a top-level column (the others only check), applied first
CONVERSIONS = {Check.WALL_CLOCK: _wall_clock, Check.VARIANT_JSON: _variant_json}


def contract_table() -> str:
    """docs/types.md's table: what txsink does with each (Spark type, ClickHouse type),
    computed by the same code that decides it at write time."""
    from txsink.clickhouse.chtypes import check_schema

    lines = ["| Spark type | ClickHouse type | what happens |", "|---|---|---|"]
    for spark_types, targets in _CONTRACT:
        spark = spark_types.split(" / ")[-1]
        for ch in targets:
            field = SparkField("c", spark, False)
            errors = check_schema([field], [ColumnInfo("c", ch)], table="t")
            if errors:
                verdict = "refused: " + errors[0].split(": ", 1)[-1]
            else:
                rules = plan_rules([field], [ColumnInfo("c", ch)])
                nested = [r for r in rules if r.path or r.check is not Check.NOT_NULL]
                says = list(dict.fromkeys(_SAYS[r.check] for r in nested))
                parsed = ch in PARSED_FROM_TEXT and spark == "string"
                verdict = (
                    "parsed by ClickHouse (a value it cannot read fails the write)"
                    if (parsed)
                    else "exact" + (f"; {'; '.join(says)}" if says else "")
                )
                if spark.startswith("interval"):
                    verdict += ", as its count of microseconds"
            cell = verdict.replace("|", "\\|")
            lines.append(f"| `{spark_types}` | `{ch}` | {cell} |")
    return "\n".join(lines)
