"""The ``CREATE TABLE`` of a target txsink creates itself (``create_table=if_missing``).

Owned by the ClickHouse adapter; pure (no I/O). The driver runs the statement where the
target is missing (:func:`txsink.spark.validate.read_target`), then validates the table
as it finds it, like any other. Invariants:

- identifiers pass :func:`txsink.names.quote_ident`; column types come from
  :func:`txsink.clickhouse.chtypes.created_type`, the inverse of the value contract: the
  DataFrame the table is made from passes :func:`~txsink.clickhouse.chtypes.check_schema`
  and is stored unaltered (:func:`created_types_table` shows it in docs/types.md);
- the statement is ``CREATE TABLE IF NOT EXISTS``: writers racing to create one table
  leave one table, and the losers validate against what the winner created;
- the user's clauses (``engine``, ``order_by``, ``partition_by``, ``table_settings``) are
  checked to be one clause each (balanced, quote-aware, no ``;``), the engine to be of the
  MergeTree family (the only tables txsink can write: attach mode moves partitions, dedup
  mode needs block deduplication); ClickHouse judges the expressions themselves;
- a column the keys (``order_by``, ``partition_by``) name is created without
  ``Nullable`` (ClickHouse refuses Nullable keys unless ``allow_nullable_key``), whatever
  Spark's nullability says: Spark marks most columns nullable, and an actual null is
  refused value by value, as for any non-Nullable column;
- a table created for dedup mode gets the dedup window dedup mode requires
  (``non_replicated_deduplication_window = dedup_min_window``) unless the user's
  ``table_settings`` name it; replicated engines keep the server's
  ``replicated_deduplication_window``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from txsink.clickhouse.chtypes import SparkField, check_schema, created_type
from txsink.clickhouse.sqltext import closing_paren, outside_quotes, split_top_level
from txsink.errors import ConfigError, SchemaMismatch
from txsink.names import qualified, quote_ident, split_table
from txsink.ports.warehouse import ColumnInfo

DEFAULT_ENGINE = "MergeTree"
DEDUP_WINDOW_SETTING = "non_replicated_deduplication_window"
_ENGINE_RE = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*(\(.*\))?\s*$", re.DOTALL)
_SETTING_RE = re.compile(
    r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*=\s*('(?:[^'\\]|\\.)*'|[A-Za-z0-9_.+-]+)\s*$", re.DOTALL
)


def _one_clause(text: str, option: str) -> str:
    """``text`` stripped, if it is one SQL clause: parentheses balanced outside quotes and
    backquotes, every quote closed, no ``;``. ConfigError naming ``option`` otherwise."""
    depth = 0
    try:
        for _, ch in outside_quotes(text):
            depth += {"(": 1, ")": -1}.get(ch, 0)
            if ch == ";" or depth < 0:
                depth = -1
                break
    except ValueError:  # a quote left open
        depth = -1
    if depth:
        raise ConfigError(
            f"option {option}={text!r} is not one SQL clause (unbalanced parentheses or "
            "quotes, or a ';'); give the expression as it follows the keyword in "
            "CREATE TABLE"
        )
    return text.strip()


def check_engine(text: str, option: str = "engine") -> str:
    """``MergeTree``, ``ReplacingMergeTree(ver)``, ``ReplicatedMergeTree('/p', '{replica}')``:
    an engine of the MergeTree family with optional arguments; ConfigError otherwise."""
    m = _ENGINE_RE.match(text or "")
    args = m.group(2) if m else None
    if args and not _one_argument_list(args):
        m = None
    if not m or not m.group(1).endswith("MergeTree"):
        raise ConfigError(
            f"option {option}={text!r} must name a table engine of the MergeTree family, "
            "with its arguments if it takes any (MergeTree, ReplacingMergeTree(ver), "
            "ReplicatedMergeTree('/clickhouse/tables/{shard}/t', '{replica}')): txsink "
            "writes MergeTree tables only (attach mode moves their partitions, dedup mode "
            "relies on their block deduplication)"
        )
    return f"{m.group(1)}{args or ''}"


def _one_argument_list(text: str) -> bool:
    """Whether ``text`` is one parenthesised list: ``(a, 'b)')``, not ``(a) SETTINGS (b)``."""
    try:
        _one_clause(text, "engine")
        return closing_paren(text) == len(text) - 1
    except (ConfigError, ValueError):
        return False


def parse_table_settings(text: str, option: str = "table_settings") -> tuple[tuple[str, str], ...]:
    """``index_granularity=8192,storage_policy='s3'`` -> ``(("index_granularity", "8192"),
    ("storage_policy", "'s3'"))``: values as given (numbers, words, quoted strings)."""
    out: dict[str, str] = {}
    for part in split_top_level(text or ""):
        if not part:
            continue
        m = _SETTING_RE.match(part)
        if not m:
            raise ConfigError(
                f"option {option}: {part!r} is not name=value (comma-separated MergeTree "
                "settings, e.g. index_granularity=8192,storage_policy='s3'; quote text "
                "values with single quotes)"
            )
        if m.group(1) in out:
            raise ConfigError(f"option {option} names {m.group(1)} twice")
        out[m.group(1)] = m.group(2)
    return tuple(out.items())


def check_options(*, engine: str, order_by: str, partition_by: str, table_settings: str) -> None:
    """The creation options, checked when the config is parsed (before any query starts)."""
    check_engine(engine)
    for name, text in (("order_by", order_by), ("partition_by", partition_by)):
        if text:
            _one_clause(text, name)
    parse_table_settings(table_settings)


def _key(text: str, option: str) -> str:
    """A key clause: ``id, ts`` (a column list) becomes ``(id, ts)``."""
    text = _one_clause(text, option)
    return f"({text})" if len(split_top_level(text)) > 1 else text


def with_dedup_window(
    engine: str, settings: tuple[tuple[str, str], ...], min_window: int
) -> tuple[tuple[str, str], ...]:
    """``settings`` plus the dedup window dedup mode requires, where the engine is not
    replicated and the user named no window (a replicated table's default window, 1000
    or 10000 parts by server version, is already above dedup_min_window's default)."""
    if engine.startswith(("Replicated", "Shared")):
        return settings
    if any(k == DEDUP_WINDOW_SETTING for k, _ in settings):
        return settings
    return (*settings, (DEDUP_WINDOW_SETTING, str(min_window)))


def created_columns(fields: Sequence[tuple[str, Any, bool]]) -> list[ColumnInfo]:
    """The columns of a table created for ``fields`` (name, Spark JSON type, nullable),
    in the DataFrame's order."""
    return [
        ColumnInfo(name, created_type(spark, nullable, where=f"column {name}"))
        for name, spark, nullable in fields
    ]


def create_sql(
    table: str,
    columns: Sequence[ColumnInfo],
    *,
    engine: str = DEFAULT_ENGINE,
    order_by: str,
    partition_by: str = "",
    settings: Sequence[tuple[str, str]] = (),
) -> str:
    """``CREATE TABLE IF NOT EXISTS db.table (...) ENGINE = ... [PARTITION BY] ORDER BY ...
    [SETTINGS ...]``, every identifier quoted."""
    db, name = split_table(table)
    body = ",\n".join(f"    {quote_ident(c.name)} {c.type}" for c in columns)
    lines = [f"CREATE TABLE IF NOT EXISTS {qualified(db, name)}\n(\n{body}\n)"]
    lines.append(f"ENGINE = {check_engine(engine)}")
    if partition_by:
        lines.append(f"PARTITION BY {_key(partition_by, 'partition_by')}")
    lines.append(f"ORDER BY {_key(order_by, 'order_by')}")
    if settings:
        lines.append("SETTINGS " + ", ".join(f"{k} = {v}" for k, v in settings))
    return "\n".join(lines)


def plan_create(
    table: str,
    fields: Sequence[tuple[str, Any, bool]],
    *,
    engine: str,
    order_by: str,
    partition_by: str,
    table_settings: str,
    dedup_window: int | None,
) -> str:
    """The statement that creates ``table`` for a DataFrame of ``fields`` (name, Spark
    JSON type, nullable). ``dedup_window``: the window the table needs when the job will
    write it in dedup mode (None in attach mode). ConfigError naming the option that is
    missing or wrong; SchemaMismatch for a column no created type can hold."""
    if not order_by.strip():
        raise ConfigError(
            f"table {table} does not exist and create_table=if_missing needs option "
            "order_by to create it: the sorting key of the MergeTree table, e.g. "
            "order_by=id or order_by=customer_id,ts (tuple() for none). Nothing was written"
        )
    settings = parse_table_settings(table_settings)
    if not _nullable_keys_allowed(settings):
        keys = key_columns(order_by, partition_by)
        fields = [(n, spark, nullable and n not in keys) for n, spark, nullable in fields]
    columns = created_columns(fields)
    # nulls bound for a column that cannot be Nullable are refused value by value, as
    # validation does for any target: only the types are checked here
    problems = check_schema(
        [SparkField(name, _simple(spark), False) for name, spark, _ in fields],
        columns,
        table=table,
    )
    if problems:  # a created type the value contract would not take: a bug, said loudly
        raise SchemaMismatch(
            f"txsink cannot create {table} for this DataFrame:\n  - " + "\n  - ".join(problems)
        )
    if dedup_window is not None:
        settings = with_dedup_window(check_engine(engine), settings, dedup_window)
    return create_sql(
        table,
        columns,
        engine=engine,
        order_by=order_by,
        partition_by=partition_by,
        settings=settings,
    )


_NAME_RE = re.compile(r"'(?:[^'\\]|\\.)*'|`((?:[^`\\]|\\.)*)`|([A-Za-z_][A-Za-z0-9_]*)")


def key_columns(*keys: str) -> frozenset[str]:
    """The names the key expressions mention (plain or backquoted identifiers outside
    string literals): the columns a created table makes non-Nullable, since ClickHouse
    refuses Nullable key columns by default. A function name that is also a column's
    name counts too (that column then refuses nulls: safe, at worst strict)."""
    found: set[str] = set()
    for text in keys:
        for m in _NAME_RE.finditer(text or ""):
            if m.group(1) is not None:
                found.add(re.sub(r"\\(.)", r"\1", m.group(1)))
            elif m.group(2):
                found.add(m.group(2))
    return frozenset(found)


def _nullable_keys_allowed(settings: Sequence[tuple[str, str]]) -> bool:
    return any(
        k == "allow_nullable_key" and v.strip("'") not in ("0", "false") for k, v in settings
    )


def _simple(spark: str | Mapping[str, Any]) -> str:
    """Spark's ``simpleString()`` of a JSON type (what :mod:`.chtypes` parses)."""
    if not isinstance(spark, Mapping):
        return {"byte": "tinyint", "short": "smallint", "integer": "int", "long": "bigint"}.get(
            str(spark), str(spark)
        )
    kind = spark.get("type")
    if kind == "array":
        return f"array<{_simple(spark['elementType'])}>"
    if kind == "map":
        return f"map<{_simple(spark['keyType'])},{_simple(spark['valueType'])}>"
    if kind == "struct":
        inner = ",".join(f"{f['name']}:{_simple(f['type'])}" for f in spark.get("fields", ()))
        return f"struct<{inner}>"
    return str(kind)


# ------------------------------------------------------------------------- docs/types.md

# (the Spark type as docs/types.md spells it, its JSON form)
_CREATED_EXAMPLES: tuple[tuple[str, Any], ...] = (
    ("tinyint", "byte"),
    ("smallint", "short"),
    ("int", "integer"),
    ("bigint", "long"),
    ("float", "float"),
    ("double", "double"),
    ("decimal(10,2)", "decimal(10,2)"),
    ("decimal(38,0)", "decimal(38,0)"),
    ("boolean", "boolean"),
    ("string (char, varchar)", "string"),
    ("binary", "binary"),
    ("date", "date"),
    ("timestamp", "timestamp"),
    ("timestamp_ntz", "timestamp_ntz"),
    ("array<int> (elements may be null)",
     {"type": "array", "elementType": "integer", "containsNull": True}),
    ("array<int> (no null elements)",
     {"type": "array", "elementType": "integer", "containsNull": False}),
    ("map<string,int>", {"type": "map", "keyType": "string", "valueType": "integer",
                         "valueContainsNull": True}),
    ("struct<a:int,b:string>", {"type": "struct", "fields": [
        {"name": "a", "type": "integer", "nullable": True, "metadata": {}},
        {"name": "b", "type": "string", "nullable": False, "metadata": {}}]}),
    ("variant", "variant"),
    ("interval day to second", "interval day to second"),
    ("interval year to month", "interval year to month"),
    ("void", "void"),
)  # fmt: skip


def created_types_table() -> str:
    """docs/types.md's table of the column types ``create_table=if_missing`` chooses, for
    a nullable field (Spark's usual), with what the write then does, decided by the same
    code as the contract table."""
    from txsink.clickhouse.values import Check, Rule, plan_rules

    def say(rule: Rule) -> str:
        if rule.check is Check.NOT_NULL:
            if rule.path:
                return "nulls inside refused"
            kind = rule.ch_type.split("(", 1)[0]
            return f"null values refused ({kind} columns are created without Nullable)"
        return {
            Check.RANGE: "values outside the column's range refused",
            Check.VARIANT_JSON: "sent as its JSON text",
        }.get(rule.check, str(rule.check.value))

    lines = ["| Spark type | created as | what happens |", "|---|---|---|"]
    for shown, spark in _CREATED_EXAMPLES:
        try:
            ch = created_type(spark, True, where="c")
        except SchemaMismatch as exc:
            lines.append(f"| `{shown}` | (none) | refused: {str(exc).split(': ', 1)[-1]} |")
            continue
        rules = plan_rules([SparkField("c", _simple(spark), True)], [ColumnInfo("c", ch)])
        notes = list(dict.fromkeys(say(r) for r in rules))
        verdict = "exact" + (f"; {'; '.join(notes)}" if notes else "")
        code = f"`` {ch} ``" if "`" in ch else f"`{ch}`"  # a code span holding backquotes
        lines.append(f"| `{shown}` | {code} | {verdict.replace('|', chr(92) + '|')} |")
    return "\n".join(lines)
