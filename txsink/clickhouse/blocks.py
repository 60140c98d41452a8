"""Cutting Arrow record batches into insert blocks.

Owned by the ClickHouse adapter. Invariants: block boundaries depend only on the batch
sizes (a replay of the same data cuts the same blocks, which dedup mode's per-block
tokens rely on); at most one block's worth of slices is held at a time.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import pyarrow as pa


def iter_blocks(
    batches: Iterable[pa.RecordBatch], *, block_rows: int, block_bytes: int
) -> Iterator[pa.Table]:
    """Group (and cut) record batches into tables of at most ``block_rows``/``block_bytes``.

    Pulls lazily: at most one block's worth of batch slices (zero-copy views of at most
    the batches they come from) is held at a time. Byte sizes are Arrow buffer sizes of
    the slices; a single row larger than ``block_bytes`` forms a block of its own.
    """
    pending: list[pa.RecordBatch] = []
    p_rows = p_bytes = 0
    for batch in batches:
        if batch.num_rows == 0:
            continue
        start = 0
        while start < batch.num_rows:
            rest = batch.num_rows - start
            avg = max(1.0, batch.nbytes / batch.num_rows)
            room_rows = block_rows - p_rows
            room_by_bytes = int((block_bytes - p_bytes) // avg)
            take = min(rest, room_rows, room_by_bytes)
            if take <= 0:
                if pending:
                    yield pa.Table.from_batches(pending)
                    pending, p_rows, p_bytes = [], 0, 0
                    continue
                take = 1  # one row bigger than a block: send it alone
            piece = batch.slice(start, take)
            # The average row size was a guess: shrink until the slice really fits.
            while take > 1 and p_bytes + piece.nbytes > block_bytes:
                shrunk = int(take * (block_bytes - p_bytes) / max(piece.nbytes, 1))
                take = max(1, min(take - 1, shrunk))
                piece = batch.slice(start, take)
            if pending and p_bytes + piece.nbytes > block_bytes:
                yield pa.Table.from_batches(pending)
                pending, p_rows, p_bytes = [], 0, 0
                continue
            pending.append(piece)
            p_rows += take
            p_bytes += piece.nbytes
            start += take
            if p_rows >= block_rows or p_bytes >= block_bytes:
                yield pa.Table.from_batches(pending)
                pending, p_rows, p_bytes = [], 0, 0
    if pending:
        yield pa.Table.from_batches(pending)
