"""Xid states, xid records and their manifests.

An xid is one transaction: one Spark micro-batch (or one batch ``save()``) of one job.

``XidState`` and its transitions::

    (absent)  -> PREPARED   driver: every task succeeded; manifest recorded by a fenced
                            create in Keeper. This is the commit point: from here the xid
                            is only ever rolled forward.
    PREPARED  -> COMMITTED  driver or recovery: every staged partition of the manifest
                            has been published into the target (attach mode) or every
                            block was inserted (dedup mode); fenced compare-and-set.
    PREPARED  -> PREPARED   publishing is idempotent: a crash part-way leaves the xid
                            PREPARED and the next driver or ``txsink recover`` resumes it.
    COMMITTED -> (pruned)   retention removes old COMMITTED records; the job's ledger
                            keeps their totals.
    (absent)  -> ABORTED    abort, recovery or a zombie's roll-back: a tombstone naming the
                            staging tables about to be dropped (``aborted_tables``). It is
                            written *before* any drop, on the same node a prepare creates,
                            so Keeper decides which of the two came first: a prepare that
                            lands later (its reply was lost, or its writer was paused) finds
                            the node and never adopts a dropped table.
    ABORTED   -> ABORTED    another roll-back adds tables to the tombstone.
    ABORTED   -> PREPARED   a replay of the batch prepares fresh staging: a fenced
                            compare-and-set, refused if its manifest names a tombstoned
                            table.
    ABORTED   -> (pruned)   once older than the tombstone lifetime (no prepare can still be
                            in flight).

A PREPARED xid whose staging is gone cannot be finished and raises an alarm for an operator
instead of being guessed at. Staging is dropped only after COMMITTED (published) or after
an ABORTED tombstone names it: no ClickHouse-side drop is ever decided by a read alone.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from txsink.protocol.ids import parse_staging


class XidState(enum.StrEnum):
    PREPARED = "PREPARED"
    COMMITTED = "COMMITTED"
    ABORTED = "ABORTED"


ALLOWED_TRANSITIONS: frozenset[tuple[XidState | None, XidState]] = frozenset(
    {
        (None, XidState.PREPARED),
        (XidState.PREPARED, XidState.PREPARED),
        (XidState.PREPARED, XidState.COMMITTED),
        (None, XidState.ABORTED),
        (XidState.ABORTED, XidState.ABORTED),
        (XidState.ABORTED, XidState.PREPARED),
    }
)


def check_transition(old: XidState | None, new: XidState) -> None:
    """Raise ValueError for an edge the table above does not allow."""
    if (old, new) not in ALLOWED_TRANSITIONS:
        raise ValueError(f"illegal xid transition {old} -> {new}")


class Mode(enum.StrEnum):
    ATTACH = "attach"
    DEDUP = "dedup"


class Visibility(enum.StrEnum):
    """When a batch's rows become visible: partition by partition as each MOVE lands, or
    all at once (``batch``: one ATTACH of a batch staging table per target)."""

    PARTITION = "partition"
    BATCH = "batch"


@dataclass(frozen=True)
class StagedPart:
    """One manifest entry. Its fields mean different things per :class:`Mode`:

    ============  ==========================================  =============================
    field         attach mode                                 dedup mode
    ============  ==========================================  =============================
    table         the staging table holding the rows          the target table itself
    partition_id  the target partition id (ClickHouse's)      the Spark partition number
    rows          rows staged for that partition              rows the partition inserted
    blocks        staged parts (0 when not counted)           deterministic blocks sent
    fingerprint   unused (``""``)                             digest of the block sequence
    uuids         evidence of publish (below)                 unused
    target        another table of a multi-table xid          unused
    ============  ==========================================  =============================

    ``uuids`` (attach mode): evidence of publish. Short ids (the first
    :data:`UUID_PREFIX_CHARS` hex digits) of up to :data:`MAX_PART_UUIDS` of the staged
    parts of this partition (the largest), which keep their UUIDs through MOVE PARTITION
    into the target. Stored as one comma-joined string, left out when empty: records
    written before this field existed load with ``()``.

    ``target`` (several tables in one xid, :func:`txsink.transaction`): the table this
    entry is published into; ``""`` means the record's ``target``. Left out of the JSON
    when empty, so records of one table look as before and old records load unchanged.
    The wire form is :mod:`txsink.protocol.codec`'s.
    """

    table: str
    partition_id: str
    rows: int
    blocks: int = 0
    fingerprint: str = ""
    uuids: tuple[str, ...] = ()
    target: str = ""


# Evidence of publish: how many part UUIDs a manifest entry keeps, and how many hex digits
# of each (64 random bits: a collision with another part of one target is ~2^-64 per pair).
MAX_PART_UUIDS = 4
UUID_PREFIX_CHARS = 16


def short_uuids(
    parts: list[tuple[int, str]], limit: int | None = MAX_PART_UUIDS
) -> tuple[str, ...]:
    """The evidence ids of one staged partition from its ``(rows, uuid)`` parts: the
    largest parts first (they outlive small ones in the target's merge selection); at
    most ``limit`` of them (None: every part's)."""
    nil = "0" * UUID_PREFIX_CHARS
    ids = [(rows, u.replace("-", "").lower()[:UUID_PREFIX_CHARS]) for rows, u in parts]
    ids = [(r, u) for r, u in ids if len(u) == UUID_PREFIX_CHARS and u != nil]
    ids.sort(key=lambda ru: (-ru[0], ru[1]))
    return tuple(u for _, u in (ids if limit is None else ids[:limit]))


@dataclass(frozen=True)
class Cut:
    """Parts of one staging partition proven in the target after a server crash cut a
    MOVE between parts (recorded by :meth:`Registry.amend` before they are dropped from
    staging): ``parts`` maps evidence id -> rows. Facts only ever grow: a later cut of
    the same partition adds parts, never removes one."""

    staging: str
    partition_id: str
    parts: Mapping[str, int]

    @property
    def key(self) -> str:
        return f"{self.staging}/{self.partition_id}"


@dataclass(frozen=True)
class XidRecord:
    """What Keeper holds for one xid. ``version`` is Keeper's node version (not stored).

    ``target`` is the job's (first) table; a manifest entry with its own ``target``
    belongs to another table of the same transaction. ``tables`` lists every table a
    multi-table transaction wrote (also those that staged no rows).

    Facts recorded over the xid's life:

    - ``aborted_tables``: staging tables an ABORTED tombstone (or an earlier one this
      record replaced) rolled back: they must never be published.
    - ``cuts``: per staging partition, parts a cut MOVE already published (:class:`Cut`),
      in the order of their keys (as the codec reads them back).
    - ``seq`` / ``committed_epoch`` (COMMITTED): the commit's place in the job's ledger
      and the epoch that recorded it (equal to ``epoch`` when no crash or takeover came
      between prepare and commit).
    - ``unknown``: keys a newer txsink wrote that this one does not know; kept as they
      are through every rewrite (:mod:`txsink.protocol.codec`).
    """

    job: str
    xid: str
    batch: int | None
    state: XidState
    epoch: int
    mode: Mode
    target: str
    manifest: tuple[StagedPart, ...] = ()
    created_at: float = 0.0
    committed_at: float | None = None
    version: int = -1
    tables: tuple[str, ...] = ()
    visibility: Visibility = Visibility.PARTITION
    aborted_tables: frozenset[str] = frozenset()
    cuts: tuple[Cut, ...] = ()
    seq: int | None = None
    committed_epoch: int | None = None
    unknown: Mapping[str, Any] = field(default_factory=dict)

    @property
    def rows(self) -> int:
        return sum(p.rows for p in self.manifest)

    @property
    def staging_tables(self) -> tuple[str, ...]:
        """Distinct staging tables of the manifest, in manifest order."""
        return tuple(dict.fromkeys(p.table for p in self.manifest))

    def cut(self, table: str, partition_id: str) -> dict[str, int]:
        """Parts of one staging partition proven in the target after a server crash cut
        a MOVE between parts: evidence id -> rows. Empty when no MOVE of it was ever cut."""
        found: dict[str, int] = {}
        for c in self.cuts:
            if c.staging == table and c.partition_id == partition_id:
                found.update(c.parts)
        return found

    def with_cuts(self, cuts: Iterable[Cut]) -> XidRecord:
        """This record with ``cuts`` merged into its own, partition by partition (what
        :meth:`Registry.amend` stores: facts another finisher added are kept)."""
        merged: dict[tuple[str, str], dict[str, int]] = {}
        for c in (*self.cuts, *cuts):
            merged.setdefault((c.staging, c.partition_id), {}).update(c.parts)
        out = sorted((Cut(t, p, parts) for (t, p), parts in merged.items()), key=lambda c: c.key)
        return replace(self, cuts=tuple(out))

    def part_target(self, part: StagedPart) -> str:
        """The table ``part`` is published into."""
        return part.target or self.target

    @property
    def targets(self) -> tuple[str, ...]:
        """Every table of this xid: ``tables`` for a multi-table transaction, else the
        record's target followed by any other entry targets (manifest order)."""
        return tuple(
            dict.fromkeys(
                [*self.tables, self.target, *(self.part_target(p) for p in self.manifest)]
            )
        )

    @property
    def multi_table(self) -> bool:
        return bool(self.tables) or any(p.target for p in self.manifest)

    @property
    def batch_visible(self) -> bool:
        """Whether the batch's rows become visible at once (``visibility=batch``)."""
        return self.visibility is Visibility.BATCH

    def partition_rows(self, table: str | None = None) -> dict[str, int]:
        """Rows per partition id, of every entry or only of those published into ``table``."""
        totals: dict[str, int] = {}
        for p in self.manifest:
            if table is None or self.part_target(p) == table:
                totals[p.partition_id] = totals.get(p.partition_id, 0) + p.rows
        return totals

    def shard_rows(self, table: str | None = None) -> dict[str, int]:
        """Rows per shard index (as text) of a sharded job's entries published into
        ``table`` (default: the record's target); empty for a job without shards."""
        want = table or self.target
        totals: dict[str, int] = {}
        for p in self.manifest:
            parsed = parse_staging(p.table)
            if parsed is None or parsed.shard is None or self.part_target(p) != want:
                continue
            key = str(parsed.shard)
            totals[key] = totals.get(key, 0) + p.rows
        return totals

    def table_rows(self) -> dict[str, int]:
        """Rows per target table (every table of :attr:`targets`, zero included)."""
        totals = dict.fromkeys(self.targets, 0)
        for p in self.manifest:
            totals[self.part_target(p)] += p.rows
        return totals

    def ledger_rows(self) -> dict[str, int]:
        """Rows per ledger key: the partition id for the record's own target (as always),
        ``<table>/<partition id>`` for the other tables of a multi-table xid (partition ids
        never contain a slash), so one table's partitions never mix with another's."""
        totals: dict[str, int] = {}
        for p in self.manifest:
            key = ledger_key(self.target, self.part_target(p), p.partition_id)
            totals[key] = totals.get(key, 0) + p.rows
        return totals

    def with_state(self, state: XidState, **changes: Any) -> XidRecord:
        check_transition(self.state, state)
        return replace(self, state=state, **changes)


def ledger_key(primary: str, table: str, partition_id: str) -> str:
    """The job ledger's key of ``partition_id`` of ``table`` (``primary``: the job's own
    target, whose keys stay bare partition ids as in every older ledger)."""
    return partition_id if table == primary or not table else f"{table}/{partition_id}"


@dataclass(frozen=True)
class Epoch:
    """A writer epoch: ``number`` grows with every takeover; ``token`` is what fenced
    writes compare against (Keeper's version of the epoch node)."""

    job: str
    number: int
    token: int
    owner: str = ""
