"""The Warehouse port: what the protocol runner, ops and the Spark layer ask of the server
that holds staging and targets, and the records that cross it.

Owned by the port; no I/O here (no clickhouse-connect, no pyarrow). Adapters:
:class:`txsink.clickhouse.warehouse.ClickHouseWarehouse` (one server),
:class:`txsink.clickhouse.shards.ShardedWarehouse` (one per shard) and the in-memory twin
:class:`txsink.ports.warehouse_memory.MemoryWarehouse`; ``tests/warehouse_contract.py``
is the contract every one of them passes. Invariants every implementation keeps:

- staging tables are named by :func:`txsink.protocol.ids.staging_name` and live in
  ``staging_db``; nothing else is created, dropped or moved from;
- every staged part carries a UUID, and ``MOVE PARTITION`` and ``ATTACH PARTITION ALL
  FROM`` keep it in the target (the evidence of publish) until a merge in the target
  replaces the part and the replaced part is cleaned up;
- ``move_partition(s)`` and ``consolidate`` are idempotent (a partition already moved
  moves nothing); ``attach_all`` is not (it copies) and ``claim_staging`` lets exactly one
  of several callers hold a batch staging table;
- ``attach_refusal`` asks the server whether the writer's user may run ``attach_all``
  into a target (roles and wildcard grants included), and changes nothing: no table is
  created, nothing reaches the target;
- ``gather_into_batch`` never converts a value: it refuses unless every table it reads
  and the one it writes have the same stored columns and types;
- ``evidence_life`` answers how long the evidence of a publish into a target survives
  (the server's uptime, the target's ``old_parts_lifetime``, the query log's TTL), never
  erring towards longer; ``detached_parts`` lists every detached part of a staging
  table, whatever the reason;
- an operation outside :attr:`Warehouse.capabilities` raises
  :class:`WarehouseCapabilityMissing` naming the capability; callers check the field
  first, never ``hasattr`` or a caught error.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from txsink.errors import ConfigError
from txsink.protocol.dedup_window import Guard
from txsink.protocol.evidence_life import EvidenceLife
from txsink.protocol.ops import BatchShape

MERGE_TREE_SUFFIX = "MergeTree"
WINDOW_SECONDS_KEY = "replicated_deduplication_window_seconds"
# Its default: 1 hour from ClickHouse 25.9, 1 week before. When the target's value is not
# known, the smaller one is assumed (a replay refused too early, never duplicated).
DEFAULT_WINDOW_SECONDS = 3600

# Per-block insert settings: one mapping for every block, or ``block_index -> mapping``
# (dedup mode: a per-block ``insert_deduplication_token``).
BlockSettings = Callable[[int], Mapping[str, Any]] | Mapping[str, Any] | None
# Rows per partition id of one staging table; None for a table that does not exist.
StagingView = dict[str, dict[str, int] | None]


@dataclass(frozen=True)
class InsertGuard:
    """What the server checks when a dedup-mode block insert starts, in the statement
    itself: that the xid's seal row ``seal`` (:func:`~txsink.protocol.ids.seal_tag`) is
    absent, and that the target's block counter and clock are within ``window``.
    ``types``: the target's column types (the block's columns are sent as typed input);
    ``replicated``: the counter is summed over partitions (see
    :mod:`txsink.protocol.dedup_window`)."""

    seal: str
    types: tuple[tuple[str, str], ...]
    window: Guard | None = None
    replicated: bool = False


@dataclass(frozen=True)
class ColumnInfo:
    name: str
    type: str
    default_kind: str = ""  # '' | DEFAULT | MATERIALIZED | ALIAS | EPHEMERAL
    default_expression: str = ""
    codec: str = ""  # system.columns.compression_codec, e.g. "CODEC(Delta(4), ZSTD(3))"


@dataclass(frozen=True)
class ClusterReplica:
    """One row of ``system.clusters``."""

    shard_num: int
    shard_weight: int
    replica_num: int
    host_name: str


@dataclass(frozen=True)
class CommitLook:
    """What a commit reads before its prepare, in one statement per server
    (:meth:`Warehouse.commit_look`): each staging table asked for, its rows and evidence
    ids per partition (None: missing); the bytes staged per partition id over all of
    them (what decides a batch's compaction); the materialized views that read
    ``views_of`` now, and its stored columns in order (what a gathered batch inserts);
    the staging tables whose names start with ``listing``; ``shape``: how to create a
    batch staging like ``views_of`` and fill it in one statement, None where its CREATE
    cannot be reproduced exactly; ``unfit``: staging tables that must not be published
    (created without the staging settings, or unlike the columns the batch's values were
    checked against), each with the reason; ``target_types``: the type of each column of
    ``views_of`` as it is now."""

    staged: dict[str, dict[str, tuple[int, tuple[str, ...]]] | None]
    sizes: dict[str, int] = field(default_factory=dict)
    views: tuple[str, ...] = ()
    listed: tuple[str, ...] = ()
    columns: tuple[str, ...] = ()
    shape: BatchShape | None = None
    unfit: dict[str, str] = field(default_factory=dict)  # staging table -> why not publishable
    target_types: dict[str, str] = field(default_factory=dict)  # views_of's columns now


@dataclass(frozen=True)
class TargetInfo:
    """What txsink needs to know about one ClickHouse table (target or staging)."""

    database: str
    table: str
    engine: str
    engine_full: str = ""
    partition_key: str = ""
    sorting_key: str = ""
    primary_key: str = ""
    sampling_key: str = ""
    storage_policy: str = ""
    columns: tuple[ColumnInfo, ...] = ()
    dependent_views: tuple[str, ...] = ()  # "db.view" of materialized views reading it
    settings: Mapping[str, str] = field(default_factory=dict)
    skip_indices: tuple[str, ...] = ()  # "name TYPE type_full GRANULARITY n ON expr"
    projections: tuple[str, ...] = ()  # "name: query"
    table_ttl: bool = False  # a table-level TTL (rows are deleted by TTL merges)
    ttl_columns: tuple[str, ...] = ()  # columns with a column TTL (values reset)
    # Replicated*MergeTree only (system.replicas): the table's Keeper path and replica
    # name on the server txsink talks to, macros expanded; "" when not replicated
    zookeeper_path: str = ""
    replica_name: str = ""
    # the server's time zone (timezone()): where a zone-less DateTime column reads a
    # timestamp_ntz's wall clock; "" when unknown (UTC is assumed)
    server_timezone: str = ""
    # Distributed only: each function its sharding key calls -> whether the server calls
    # it deterministic (system.functions; None: it cannot tell or does not know it), and
    # the shard count of its cluster (system.clusters; None: not found there)
    key_functions: Mapping[str, bool | None] = field(default_factory=dict)
    shard_count: int | None = None

    @property
    def name(self) -> str:
        return f"{self.database}.{self.table}"

    @property
    def is_replicated(self) -> bool:
        return self.engine.startswith(("Replicated", "Shared"))

    @property
    def has_dependent_views(self) -> bool:
        return bool(self.dependent_views)

    @property
    def is_merge_tree(self) -> bool:
        return self.engine.endswith(MERGE_TREE_SUFFIX)

    @property
    def dedup_window_setting(self) -> str:
        """The setting that sizes this table's insert dedup window (in parts)."""
        if self.is_replicated:
            return "replicated_deduplication_window"
        return "non_replicated_deduplication_window"

    @property
    def dedup_window(self) -> int:
        """Insert dedup window that applies to this table, in parts (0 = no dedup)."""
        try:
            return int(self.settings.get(self.dedup_window_setting, "0"))
        except ValueError:
            return 0

    @property
    def dedup_window_seconds(self) -> float | None:
        """How long a replicated table keeps dedup entries (None: no time limit)."""
        if not self.is_replicated:
            return None
        try:
            return float(self.settings.get(WINDOW_SECONDS_KEY, DEFAULT_WINDOW_SECONDS))
        except ValueError:
            return float(DEFAULT_WINDOW_SECONDS)


@dataclass(frozen=True)
class InsertStats:
    """What one :meth:`Warehouse.insert_blocks` sent."""

    rows: int
    bytes: int
    blocks: int


@dataclass(frozen=True)
class WarehouseCapabilities:
    """What a warehouse can do beyond the core every implementation has (staging,
    inserts into staging, MOVE PARTITION, part UUID evidence, observation).

    ``batch_visibility``: ``visibility=batch`` publishing on one server (batch staging,
    ``consolidate``, ``claim_staging``, ``attach_all``, the two ``*_refusal`` probes).
    ``query_log``: ``attach_logged`` can prove an ATTACH by its tag (a server may still
    lack a readable query log; that is a ConfigError when asked). ``direct_insert``:
    ``insert_blocks`` into a target (dedup mode). ``per_shard_counts``:
    ``partition_rows_by_shard``. ``clusters``: ``expand_macros`` and ``cluster_replicas``
    read the server's cluster definitions."""

    batch_visibility: bool = True
    query_log: bool = True
    direct_insert: bool = True
    per_shard_counts: bool = False
    clusters: bool = True

    def missing(self, capability: str, what: str, hint: str) -> WarehouseCapabilityMissing:
        """The error for an operation that needs ``capability`` (a field name)."""
        return WarehouseCapabilityMissing(
            f"{what} needs the warehouse capability {capability!r}, which this warehouse "
            f"lacks; {hint}",
            capability=capability,
        )


class WarehouseCapabilityMissing(ConfigError):
    """An operation the warehouse does not offer (see :class:`WarehouseCapabilities`)."""

    def __init__(self, message: str, *, capability: str, code: int | None = None) -> None:
        super().__init__(message, code=code)
        self.capability = capability


class Warehouse(Protocol):
    """What the driver, executors and ops need of ClickHouse (the twin can stand in).

    Table arguments: ``staging`` / ``table`` in the staging methods is a bare staging
    table name in :attr:`staging_db`; ``target`` is ``db.table``."""

    staging_db: str
    capabilities: WarehouseCapabilities

    # -- observation ------------------------------------------------------------------

    def staging_view(self, tables: Iterable[str]) -> StagingView: ...

    def staged_partitions(
        self, table: str, every_part: bool = False
    ) -> dict[str, tuple[int, tuple[str, ...]]]: ...

    def staged_partitions_of(
        self, tables: Iterable[str], every_part: bool = False
    ) -> dict[str, dict[str, tuple[int, tuple[str, ...]]] | None]: ...

    def commit_look(
        self,
        tables: Iterable[str],
        *,
        views_of: str | None = None,
        listing: str | None = None,
        validated: Sequence[tuple[str, str]] | None = None,
    ) -> CommitLook: ...

    def staged_part_rows(self, table: str) -> dict[str, dict[str, int]]: ...

    def published_uuids(self, target: str, uuids: Iterable[str]) -> frozenset[str]: ...

    def partition_rows(self, table: str, db: str | None = None) -> dict[str, int]: ...

    def partition_rows_by_shard(self, table: str) -> list[dict[str, int]]: ...

    def list_staging(self, prefix: str) -> list[str]: ...

    def drop_leftover_fills(self, older_than_s: float) -> list[str]:
        """Drop what a server killed during a fill of a batch staging (a gather that
        creates its table) left in the staging database under no txsink name, once older
        than ``older_than_s``; the names dropped."""
        ...

    def staging_sizes(self, prefix: str) -> dict[str, dict[str, int]]: ...

    def settle(self, names: Iterable[str]) -> bool: ...

    def attach_logged(self, target: str, tag: str, since: float) -> bool: ...

    def evidence_life(self, target: str) -> EvidenceLife: ...

    def detached_parts(self, tables: Iterable[str]) -> dict[str, dict[str, int]]: ...

    def target_info(self, target: str, *, staging: bool = False) -> TargetInfo: ...

    def target_infos(self, target: str) -> list[TargetInfo]: ...

    def dependent_views(self, target: str) -> tuple[str, ...]: ...

    def expand_macros(self, text: str) -> str: ...

    def cluster_replicas(self, cluster: str) -> list[ClusterReplica]: ...

    # -- staging lifecycle ------------------------------------------------------------

    def ensure_staging_db(self) -> None: ...

    def ensure_seal_table(self) -> None: ...

    def seal_dedup(self, tag: str) -> None: ...

    def create_staging(
        self,
        target: str,
        table: str,
        expected: TargetInfo | None = None,
        *,
        read_back: bool = True,
    ) -> None: ...

    def drop_staging(self, table: str) -> None: ...

    def drop_stagings(self, tables: Sequence[str], *, wait: bool = True) -> None: ...

    def insert_blocks(
        self,
        table: str,
        batches: Iterable[Any],  # Arrow record batches: opaque to the port
        *,
        block_rows: int,
        block_bytes: int,
        settings: BlockSettings = None,
        resend_ok: Callable[[], bool] | None = None,  # asked before a block is sent again
        guard: InsertGuard | None = None,  # checked by the server as each block starts
    ) -> InsertStats: ...

    # -- publish ----------------------------------------------------------------------

    def move_partition(self, staging: str, partition_id: str, target: str) -> None: ...

    def move_partitions(self, staging: str, partition_ids: Sequence[str], target: str) -> None: ...

    def drop_parts(self, staging: str, partition_id: str, evidence: Sequence[str]) -> None: ...

    def create_batch_staging(self, table: str, like: str, target: str = "") -> None: ...

    def consolidate(self, staging: str, partition_id: str, batch_staging: str) -> None: ...

    def copy_into_batch(self, batch_staging: str, sources: Sequence[tuple[str, str]]) -> None: ...

    def gather_into_batch(
        self,
        batch_staging: str,
        tables: Sequence[str],
        columns: Sequence[str],
        rows: int,
        *,
        create: BatchShape | None = None,
    ) -> None:
        """Insert every row of ``tables`` (task staging tables, whole) into the batch
        staging in one statement: one part per partition for a batch below one insert
        block. Refused before any row unless every table, the batch staging included,
        has exactly ``columns`` (stored, in order) with the same types: nothing is ever
        converted. ``create``: the batch staging does not exist yet and the same
        statement creates it from the shape (every task staging table must show
        ``create.layout``; a refusal creates nothing). Never retried blindly (it writes
        new parts); a count of rows written other than ``rows`` is a RetryableConflict
        (the publish re-observes)."""
        ...

    def claim_staging(self, staging: str, claimed: str) -> None: ...

    def attach_all(self, staging: str, target: str, tag: str = "") -> None: ...

    def attach_refusal(self, target: str) -> str:
        """Why the writer's user may not run :meth:`attach_all` into ``target`` (the
        server's words), or "" when it may; changes nothing."""
        ...
