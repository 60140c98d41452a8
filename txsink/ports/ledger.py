"""The job ledger: exact totals of everything a job ever committed, in one bounded node.

Pure (no kazoo). The ledger node is rewritten by every commit (in the same fenced Keeper
transaction as the COMMITTED record), so it must stay small whatever the job's age::

    {"seq", "committed", "rows", "last_batch", "last_commit_at",   exact, never pruned
     "partitions":    {pid: rows},   per-partition totals of the LEDGER_PARTITIONS partition
                                     ids most recently written (the window)
     "partition_seq": {pid: seq},    the last commit seq that wrote each of them
     "partial":       [pid, ...],    window ids that may have been evicted before: their
                                     totals count only rows since they came back
     "evicted_partitions": n,        evictions so far (a partition evicted twice counts 2)
     "evicted_rows":  rows,          the rows of every evicted total, folded into one number
     "evicted_filter": hex,          a Bloom filter of the evicted partition ids
     "shards":        {k: rows},     sharded jobs: exact rows of the job's target per shard
                                     index (one entry per shard)
     "tables":        {table: rows}, multi-table jobs: exact rows per table (one entry per
                                     table of the job: bounded by the job's table set)
     "evicted_tables": {table: rows}} the part of evicted_rows that belongs to tables other
                                     than the job's own target

Several tables in one job (:func:`txsink.transaction`): partition ids of the job's own
target are keyed as always; those of its other tables as ``<table>/<partition id>``
(:func:`txsink.protocol.states.ledger_key`), in the same bounded window, so the ledger
never mixes two tables' partitions. :func:`table_view` cuts one table's ledger out of it
for ``txsink verify``.

When a commit brings the window past ``LEDGER_PARTITIONS`` ids, the least recently written
ones are evicted: their rows move into ``evicted_rows`` and their id into the filter. An id
that comes back while the filter says it may have been evicted is marked ``partial``. The
filter never forgets and has false positives (about 2% at 1,000 evicted ids, most ids after
5,000): a false positive only makes one more partition "not reconcilable one by one".
``txsink verify`` reconciles window partitions exactly and everything else (evicted and
partial ids) as one total; ``rows`` stays the exact grand total.

Ledgers written before this layout (``partitions`` without ``partition_seq``) are read as
a window whose ids all have seq 0 (evicted first). The node is a typed
:class:`~txsink.protocol.codec.Ledger`, encoded by :mod:`txsink.protocol.codec`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from txsink.protocol.codec import Ledger, as_ledger
from txsink.protocol.states import XidRecord

__all__ = [
    "EMPTY_LEDGER",
    "LEDGER_PARTITIONS",
    "Ledger",
    "empty_ledger",
    "exact_partitions",
    "maybe_evicted",
    "next_ledger",
    "rest_rows",
    "table_view",
]

# Partition ids whose totals the ledger keeps one by one (about 40 KiB of ledger node).
LEDGER_PARTITIONS = 1000
FILTER_BITS = 8192
FILTER_HASHES = 4

EMPTY_LEDGER = Ledger()

LedgerLike = Ledger | Mapping[str, Any]


def empty_ledger() -> Ledger:
    return Ledger()


def _bits(pid: str) -> list[int]:
    digest = hashlib.sha256(pid.encode()).digest()
    return [
        int.from_bytes(digest[4 * i : 4 * i + 4], "big") % FILTER_BITS for i in range(FILTER_HASHES)
    ]


def _filter(ledger: Ledger) -> bytearray:
    raw = ledger.evicted_filter
    return bytearray.fromhex(raw) if raw else bytearray(FILTER_BITS // 8)


def maybe_evicted(ledger: LedgerLike, pid: str) -> bool:
    """False when ``pid`` was certainly never evicted from this ledger's window (``pid``
    of a :func:`table_view`: looked up under that table's key)."""
    ledger = as_ledger(ledger)
    if not ledger.evicted_partitions:
        return False
    bloom = _filter(ledger)
    key = ledger.key_prefix + pid
    return all(bloom[b // 8] & (1 << (b % 8)) for b in _bits(key))


def next_ledger(
    ledger: LedgerLike,
    record: XidRecord,
    committed_at: float,
    keep: int = LEDGER_PARTITIONS,
) -> Ledger:
    """The ledger after ``record`` commits (pure; shared by both registries)."""
    ledger = as_ledger(ledger)
    seq = ledger.seq + 1
    parts = dict(ledger.partitions)
    pseq = dict(ledger.partition_seq)
    partial = set(ledger.partial)
    evicted, evicted_rows = ledger.evicted_partitions, ledger.evicted_rows
    bloom = _filter(ledger)
    tables = dict(ledger.tables)
    evicted_tables = dict(ledger.evicted_tables)
    if record.multi_table:
        for table, rows in record.table_rows().items():
            tables[table] = tables.get(table, 0) + rows
    shards = dict(ledger.shards)
    for k, rows in record.shard_rows().items():
        shards[k] = shards.get(k, 0) + rows
    for pid, rows in record.ledger_rows().items():
        if pid not in parts:
            if maybe_evicted(ledger, pid):
                partial.add(pid)
            parts[pid] = 0
        parts[pid] += rows
        pseq[pid] = seq
    if len(parts) > keep:
        order = sorted(parts, key=lambda p: (pseq.get(p, 0), p))
        for pid in order[: len(parts) - keep]:
            rows = parts.pop(pid)
            evicted_rows += rows
            if "/" in pid:
                table = pid.rsplit("/", 1)[0]
                evicted_tables[table] = evicted_tables.get(table, 0) + rows
            pseq.pop(pid, None)
            partial.discard(pid)
            evicted += 1
            for b in _bits(pid):
                bloom[b // 8] |= 1 << (b % 8)
    last = ledger.last_batch
    if record.batch is not None:
        last = record.batch if last is None else max(last, record.batch)
    return replace(
        ledger,
        seq=seq,
        committed=ledger.committed + 1,
        rows=ledger.rows + record.rows,
        last_batch=last,
        last_commit_at=committed_at,
        partitions=parts,
        partition_seq={p: pseq.get(p, 0) for p in parts},
        partial=tuple(sorted(partial)),
        evicted_partitions=evicted,
        evicted_rows=evicted_rows,
        evicted_filter=bloom.hex() if evicted else "",
        tables=tables,
        shards=shards,
        evicted_tables=evicted_tables,
    )


def exact_partitions(ledger: LedgerLike) -> dict[str, int]:
    """Window totals that count every row ever committed to that partition id."""
    ledger = as_ledger(ledger)
    partial = set(ledger.partial)
    return {p: r for p, r in ledger.partitions.items() if p not in partial}


def rest_rows(ledger: LedgerLike) -> int:
    """Rows the ledger cannot attribute to one partition: evicted and partial totals."""
    ledger = as_ledger(ledger)
    parts = ledger.partitions
    return ledger.evicted_rows + sum(parts[p] for p in ledger.partial if p in parts)


def table_view(ledger: LedgerLike, table: str, primary: str) -> Ledger:
    """The ledger of one table of a job (``primary``: the job's own target), in the
    single-table layout :func:`exact_partitions`, :func:`rest_rows` and
    :func:`maybe_evicted` read: that table's partitions under their bare ids, its rows,
    and the evicted rows that are its own. A ledger of one table is returned as is."""
    ledger = as_ledger(ledger)
    if table == primary and not ledger.tables and not ledger.evicted_tables:
        return ledger
    prefix = "" if table == primary else f"{table}/"

    def mine(key: str) -> bool:
        return key.startswith(prefix) and "/" not in key[len(prefix) :]

    if table == primary:
        evicted_rows = ledger.evicted_rows - sum(ledger.evicted_tables.values())
        rows = ledger.rows - sum(n for t, n in ledger.tables.items() if t != primary)
    else:
        evicted_rows = ledger.evicted_tables.get(table, 0)
        rows = ledger.tables.get(table, 0)
    return replace(
        ledger,
        partitions={k[len(prefix) :]: v for k, v in ledger.partitions.items() if mine(k)},
        partition_seq={k[len(prefix) :]: v for k, v in ledger.partition_seq.items() if mine(k)},
        partial=tuple(p[len(prefix) :] for p in ledger.partial if mine(p)),
        evicted_rows=evicted_rows,
        rows=rows,
        key_prefix=prefix,
        tables={},
        evicted_tables={},
    )
