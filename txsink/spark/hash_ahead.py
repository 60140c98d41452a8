"""Dedup mode's blocks, each cut and fingerprinted in one worker thread ahead of its turn.

A dedup-mode task spends most of its time waiting: for ClickHouse to take a block, for
Keeper to record it. The fingerprint of a block (BLAKE2b over its Arrow IPC,
:func:`txsink.spark.dedup_write.fingerprint`) is CPU work that hashlib does without the
GIL on large buffers, so :class:`BlockFeed` runs it, and the cutting of the next block
from Spark's batches, in a worker thread meanwhile. Only *when* the pure computation runs
moves; what the task decides, writes and sends, and in which order, does not:

- the fingerprint of block ``n`` is a pure function of ``(n, block, legacy)``;
  :meth:`BlockFeed.fingerprint` checks that ``legacy`` (which depends on the partition's record,
  read in the main thread) is still what it was when the work was handed over, and
  computes it again in the main thread if not: it returns exactly what an inline call
  would;
- the batches are pulled by one thread at a time: the first block by the caller before
  the feed starts, every later one by the worker, never two pulls at once;
- an exception of the worker (a value refused while cutting, a failing Spark source)
  is raised by :meth:`BlockFeed.next_block` of the block it was cutting, which comes
  after the previous block was sent: where an inline pull would have raised it;
- the thread never outlives the feed: leaving the ``with`` block cancels what has not
  started and joins the thread (an exception of the abandoned work is dropped: the task
  is already failing with its own).

Memory: the next block is cut while the current one is being sent only if the current one
is at most ``ahead_bytes`` (half of ``block_bytes``): then two blocks are held, the one in
hand and the next, whose size only ``block_rows`` bounds (dedup blocks are cut by rows).
A larger block is let go before the next is cut (one block held, as in attach mode).
Block 0 is hashed while the task reads its Keeper records.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

Hasher = Callable[..., Any]  # (index, block, *, legacy) -> fingerprint


@dataclass
class _Pending:
    index: int
    legacy: bool
    cut: Future[Any]  # the block once cut (None: no more blocks); set by the worker
    hashed: Future[Any]  # its fingerprint


class BlockFeed:
    """The blocks of one partition with their fingerprints (see the module doc).

    ``with BlockFeed(first, rest, hasher, ahead_bytes=...) as feed``: :meth:`start` hands
    block 0 to the worker; :meth:`next_block` returns the next block once it is cut (None
    at the end), while its fingerprint may still be being computed, and
    :meth:`fingerprint` then waits for that; :meth:`cut_next` asks for the block after
    the current one to be cut and hashed while the caller sends the current one.
    """

    def __init__(
        self, first: Any, rest: Iterator[Any], hasher: Hasher, *, ahead_bytes: int
    ) -> None:
        self._first: Any = first
        self._rest = rest
        self._hash = hasher
        self._ahead_bytes = ahead_bytes
        self._next_index = 0
        self._pending: _Pending | None = None  # handed to the worker, not yet taken
        self._taken: _Pending | None = None  # returned by next_block, hash not yet taken
        self._pool: ThreadPoolExecutor | None = None

    def __enter__(self) -> BlockFeed:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="txsink-dedup-hash")
        return self

    def __exit__(self, *exc: object) -> None:
        pool, self._pool = self._pool, None
        self._pending = self._taken = self._first = None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)

    def _submit(self, legacy: bool) -> _Pending:
        if self._pool is None:
            raise RuntimeError("BlockFeed used outside its with block")
        index = self._next_index
        first, self._first = self._first, None
        cut: Future[Any] = Future()

        def work() -> Any:
            try:
                block = first if index == 0 else next(self._rest, None)
            except BaseException as exc:
                cut.set_exception(exc)
                raise
            cut.set_result(block)
            return None if block is None else self._hash(index, block, legacy=legacy)

        self._pending = _Pending(index, legacy, cut, self._pool.submit(work))
        return self._pending

    def start(self, legacy: bool) -> None:
        """Hand block 0 to the worker to hash while the caller does other work."""
        self._submit(legacy)

    def cut_next(self, current: Any, legacy: bool) -> None:
        """Block ``current`` is about to be sent: cut and hash the next one meanwhile,
        if holding both stays within the memory bound (else :meth:`next_block` has it
        cut once the caller let ``current`` go)."""
        if self._pending is None and current.nbytes <= self._ahead_bytes:
            self._submit(legacy)

    def next_block(self, legacy_of: Callable[[int], bool]) -> Any:
        """The next block once it is cut, or None at the end of the partition; a failure
        to cut it (the worker's exception) is raised here."""
        pending = self._pending or self._submit(legacy_of(self._next_index))
        self._pending = None
        block = pending.cut.result()
        if block is not None:
            self._next_index += 1
            self._taken = pending
        return block

    def fingerprint(self, block: Any, legacy_of: Callable[[int], bool]) -> Any:
        """The fingerprint of ``block``, the one :meth:`next_block` just returned.

        ``legacy_of(index)``: whether block ``index`` must be hashed the way earlier
        releases did, judged now; a fingerprint computed with another answer is computed
        again (the same block, another digest kind), so this returns exactly what
        ``hasher(index, block, legacy=legacy_of(index))`` would."""
        taken, self._taken = self._taken, None
        if taken is None:
            raise RuntimeError("BlockFeed.fingerprint without a block from next_block")
        fp = taken.hashed.result()
        legacy = legacy_of(taken.index)
        if legacy != taken.legacy:
            return self._hash(taken.index, block, legacy=legacy)
        return fp
