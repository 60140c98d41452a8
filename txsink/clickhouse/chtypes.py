"""ClickHouse and Spark type strings, parsed, and whether a DataFrame fits a target.

Owned by the ClickHouse adapter; pure (no I/O). Spark types are spelled as
``DataType.simpleString()`` prints them (``bigint``, ``decimal(10,2)``, ``array<int>``,
``struct<a:int,b:string>``); ClickHouse types as ``system.columns.type`` prints them
(``LowCardinality(Nullable(String))``). Invariants: :func:`check_schema` returns errors
naming the table and column; soft warnings (unsigned targets, precision loss the user
probably intends) go to the optional ``notes`` list.

:func:`created_type` runs the other way, for a table txsink creates
(``create_table=if_missing``): for each Spark type the ClickHouse type that
:func:`check_schema` accepts and that stores every value unaltered (at most checked per
value where no ClickHouse type holds Spark's whole range: dates and times before 1900 or
after 2299, nulls in an Array, Map, Tuple or JSON column, which cannot be Nullable).
A unit test proves that for every type family of docs/types.md.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from txsink.clickhouse.sqltext import split_top_level
from txsink.errors import SchemaMismatch
from txsink.names import quote_ident
from txsink.ports.warehouse import ColumnInfo

# default_kind values of system.columns a DataFrame cannot (or need not) supply.
NOT_INSERTABLE_KINDS = frozenset({"MATERIALIZED", "ALIAS"})


@dataclass(frozen=True)
class SparkField:
    name: str
    type_string: str  # DataType.simpleString()
    nullable: bool = True


# --------------------------------------------------------------------------- type parsing


@dataclass(frozen=True)
class CHType:
    """A parsed ClickHouse type: ``name(args...)``; args are nested types or literals."""

    name: str
    args: tuple[str, ...] = ()

    def arg_type(self, i: int) -> CHType:
        return parse_ch_type(_strip_element_name(self.args[i]))

    @property
    def text(self) -> str:
        """The type as ClickHouse spells it: ``Decimal(10, 2)``."""
        return f"{self.name}({', '.join(self.args)})" if self.args else self.name


def parse_ch_type(s: str) -> CHType:
    """``name(args)`` as ClickHouse prints it. Not clickhouse-connect's type registry
    (``get_from_name``), which parses into its column codecs: the schema check and the
    value contract need each argument as the server spelled it (Decimal precision,
    DateTime64 zone, Enum values), which a name and its raw arguments keep."""
    s = s.strip()
    m = re.match(r"^([A-Za-z_][A-Za-z0-9_]*)\s*(?:\((.*)\))?$", s, re.DOTALL)
    if not m:
        return CHType(s)
    args = tuple(split_top_level(m.group(2))) if m.group(2) is not None else ()
    return CHType(m.group(1), args)


_ELEMENT_NAME_RE = re.compile(r"^(`[^`]+`|[A-Za-z_][A-Za-z0-9_]*)\s+(?=[A-Za-z_])")


def _strip_element_name(arg: str) -> str:
    """``a Int32`` (a named Tuple element) -> ``Int32``."""
    m = _ELEMENT_NAME_RE.match(arg)
    return arg[m.end() :] if m else arg


def _element_name(arg: str) -> str | None:
    m = _ELEMENT_NAME_RE.match(arg)
    return m.group(1).strip("`") if m else None


def unwrap(t: CHType) -> tuple[CHType, bool]:
    """Strip LowCardinality/Nullable wrappers: (inner type, nullable).

    ``SimpleAggregateFunction(f, T)`` is stored and inserted as plain ``T`` (ClickHouse
    takes values of ``T`` for it, the function only applies when parts merge), so it
    unwraps to ``T`` as well, for type checks and for the null check of each block."""
    nullable = False
    while t.args:
        if t.name in ("LowCardinality", "Nullable"):
            nullable = nullable or t.name == "Nullable"
            t = t.arg_type(0)
        elif t.name == "SimpleAggregateFunction" and len(t.args) >= 2:
            t = t.arg_type(len(t.args) - 1)
        else:
            break
    return t, nullable


@dataclass(frozen=True)
class SparkType:
    name: str  # bigint, decimal, array, map, struct, ...
    args: tuple[str, ...] = ()  # decimal: (p, s); array: (elem,); map: (k, v)
    fields: tuple[tuple[str, str], ...] = ()  # struct: ((name, type), ...)


def parse_spark_type(s: str) -> SparkType:
    s = s.strip()
    low = s.lower()
    if low.startswith("array<") and low.endswith(">"):
        return SparkType("array", (s[6:-1],))
    if low.startswith("map<") and low.endswith(">"):
        kv = split_top_level(s[4:-1])
        return SparkType("map", tuple(kv))
    if low.startswith("struct<") and low.endswith(">"):
        fields = []
        for f in split_top_level(s[7:-1]):
            name, _, typ = f.partition(":")
            fields.append((name.strip("`"), typ))
        return SparkType("struct", fields=tuple(fields))
    m = re.match(r"^(decimal|char|varchar)\((\d+)(?:,\s*(\d+))?\)$", low)
    if m:
        args = (m.group(2), m.group(3) or "0") if m.group(1) == "decimal" else (m.group(2),)
        return SparkType(m.group(1), args)
    if low == "decimal":
        return SparkType("decimal", ("10", "0"))
    return SparkType(low)


# --------------------------------------------------------------------------- compatibility

_SIGNED = {"Int8": 8, "Int16": 16, "Int32": 32, "Int64": 64, "Int128": 128, "Int256": 256}
_UNSIGNED = {"UInt8": 8, "UInt16": 16, "UInt32": 32, "UInt64": 64, "UInt128": 128, "UInt256": 256}
SPARK_INT_BITS = {"tinyint": 8, "byte": 8, "smallint": 16, "short": 16, "int": 32,
                   "integer": 32, "bigint": 64, "long": 64}  # fmt: skip
_DECIMAL_MAX_P = {"Decimal32": 9, "Decimal64": 18, "Decimal128": 38, "Decimal256": 76}
STRINGISH = {"string", "char", "varchar"}
PARSED_FROM_TEXT = ("UUID", "IPv4", "IPv6", "Bool", "JSON")


@dataclass
class _Verdict:
    error: str | None = None
    notes: list[str] = field(default_factory=list)


def decimal_ps(t: CHType) -> tuple[int, int] | None:
    try:
        if t.name == "Decimal" and len(t.args) == 2:
            return int(t.args[0]), int(t.args[1])
        if t.name == "Decimal" and len(t.args) == 1:
            return int(t.args[0]), 0
        if t.name in _DECIMAL_MAX_P and len(t.args) == 1:
            return _DECIMAL_MAX_P[t.name], int(t.args[0])
    except ValueError:
        return None
    return None


def _compatible(spark: SparkType, ch: CHType, where: str) -> _Verdict:
    """Whether values of ``spark`` fit into ``ch`` (already unwrapped); ``where`` names it."""
    v = _Verdict()
    n = ch.name
    s = spark.name
    bad = _Verdict(
        f"{s} does not fit {ch.text}; cast the column in Spark to a type docs/types.md "
        f"lists for {ch.name}, or change the column's type"
    )
    if s in SPARK_INT_BITS:
        bits = SPARK_INT_BITS[s]
        if n in _SIGNED and _SIGNED[n] >= bits:
            return v
        if n in _UNSIGNED and _UNSIGNED[n] >= bits:
            return v  # negatives are refused value by value (txsink.clickhouse.values)
        if n in _SIGNED or n in _UNSIGNED:
            return _Verdict(f"{s} is wider than {n}; widen the column or cast in Spark")
        if n in ("Float32", "Float64") or decimal_ps(ch) is not None:
            return v  # whole numbers beyond what the type holds exactly: per value
        return bad
    if s == "boolean":
        return v if n in ("Bool", "Boolean", "UInt8", "Int8") else bad
    if s == "float":
        return v if n in ("Float32", "Float64") else bad
    if s == "double":
        if n == "Float64":
            return v
        if n == "Float32":
            return _Verdict("double into Float32 loses precision; cast to float in Spark")
        return bad
    if s == "decimal":
        p, sc = int(spark.args[0]), int(spark.args[1])
        if sc == 0 and (n in _SIGNED or n in _UNSIGNED):
            return v  # whole numbers: their range is checked value by value
        ps = decimal_ps(ch)
        if ps is None:
            return bad
        cp, cs = ps
        if cp - cs >= p - sc and cs >= sc:
            return v
        return _Verdict(
            f"decimal({p},{sc}) does not fit {ch.text}: need at least {p - sc} integer "
            f"and {sc} fractional digits; widen the column or cast in Spark"
        )
    if s in STRINGISH:
        if n == "String":
            return v
        if n == "FixedString":
            return v  # longer values: refused value by value
        if n in PARSED_FROM_TEXT:
            # the server parses each value and refuses the insert at the first one it
            # cannot read (docs/types.md): nothing is altered
            return v
        if n in ("Enum8", "Enum16", "Enum"):
            return v  # values outside the enum: refused value by value
        return bad
    if s == "binary":
        if n == "String":
            return v
        if n == "FixedString":
            return v  # longer values: refused value by value
        return bad
    if s in ("timestamp", "timestamp_ntz"):
        # range, precision and (timestamp_ntz) the column's zone: per value, in
        # txsink.clickhouse.values
        return v if n in ("DateTime", "DateTime64") else bad
    if s == "date":
        return v if n in ("Date", "Date32") else bad  # Date's range: per value
    if s == "array":
        if n != "Array" or len(ch.args) != 1:
            return bad
        inner, _ = unwrap(ch.arg_type(0))
        return _nested(parse_spark_type(spark.args[0]), inner, f"{where}[]")
    if s == "map":
        if n != "Map" or len(ch.args) != 2 or len(spark.args) != 2:
            return bad
        kv = _nested(parse_spark_type(spark.args[0]), unwrap(ch.arg_type(0))[0], f"{where} key")
        if kv.error:
            return kv
        vv = _nested(parse_spark_type(spark.args[1]), unwrap(ch.arg_type(1))[0], f"{where} value")
        vv.notes[:0] = kv.notes
        return vv
    if s == "struct":
        if n != "Tuple" or len(ch.args) != len(spark.fields):
            return _Verdict(
                f"struct with {len(spark.fields)} fields does not fit {ch.text}; "
                "use a Tuple with the same fields"
            )
        for i, (fname, ftype) in enumerate(spark.fields):
            ename = _element_name(ch.args[i])
            if ename is not None and ename != fname:
                return _Verdict(f"struct field {fname} meets Tuple element {ename}")
            sub = _nested(parse_spark_type(ftype), unwrap(ch.arg_type(i))[0], f"{where}.{fname}")
            if sub.error:
                return sub
            v.notes.extend(sub.notes)
        return v
    if s == "variant":
        # sent as its JSON text (txsink.clickhouse.values): the server would store
        # Spark's binary encoding (value, metadata) as it is
        return v if n == "JSON" else bad
    if s.startswith("interval"):
        if "year" in s or "month" in s:
            return _Verdict(
                f"{s} has no Arrow form in Spark; cast it to a whole number of months "
                "(e.g. `year * 12 + month`) first"
            )
        # a day-time interval travels as its count of microseconds (Arrow duration[us])
        return v if n == "Int64" else bad
    if s in ("void", "null"):
        return v
    return _Verdict(f"Spark type {s} is not supported by txsink; cast it in Spark")


def _nested(spark: SparkType, ch: CHType, where: str) -> _Verdict:
    if spark.name == "variant":
        return _Verdict(
            f"{where}: a variant inside an array, map or struct is not supported; write it "
            "as a column of its own, or to_json() it into a string"
        )
    v = _compatible(spark, ch, where)
    if v.error:
        v.error = f"{where}: {v.error}"
    return v


def check_schema(
    spark_fields: list[SparkField],
    columns: list[ColumnInfo],
    *,
    table: str = "the target",
    notes: list[str] | None = None,
) -> list[str]:
    """Every reason the DataFrame cannot be inserted into ``columns`` of ``table``.

    Missing columns (no default in the target), extra columns, incompatible types and
    nullable Spark columns meeting non-Nullable ClickHouse columns are errors: ClickHouse
    would otherwise turn nulls silently into default values (``input_format_null_as_default``).
    A missing Nullable column is allowed (it becomes NULL) and noted.
    """
    errors: list[str] = []
    by_name = {c.name: c for c in columns}
    lower = {c.name.lower(): c.name for c in columns}
    seen: set[str] = set()
    for f in spark_fields:
        col = by_name.get(f.name)
        if col is None:
            hint = lower.get(f.name.lower())
            did = f" (did you mean {hint}? names are case-sensitive)" if hint else ""
            errors.append(
                f"DataFrame column {f.name} does not exist in {table}{did}; drop or rename "
                "it before writing, or add the column to the table"
            )
            continue
        seen.add(col.name)
        if col.default_kind in NOT_INSERTABLE_KINDS:
            errors.append(
                f"column {col.name} of {table} is {col.default_kind} and cannot be written; "
                "drop it from the DataFrame"
            )
            continue
        ch, ch_nullable = unwrap(parse_ch_type(col.type))
        where = f"column {col.name} of {table}"
        verdict = _compatible(parse_spark_type(f.type_string), ch, where)
        if verdict.error:
            errors.append(
                f"{where} is {col.type}, the DataFrame has {f.type_string}: {verdict.error}"
            )
            continue
        if notes is not None:
            notes.extend(verdict.notes)
        if f.nullable and not ch_nullable:
            if ch.name in ("Array", "Map", "Tuple"):
                if notes is not None:
                    notes.append(
                        f"{where} is {col.type} (cannot be Nullable): null values from the "
                        "DataFrame become empty values"
                    )
            else:
                errors.append(
                    f"{where} is {col.type} (not Nullable) but DataFrame column {f.name} is "
                    f"nullable: make the column Nullable({col.type}) or fill nulls in Spark "
                    "(coalesce / na.fill) so the field is non-nullable"
                )
    for col in columns:
        if col.name in seen or col.default_kind:
            continue
        if unwrap(parse_ch_type(col.type))[1]:
            if notes is not None:
                notes.append(f"column {col.name} of {table} is not in the DataFrame: NULL")
            continue
        errors.append(
            f"column {col.name} ({col.type}) of {table} has no default and is missing from "
            "the DataFrame; add it to the DataFrame or give the column a DEFAULT"
        )
    return errors


# --------------------------------------------------------------------------- creation

# Spark's scalar types (parsed names) -> the ClickHouse type a created column gets.
# Instants and wall clocks alike go into a UTC DateTime64(6): microseconds kept, and in
# UTC a timestamp_ntz's wall clock is its stored instant (no conversion, also nested).
CREATED_TIMESTAMP = "DateTime64(6, 'UTC')"
_CREATED = {
    **{name: f"Int{bits}" for name, bits in SPARK_INT_BITS.items()},
    "float": "Float32",
    "double": "Float64",
    "boolean": "Bool",
    **{name: "String" for name in STRINGISH},
    "binary": "String",
    "date": "Date32",  # 1900-2299; Date would refuse everything before 1970
    "timestamp": CREATED_TIMESTAMP,
    "timestamp_ntz": CREATED_TIMESTAMP,
    "variant": "JSON",  # sent as its JSON text (txsink.clickhouse.values)
}
# What ClickHouse cannot wrap in Nullable on every server txsink supports: a null there
# is refused value by value (txsink.clickhouse.values), never stored as an empty value.
NEVER_NULLABLE = ("Array", "Map", "Tuple", "JSON")


def created_type(spark: str | Mapping[str, Any], nullable: bool = True, *, where: str = "") -> str:
    """The ClickHouse type txsink creates a column of Spark type ``spark`` with.

    ``spark`` is Spark's JSON form of the type (``DataType.jsonValue()``: ``"long"``,
    ``"decimal(10,2)"``, ``{"type": "array", "elementType": ..., "containsNull": ...}``):
    unlike ``simpleString()`` it says which array elements, map values and struct fields
    may be null. ``nullable``: whether the field may be null (``Nullable(T)`` then).
    ``where`` names the column in errors. SchemaMismatch for a type no column can hold
    as it is, naming the column and the cast to make."""
    return _created(spark, nullable, where or "the column", nested=False)


def _created(spark: str | Mapping[str, Any], nullable: bool, where: str, *, nested: bool) -> str:
    if isinstance(spark, Mapping):
        kind = spark.get("type")
        if kind == "array":
            inner = _created(spark["elementType"], bool(spark.get("containsNull", True)),
                             f"{where}[]", nested=True)  # fmt: skip
            return f"Array({inner})"
        if kind == "map":  # keys are never null in Spark, and never Nullable in ClickHouse
            key = _created(spark["keyType"], False, f"{where}{{key}}", nested=True)
            value = _created(spark["valueType"], bool(spark.get("valueContainsNull", True)),
                             f"{where}{{value}}", nested=True)  # fmt: skip
            return f"Map({key}, {value})"
        if kind == "struct":
            elements = []
            for f in spark.get("fields", ()):
                name = str(f["name"])
                if "`" in name or "\\" in name:
                    raise SchemaMismatch(
                        f"{where}: struct field {name!r} has a backquote or backslash in its "
                        "name, which a created Tuple cannot carry through txsink's type "
                        "checks; rename the field in Spark"
                    )
                sub = _created(f["type"], bool(f.get("nullable", True)), f"{where}.{name}",
                               nested=True)  # fmt: skip
                elements.append(f"{quote_ident(name)} {sub}")
            return f"Tuple({', '.join(elements)})"
        raise SchemaMismatch(
            f"{where}: Spark type {kind or spark!r} has no ClickHouse type txsink creates; "
            "cast it in Spark (docs/types.md), or create the table yourself"
        )
    parsed = parse_spark_type(str(spark))
    s = parsed.name
    if s == "variant" and nested:
        raise SchemaMismatch(
            f"{where}: a variant inside an array, map or struct is not supported; write it "
            "as a column of its own, or to_json() it into a string"
        )
    if s == "decimal":
        base = f"Decimal({parsed.args[0]}, {parsed.args[1]})"
    elif s.startswith("interval ") and "year" not in s and "month" not in s:
        base = "Int64"  # a day-time interval travels as its count of microseconds
    elif s in _CREATED:
        base = _CREATED[s]
    else:
        fix = {
            "void": "a column of nulls only has no type: cast it in Spark to the type it "
            "stands for",
        }.get(s, "cast it in Spark to a type docs/types.md lists, or create the table yourself")
        if s.startswith("interval "):
            fix = "cast it to a whole number of months (e.g. `year * 12 + month`) first"
        raise SchemaMismatch(
            f"{where}: Spark type {s} has no ClickHouse type txsink creates; {fix}"
        )
    if nullable and not base.startswith(NEVER_NULLABLE):
        return f"Nullable({base})"
    return base
