"""The staging table of a ``Replicated*MergeTree`` target: its Keeper path and engine clause,
and the engine-clause text surgery they need.

Owned by the ClickHouse adapter; pure (no I/O). Invariants: a staging Keeper path is a
sibling of the target's, never inside it, and names one staging table; an engine clause
keeps the target's engine family (``MOVE PARTITION`` stays within one) and drops its TTL.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from txsink.clickhouse.sqltext import closing_paren, mask_quoted, split_top_level, sql_string
from txsink.ports.warehouse import TargetInfo

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
    masked = mask_quoted(rest)
    at = re.search(r"\sSETTINGS\s", masked)
    body, settings_text = (rest, "") if at is None else (rest[: at.start()], rest[at.end() :])
    ttl = re.search(r"\sTTL\s", mask_quoted(body))
    if ttl is not None:  # TTL is the last clause before SETTINGS
        body = body[: ttl.start()]
    settings = [
        kv for kv in split_top_level(settings_text)
        if kv and kv.split("=", 1)[0].strip() not in staging_settings
    ]  # fmt: skip
    settings += [f"{k} = {v}" for k, v in staging_settings.items()]
    engine_args = ", ".join([sql_string(keeper_path), sql_string(target.replica_name), *args])
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
