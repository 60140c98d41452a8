"""The storage model of the in-memory Warehouse twin: tables made of immutable parts.

Owned by the port, beside :mod:`txsink.ports.warehouse_memory`; no I/O. Invariants: a
part never changes once made (a merge makes a new one, with a new UUID); a table's
``outdated`` parts are the ones a merge replaced, still visible to evidence lookups
until cleaned up, as in ``system.parts``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Part:
    """One data part: immutable, like ClickHouse's."""

    partition_id: str
    rows: tuple[Any, ...]
    uuid: str

    @property
    def count(self) -> int:
        return len(self.rows)


@dataclass
class MemoryTable:
    """One table: active parts, outdated parts (replaced by a merge, not cleaned up yet),
    the column its partition id is read from ("" for one partition ``all``), and the
    insert dedup tokens it has seen (``dedup_window`` 0: none kept)."""

    partition_by: str = ""
    parts: list[Part] = field(default_factory=list)
    outdated: list[Part] = field(default_factory=list)
    dedup_window: int = 0
    tokens: set[tuple[str, str]] = field(default_factory=set)

    def rows(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for p in self.parts:
            if p.count:
                out[p.partition_id] = out.get(p.partition_id, 0) + p.count
        return out


def partition_of(row: Any, column: str) -> str:
    if not column:
        return "all"
    return str(row[column])


def cut_blocks(batches: Iterable[Any], block_rows: int) -> Iterable[list[Any]]:
    """Rows cut into blocks of ``block_rows`` (by row count only, like dedup mode's)."""
    pending: list[Any] = []
    for batch in batches:
        rows = batch.to_pylist() if hasattr(batch, "to_pylist") else list(batch)
        for row in rows:
            pending.append(row)
            if len(pending) == block_rows:
                yield pending
                pending = []
    if pending:
        yield pending
