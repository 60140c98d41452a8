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


@dataclass(frozen=True)
class StagedPart:
    """Rows of one target partition held by one staging table (attach mode), or the rows
    one Spark partition inserted as deterministic blocks (dedup mode: ``table`` is the
    target and ``partition_id`` the Spark partition number as text).

    ``uuids`` (attach mode): evidence of publish. Short ids (the first
    :data:`UUID_PREFIX_CHARS` hex digits) of up to :data:`MAX_PART_UUIDS` of the staged
    parts of this partition (the largest), which keep their UUIDs through MOVE PARTITION
    into the target. Stored as one comma-joined string, left out when empty: records
    written before this field existed load with ``()``.

    ``target`` (several tables in one xid, :func:`txsink.transaction`): the table this
    entry is published into; ``""`` means the record's ``target``. Left out of the JSON
    when empty, so records of one table look as before and old records load unchanged.
    """

    table: str
    partition_id: str
    rows: int
    blocks: int = 0
    fingerprint: str = ""
    uuids: tuple[str, ...] = ()
    target: str = ""

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "table": self.table,
            "partition_id": self.partition_id,
            "rows": self.rows,
            "blocks": self.blocks,
            "fingerprint": self.fingerprint,
        }
        if self.uuids:
            out["uuids"] = ",".join(self.uuids)
        if self.target:
            out["target"] = self.target
        return out

    @staticmethod
    def from_json(data: dict[str, Any]) -> StagedPart:
        raw = data.get("uuids") or ""
        return StagedPart(
            table=str(data["table"]),
            partition_id=str(data["partition_id"]),
            rows=int(data["rows"]),
            blocks=int(data.get("blocks", 0)),
            fingerprint=str(data.get("fingerprint", "")),
            uuids=tuple(u for u in (raw.split(",") if isinstance(raw, str) else raw) if u),
            target=str(data.get("target") or ""),
        )


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
class XidRecord:
    """What Keeper holds for one xid. ``version`` is Keeper's node version (not stored).

    ``target`` is the job's (first) table; a manifest entry with its own ``target``
    belongs to another table of the same transaction. ``extra["tables"]`` lists every
    table a multi-table transaction wrote (also those that staged no rows).
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
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def rows(self) -> int:
        return sum(p.rows for p in self.manifest)

    @property
    def aborted_tables(self) -> frozenset[str]:
        """Staging tables an ABORTED tombstone (or an earlier one this record replaced)
        rolled back: they must never be published."""
        return frozenset(str(t) for t in self.extra.get("aborted_tables", ()))

    @property
    def staging_tables(self) -> tuple[str, ...]:
        """Distinct staging tables of the manifest, in manifest order."""
        return tuple(dict.fromkeys(p.table for p in self.manifest))

    def cut(self, table: str, partition_id: str) -> dict[str, int]:
        """Parts of one staging partition proven in the target after a server crash cut
        a MOVE between parts (``extra["cut"]``, written before they are dropped from
        staging): evidence id -> rows. Empty when no MOVE of it was ever cut."""
        found = self.extra.get("cut", {}).get(f"{table}/{partition_id}", {})
        return {str(u): int(n) for u, n in found.items()}

    def part_target(self, part: StagedPart) -> str:
        """The table ``part`` is published into."""
        return part.target or self.target

    @property
    def targets(self) -> tuple[str, ...]:
        """Every table of this xid: ``extra["tables"]`` for a multi-table transaction,
        else the record's target followed by any other entry targets (manifest order)."""
        listed = [str(t) for t in self.extra.get("tables", ())]
        return tuple(
            dict.fromkeys([*listed, self.target, *(self.part_target(p) for p in self.manifest)])
        )

    @property
    def multi_table(self) -> bool:
        return bool(self.extra.get("tables")) or any(p.target for p in self.manifest)

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

    def to_json(self) -> dict[str, Any]:
        return {
            "job": self.job,
            "xid": self.xid,
            "batch": self.batch,
            "state": self.state.value,
            "epoch": self.epoch,
            "mode": self.mode.value,
            "target": self.target,
            "manifest": [p.to_json() for p in self.manifest],
            "rows": self.rows,
            "created_at": self.created_at,
            "committed_at": self.committed_at,
            "extra": self.extra,
        }

    @staticmethod
    def from_json(data: dict[str, Any], version: int = -1) -> XidRecord:
        return XidRecord(
            job=str(data["job"]),
            xid=str(data["xid"]),
            batch=None if data.get("batch") is None else int(data["batch"]),
            state=XidState(data["state"]),
            epoch=int(data["epoch"]),
            mode=Mode(data.get("mode", "attach")),
            target=str(data.get("target", "")),
            manifest=tuple(StagedPart.from_json(p) for p in data.get("manifest", [])),
            created_at=float(data.get("created_at", 0.0)),
            committed_at=None if data.get("committed_at") is None else float(data["committed_at"]),
            version=version,
            extra=dict(data.get("extra", {})),
        )


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
