"""Pure decisions of ``visibility=batch``: a reader sees a batch of a table whole or not at all.

Mechanism (per target table of an xid): every task's staged partitions are first moved
(``MOVE PARTITION``, invisible to readers) into one *batch staging* table of the xid
(:func:`txsink.protocol.ids.batch_staging_name`), then published by one
``ALTER TABLE target ATTACH PARTITION ALL FROM batch_staging``: on non-replicated MergeTree
ClickHouse commits every cloned part under one lock, so a reader sees all of them or none
(measured by ``tests/integration/test_visibility.py``). ATTACH copies (hard links), so it is
not idempotent and leaves the batch staging full; it is dropped right after.

Every step is decided from observations only by the one publish planner
(:func:`txsink.protocol.planner.plan_batch_publish`: the per-partition checks of
:func:`~txsink.protocol.planner.plan_publish`, with the batch staging as the sink), with
part UUIDs (kept by MOVE and ATTACH) as the
evidence of what already happened:

- consolidation (PREPARED, batch staging missing or partly filled): a manifest partition
  still in its task staging with its full count is moved into the batch staging, unless
  every one of its parts is there already (a server crash inside MOVE left the source); a
  partition with no rows left must show one of its recorded UUIDs in the batch staging;
  the plan then stops (``Reobserve``): the attach is planned from a fresh look;
- claim (every manifest partition of the table is in the batch staging, counts equal,
  none of its part UUIDs in the target): ``RENAME`` the batch staging to this finisher's
  own name (:class:`ClaimBatch`), wait until no statement on the xid's staging runs,
  re-observe;
- attach (claimed): none of the batch staging's part UUIDs in the target and no finished
  ATTACH of this xid into it in ``system.query_log``: attach, then drop the batch
  staging; all of them, or the log entry: an earlier ATTACH landed (drop only); some of
  the UUIDs: an Alarm;
- batch staging missing under every name and every task staging partition empty with
  UUIDs: counted as published only with the query log's proof (the batch staging is
  dropped after COMMITTED; a missing one is a rename seen half-way: look again).

Two finishers of one xid (a takeover and ``txsink recover --force``, two recoverers, a
superseded driver) can never both ATTACH: each attaches only from the name it renamed the
table to, after it saw the server quiet and found no evidence (part UUIDs, which a merge
in the target removes, or the ATTACH's ``log_comment`` in ``system.query_log``, which it
does not). The window that remains (docs/modes.md#visibility): the *server* crashing
within its log flush interval after an ATTACH committed, the driver dying before it
recorded COMMITTED, and the target merging the attached parts and cleaning up the
replaced ones before the roll-forward looks.
"""

from __future__ import annotations

from collections.abc import Mapping

from txsink.protocol.states import Mode, XidRecord

__all__ = [
    "batch_refusal",
    "compaction",
    "is_batch",
]


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


def is_batch(record: XidRecord) -> bool:
    return record.mode is Mode.ATTACH and record.batch_visible


def compaction(engine: str, sizes: Mapping[str, int], limit: int) -> bool:
    """Whether a batch staging is merged into one part per partition (``OPTIMIZE ...
    FINAL``) before its ATTACH: only on a plain ``MergeTree`` target, whose merges keep
    every row as it is (the Replacing, Summing, Aggregating, Collapsing families' merges
    change rows: they keep their parts, and the target merges them as it always does),
    and only while every partition of the batch stages at most ``limit`` bytes (``sizes``:
    bytes on disk per partition id; ``limit`` 0: never), so that the merge stays a small
    part of the commit."""
    return limit > 0 and engine == "MergeTree" and bool(sizes) and max(sizes.values()) <= limit
