"""The ClickHouse side of the protocol: staging tables, inserts, MOVE PARTITION, inspection.

Owned by the ClickHouse adapter. The driver and executors depend on the :class:`Warehouse`
protocol only; :class:`ClickHouseWarehouse` implements it over :class:`~.client.Client`.
Invariants:

- only tables whose name :func:`~txsink.protocol.ids.parse_staging` recognises, inside
  ``staging_db``, are ever created, dropped or moved from: nothing outside txsink's own
  naming is touched;
- a staging table is ``CREATE TABLE staging AS target`` (ClickHouse 26.9 copies columns
  with codecs and defaults, keys, SAMPLE BY, TTL, settings, indices and projections), then
  checked against the target with :func:`~.compat.check_move_compat` before any row lands;
  a ``Replicated*MergeTree`` target's staging is replicated too (``MOVE PARTITION`` stays
  within one engine family) on the replica txsink talks to, under a Keeper path of its
  own (:func:`~.compat.staging_keeper_path`, never the target's), which its ``DROP ...
  SYNC`` removes;
- staging keeps every row it was sent until published: before any row lands its table
  and column TTLs are removed and table settings (persistent, unlike ``SYSTEM STOP
  MERGES``) disable merges and insert deduplication and give every part a UUID (the
  evidence of publish, see :func:`~txsink.protocol.plans.plan_publish`); staging inserts
  run with :data:`~.compat.STAGING_INSERT_SETTINGS` (no deduplication in either spelling,
  no async insert, no ``optimize_on_insert``, no partition limit per block);
- ``move_partition`` is idempotent: moving a partition id the staging table no longer
  holds moves nothing and does not fail. When the target gained columns after the
  staging was created, the staging table gets the same columns first (nothing else
  is repaired: see :func:`~.compat.plan_column_catch_up`);
- ``insert_blocks`` holds at most one block (plus the batch being cut) in memory.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import pyarrow as pa

from txsink.clickhouse.client import (
    Client,
    qualified,
    quote_ident,
    quote_literal,
    split_table,
)
from txsink.clickhouse.compat import (
    OPTIONAL_INSERT_SETTINGS,
    STAGING_INSERT_SETTINGS,
    AddColumn,
    ClusterReplica,
    ColumnInfo,
    TargetInfo,
    check_move_compat,
    closing_paren,
    plan_column_catch_up,
    split_top_level,
    staging_engine_clause,
    staging_keeper_path,
)
from txsink.errors import ConfigError, RecoveryAlarm, RetryableConflict, TxSinkError
from txsink.protocol.ids import parse_staging
from txsink.protocol.states import MAX_PART_UUIDS, short_uuids

log = logging.getLogger(__name__)

DEFAULT_STAGING_DB = "txsink_staging"
# Commands per grouped statement (MOVE PARTITION, DROP TABLE): ClickHouse refuses any
# statement over max_query_size (256 KiB by default) on every retry, so one ALTER for a
# backfill task's thousands of partitions would wedge its PREPARED xid. 200 commands stay
# under 64 KiB at ClickHouse's name length limits.
MAX_COMMANDS = 200
TABLE_ALREADY_EXISTS = 57
REPLICA_ALREADY_EXISTS = 253
METADATA_MISMATCH = 342  # a leftover at the path, of a table the target has outgrown
_PARTITION_ID_RE = re.compile(r"^[A-Za-z0-9_\-]+$")
_DB_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
DEDUP_SETTING_KEYS = ("non_replicated_deduplication_window", "replicated_deduplication_window")
PARTS_SETTING_KEYS = ("parts_to_delay_insert", "parts_to_throw_insert")
# MergeTree settings TargetInfo carries: server defaults, overridden by the table's SETTINGS
MERGE_TREE_SETTING_KEYS = (*DEDUP_SETTING_KEYS, *PARTS_SETTING_KEYS)
# Staging keeps every row it was sent until published. Table settings persist across a
# server restart (SYSTEM STOP MERGES / STOP TTL MERGES do not): no part is ever larger
# than 1 byte for the merge selector, so no merge (Replacing/Collapsing... semantics, a
# new part UUID) runs, OPTIMIZE included; no insert deduplication; a UUID on every part.
STAGING_SETTINGS = {
    "assign_part_uuids": 1,
    "non_replicated_deduplication_window": 0,
    "max_bytes_to_merge_at_max_space_in_pool": 1,
    "max_bytes_to_merge_at_min_space_in_pool": 1,
    # a target's forced merges by age (inherited by CREATE AS) ignore the size limits
    "min_age_to_force_merge_seconds": 0,
    "min_age_to_force_merge_on_partition_only": 0,
    # staging never merges, so it holds one part per block and partition: the target's
    # back-pressure limits (inherited by CREATE AS, made for a table that merges) would
    # delay, then refuse, every later insert of the task, on every retry (a wedge)
    "parts_to_delay_insert": 1_000_000_000,
    "parts_to_throw_insert": 1_000_000_000,
    "max_parts_in_total": 1_000_000_000,
    "inactive_parts_to_delay_insert": 0,
    "inactive_parts_to_throw_insert": 0,
}
_TTL_RE = re.compile(r"\sTTL\s", re.IGNORECASE)
_QUOTED_RE = re.compile(r"'(?:[^'\\]|\\.)*'")

BlockSettings = Callable[[int], Mapping[str, Any]] | Mapping[str, Any] | None


@dataclass(frozen=True)
class InsertStats:
    rows: int
    bytes: int
    blocks: int


class Warehouse(Protocol):
    """What the driver and executors need of ClickHouse (an in-memory twin can stand in)."""

    def staging_view(self, tables: Iterable[str]) -> dict[str, dict[str, int] | None]: ...

    def move_partition(self, staging: str, partition_id: str, target: str) -> None: ...

    def move_partitions(self, staging: str, partition_ids: Sequence[str], target: str) -> None: ...

    def drop_staging(self, table: str) -> None: ...

    def drop_stagings(self, tables: Sequence[str]) -> None: ...

    def list_staging(self, prefix: str) -> list[str]: ...

    def staging_sizes(self, prefix: str) -> dict[str, dict[str, int]]: ...

    def ensure_staging_db(self) -> None: ...

    def create_staging(
        self, target: str, table: str, expected: TargetInfo | None = None
    ) -> None: ...

    def insert_blocks(
        self,
        table: str,
        batches: Iterable[pa.RecordBatch],
        *,
        block_rows: int,
        block_bytes: int,
        settings: BlockSettings = None,
    ) -> InsertStats: ...

    def partition_rows(self, table: str, db: str | None = None) -> dict[str, int]: ...

    def staged_partitions(
        self, table: str, every_part: bool = False
    ) -> dict[str, tuple[int, tuple[str, ...]]]: ...

    def staged_part_rows(self, table: str) -> dict[str, dict[str, int]]: ...

    def drop_parts(self, staging: str, partition_id: str, evidence: Sequence[str]) -> None: ...

    def published_uuids(self, target: str, uuids: Iterable[str]) -> frozenset[str]: ...

    def create_batch_staging(self, table: str, like: str, target: str = "") -> None: ...

    def attach_all(self, staging: str, target: str, tag: str = "") -> None: ...

    def claim_staging(self, staging: str, claimed: str) -> None: ...

    def attach_logged(self, target: str, tag: str, since: float) -> bool: ...

    def settle(self, names: Iterable[str]) -> bool: ...

    def consolidate(self, staging: str, partition_id: str, batch_staging: str) -> None: ...

    def target_info(self, target: str) -> TargetInfo: ...

    def dependent_views(self, target: str) -> tuple[str, ...]: ...


class ClickHouseWarehouse:
    """:class:`Warehouse` over one :class:`Client`. Cheap to create; holds no state."""

    def __init__(self, client: Client, staging_db: str = DEFAULT_STAGING_DB) -> None:
        if not _DB_RE.match(staging_db):
            raise ConfigError(
                f"staging database {staging_db!r} must be a plain identifier "
                "([A-Za-z_][A-Za-z0-9_]*)"
            )
        self.client = client
        self.staging_db = staging_db

    # ------------------------------------------------------------------ staging naming

    def _staging(self, table: str, action: str) -> str:
        """Qualified name of a txsink staging table; ConfigError for any other name."""
        if parse_staging(table) is None:
            raise ConfigError(
                f"refusing to {action} {self.staging_db}.{table}: not a txsink staging table "
                f"name (see txsink.protocol.ids); txsink never touches tables it did not name"
            )
        return qualified(self.staging_db, table)

    # ------------------------------------------------------------------ observation

    def staging_view(self, tables: Iterable[str]) -> dict[str, dict[str, int] | None]:
        """Rows per partition id of each staging table; None for a table that is missing.

        Partitions without rows are left out: after MOVE/DROP PARTITION ClickHouse 26.9
        keeps an empty active part covering the moved range until cleanup.
        """
        names = sorted(set(tables))
        if not names:
            return {}
        rows = self.client.query_rows(
            "SELECT name, '' AS partition_id, toUInt64(0) AS rows FROM system.tables "
            "WHERE database = {db:String} AND name IN {names:Array(String)} "
            "UNION ALL "
            "SELECT table, partition_id, sum(rows) FROM system.parts "
            "WHERE active AND database = {db:String} AND table IN {names:Array(String)} "
            "GROUP BY table, partition_id HAVING sum(rows) > 0",
            parameters={"db": self.staging_db, "names": names},
            what=f"read staging partitions of {len(names)} table(s) in {self.staging_db}",
        )
        view: dict[str, dict[str, int] | None] = dict.fromkeys(names)
        for name, pid, n in rows:
            parts = view.get(name)
            if parts is None:
                parts = view[name] = {}
            if pid:
                parts[pid] = parts.get(pid, 0) + int(n)
        # A table whose parts were listed but whose system.tables row raced away (dropped
        # between the two reads) is reported with its rows: the conservative answer.
        return view

    def partition_rows(self, table: str, db: str | None = None) -> dict[str, int]:
        """Rows per partition id of any table (``table`` is ``db.table`` when db is None)."""
        if db is None:
            db, table = split_table(table)
        rows = self.client.query_rows(
            "SELECT partition_id, sum(rows) FROM system.parts "
            "WHERE active AND database = {db:String} AND table = {t:String} "
            "GROUP BY partition_id HAVING sum(rows) > 0",
            parameters={"db": db, "t": table},
            what=f"read partitions of {db}.{table}",
        )
        return {pid: int(n) for pid, n in rows}

    def staged_partitions(
        self, table: str, every_part: bool = False
    ) -> dict[str, tuple[int, tuple[str, ...]]]:
        """Rows and evidence ids (short part UUIDs, see
        :func:`~txsink.protocol.states.short_uuids`) per partition of one staging table:
        those of the largest parts (what a manifest records), or of ``every_part`` (what
        a resumed publish compares with the target)."""
        by_pid: dict[str, list[tuple[int, str]]] = {}
        for pid, n, uuid in self._staged_parts(table):
            by_pid.setdefault(pid, []).append((n, uuid))
        return {
            pid: (
                sum(n for n, _ in parts),
                short_uuids(parts, None if every_part else MAX_PART_UUIDS),
            )
            for pid, parts in by_pid.items()
        }

    def staged_part_rows(self, table: str) -> dict[str, dict[str, int]]:
        """Every active part of one staging table: partition id -> {evidence id: rows}."""
        out: dict[str, dict[str, int]] = {}
        for pid, n, uuid in self._staged_parts(table):
            for short in short_uuids([(n, uuid)], None):
                out.setdefault(pid, {})[short] = n
        return out

    def _staged_parts(self, table: str) -> list[tuple[str, int, str]]:
        """(partition id, rows, UUID) of every active part of one staging table."""
        self._staging(table, "read")
        rows = self.client.query_rows(
            "SELECT partition_id, rows, toString(uuid) FROM system.parts "
            "WHERE active AND rows > 0 AND database = {db:String} AND table = {t:String}",
            parameters={"db": self.staging_db, "t": table},
            what=f"read staged parts of {self.staging_db}.{table}",
        )
        return [(str(pid), int(n), str(uuid)) for pid, n, uuid in rows]

    def drop_parts(self, staging: str, partition_id: str, evidence: Sequence[str]) -> None:
        """Drop the active parts of one staging partition whose evidence ids are
        ``evidence`` (parts a cut MOVE already put in the target). Looked up by UUID at
        the moment of the drop: a part gone already (a repeat after a lost reply) is
        simply not dropped again."""
        fq = self._staging(staging, "drop parts of")
        wanted = sorted(set(evidence))
        if not wanted:
            return
        names = self.client.query_rows(
            "SELECT name FROM system.parts WHERE active AND database = {db:String} "
            "AND table = {t:String} AND partition_id = {p:String} AND "
            "substring(replaceAll(toString(uuid), '-', ''), 1, {n:UInt8}) IN {ids:Array(String)}",
            parameters={"db": self.staging_db, "t": staging, "p": partition_id,
                        "ids": wanted, "n": len(wanted[0])},
            what=f"find the parts of {fq} already in the target",
        )  # fmt: skip
        for at in range(0, len(names), MAX_COMMANDS):
            commands = ", ".join(
                f"DROP PART {quote_literal(str(r[0]))}" for r in names[at : at + MAX_COMMANDS]
            )
            self.client.command(
                f"ALTER TABLE {fq} {commands}",
                idempotent=False,
                table=f"{self.staging_db}.{staging}",
                what=f"drop from {fq} the parts already in the target",
            )

    def published_uuids(self, target: str, uuids: Iterable[str]) -> frozenset[str]:
        """Which evidence ids (short part UUIDs) the target's parts still show, active or
        outdated (moved parts keep their UUID until a merge in the target replaces them
        and the replaced parts are cleaned up)."""
        wanted = sorted(set(uuids))
        if not wanted:
            return frozenset()
        db, name = split_table(target)
        rows = self.client.query_rows(
            "SELECT DISTINCT substring(replaceAll(toString(uuid), '-', ''), 1, {n:UInt8}) AS u "
            "FROM system.parts WHERE database = {db:String} AND table = {t:String} "
            "AND u IN {ids:Array(String)}",
            parameters={"db": db, "t": name, "ids": wanted, "n": len(wanted[0])},
            what=f"look for published parts in {target}",
        )
        return frozenset(str(r[0]) for r in rows)

    def list_staging(self, prefix: str) -> list[str]:
        """Staging tables of one job prefix (``prefix + "__"``), sorted."""
        rows = self.client.query_rows(
            "SELECT name FROM system.tables WHERE database = {db:String} "
            "AND startsWith(name, {p:String}) ORDER BY name",
            parameters={"db": self.staging_db, "p": prefix + "__"},
            what=f"list staging tables {prefix}__* in {self.staging_db}",
        )
        return [r[0] for r in rows]

    def staging_sizes(self, prefix: str) -> dict[str, dict[str, int]]:
        """``{table: {"rows": n, "bytes": n}}`` of one job's staging tables (status)."""
        rows = self.client.query_rows(
            "SELECT name, ifNull(total_rows, 0), ifNull(total_bytes, 0) FROM system.tables "
            "WHERE database = {db:String} AND startsWith(name, {p:String}) ORDER BY name",
            parameters={"db": self.staging_db, "p": prefix + "__"},
            what=f"size staging tables {prefix}__* in {self.staging_db}",
        )
        return {name: {"rows": int(r), "bytes": int(b)} for name, r, b in rows}

    def target_info(self, target: str, *, views: bool = True) -> TargetInfo:
        """Everything compat checks need about ``db.table``; ConfigError if it is missing.

        One round trip (scalar subqueries over the system tables): it runs for every
        staging table a task creates. ``views=False`` skips the scan of materialized views
        (a staging table has none)."""
        db, name = split_table(target)
        sub = "WHERE database = {db:String} AND table = {t:String}"
        mvs = (
            "(SELECT groupArray((database, name, if(as_select != '', as_select, "
            "create_table_query))) FROM system.tables WHERE engine = 'MaterializedView')"
            if views
            else "[]"
        )
        rows = self.client.query_rows(
            "SELECT engine, engine_full, partition_key, sorting_key, primary_key, "
            "sampling_key, storage_policy, dependencies_database, dependencies_table, "
            "create_table_query, "
            "(SELECT groupArray((position, name, type, default_kind, default_expression, "
            f"compression_codec)) FROM system.columns {sub}), "
            "(SELECT groupArray((name, type_full, toString(granularity), expr)) "
            f"FROM system.data_skipping_indices {sub}), "
            f"(SELECT groupArray((name, query)) FROM system.projections {sub}), "
            "(SELECT groupArray((name, value)) FROM system.merge_tree_settings "
            f"WHERE name IN {{names:Array(String)}}), {mvs}, "
            "(SELECT groupArray((if(zookeeper_name IN ('', 'default'), '', "
            "zookeeper_name || ':') || zookeeper_path, replica_name)) "
            f"FROM system.replicas {sub}) "
            "FROM system.tables WHERE database = {db:String} AND name = {t:String}",
            parameters={"db": db, "t": name, "names": list(MERGE_TREE_SETTING_KEYS)},
            what=f"inspect {target}",
            table=target,
        )
        if not rows:
            raise ConfigError(
                f"table {db}.{name} does not exist on {self.client.url}; create it first or "
                f"fix the table option",
                code=60,
            )
        (
            engine, engine_full, pkey, skey, prkey, sampling, policy, dep_dbs, dep_tables, ddl,
            cols, idx, projs, defaults, views_found, replicas,
        ) = rows[0]  # fmt: skip
        keeper_path, replica = (str(replicas[0][0]), str(replicas[0][1])) if replicas else ("", "")
        columns = tuple(ColumnInfo(n, t, k, e, c) for _, n, t, k, e, c in sorted(cols))
        found = {f"{d}.{t}" for d, t in zip(dep_dbs, dep_tables, strict=False)}
        found |= {
            f"{vdb}.{vname}"
            for vdb, vname, select in views_found
            if reads_from(str(select), str(vdb), db, name)
        }
        indices = tuple(f"{n} TYPE {tf} GRANULARITY {g} ON {e}" for n, tf, g, e in sorted(idx))
        projections = tuple(f"{n}: {q}" for n, q in sorted(projs))
        settings: dict[str, str] = {}
        if str(engine).endswith("MergeTree"):
            settings.update((k, str(v)) for k, v in defaults)
            settings.update(parse_settings_clause(str(engine_full)))
        return TargetInfo(
            database=db,
            table=name,
            engine=str(engine),
            engine_full=str(engine_full),
            partition_key=str(pkey),
            sorting_key=str(skey),
            primary_key=str(prkey),
            sampling_key=str(sampling),
            storage_policy=str(policy),
            columns=columns,
            dependent_views=tuple(sorted(found)),
            settings=settings,
            skip_indices=indices,
            projections=projections,
            table_ttl=bool(_TTL_RE.search(_QUOTED_RE.sub("''", str(engine_full)))),
            ttl_columns=ttl_columns(str(ddl)),
            zookeeper_path=keeper_path,
            replica_name=replica,
        )

    def dependent_views(self, target: str) -> tuple[str, ...]:
        """Materialized views fed by ``db.table`` now (the commit's re-check of attach
        mode), by ``dependencies_table`` and by a scan of every view's SELECT (older
        servers fill the former inconsistently); one round trip."""
        db, name = split_table(target)
        rows = self.client.query_rows(
            "SELECT 1, dependencies_database, dependencies_table, '' FROM system.tables "
            "WHERE database = {db:String} AND name = {t:String} "
            "UNION ALL "
            "SELECT 2, [database], [name], if(as_select != '', as_select, create_table_query) "
            "FROM system.tables WHERE engine = 'MaterializedView'",
            parameters={"db": db, "t": name},
            what=f"read views of {target}",
            table=target,
        )
        views: set[str] = set()
        for kind, dbs, names, select in rows:
            if kind == 1:
                views |= {f"{d}.{t}" for d, t in zip(dbs, names, strict=False)}
            elif reads_from(str(select), str(dbs[0]), db, name):
                views.add(f"{dbs[0]}.{names[0]}")
        return tuple(sorted(views))

    def expand_macros(self, text: str) -> str:
        """``text`` with every ``{name}`` replaced by the server's macro of that name (a
        Distributed table's ``engine_full`` keeps ``'{cluster}'`` as written)."""
        names = sorted(set(re.findall(r"\{([A-Za-z_][A-Za-z0-9_]*)\}", text)))
        if not names:
            return text
        rows = self.client.query_rows(
            "SELECT " + ", ".join(f"getMacro({quote_literal(n)})" for n in names),
            what=f"expand the macros of {text!r}",
        )
        for name, value in zip(names, rows[0], strict=True):
            text = text.replace("{" + name + "}", str(value))
        return text

    def cluster_replicas(self, cluster: str) -> list[ClusterReplica]:
        """The rows of ``system.clusters`` for ``cluster`` on this server (the shards a
        ``Distributed`` table over it writes to)."""
        rows = self.client.query_rows(
            "SELECT shard_num, shard_weight, replica_num, host_name FROM system.clusters "
            "WHERE cluster = {c:String} ORDER BY shard_num, replica_num",
            parameters={"c": cluster},
            what=f"read cluster {cluster} from system.clusters",
        )
        return [ClusterReplica(int(s), int(w), int(r), str(h)) for s, w, r, h in rows]

    # ------------------------------------------------------------------ staging lifecycle

    def ensure_staging_db(self) -> None:
        self.client.command(
            f"CREATE DATABASE IF NOT EXISTS {quote_ident(self.staging_db)}",
            table=self.staging_db,
        )

    def create_staging(self, target: str, table: str, expected: TargetInfo | None = None) -> None:
        """(Re)create ``staging_db.table`` as an exact structural copy of ``target``.

        ``CREATE TABLE ... AS target SETTINGS <STAGING_SETTINGS>`` (the settings override
        the target's own), then one read of the copy to check it can be moved and really
        carries those settings (an ALTER adds them otherwise), and an ALTER removing
        inherited TTLs if there are any: two or three round trips per task. A table of
        the same name is garbage from an earlier try of the same task attempt id (never
        reused within an epoch): it is dropped and the table created again. ``expected``
        is the target as the driver saw it (saves one round of system-table queries per
        task); on a mismatch the target is read again before giving up, in case it was
        altered. A replicated target's staging gets an engine clause of its own
        (:meth:`_create`), built from the target as *this* server has it now (its replica
        name, Keeper path, keys and policy: a clause from an old or another server's view
        would create staging that cannot be moved, found only after PREPARED), and must
        be on the replica ``expected`` was read from: staging exists on one replica only,
        and the driver moves it through the same URL.
        """
        fq = self._staging(table, "create")
        reuse = expected is not None and not expected.is_replicated
        wanted = expected if expected is not None and reuse else self.target_info(target)
        if expected is not None and not reuse and wanted.is_replicated:
            check_same_replica(expected, wanted, self.client)
        staged = self._create(fq, target, table, wanted)
        problem = check_move_compat(staged, wanted)
        if problem and reuse:
            wanted = self.target_info(target)
            problem = check_move_compat(staged, wanted)
            if problem and wanted.is_replicated:  # its engine clause came from the stale view
                staged = self._create(fq, target, table, wanted)
                problem = check_move_compat(staged, wanted)
        if problem:
            self.client.command(f"DROP TABLE IF EXISTS {fq} SYNC")
            raise ConfigError(problem)
        self._protect(fq, staged)

    def _create(self, fq: str, target: str, table: str, wanted: TargetInfo) -> TargetInfo:
        """``CREATE TABLE fq AS target`` with the staging settings, replacing a garbage
        table of the same name; for a replicated target, with an engine clause of its own
        (:func:`~.compat.staging_engine_clause`) whose Keeper path a leftover replica may
        hold (a DROP that never reached Keeper): that replica is dropped from Keeper first
        (the path is txsink's own and names this one staging table; ClickHouse refuses to
        drop a replica that is active or attached).
        Returns the staging table as created."""
        db, name = split_table(target)
        settings = ", ".join(f"{k} = {v}" for k, v in STAGING_SETTINGS.items())
        storage = f"SETTINGS {settings}"
        keeper_path = ""
        if wanted.is_replicated:
            keeper_path = staging_keeper_path(wanted, self.staging_db, table)
            storage = staging_engine_clause(wanted, keeper_path, STAGING_SETTINGS)

        def create() -> None:
            self.client.command(
                f"CREATE TABLE {fq} AS {qualified(db, name)} {storage}",
                idempotent=False,  # a blind repeat after a lost reply fails "already exists"
                table=target,
                what=f"create staging {self.staging_db}.{table} AS {target}",
            )

        try:
            create()
        except TxSinkError as exc:
            if exc.code == TABLE_ALREADY_EXISTS:
                self.client.command(
                    f"DROP TABLE IF EXISTS {fq} SYNC", table=f"{self.staging_db}.{table}"
                )
            elif exc.code in (REPLICA_ALREADY_EXISTS, METADATA_MISMATCH) and keeper_path:
                log.warning("staging %s: dropping leftover replica at %s", fq, keeper_path)
                self.client.command(
                    f"SYSTEM DROP REPLICA {quote_literal(wanted.replica_name)} "
                    f"FROM ZKPATH {quote_literal(keeper_path)}",
                    table=f"{self.staging_db}.{table}",
                    what=f"drop the leftover Keeper replica of staging {fq}",
                )
            else:
                raise
            create()
        return self.target_info(f"{self.staging_db}.{table}", views=False)

    def _protect(self, fq: str, staged: TargetInfo) -> None:
        """Make the (still empty) staging table keep every row until it is moved.

        A TTL inherited from the target would delete old rows (late or backfilled data)
        in a TTL merge before publish; a column TTL would reset their values. Removing
        both from staging does not stop MOVE PARTITION into the target (checked on
        26.9), which applies its own TTL after the move. The settings normally came
        with the CREATE; they are added here if the server did not keep them. Everything
        here is table metadata, so it survives a server restart.
        """
        clauses = ["REMOVE TTL"] if staged.table_ttl else []
        clauses += [f"MODIFY COLUMN {quote_ident(c)} REMOVE TTL" for c in staged.ttl_columns]
        have = parse_settings_clause(staged.engine_full)
        if any(have.get(k) != str(v) for k, v in STAGING_SETTINGS.items()):
            clauses.append(
                "MODIFY SETTING " + ", ".join(f"{k} = {v}" for k, v in STAGING_SETTINGS.items())
            )
        if not clauses:
            return
        self.client.command(
            f"ALTER TABLE {fq} {', '.join(clauses)}",
            idempotent=True,
            table=fq,
            what=f"protect staging {fq} (no TTL, no merges, no dedup, part UUIDs)",
        )

    def drop_staging(self, table: str) -> None:
        self.drop_stagings([table])

    def drop_stagings(self, tables: Sequence[str]) -> None:
        """Drop staging tables, ``MAX_COMMANDS`` per ``DROP TABLE IF EXISTS a, b, ... SYNC``."""
        names = [self._staging(t, "drop") for t in tables]
        for at in range(0, len(names), MAX_COMMANDS):
            self.client.command(
                f"DROP TABLE IF EXISTS {', '.join(names[at : at + MAX_COMMANDS])} SYNC",
                table=f"{self.staging_db}.{tables[at]}",
            )

    def create_batch_staging(self, table: str, like: str, target: str = "") -> None:
        """Create the batch staging ``table`` (``visibility=batch``) as a copy of the
        ``target`` as it is now (with the staging settings and protections of
        :meth:`create_staging`), or of the task staging table ``like`` when no target is
        given. From the target, not from a task's staging: a task staged before an
        ``ADD COLUMN`` on the target would give it the old structure, and the newer tasks'
        staging could not be moved into it; older task staging catches up with a newer
        batch staging like any staging with its target. Idempotent: an existing table is
        kept (another finisher may already have moved rows into it), never replaced."""
        fq = self._staging(table, "create")
        if target:
            db, name = split_table(target)
            src = qualified(db, name)
        else:
            src = self._staging(like, "copy")
        settings = ", ".join(f"{k} = {v}" for k, v in STAGING_SETTINGS.items())
        self.client.command(
            f"CREATE TABLE IF NOT EXISTS {fq} AS {src}"
            + (f" SETTINGS {settings}" if target else ""),
            idempotent=True,
            table=f"{self.staging_db}.{table}",
            what=f"create batch staging {fq} AS {src}",
        )
        if target:
            self._protect(fq, self.target_info(f"{self.staging_db}.{table}", views=False))

    def consolidate(self, staging: str, partition_id: str, batch_staging: str) -> None:
        """MOVE one task staging partition into the batch staging table (readers of the
        target see neither). Idempotent like :meth:`move_partition`."""
        self._staging(batch_staging, "move partitions into")
        self.move_partition(staging, partition_id, f"{self.staging_db}.{batch_staging}")

    def attach_all(self, staging: str, target: str, tag: str = "") -> None:
        """``ATTACH PARTITION ALL FROM`` the batch staging: every part in one commit.

        Not idempotent (it copies) and never retried blindly: the caller claimed the
        batch staging and re-observed (part UUIDs in the target, ``tag`` in the query
        log) before. ``tag`` goes into ``system.query_log`` as the statement's
        ``log_comment``, whatever the user's profile says about logging."""
        fq = self._staging(staging, "attach from")
        db, name = split_table(target)
        logged = {
            "log_queries": 1,
            "log_comment": tag,
            "log_queries_min_type": "QUERY_START",
            "log_queries_min_query_duration_ms": 0,
            "log_queries_probability": 1,
        }

        def attach(note: str = "") -> None:
            self.client.command(
                f"ALTER TABLE {qualified(db, name)} ATTACH PARTITION ALL FROM {fq}",
                settings=logged if tag else None,
                idempotent=False,
                table=target,
                what=f"ATTACH PARTITION ALL FROM {fq} into {target}{note}",
            )

        try:
            attach()
        except TxSinkError as exc:
            if exc.code not in (36, 122):  # a definite structure refusal: nothing attached
                raise
            self._catch_up_columns(staging, target, exc)
            attach(" (after adding the target's new columns to batch staging)")

    def claim_staging(self, staging: str, claimed: str) -> None:
        """``RENAME TABLE staging TO claimed``: atomic, so of several finishers renaming
        one batch staging table exactly one holds it afterwards; the others find it gone
        (RetryableConflict: re-observe)."""
        src = self._staging(staging, "claim")
        dst = self._staging(claimed, "claim")
        try:
            self.client.command(
                f"RENAME TABLE {src} TO {dst}",
                idempotent=False,
                table=f"{self.staging_db}.{staging}",
                what=f"claim batch staging {src} as {dst}",
            )
        except TxSinkError as exc:
            if exc.code not in (60, 81):  # UNKNOWN_TABLE / UNKNOWN_DATABASE: taken already
                raise
            raise RetryableConflict(
                f"batch staging {src} was claimed by another finisher of its xid; re-observing"
            ) from exc

    def attach_logged(self, target: str, tag: str, since: float) -> bool:
        """Whether ``system.query_log`` shows an ATTACH tagged ``tag`` (its
        ``log_comment``) that finished, since the day before ``since`` (unix time).
        Flushes the logs first. A server without a query log is a ConfigError: nothing
        else proves an ATTACH whose parts the target has merged away."""
        try:
            self.client.command("SYSTEM FLUSH LOGS", what="flush the query log")
            # merge(): a server upgrade that changes the log's columns renames the old
            # table to query_log_0, _1, ...; the entry may be there
            rows = self.client.query_rows(
                "SELECT count() FROM merge('system', '^query_log(_[0-9]+)?$') WHERE "
                "event_date >= toDate(toDateTime({since:Int64})) - 7 AND type = 'QueryFinish' "
                "AND log_comment = {tag:String} AND query_kind = 'Alter'",
                parameters={"since": int(since), "tag": tag},
                what=f"look in system.query_log for an ATTACH into {target}",
            )
        except TxSinkError as exc:
            if exc.code not in (60, 497):  # no query_log table / no privilege to read it
                raise
            raise ConfigError(
                f"visibility=batch into {target} needs system.query_log (readable by this "
                f"user, and SYSTEM FLUSH LOGS) to prove an ATTACH landed: {exc}. Enable the "
                f"server's <query_log> or use visibility=partition (docs/modes.md#visibility)",
                code=exc.code,
            ) from exc
        return int(rows[0][0]) > 0

    def settle(self, names: Iterable[str]) -> bool:
        """True when the server answers and runs no statement whose text contains any of
        ``names`` (staging tables or a common prefix of them; other than this probe): a
        MOVE whose reply was lost has then ended, one way or the other, and what it left
        can be observed. A client that goes away does not stop a running ALTER on the
        server, so this is how a resumed publish knows it is alone."""
        names = sorted({n for n in names if n})
        if len(names) > 200:  # multiSearchAny takes fewer than 256 needles
            raise ConfigError(f"settle: {len(names)} names; pass a common prefix instead")
        if not names:
            return bool(self.client.ping())
        rows = self.client.query_rows(
            "SELECT count() FROM system.processes "
            "WHERE query_id != queryID() AND multiSearchAny(query, {names:Array(String)})",
            parameters={"names": names},
            what="look for statements still running on staging",
        )
        return int(rows[0][0]) == 0

    def move_partition(self, staging: str, partition_id: str, target: str) -> None:
        """Publish one staged partition. Idempotent: once moved, a repeat moves nothing."""
        self.move_partitions(staging, [partition_id], target)

    def move_partitions(self, staging: str, partition_ids: Sequence[str], target: str) -> None:
        """Publish staged partitions of one staging table, in ALTERs of up to
        ``MAX_COMMANDS`` MOVE commands (one round trip for most tasks: each command is
        atomic per partition, not the statement). Idempotent: a partition already moved
        moves nothing, so a repeat moves only what is left. Every id is checked before the
        first statement: a bad one must not stop the publish half-way."""
        for partition_id in partition_ids:
            if not _PARTITION_ID_RE.match(partition_id):
                raise ConfigError(
                    f"partition id {partition_id!r} of staging {staging} is not a ClickHouse "
                    "partition id; the manifest is corrupt: run `txsink verify`"
                )
        for at in range(0, len(partition_ids), MAX_COMMANDS):
            self._move(staging, partition_ids[at : at + MAX_COMMANDS], target)

    def _move(self, staging: str, partition_ids: Sequence[str], target: str) -> None:
        fq = self._staging(staging, "move partitions out of")
        if not partition_ids:
            return
        db, name = split_table(target)
        dest = qualified(db, name)
        commands = ", ".join(
            f"MOVE PARTITION ID {quote_literal(p)} TO TABLE {dest}" for p in partition_ids
        )
        shown = partition_ids[0] if len(partition_ids) == 1 else f"s {', '.join(partition_ids)}"

        def move(note: str = "") -> None:
            # Not retried blindly: a repeat sent while the first MOVE still runs on the
            # server could copy the same parts twice. An ambiguous failure surfaces, and
            # the resumed publish re-observes (staging rows, part UUIDs in the target).
            self.client.command(
                f"ALTER TABLE {fq} {commands}",
                idempotent=False,
                table=f"{self.staging_db}.{staging}",
                what=f"MOVE PARTITION ID{shown} of {self.staging_db}.{staging} "
                f"TO TABLE {target}{note}",
            )

        try:
            move()
        except TxSinkError as exc:
            if exc.code not in (36, 122):  # BAD_ARGUMENTS / INCOMPATIBLE_COLUMNS: structure
                raise
            self._catch_up_columns(staging, target, exc)
            move(" (after adding the target's new columns to staging)")

    def _catch_up_columns(self, staging: str, target: str, exc: TxSinkError) -> None:
        """The target was altered after the batch was staged: add the columns it gained to
        staging, or raise RecoveryAlarm naming the difference and the next step."""
        fq = qualified(self.staging_db, staging)
        mine = self.target_info(f"{self.staging_db}.{staging}")
        theirs = self.target_info(target)
        additions, problem = plan_column_catch_up(mine, theirs)
        if problem:
            raise RecoveryAlarm(problem, code=exc.code) from exc
        if not additions:
            raise ConfigError(
                f"MOVE PARTITION from staging {self.staging_db}.{staging} into {target} "
                f"failed ({exc}) although their structures look alike; run `txsink verify` "
                f"and see docs/operations.md#target-altered",
                code=exc.code,
            ) from exc
        clauses = ", ".join(add_column_clause(a) for a in additions)
        log.warning(
            "target %s gained column(s) %s after staging %s was created; adding them to "
            "staging before the MOVE",
            target, ", ".join(a.column.name for a in additions), staging,
        )  # fmt: skip
        self.client.command(
            f"ALTER TABLE {fq} {clauses}",
            idempotent=True,  # IF NOT EXISTS: a repeat after a lost reply is a no-op
            table=f"{self.staging_db}.{staging}",
            what=f"add the target's new columns to staging {self.staging_db}.{staging}",
        )

    # ------------------------------------------------------------------ inserts

    def insert_blocks(
        self,
        table: str,
        batches: Iterable[pa.RecordBatch],
        *,
        block_rows: int,
        block_bytes: int,
        settings: BlockSettings = None,
    ) -> InsertStats:
        """Send ``batches`` as blocks of at most ``block_rows`` rows / ``block_bytes`` bytes.

        ``table`` is ``db.table``, or a bare staging table name (in ``staging_db``; its
        inserts run with ``optimize_on_insert=0``). ``settings`` is a dict for every block
        or a callable ``block_index -> dict`` (dedup mode: a per-block
        ``insert_deduplication_token``).
        A block is retried after an ambiguous failure only if it carries such a token.
        Block boundaries depend only on the batch sizes, so a replay of the same data cuts
        the same blocks.
        """
        if block_rows < 1 or block_bytes < 1:
            raise ConfigError(
                f"block_rows={block_rows} / block_bytes={block_bytes} must both be >= 1"
            )
        if "." not in table and "`" not in table:
            self._staging(table, "insert into")
            db, name = self.staging_db, table
            # Staged rows == sent rows: the target's own merges (Replacing/Summing/...)
            # and deduplication apply after the MOVE, not here.
            base: Mapping[str, Any] = STAGING_INSERT_SETTINGS
        else:
            db, name = split_table(table)
            base = {}
        rows = size = blocks = 0
        for block in iter_blocks(batches, block_rows=block_rows, block_bytes=block_bytes):
            extra = settings(blocks) if callable(settings) else settings
            block_settings = self.client.known({**base, **(extra or {})}, OPTIONAL_INSERT_SETTINGS)
            idempotent = bool(block_settings.get("insert_deduplication_token"))
            self.client.insert_arrow(
                db, name, block, settings=block_settings or None, idempotent=idempotent
            )
            rows += block.num_rows
            size += block.nbytes
            blocks += 1
            del block  # let the block go before the next one is assembled
        log.debug("inserted %d rows (%d bytes) in %d blocks into %s", rows, size, blocks, table)
        return InsertStats(rows, size, blocks)


def check_same_replica(expected: TargetInfo, now: TargetInfo, client: Any) -> None:
    """ConfigError unless ``now`` (read through this connection) is the replica of the
    replicated target that ``expected`` (the driver's validation) was read from: a URL
    that reaches another replica (a load balancer, DNS round robin) would stage where the
    driver's MOVE cannot find it. Caught here before any row is written, by chance only
    (each request may reach another server); docs/modes.md#replicated-targets."""
    if (now.replica_name, now.zookeeper_path) == (expected.replica_name, expected.zookeeper_path):
        return
    url = getattr(client, "url", "the url option")
    raise ConfigError(
        f"{expected.name} through {url} reached replica {now.replica_name!r} "
        f"({now.zookeeper_path}), but the driver validated replica "
        f"{expected.replica_name!r} ({expected.zookeeper_path}) through the same URL: it "
        f"leads to more than one server (a load balancer?), or the table was created again "
        f"since. Attach mode stages on one "
        f"replica and moves there; name one server per shard (url/shards), or use "
        f"mode=dedup. Nothing was written"
    )


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


# --------------------------------------------------------------------------- parsing helpers

_SETTINGS_TAIL_RE = re.compile(r"\sSETTINGS\s+(.*)$", re.DOTALL)
_SETTING_RE = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_]*)\s*=\s*('(?:[^'\\]|\\.)*'|[^,]+?)\s*(?:,|$)")


def parse_settings_clause(engine_full: str) -> dict[str, str]:
    """``... SETTINGS a = 1, storage_policy = 'x'`` -> ``{"a": "1", "storage_policy": "x"}``."""
    m = _SETTINGS_TAIL_RE.search(engine_full)
    if not m:
        return {}
    out: dict[str, str] = {}
    for key, value in _SETTING_RE.findall(m.group(1)):
        out[key] = value[1:-1] if value.startswith("'") else value
    return out


def add_column_clause(add: AddColumn) -> str:
    """``ADD COLUMN IF NOT EXISTS `c` T [DEFAULT e] [CODEC(...)] AFTER `x``` (or FIRST)."""
    col = add.column
    sql = f"ADD COLUMN IF NOT EXISTS {quote_ident(col.name)} {col.type}"
    if col.default_kind in ("DEFAULT", "MATERIALIZED", "ALIAS", "EPHEMERAL"):
        sql += f" {col.default_kind}"
        if col.default_expression:
            sql += f" {col.default_expression}"
    if col.codec:
        sql += f" {col.codec}"
    return sql + (f" AFTER {quote_ident(add.after)}" if add.after else " FIRST")


def ttl_columns(create_query: str) -> tuple[str, ...]:
    """Columns with a column TTL in a ``system.tables.create_table_query``."""
    start = create_query.find("(")
    if start < 0:
        return ()
    try:
        end = start + closing_paren(create_query[start:])
    except ValueError:
        end = len(create_query)
    found = []
    for element in split_top_level(create_query[start + 1 : end]):
        m = re.match(r"^(`(?:[^`\\]|\\.)+`|[A-Za-z_][A-Za-z0-9_]*)\s+(.*)$", element, re.DOTALL)
        if not m or m.group(1).upper() in ("INDEX", "PROJECTION", "CONSTRAINT"):
            continue
        if _TTL_RE.search(_QUOTED_RE.sub("''", m.group(2))):
            found.append(re.sub(r"\\(.)", r"\1", m.group(1).strip("`")))
    return tuple(found)


def reads_from(select: str, view_db: str, db: str, table: str) -> bool:
    """Whether a view's SELECT reads FROM ``db.table`` (unqualified names are ``view_db``)."""
    ident = r"(?:`(?:[^`\\]|\\.)+`|[A-Za-z_][A-Za-z0-9_]*)"
    for m in re.finditer(rf"\bFROM\s+({ident})(?:\s*\.\s*({ident}))?", select, re.IGNORECASE):
        first, second = m.group(1).strip("`"), m.group(2)
        src_db, src = (first, second.strip("`")) if second else (view_db, first)
        if src_db == db and src == table:
            return True
    return False
