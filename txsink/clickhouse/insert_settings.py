"""The settings txsink sends with its inserts, why a user's profile may forbid them, and
which settings a user may add (writer options ``settings.<name>``).

Owned by the ClickHouse adapter; pure (no I/O). Invariants: every setting txsink relies on
is sent with each insert, so only a profile that forbids the override is a problem; this
module is the one place that decides which settings a user may not pass
(:func:`refused_setting`), and txsink's own values win over a user's in every insert.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from txsink.options import closest

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
    # views receive it again (tests/integration/test_dedup_mode.py checks it)
    "deduplicate_blocks_in_dependent_materialized_views": 1,
    # Distributed targets: insert synchronously into the shards, whose local tables
    # deduplicate; harmless for other engines (alias of distributed_foreground_insert)
    "insert_distributed_sync": 1,
    "max_partitions_per_insert_block": 0,
    # a block is sent as INSERT ... SELECT FROM input() (its seal and window checked on
    # the server): 26.x's default skips deduplicating an INSERT SELECT it does not find
    # "stable", and force_enable refuses it (26.2 before ClickHouse PR 99206, whatever
    # the token); with this value the block's token decides, as for a plain INSERT
    "deduplicate_insert_select": "enable_even_for_bad_queries",
}
OPTIONAL_INSERT_SETTINGS = ("deduplicate_insert", "deduplicate_insert_select")
# The publish of visibility=batch: its ATTACH PARTITION ALL goes into system.query_log
# with the batch's tag as log_comment, whatever the user's profile says about logging
# (the proof that it landed once the target merged its parts). A profile constraint on
# any of them would refuse every ATTACH after PREPARE, where neither the writer nor
# `txsink recover` can finish the batch: validation checks them before anything is
# staged (:func:`statement_settings_problems`). log_comment's value here stands for
# every tag (a constraint allows one only where it equals the profile's value).
ATTACH_LOG_SETTINGS: dict[str, Any] = {
    "log_queries": 1,
    "log_comment": "txsink",
    "log_queries_min_type": "QUERY_START",
    "log_queries_min_query_duration_ms": 0,
    "log_queries_probability": 1,
}
# The INSERT that gathers a batch's task staging into its batch staging (visibility=batch,
# a plain MergeTree below compact_bytes): staging's insert settings, and the MATERIALIZED
# columns written with the values staging holds (never computed again).
GATHER_SETTINGS: dict[str, Any] = {
    **STAGING_INSERT_SETTINGS,
    "insert_allow_materialized_columns": 1,
}
# The gather that creates its batch staging from the target's CREATE text (CREATE TABLE
# ... AS SELECT): the column list is read again under the writer's session, where these
# would make it another table than the target (Nested flattened, every type Nullable)
CREATE_GATHER_SETTINGS: dict[str, Any] = {
    **GATHER_SETTINGS,
    "flatten_nested": 0,
    "data_type_default_nullable": 0,
}
# Every write of the state store with state=clickhouse (txsink.keeper.keepermap): strict
# mode is the compare-and-set; a node's value travels hex-encoded inside the statement
# (room for a 1 MiB node, twice over). The COMMITTED record is such a write.
KEEPERMAP_SETTINGS: dict[str, Any] = {
    "keeper_map_strict_mode": 1,
    "max_query_size": 8 * 1024 * 1024,
}


def after_prepare_settings(
    mode: str, visibility: str, state: str
) -> list[tuple[str, str, Mapping[str, Any]]]:
    """The settings txsink sends with statements other than inserts that run after a
    batch is PREPARED, for :func:`statement_settings_problems`: (what sends them, the
    way around a constraint that forbids them, the settings)."""
    out: list[tuple[str, str, Mapping[str, Any]]] = []
    if mode == "attach" and visibility == "batch":
        out.append(
            (
                "the ATTACH that publishes a batch (visibility=batch)",
                "use visibility=partition",
                ATTACH_LOG_SETTINGS,
            )
        )
        out.append(
            (
                "the INSERT that gathers a batch into one part per partition (visibility=batch)",
                "set compact_bytes=0 or use visibility=partition",
                {"insert_allow_materialized_columns": 1},
            )
        )
    if state == "clickhouse":
        out.append(
            (
                "every write of the state store (state=clickhouse)",
                "start the job with state=keeper",
                KEEPERMAP_SETTINGS,
            )
        )
    return out


# What breaks which guarantee, for the messages of insert_settings_problems and
# refused_setting.
_WHY = {
    "insert_deduplicate": "block deduplication",
    "deduplicate_insert": "block deduplication (26.x: overrides insert_deduplicate)",
    "async_insert": "synchronous inserts (rows in parts when the insert returns)",
    "optimize_on_insert": "staging keeps every row sent",
    "max_partitions_per_insert_block": "blocks spanning many partitions (backfills)",
    "deduplicate_blocks_in_dependent_materialized_views": "deduplication in views",
    "insert_distributed_sync": "synchronous inserts through a Distributed table",
}


# --------------------------------------------------------------------------- user settings

# Settings a user may not pass with ``settings.<name>``: what each decides that txsink must
# own. Four families: txsink's own insert settings and the others that decide
# deduplication or synchronous inserts (the guarantee); block boundaries (txsink cuts
# blocks itself: a dedup token names one block, and a server that re-split or squashed
# blocks would give a replay other blocks); values (docs/types.md: a row is stored as sent
# or refused before it is sent, never altered by the server); the connection's own
# parameters (clickhouse-connect sends them per request), which are no insert's settings.
_DEDUP = "block deduplication"
_SYNC = "synchronous inserts (rows in parts when the insert returns)"
_VIEWS = "deduplication in materialized views"
_OWNED: dict[str, str] = {
    "insert_deduplicate": _DEDUP,
    "deduplicate_insert": _DEDUP + " (26.x: overrides insert_deduplicate)",
    "insert_deduplication_token": "each block's identity (dedup mode sets one per block)",
    "async_insert": _SYNC,
    "wait_for_async_insert": _SYNC,
    "async_insert_deduplicate": _DEDUP + " of async inserts",
    "optimize_on_insert": "staging keeping every row sent (the target's engine applies later)",
    "max_partitions_per_insert_block": "blocks spanning many partitions (backfills)",
    "deduplicate_blocks_in_dependent_materialized_views": _VIEWS,
    "update_insert_deduplication_token_in_dependent_materialized_views": _VIEWS,
    "materialized_views_ignore_errors": "views receiving every row (errors not dropped)",
    "insert_distributed_sync": "synchronous inserts through a Distributed table",
    "distributed_foreground_insert": "synchronous inserts through a Distributed table",
    "insert_distributed_one_random_shard": (
        "deduplication through a Distributed table (a replayed block must reach the shard "
        "that has seen its token)"
    ),
}
_BLOCKS = "the blocks txsink cuts (a dedup token names one block)"
_VALUES = "the values stored (docs/types.md: every value is checked before it is sent)"
_COLUMNS = "which column a value goes to (docs/types.md: the schema is checked first)"
_CONNECTION = "the connection txsink opens, not the insert"
_FAMILIES: dict[str, tuple[str, tuple[str, ...]]] = {
    _BLOCKS: (
        "size blocks with the options block_rows / block_bytes",
        (
            "max_insert_block_size",
            "max_insert_block_size_rows",
            "max_insert_block_size_bytes",
            "min_insert_block_size_rows",
            "min_insert_block_size_bytes",
            "min_insert_block_size_rows_for_materialized_views",
            "min_insert_block_size_bytes_for_materialized_views",
            "use_strict_insert_block_limits",
        ),
    ),
    _VALUES: (
        "txsink refuses a value ClickHouse would alter before sending it: leave it out",
        (
            "input_format_null_as_default",
            "insert_null_as_default",
            "input_format_defaults_for_omitted_fields",
            "input_format_force_null_for_omitted_fields",
            "input_format_allow_errors_num",
            "input_format_allow_errors_ratio",
            "date_time_overflow_behavior",
        ),
    ),
    _COLUMNS: (
        "name the DataFrame's columns as the table's: leave it out",
        (
            "input_format_arrow_allow_missing_columns",
            "input_format_arrow_case_insensitive_column_matching",
            "input_format_skip_unknown_fields",
            "insert_allow_materialized_columns",
        ),
    ),
    _CONNECTION: (
        "use the writer options (compress, connect_timeout, send_receive_timeout)",
        (
            "session_id",
            "session_timeout",
            "session_check",
            "query_id",
            "database",
            "default_format",
            "compress",
            "decompress",
            "enable_http_compression",
            "send_progress_in_http_headers",
            "http_headers_progress_interval_ms",
        ),
    ),
}
_OWNED_FIX = "txsink sends its own value with every insert that needs it: leave it out"


def refused_settings() -> dict[str, tuple[str, str]]:
    """Every setting a user may not pass: name -> (what it decides, what to do instead).
    The one list (:func:`refused_setting`, docs/options.md's table)."""
    out = {n: (why, _OWNED_FIX) for n, why in _OWNED.items()}
    for name in (*STAGING_INSERT_SETTINGS, *DEDUP_INSERT_SETTINGS):  # txsink's own, always
        out.setdefault(name, (_WHY.get(name, "the exactly-once guarantee"), _OWNED_FIX))
    for why, (fix, names) in _FAMILIES.items():
        out.update((n, (why, fix)) for n in names)
    return out


_REFUSED = refused_settings()


def refused_setting(name: str) -> str | None:
    """Why a user may not pass ClickHouse setting ``name`` to txsink's inserts and what to
    do instead, or None when it may be passed."""
    if name not in _REFUSED:
        return None
    why, fix = _REFUSED[name]
    return f"{name} decides {why}, which txsink owns; {fix}"


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
        why = _WHY.get(name, "the exactly-once guarantee")
        need = f"{mode} mode needs {name}={value} for {why}"
        problem = _constraint(have, str(value), user, need, how)
        if problem:
            problems.append(problem)
    return problems


def statement_settings_problems(
    effective: Mapping[str, SettingValue],
    wanted: Mapping[str, Any],
    *,
    user: str,
    sender: str,
    fix: str,
) -> list[str]:
    """Why ``user`` cannot send ``wanted`` with statements other than inserts (``sender``
    names them, e.g. "the ATTACH of visibility=batch"), by the constraint rules of
    :func:`insert_settings_problems`; ``fix``: the way around it that needs no profile
    change."""
    how = f"{fix}, or relax the settings constraints of user {user}'s profile"
    problems = []
    for name, value in wanted.items():
        have = effective.get(name)
        if have is not None:
            problem = _constraint(have, str(value), user, f"{sender} sends {name}={value!r}", how)
            if problem:
                problems.append(problem)
    return problems


def passthrough_problems(
    effective: Mapping[str, SettingValue],
    given: Mapping[str, str],
    *,
    user: str,
    known: Iterable[str] = (),
) -> list[str]:
    """Why the settings a user passes (``settings.<name>``, :func:`refused_setting`
    already applied) cannot be sent, judged by the rules of
    :func:`insert_settings_problems`: a name the server does not know (with the closest
    of ``known``, the server's setting names), a value a settings constraint of ``user``
    forbids."""
    problems: list[str] = []
    how = f"change the value, or the settings profile/constraints of user {user}"
    names = list(known)
    for name, value in given.items():
        have = effective.get(name)
        if have is None:
            match = closest(name, names) if names else None
            hint = f" (did you mean {match}?)" if match else ""
            problems.append(
                f"option settings.{name}: the server has no setting {name}{hint}; "
                f"setting names are case-sensitive (system.settings lists them)"
            )
            continue
        problem = _constraint(have, value, user, f"option settings.{name} asks for {value!r}", how)
        if problem:
            problems.append(problem)
    return problems


def _constraint(have: SettingValue, need: str, user: str, asked: str, how: str) -> str | None:
    """Why ``user`` cannot set ``have.name`` to ``need`` (None: it can)."""
    name = have.name
    if have.readonly and not _same_setting(have.value, need):
        return (
            f"{name}={have.value} is fixed for user {user} (a read-only/const settings "
            f"constraint), but {asked}; {how}"
        )
    if not _within(need, have.min, have.max):
        return (
            f"{name} is bounded to [{have.min or '-'}, {have.max or '-'}] for user {user}, "
            f"but {asked}; {how}"
        )
    return None


def _same_setting(have: str, need: str) -> bool:
    norm = {"true": "1", "false": "0"}
    return norm.get(have.lower(), have.lower()) == norm.get(need.lower(), need.lower())


def _within(value: str, low: str | None, high: str | None) -> bool:
    try:
        v = float(value)
        return (low is None or float(low) <= v) and (high is None or v <= float(high))
    except ValueError:
        return True  # not numeric: bounds do not apply
