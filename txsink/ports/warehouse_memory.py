"""In-memory twin of the :class:`~txsink.ports.warehouse.Warehouse` port, for unit tests.

Owned by the port, as :class:`txsink.ports.registry_memory.MemoryRegistry` is by the registry;
no I/O. It models what the protocol's evidence relies on, with ClickHouse's semantics
(``tests/warehouse_contract.py`` runs the same cases on it and on the real adapters):

- a table is a list of *parts*, each with a partition id, its rows and a UUID; an insert
  block makes one part per partition it touches;
- ``MOVE PARTITION`` moves every active part of one partition, keeping its UUID, atomic
  per partition; a repeat moves nothing. ``ATTACH PARTITION ALL FROM`` copies every part
  (the UUIDs too: ClickHouse keeps them) and leaves the source as it was;
- :meth:`MemoryWarehouse.merge` is ClickHouse's own merge in a target: the partition's
  parts become one part with a new UUID, the old ones stay *outdated* (still found by
  ``published_uuids``) until :meth:`MemoryWarehouse.cleanup`;
- grants: a target in ``attach_denied`` is one the user may MOVE into but not ``ATTACH
  PARTITION ... FROM`` into (ClickHouse asks ALTER DELETE there too): ``attach_all``
  into it is refused before anything happens, and ``attach_refusal`` says so;
- fault hooks for tests: :meth:`~MemoryWarehouse.fail_next` (refused before anything
  happens), :meth:`~MemoryWarehouse.lose_reply` (it landed, the reply was lost),
  :meth:`~MemoryWarehouse.cut_next_move` (a server crash cut a MOVE between parts: some
  are in the target and still in staging) and
  ``running`` (``settle`` sees a statement still running that many times).

Rows are whatever the test stores: row ids given to :meth:`~MemoryWarehouse.stage`, or
the dicts of the batches given to ``insert_blocks`` (anything with ``to_pylist()``, such
as an Arrow record batch, or a list of dicts).
"""

from __future__ import annotations

import hashlib
import itertools
import re
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from txsink.errors import ConfigError, FencedError, RetryableConflict, TxSinkError, UnavailableError
from txsink.ports.memory_tables import MemoryTable, Part, cut_blocks, partition_of
from txsink.ports.warehouse import (
    BlockSettings,
    ClusterReplica,
    CommitLook,
    InsertGuard,
    InsertStats,
    StagingView,
    TargetInfo,
    Warehouse,
    WarehouseCapabilities,
)
from txsink.protocol.evidence_life import EvidenceLife
from txsink.protocol.ids import parse_staging
from txsink.protocol.ops import BatchShape
from txsink.protocol.states import MAX_PART_UUIDS, short_uuids

T = TypeVar("T")
UNKNOWN_TABLE = 60  # ClickHouse's code, which the real adapter keeps on its ConfigError
ACCESS_DENIED = 497
_PARTITION_ID_RE = re.compile(r"^[A-Za-z0-9_\-]+$")
_ROW_BYTES = 8  # the size the twin reports per row (status, staging_sizes)


@dataclass
class _Fault:
    method: str
    kind: str  # "fail" | "lost" | "cut"
    error: TxSinkError
    parts: int = 0  # "cut": how many parts the cut MOVE moved


class MemoryWarehouse:
    """The twin. ``staging`` (bare names) and ``tables`` (``db.table``) are public so a
    test can look, or lose staging on purpose (``wh.staging.clear()``)."""

    def __init__(
        self,
        staging_db: str = "txsink_staging",
        capabilities: WarehouseCapabilities | None = None,
        seed: str = "",
    ) -> None:
        self.staging_db = staging_db
        self.capabilities = capabilities or WarehouseCapabilities(per_shard_counts=True)
        self.staging: dict[str, MemoryTable] = {}
        self.tables: dict[str, MemoryTable] = {}
        self.query_log: dict[str, int] = {}  # ATTACH tag (log_comment) -> statements
        self.macros: dict[str, str] = {}
        self.clusters: dict[str, list[ClusterReplica]] = {}
        self.views: dict[str, tuple[str, ...]] = {}  # target -> materialized views
        self.moves = 0  # MOVE PARTITION commands that ran (partitions)
        self.running = 0  # settle() answers "busy" this many more times
        self.seals: set[str] = set()  # seal rows of dedup xids (seal_dedup)
        # evidence_life(): seconds since the server started (a test sets a restart),
        # the targets' old_parts_lifetime, the query log's TTL (None: none)
        self.uptime_s = float("inf")
        self.parts_lifetime_s = 480.0
        self.query_log_ttl_s: float | None = None
        self.detached: dict[str, dict[str, int]] = {}  # staging table -> {pid: parts}
        self.attach_denied: set[str] = set()  # targets without the ATTACH ... FROM grant
        self.staging_db_created = False
        self._faults: list[_Fault] = []
        self._seed = seed
        self._uuids = 0
        self._lock = threading.RLock()

    # ------------------------------------------------------------------ test helpers

    def add_table(self, target: str, partition_by: str = "", dedup_window: int = 0) -> None:
        """Create target ``db.table`` (what the real tests do with CREATE TABLE)."""
        self.tables[target] = MemoryTable(partition_by, dedup_window=dedup_window)

    def stage(self, table: str, rows: Mapping[str, Sequence[Any]], parts: int = 1) -> None:
        """(Re)create staging ``table`` holding ``{pid: rows}`` in up to ``parts`` parts
        per partition (what an executor's staging inserts leave: one part per block)."""
        made: list[Part] = []
        for pid, ids in rows.items():
            n = max(1, min(parts, len(ids)))
            cuts = [len(ids) * i // n for i in range(n + 1)]
            made += [self._part(pid, tuple(ids[a:b])) for a, b in itertools.pairwise(cuts) if b > a]
        self.staging[table] = MemoryTable(parts=made)

    def target_ids(self, target: str) -> list[Any]:
        """Every row the target holds (sorted): what the exactly-once checks compare."""
        t = self.tables.get(target)
        return sorted(r for p in (t.parts if t else []) for r in p.rows)

    def merge(self, target: str, partition_id: str) -> None:
        """ClickHouse merging one partition of a target: its active parts become one part
        with a new UUID; the old parts stay outdated until :meth:`cleanup`."""
        t = self._table(target)
        old = [p for p in t.parts if p.partition_id == partition_id]
        if len(old) < 2:
            return
        t.parts = [p for p in t.parts if p.partition_id != partition_id]
        t.parts.append(self._part(partition_id, tuple(r for p in old for r in p.rows)))
        t.outdated.extend(old)

    def cleanup(self, target: str) -> None:
        """The cleanup thread removing a target's outdated parts (``old_parts_lifetime``)."""
        self._table(target).outdated.clear()

    def detach(self, table: str, partition_id: str) -> None:
        """The server detaching every part of one staging partition (broken at start-up,
        or ``ALTER TABLE ... DETACH PARTITION``): gone from the table, listed in
        ``detached_parts``."""
        t = self._staged(table)
        gone = [p for p in t.parts if p.partition_id == partition_id]
        t.parts = [p for p in t.parts if p.partition_id != partition_id]
        mine = self.detached.setdefault(table, {})
        mine[partition_id] = mine.get(partition_id, 0) + len(gone)

    def fail_next(self, method: str, error: TxSinkError | None = None, times: int = 1) -> None:
        """The next ``times`` calls of ``method`` are refused before anything happens."""
        err = error or RetryableConflict(f"{method} refused (injected)", code=252)
        self._faults += [_Fault(method, "fail", err) for _ in range(times)]

    def lose_reply(self, method: str, times: int = 1) -> None:
        """The next ``times`` calls of ``method`` land, then their reply is lost."""
        err = UnavailableError(f"{method}: connection reset by peer (injected, it landed)")
        self._faults += [_Fault(method, "lost", err) for _ in range(times)]

    def cut_next_move(self, parts: int = 1) -> None:
        """A server crash cuts the next MOVE of a partition: its first ``parts`` parts are
        in the target already and still in staging (ClickHouse removes moved parts from
        the source only when the whole MOVE commits); the reply is lost."""
        err = UnavailableError("MOVE PARTITION: server went away (injected cut)")
        self._faults.append(_Fault("move_partition", "cut", err, parts))

    # ------------------------------------------------------------------ observation

    def staging_view(self, tables: Iterable[str]) -> StagingView:
        def act() -> StagingView:
            view: StagingView = {}
            for name in sorted(set(tables)):
                t = self.staging.get(name)
                view[name] = None if t is None else t.rows()
            return view

        return self._call("staging_view", act)

    def staged_partitions(
        self, table: str, every_part: bool = False
    ) -> dict[str, tuple[int, tuple[str, ...]]]:
        def act() -> dict[str, tuple[int, tuple[str, ...]]]:
            by_pid: dict[str, list[tuple[int, str]]] = {}
            for p in self._staged(table).parts:
                if p.count:
                    by_pid.setdefault(p.partition_id, []).append((p.count, p.uuid))
            limit = None if every_part else MAX_PART_UUIDS
            return {
                pid: (sum(n for n, _ in parts), short_uuids(parts, limit))
                for pid, parts in by_pid.items()
            }

        return self._call("staged_partitions", act)

    def staged_partitions_of(
        self, tables: Iterable[str], every_part: bool = False
    ) -> dict[str, dict[str, tuple[int, tuple[str, ...]]] | None]:
        names = sorted(set(tables))
        present = [t for t in names if t in self.staging]
        read = {t: self.staged_partitions(t, every_part) for t in present}
        return {t: read.get(t) for t in names}

    def commit_look(
        self,
        tables: Iterable[str],
        *,
        views_of: str | None = None,
        listing: str | None = None,
        validated: Sequence[tuple[str, str]] | None = None,
    ) -> CommitLook:
        """The twin's bytes: ``_ROW_BYTES`` per row; its tables' one column: ``value``;
        none unfit."""

        def act() -> CommitLook:
            read = self.staged_partitions_of(tables)
            sizes: dict[str, int] = {}
            for by_pid in read.values():
                for pid, (n, _) in (by_pid or {}).items():
                    sizes[pid] = sizes.get(pid, 0) + n * _ROW_BYTES
            views = self.views.get(views_of, ()) if views_of is not None else ()
            listed = (
                () if listing is None else sorted(t for t in self.staging if t.startswith(listing))
            )
            columns = ("value",) if views_of is not None else ()
            shape = (
                BatchShape(views_of, (("value", "String", ""),))
                if views_of is not None and views_of in self.tables
                else None
            )
            return CommitLook(read, sizes, tuple(views), tuple(listed), columns, shape)

        return self._call("commit_look", act)

    def staged_part_rows(self, table: str) -> dict[str, dict[str, int]]:
        def act() -> dict[str, dict[str, int]]:
            out: dict[str, dict[str, int]] = {}
            for p in self._staged(table).parts:
                for short in short_uuids([(p.count, p.uuid)], None) if p.count else ():
                    out.setdefault(p.partition_id, {})[short] = p.count
            return out

        return self._call("staged_part_rows", act)

    def published_uuids(self, target: str, uuids: Iterable[str]) -> frozenset[str]:
        def act() -> frozenset[str]:
            wanted = set(uuids)
            t = self.tables.get(target)
            if not wanted or t is None:
                return frozenset()
            n = len(next(iter(wanted)))
            shown = {p.uuid.replace("-", "")[:n] for p in (*t.parts, *t.outdated)}
            return frozenset(wanted & shown)

        return self._call("published_uuids", act)

    def partition_rows(self, table: str, db: str | None = None) -> dict[str, int]:
        name = table if db is None else f"{db}.{table}"
        return self._call("partition_rows", lambda: self._table(name).rows())

    def partition_rows_by_shard(self, table: str) -> list[dict[str, int]]:
        if not self.capabilities.per_shard_counts:
            raise self.capabilities.missing("per_shard_counts", f"rows per shard of {table}", "")
        return [self.partition_rows(table)]

    def list_staging(self, prefix: str) -> list[str]:
        return self._call(
            "list_staging", lambda: sorted(t for t in self.staging if t.startswith(prefix + "__"))
        )

    def staging_sizes(self, prefix: str) -> dict[str, dict[str, int]]:
        def act() -> dict[str, dict[str, int]]:
            out: dict[str, dict[str, int]] = {}
            for name in self.list_staging(prefix):
                n = sum(self.staging[name].rows().values())
                out[name] = {"rows": n, "bytes": n * _ROW_BYTES}
            return out

        return self._call("staging_sizes", act)

    def settle(self, names: Iterable[str]) -> bool:
        def act() -> bool:
            if self.running:
                self.running -= 1
                return False
            return True

        return self._call("settle", act)

    def attach_logged(self, target: str, tag: str, since: float) -> bool:
        if not self.capabilities.query_log:
            raise self.capabilities.missing("query_log", f"the ATTACH log of {target}", "")
        return self._call("attach_logged", lambda: self.query_log.get(tag, 0) > 0)

    def evidence_life(self, target: str) -> EvidenceLife:
        life = EvidenceLife(self.uptime_s, self.parts_lifetime_s, self.query_log_ttl_s)
        return self._call("evidence_life", lambda: life)

    def detached_parts(self, tables: Iterable[str]) -> dict[str, dict[str, int]]:
        def act() -> dict[str, dict[str, int]]:
            return {t: dict(self.detached[t]) for t in set(tables) if self.detached.get(t)}

        return self._call("detached_parts", act)

    def target_info(self, target: str, *, staging: bool = False) -> TargetInfo:
        def act() -> TargetInfo:
            t = self._table(target)
            db, _, name = target.partition(".")
            window = {"non_replicated_deduplication_window": str(t.dedup_window)}
            return TargetInfo(
                database=db,
                table=name,
                engine="MergeTree",
                engine_full=f"MergeTree PARTITION BY {t.partition_by or 'tuple()'} ORDER BY ()",
                partition_key=t.partition_by,
                dependent_views=self.views.get(target, ()) if not staging else (),
                settings=window,
            )

        return self._call("target_info", act)

    def target_infos(self, target: str) -> list[TargetInfo]:
        return [self.target_info(target)]

    def dependent_views(self, target: str) -> tuple[str, ...]:
        return self._call("dependent_views", lambda: self.views.get(target, ()))

    def expand_macros(self, text: str) -> str:
        if not self.capabilities.clusters:
            raise self.capabilities.missing("clusters", f"expanding {text!r}", "")
        for name, value in self.macros.items():
            text = text.replace("{" + name + "}", value)
        return text

    def cluster_replicas(self, cluster: str) -> list[ClusterReplica]:
        if not self.capabilities.clusters:
            raise self.capabilities.missing("clusters", f"reading cluster {cluster}", "")
        return list(self.clusters.get(cluster, ()))

    # ------------------------------------------------------------------ staging lifecycle

    def ensure_staging_db(self) -> None:
        self._call("ensure_staging_db", lambda: setattr(self, "staging_db_created", True))

    def ensure_seal_table(self) -> None:
        self._call("ensure_seal_table", lambda: None)

    def seal_dedup(self, tag: str) -> None:
        self._call("seal_dedup", lambda: self.seals.add(tag))

    def create_staging(
        self,
        target: str,
        table: str,
        expected: TargetInfo | None = None,
        *,
        read_back: bool = True,
    ) -> None:
        def act() -> None:
            self._check_name(table, "create")
            # a table of the same name is garbage of an earlier try: replaced
            self.staging[table] = MemoryTable(self._table(target).partition_by)

        self._call("create_staging", act)

    def drop_staging(self, table: str) -> None:
        self.drop_stagings([table])

    def drop_stagings(self, tables: Sequence[str], *, wait: bool = True) -> None:
        def act() -> None:
            for t in tables:
                self._check_name(t, "drop")
            for t in tables:
                self.staging.pop(t, None)

        self._call("drop_stagings", act)

    def insert_blocks(
        self,
        table: str,
        batches: Iterable[Any],
        *,
        block_rows: int,
        block_bytes: int,
        settings: BlockSettings = None,
        resend_ok: Callable[[], bool] | None = None,  # the twin never sends a block again
        guard: InsertGuard | None = None,  # the seal only: the twin keeps no block counter
    ) -> InsertStats:
        if block_rows < 1 or block_bytes < 1:
            raise ConfigError(f"block_rows={block_rows} / block_bytes={block_bytes} must be >= 1")
        direct = "." in table
        if direct and not self.capabilities.direct_insert:
            raise self.capabilities.missing("direct_insert", f"inserting into {table}", "")

        def act() -> InsertStats:
            t = self._table(table) if direct else self._staged(table)
            rows = blocks = 0
            for block in cut_blocks(batches, block_rows):
                if guard is not None and guard.seal in self.seals:
                    raise FencedError(f"{table}: {guard.seal} is sealed; the block was refused")
                extra = settings(blocks) if callable(settings) else settings
                token = str((extra or {}).get("insert_deduplication_token", ""))
                by_pid: dict[str, list[Any]] = {}
                for row in block:
                    by_pid.setdefault(partition_of(row, t.partition_by), []).append(row)
                for pid, part_rows in by_pid.items():
                    if direct and token and t.dedup_window > 0:
                        if (token, pid) in t.tokens:
                            continue  # ClickHouse drops a block it has seen (dedup mode)
                        t.tokens.add((token, pid))
                    t.parts.append(self._part(pid, tuple(part_rows)))
                rows += len(block)
                blocks += 1
            return InsertStats(rows, rows * _ROW_BYTES, blocks)

        return self._call("insert_blocks", act)

    # ------------------------------------------------------------------ publish

    def move_partition(self, staging: str, partition_id: str, target: str) -> None:
        def act(cut: int | None) -> None:
            src = self._staged(staging)
            dest = self._dest(target)
            mine = [p for p in src.parts if p.partition_id == partition_id]
            if cut is not None:
                # ClickHouse renames a MOVE's parts into the target one by one and removes
                # them from the source only at the end: a crash leaves some in both
                dest.parts.extend(mine[:cut])
                return
            src.parts = [p for p in src.parts if p.partition_id != partition_id]
            dest.parts.extend(mine)  # a moved part keeps its UUID
            self.moves += 1

        self._call("move_partition", act, cuttable=True)

    def move_partitions(self, staging: str, partition_ids: Sequence[str], target: str) -> None:
        for pid in partition_ids:  # every id is checked before the first move
            if not _PARTITION_ID_RE.match(pid):
                raise ConfigError(
                    f"partition id {pid!r} of staging {staging} is not a ClickHouse partition "
                    "id; the manifest is corrupt: run `txsink verify`"
                )
        for pid in partition_ids:
            self.move_partition(staging, pid, target)

    def drop_parts(self, staging: str, partition_id: str, evidence: Sequence[str]) -> None:
        def act() -> None:
            wanted = set(evidence)
            if not wanted:
                return
            n = len(next(iter(wanted)))
            t = self._staged(staging)
            t.parts = [
                p
                for p in t.parts
                if p.partition_id != partition_id or p.uuid.replace("-", "")[:n] not in wanted
            ]

        self._call("drop_parts", act)

    def drop_leftover_fills(self, older_than_s: float) -> list[str]:
        """The twin's fills never leave anything behind."""
        return self._call("drop_leftover_fills", list)

    def create_batch_staging(self, table: str, like: str, target: str = "") -> None:
        self._need_batch(f"batch staging {table}")

        def act() -> None:
            self._check_name(table, "create")
            source = self._table(target) if target else self._staged(like)
            self.staging.setdefault(table, MemoryTable(source.partition_by))

        self._call("create_batch_staging", act)

    def consolidate(self, staging: str, partition_id: str, batch_staging: str) -> None:
        self._need_batch(f"consolidating {staging}")
        self._staged(batch_staging)
        self.move_partition(staging, partition_id, f"{self.staging_db}.{batch_staging}")

    def copy_into_batch(self, batch_staging: str, sources: Sequence[tuple[str, str]]) -> None:
        self._need_batch(f"copying into {batch_staging}")

        def act(cut: int | None = None) -> None:
            dest = self._staged(batch_staging)
            for n, (table, pid) in enumerate(sources):
                if cut is not None and n >= cut:  # a statement cut between its commands
                    return
                dest.parts.extend(
                    p for p in self._staged(table).parts if pid in ("", p.partition_id)
                )

        self._call("copy_into_batch", act, cuttable=True)

    def gather_into_batch(
        self,
        batch_staging: str,
        tables: Sequence[str],
        columns: Sequence[str],
        rows: int,
        *,
        create: BatchShape | None = None,
    ) -> None:
        """The twin's tables have no columns to compare (``columns`` is not checked):
        every row of ``tables`` goes into one new part per partition. ``create``: its
        ``ddl`` names the target the new batch staging is made like."""
        self._need_batch(f"gathering into {batch_staging}")

        def act() -> None:
            if create is not None:
                self._check_name(batch_staging, "create")
                if batch_staging in self.staging:  # the server's refusal, re-observed
                    raise RetryableConflict(f"table {batch_staging} already exists")
                self.staging[batch_staging] = MemoryTable(self._table(create.ddl).partition_by)
            dest = self._staged(batch_staging)
            by_pid: dict[str, list[Any]] = {}
            for table in tables:
                for p in self._staged(table).parts:
                    by_pid.setdefault(p.partition_id, []).extend(p.rows)
            written = sum(len(r) for r in by_pid.values())
            dest.parts.extend(self._part(pid, tuple(r)) for pid, r in sorted(by_pid.items()))
            if written != rows:
                raise RetryableConflict(
                    f"gathering into {batch_staging} wrote {written} rows, the manifest "
                    f"says {rows}; re-observing"
                )

        self._call("gather_into_batch", act)

    def claim_staging(self, staging: str, claimed: str) -> None:
        self._need_batch(f"claiming {staging}")

        def act() -> None:
            self._check_name(claimed, "claim")
            if staging not in self.staging:
                raise RetryableConflict(
                    f"batch staging {staging} was claimed by another finisher of its xid; "
                    "re-observing"
                )
            if claimed in self.staging:
                raise ConfigError(f"table {self.staging_db}.{claimed} already exists", code=57)
            self.staging[claimed] = self.staging.pop(staging)

        self._call("claim_staging", act)

    def attach_all(self, staging: str, target: str, tag: str = "") -> None:
        self._need_batch(f"ATTACH PARTITION ALL into {target}")

        def act() -> None:
            src, dest = self._staged(staging), self._table(target)
            if target in self.attach_denied:
                raise ConfigError(self._denied("INSERT, ALTER DELETE", target), code=ACCESS_DENIED)
            dest.parts.extend(src.parts)  # copies, UUIDs kept; the source is unchanged
            if tag:
                self.query_log[tag] = self.query_log.get(tag, 0) + 1

        self._call("attach_all", act)

    def attach_refusal(self, target: str) -> str:
        self._need_batch(f"probing the ATTACH PARTITION ALL grant on {target}")

        def act() -> str:
            self._table(target)
            if target in self.attach_denied:
                return self._denied("INSERT, ALTER DELETE", target)
            return ""

        return self._call("attach_refusal", act)

    # ------------------------------------------------------------------ internals

    @staticmethod
    def _denied(grants: str, table: str) -> str:
        """ClickHouse's words for a statement without the grants it needs (the twin's
        user holds every other one)."""
        missing = "ALTER DELETE" if "ALTER DELETE" in grants else grants
        return (
            "Not enough privileges. To execute this query, it's necessary to have the grant "
            f"{grants} ON {table}. (Missing permissions: {missing} ON {table})"
        )

    def _call(self, method: str, act: Callable[..., T], cuttable: bool = False) -> T:
        """Run ``act`` under the lock, applying the first fault queued for ``method``."""
        with self._lock:
            fault = next((f for f in self._faults if f.method == method), None)
            if fault is None:
                return act(None) if cuttable else act()
            self._faults.remove(fault)
            if fault.kind == "fail":
                raise fault.error
            if fault.kind == "cut":
                act(fault.parts)
            else:
                act(None) if cuttable else act()
            raise fault.error

    def _part(self, partition_id: str, rows: tuple[Any, ...]) -> Part:
        self._uuids += 1
        digest = hashlib.sha256(f"{self._seed}/{self._uuids}".encode()).hexdigest()
        uuid = f"{digest[:8]}-{digest[8:12]}-{digest[12:16]}-{digest[16:20]}-{digest[20:32]}"
        return Part(partition_id, rows, uuid)

    def _check_name(self, table: str, action: str) -> None:
        if parse_staging(table) is None:
            raise ConfigError(
                f"refusing to {action} {self.staging_db}.{table}: not a txsink staging table "
                f"name (see txsink.protocol.ids); txsink never touches tables it did not name"
            )

    def _staged(self, table: str) -> MemoryTable:
        self._check_name(table, "use")
        t = self.staging.get(table)
        if t is None:
            raise ConfigError(f"table {self.staging_db}.{table} does not exist", code=UNKNOWN_TABLE)
        return t

    def _table(self, name: str) -> MemoryTable:
        db, _, table = name.partition(".")
        if db == self.staging_db:
            return self._staged(table)
        t = self.tables.get(name)
        if t is None:
            raise ConfigError(f"table {name} does not exist", code=UNKNOWN_TABLE)
        return t

    def _dest(self, target: str) -> MemoryTable:
        """A MOVE's destination; a target the test never created is created empty (unit
        tests of the protocol need no DDL)."""
        db, _, table = target.partition(".")
        if db == self.staging_db:
            return self._staged(table)
        return self.tables.setdefault(target, MemoryTable())

    def _need_batch(self, what: str) -> None:
        if not self.capabilities.batch_visibility:
            raise self.capabilities.missing("batch_visibility", what, "use visibility=partition")


def _conforms(twin: MemoryWarehouse) -> Warehouse:
    """mypy checks here that the twin implements the whole port."""
    return twin
