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
                         (an attempt that outlives its batch finds it gone: it sends
                         no block once :func:`txsink.protocol.job.is_sealed` says so)

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

Two more rules, each with its table: :func:`~txsink.protocol.dedup_window.window_step`
(before every block sent, whether the target's dedup window still recognises the
partition's recorded blocks and has room for the next; in its own module) and
:func:`check_successor` (every record write is compare-and-set and may only append;
"Record writes" further down).

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

from txsink.protocol.dedup_window import (
    Track,
    WindowProblem,
    WindowRefusal,
)

# the window rule lives in its own module; its names are part of this one's too
__all__ = [
    "BlockAction",
    "BlockFingerprint",
    "BlockStep",
    "Decision",
    "OpenBatch",
    "PartitionPlan",
    "PartitionState",
    "Refusal",
    "Status",
    "WriteVerdict",
    "after",
    "before",
    "check_prefix",
    "check_successor",
    "decide_block",
    "decide_end",
    "decide_partition",
    "needs_before_record",
    "open_batch",
    "partition_key",
    "summarize",
    "unmarked",
    "xid_key",
]


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
    track: Track | None = None  # the dedup-window bookkeeping (see "The dedup window")

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "status": self.status.value,
            "blocks": [b.to_json() for b in self.blocks],
            "rows": self.rows,
            "attempt": self.attempt,
            "updated_at": self.updated_at,
        }
        if self.track is not None:
            out["window"] = self.track.to_json()
        return out

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
            track=Track.from_json(data.get("window")),
        )


def before(
    blocks: Sequence[BlockFingerprint], attempt: int, now: float, track: Track | None = None
) -> PartitionState:
    """The BEFORE record written before the last of ``blocks`` is sent."""
    rows = sum(b.rows for b in blocks)
    return PartitionState(Status.BEFORE, tuple(blocks), rows, attempt, now, track)


def after(
    blocks: Sequence[BlockFingerprint], attempt: int, now: float, track: Track | None = None
) -> PartitionState:
    """The AFTER record written once every one of ``blocks`` was acknowledged."""
    rows = sum(b.rows for b in blocks)
    return PartitionState(Status.AFTER, tuple(blocks), rows, attempt, now, track)


@dataclass(frozen=True)
class OpenBatch:
    """An xid's dedup records as a whole, for an xid that has no PREPARED or COMMITTED
    record: a batch stopped half-way (or still in flight). The rows of its recorded
    blocks may be in the target; the last block of a BEFORE record may not have landed,
    hence a range."""

    xid: str
    partitions: int  # Spark partitions with a record
    finished: int  # of them, AFTER: every block acknowledged
    rows_at_least: int
    rows_at_most: int

    def describe(self) -> str:
        rows = (
            f"{self.rows_at_most} row(s)"
            if self.rows_at_least == self.rows_at_most
            else f"{self.rows_at_least} to {self.rows_at_most} row(s)"
        )
        return f"{rows} from {self.partitions} Spark partition(s), {self.finished} of them finished"


def open_batch(xid: str, states: Sequence[PartitionState]) -> OpenBatch:
    """The summary of ``xid``'s partition records (see :class:`OpenBatch`)."""
    least = most = 0
    for s in states:
        most += s.rows
        pending = s.blocks[-1].rows if s.status is Status.BEFORE and s.blocks else 0
        least += s.rows - pending
    finished = sum(1 for s in states if s.status is Status.AFTER)
    return OpenBatch(xid, len(states), finished, least, most)


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


def check_prefix(stored: PartitionState | None, done: Sequence[BlockFingerprint]) -> Refusal | None:
    """After re-reading a record another attempt changed: the blocks this attempt already
    sent must still agree with it (else the source is not deterministic)."""
    if stored is None:
        return None
    k = _first_difference(stored.blocks, done)
    if k is None:
        return None
    return Refusal(
        Decision.CHANGED, k, f"block {k} changed: {_describe(stored.blocks[k], done[k])}"
    )


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


def unmarked(stored: PartitionState) -> WindowRefusal:
    n = len(stored.blocks)
    return WindowRefusal(
        WindowProblem.UNMARKED, 0, 0, False,
        f"the BEFORE record of {n} block(s) has no window track (written by an older "
        "txsink), so whether their tokens are still remembered cannot be told",
    )  # fmt: skip


# --------------------------------------------------------------------------- record writes
#
# Records are written compare-and-set (on the Keeper node's version); a writer that loses
# re-reads and decides its block again. :func:`check_successor` is the rule every write
# obeys, whoever wrote the current record (a speculative twin, a zombie attempt):
#
#   current   proposed                              verdict
#   -------   ------------------------------------  -------------------------------------
#   none      anything                              WRITE
#   any       a listed block with other content     REFUSE (rewrite)
#   any       fewer blocks                          REFUSE (shrink)
#   any       another first mark in its track       REFUSE (would hide window use)
#   BEFORE    BEFORE, same blocks                   NOOP
#   BEFORE    BEFORE, the blocks plus more          WRITE (append)
#   BEFORE    AFTER, same blocks                    WRITE
#   BEFORE    AFTER, more blocks                    REFUSE (a block sent unrecorded)
#   AFTER     AFTER, same blocks                    NOOP
#   AFTER     anything else                         REFUSE (complete is final)


class WriteVerdict(enum.StrEnum):
    WRITE = "WRITE"
    NOOP = "NOOP"
    REFUSE = "REFUSE"


def check_successor(
    current: PartitionState | None, proposed: PartitionState
) -> tuple[WriteVerdict, str]:
    """Whether ``proposed`` may replace ``current`` (see the table above); why not."""
    if current is None:
        return WriteVerdict.WRITE, ""
    cur, new = current.blocks, proposed.blocks
    k = _first_difference(cur, new)
    if k is not None:
        return WriteVerdict.REFUSE, f"it would rewrite recorded block {k}"
    if len(new) < len(cur):
        return WriteVerdict.REFUSE, (
            f"it would shrink the record from {len(cur)} to {len(new)} block(s)"
        )
    if current.track is not None and (
        proposed.track is None or proposed.track.first != current.track.first
    ):
        return WriteVerdict.REFUSE, "it would replace the mark of the partition's first block"
    if current.status is Status.AFTER:
        if proposed.status is Status.AFTER and len(new) == len(cur):
            return WriteVerdict.NOOP, ""
        return WriteVerdict.REFUSE, f"the record is complete (AFTER, {len(cur)} block(s))"
    if proposed.status is Status.AFTER and len(new) > len(cur):
        return WriteVerdict.REFUSE, (
            f"AFTER would list {len(new)} block(s) but only {len(cur)} were recorded BEFORE "
            "being sent"
        )
    if proposed.status is Status.BEFORE and len(new) == len(cur):
        return WriteVerdict.NOOP, ""
    return WriteVerdict.WRITE, ""
