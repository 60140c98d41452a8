"""Pure compatibility checks between a Spark DataFrame, a ClickHouse target and its staging.

Owned by the ClickHouse adapter. No I/O: :mod:`txsink.clickhouse.warehouse` observes the
server (``system.tables``, ``system.columns``...) into the frozen records below and the
functions here decide. Invariants:

- every message names the table and, where there is one, the column, and says what to do;
- an empty list means "no problem found", never "not checked";
- :func:`attach_blockers` lists *every* reason ``MOVE PARTITION`` cannot publish into a
  target, so the driver can pick ``mode=dedup`` with one explanation;
- :func:`check_schema` returns errors; soft warnings (unsigned targets, precision loss the
  user probably intends) go to the optional ``notes`` list.

Spark types are spelled as ``DataType.simpleString()`` prints them (``bigint``,
``decimal(10,2)``, ``array<int>``, ``struct<a:int,b:string>``); ClickHouse types as
``system.columns.type`` prints them (``LowCardinality(Nullable(String))``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from txsink.protocol.dedup import Window

MERGE_TREE_SUFFIX = "MergeTree"
VIEW_ENGINES = frozenset({"View", "MaterializedView", "LiveView", "WindowView"})
# default_kind values of system.columns a DataFrame cannot (or need not) supply.
NOT_INSERTABLE_KINDS = frozenset({"MATERIALIZED", "ALIAS"})
WINDOW_SECONDS_KEY = "replicated_deduplication_window_seconds"
# Its default: 1 hour from ClickHouse 25.9, 1 week before. When the target's value is not
# known, the smaller one is assumed (a replay refused too early, never duplicated).
DEFAULT_WINDOW_SECONDS = 3600


@dataclass(frozen=True)
class ColumnInfo:
    name: str
    type: str
    default_kind: str = ""  # '' | DEFAULT | MATERIALIZED | ALIAS | EPHEMERAL
    default_expression: str = ""
    codec: str = ""  # system.columns.compression_codec, e.g. "CODEC(Delta(4), ZSTD(3))"


@dataclass(frozen=True)
class ClusterReplica:
    """One row of ``system.clusters``."""

    shard_num: int
    shard_weight: int
    replica_num: int
    host_name: str


@dataclass(frozen=True)
class SparkField:
    name: str
    type_string: str  # DataType.simpleString()
    nullable: bool = True


@dataclass(frozen=True)
class TargetInfo:
    """What txsink needs to know about one ClickHouse table (target or staging)."""

    database: str
    table: str
    engine: str
    engine_full: str = ""
    partition_key: str = ""
    sorting_key: str = ""
    primary_key: str = ""
    sampling_key: str = ""
    storage_policy: str = ""
    columns: tuple[ColumnInfo, ...] = ()
    dependent_views: tuple[str, ...] = ()  # "db.view" of materialized views reading it
    settings: Mapping[str, str] = field(default_factory=dict)
    skip_indices: tuple[str, ...] = ()  # "name TYPE type_full GRANULARITY n ON expr"
    projections: tuple[str, ...] = ()  # "name: query"
    table_ttl: bool = False  # a table-level TTL (rows are deleted by TTL merges)
    ttl_columns: tuple[str, ...] = ()  # columns with a column TTL (values reset)
    # Replicated*MergeTree only (system.replicas): the table's Keeper path and replica
    # name on the server txsink talks to, macros expanded; "" when not replicated
    zookeeper_path: str = ""
    replica_name: str = ""

    @property
    def name(self) -> str:
        return f"{self.database}.{self.table}"

    @property
    def is_replicated(self) -> bool:
        return self.engine.startswith(("Replicated", "Shared"))

    @property
    def has_dependent_views(self) -> bool:
        return bool(self.dependent_views)

    @property
    def is_merge_tree(self) -> bool:
        return self.engine.endswith(MERGE_TREE_SUFFIX)

    @property
    def dedup_window_setting(self) -> str:
        """The setting that sizes this table's insert dedup window (in parts)."""
        if self.is_replicated:
            return "replicated_deduplication_window"
        return "non_replicated_deduplication_window"

    @property
    def dedup_window(self) -> int:
        """Insert dedup window that applies to this table, in parts (0 = no dedup)."""
        try:
            return int(self.settings.get(self.dedup_window_setting, "0"))
        except ValueError:
            return 0

    @property
    def dedup_window_seconds(self) -> float | None:
        """How long a replicated table keeps dedup entries (None: no time limit)."""
        if not self.is_replicated:
            return None
        try:
            return float(self.settings.get(WINDOW_SECONDS_KEY, DEFAULT_WINDOW_SECONDS))
        except ValueError:
            return float(DEFAULT_WINDOW_SECONDS)


def dedup_window(info: TargetInfo) -> Window | None:
    """The window dedup mode checks every block against (see :mod:`txsink.protocol.dedup`);
    None where txsink cannot observe it (not a MergeTree: a Distributed target's shards)."""
    if not info.is_merge_tree:
        return None
    seconds = info.dedup_window_seconds
    return Window(
        parts=info.dedup_window,
        setting=info.dedup_window_setting,
        seconds=seconds,
        seconds_setting=WINDOW_SECONDS_KEY if seconds is not None else None,
    )


# --------------------------------------------------------------------------- blockers


def attach_blockers(info: TargetInfo) -> list[str]:
    """Every reason ``ALTER TABLE staging MOVE PARTITION ... TO TABLE target`` cannot be used.

    A target without a partition key is fine: all its rows live in partition id ``all``.
    """
    t = info.name
    remedy = "use mode=dedup (direct inserts with insert_deduplication_token)"
    out: list[str] = []
    if info.engine in VIEW_ENGINES:
        out.append(
            f"target {t} is a {info.engine}, not a table: write to the table it reads "
            f"from or stores into, or {remedy}"
        )
    elif info.engine == "Distributed":
        out.append(
            f"target {t} is a Distributed table: partitions can only be moved on each "
            f"shard's local table; point table= at the local MergeTree table or {remedy}"
        )
    elif not info.is_merge_tree:
        out.append(
            f"target {t} uses engine {info.engine}, which has no partitions to move "
            f"(MergeTree family only); {remedy}"
        )
    if info.engine.startswith("Shared"):
        out.append(
            f"target {t} uses {info.engine} (ClickHouse Cloud): txsink creates its staging "
            f"tables per replica, which SharedMergeTree has no notion of; {remedy}"
        )
    elif info.is_replicated and info.zookeeper_path and not info.zookeeper_path.startswith("/"):
        out.append(
            f"target {t} is replicated through the auxiliary ZooKeeper "
            f"{info.zookeeper_path.split(':', 1)[0]!r} ({info.zookeeper_path}); txsink's "
            f"staging for such tables is not built or tested yet; {remedy}"
        )
    elif info.is_replicated and not (info.zookeeper_path and info.replica_name):
        out.append(
            f"target {t} uses {info.engine} but system.replicas does not list it on this "
            f"server, so txsink cannot give its staging a Keeper path of its own: check the "
            f"server's <zookeeper> configuration, or {remedy}"
        )
    if info.dependent_views:
        views = ", ".join(info.dependent_views)
        out.append(
            f"target {t} feeds materialized view(s) {views}: MOVE PARTITION does not fire "
            f"them, so they would miss the rows; {remedy}"
        )
    return out


STAGING_KEEPER_SUFFIX = "_txsink_staging"


def staging_keeper_path(target: TargetInfo, staging_db: str, staging_table: str) -> str:
    """The Keeper path of the staging table of a replicated target: a sibling of the
    target's own path (``<target path>_txsink_staging/<staging db>/<staging table>``),
    never inside it, with the target's macros already expanded, so it is unique wherever
    the target's path is (each shard's, each cluster's) and names one staging table."""
    return f"{target.zookeeper_path}{STAGING_KEEPER_SUFFIX}/{staging_db}/{staging_table}"


def staging_engine_clause(
    target: TargetInfo, keeper_path: str, staging_settings: Mapping[str, object]
) -> str:
    """``ENGINE = ...`` for the staging table of a ``Replicated*MergeTree`` target.

    ``CREATE TABLE s AS target`` would copy the target's Keeper path and replica name,
    and fail (REPLICA_ALREADY_EXISTS) or, with a path built from ``{table}``, make
    staging a second replicated table nobody asked for. Staging must stay replicated
    (``MOVE PARTITION`` only moves within one engine family), so its engine is the
    target's with the first two arguments replaced by ``keeper_path`` and the target's
    replica name (other arguments, e.g. a Replacing version column, are kept), the
    target's keys, its settings overridden by ``staging_settings``, and no table TTL
    (staging keeps every row; removing it later would be an ALTER, which a replica
    that is read-only refuses). Columns, indices and projections come with ``AS``.
    """
    if not target.is_replicated:
        raise ValueError(f"{target.name} is not a replicated MergeTree: {target.engine_full!r}")
    name, args, rest = split_engine(target.engine_full)
    if len(args) >= 2 and all(a.startswith("'") for a in args[:2]):
        args = args[2:]
    masked = _mask_quoted(rest)
    at = re.search(r"\sSETTINGS\s", masked)
    body, settings_text = (rest, "") if at is None else (rest[: at.start()], rest[at.end() :])
    ttl = re.search(r"\sTTL\s", _mask_quoted(body))
    if ttl is not None:  # TTL is the last clause before SETTINGS
        body = body[: ttl.start()]
    settings = [
        kv for kv in split_top_level(settings_text)
        if kv and kv.split("=", 1)[0].strip() not in staging_settings
    ]  # fmt: skip
    settings += [f"{k} = {v}" for k, v in staging_settings.items()]
    engine_args = ", ".join([_sql_string(keeper_path), _sql_string(target.replica_name), *args])
    tail = f" SETTINGS {', '.join(settings)}" if settings else ""
    return f"ENGINE = {name}({engine_args}) {body.strip()}{tail}"


def split_engine(engine_full: str) -> tuple[str, list[str], str]:
    """``system.tables.engine_full`` cut into (engine name, its top-level arguments as
    written, the clauses after them); ValueError if it does not start with a name."""
    text = engine_full.strip()
    m = re.match(r"[A-Za-z0-9_]+", text)
    if not m:
        raise ValueError(f"not an engine clause: {text!r}")
    name, rest = m.group(0), text[m.end() :]
    args: list[str] = []
    if rest.lstrip().startswith("("):
        rest = rest.lstrip()
        end = closing_paren(rest)
        args = split_top_level(rest[1:end])
        rest = rest[end + 1 :]
    return name, args, rest


def closing_paren(text: str) -> int:
    """Index of the parenthesis closing the one ``text`` starts with (quote-aware)."""
    depth, quote, i = 0, "", 0
    while i < len(text):
        ch = text[i]
        if quote:
            if ch == "\\":
                i += 1
            elif ch == quote:
                quote = ""
        elif ch in "'`\"":
            quote = ch
        elif ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    raise ValueError(f"unbalanced parentheses in {text!r}")


def _mask_quoted(text: str) -> str:
    """``text`` with the inside of every quoted string blanked (same length), so keyword
    searches do not match inside literals."""
    return re.sub(r"'(?:[^'\\]|\\.)*'", lambda m: "'" + "_" * (len(m.group(0)) - 2) + "'", text)


def _sql_string(value: str) -> str:
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def dedup_blockers(
    info: TargetInfo, *, min_window: int = 1, view_tables: Sequence[TargetInfo] = ()
) -> list[str]:
    """Every reason ``mode=dedup`` (direct inserts with ``insert_deduplication_token``) is
    unsafe for this target.

    A replay of a batch interrupted mid-insert is only exactly-once if the target
    deduplicates blocks by token within a window of at least ``min_window`` inserts.
    ``view_tables`` are the tables the target's materialized views store into: txsink
    sends ``deduplicate_blocks_in_dependent_materialized_views=1`` with every block, but
    ClickHouse (checked on 26.9) deduplicates a view's block only in a view table that
    has a dedup window itself; with none, a replayed block is dropped from the target and
    counted again in the view. A Distributed target is not blocked: deduplication
    happens in the shards' local tables, which must have the window set (txsink cannot
    see them from here; see :func:`dedup_notes`).
    """
    t = info.name
    if info.engine in ("View", "LiveView", "WindowView"):
        return [f"target {t} is a {info.engine} and cannot be inserted into; write to its source"]
    if info.engine == "MaterializedView":
        return [
            f"target {t} is a materialized view; write to the table it reads from (or its "
            "TO table) instead"
        ]
    if info.engine == "Distributed":
        return []
    if not info.is_merge_tree:
        return [
            f"target {t} uses engine {info.engine}, which does not deduplicate inserts: a "
            "batch interrupted mid-insert would be duplicated on replay; use a MergeTree "
            "table"
        ]
    out = (
        [_window_blocker(f"target {t}", info, min_window)] if info.dedup_window < min_window else []
    )
    for view in view_tables:
        if not view.is_merge_tree:
            out.append(
                f"{view.name}, fed by a materialized view of {t}, uses engine {view.engine}, "
                "which does not deduplicate: a replayed block would be counted twice there; "
                "store the view into a MergeTree table"
            )
        elif view.dedup_window < min_window:
            out.append(
                _window_blocker(
                    f"{view.name} (fed by a materialized view of {t})", view, min_window
                )
                + ": without it a replayed block is deduplicated in the target but counted "
                "again in the view"
            )
    return out


def _window_blocker(what: str, info: TargetInfo, min_window: int) -> str:
    key = (
        "replicated_deduplication_window"
        if info.is_replicated
        else "non_replicated_deduplication_window"
    )
    return (
        f"{what} has {key}={info.dedup_window} (< {min_window}): a replayed block "
        f"would not be deduplicated; run ALTER TABLE {info.name} MODIFY SETTING "
        f"{key} = {max(min_window, 100)}"
    )


def dedup_notes(info: TargetInfo) -> list[str]:
    """What dedup mode relies on but cannot check (logged as warnings, not refused)."""
    if info.is_merge_tree:
        window = dedup_window(info)
        if window is None or window.seconds is None:
            return []
        return [
            f"target {info.name} is replicated: ClickHouse forgets its dedup tokens after "
            f"{WINDOW_SECONDS_KEY}={window.seconds:.0f} s, so a batch interrupted mid-insert "
            f"must be replayed within that time (minus a margin) of its first insert, or the "
            "replay is refused with DedupWindowExceeded"
        ]
    if info.engine != "Distributed":
        return []
    return [
        f"target {info.name} is Distributed: txsink inserts with insert_distributed_sync=1 "
        "(distributed_foreground_insert) so a block is on the shards when acknowledged; "
        "every shard's local table must be a MergeTree with a dedup window "
        "(non_replicated_/replicated_deduplication_window) and its sharding key must be "
        "deterministic (not rand()), or a replayed block lands on another shard and is "
        "not recognised; the shards' windows (parts and seconds) are not checked either"
    ]


def check_move_compat(staging: TargetInfo, target: TargetInfo) -> str | None:
    """The first difference that would make MOVE PARTITION fail or publish incomplete parts.

    ClickHouse 26.9 itself rejects different columns, keys and extra staging indices, but
    accepts a staging *without* the target's indices/projections (the moved parts then
    lack them) and a different engine: this check is stricter and demands equality.
    """
    pairs: list[tuple[str, object, object]] = [
        ("engine", staging.engine, target.engine),
        ("columns", _col_sig(staging), _col_sig(target)),
        ("partition key", staging.partition_key, target.partition_key),
        ("sorting key", staging.sorting_key, target.sorting_key),
        ("primary key", staging.primary_key, target.primary_key),
        ("sampling key", staging.sampling_key, target.sampling_key),
        ("storage policy", staging.storage_policy, target.storage_policy),
        ("skip indices", staging.skip_indices, target.skip_indices),
        ("projections", staging.projections, target.projections),
    ]
    for what, mine, theirs in pairs:
        if mine != theirs:
            return (
                f"staging table {staging.name} differs from target {target.name} in its "
                f"{what} ({mine!r} vs {theirs!r}); drop the staging table and retry, or "
                f"use mode=dedup"
            )
    return None


def _col_sig(info: TargetInfo) -> tuple[tuple[str, str], ...]:
    return tuple((c.name, c.type) for c in info.columns)


@dataclass(frozen=True)
class AddColumn:
    """One column staging lacks: add ``column`` after ``after`` (None: FIRST)."""

    column: ColumnInfo
    after: str | None


def plan_column_catch_up(
    staging: TargetInfo, target: TargetInfo
) -> tuple[list[AddColumn], str | None]:
    """How to bring a staging table in line with a target altered after it was created.

    Only one change is repaired: the target *gained* columns (``ALTER TABLE ... ADD
    COLUMN``, at any position). Staged parts lack them and the target computes their
    DEFAULT (or MATERIALIZED/ALIAS expression) on read, exactly as for its own older
    parts. Returns ``(additions, None)``, or ``([], problem)`` for every other
    difference: a column dropped or renamed in the target (staged values would be
    lost: refused, the operator decides), a changed type, order or key, another engine.
    """
    t = target.name
    have = {c.name: c for c in staging.columns}
    want = {c.name: c for c in target.columns}
    gone = [c.name for c in staging.columns if c.name not in want]
    if gone:
        return [], (
            f"target {t} no longer has column(s) {', '.join(gone)} that staging table "
            f"{staging.name} holds (dropped or renamed after the batch was staged); txsink "
            f"does not drop staged values: add the column(s) back to {t} (ALTER TABLE {t} "
            f"ADD COLUMN ...), run `txsink recover`, then drop them again "
            f"(docs/operations.md#target-altered)"
        )
    retyped = [
        f"{n} ({have[n].type} -> {want[n].type})" for n in have if have[n].type != want[n].type
    ]
    if retyped:
        return [], (
            f"column type(s) of target {t} changed after the batch was staged in "
            f"{staging.name}: {', '.join(retyped)}; restore the old type(s) on {t}, run "
            f"`txsink recover`, then change them again (docs/operations.md#target-altered)"
        )
    order = [c.name for c in target.columns if c.name in have]
    if order != [c.name for c in staging.columns]:
        return [], (
            f"the columns of target {t} were reordered after the batch was staged in "
            f"{staging.name}; restore the order, run `txsink recover` "
            f"(docs/operations.md#target-altered)"
        )
    additions: list[AddColumn] = []
    prev: str | None = None
    for col in target.columns:
        if col.name not in have:
            additions.append(AddColumn(col, prev))
        prev = col.name
    caught_up = TargetInfo(
        database=staging.database,
        table=staging.table,
        engine=staging.engine,
        partition_key=staging.partition_key,
        sorting_key=staging.sorting_key,
        primary_key=staging.primary_key,
        sampling_key=staging.sampling_key,
        storage_policy=staging.storage_policy,
        columns=target.columns,
        skip_indices=staging.skip_indices,
        projections=staging.projections,
    )
    problem = check_move_compat(caught_up, target)
    if problem:
        return [], (
            f"{problem.split('; ')[0]}: target {t} was altered after the batch was staged; "
            f"only added columns are repaired automatically: restore the target, run "
            f"`txsink recover` (docs/operations.md#target-altered)"
        )
    return additions, None


# --------------------------------------------------------------------------- type parsing


@dataclass(frozen=True)
class CHType:
    """A parsed ClickHouse type: ``name(args...)``; args are nested types or literals."""

    name: str
    args: tuple[str, ...] = ()

    def arg_type(self, i: int) -> CHType:
        return parse_ch_type(_strip_element_name(self.args[i]))


def split_top_level(s: str, sep: str = ",") -> list[str]:
    """Split on ``sep`` outside parentheses, angle brackets and quotes."""
    parts: list[str] = []
    depth = 0
    quote: str | None = None
    cur: list[str] = []
    i = 0
    while i < len(s):
        ch = s[i]
        if quote:
            cur.append(ch)
            if ch == "\\" and i + 1 < len(s):
                cur.append(s[i + 1])
                i += 1
            elif ch == quote:
                quote = None
        elif ch in "'`\"":
            quote = ch
            cur.append(ch)
        elif ch in "(<":
            depth += 1
            cur.append(ch)
        elif ch in ")>":
            depth -= 1
            cur.append(ch)
        elif ch == sep and depth == 0:
            parts.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
        i += 1
    tail = "".join(cur).strip()
    if tail or parts:
        parts.append(tail)
    return parts


def parse_ch_type(s: str) -> CHType:
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
_SPARK_INT_BITS = {"tinyint": 8, "byte": 8, "smallint": 16, "short": 16, "int": 32,
                   "integer": 32, "bigint": 64, "long": 64}  # fmt: skip
_DECIMAL_MAX_P = {"Decimal32": 9, "Decimal64": 18, "Decimal128": 38, "Decimal256": 76}
_STRINGISH = {"string", "char", "varchar"}


@dataclass
class _Verdict:
    error: str | None = None
    notes: list[str] = field(default_factory=list)


def _decimal_ps(t: CHType) -> tuple[int, int] | None:
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
    bad = _Verdict(f"{s} does not fit {_fmt(ch)}")
    if s in _SPARK_INT_BITS:
        bits = _SPARK_INT_BITS[s]
        if n in _SIGNED and _SIGNED[n] >= bits:
            return v
        if n in _UNSIGNED and _UNSIGNED[n] >= bits:
            v.notes.append(
                f"{where}: {s} into unsigned {n}: negative values will not fit; "
                "make sure the column holds none"
            )
            return v
        if n in _SIGNED or n in _UNSIGNED:
            return _Verdict(f"{s} is wider than {n}; widen the column or cast in Spark")
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
        ps = _decimal_ps(ch)
        if ps is None:
            return bad
        cp, cs = ps
        if cp - cs >= p - sc and cs >= sc:
            return v
        return _Verdict(
            f"decimal({p},{sc}) does not fit {_fmt(ch)}: need at least {p - sc} integer "
            f"and {sc} fractional digits; widen the column or cast in Spark"
        )
    if s in _STRINGISH:
        if n == "String":
            return v
        if n == "FixedString":
            v.notes.append(f"{where}: string into {_fmt(ch)}: longer values will be rejected")
            return v
        if n == "UUID":
            v.notes.append(f"{where}: string into UUID: every value must be a UUID")
            return v
        if n in ("Enum8", "Enum16", "Enum"):
            v.notes.append(f"{where}: string into {n}: values outside the enum are rejected")
            return v
        return bad
    if s == "binary":
        if n == "String":
            return v
        if n == "FixedString":
            v.notes.append(f"{where}: binary into {_fmt(ch)}: longer values will be rejected")
            return v
        return bad
    if s in ("timestamp", "timestamp_ntz"):
        if n == "DateTime64":
            try:
                prec = int(ch.args[0]) if ch.args else 3
            except ValueError:
                prec = 3
            if prec < 6:
                v.notes.append(
                    f"{where}: Spark timestamps have microseconds; {_fmt(ch)} keeps {prec} "
                    "fractional digits"
                )
            if s == "timestamp_ntz":
                v.notes.append(f"{where}: timestamp_ntz is read in the column's time zone")
            return v
        if n == "DateTime":
            v.notes.append(
                f"{where}: {s} into DateTime truncates to whole seconds; use DateTime64(6) "
                "to keep them"
            )
            return v
        return bad
    if s == "date":
        if n == "Date32":
            return v
        if n == "Date":
            v.notes.append(f"{where}: Date holds 1970-01-01..2149-06-06; Date32 holds more")
            return v
        return bad
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
                f"struct with {len(spark.fields)} fields does not fit {_fmt(ch)}; "
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
    if s in ("void", "null"):
        return v
    return _Verdict(f"Spark type {s} is not supported by txsink; cast it in Spark")


def _nested(spark: SparkType, ch: CHType, where: str) -> _Verdict:
    v = _compatible(spark, ch, where)
    if v.error:
        v.error = f"{where}: {v.error}"
    return v


def _fmt(t: CHType) -> str:
    return f"{t.name}({', '.join(t.args)})" if t.args else t.name


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


# --------------------------------------------------------------------------- insert settings

# Settings txsink sends with its inserts. The 26.x spelling deduplicate_insert overrides
# insert_deduplicate (and async_insert_deduplicate) whatever those say, so both are sent;
# OPTIONAL_INSERT_SETTINGS are sent only where the server's system.settings lists them.
#
# Staging: no block deduplication (two identical slices of one task are two slices; a
# replicated staging keeps the target's replicated_deduplication_window), no async
# buffering (26.x enables it by default: rows must be in parts when the insert returns),
# no merging of rows on insert (Replacing/Summing/... semantics belong to the target), no
# limit on partitions per block (txsink owns the table: a backfill task spanning more
# than 100 days must not be refused on every retry).
STAGING_INSERT_SETTINGS: dict[str, Any] = {
    "insert_deduplicate": 0,
    "deduplicate_insert": "disable",
    "async_insert": 0,
    "optimize_on_insert": 0,
    "max_partitions_per_insert_block": 0,
}
# Dedup mode: every block deduplicated by its token, synchronously (a block acknowledged
# is in parts, so BEFORE/AFTER records mean what they say), in dependent views too, and
# through a Distributed table into the shards' local tables. The partition limit is
# lifted as for staging: blocks are cut by row count only (their tokens must not depend on
# anything else), each part a block makes is counted by the dedup-window guard, and a
# refused block would wedge the query on every replay.
DEDUP_INSERT_SETTINGS: dict[str, Any] = {
    "insert_deduplicate": 1,
    "deduplicate_insert": "enable",
    "async_insert": 0,
    # without it a replayed block is dropped from the target but its materialized
    # views receive it again (checked on chdb 26.9: tests/integration/test_dedup_mode.py)
    "deduplicate_blocks_in_dependent_materialized_views": 1,
    # Distributed targets: insert synchronously into the shards, whose local tables
    # deduplicate; harmless for other engines (alias of distributed_foreground_insert)
    "insert_distributed_sync": 1,
    "max_partitions_per_insert_block": 0,
}
OPTIONAL_INSERT_SETTINGS = ("deduplicate_insert",)
# What breaks which guarantee, for the messages of insert_settings_problems.
_WHY = {
    "insert_deduplicate": "block deduplication",
    "deduplicate_insert": "block deduplication (26.x: overrides insert_deduplicate)",
    "async_insert": "synchronous inserts (rows in parts when the insert returns)",
    "optimize_on_insert": "staging keeps every row sent",
    "max_partitions_per_insert_block": "blocks spanning many partitions (backfills)",
    "deduplicate_blocks_in_dependent_materialized_views": "deduplication in views",
    "insert_distributed_sync": "synchronous inserts through a Distributed table",
}


@dataclass(frozen=True)
class SettingValue:
    """One row of ``system.settings`` as the writer's user sees it."""

    name: str
    value: str
    changed: bool  # differs from the server default (a profile, the user, the server)
    readonly: bool  # a constraint forbids changing it
    min: str | None = None
    max: str | None = None


def insert_settings_problems(
    effective: Mapping[str, SettingValue],
    wanted: Mapping[str, Any],
    *,
    user: str,
    mode: str,
) -> list[str]:
    """Why the writer's user cannot run txsink's inserts with ``wanted`` (its
    effective ``system.settings``: profile, user and server defaults applied).

    txsink sends every setting it relies on with each insert, so a profile *default*
    (``deduplicate_insert='disable'``, ``async_insert=1``) is overridden and fine; what
    breaks the guarantee is a profile that forbids the override: ``readonly`` (1: no
    setting may change; 2: no writes), a constraint that makes a setting read-only or
    const at another value, or min/max bounds that exclude the value txsink needs.
    ``effective`` lacks settings the server does not know (they are not sent)."""
    problems: list[str] = []
    how = (
        f"change the settings profile of user {user} (or its settings constraints) or "
        f"write as another user"
    )
    ro = effective.get("readonly")
    if ro is not None and ro.value not in ("0", ""):
        problems.append(
            f"user {user} has readonly={ro.value}: "
            + ("no setting may be changed" if ro.value == "1" else "it may not write")
            + f"; {how}"
        )
    for name, value in wanted.items():
        have = effective.get(name)
        if have is None:
            continue
        need = str(value)
        why = _WHY.get(name, "the exactly-once guarantee")
        if have.readonly and not _same_setting(have.value, need):
            problems.append(
                f"{name}={have.value} is fixed for user {user} (a read-only/const settings "
                f"constraint), but {mode} mode needs {name}={need} for {why}; {how}"
            )
        elif not _within(need, have.min, have.max):
            problems.append(
                f"{name} is bounded to [{have.min or '-'}, {have.max or '-'}] for user {user}, "
                f"but {mode} mode needs {name}={need} for {why}; {how}"
            )
    return problems


def _same_setting(have: str, need: str) -> bool:
    norm = {"true": "1", "false": "0"}
    return norm.get(have.lower(), have.lower()) == norm.get(need.lower(), need.lower())


def _within(value: str, low: str | None, high: str | None) -> bool:
    try:
        v = float(value)
        return (low is None or float(low) <= v) and (high is None or v <= float(high))
    except ValueError:
        return True  # not numeric: bounds do not apply
