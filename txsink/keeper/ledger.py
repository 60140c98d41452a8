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
a window whose ids all have seq 0 (evicted first).
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Mapping
from typing import Any

from txsink.protocol.states import XidRecord

# Partition ids whose totals the ledger keeps one by one (about 40 KiB of ledger node).
LEDGER_PARTITIONS = 1000
FILTER_BITS = 8192
FILTER_HASHES = 4

EMPTY_LEDGER: dict[str, Any] = {
    "seq": 0,
    "committed": 0,
    "rows": 0,
    "last_batch": None,
    "last_commit_at": None,
    "partitions": {},
    "partition_seq": {},
    "partial": [],
    "evicted_partitions": 0,
    "evicted_rows": 0,
    "evicted_filter": "",
}


def empty_ledger() -> dict[str, Any]:
    return copy.deepcopy(EMPTY_LEDGER)


def _bits(pid: str) -> list[int]:
    digest = hashlib.sha256(pid.encode()).digest()
    return [
        int.from_bytes(digest[4 * i : 4 * i + 4], "big") % FILTER_BITS for i in range(FILTER_HASHES)
    ]


def _filter(ledger: Mapping[str, Any]) -> bytearray:
    raw = str(ledger.get("evicted_filter") or "")
    return bytearray.fromhex(raw) if raw else bytearray(FILTER_BITS // 8)


def maybe_evicted(ledger: Mapping[str, Any], pid: str) -> bool:
    """False when ``pid`` was certainly never evicted from this ledger's window (``pid``
    of a :func:`table_view`: looked up under that table's key)."""
    if not int(ledger.get("evicted_partitions", 0)):
        return False
    bloom = _filter(ledger)
    key = str(ledger.get("key_prefix", "")) + pid
    return all(bloom[b // 8] & (1 << (b % 8)) for b in _bits(key))


def next_ledger(
    ledger: Mapping[str, Any],
    record: XidRecord,
    committed_at: float,
    keep: int = LEDGER_PARTITIONS,
) -> dict[str, Any]:
    """The ledger after ``record`` commits (pure; shared by both registries)."""
    seq = int(ledger.get("seq", 0)) + 1
    parts = {str(k): int(v) for k, v in dict(ledger.get("partitions", {})).items()}
    pseq = {str(k): int(v) for k, v in dict(ledger.get("partition_seq", {})).items()}
    partial = set(ledger.get("partial", []))
    evicted, evicted_rows = (
        int(ledger.get("evicted_partitions", 0)),
        int(ledger.get("evicted_rows", 0)),
    )
    bloom = _filter(ledger)
    tables = {str(k): int(v) for k, v in dict(ledger.get("tables", {})).items()}
    evicted_tables = {str(k): int(v) for k, v in dict(ledger.get("evicted_tables", {})).items()}
    if record.multi_table:
        for table, rows in record.table_rows().items():
            tables[table] = tables.get(table, 0) + rows
    shards = {str(k): int(v) for k, v in dict(ledger.get("shards", {})).items()}
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
    last = ledger.get("last_batch")
    if record.batch is not None:
        last = record.batch if last is None else max(int(last), record.batch)
    out: dict[str, Any] = {
        "seq": seq,
        "committed": int(ledger.get("committed", 0)) + 1,
        "rows": int(ledger.get("rows", 0)) + record.rows,
        "last_batch": last,
        "last_commit_at": committed_at,
        "partitions": parts,
        "partition_seq": {p: pseq.get(p, 0) for p in parts},
        "partial": sorted(partial),
        "evicted_partitions": evicted,
        "evicted_rows": evicted_rows,
        "evicted_filter": bloom.hex() if evicted else "",
    }
    if tables:
        out["tables"] = tables
    if shards:
        out["shards"] = shards
    if evicted_tables:
        out["evicted_tables"] = evicted_tables
    return out


def exact_partitions(ledger: Mapping[str, Any]) -> dict[str, int]:
    """Window totals that count every row ever committed to that partition id."""
    partial = set(ledger.get("partial", []))
    return {
        str(p): int(r) for p, r in dict(ledger.get("partitions", {})).items() if p not in partial
    }


def rest_rows(ledger: Mapping[str, Any]) -> int:
    """Rows the ledger cannot attribute to one partition: evicted and partial totals."""
    partial = set(ledger.get("partial", []))
    parts = dict(ledger.get("partitions", {}))
    return int(ledger.get("evicted_rows", 0)) + sum(int(parts[p]) for p in partial if p in parts)


def table_view(ledger: Mapping[str, Any], table: str, primary: str) -> dict[str, Any]:
    """The ledger of one table of a job (``primary``: the job's own target), in the
    single-table layout :func:`exact_partitions`, :func:`rest_rows` and
    :func:`maybe_evicted` read: that table's partitions under their bare ids, its rows,
    and the evicted rows that are its own. A ledger of one table is returned as is."""
    if table == primary and not ledger.get("tables") and not ledger.get("evicted_tables"):
        return dict(ledger)
    prefix = "" if table == primary else f"{table}/"

    def mine(key: str) -> bool:
        return key.startswith(prefix) and "/" not in key[len(prefix) :]

    parts = {
        str(k)[len(prefix) :]: int(v)
        for k, v in dict(ledger.get("partitions", {})).items()
        if mine(str(k))
    }
    evicted_tables = {str(k): int(v) for k, v in dict(ledger.get("evicted_tables", {})).items()}
    if table == primary:
        evicted_rows = int(ledger.get("evicted_rows", 0)) - sum(evicted_tables.values())
    else:
        evicted_rows = evicted_tables.get(table, 0)
    tables = dict(ledger.get("tables", {}))
    view = dict(ledger)
    view.update(
        partitions=parts,
        partition_seq={
            str(k)[len(prefix) :]: v
            for k, v in dict(ledger.get("partition_seq", {})).items()
            if mine(str(k))
        },
        partial=[str(p)[len(prefix) :] for p in ledger.get("partial", []) if mine(str(p))],
        evicted_rows=evicted_rows,
        rows=int(ledger.get("rows", 0)) - sum(int(n) for t, n in tables.items() if t != primary)
        if table == primary
        else int(tables.get(table, 0)),
        key_prefix=prefix,
    )
    view.pop("tables", None)
    view.pop("evicted_tables", None)
    return view
