"""What txsink reads from a ClickHouse server: staging partitions and part UUIDs, a
target's structure and views, cluster definitions, the query log, running statements.

Owned by the ClickHouse adapter: :class:`Observer` is the base of
:class:`~txsink.clickhouse.warehouse.ClickHouseWarehouse` (one client, one staging
database) and holds the read-only half of the :class:`~txsink.ports.warehouse.Warehouse`
port. Invariants: nothing here writes (``SYSTEM FLUSH LOGS`` aside); only tables whose
name :func:`~txsink.protocol.ids.parse_staging` recognises are read as staging; answers
are conservative (a table seen in ``system.parts`` but raced away from ``system.tables``
is reported with its rows).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Sequence
from typing import Any

from txsink.clickhouse.client import Client
from txsink.clickhouse.replicated_ddl import split_engine
from txsink.clickhouse.sqltext import (
    called_functions,
    has_ttl,
    log_ttl_seconds,
    parse_settings_clause,
    reads_from,
    ttl_columns,
)
from txsink.errors import ConfigError, TxSinkError
from txsink.names import qualified, quote_literal, split_table
from txsink.ports.warehouse import ClusterReplica, ColumnInfo, CommitLook, TargetInfo
from txsink.protocol.evidence_life import EvidenceLife
from txsink.protocol.ids import parse_staging
from txsink.protocol.ops import BatchShape
from txsink.protocol.states import MAX_PART_UUIDS, short_uuids

DEFAULT_STAGING_DB = "txsink_staging"
# Commands per grouped statement (MOVE PARTITION, DROP TABLE): ClickHouse refuses any
# statement over max_query_size (256 KiB by default) on every retry, so one ALTER for a
# backfill task's thousands of partitions would wedge its PREPARED xid. 200 commands stay
# under 64 KiB at ClickHouse's name length limits.
MAX_COMMANDS = 200
# Staging names listed in one read's parameter (beyond: their common prefix selects them)
MAX_LISTED_NAMES = 200
TABLE_ALREADY_EXISTS = 57
CANNOT_EXTRACT_TABLE_STRUCTURE = 636  # merge() over no table: "no tables satisfied regexp"
REPLICA_ALREADY_EXISTS = 253
METADATA_MISMATCH = 342  # a leftover at the path, of a table the target has outgrown
PARTITION_ID_RE = re.compile(r"^[A-Za-z0-9_\-]+$")
_DB_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
DEDUP_SETTING_KEYS = ("non_replicated_deduplication_window", "replicated_deduplication_window")
PARTS_SETTING_KEYS = ("parts_to_delay_insert", "parts_to_throw_insert")
# MergeTree settings TargetInfo carries: server defaults, overridden by the table's SETTINGS
MERGE_TREE_SETTING_KEYS = (*DEDUP_SETTING_KEYS, *PARTS_SETTING_KEYS)


# (rows, UUID, bytes on disk) of each active part, per partition id, per staging table
PartsOf = dict[str, dict[str, list[tuple[int, str, int]]] | None]
#: every column of a table: (name, type, default kind), in order
Layout = tuple[tuple[str, str, str], ...]


class Observer:
    """The reads of :class:`~txsink.clickhouse.warehouse.ClickHouseWarehouse`."""

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
        return self.staged_partitions_of([table], every_part)[table] or {}

    def staged_partitions_of(
        self, tables: Iterable[str], every_part: bool = False
    ) -> dict[str, dict[str, tuple[int, tuple[str, ...]]] | None]:
        """:meth:`staged_partitions` of many staging tables in one statement (the commit's
        read of every table a batch's tasks staged); None for a table that is missing."""
        return self._summed(tables, None if every_part else MAX_PART_UUIDS)[0]

    def commit_look(
        self,
        tables: Iterable[str],
        *,
        views_of: str | None = None,
        listing: str | None = None,
        validated: Sequence[tuple[str, str]] | None = None,
    ) -> CommitLook:
        """:meth:`staged_partitions_of` with the bytes per partition id, the views reading
        ``views_of``, the staging tables named ``listing*`` and those unfit to publish
        (their engine clause without the staging settings or with a TTL; with
        ``validated``, the (name, type) of the columns the tasks' values were checked
        against, those whose columns of these names differ): one statement."""
        found, views, listed, columns, made, unfit, layout = self._looked(
            tables, views_of, listing, validated
        )
        read, sizes = self._sums(found, MAX_PART_UUIDS)
        shape = self._batch_shape(views_of, *made) if views_of is not None and made else None
        types = {name: ctype for name, ctype, _ in layout}
        return CommitLook(read, sizes, views, listed, columns, shape, unfit, types)

    def _settings_missing(self, engine_full: str) -> bool:
        """Whether a staging table's engine clause lacks the staging settings
        (:class:`~txsink.clickhouse.staging.Stager` knows them)."""
        return False

    def _batch_shape(
        self, target: str, create_query: str, engine_full: str, layout: Layout
    ) -> BatchShape | None:
        """How to create a batch staging like ``target`` and fill it in one statement
        (:class:`~txsink.clickhouse.staging.Stager` knows the staging settings)."""
        return None

    def _summed(
        self, tables: Iterable[str], limit: int | None
    ) -> tuple[dict[str, dict[str, tuple[int, tuple[str, ...]]] | None], dict[str, int]]:
        return self._sums(self._staged_parts_of(tables), limit)

    @staticmethod
    def _sums(
        parts: PartsOf, limit: int | None
    ) -> tuple[dict[str, dict[str, tuple[int, tuple[str, ...]]] | None], dict[str, int]]:
        read: dict[str, dict[str, tuple[int, tuple[str, ...]]] | None] = {}
        sizes: dict[str, int] = {}
        for name, by_pid in parts.items():
            if by_pid is None:
                read[name] = None
                continue
            mine = read[name] = {}
            for pid, found in by_pid.items():
                pairs = [(n, u) for n, u, _ in found]
                mine[pid] = (sum(n for n, _ in pairs), short_uuids(pairs, limit))
                sizes[pid] = sizes.get(pid, 0) + sum(b for _, _, b in found)
        return read, sizes

    def staged_part_rows(self, table: str) -> dict[str, dict[str, int]]:
        """Every active part of one staging table: partition id -> {evidence id: rows}."""
        out: dict[str, dict[str, int]] = {}
        for pid, parts in (self._staged_parts_of([table])[table] or {}).items():
            for n, uuid, _ in parts:
                for short in short_uuids([(n, uuid)], None):
                    out.setdefault(pid, {})[short] = n
        return out

    def _staged_parts_of(self, tables: Iterable[str]) -> PartsOf:
        """(rows, UUID, bytes on disk) of every active part per partition of each staging
        table, in one statement; None for a table that is missing."""
        return self._looked(tables, None, None)[0]

    def _looked(
        self,
        tables: Iterable[str],
        views_of: str | None,
        listing: str | None,
        validated: Sequence[tuple[str, str]] | None = None,
    ) -> tuple[
        PartsOf,
        tuple[str, ...],
        tuple[str, ...],
        tuple[str, ...],
        tuple[str, str, Layout] | None,
        dict[str, str],
        Layout,
    ]:
        """:meth:`_staged_parts_of`, the views reading ``views_of`` (as
        :meth:`dependent_views` finds them) and its stored columns (neither ALIAS nor
        EPHEMERAL) in order, and the staging tables named ``listing*``, from one
        statement (each branch only when asked); with ``views_of``, also its
        ``create_table_query`` and ``engine_full`` and every column's (name, type, kind)
        (None if it has a comment, which its CREATE would not carry over exactly)."""
        names = sorted(set(tables))
        for name in names:
            self._staging(name, "read")
        # thousands of names would not fit a request's parameter: their common prefix
        # (every staging name of an xid has one) selects them, the rest is left out below
        many = len(names) > MAX_LISTED_NAMES
        prefix = os.path.commonprefix(names) if many else ""  # noqa: RUF071 - names, not paths

        def among(column: str) -> str:
            if prefix:
                return f"startsWith({column}, {{p:String}})"
            return f"{column} IN {{names:Array(String)}}"

        branches: list[str] = []
        parameters: dict[str, Any] = {"db": self.staging_db}
        viewed = ("", "")  # views_of as (database, table)
        if names:
            parameters.update({"p": prefix} if prefix else {"names": names})
            branches += [  # 0: the table exists, its CREATE and engine clause; 1: an active part
                "SELECT 0, name, create_table_query, toUInt64(0), engine_full, toUInt64(0) "
                "FROM system.tables "
                f"WHERE database = {{db:String}} AND {among('name')}",
                "SELECT 1, table, partition_id, rows, toString(uuid), bytes_on_disk "
                f"FROM system.parts WHERE active AND rows > 0 AND database = {{db:String}} "
                f"AND {among('table')}",
            ]
        if names and validated is not None:
            parameters["vn"] = [n for n, _ in validated]
            parameters["vty"] = [t for _, t in validated]
            branches.append(  # 7: a table whose columns named in validated differ from it
                "SELECT 7, table, '', toUInt64(0), '', toUInt64(0) FROM (SELECT table, "
                "arraySort(arrayFilter(c -> has({vn:Array(String)}, c.2), "
                "groupArray((position, name, type)))) AS cols FROM system.columns "
                f"WHERE database = {{db:String}} AND {among('table')} GROUP BY table) "
                "WHERE arrayMap(c -> c.2, cols) != {vn:Array(String)} "
                "OR arrayMap(c -> c.3, cols) != {vty:Array(String)}"
            )
        if views_of is not None:
            parameters["vdb"], parameters["vt"] = viewed = split_table(views_of)
            branches += [  # 2: a view the server lists as dependent; 3: every view's SELECT
                "SELECT 2, d, t, toUInt64(0), '', toUInt64(0) FROM system.tables "
                "ARRAY JOIN dependencies_database AS d, dependencies_table AS t "
                "WHERE database = {vdb:String} AND name = {vt:String}",
                "SELECT 3, database, name, toUInt64(0), "
                "if(as_select != '', as_select, create_table_query), toUInt64(0) "
                "FROM system.tables WHERE engine = 'MaterializedView'",
                # 5: a column of views_of: its type, position and kind
                "SELECT 5, name, type, position, default_kind, toUInt64(0) FROM system.columns "
                "WHERE database = {vdb:String} AND table = {vt:String}",
                # 6: its CREATE as the server prints it, its engine clause and comment
                "SELECT 6, create_table_query, engine_full, toUInt64(0), comment, "
                "toUInt64(0) FROM system.tables "
                "WHERE database = {vdb:String} AND name = {vt:String}",
            ]
        if listing is not None:
            parameters["l"] = listing
            branches.append(  # 4: a staging table named listing*
                "SELECT 4, name, '', toUInt64(0), '', toUInt64(0) FROM system.tables "
                "WHERE database = {db:String} AND startsWith(name, {l:String})"
            )
        if not branches:
            return {}, (), (), (), None, {}, ()
        rows = self.client.query_rows(
            " UNION ALL ".join(branches),
            parameters=parameters,
            what=(
                f"read staged parts of {len(names)} table(s) in {self.staging_db}"
                if names or views_of is None
                else f"read views of {views_of}"
            ),
            table=None if names else views_of,
        )
        found: dict[str, dict[str, list[tuple[int, str, int]]]] = {}
        views: set[str] = set()
        listed: set[str] = set()
        columns: list[tuple[int, str, str, str]] = []
        made: list[tuple[str, str, str]] = []
        unfit: dict[str, str] = {}
        for kind, name, pid, n, text, size in rows:
            if kind == 0:
                found.setdefault(str(name), {})
                if has_ttl(str(text)) or ttl_columns(str(pid)):
                    unfit[str(name)] = "it has a TTL"
                elif self._settings_missing(str(text)):
                    unfit[str(name)] = "its engine clause lacks the staging settings"
            elif kind == 7:
                unfit[str(name)] = "its columns differ from those the values were checked for"
            elif kind == 1:
                by_pid = found.setdefault(str(name), {})
                by_pid.setdefault(str(pid), []).append((int(n), str(text), int(size)))
            elif kind == 2 or (kind == 3 and reads_from(str(text), str(name), *viewed)):
                views.add(f"{name}.{pid}")
            elif kind == 4:
                listed.add(str(name))
            elif kind == 5:
                columns.append((int(n), str(name), str(pid), str(text)))
            elif kind == 6:
                made.append((str(name), str(pid), str(text)))
        staged = {name: found.get(name) for name in names}
        layout = tuple((name, ctype, kind) for _, name, ctype, kind in sorted(columns))
        stored = tuple(name for name, _, kind in layout if kind not in ("ALIAS", "EPHEMERAL"))
        shape = (made[0][0], made[0][1], layout) if len(made) == 1 and not made[0][2] else None
        unfit = {name: why for name, why in unfit.items() if name in staged}
        return staged, tuple(sorted(views)), tuple(sorted(listed)), stored, shape, unfit, layout

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
        """``{table: {"rows": n, "bytes": n, "modified": unix seconds}}`` of one job's
        staging tables (status, recovery): ``modified`` is the table's last write (its
        creation or its newest part), what tells a run at work from an orphan."""
        rows = self.client.query_rows(
            "SELECT t.name, ifNull(t.total_rows, 0), ifNull(t.total_bytes, 0), "
            "toUnixTimestamp(greatest(t.metadata_modification_time, "
            "ifNull(p.newest, toDateTime(0)))) FROM system.tables AS t LEFT JOIN "
            "(SELECT table, max(modification_time) AS newest FROM system.parts WHERE "
            "database = {db:String} AND startsWith(table, {p:String}) GROUP BY table) AS p "
            "ON p.table = t.name "
            "WHERE t.database = {db:String} AND startsWith(t.name, {p:String}) ORDER BY t.name",
            parameters={"db": self.staging_db, "p": prefix + "__"},
            what=f"size staging tables {prefix}__* in {self.staging_db}",
        )
        return {
            name: {"rows": int(r), "bytes": int(b), "modified": int(m)} for name, r, b, m in rows
        }

    def target_info(self, target: str, *, staging: bool = False) -> TargetInfo:
        """What the schema and mode checks need about ``db.table``; ConfigError if missing.

        One round trip (scalar subqueries over the system tables). ``staging``: the
        read-back of a staging table a task just created (one per task): what
        :func:`~.blockers.check_move_compat` compares and what the staging's protection
        reads (its ``engine_full``, TTLs), without the scans a staging table does not
        need: materialized views (it has none), the server's merge-tree defaults (its
        ``settings`` are only those of its own SETTINGS clause), its replica (checked
        on the target) and the time zone. About 3 of 11 ms per task on the embedded
        server (docs/benchmarks.md, round trips)."""
        db, name = split_table(target)
        sub = "WHERE database = {db:String} AND table = {t:String}"
        mvs = (
            "[]"
            if staging
            else "(SELECT groupArray((database, name, if(as_select != '', as_select, "
            "create_table_query))) FROM system.tables WHERE engine = 'MaterializedView')"
        )
        defaults_sql = (
            "[]"
            if staging
            else "(SELECT groupArray((name, value)) FROM system.merge_tree_settings "
            "WHERE name IN {names:Array(String)})"
        )
        replicas_sql = (
            "[]"
            if staging
            else "(SELECT groupArray((if(zookeeper_name IN ('', 'default'), '', "
            f"zookeeper_name || ':') || zookeeper_path, replica_name)) FROM system.replicas {sub})"
        )
        zone_sql = "''" if staging else "timezone()"
        rows = self.client.query_rows(
            "SELECT engine, engine_full, partition_key, sorting_key, primary_key, "
            "sampling_key, storage_policy, dependencies_database, dependencies_table, "
            "create_table_query, "
            "(SELECT groupArray((position, name, type, default_kind, default_expression, "
            f"compression_codec)) FROM system.columns {sub}), "
            "(SELECT groupArray((name, type_full, toString(granularity), expr)) "
            f"FROM system.data_skipping_indices {sub}), "
            f"(SELECT groupArray((name, query)) FROM system.projections {sub}), "
            f"{defaults_sql}, {mvs}, {replicas_sql}, {zone_sql} "
            "FROM system.tables WHERE database = {db:String} AND name = {t:String}",
            parameters={"db": db, "t": name}
            | ({} if staging else {"names": list(MERGE_TREE_SETTING_KEYS)}),
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
            cols, idx, projs, defaults, views_found, replicas, zone,
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
            table_ttl=has_ttl(str(engine_full)),
            ttl_columns=ttl_columns(str(ddl)),
            zookeeper_path=keeper_path,
            replica_name=replica,
            server_timezone=str(zone),
            **(self._distribution(str(engine_full)) if engine == "Distributed" else {}),
        )

    def _distribution(self, engine_full: str) -> dict[str, Any]:
        """What decides where a ``Distributed`` table sends a replayed block: whether
        each function its sharding key calls is deterministic (``system.functions``) and
        how many shards its cluster has (``system.clusters``), as ``TargetInfo`` fields
        (:func:`~.blockers.dedup_blockers` decides). One round trip (two with macros)."""
        try:
            _, args, _ = split_engine(engine_full)
        except ValueError:
            return {}  # dedup_blockers reports an engine it cannot read
        if len(args) < 3:
            return {}
        cluster = self.expand_macros(args[0].strip().strip("'\"`"))
        calls = called_functions(args[3]) if len(args) > 3 else ()
        rows = self.client.query_rows(
            "SELECT (SELECT uniqExact(shard_num) FROM system.clusters WHERE cluster = {c:String}), "
            "(SELECT groupArray((name, case_insensitive, deterministic)) FROM system.functions "
            "WHERE lower(name) IN {names:Array(String)})",
            parameters={"c": cluster, "names": sorted({n.lower() for n in calls})},
            what=f"read the cluster {cluster} and the sharding key of a Distributed table",
        )
        count, found = rows[0]
        exact = {str(n): d for n, _, d in found}
        folded = {str(n).lower(): d for n, ci, d in found if ci}
        functions: dict[str, bool | None] = {}
        for name in calls:
            flag = exact[name] if name in exact else folded.get(name.lower())
            functions[name] = None if flag is None else bool(flag)
        return {"key_functions": functions, "shard_count": int(count) or None}

    def dependent_views(self, target: str) -> tuple[str, ...]:
        """Materialized views fed by ``db.table`` now, by ``dependencies_table`` and by a
        scan of every view's SELECT (older servers fill the former inconsistently); one
        round trip (the commit reads them with its staging: :meth:`commit_look`)."""
        return self._looked((), target, None)[1]

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
            # no query_log table / no privilege to read it / merge() sees no log table
            # this user was granted SELECT on (a plain SELECT would pass: system tables
            # are readable without a grant, merge() lists only granted ones)
            if exc.code not in (60, 497, CANNOT_EXTRACT_TABLE_STRUCTURE):
                raise
            raise ConfigError(
                f"visibility=batch into {target} needs system.query_log (readable by this "
                f"user, and SYSTEM FLUSH LOGS) to prove an ATTACH landed: {exc}. Enable the "
                f"server's <query_log> or use visibility=partition (docs/modes.md#visibility)",
                code=exc.code,
            ) from exc
        return int(rows[0][0]) > 0

    def evidence_life(self, target: str) -> EvidenceLife:
        """How long the evidence of a publish into ``target`` survives here: the server's
        uptime, the target's ``old_parts_lifetime`` (its SETTINGS, else the server's
        default), the query log's TTL. One round trip, asked only by a resumed publish
        about to move or attach (:mod:`txsink.protocol.evidence_life`)."""
        db, name = split_table(target)
        rows = self.client.query_rows(
            "SELECT uptime(), (SELECT any(value) FROM system.merge_tree_settings "
            "WHERE name = 'old_parts_lifetime'), (SELECT any(engine_full) FROM system.tables "
            "WHERE database = {db:String} AND name = {t:String}), (SELECT any(engine_full) "
            "FROM system.tables WHERE database = 'system' AND name = 'query_log')",
            parameters={"db": db, "t": name},
            what=f"read how long evidence of a publish into {target} survives",
            table=target,
        )
        uptime, default, engine_full, log_engine = rows[0]
        lifetime = parse_settings_clause(str(engine_full)).get("old_parts_lifetime", default)
        try:
            seconds = float(str(lifetime))
        except ValueError:
            seconds = 0.0  # unreadable: assume the evidence is gone at once
        ttl = log_ttl_seconds(str(log_engine)) if log_engine else None
        return EvidenceLife(float(uptime), seconds, ttl)

    def detached_parts(self, tables: Iterable[str]) -> dict[str, dict[str, int]]:
        """Detached parts per staging table and partition id ("" when the server could
        not read one from the part's name), any reason (``system.detached_parts``)."""
        names = sorted(set(tables))
        if not names:
            return {}
        rows = self.client.query_rows(
            "SELECT table, ifNull(partition_id, ''), count() FROM system.detached_parts "
            "WHERE database = {db:String} AND table IN {names:Array(String)} "
            "GROUP BY table, partition_id",
            parameters={"db": self.staging_db, "names": names},
            what=f"read detached parts of {len(names)} staging table(s)",
        )
        out: dict[str, dict[str, int]] = {}
        for table, pid, n in rows:
            mine = out.setdefault(str(table), {})
            mine[str(pid)] = mine.get(str(pid), 0) + int(n)
        return out

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
