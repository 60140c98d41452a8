"""The settings txsink sends with its inserts, and why a user's profile may forbid them.

Owned by the ClickHouse adapter; pure (no I/O). Invariant: every setting txsink relies on
is sent with each insert, so only a profile that forbids the override is a problem.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

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
