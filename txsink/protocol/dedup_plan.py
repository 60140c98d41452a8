"""One dedup task's partition as a protocol sequence, like the publish
(:mod:`txsink.protocol.sequence`): a generator that yields what to observe and what to do
next and receives each result through ``send()``; it returns what the partition amounted
to (:class:`Sent`) or that the attempt outlived its batch (:class:`Outlived`).

This module owns the *order* of a dedup task's reads and writes; the decisions are
:mod:`txsink.protocol.dedup`'s and :mod:`txsink.protocol.dedup_window`'s. The runner
(:func:`txsink.spark.dedup_write.run_plan`) owns every effect: it cuts and hashes the
blocks, holds the block in hand, reads the target's window, writes the partition's record
compare-and-set, asks the batch's seal, inserts, stamps the time and raises. Pure: no
I/O, no clock, no hashing.

Per block, in this order (each order is load-bearing)::

    NextBlock        -> the block's fingerprint (the runner hashed it), None at the end
    decide_block     REFUSE: RefuseContent; SKIP: next block (recorded AFTER)
    ObserveWindow    -> the target's block counter and window, read *after* the hash and
                     before the record write: only that write (a new block) or nothing (a
                     re-sent one) stands between this read and the insert, so other
                     writers' parts cannot slip past the window check in a hash's time
    window_step      a refusal: RefuseWindow (nothing sent)
    ProposeBefore    only for a block the record does not list yet; -> (written, the
                     record as it is now); a lost race decides the block again, after
                     the blocks already sent are checked against the winner's record
    CutNext          the block is recorded: the next one may be cut
    CheckSealed      before each insert, after this attempt's last record write (so not
                     staler than a commit that deleted the records): sealed -> Outlived
    InsertBlock      -> False if the batch was sealed while the block was retried (the
                     runner asks the seal again before each retry) -> Outlived
    FaultPoint       after block 0 (tests crash the executor mid-write here)

After the last block: ``decide_end``, then ProposeAfter (compare-and-set, the same
lost-race rule) and :class:`Sent`.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import Any

from txsink.protocol import dedup
from txsink.protocol import dedup_window as dw
from txsink.protocol.steps import FaultPoint


@dataclass(frozen=True)
class NextBlock:
    """-> :class:`~txsink.protocol.dedup.BlockFingerprint` of block ``index`` (the runner
    now holds it), or None once the partition is exhausted."""

    index: int


@dataclass(frozen=True)
class ObserveWindow:
    """-> ``(Mark, Window)`` of the target's dedup window, or None if it cannot be read."""


@dataclass(frozen=True)
class ProposeBefore:
    """-> ``(written, record)``: write a BEFORE record of ``blocks`` compare-and-set
    (stamped with the runner's clock); ``record`` is the partition's record after it
    (the winner's, if another attempt wrote first)."""

    blocks: tuple[dedup.BlockFingerprint, ...]
    attempt: int
    track: dw.Track | None


@dataclass(frozen=True)
class ProposeAfter:
    """-> ``(written, record)``: as :class:`ProposeBefore`, the AFTER record."""

    blocks: tuple[dedup.BlockFingerprint, ...]
    attempt: int
    track: dw.Track | None


@dataclass(frozen=True)
class CutNext:
    """Block ``index - 1`` is recorded: the runner may cut (and hash) block ``index``."""

    index: int


@dataclass(frozen=True)
class CheckSealed:
    """-> bool: is the task's batch prepared or committed (synced read)?"""


@dataclass(frozen=True)
class InsertBlock:
    """-> bool: insert the block in hand as block ``index``; False if the batch was sealed
    (the runner asks before each retry; the server checks the xid's seal row when the
    insert starts): nothing more may be sent. ``guard``: the window bounds the server
    checks when the insert starts (None where no window was observed)."""

    index: int
    guard: dw.Guard | None = None


@dataclass(frozen=True)
class RefuseContent:
    """Stop: the replay differs from the record (the runner raises ContentChanged)."""

    stored: dedup.PartitionState | None
    refusal: dedup.Refusal


@dataclass(frozen=True)
class RefuseWindow:
    """Stop: block ``index`` may not be recognised by the target's dedup window (the
    runner raises DedupWindowExceeded); nothing of it was sent."""

    index: int
    resend: bool
    window: dw.Window | None
    refusal: dw.WindowRefusal


@dataclass(frozen=True)
class Sent:
    """The partition is written and recorded AFTER."""

    done: tuple[dedup.BlockFingerprint, ...]
    inserted: int
    skipped: int
    rows: int
    decision: dedup.Decision


@dataclass(frozen=True)
class Outlived:
    """The batch was prepared or committed while this attempt ran: block ``index`` and
    the rest were not sent (``retried``: found while the block was retried)."""

    index: int
    retried: bool


DedupStep = (
    NextBlock
    | ObserveWindow
    | ProposeBefore
    | ProposeAfter
    | CutNext
    | CheckSealed
    | InsertBlock
    | FaultPoint
    | RefuseContent
    | RefuseWindow
)


def merge_track(ours: dw.Track | None, theirs: dw.Track | None) -> dw.Track | None:
    """This attempt's track, reconciled with the record's (which another attempt may have
    written): the record's first mark wins; the highest counter and block size seen too."""
    if theirs is None:
        return ours
    if ours is None or ours.first != theirs.first:
        return theirs
    return dw.Track(
        ours.first,
        ours.parts_window,
        ours.seconds_window,
        max(ours.seen, theirs.seen),
        max(ours.block_parts, theirs.block_parts),
    )


def write_partition(
    initial: dedup.PartitionState | None, attempt: int
) -> Generator[DedupStep, Any, Sent | Outlived]:
    """The sequence of one task attempt's partition, from its record as first read
    (``initial``; see the module doc for the order)."""
    stored = initial  # the record as this attempt last read or wrote it
    track: dw.Track | None = None  # this attempt's view of the window bookkeeping
    prev_counter: int | None = None
    guard: dw.Guard | None = None
    done: list[dedup.BlockFingerprint] = []
    inserted = skipped = rows = 0
    index = 0
    while True:
        fp = yield NextBlock(index)
        if fp is None:
            break
        while True:
            step = dedup.decide_block(stored, index, fp)
            if step.action is dedup.BlockAction.REFUSE and step.refusal is not None:
                yield RefuseContent(stored, step.refusal)
            if step.action is dedup.BlockAction.SKIP:
                break
            resend = stored is not None and index < len(stored.blocks)
            track = merge_track(track, stored.track if stored else None)
            guard = None
            observed = yield ObserveWindow()
            if observed is not None:
                now, window = observed
                verdict: dw.WindowRefusal | None = None
                if resend and stored is not None and stored.track is None:
                    verdict = dedup.unmarked(stored)
                else:
                    track, verdict = dw.window_step(
                        track, window, now, resend=resend, prev_counter=prev_counter
                    )
                if verdict is not None:
                    yield RefuseWindow(index, resend, window, verdict)
                if track is not None:  # always, past window_step
                    guard = dw.insert_guard(track, window, resend=resend)
                prev_counter = now.counter
            if not dedup.needs_before_record(stored, index):
                break
            written, stored = yield ProposeBefore((*done, fp), attempt, track)
            if written:
                break
            yield from _agree(stored, done)  # another attempt wrote first
        done.append(fp)
        yield CutNext(index + 1)
        if step.action is dedup.BlockAction.INSERT:
            if (yield CheckSealed()):
                return Outlived(index, retried=False)
            if not (yield InsertBlock(index, guard)):
                return Outlived(index, retried=True)
            inserted += 1
        else:
            skipped += 1
        rows += fp.rows
        if index == 0:
            yield FaultPoint("executor.mid_write")
        index += 1
    while True:
        refusal = dedup.decide_end(stored, len(done))
        if refusal is not None:
            yield RefuseContent(stored, refusal)
        final = merge_track(track, stored.track if stored else None)
        written, stored = yield ProposeAfter(tuple(done), attempt, final)
        if written:
            break
        yield from _agree(stored, done)
    decision = dedup.summarize(initial, inserted, skipped, len(done))
    return Sent(tuple(done), inserted, skipped, rows, decision)


def _agree(
    stored: dedup.PartitionState | None, done: Sequence[dedup.BlockFingerprint]
) -> Generator[DedupStep, Any, None]:
    """After a lost race: the blocks this attempt already sent must agree with the
    winner's record (else the source is not deterministic)."""
    mismatch = dedup.check_prefix(stored, done)
    if mismatch is not None:
        yield RefuseContent(stored, mismatch)
