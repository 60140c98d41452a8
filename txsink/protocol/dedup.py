"""Dedup mode's per-partition state machine (pure: no I/O, no clock, no hashing).

In dedup mode executors insert straight into the target in deterministic blocks, each
with ``insert_deduplication_token = dedup_token(job, xid, partition, block)``. Keeper keeps,
per (xid, Spark partition), a :class:`PartitionState` under ``dedup/<xid>/p<partition>``
(the ClickHouse Kafka Connect BEFORE/AFTER machine, with offsets replaced by block
fingerprints because a Spark partition has no offsets)::

    (absent) -> BEFORE   before block k is sent, ``blocks`` lists the fingerprints of
                         blocks 0..k: every block that *may* have landed is recorded
    BEFORE   -> BEFORE   the next block is about to be sent (the list grows by one)
    BEFORE   -> AFTER    every block of the partition was acknowledged
    (absent) -> AFTER    an attempt whose blocks were all skipped or that found the
                         previous attempt's record complete (never written for an
                         empty partition: it inserts nothing, so there is nothing to
                         recognise)
    AFTER    -> AFTER    a replay that matched (SAME) does not write again
    any      -> (gone)   the driver deletes ``dedup/<xid>`` once the xid is COMMITTED

Decisions for an incoming partition (blocks ``I``) against the stored state (blocks ``S``)
-- :func:`decide_partition`; ``a <= b`` means "a is a prefix of b"::

    stored  relation of I and S            decision    what the executor does
    ------  -----------------------------  ----------  -----------------------------------
    none    (anything)                     NEW         insert every block; BEFORE before
                                                       each block, AFTER after the last
    AFTER   I == S                         SAME        insert nothing (all already landed)
    AFTER   I < S (strict prefix)          CONTAINED   refuse: ContentChanged (blocks
                                                       len(I).. landed but are not in I)
    AFTER   S < I (strict prefix)          OVERLAP     refuse: ContentChanged (a batch's
                                                       content is fixed; more rows is new
                                                       content under an old xid)
    AFTER   I[k] != S[k] for some k        CHANGED     refuse at the first such k
    BEFORE  S <= I                         RESUME      re-insert every block with the same
                                                       tokens: ClickHouse drops those that
                                                       landed, sends the rest
    BEFORE  I < S (strict prefix)          CONTAINED   refuse: recorded blocks beyond I may
                                                       have landed
    BEFORE  I[k] != S[k] for some k        CHANGED     refuse at the first such k: block k
                                                       may have landed with other content

Refusal reports the first offending block index: the first differing block for
CHANGED, ``len(S)`` for OVERLAP (the first block the record lacks), ``len(I)`` for
CONTAINED (the first recorded block the replay lacks).

An executor learns its blocks one at a time while streaming, so the same table is
applied block by block with :func:`decide_block` (for each incoming block, in order) and
:func:`decide_end` (once the stream ended); the property tests prove that the block-wise
walk inserts exactly the blocks and refuses exactly where :func:`decide_partition` does.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


class Status(enum.StrEnum):
    BEFORE = "BEFORE"
    AFTER = "AFTER"


class Decision(enum.StrEnum):
    NEW = "NEW"
    SAME = "SAME"
    RESUME = "RESUME"
    CONTAINED = "CONTAINED"
    OVERLAP = "OVERLAP"
    CHANGED = "CHANGED"

    @property
    def refuses(self) -> bool:
        return self in (Decision.CONTAINED, Decision.OVERLAP, Decision.CHANGED)


class BlockAction(enum.StrEnum):
    INSERT = "INSERT"
    SKIP = "SKIP"
    REFUSE = "REFUSE"


@dataclass(frozen=True)
class BlockFingerprint:
    """One deterministic block: its index in the partition, its rows and a content digest."""

    index: int
    rows: int
    digest: str

    def to_json(self) -> list[Any]:
        return [self.index, self.rows, self.digest]

    @staticmethod
    def from_json(data: Sequence[Any]) -> BlockFingerprint:
        index, rows, digest = data
        return BlockFingerprint(int(index), int(rows), str(digest))


@dataclass(frozen=True)
class PartitionState:
    """What Keeper holds for one (xid, Spark partition) in dedup mode."""

    status: Status
    blocks: tuple[BlockFingerprint, ...]
    rows: int
    attempt: int
    updated_at: float

    def to_json(self) -> dict[str, Any]:
        return {
            "status": self.status.value,
            "blocks": [b.to_json() for b in self.blocks],
            "rows": self.rows,
            "attempt": self.attempt,
            "updated_at": self.updated_at,
        }

    @staticmethod
    def from_json(data: Mapping[str, Any] | None) -> PartitionState | None:
        if not data:
            return None
        return PartitionState(
            status=Status(data["status"]),
            blocks=tuple(BlockFingerprint.from_json(b) for b in data.get("blocks", ())),
            rows=int(data.get("rows", 0)),
            attempt=int(data.get("attempt", 0)),
            updated_at=float(data.get("updated_at", 0.0)),
        )


def before(blocks: Sequence[BlockFingerprint], attempt: int, now: float) -> PartitionState:
    """The BEFORE record written before the last of ``blocks`` is sent."""
    return PartitionState(Status.BEFORE, tuple(blocks), sum(b.rows for b in blocks), attempt, now)


def after(blocks: Sequence[BlockFingerprint], attempt: int, now: float) -> PartitionState:
    """The AFTER record written once every one of ``blocks`` was acknowledged."""
    return PartitionState(Status.AFTER, tuple(blocks), sum(b.rows for b in blocks), attempt, now)


def partition_key(xid: str, partition: int) -> str:
    """Blob key of one partition's state (``<root>/jobs/<job>/dedup/<xid>/p<n>``)."""
    return f"dedup/{xid}/p{partition}"


def xid_key(xid: str) -> str:
    """Blob key of all partition states of one xid (deleted after COMMITTED)."""
    return f"dedup/{xid}"


@dataclass(frozen=True)
class Refusal:
    """Why a replay cannot be written: its decision, the block and what differs."""

    decision: Decision
    block: int
    detail: str


@dataclass(frozen=True)
class PartitionPlan:
    """The whole-partition decision: which block indexes to send, or a refusal."""

    decision: Decision
    insert: tuple[int, ...] = ()
    refusal: Refusal | None = None


@dataclass(frozen=True)
class BlockStep:
    action: BlockAction
    refusal: Refusal | None = None


def _describe(stored: BlockFingerprint, incoming: BlockFingerprint) -> str:
    if stored.rows != incoming.rows:
        return f"recorded {stored.rows} rows, the replay has {incoming.rows}"
    return f"same {stored.rows} rows but digest {incoming.digest} instead of {stored.digest}"


def _first_difference(
    stored: Sequence[BlockFingerprint], incoming: Sequence[BlockFingerprint]
) -> int | None:
    for k in range(min(len(stored), len(incoming))):
        if stored[k] != incoming[k]:
            return k
    return None


def decide_partition(
    stored: PartitionState | None, incoming: Sequence[BlockFingerprint]
) -> PartitionPlan:
    """The decision for a whole incoming partition (see the table in the module doc)."""
    everything = tuple(b.index for b in incoming)
    if stored is None:
        return PartitionPlan(Decision.NEW, everything)
    s = stored.blocks
    k = _first_difference(s, incoming)
    if k is not None:
        return PartitionPlan(
            Decision.CHANGED,
            refusal=Refusal(
                Decision.CHANGED, k, f"block {k} changed: {_describe(s[k], incoming[k])}"
            ),
        )
    if stored.status is Status.AFTER and len(incoming) > len(s):
        return PartitionPlan(Decision.OVERLAP, refusal=_overlap(stored))
    if len(incoming) < len(s):
        return PartitionPlan(Decision.CONTAINED, refusal=_contained(stored, len(incoming)))
    if stored.status is Status.AFTER:
        return PartitionPlan(Decision.SAME)
    return PartitionPlan(Decision.RESUME, everything)


def _overlap(stored: PartitionState) -> Refusal:
    n = len(stored.blocks)
    return Refusal(
        Decision.OVERLAP,
        n,
        f"the replay goes on past block {n - 1 if n else 'none'}: the recorded, complete "
        f"attempt had {n} block(s) with {stored.rows} rows and the replay has more",
    )


def _contained(stored: PartitionState, n: int) -> Refusal:
    landed = "landed" if stored.status is Status.AFTER else "may have landed"
    return Refusal(
        Decision.CONTAINED,
        n,
        f"the replay ended after {n} block(s), but {len(stored.blocks)} block(s) with "
        f"{stored.rows} rows were recorded ({stored.status.value}); blocks {n}.. {landed}",
    )


def decide_block(stored: PartitionState | None, index: int, block: BlockFingerprint) -> BlockStep:
    """The decision for block ``index`` of a streaming partition (blocks come in order)."""
    if stored is None:
        return BlockStep(BlockAction.INSERT)
    s = stored.blocks
    if index < len(s):
        if s[index] != block:
            return BlockStep(
                BlockAction.REFUSE,
                Refusal(
                    Decision.CHANGED,
                    index,
                    f"block {index} changed: {_describe(s[index], block)}",
                ),
            )
        return BlockStep(BlockAction.SKIP if stored.status is Status.AFTER else BlockAction.INSERT)
    if stored.status is Status.AFTER:
        return BlockStep(BlockAction.REFUSE, _overlap(stored))
    return BlockStep(BlockAction.INSERT)


def decide_end(stored: PartitionState | None, n_blocks: int) -> Refusal | None:
    """After the last block: a refusal if the replay lacks recorded blocks, else None."""
    if stored is not None and n_blocks < len(stored.blocks):
        return _contained(stored, n_blocks)
    return None


def needs_before_record(stored: PartitionState | None, index: int) -> bool:
    """Whether a BEFORE record listing block ``index`` must be written before sending it.

    Blocks the stored record already lists (RESUME) are covered by it; every other block
    must be recorded first, so that a replay can verify any block that may have landed.
    """
    return stored is None or index >= len(stored.blocks)


def summarize(
    stored: PartitionState | None, inserted: int, skipped: int, n_blocks: int
) -> Decision:
    """The whole-partition decision a block-wise walk amounted to (for logs/metrics)."""
    if stored is None:
        return Decision.NEW
    if stored.status is Status.AFTER and skipped == n_blocks:
        return Decision.SAME
    return Decision.RESUME
