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
  validation (a view table without a dedup window counts a replayed block twice);
- the seal (:func:`guarded_insert_sql`, :data:`SEAL_TABLE`): every block is sent as
  ``INSERT ... SELECT ... FROM input() WHERE`` checks the server makes when the insert
  starts: the xid's seal row is absent (the commit writes it, then waits out the
  inserts still running, before COMMITTED) and the window bounds the task just checked
  still hold. An attempt frozen anywhere before its insert starts on the server (a GC
  pause, a partition) therefore writes nothing once its batch is sealed.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any

from txsink.clickhouse.blockers import dedup_window
from txsink.clickhouse.error_map import SEALED_MARK, WINDOW_MARK
from txsink.clickhouse.insert_settings import DEDUP_INSERT_SETTINGS
from txsink.clickhouse.sqltext import parse_settings_clause
from txsink.errors import ConfigError
from txsink.names import qualified, quote_ident, quote_literal, split_table
from txsink.ports.warehouse import WINDOW_SECONDS_KEY, InsertGuard, TargetInfo
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

# The block counter (see txsink.protocol.dedup_window): mx for non-replicated targets, sm
# for replicated ones; {db}/{t} are query parameters here, literals in a guarded insert.
_COUNTERS = (
    "SELECT max(m) AS mx, sum(m + 1) AS sm FROM (SELECT partition_id, "
    " max(max_block_number) AS m FROM system.parts "
    " WHERE database = {db} AND table = {t} GROUP BY partition_id)"
)
_MARK_FROM = (
    " FROM (SELECT engine, engine_full FROM system.tables "
    " WHERE database = {db:String} AND name = {t:String}) AS t CROSS JOIN "
    "(" + _COUNTERS.format(db="{db:String}", t="{t:String}") + ") AS p"
)
_MARK_SQL = "SELECT t.engine, t.engine_full, p.mx, p.sm, toFloat64(now64(3))" + _MARK_FROM
# The first observation of a task also reads the server's defaults of the window settings,
# in the same statement (one round trip): a later one only needs the counter and the clock.
# ... and the target's column types (a guarded insert sends the block as typed input).
_FIRST_MARK_SQL = (
    "SELECT t.engine, t.engine_full, p.mx, p.sm, toFloat64(now64(3)), "
    "(SELECT groupArray((name, value)) FROM system.merge_tree_settings "
    " WHERE name IN {names:Array(String)}), "
    "(SELECT groupArray((name, type)) FROM system.columns "
    " WHERE database = {db:String} AND table = {t:String})" + _MARK_FROM
)
# Where the commit of a dedup xid writes its seal row (in the staging database).
SEAL_TABLE = "txsink_seals"
# A seal must outlive every attempt of its batch; the Keeper check stops them after the
# record is pruned too.
SEAL_TTL_DAYS = 30


def seal_table_sql(staging_db: str) -> str:
    """``CREATE TABLE IF NOT EXISTS`` of the seal table (validation of a dedup job)."""
    return (
        f"CREATE TABLE IF NOT EXISTS {qualified(staging_db, SEAL_TABLE)} "
        "(tag String, sealed_at DateTime DEFAULT now()) ENGINE = MergeTree ORDER BY tag "
        f"TTL sealed_at + INTERVAL {SEAL_TTL_DAYS} DAY"
    )


def seal_row_sql(staging_db: str) -> str:
    """The commit's seal row (parameter ``tag``)."""
    return f"INSERT INTO {qualified(staging_db, SEAL_TABLE)} (tag) VALUES ({{tag:String}})"


def guarded_insert_sql(
    db: str, table: str, columns: Iterable[str], guard: InsertGuard, staging_db: str
) -> str:
    """The statement a guarded block is sent with (Arrow data in the request body).

    Its WHERE clause is checked by the server when the insert starts, before any row is
    read: ``throwIf`` refuses the whole insert (nothing written, error 395 with
    :data:`~.error_map.SEALED_MARK` or :data:`~.error_map.WINDOW_MARK`) when the seal
    row exists or the block counter or clock left ``guard.window``. The seal's literal
    stays in the statement's text: that is how the commit finds it in
    ``system.processes``."""
    cols = list(columns)
    types = dict(guard.types)
    missing = [c for c in cols if c not in types]
    if missing:
        raise ConfigError(
            f"table {db}.{table} has no column(s) {missing} that the block carries; "
            "the DataFrame's columns must be the table's"
        )
    names = ", ".join(quote_ident(c) for c in cols)
    structure = ", ".join(f"{quote_ident(c)} {types[c]}" for c in cols)
    checks = [
        f"(SELECT throwIf(count() > 0, {quote_literal(SEALED_MARK)}) "
        f"FROM {qualified(staging_db, SEAL_TABLE)} WHERE tag = {quote_literal(guard.seal)})"
    ]
    w = guard.window
    if w is not None:
        counter = "sm" if guard.replicated else "mx"
        late = "" if w.deadline is None else f" OR toFloat64(now64(3)) > {w.deadline!r}"
        checks.append(
            f"(SELECT throwIf({counter} < {w.counter_min} OR {counter} > {w.counter_max}"
            f"{late}, {quote_literal(WINDOW_MARK)}) FROM ("
            + _COUNTERS.format(db=quote_literal(db), t=quote_literal(table))
            + "))"
        )
    where = " AND ".join(f"{c} = 0" for c in checks)
    return (
        f"INSERT INTO {qualified(db, table)} ({names}) SELECT * "
        f"FROM input({quote_literal(structure)}) WHERE {where} FORMAT Arrow"
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
        self._types: tuple[tuple[str, str], ...] | None = None  # the target's columns
        self._replicated = False

    def insert(
        self,
        block: Any,
        *,
        job: str,
        xid: str,
        partition: int,
        index: int,
        seal: str,
        window: dw.Guard | None = None,
        resend_ok: Callable[[], bool] | None = None,
    ) -> None:
        """Insert the Arrow table ``block`` as ONE ClickHouse block with its token, guarded
        on the server by the xid's seal row ``seal`` and the ``window`` bounds
        (:func:`guarded_insert_sql`); a retry after an unknown outcome is sent only while
        ``resend_ok()`` (else :class:`~txsink.errors.FencedError`, as when the server
        finds the seal)."""
        if self._types is None:  # the plan observes before every insert; a read otherwise
            self._first_read()
        guard = InsertGuard(seal, self._types or (), window, self._replicated)
        self.warehouse.insert_blocks(
            self.table,
            block.to_batches(),
            block_rows=block.num_rows,
            block_bytes=NO_BYTE_LIMIT,
            settings=insert_settings(job, xid, partition, index, self.settings),
            resend_ok=resend_ok,
            guard=guard,
        )

    def _first_read(self) -> None:
        self._defaults = None
        self.observe()

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
            self._types = tuple((str(n), str(t)) for n, t in rows[0][6])
        settings = {**self._defaults, **parse_settings_clause(str(engine_full))}
        info = TargetInfo(self.db, self.name, str(engine), str(engine_full), settings=settings)
        self._replicated = info.is_replicated
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
