"""The ClickHouse adapter of the :class:`~txsink.ports.warehouse.Warehouse` port.

Owned by the ClickHouse adapter. :class:`ClickHouseWarehouse` implements the port over
one :class:`~.client.Client`, in layers of one concern each: :class:`~.observe.Observer`
(reads), :class:`~.staging.Stager` (staging DDL), :class:`~.publish.Publisher` (MOVE,
ATTACH, claims) and, here, inserts. Invariants (the layers' docstrings say more):

- only tables whose name :func:`~txsink.protocol.ids.parse_staging` recognises, inside
  ``staging_db``, are ever created, dropped or moved from;
- staging keeps every row it was sent until published; staging inserts run with
  :data:`~.insert_settings.STAGING_INSERT_SETTINGS` (no deduplication in either
  spelling, no async insert, no ``optimize_on_insert``, no partition limit per block);
- ``insert_blocks`` holds at most one block (plus the batch being cut) in memory.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import pyarrow as pa

from txsink.clickhouse.blocks import iter_blocks
from txsink.clickhouse.dedup_insert import (
    SEAL_TABLE,
    guarded_insert_sql,
    seal_row_sql,
    seal_table_sql,
)
from txsink.clickhouse.error_map import UNKNOWN_DATABASE, UNKNOWN_TABLE
from txsink.clickhouse.insert_settings import OPTIONAL_INSERT_SETTINGS, STAGING_INSERT_SETTINGS
from txsink.clickhouse.observe import TABLE_ALREADY_EXISTS
from txsink.clickhouse.publish import Publisher
from txsink.errors import ConfigError, RetryableConflict, TxSinkError, UnavailableError
from txsink.names import split_table
from txsink.ports.warehouse import (
    BlockSettings,
    InsertGuard,
    InsertStats,
    TargetInfo,
    WarehouseCapabilities,
)

__all__ = [
    "ClickHouseWarehouse",
]

log = logging.getLogger(__name__)


class ClickHouseWarehouse(Publisher):
    """:class:`~txsink.ports.warehouse.Warehouse` over one :class:`~.client.Client`.
    Cheap to create; holds no state. One server: no per-shard counts (a
    :class:`~.shards.ShardedWarehouse` has them)."""

    capabilities = WarehouseCapabilities(per_shard_counts=False)

    def partition_rows_by_shard(self, table: str) -> list[dict[str, int]]:
        raise self.capabilities.missing(
            "per_shard_counts",
            f"rows per shard of {table}",
            "a single server has one shard: use partition_rows",
        )

    def target_infos(self, target: str) -> list[TargetInfo]:
        """The target on every server of this warehouse: one."""
        return [self.target_info(target)]

    def create_target(self, table: str, sql: str) -> None:
        """Run a target's ``CREATE TABLE IF NOT EXISTS`` (``create_table=if_missing``, the
        statement from :func:`~.target_ddl.plan_create`). Idempotent; a writer racing
        another to create the table succeeds (``TABLE_ALREADY_EXISTS`` is what a
        concurrent create may answer). A statement the server refuses is a ConfigError
        naming the creation options and showing the statement."""
        try:
            self.client.command(sql, table=table, what=f"create {table}")
        except TxSinkError as exc:
            if exc.code == TABLE_ALREADY_EXISTS:
                return
            if isinstance(exc, (ConfigError, UnavailableError, RetryableConflict)):
                raise
            raise ConfigError(
                f"creating {table} on {self.client.url} (create_table=if_missing) failed: "
                f"{exc}. Check the options order_by, partition_by, engine and "
                f"table_settings; the statement was:\n{sql}",
                code=exc.code,
            ) from exc

    # ------------------------------------------------------------------ dedup seals

    def ensure_seal_table(self) -> None:
        """The staging database and its seal table (validation of a dedup-mode job: every
        guarded insert reads it)."""
        self.ensure_staging_db()
        self.client.command(
            seal_table_sql(self.staging_db), table=f"{self.staging_db}.{SEAL_TABLE}"
        )

    def seal_dedup(self, tag: str) -> None:
        """Write seal row ``tag``: no guarded insert carrying it starts afterwards. A
        repeated row is harmless (the guard counts rows). A seal table dropped since
        validation is made again (the inserts of the xid fail without it: none lands)."""

        self._with_seal_table(
            lambda: self.client.command(
                seal_row_sql(self.staging_db),
                parameters={"tag": tag},
                table=f"{self.staging_db}.{SEAL_TABLE}",
                what=f"seal {tag}",
            )
        )

    def _with_seal_table(self, statement: Callable[[], Any]) -> None:
        """Run ``statement``; if the seal table (or the staging database) is missing, make
        it and run it once more: the refusal came before anything was written."""
        try:
            statement()
        except ConfigError as exc:
            missing = exc.code in (UNKNOWN_TABLE, UNKNOWN_DATABASE)
            if not missing or self.staging_db not in str(exc):
                raise
            self.ensure_seal_table()
            statement()

    # ------------------------------------------------------------------ inserts

    def _insert_guarded(
        self,
        db: str,
        name: str,
        block: Any,
        guard: InsertGuard,
        settings: Mapping[str, Any],
        idempotent: bool,
        resend_ok: Callable[[], bool] | None,
    ) -> None:
        """One dedup block, guarded (:func:`~.dedup_insert.guarded_insert_sql`); a seal
        table missing (a plan validated by an older txsink, staging dropped by hand) is
        made first (:meth:`_with_seal_table`)."""
        sql = guarded_insert_sql(db, name, block.schema.names, guard, self.staging_db)
        self._with_seal_table(
            lambda: self.client.insert_arrow_sql(
                sql,
                block,
                settings=settings or None,
                idempotent=idempotent,
                resend_ok=resend_ok,
                table=f"{db}.{name}",
            )
        )

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
        """Send ``batches`` as blocks of at most ``block_rows`` rows / ``block_bytes`` bytes.

        ``table`` is ``db.table``, or a bare staging table name (in ``staging_db``; its
        inserts run with ``optimize_on_insert=0``). ``settings`` is a dict for every block
        or a callable ``block_index -> dict`` (dedup mode: a per-block
        ``insert_deduplication_token``); the user's ``settings.<name>`` options arrive
        here, under the staging settings, which win.
        A block is retried after an ambiguous failure only if it carries such a token, and
        only while ``resend_ok()`` is true (else :class:`~txsink.errors.FencedError`).
        ``guard`` (dedup mode): each block is sent as the statement of
        :func:`~.dedup_insert.guarded_insert_sql`, which the server refuses once the
        xid is sealed (FencedError) or the window moved (RetryableConflict).
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
            # txsink's staging settings win over any given (a user's settings.<name>)
            block_settings = self.client.known({**(extra or {}), **base}, OPTIONAL_INSERT_SETTINGS)
            idempotent = bool(block_settings.get("insert_deduplication_token"))
            if guard is not None:
                self._insert_guarded(db, name, block, guard, block_settings, idempotent, resend_ok)
            else:
                self.client.insert_arrow(
                    db,
                    name,
                    block,
                    settings=block_settings or None,
                    idempotent=idempotent,
                    resend_ok=resend_ok,
                )
            rows += block.num_rows
            size += block.nbytes
            blocks += 1
            del block  # let the block go before the next one is assembled
        log.debug("inserted %d rows (%d bytes) in %d blocks into %s", rows, size, blocks, table)
        return InsertStats(rows, size, blocks)
