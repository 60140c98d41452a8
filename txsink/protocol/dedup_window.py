"""The dedup window rule of dedup mode (pure): whether the target still recognises a
partition's recorded blocks and has room for the next one (:func:`window_step`).

This module owns the window bookkeeping a partition's record carries (:class:`Track`)
and the check run before every block; :mod:`txsink.protocol.dedup` owns the records
themselves.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# --------------------------------------------------------------------------- the dedup window
#
# ClickHouse remembers the last N insert *parts* of a table (N = the target's
# ``non_replicated_deduplication_window`` / ``replicated_deduplication_window``; a block
# spanning k partitions makes k parts, each with its own entry), and replicated tables also
# forget entries older than ``replicated_deduplication_window_seconds``. A block re-sent
# after its entries were forgotten is inserted again. ClickHouse does not show the log, so
# the executor bounds it from the outside:
#
# - the target's *block counter* (:class:`Mark`): every inserted part takes a new block
#   number, so the counter's advance since a partition's first block bounds the entries
#   added since (from above: deduplicated inserts, merges of mutations, ATTACH... advance
#   it too). Non-replicated tables number blocks per table: the counter is the highest
#   block number; replicated tables number them per partition: the counter is the sum over
#   partitions of (highest block number + 1);
# - the server's clock, for the time window.
#
# :func:`window_step` runs before *every* block a partition sends (new or re-sent):
#
#   check       condition                                              refusal
#   ----------  -----------------------------------------------------  ---------
#   backwards   counter >= the highest counter seen before             BACKWARDS
#   past        used <= min(window at the previous check, window now)  EVICTED
#               (and elapsed <= the same for seconds, replicated)
#   future      used + next + margin <= window now                     NO_ROOM
#               (and elapsed + margin_s <= seconds now, replicated)
#
# where ``used`` = counter now - counter before the partition's first block, ``next`` =
# 0 for a block the record lists (its entries must still be there; re-sending it adds
# none), else the most parts one block of this attempt was seen to take (at least 1), and
# the margins leave room for inserts racing the check: ``window // 10`` parts and
# ``max(60 s, seconds / 10)``. EVICTED means a recorded block may no longer be recognised:
# re-sending it could duplicate, and raising the window cannot bring the entries back.
# NO_ROOM before a new block means the partition would outgrow the window and a crash
# would leave it unrecoverable; stopping first keeps it resumable once the window is
# raised. A BEFORE record without a track (written by an older txsink) is UNMARKED.

WINDOW_MARGIN_DIVISOR = 10
MIN_SECONDS_MARGIN = 60.0


class WindowProblem(enum.StrEnum):
    BACKWARDS = "BACKWARDS"
    EVICTED = "EVICTED"
    NO_ROOM = "NO_ROOM"
    UNMARKED = "UNMARKED"


@dataclass(frozen=True)
class Mark:
    """The target's block counter and the server's clock (seconds) at one moment."""

    counter: int
    at: float


@dataclass(frozen=True)
class Window:
    """The dedup window that applies to the target now."""

    parts: int
    setting: str  # the setting that sizes ``parts``
    seconds: float | None = None  # replicated targets only
    seconds_setting: str | None = None


@dataclass(frozen=True)
class Track:
    """Window bookkeeping of one partition, carried in its BEFORE/AFTER record."""

    first: Mark  # before the partition's first block was sent (never changes)
    parts_window: int  # window in force at the last check
    seconds_window: float | None
    seen: int  # highest counter seen (lower later: parts were dropped, the bound is lost)
    block_parts: int = 0  # most parts one block was seen to take (upper bound)

    def to_json(self) -> dict[str, Any]:
        return {
            "first": [self.first.counter, self.first.at],
            "parts_window": self.parts_window,
            "seconds_window": self.seconds_window,
            "seen": self.seen,
            "block_parts": self.block_parts,
        }

    @staticmethod
    def from_json(data: Mapping[str, Any] | None) -> Track | None:
        if not data:
            return None
        counter, at = data["first"]
        seconds = data.get("seconds_window")
        return Track(
            first=Mark(int(counter), float(at)),
            parts_window=int(data["parts_window"]),
            seconds_window=None if seconds is None else float(seconds),
            seen=int(data["seen"]),
            block_parts=int(data.get("block_parts", 0)),
        )


@dataclass(frozen=True)
class WindowRefusal:
    """Why a block must not be sent: the problem, the numbers, in words."""

    problem: WindowProblem
    used: float  # parts (or seconds, for ``seconds``) since the partition's first block
    limit: float  # what ``used`` had to stay within
    seconds: bool  # the time window, not the parts window
    detail: str


def margin_parts(window: int) -> int:
    return window // WINDOW_MARGIN_DIVISOR


def margin_seconds(seconds: float) -> float:
    return max(MIN_SECONDS_MARGIN, seconds / WINDOW_MARGIN_DIVISOR)


def start_track(window: Window, now: Mark) -> Track:
    """The track of a partition about to send its first block."""
    return Track(now, window.parts, window.seconds, now.counter)


def window_step(
    track: Track | None,
    window: Window,
    now: Mark,
    *,
    resend: bool,
    prev_counter: int | None = None,
) -> tuple[Track, WindowRefusal | None]:
    """Whether the next block may be sent; the track after this check (see the table).

    ``track`` is the partition's (None: its first block). ``resend``: the block is one the
    record lists. ``prev_counter``: the counter at this attempt's previous check (the
    advance since bounds the parts of the block sent in between), None at its first.
    """
    if track is None:
        track = start_track(window, now)
    block_parts = track.block_parts
    if prev_counter is not None:
        block_parts = max(block_parts, now.counter - prev_counter)
    used = now.counter - track.first.counter
    if now.counter < track.seen:
        return track, WindowRefusal(
            WindowProblem.BACKWARDS, used, track.seen - track.first.counter, False,
            f"the block counter went back from {track.seen} to {now.counter} (parts were "
            "dropped or detached), so the parts inserted since cannot be bounded",
        )  # fmt: skip
    past = min(track.parts_window, window.parts)
    if used > past:
        return track, WindowRefusal(
            WindowProblem.EVICTED, used, past, False,
            f"{used} part(s) were inserted since the partition's first block (block counter "
            f"{track.first.counter} -> {now.counter}) and the window was {past}: the "
            "recorded blocks' tokens may have been forgotten",
        )  # fmt: skip
    elapsed = now.at - track.first.at
    if window.seconds is not None:
        past_s = min(
            window.seconds if track.seconds_window is None else track.seconds_window,
            window.seconds,
        )
        if elapsed > past_s:
            return track, WindowRefusal(
                WindowProblem.EVICTED, elapsed, past_s, True,
                f"{elapsed:.0f} s passed since the partition's first block and the window "
                f"keeps tokens {past_s:.0f} s: the recorded blocks' tokens may have expired",
            )  # fmt: skip
    nxt = 0 if resend else max(1, block_parts)
    room = window.parts - margin_parts(window.parts)
    if used + nxt > room:
        return track, WindowRefusal(
            WindowProblem.NO_ROOM, used + nxt, room, False,
            f"{used} part(s) were inserted since the partition's first block (block counter "
            f"{track.first.counter} -> {now.counter}), the next block may add {nxt}, and "
            f"the window of {window.parts} keeps a margin of {margin_parts(window.parts)}",
        )  # fmt: skip
    if window.seconds is not None:
        room_s = window.seconds - margin_seconds(window.seconds)
        if elapsed > room_s:
            return track, WindowRefusal(
                WindowProblem.NO_ROOM, elapsed, room_s, True,
                f"{elapsed:.0f} s passed since the partition's first block and the window "
                f"of {window.seconds:.0f} s keeps a margin of "
                f"{margin_seconds(window.seconds):.0f} s",
            )  # fmt: skip
    return (
        Track(track.first, window.parts, window.seconds, max(track.seen, now.counter), block_parts),
        None,
    )


@dataclass(frozen=True)
class Guard:
    """The window check of :func:`window_step`, as bounds the server checks again when the
    block's insert starts (:mod:`txsink.clickhouse.dedup_insert`): an attempt frozen
    between the check and its send (a GC pause, a partition) is refused by the server
    if the window moved meanwhile, instead of re-sending a forgotten block."""

    counter_min: int  # BACKWARDS: parts were dropped since the check
    counter_max: int  # EVICTED / NO_ROOM, in parts
    deadline: float | None  # EVICTED / NO_ROOM, server clock (replicated targets)


def insert_guard(track: Track, window: Window, *, resend: bool) -> Guard:
    """The bounds a block may still be inserted within: ``track`` and ``window`` as
    :func:`window_step` left and saw them, for the block it just allowed."""
    nxt = 0 if resend else max(1, track.block_parts)
    room = window.parts - margin_parts(window.parts)
    past = min(track.parts_window, window.parts)
    counter_max = track.first.counter + min(past, room - nxt)
    deadline = None
    if window.seconds is not None:
        room_s = window.seconds - margin_seconds(window.seconds)
        past_s = window.seconds if track.seconds_window is None else track.seconds_window
        deadline = track.first.at + min(room_s, past_s, window.seconds)
    return Guard(track.seen, counter_max, deadline)
