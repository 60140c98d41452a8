"""Compatibility checks between a Spark DataFrame, a ClickHouse target and its staging.

A stable import point: the checks live in modules of one concern each, re-exported here
so callers keep one spelling:

- :mod:`txsink.ports.warehouse`: the records observed from the server (``TargetInfo``,
  ``ColumnInfo``, ``ClusterReplica``);
- :mod:`txsink.clickhouse.blockers`: attach/dedup blockers, move compatibility, column
  catch-up;
- :mod:`txsink.clickhouse.replicated_ddl`: a replicated target's staging engine clause;
- :mod:`txsink.clickhouse.chtypes`: type parsing and :func:`check_schema`;
- :mod:`txsink.clickhouse.insert_settings`: the settings txsink's inserts carry;
- :mod:`txsink.clickhouse.sqltext`: quote-aware scans of SQL text.

Everything here is pure (no I/O).
"""

from __future__ import annotations

from txsink.clickhouse.blockers import (
    VIEW_ENGINES,
    AddColumn,
    attach_blockers,
    check_move_compat,
    dedup_blockers,
    dedup_notes,
    dedup_window,
    plan_column_catch_up,
)
from txsink.clickhouse.chtypes import (
    NOT_INSERTABLE_KINDS,
    CHType,
    SparkField,
    SparkType,
    check_schema,
    parse_ch_type,
    parse_spark_type,
    unwrap,
)
from txsink.clickhouse.insert_settings import (
    DEDUP_INSERT_SETTINGS,
    OPTIONAL_INSERT_SETTINGS,
    STAGING_INSERT_SETTINGS,
    SettingValue,
    insert_settings_problems,
)
from txsink.clickhouse.replicated_ddl import (
    STAGING_KEEPER_SUFFIX,
    split_engine,
    staging_engine_clause,
    staging_keeper_path,
)
from txsink.clickhouse.sqltext import (
    closing_paren,
    split_top_level,
)
from txsink.ports.warehouse import (
    DEFAULT_WINDOW_SECONDS,
    MERGE_TREE_SUFFIX,
    WINDOW_SECONDS_KEY,
    ClusterReplica,
    ColumnInfo,
    TargetInfo,
)

__all__ = [
    "DEDUP_INSERT_SETTINGS",
    "DEFAULT_WINDOW_SECONDS",
    "MERGE_TREE_SUFFIX",
    "NOT_INSERTABLE_KINDS",
    "OPTIONAL_INSERT_SETTINGS",
    "STAGING_INSERT_SETTINGS",
    "STAGING_KEEPER_SUFFIX",
    "VIEW_ENGINES",
    "WINDOW_SECONDS_KEY",
    "AddColumn",
    "CHType",
    "ClusterReplica",
    "ColumnInfo",
    "SettingValue",
    "SparkField",
    "SparkType",
    "TargetInfo",
    "attach_blockers",
    "check_move_compat",
    "check_schema",
    "closing_paren",
    "dedup_blockers",
    "dedup_notes",
    "dedup_window",
    "insert_settings_problems",
    "parse_ch_type",
    "parse_spark_type",
    "plan_column_catch_up",
    "split_engine",
    "split_top_level",
    "staging_engine_clause",
    "staging_keeper_path",
    "unwrap",
]
