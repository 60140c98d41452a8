"""The ClickHouse side of dedup mode: token inserts, the dedup window, view tables.

Every SQL statement dedup mode sends lives here, so the Spark layer holds none
(:mod:`txsink.spark.dedup_write` decides with :mod:`txsink.protocol.dedup` and calls
:class:`DedupTarget`). Three things:

- :meth:`DedupTarget.insert`: one deterministic block with its
  ``insert_deduplication_token`` and every setting the guarantee relies on
  (:func:`insert_settings`);
- :meth:`DedupTarget.observe`: the target's dedup window and block counter, one query per
  block, over all of the target's partitions (the first one of a task also reads the
  server's defaults of the window settings). The counter bounds the dedup entries added
  since a mark (see the window section of :mod:`txsink.protocol.dedup`): the highest block
  number for non-replicated targets (numbered per table), the sum over partitions of
  highest block number + 1 for replicated ones (numbered per partition). Outdated parts
  still listed count too;
- :func:`view_tables`: the tables the target's materialized views store into, for
  validation (a view table without a dedup window counts a replayed block twice).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any

from txsink.clickhouse.blockers import dedup_window
from txsink.clickhouse.insert_settings import DEDUP_INSERT_SETTINGS
from txsink.clickhouse.sqltext import parse_settings_clause
from txsink.errors import ConfigError
from txsink.names import split_table
from txsink.ports.warehouse import WINDOW_SECONDS_KEY, TargetInfo
from txsink.protocol import dedup_window as dw
from txsink.protocol.ids import dedup_token

# Effectively no byte limit: block boundaries depend on row counts only (a byte limit
# computed from Arrow buffer sizes could cut a replayed partition differently).
NO_BYTE_LIMIT = 1 << 62

WINDOW_KEYS = (
    "non_replicated_deduplication_window",
    "replicated_deduplication_window",
    WINDOW_SECONDS_KEY,
)

_MARK_FROM = (
    " FROM (SELECT engine, engine_full FROM system.tables "
    " WHERE database = {db:String} AND name = {t:String}) AS t CROSS JOIN "
    "(SELECT max(m) AS mx, sum(m + 1) AS sm FROM (SELECT partition_id, "
    " max(max_block_number) AS m FROM system.parts "
    " WHERE database = {db:String} AND table = {t:String} GROUP BY partition_id)) AS p"
)
_MARK_SQL = "SELECT t.engine, t.engine_full, p.mx, p.sm, toFloat64(now64(3))" + _MARK_FROM
# The first observation of a task also reads the server's defaults of the window settings,
# in the same statement (one round trip): a later one only needs the counter and the clock.
_FIRST_MARK_SQL = (
    "SELECT t.engine, t.engine_full, p.mx, p.sm, toFloat64(now64(3)), "
    "(SELECT groupArray((name, value)) FROM system.merge_tree_settings "
    " WHERE name IN {names:Array(String)})" + _MARK_FROM
)


def insert_settings(
    job: str, xid: str, partition: int, index: int, user: Iterable[tuple[str, str]] = ()
) -> dict[str, Any]:
    """Per-block insert settings of dedup mode: the user's (option ``settings.<name>``),
    then the block's token and every setting the guarantee relies on
    (:data:`~txsink.clickhouse.insert_settings.DEDUP_INSERT_SETTINGS`), which win; the
    warehouse leaves out the 26.x spellings an older server does not know."""
    return {
        **dict(user),
        "insert_deduplication_token": dedup_token(job, xid, partition, index),
        **DEDUP_INSERT_SETTINGS,
    }


class DedupTarget:
    """The target of a dedup-mode task, over one (borrowed) warehouse."""

    def __init__(
        self, warehouse: Any, table: str, settings: tuple[tuple[str, str], ...] = ()
    ) -> None:
        self.warehouse = warehouse
        self.client = warehouse.client
        self.table = table
        self.settings = settings  # the user's settings.<name> options
        self.db, self.name = split_table(table)
        self._defaults: dict[str, str] | None = None

    def insert(
        self,
        block: Any,
        *,
        job: str,
        xid: str,
        partition: int,
        index: int,
        resend_ok: Callable[[], bool] | None = None,
    ) -> None:
        """Insert the Arrow table ``block`` as ONE ClickHouse block with its token; a
        retry after an unknown outcome is sent only while ``resend_ok()`` (else
        :class:`~txsink.errors.FencedError`)."""
        self.warehouse.insert_blocks(
            self.table,
            block.to_batches(),
            block_rows=block.num_rows,
            block_bytes=NO_BYTE_LIMIT,
            settings=insert_settings(job, xid, partition, index, self.settings),
            resend_ok=resend_ok,
        )

    def observe(self) -> tuple[dw.Mark, dw.Window] | None:
        """(counter and server time, window now); None where no window can be observed."""
        params: dict[str, Any] = {"db": self.db, "t": self.name}
        if self._defaults is not None:
            sql = _MARK_SQL
        else:
            sql, params["names"] = _FIRST_MARK_SQL, list(WINDOW_KEYS)
        rows = self.client.query_rows(
            sql,
            parameters=params,
            what=f"read the block counter of {self.table}",
            table=self.table,
        )
        if not rows:
            raise ConfigError(f"table {self.table} disappeared during a dedup-mode write")
        engine, engine_full, mx, sm, now = rows[0][:5]
        if self._defaults is None:
            self._defaults = {str(k): str(v) for k, v in rows[0][5]}
        settings = {**self._defaults, **parse_settings_clause(str(engine_full))}
        info = TargetInfo(self.db, self.name, str(engine), str(engine_full), settings=settings)
        window = dedup_window(info)
        if window is None:
            return None
        counter = int(sm) if info.is_replicated else int(mx)
        return dw.Mark(counter, float(now)), window


_TO_RE = re.compile(
    r"\bMATERIALIZED\s+VIEW\s+.+?\s+TO\s+((?:`[^`]+`|[A-Za-z_][A-Za-z0-9_]*)"
    r"(?:\s*\.\s*(?:`[^`]+`|[A-Za-z_][A-Za-z0-9_]*))?)",
    re.IGNORECASE | re.DOTALL,
)


def view_tables(warehouse: Any, info: TargetInfo) -> tuple[TargetInfo, ...]:
    """The tables ``info``'s materialized views store into (``TO`` table or inner table).

    Driver-side, for :func:`txsink.clickhouse.blockers.dedup_blockers`: a view table without
    a dedup window counts a replayed block twice.
    """
    out: list[TargetInfo] = []
    for view in info.dependent_views:
        vdb, vname = view.split(".", 1)
        what = f"inspect materialized view {view}"
        row = _system_table(warehouse, "create_table_query, toString(uuid)", vdb, vname, what)
        if row is None:
            continue
        create, uuid = str(row[0]), str(row[1])
        m = _TO_RE.search(create.split(" AS SELECT", 1)[0])
        if m:
            parts = [p.strip().strip("`") for p in m.group(1).split(".", 1)]
            names = [f"{parts[0]}.{parts[1]}" if len(parts) == 2 else f"{vdb}.{parts[0]}"]
        else:
            names = [f"{vdb}..inner_id.{uuid}", f"{vdb}..inner.{vname}"]
        for name in names:
            db, table = name.split(".", 1)
            what = f"find the table of materialized view {view}"
            if _system_table(warehouse, "1", db, table, what) is not None:
                quoted = f"{db}.`{table}`" if table.startswith(".") else name
                out.append(warehouse.target_info(quoted))
                break
    return tuple(out)


def _system_table(warehouse: Any, columns: str, db: str, name: str, what: str) -> Any:
    """``columns`` (a constant SQL list) of table ``db.name`` in system.tables; None if
    there is no such table."""
    rows = warehouse.client.query_rows(
        f"SELECT {columns} FROM system.tables "
        "WHERE database = {db:String} AND name = {t:String}",
        parameters={"db": db, "t": name},
        what=what,
    )
    return rows[0] if rows else None
