"""Pure decisions of ``visibility=batch``: a reader sees a batch of a table whole or not at all.

Mechanism (per target table of an xid): every task's staging table is copied (``ATTACH
PARTITION ALL FROM``, hard links, invisible to readers) into one *batch staging* table of
the xid in one statement (:func:`txsink.protocol.ids.batch_staging_name`), or, where
:func:`compaction` says so, its rows inserted there in one part per partition (one
``INSERT ... SELECT``, which refuses tables of different columns), then published by
one ``ALTER TABLE target ATTACH PARTITION ALL FROM batch_staging``: on non-replicated
MergeTree ClickHouse commits every cloned part under one lock, so a reader sees all of
them or none (measured by ``tests/integration/test_visibility.py``). The statements are
the same whatever the number of tasks. ATTACH copies, so it is not idempotent; the task
staging stays whole until COMMITTED, and everything is dropped then.

A fresh commit runs straight through (:func:`txsink.protocol.sequence.fresh_batch`:
the batch staging is created under the committing finisher's own name, the epoch checked
before the ATTACH). Every other finisher decides every step from observations only, by
the one publish planner (:func:`txsink.protocol.planner.plan_batch_publish`), with part
UUIDs (kept by copies, MOVE and ATTACH) as the evidence of what already happened:

- build (PREPARED, task staging whole): a batch staging that is not exactly the task
  staging's parts (a copy cut short, or doubled by a late one) was never attached and is
  built again, only ever under the name no finisher attaches from;
- claim: ``RENAME`` the batch staging to this finisher's own name (:class:`ClaimBatch`),
  wait until no statement on the xid's staging runs, re-observe; other copies with rows
  (*twins*) are dropped after the fence check, their parts then looked for in the target;
- attach (claimed): none of the batch staging's part UUIDs in the target and no finished
  ATTACH of this xid into it in ``system.query_log``: attach, then drop the batch
  staging; all of them, or the log entry: an earlier ATTACH landed (drop only); some of
  the UUIDs: an Alarm;
- a record consolidated by MOVE (an older txsink: task partitions emptied) keeps its
  rules: a missing batch staging is published only with the query log's proof.

Two finishers of one xid (a takeover and ``txsink recover --force``, two recoverers, a
superseded driver) can never both ATTACH: each attaches only from a name it holds, after
its fence check, and a finisher that took over later renames that table away and waits
out an ATTACH already sent before it looks for evidence (part UUIDs, which a merge in the
target removes, or the ATTACH's ``log_comment`` in ``system.query_log``, which it does
not). The window that remains (docs/modes.md#visibility): the *server* crashing within
its log flush interval after an ATTACH committed, the driver dying before it recorded
COMMITTED, and the target merging the attached parts and cleaning up the replaced ones
before the roll-forward looks; or a hand dropping the attached batch staging then.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence

from txsink.protocol.ops import BatchShape, Gathered
from txsink.protocol.states import Mode, StagedPart, XidRecord

__all__ = [
    "ATTACH_PRIVILEGES",
    "batch_refusal",
    "compaction",
    "gather_fits",
    "gathering",
    "grant_refusal",
    "is_batch",
]

# What ClickHouse checks for ALTER TABLE target ATTACH PARTITION ... FROM source (in
# InterpreterAlterQuery, as REPLACE_PARTITION): these on the target, SELECT on the source.
# A partition-visibility writer has INSERT already (MOVE PARTITION ... TO TABLE asks INSERT
# on the target, SELECT and ALTER DELETE on the source): ALTER DELETE is the one it lacks.
ATTACH_PRIVILEGES = "ALTER DELETE, INSERT"
_PLAIN_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def batch_refusal(table: str, engine: str, mode: str) -> str:
    """Why ``visibility=batch`` cannot be honoured for ``table`` ("" when it can).

    ATTACH PARTITION ALL commits every part under one lock only on non-replicated
    MergeTree; a replicated table fetches parts replica by replica and a Distributed one
    has no parts; dedup mode inserts block by block."""
    if mode != "attach":
        return (
            f"visibility=batch needs attach mode, but {table} is written in {mode} mode "
            f"(rows are visible block by block); use visibility=partition or make the target "
            f"fit attach mode (docs/modes.md)"
        )
    if not engine.endswith("MergeTree") or engine.startswith(("Replicated", "Shared")):
        return (
            f"visibility=batch needs a non-replicated MergeTree target, {table} is {engine}: "
            f"one ATTACH PARTITION ALL is atomic for readers only there; use "
            f"visibility=partition (docs/modes.md#visibility)"
        )
    return ""


# what a server older than ClickHouse 24.9 answers the probe of the batch publish with
ATTACH_ALL_UNSUPPORTED = (
    "this server does not run ALTER TABLE ... ATTACH PARTITION ALL FROM (ClickHouse 24.9 "
    "and newer do)"
)


def grant_refusal(table: str, user: str, staging_db: str, server_says: str) -> str:
    """Why ``visibility=batch`` cannot publish into ``table``: the writer's ``user`` may
    not run its ``ATTACH PARTITION ALL FROM`` (``server_says``: the server's refusal of
    that statement), with the GRANT that allows it; or that the server cannot run it."""
    if server_says.startswith(ATTACH_ALL_UNSUPPORTED):
        return (
            f"visibility=batch publishes into {table} with one ALTER TABLE {table} ATTACH "
            f"PARTITION ALL FROM <a batch staging table>, but {server_says}; use "
            f"visibility=partition, or upgrade the server (docs/install.md#clickhouse-versions)"
        )
    return (
        f"visibility=batch publishes into {table} with one ALTER TABLE {table} ATTACH "
        f"PARTITION ALL FROM <a batch staging table in {staging_db}>, which user {user} may "
        f"not run ({server_says}): it needs the privilege ALTER DELETE on {table}, with "
        f"INSERT there and SELECT on {staging_db}.* (which publishing by MOVE needs too). "
        f"Run GRANT {ATTACH_PRIVILEGES} ON {table} TO {_grantee(user)} (or to a role of "
        f"the user's), or use visibility=partition (docs/modes.md#visibility)"
    )


def _grantee(user: str) -> str:
    return user if _PLAIN_NAME_RE.match(user) else "`" + user.replace("`", "\\`") + "`"


def is_batch(record: XidRecord) -> bool:
    return record.mode is Mode.ATTACH and record.batch_visible


# a gather names every task staging table and every column of each: beyond these its
# statement nears the server's parser limits (max_query_size 256 KiB; query plans of
# thousands of UNION branches): such a batch is copied part by part instead
MAX_GATHER_TABLES = 200
MAX_GATHER_SQL = 192 * 1024


def gather_fits(tables: int, columns: Sequence[str]) -> bool:
    """Whether a batch of ``tables`` task staging tables storing ``columns`` can be
    gathered in one statement (:data:`MAX_GATHER_TABLES`, :data:`MAX_GATHER_SQL`);
    no columns known: it cannot."""
    fits = _gather_sql(tables, columns) <= MAX_GATHER_SQL
    return bool(columns) and 0 < tables <= MAX_GATHER_TABLES and fits


def _gather_sql(tables: int, columns: Sequence[str]) -> int:
    """About how long a gather's SQL is (quoted names, separators, SELECT ... FROM s)."""
    return tables * (sum(len(c) + 4 for c in columns) + 64)


def gathering(
    engine: str,
    found: Sequence[StagedPart],
    columns: Sequence[str],
    sizes: Mapping[str, int],
    limit: int,
    shape: BatchShape | None = None,
) -> Gathered | None:
    """How the fresh publish fills one target's batch staging, from the commit's one
    read: gathered (:func:`gather_fits`, :func:`compaction`; ``found``: the manifest's
    parts of the target), and made by the same statement where the target's ``shape``
    is known and its CREATE fits the statement too; None: its parts are copied."""
    tables = len({p.table for p in found})
    if not gather_fits(tables, columns):
        return None
    if not compaction(engine, sizes, limit, parts_per_partition(found)):
        return None
    if shape is not None and _gather_sql(tables, columns) + len(shape.ddl) > MAX_GATHER_SQL:
        shape = None
    return Gathered(tuple(columns), sum(sizes.values()), shape)


def parts_per_partition(parts: Iterable[StagedPart]) -> dict[str, int]:
    """How many parts each partition id has over every task's staging (what decides
    whether compaction would change anything): one evidence id per part; an entry without
    any (a part without a UUID) counts as several, so that it is merged."""
    count: dict[str, int] = {}
    for p in parts:
        count[p.partition_id] = count.get(p.partition_id, 0) + (len(p.uuids) or 2)
    return count


def compaction(
    engine: str, sizes: Mapping[str, int], limit: int, parts: Mapping[str, int] | None = None
) -> bool:
    """Whether a batch is gathered into one part per partition before its ATTACH (its
    rows inserted into the batch staging, not its parts copied): only on a plain
    ``MergeTree`` target, where parts merged keep every row as it is (the Replacing,
    Summing, Aggregating, Collapsing families' merges change rows: they keep their parts,
    and the target merges them as it always does), only while every partition of the
    batch stages at most ``limit`` bytes (``sizes``: bytes on disk per partition id;
    ``limit`` 0: never), so that rewriting the rows stays a small part of the commit,
    and only when some partition has more than one part (``parts``: parts per partition
    id over every task's staging; None: not known)."""
    if parts is not None and max(parts.values(), default=0) <= 1:
        return False  # one part per partition already: copies are cheaper
    return limit > 0 and engine == "MergeTree" and bool(sizes) and max(sizes.values()) <= limit
