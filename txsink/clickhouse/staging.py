"""Staging tables on a ClickHouse server: created as exact copies of the target, protected
so they keep every row until published, dropped.

Owned by the ClickHouse adapter (:class:`Stager`, a base of
:class:`~txsink.clickhouse.warehouse.ClickHouseWarehouse`). Invariants:

- only tables whose name :func:`~txsink.protocol.ids.parse_staging` recognises, inside
  ``staging_db``, are ever created or dropped;
- a staging table is ``CREATE TABLE staging AS target`` (columns with codecs and
  defaults, keys, SAMPLE BY, TTL, settings, indices and projections are copied), then
  checked against the target with :func:`~.blockers.check_move_compat` before any row
  lands, or (an attach task's, once the server was seen keeping the staging settings)
  by its commit's one read before anything is prepared: its columns as the driver
  validated them, its settings (:func:`staging_settings_missing`);
  a ``Replicated*MergeTree`` target's staging is replicated too on the replica
  txsink talks to, under a Keeper path of its own
  (:func:`~.replicated_ddl.staging_keeper_path`), which its ``DROP ... SYNC`` removes;
- before any row lands, its TTLs are removed and :data:`STAGING_SETTINGS` (persistent
  table settings) disable merges and insert deduplication and give every part a UUID.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Sequence
from typing import Any

from txsink.clickhouse.blockers import check_move_compat
from txsink.clickhouse.observe import (
    METADATA_MISMATCH,
    REPLICA_ALREADY_EXISTS,
    TABLE_ALREADY_EXISTS,
    Layout,
    Observer,
)
from txsink.clickhouse.replicated_ddl import staging_engine_clause, staging_keeper_path
from txsink.clickhouse.sqltext import batch_ddl, parse_settings_clause
from txsink.errors import ConfigError, TxSinkError
from txsink.names import qualified, quote_ident, quote_literal, split_table
from txsink.ports.warehouse import TargetInfo
from txsink.protocol.ops import BatchShape

log = logging.getLogger(__name__)
# the table a CREATE ... AS SELECT fills before it takes its name (ClickHouse 26.x)
_LEFTOVER_FILL_RE = re.compile(r"_tmp_replace_[0-9A-Za-z_]+")
KEEPS_SETTINGS = "keeps_staging_settings"
# how long that is trusted: a server replaced behind the URL by one that drops the
# settings makes the commits refuse staging (CommitLook.unfit) for at most this long
KEEPS_SETTINGS_S = 600.0
# names per DROP TABLE statement, in bytes: far below max_query_size (256 KiB by default)
MAX_DROP_BYTES = 60 * 1024

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


def staging_settings_missing(engine_full: str) -> bool:
    """Whether a table's engine clause lacks one of :data:`STAGING_SETTINGS` (or has
    another value for it)."""
    have = parse_settings_clause(engine_full)
    return any(have.get(k) != str(v) for k, v in STAGING_SETTINGS.items())


class Stager(Observer):
    """Staging DDL of :class:`~txsink.clickhouse.warehouse.ClickHouseWarehouse`."""

    # ------------------------------------------------------------------ staging lifecycle

    def ensure_staging_db(self) -> None:
        """The staging database, created if it is not there. Looked up first: ClickHouse
        asks for the CREATE DATABASE grant even when ``IF NOT EXISTS`` finds it, and a
        writer granted only what it does inside an existing one (server_ext) lacks it."""
        found = self.client.query_rows(
            "SELECT count() FROM system.databases WHERE name = {db:String}",
            parameters={"db": self.staging_db},
            what=f"look up database {self.staging_db}",
        )
        if found and int(found[0][0]):
            return
        self.client.command(
            f"CREATE DATABASE IF NOT EXISTS {quote_ident(self.staging_db)}",
            table=self.staging_db,
        )

    def create_staging(
        self,
        target: str,
        table: str,
        expected: TargetInfo | None = None,
        *,
        read_back: bool = True,
    ) -> None:
        """(Re)create ``staging_db.table`` as an exact structural copy of ``target``.

        ``read_back=False`` (an attach task's staging, which its commit checks: the
        columns against ``expected`` and the staging settings, in its one read,
        :meth:`~.observe.Observer.commit_look`) sends the CREATE alone, and the ALTER
        removing TTLs only when ``expected`` has any, once this server was seen keeping
        the settings of a CREATE ... AS: one round trip. Not for a replicated target,
        whose staging must be checked on this replica.

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
        # once a read-back through this (pooled) client saw the server keep the staging
        # settings of a CREATE ... AS, a task's CREATE goes without one for a while
        seen = self.client.facts.get(KEEPS_SETTINGS)
        fast = not read_back and seen is not None and time.monotonic() - seen < KEEPS_SETTINGS_S
        if fast and expected is not None and not expected.is_replicated:
            self._create(fq, target, table, expected)
            try:
                self._protect(fq, expected.table_ttl, expected.ttl_columns, settings=False)
                return
            except TxSinkError as exc:  # the target's TTL went since the driver's view
                log.info("staging %s: %s; reading it back", fq, exc)
        reuse = expected is not None and not expected.is_replicated
        wanted = expected if expected is not None and reuse else self.target_info(target)
        if expected is not None and not reuse and wanted.is_replicated:
            check_same_replica(expected, wanted, self.client)
        staged = self._created(fq, target, table, wanted)
        problem = check_move_compat(staged, wanted)
        if problem and reuse:
            wanted = self.target_info(target)
            problem = check_move_compat(staged, wanted)
            if problem and wanted.is_replicated:  # its engine clause came from the stale view
                staged = self._created(fq, target, table, wanted)
                problem = check_move_compat(staged, wanted)
        if problem:
            self.client.command(f"DROP TABLE IF EXISTS {fq} SYNC")
            raise ConfigError(problem)
        kept = self._protect_read(fq, staged)
        if kept and not wanted.is_replicated:
            self.client.facts[KEEPS_SETTINGS] = time.monotonic()

    def _created(self, fq: str, target: str, table: str, wanted: TargetInfo) -> TargetInfo:
        """:meth:`_create`, then the staging table as the server has it (one read)."""
        self._create(fq, target, table, wanted)
        return self.target_info(f"{self.staging_db}.{table}", staging=True)

    def _create(self, fq: str, target: str, table: str, wanted: TargetInfo) -> None:
        """``CREATE TABLE fq AS target`` with the staging settings, replacing a garbage
        table of the same name; for a replicated target, with an engine clause of its own
        (:func:`~.replicated_ddl.staging_engine_clause`) whose Keeper path a leftover replica may
        hold (a DROP that never reached Keeper): that replica is dropped from Keeper first
        (the path is txsink's own and names this one staging table; ClickHouse refuses to
        drop a replica that is active or attached)."""
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

    def _protect_read(self, fq: str, staged: TargetInfo) -> bool:
        """:meth:`_protect` as the read-back ``staged`` shows the table; whether the
        server had kept the staging settings of its CREATE."""
        missing = staging_settings_missing(staged.engine_full)
        self._protect(fq, staged.table_ttl, staged.ttl_columns, settings=missing)
        return not missing

    def _protect(
        self, fq: str, table_ttl: bool, ttl_columns: Sequence[str], *, settings: bool
    ) -> None:
        """Make the (still empty) staging table keep every row until it is moved.

        A TTL inherited from the target would delete old rows (late or backfilled data)
        in a TTL merge before publish; a column TTL would reset their values. Removing
        both from staging does not stop MOVE PARTITION into the target (ClickHouse 26.9;
        docs/reliability.md), which applies its own TTL after the move. The settings normally came
        with the CREATE; they are added here if the server did not keep them. Everything
        here is table metadata, so it survives a server restart.
        """
        clauses = ["REMOVE TTL"] if table_ttl else []
        clauses += [f"MODIFY COLUMN {quote_ident(c)} REMOVE TTL" for c in ttl_columns]
        if settings:
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

    def _settings_missing(self, engine_full: str) -> bool:
        return staging_settings_missing(engine_full)

    def _batch_shape(
        self, target: str, create_query: str, engine_full: str, layout: Layout
    ) -> BatchShape | None:
        """The target's CREATE with the staging settings (:func:`~.sqltext.batch_ddl`),
        for a batch staging created and filled in one statement."""
        ddl = batch_ddl(create_query, engine_full, split_table(target), layout, STAGING_SETTINGS)
        return BatchShape(ddl, layout) if ddl else None

    def drop_leftover_fills(self, older_than_s: float) -> list[str]:
        """Drop the internal tables a ``CREATE ... AS SELECT`` fills before it renames
        them (``_tmp_replace_*``) that a server killed during the fill left in the
        staging database, once older than ``older_than_s`` (a younger one may be a fill
        still running, of this job or another). Their rows were never published: the
        publish went on by another way. One read; a DROP only when there are some."""
        rows = self.client.query_rows(
            "SELECT name FROM system.tables WHERE database = {db:String} "
            "AND startsWith(name, '_tmp_replace_') "
            "AND metadata_modification_time < now() - {age:UInt32}",
            parameters={"db": self.staging_db, "age": int(older_than_s)},
            what=f"list leftover fills in {self.staging_db}",
        )
        names = [str(r[0]) for r in rows if _LEFTOVER_FILL_RE.fullmatch(str(r[0]))]
        if names:
            log.warning("dropping leftover fills of a killed server: %s", names)
            self.client.command(
                "DROP TABLE IF EXISTS "
                + ", ".join(qualified(self.staging_db, n) for n in names)
                + " SYNC",
                table=f"{self.staging_db}.{names[0]}",
                what=f"drop leftover fills in {self.staging_db}",
            )
        return names

    def drop_staging(self, table: str) -> None:
        self.drop_stagings([table])

    def drop_stagings(self, tables: Sequence[str], *, wait: bool = True) -> None:
        """Drop staging tables: ``DROP TABLE IF EXISTS a, b, ... SYNC``, one statement per
        ``MAX_DROP_BYTES`` of names (a batch of 200 tasks' tables and its batch staging
        is one). ``wait=False`` leaves out ``SYNC``: the names are free at once, an
        Atomic database deletes the data later (``database_atomic_delay_before_drop_
        table_sec``), and a replicated table's Keeper path goes only then."""
        names = [self._staging(t, "drop") for t in tables]
        at = 0
        while at < len(names):
            end, size = at + 1, len(names[at])
            while end < len(names) and size + len(names[end]) + 2 <= MAX_DROP_BYTES:
                size += len(names[end]) + 2
                end += 1
            self.client.command(
                f"DROP TABLE IF EXISTS {', '.join(names[at:end])}" + (" SYNC" if wait else ""),
                table=f"{self.staging_db}.{tables[at]}",
            )
            at = end

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
            self._protect_read(fq, self.target_info(f"{self.staging_db}.{table}", staging=True))


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
