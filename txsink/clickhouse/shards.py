"""A table on several ClickHouse shards, behind the one :class:`~.warehouse.Warehouse`.

One xid spans every shard. Nothing above this module knows about shards: the
protocol works on staging tables, and every staging table of a sharded job carries its
shard in its name (``..._t<task attempt id>_s<k>``, :mod:`txsink.protocol.ids`), so
:class:`ShardedWarehouse` sends each operation on a staging table to the server that
holds it, and each question about "all staging" or "the target" to every server. The
PREPARED record's manifest therefore names the shard of every staged part, recovery
rolls an xid forward on every shard, and a shard that does not answer fails the step
(``UnavailableError`` naming it): the xid stays PREPARED and the next commit or
``txsink recover`` finishes it there, never a half-forgotten xid.

Shard ``k`` is the k-th URL of the job's ``shards`` option, pinned in the job's Keeper
meta at its first commit (:func:`txsink.protocol.commit.run_epoch`): a restart with the
list in another order would send a staging table's MOVE to the wrong server.

Routing of rows (:func:`shard_of_rows`): with ``shard_by`` a row goes where a
``Distributed`` table with sharding key ``intHash64(shard_by)`` and equal shard weights
sends it, ``intHash64(value) % shards``; without it rows are spread evenly by position.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from txsink.clickhouse.replicated_ddl import split_engine
from txsink.clickhouse.warehouse import ClickHouseWarehouse
from txsink.errors import ConfigError
from txsink.ports.warehouse import (
    BlockSettings,
    ClusterReplica,
    CommitLook,
    InsertGuard,
    InsertStats,
    TargetInfo,
    Warehouse,
    WarehouseCapabilities,
)
from txsink.protocol.evidence_life import EvidenceLife
from txsink.protocol.ids import shard_of
from txsink.protocol.ops import BatchShape

_SALT = np.uint64(0x4CF2D2BAAE6DA887)  # ClickHouse's IntHash64Impl xors this in first
_M1 = np.uint64(0xFF51AFD7ED558CCD)
_M2 = np.uint64(0xC4CEB9FE1A85EC53)
_S33 = np.uint64(33)


def int_hash64(values: np.ndarray) -> np.ndarray:
    """ClickHouse's ``intHash64`` of integers (as UInt64: signed values wrap), vectorised."""
    x = values.astype(np.int64, copy=False).view(np.uint64) ^ _SALT
    with np.errstate(over="ignore"):
        x = x ^ (x >> _S33)
        x = x * _M1
        x = x ^ (x >> _S33)
        x = x * _M2
        x = x ^ (x >> _S33)
    return x


def shard_of_rows(batch: pa.RecordBatch, shards: int, shard_by: str, offset: int) -> np.ndarray:
    """The shard index of every row of ``batch``: ``intHash64(shard_by) % shards``, or,
    without ``shard_by``, round robin starting at ``offset`` (rows spread evenly)."""
    n = batch.num_rows
    if not shard_by:
        return (np.arange(offset, offset + n, dtype=np.int64) % shards).astype(np.int64)
    idx = batch.schema.get_field_index(shard_by)
    if idx < 0:
        raise ConfigError(f"shard_by column {shard_by!r} is not in the DataFrame")
    column = batch.column(idx)
    if not pa.types.is_integer(column.type):
        raise ConfigError(
            f"shard_by column {shard_by!r} is {column.type}; it must be an integer column "
            f"(the sharding key is intHash64({shard_by})). Derive one, e.g. "
            f"cityHash64 of a string, in the DataFrame"
        )
    if column.null_count:
        raise ConfigError(f"shard_by column {shard_by!r} has null values; a row needs a shard")
    values = column.to_numpy(zero_copy_only=False)
    if values.dtype == np.uint64:
        values = values.view(np.int64)
    return (int_hash64(values.astype(np.int64)) % np.uint64(shards)).astype(np.int64)


def split_by_shard(
    batch: pa.RecordBatch, shards: int, shard_by: str, offset: int
) -> dict[int, pa.RecordBatch]:
    """``batch`` cut into the rows of each shard (shards without rows left out)."""
    where = shard_of_rows(batch, shards, shard_by, offset)
    out: dict[int, pa.RecordBatch] = {}
    for k in range(shards):
        mask = where == k
        if mask.any():
            out[k] = batch.filter(pa.array(mask))
    return out


@dataclass(frozen=True)
class DistributedTarget:
    """What a ``Distributed`` table says about where its rows go."""

    cluster: str
    local_table: str  # db.table on every shard
    shard_by: str  # the column of an intHash64(column) sharding key; "" for rand()
    sharding_key: str = ""  # as written in the engine ("" when it has none)


def parse_distributed(info: TargetInfo) -> DistributedTarget:
    """The cluster, local table and ``shard_by`` of the ``Distributed`` table ``info``.

    Only sharding keys txsink routes exactly as ClickHouse does are accepted:
    ``intHash64(column)`` (:func:`shard_of_rows`) and ``rand()``/``rand32()``/``rand64()``
    (any spread is one ``rand()`` could have chosen); anything else is a ConfigError
    naming the key. A missing key is accepted here (one shard needs none; the shard
    count is checked by :func:`cluster_urls`)."""
    what = f"Distributed table {info.name}"
    try:
        _, args, _ = split_engine(info.engine_full)
    except ValueError as exc:
        raise ConfigError(f"{what}: cannot read its engine ({exc})") from exc
    if len(args) < 3:
        raise ConfigError(f"{what}: engine {info.engine_full!r} names no cluster and table")
    cluster, db, table = (_name_arg(a, info.database) for a in args[:3])
    if not (cluster and db and table):
        raise ConfigError(
            f"{what}: cannot read the cluster, database and table from {info.engine_full!r}"
        )
    key = args[3].strip() if len(args) > 3 else ""
    compact = re.sub(r"\s+", "", key)
    if compact in ("", "rand()", "rand32()", "rand64()"):
        shard_by = ""
    else:
        m = re.fullmatch(r"intHash64\(`?([A-Za-z_][A-Za-z0-9_]*)`?\)", compact)
        if not m:
            raise ConfigError(
                f"{what} shards by {key}, which txsink cannot reproduce row by row (it "
                f"routes by intHash64(<integer column>) or rand()). Use one of those keys, "
                f"or give shards= and shard_by= with table= naming the local table"
            )
        shard_by = m.group(1)
    return DistributedTarget(cluster, f"{db}.{table}", shard_by, key)


def _name_arg(arg: str, current_db: str) -> str:
    arg = arg.strip()
    if re.fullmatch(r"currentDatabase\(\s*\)", arg):
        return current_db
    if len(arg) >= 2 and arg[0] == arg[-1] and arg[0] in "'`\"":
        return arg[1:-1].replace("\\'", "'")
    return arg if re.fullmatch(r"[A-Za-z0-9_.-]+", arg) else ""


def cluster_urls(
    target: DistributedTarget, replicas: Sequence[ClusterReplica], scheme: str, port: int
) -> tuple[str, ...]:
    """One URL per shard of ``target``'s cluster, in ``shard_num`` order: the shard's
    first replica (lowest ``replica_num``), ``scheme://host_name:port``.

    The choice depends only on the cluster definition, never on the server asked, so
    every writer and restart of a job names the same servers (the job pins them)."""
    if not replicas:
        raise ConfigError(
            f"cluster {target.cluster!r} is not in system.clusters of the server asked; "
            f"check its <remote_servers>, or give shards= (the shard URLs)"
        )
    first: dict[int, ClusterReplica] = {}
    for r in sorted(replicas, key=lambda r: (r.shard_num, r.replica_num)):
        first.setdefault(r.shard_num, r)
    if any(r.shard_weight != 1 for r in first.values()):
        raise ConfigError(
            f"cluster {target.cluster!r} gives its shards weights "
            f"({', '.join(f'{k}: {r.shard_weight}' for k, r in sorted(first.items()))}); "
            f"txsink routes rows as ClickHouse does with every weight 1 only (key % shards; "
            f"other weights pick shards from a table of slots). Give shards= and shard_by="
        )
    if len(first) > 1 and not target.sharding_key:
        raise ConfigError(
            f"the Distributed table over cluster {target.cluster!r} has no sharding key "
            f"and {len(first)} shards: ClickHouse itself refuses such inserts. Add a key "
            f"(intHash64(<column>) or rand())"
        )
    hosts = [r.host_name for _, r in sorted(first.items())]
    urls = tuple(f"{scheme}://{_bracketed(h)}:{port}" for h in hosts)
    if len(set(urls)) != len(urls):
        raise ConfigError(
            f"cluster {target.cluster!r} puts several shards on one host "
            f"({', '.join(urls)} over HTTP port {port}); txsink reaches a shard by its host "
            f"and one HTTP port. Give shards= with each shard's URL"
        )
    return urls


def replicas_per_shard(replicas: Sequence[ClusterReplica]) -> dict[int, int]:
    """How many replicas each shard of a cluster lists."""
    out: dict[int, int] = {}
    for r in replicas:
        out[r.shard_num] = out.get(r.shard_num, 0) + 1
    return out


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


class ShardedWarehouse:
    """:class:`~txsink.ports.warehouse.Warehouse` over one :class:`ClickHouseWarehouse`
    per shard. It lacks what one statement on one server must do for the whole table:
    ``visibility=batch`` (one ATTACH per table cannot span servers, nor can its query-log
    proof), direct inserts (dedup mode), and reading cluster definitions (a sharded job
    names its shards); those methods raise
    :class:`~txsink.ports.warehouse.WarehouseCapabilityMissing`."""

    capabilities = WarehouseCapabilities(
        batch_visibility=False,
        query_log=False,
        direct_insert=False,
        per_shard_counts=True,
        clusters=False,
    )

    def __init__(self, shards: Sequence[ClickHouseWarehouse]) -> None:
        if not shards:
            raise ConfigError("a sharded warehouse needs at least one shard")
        self.shards = list(shards)
        self.staging_db = self.shards[0].staging_db
        self.client = self.shards[0].client  # "a" server: clocks, settings defaults

    def _on(self, table: str) -> ClickHouseWarehouse:
        k = shard_of(table)
        if k >= len(self.shards):
            raise ConfigError(
                f"staging table {table} lives on shard {k}, but this job has "
                f"{len(self.shards)} shard(s): the shards option changed? The job pins its "
                "shard list; see docs/options.md#shards"
            )
        return self.shards[k]

    def _grouped(self, tables: Iterable[str]) -> dict[int, list[str]]:
        by: dict[int, list[str]] = {}
        for table in tables:
            self._on(table)
            by.setdefault(shard_of(table), []).append(table)
        return by

    def close(self) -> None:
        for shard in self.shards:
            shard.client.close()

    # -- staging: routed by the shard in the name ------------------------------------

    def staging_view(self, tables: Iterable[str]) -> dict[str, dict[str, int] | None]:
        view: dict[str, dict[str, int] | None] = {}
        for k, names in self._grouped(tables).items():
            view.update(self.shards[k].staging_view(names))
        return view

    def staged_partitions_of(
        self, tables: Iterable[str], every_part: bool = False
    ) -> dict[str, dict[str, tuple[int, tuple[str, ...]]] | None]:
        out: dict[str, dict[str, tuple[int, tuple[str, ...]]] | None] = {}
        for k, names in self._grouped(tables).items():
            out.update(self.shards[k].staged_partitions_of(names, every_part))
        return out

    def commit_look(
        self,
        tables: Iterable[str],
        *,
        views_of: str | None = None,
        listing: str | None = None,
        validated: Sequence[tuple[str, str]] | None = None,
    ) -> CommitLook:
        """One statement per shard: its own staging tables, the views of its table, its
        staging named ``listing*``, the unfit."""
        grouped = self._grouped(tables)
        staged: dict[str, dict[str, tuple[int, tuple[str, ...]]] | None] = {}
        sizes: dict[str, int] = {}
        views: set[str] = set()
        listed: set[str] = set()
        columns: tuple[str, ...] = ()
        unfit: dict[str, str] = {}
        for k, shard in enumerate(self.shards):
            look = shard.commit_look(
                grouped.get(k, ()), views_of=views_of, listing=listing, validated=validated
            )
            staged.update(look.staged)
            unfit.update(look.unfit)
            for pid, n in look.sizes.items():
                sizes[pid] = sizes.get(pid, 0) + n
            views |= set(look.views)
            listed |= set(look.listed)
            columns = columns or look.columns
        return CommitLook(
            staged, sizes, tuple(sorted(views)), tuple(sorted(listed)), columns, unfit=unfit
        )

    def move_partition(self, staging: str, partition_id: str, target: str) -> None:
        self._on(staging).move_partition(staging, partition_id, target)

    def move_partitions(self, staging: str, partition_ids: Sequence[str], target: str) -> None:
        self._on(staging).move_partitions(staging, partition_ids, target)

    def drop_staging(self, table: str) -> None:
        self._on(table).drop_staging(table)

    def drop_stagings(self, tables: Sequence[str], *, wait: bool = True) -> None:
        for k, names in self._grouped(tables).items():
            self.shards[k].drop_stagings(names, wait=wait)

    def create_staging(
        self,
        target: str,
        table: str,
        expected: TargetInfo | None = None,
        *,
        read_back: bool = True,
    ) -> None:
        self._on(table).create_staging(target, table, expected, read_back=read_back)

    def insert_blocks(
        self,
        table: str,
        batches: Iterable[pa.RecordBatch],
        *,
        block_rows: int,
        block_bytes: int,
        settings: BlockSettings = None,
        resend_ok: Callable[[], bool] | None = None,
        guard: InsertGuard | None = None,
    ) -> InsertStats:
        if "." in table or "`" in table or guard is not None:
            raise self.capabilities.missing(
                "direct_insert",
                f"inserting into {table} directly (dedup mode)",
                "a sharded job does not offer it (each shard would need its own "
                "deterministic blocks); use mode=attach",
            )
        return self._on(table).insert_blocks(
            table,
            batches,
            block_rows=block_rows,
            block_bytes=block_bytes,
            settings=settings,
            resend_ok=resend_ok,
        )

    def staged_part_rows(self, table: str) -> dict[str, dict[str, int]]:
        return self._on(table).staged_part_rows(table)

    def drop_parts(self, staging: str, partition_id: str, evidence: Sequence[str]) -> None:
        self._on(staging).drop_parts(staging, partition_id, evidence)

    def staged_partitions(
        self, table: str, every_part: bool = False
    ) -> dict[str, tuple[int, tuple[str, ...]]]:
        return self._on(table).staged_partitions(table, every_part)

    # -- questions about every shard ---------------------------------------------------

    def list_staging(self, prefix: str) -> list[str]:
        return sorted(t for shard in self.shards for t in shard.list_staging(prefix))

    def staging_sizes(self, prefix: str) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        for shard in self.shards:
            out.update(shard.staging_sizes(prefix))
        return out

    def ensure_staging_db(self) -> None:
        for shard in self.shards:
            shard.ensure_staging_db()

    def ensure_seal_table(self) -> None:
        for shard in self.shards:
            shard.ensure_seal_table()

    def seal_dedup(self, tag: str) -> None:
        for shard in self.shards:
            shard.seal_dedup(tag)

    def create_target(self, table: str, sql: str) -> None:
        """The target created on every shard (``create_table=if_missing``)."""
        for shard in self.shards:
            shard.create_target(table, sql)

    def partition_rows(self, table: str, db: str | None = None) -> dict[str, int]:
        """Rows per partition id summed over the shards (the job's whole table)."""
        out: dict[str, int] = {}
        for shard in self.shards:
            for pid, n in shard.partition_rows(table, db).items():
                out[pid] = out.get(pid, 0) + n
        return out

    def partition_rows_by_shard(self, table: str) -> list[dict[str, int]]:
        return [shard.partition_rows(table) for shard in self.shards]

    def published_uuids(self, target: str, uuids: Iterable[str]) -> frozenset[str]:
        wanted = sorted(set(uuids))
        found: frozenset[str] = frozenset()
        for shard in self.shards:
            found |= shard.published_uuids(target, wanted)
        return found

    def settle(self, names: Iterable[str]) -> bool:
        wanted = list(names)
        return all(shard.settle(wanted) for shard in self.shards)

    def evidence_life(self, target: str) -> EvidenceLife:
        """The shortest-lived evidence over every shard (a cut MOVE is on one of them)."""
        lives = [shard.evidence_life(target) for shard in self.shards]
        ttls = [life.query_log_ttl_s for life in lives if life.query_log_ttl_s is not None]
        return EvidenceLife(
            uptime_s=min(life.uptime_s for life in lives),
            parts_lifetime_s=min(life.parts_lifetime_s for life in lives),
            query_log_ttl_s=min(ttls) if ttls else None,
        )

    def detached_parts(self, tables: Iterable[str]) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        for k, names in self._grouped(tables).items():
            out.update(self.shards[k].detached_parts(names))
        return out

    def target_info(self, target: str, *, staging: bool = False) -> TargetInfo:
        """The first shard's table (validation checks every shard: :meth:`target_infos`)."""
        return self.shards[0].target_info(target, staging=staging)

    def target_infos(self, target: str) -> list[TargetInfo]:
        return [shard.target_info(target) for shard in self.shards]

    def dependent_views(self, target: str) -> tuple[str, ...]:
        return tuple(sorted({v for shard in self.shards for v in shard.dependent_views(target)}))

    # -- visibility=batch: one ATTACH per table cannot span servers ---------------------

    def _no_batch(self, what: str, capability: str = "batch_visibility") -> ConfigError:
        return self.capabilities.missing(
            capability, what, "visibility=batch cannot span shards; use visibility=partition"
        )

    def drop_leftover_fills(self, older_than_s: float) -> list[str]:
        return [n for shard in self.shards for n in shard.drop_leftover_fills(older_than_s)]

    def create_batch_staging(self, table: str, like: str, target: str = "") -> None:
        raise self._no_batch(f"batch staging {table}")

    def attach_all(self, staging: str, target: str, tag: str = "") -> None:
        raise self._no_batch(f"ATTACH PARTITION ALL into {target}")

    def claim_staging(self, staging: str, claimed: str) -> None:
        raise self._no_batch(f"claiming batch staging {staging}")

    def attach_refusal(self, target: str) -> str:
        raise self._no_batch(f"probing the ATTACH PARTITION ALL grant on {target}")

    def attach_logged(self, target: str, tag: str, since: float) -> bool:
        raise self._no_batch(f"the query-log proof of an ATTACH into {target}", "query_log")

    def consolidate(self, staging: str, partition_id: str, batch_staging: str) -> None:
        raise self._no_batch(f"consolidating {staging} into batch staging {batch_staging}")

    def copy_into_batch(self, batch_staging: str, sources: Sequence[tuple[str, str]]) -> None:
        raise self._no_batch(f"copying into batch staging {batch_staging}")

    def gather_into_batch(
        self,
        batch_staging: str,
        tables: Sequence[str],
        columns: Sequence[str],
        rows: int,
        *,
        create: BatchShape | None = None,
    ) -> None:
        raise self._no_batch(f"gathering into batch staging {batch_staging}")

    # -- cluster definitions: a sharded job names its shards ------------------------------

    def expand_macros(self, text: str) -> str:
        raise self.capabilities.missing(
            "clusters", f"expanding macros of {text!r}", "a sharded job names its shards"
        )

    def cluster_replicas(self, cluster: str) -> list[ClusterReplica]:
        raise self.capabilities.missing(
            "clusters", f"reading cluster {cluster}", "a sharded job names its shards"
        )


def _conforms(one: ClickHouseWarehouse, sharded: ShardedWarehouse) -> list[Warehouse]:
    """mypy checks here that both ClickHouse adapters implement the whole port."""
    return [one, sharded]
