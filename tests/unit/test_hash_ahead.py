"""Dedup mode's hash-ahead feed (txsink/spark/hash_ahead.py): the blocks and fingerprints
it hands out are exactly those of an inline walk, the worker's failures surface where an
inline pull would have raised them, and its thread never outlives the feed."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import pytest

from txsink.spark.dedup_write import fingerprint
from txsink.spark.hash_ahead import BlockFeed


def _blocks(n: int, rows: int = 3) -> list[pa.Table]:
    return [pa.table({"id": list(range(i * rows, (i + 1) * rows))}) for i in range(n)]


def _hash_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("txsink-dedup-hash")]


def _walk(feed: BlockFeed, legacy: Any = lambda _i: False) -> list[Any]:
    out = []
    while (block := feed.next_block(legacy)) is not None:
        out.append(feed.fingerprint(block, legacy))
        feed.cut_next(block, legacy(len(out)))
    return out


def test_the_feed_hands_out_the_fingerprints_an_inline_walk_computes() -> None:
    blocks = _blocks(4)
    with BlockFeed(blocks[0], iter(blocks[1:]), fingerprint, ahead_bytes=1 << 30) as feed:
        feed.start(False)
        got = _walk(feed)
    assert got == [fingerprint(i, b) for i, b in enumerate(blocks)]


def test_a_block_whose_record_turned_legacy_meanwhile_is_hashed_again_the_legacy_way() -> None:
    blocks = _blocks(2)
    record: set[int] = set()
    with BlockFeed(blocks[0], iter(blocks[1:]), fingerprint, ahead_bytes=1 << 30) as feed:
        feed.start(False)  # hashed as b3 ahead...
        record.add(0)  # ...then another attempt's b2 record is read for block 0
        block = feed.next_block(lambda i: i in record)
        fp = feed.fingerprint(block, lambda i: i in record)
    assert fp == fingerprint(0, blocks[0], legacy=True) != fingerprint(0, blocks[0])


def test_a_failure_while_cutting_the_next_block_surfaces_when_that_block_is_taken() -> None:
    blocks = _blocks(2)
    sent: list[int] = []

    def source() -> Iterator[pa.Table]:
        yield blocks[1]
        raise RuntimeError("executor lost")

    with BlockFeed(blocks[0], source(), fingerprint, ahead_bytes=1 << 30) as feed:
        feed.start(False)
        with pytest.raises(RuntimeError, match="executor lost"):
            while (block := feed.next_block(lambda _i: False)) is not None:
                feed.fingerprint(block, lambda _i: False)
                feed.cut_next(block, False)  # the failing cut runs while this one is sent
                sent.append(block.num_rows)
    assert sent == [3, 3]  # both blocks before the failure were sent, as inline
    assert _hash_threads() == []


def test_the_worker_thread_is_joined_when_the_task_fails_while_it_hashes() -> None:
    started, release = threading.Event(), threading.Event()

    def slow(index: int, block: pa.Table, *, legacy: bool) -> Any:
        started.set()
        release.wait(5)
        return fingerprint(index, block, legacy=legacy)

    blocks = _blocks(1)
    with (
        pytest.raises(KeyError),
        BlockFeed(blocks[0], iter(()), slow, ahead_bytes=1 << 30) as feed,
    ):
        feed.start(False)
        assert started.wait(5)
        threading.Timer(0.2, release.set).start()
        raise KeyError("the insert failed")
    assert _hash_threads() == []


def test_a_block_larger_than_the_bound_is_let_go_before_the_next_is_cut() -> None:
    blocks = _blocks(3)
    pulled: list[int] = []

    def source() -> Iterator[pa.Table]:
        for b in blocks[1:]:
            pulled.append(b.num_rows)
            yield b

    with BlockFeed(blocks[0], source(), fingerprint, ahead_bytes=0) as feed:
        feed.start(False)
        block = feed.next_block(lambda _i: False)
        feed.fingerprint(block, lambda _i: False)
        feed.cut_next(block, False)
        assert pulled == []  # nothing cut while block 0 is held
        del block
        assert feed.next_block(lambda _i: False) is not None
        assert pulled == [3]
