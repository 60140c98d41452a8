"""The Keeper layout served by a ``KeeperMap`` table: the ``state=clickhouse`` store.

ClickHouse Cloud exposes no Keeper endpoint, but its ``KeeperMap`` engine keeps each row
in Keeper and is reached through SQL. :class:`KeeperMapNodes` gives the Keeper registry
(:class:`~txsink.keeper.kazoo_registry.KazooRegistry`) the few kazoo client calls it
makes (get, exists, children, create, set, delete, sync and the multi-op transaction),
each served by one table::

    <state_database>.nodes (key String, value String, ver UInt32, czxid UInt64,
                            pending String, tx String)  ENGINE = KeeperMap('/txsink/<db>')

``key`` is the node's path, ``value`` its data, ``ver`` its version (kept by txsink:
KeeperMap's own znode versions are not readable), ``czxid`` its creation order (the
writer's clock in nanoseconds), ``pending`` the id of a transaction that inserted the
row and has not yet confirmed it, ``tx`` the id of the last transaction that wrote it
(so a write whose reply was lost is recognised as ours). So the registry, its fencing,
records, ledger and dedup state are one code path on both stores
(:mod:`txsink.ports.registry`).

Every statement runs with ``keeper_map_strict_mode = 1`` (an INSERT of an existing key
fails; a write over a row that changed since the statement read it fails with "Bad
version"), and each statement is one Keeper multi-request. What KeeperMap cannot do in
one statement, a transaction does in steps (:meth:`KeeperMapNodes.commit`):

1. one read of every row the transaction names; a check, set or delete of a row not at
   the expected version, or a create of an existing row, fails here as kazoo would;
2. creates: one INSERT of the new rows marked ``pending`` with the transaction's id
   (all or nothing). Readers treat a pending row as absent. A create that finds
   another's pending row waits for it (NodeExists once it is confirmed): only a row
   older than ``PENDING_STALE_S``, a dead creator's, is taken over (its owner then can
   no longer confirm it);
3. one ``ALTER TABLE ... UPDATE`` over every checked, set and created row: a ``throwIf``
   guard re-checks each row's version (and that each created row is still ours), the
   sets are written and the creates confirmed. The guard and Keeper's own versions make
   this one compare-and-set: all rows or none;
4. deletes: one ``DELETE`` guarded the same way, after step 3.

A transaction of checks only (a fence) is step 1 alone: one read; one of checks and sets
at versions the caller read (a commit) is step 3 and its read-back. A transaction of one
op needs fewer (issue 29): a lone create is one ``INSERT`` of a
confirmed row (strict mode makes it create-if-absent; its ``SELECT`` refuses it while
the parent is not live), a lone set at a given version one guarded ``UPDATE`` and its
read-back. Anything they cannot decide alone (a stale pending row, a row rewritten at
the same version, a reply that may be a retried request's) goes through the steps.

What one statement costs (4 to 15 ms on the embedded stack, most of a commit's time)
decides the rest: the table is checked once per process; paths ``ensure_path`` made or
saw are remembered (a create refused because a remembered parent went missing makes it
again and runs once more, as the registry's own ensure would have); reads asked
together (kazoo's pipelined ``get_async``: ``list`` asks for every record at once) are
one ``SELECT``, answered before any later write runs; a listing scans only if its node
exists.

Windows this leaves, and why each is acceptable (docs/cloud.md says the same):

- An UPDATE rewrites every row it names, checked rows too, so two transactions that
  only check one row (the epoch) collide inside Keeper where ZooKeeper takes both: a
  transaction that lost but finds nothing it relies on moved decides again
  (``MAX_ROUNDS``). Manifest chunks are checked by reading before and after instead
  (:func:`_read_checked`).

- Deletes are not atomic with the checks of their transaction (step 4 follows step 3):
  a writer fenced between the two can still delete. txsink deletes only what every
  writer agrees is garbage (records past retention, orphaned manifest chunks).
- An UPDATE skips rows that do not exist without an error. Step 1 sees every row, and
  the outcome is read back after step 3: a row deleted between them is reported as a
  broken transaction (``TxSinkError``), never as success. Nothing deletes the rows a
  commit writes (the epoch, the ledger, a PREPARED record) while it runs.
- The server retries a Keeper request after a connection loss, so a write that landed
  can be reported as "Bad version" or "Node exists": both are followed by a read that
  recognises our own write (the transaction's id, the values written).
- ``sync`` is a no-op: every reader of one server shares that server's Keeper session.
  Behind a load balancer over several replicas (ClickHouse Cloud) a read may lag a
  write made through another replica; the registry's fenced writes still refuse a stale
  decision, but a status read may be a moment old.
- A DELETE removes at most the first block of rows the mutation reads
  (``StorageKeeperMap::mutate`` returns after it): a recursive delete repeats until
  nothing under the node is left.
- Rows have no hierarchy: a lone delete refuses a node with children by a scan before
  its DELETE and another after it (the node is put back if a child appeared), not in
  one step. Only an emptied ``dedup/<xid>`` node is deleted that way, and a dedup task
  of that xid would have to create its first state within those milliseconds.
- Listing children scans the table (KeeperMap reads keys only by equality), so the cost
  grows with all jobs' state; retention keeps it bounded.
"""

from __future__ import annotations

import contextlib
import random
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from kazoo.exceptions import (
    BadVersionError,
    ConnectionLoss,
    NodeExistsError,
    NoNodeError,
    NotEmptyError,
    RolledBackError,
)

from txsink.clickhouse.insert_settings import KEEPERMAP_SETTINGS
from txsink.errors import ConfigError, TxSinkError, UnavailableError
from txsink.names import quote_ident, quote_literal
from txsink.ports.manifest_codec import CHUNKS_DIR

# validation checks them against the user's settings constraints (insert_settings)
STRICT = KEEPERMAP_SETTINGS
#: seconds after which an unconfirmed row is a dead creator's, taken over by the next
#: create (a live creator confirms its rows within a few statements)
PENDING_STALE_S = 15.0
# re-decisions of one transaction that lost to a write it does not care about. Not
# tenacity (which retries the single calls elsewhere): each round decides again from what
# the last one read and may end in a refusal or a win found in the rows, not a retry
MAX_ROUNDS = 30
TABLE = "nodes"
COLUMNS = (
    ("key", "String"),
    ("value", "String"),
    ("ver", "UInt32"),
    ("czxid", "UInt64"),
    ("pending", "String"),
    ("tx", "String"),
)
KEEPER_EXCEPTION = 999  # Keeper said no: Bad version, Node exists, Connection loss
GUARD_FAILED = 395  # FUNCTION_THROW_IF_VALUE_IS_NON_ZERO

# (url, database) of state tables this process has seen with txsink's columns
_CHECKED_TABLES: set[tuple[str, str]] = set()


@dataclass(frozen=True)
class Stat:
    """The two fields of a znode stat the registry reads."""

    version: int
    czxid: int


@dataclass(frozen=True)
class Row:
    value: bytes
    ver: int
    czxid: int
    pending: str
    tx: str = ""


class _Done:
    """kazoo's async result, already resolved (or resolved on first ``get``)."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self._fn = fn
        self._ran = False
        self._value: Any = None
        self._error: BaseException | None = None

    def get(self, timeout: float | None = None) -> Any:
        if not self._ran:
            self._ran = True
            try:
                self._value = self._fn()
            except BaseException as exc:  # noqa: BLE001 - handed to the waiter below
                self._error = exc
        if self._error is not None:
            raise self._error
        return self._value


class _Read:
    """kazoo's async result of a read, answered with the other reads asked with it
    (:meth:`KeeperMapNodes._ask`)."""

    def __init__(self, nodes: KeeperMapNodes, path: str, answer: Callable[[Row | None], Any]):
        self._nodes = nodes
        self.path = path
        self._answer = answer
        self._done = False
        self._value: Any = None
        self._error: BaseException | None = None

    def serve(self, row: Row | None) -> None:
        self._done = True
        try:
            self._value = self._answer(row)
        except BaseException as exc:  # noqa: BLE001 - handed to the waiter below
            self._error = exc

    def fail(self, error: BaseException) -> None:
        self._done, self._error = True, error

    def get(self, timeout: float | None = None) -> Any:
        if not self._done:
            self._nodes._serve_asked()
        if not self._done:  # asked while another thread was serving: on its own
            try:
                self.serve(self._nodes._read([self.path]).get(self.path))
            except BaseException as exc:  # noqa: BLE001 - handed to the waiter below
                self.fail(exc)
        if self._error is not None:
            raise self._error
        return self._value


class _NeverTimesOut(Exception):
    """Requests run synchronously here: kazoo's handler timeout never fires."""


class _Handler:
    timeout_exception = _NeverTimesOut


@dataclass(frozen=True)
class Op:
    kind: str  # check | create | set | delete
    path: str
    data: bytes = b""
    version: int = -1


class _Transaction:
    """kazoo's ``TransactionRequest``: ops collected, run by :meth:`commit_async`."""

    def __init__(self, nodes: KeeperMapNodes) -> None:
        self._nodes = nodes
        self.ops: list[Op] = []

    def check(self, path: str, version: int) -> None:
        self.ops.append(Op("check", path, version=version))

    def create(self, path: str, value: bytes = b"", acl: Any = None, **_: Any) -> None:
        self.ops.append(Op("create", path, value))

    def set_data(self, path: str, value: bytes, version: int = -1) -> None:
        self.ops.append(Op("set", path, value, version))

    def delete(self, path: str, version: int = -1) -> None:
        self.ops.append(Op("delete", path, version=version))

    def commit_async(self) -> _Done:
        return _Done(lambda: self._nodes.commit(self.ops))


def lit(value: str) -> str:
    """A string as an SQL literal (values travel in the request body, not the URL)."""
    return quote_literal(value)


def blob(data: bytes) -> str:
    """Bytes as an SQL expression (hex: any byte survives, nothing to escape)."""
    return f"unhex('{data.hex()}')"


def _transient(ops: Sequence[Op]) -> set[str]:
    """Paths the transaction creates and then deletes (a proof that they are absent)."""
    made = {op.path for op in ops if op.kind == "create"}
    return {op.path for op in ops if op.kind == "delete" and op.path in made}


def _read_checked(op: Op) -> bool:
    """A check of a manifest chunk: chunks are written once and never changed, and an
    UPDATE rewrites every row it names, so checking a record's chunks inside one would
    make the Keeper request grow by every chunk's size (past ZooKeeper's 1 MiB from four
    full chunks). They are checked by reading, before and after the write; the xid row,
    which the same transaction creates, orders a prepare against a sweep of its chunks."""
    return op.kind == "check" and f"/{CHUNKS_DIR}/" in op.path


def _parent(path: str) -> str:
    return path.rsplit("/", 1)[0] or "/"


def _failed(ops: Sequence[Op], culprit: int, error: Exception) -> list[Any]:
    """kazoo's result list of a failed multi: the culprit's error, the rest rolled back."""
    return [error if i == culprit else RolledBackError() for i in range(len(ops))]


class KeeperMapNodes:
    """Keeper nodes in one KeeperMap table; the kazoo client calls the registry makes.

    ``client`` is a :class:`txsink.clickhouse.client.Client` on the server holding the
    state (closed by :meth:`close`). Creating the database and table is idempotent."""

    handler = _Handler()
    connected = True
    # A manifest chunk is written on its own, before the prepare's transaction, even when
    # it is the only one: a chunk row left unconfirmed by a transaction cut short would
    # never be taken over (its key is unique) nor swept (listings see confirmed rows).
    chunks_in_transactions = False

    def __init__(self, client: Any, database: str, *, clock: Callable[[], int] = time.time_ns):
        self._ch = client
        self._clock = clock
        self.database = database
        self.table = f"{quote_ident(database)}.{TABLE}"
        self.where = f"{client.url} ({database}.{TABLE}, KeeperMap)"
        # Paths ensure_path saw or made: it skips them next time (the registry ensures
        # the xids directory before every prepare). A path can be deleted behind our
        # back: deletes forget what they touch, and a create refused because a parent
        # remembered here is gone makes the parent again and runs once more (commit).
        self._ensured: set[str] = set()
        # reads asked for (kazoo's *_async) and not yet waited on: served by one SELECT
        self._asked: list[_Read] = []
        self._create_table()

    # -- the table -----------------------------------------------------------------------

    def _create_table(self) -> None:
        """Make sure the state table exists with txsink's columns: one read of
        ``system.columns`` when it does (the usual case: it is created once), the
        CREATEs only when it does not. Once seen, a table is not checked again by this
        process (a table dropped under a running writer makes its statements fail)."""
        seen = (self._ch.url, self.database)
        if seen in _CHECKED_TABLES:
            return
        try:
            found = self._columns()
            if not found:
                self._ch.command(f"CREATE DATABASE IF NOT EXISTS {quote_ident(self.database)}")
                self._ch.command(
                    f"CREATE TABLE IF NOT EXISTS {self.table} "
                    f"({', '.join(f'{n} {t}' for n, t in COLUMNS)}) "
                    f"ENGINE = KeeperMap('/txsink/{self.database}') PRIMARY KEY key"
                )
                found = self._columns()
        except UnavailableError:
            raise
        except TxSinkError as exc:
            if "keeper_map_path_prefix" in str(exc) or "KeeperMap is disabled" in str(exc):
                raise ConfigError(
                    f"state=clickhouse needs KeeperMap tables, and the server at "
                    f"{self._ch.url} has them disabled (no `keeper_map_path_prefix` in its "
                    "config): set it (ClickHouse Cloud has it), or use state=keeper"
                ) from exc
            raise ConfigError(
                f"state=clickhouse cannot create its table {self.database}.{TABLE} on "
                f"{self._ch.url}: {exc}; grant CREATE DATABASE/TABLE on "
                f"{self.database}, or create it as docs/cloud.md shows"
            ) from exc
        if sorted((str(n), str(t)) for n, t in found) != sorted(COLUMNS):
            raise ConfigError(
                f"the state table {self.database}.{TABLE} on {self._ch.url} has columns "
                f"{sorted(found)}, not txsink's {sorted(COLUMNS)}: it was made by another "
                "release or program; name another state_database"
            )
        _CHECKED_TABLES.add(seen)

    def _columns(self) -> list[tuple[Any, ...]]:
        rows: list[tuple[Any, ...]] = self._ch.query_rows(
            "SELECT name, type FROM system.columns WHERE database = {d:String} "
            "AND table = {t:String}",
            parameters={"d": self.database, "t": TABLE},
        )
        return rows

    def _read(self, keys: Iterable[str]) -> dict[str, Row]:
        wanted = sorted(set(keys))
        if not wanted:
            return {}
        rows = self._ch.query_rows(
            f"SELECT key, hex(value), ver, czxid, pending, tx FROM {self.table} "
            "WHERE key IN {keys:Array(String)}",
            parameters={"keys": wanted},
            what="read of the state store",
        )
        return {k: Row(bytes.fromhex(v), int(ver), int(cz), p, tx) for k, v, ver, cz, p, tx in rows}

    def _ask(self, path: str, answer: Callable[[Row | None], Any]) -> _Read:
        """A read to be served together with every other read asked before the first of
        them is waited on (kazoo's pipelined ``get_async``: ``list`` asks for every
        record at once), in one SELECT."""
        read = _Read(self, path, answer)
        self._asked.append(read)
        return read

    def _serve_asked(self) -> None:
        asked, self._asked = self._asked, []
        if not asked:
            return
        try:
            rows = self._read(read.path for read in asked)
        except BaseException as exc:  # noqa: BLE001 - every waiter hears it
            for read in asked:
                read.fail(exc)
            return
        for read in asked:
            read.serve(rows.get(read.path))

    def _write(self, sql: str, what: str) -> None:
        """Run one write; Keeper's refusals become kazoo's errors, an unknown outcome
        (the connection to ClickHouse failed) kazoo's ConnectionLoss. Reads asked for
        before it are served first: they must not see it (kazoo's requests are FIFO)."""
        self._serve_asked()
        try:
            self._ch.command(sql, settings=STRICT, idempotent=False, what=what)
        except UnavailableError as exc:
            raise ConnectionLoss(str(exc)) from exc
        except TxSinkError as exc:
            text = str(exc)
            if exc.code == GUARD_FAILED:
                raise BadVersionError(text) from exc
            if exc.code != KEEPER_EXCEPTION:
                raise
            if "(Bad version)" in text:
                raise BadVersionError(text) from exc
            if "(Node exists)" in text:
                raise NodeExistsError(text) from exc
            raise ConnectionLoss(text) from exc  # connection loss and the like: unknown

    # -- kazoo's client calls ------------------------------------------------------------

    def start(self, timeout: float | None = None) -> None:
        return None

    def stop(self) -> None:
        return None

    def close(self) -> None:
        self._ch.close()

    def add_auth_async(self, scheme: str, credential: str) -> _Done:
        return _Done(lambda: None)  # ClickHouse's own user and grants protect the table

    def sync_async(self, path: str) -> _Done:
        return _Done(lambda: None)  # one server, one Keeper session: see the module doc

    def get_async(self, path: str) -> _Read:
        def answer(row: Row | None) -> tuple[bytes, Stat]:
            if row is None or row.pending:
                raise NoNodeError(path)
            return row.value, Stat(row.ver, row.czxid)

        return self._ask(path, answer)

    def exists_async(self, path: str) -> _Read:
        def answer(row: Row | None) -> Stat | None:
            return None if row is None or row.pending else Stat(row.ver, row.czxid)

        return self._ask(path, answer)

    def get_children_async(self, path: str) -> _Done:
        """The names under ``path``. KeeperMap finds rows by key only, so listing scans
        the table; the scan runs only if ``path`` itself is there (a scalar subquery on
        its key decides first), so asking about a node that does not exist (``dedup/<xid>``
        of an attach batch, every batch) costs a key lookup, not a scan."""

        def run() -> list[str]:
            self._serve_asked()
            prefix = path.rstrip("/") + "/"
            rows = self._ch.query_rows(
                f"SELECT key FROM {self.table} WHERE key = {{p:String}} AND pending = '' "
                f"UNION ALL SELECT key FROM {self.table} WHERE startsWith(key, {{d:String}}) "
                f"AND pending = '' AND (SELECT count() FROM {self.table} WHERE key = "
                "{p:String} AND pending = '') > 0",
                parameters={"p": path, "d": prefix},
                what="listing of the state store",
            )
            keys = [r[0] for r in rows]
            if not keys:
                raise NoNodeError(path)
            return sorted({k[len(prefix) :].split("/")[0] for k in keys if k != path})

        return _Done(run)

    def _has_children(self, path: str) -> bool:
        rows = self._ch.query_rows(
            f"SELECT count() FROM {self.table} WHERE startsWith(key, {{d:String}}) "
            "AND pending = ''",
            parameters={"d": path.rstrip("/") + "/"},
            what="listing of the state store",
        )
        return bool(rows and int(rows[0][0]))

    def ensure_path_async(self, path: str, acl: Any = None) -> _Done:
        def run() -> None:
            if path in self._ensured:
                return
            parts = path.strip("/").split("/")
            chain = ["/" + "/".join(parts[: i + 1]) for i in range(len(parts))]
            for attempt in range(50):  # a racing creator may hold a row unconfirmed
                self._serve_asked()
                found = self._read(chain)
                missing = [k for k in chain if k not in found or found[k].pending]
                if not missing:
                    self._ensured.update(chain)
                    return
                for key in missing:
                    try:
                        self.commit_or_raise([Op("create", key)])
                    except (NodeExistsError, NoNodeError, BadVersionError):
                        break  # raced: read again
                time.sleep(min(0.005 * (attempt + 1), 0.1))
            raise ConnectionLoss(f"{path} could not be created: it keeps changing")

        return _Done(run)

    def create_async(self, path: str, value: bytes = b"", acl: Any = None, **_: Any) -> _Done:
        return _Done(lambda: self.commit_or_raise([Op("create", path, value)])[0])

    def set_async(self, path: str, value: bytes, version: int = -1) -> _Done:
        return _Done(lambda: self.commit_or_raise([Op("set", path, value, version)])[0])

    def delete_async(self, path: str, version: int = -1) -> _Done:
        return _Done(lambda: self.commit_or_raise([Op("delete", path, version=version)])[0])

    def delete(self, path: str, version: int = -1, recursive: bool = False) -> bool:
        if not recursive:
            return bool(self.delete_async(path, version).get())
        self._forget(path)
        where = f"key = {lit(path)} OR startsWith(key, {lit(path.rstrip('/') + '/')})"
        left = -1
        while True:  # one DELETE removes at most one block of the rows it reads
            self._write(f"DELETE FROM {self.table} WHERE {where}", f"delete of {path} and under it")
            counted = self._ch.query_rows(
                f"SELECT count() FROM {self.table} WHERE {where}", what=f"count of {path}'s rows"
            )
            before, left = left, int(counted[0][0]) if counted else 0
            if left == 0:
                return True
            if left == before:
                raise TxSinkError(
                    f"state store {self.where}: deleting {path} and everything under it "
                    f"left {left} rows after a DELETE that removed none; something outside "
                    "txsink writes there: stop the jobs that use it and retry"
                )

    def transaction(self) -> _Transaction:
        return _Transaction(self)

    # -- transactions ----------------------------------------------------------------------

    def commit_or_raise(self, ops: Sequence[Op]) -> list[Any]:
        results = self.commit(ops)
        for result in results:
            if isinstance(result, Exception) and not isinstance(result, RolledBackError):
                raise result
        return results

    def commit(self, ops: Sequence[Op]) -> list[Any]:
        """Run ``ops`` as one transaction (see the module docstring); kazoo's result list:
        per op True (check, delete), the path (create) or the new Stat (set); when it
        fails, the culprit's error and RolledBackError for the others.

        A transaction of one create, or of one set at a given version, is one statement
        that is all the fencing it needs (:meth:`_create_alone`, :meth:`_set_alone`);
        anything else, and any doubt, goes through the steps."""
        if not ops:
            return []
        self._serve_asked()
        for op in ops:
            if op.kind == "delete":
                self._forget(op.path)
        trusted = {_parent(op.path) for op in ops if op.kind == "create"} & self._ensured
        results = self._commit(ops)
        gone = [str(r.args[0]) for r in results if isinstance(r, NoNodeError) and r.args]
        for path in gone:
            self._forget(path)
        if any(path in trusted for path in gone):
            # a parent this process ensured earlier was deleted since: make it again, as
            # the registry's ensure would have done had it not been remembered here
            for path in trusted.intersection(gone):
                self.ensure_path_async(path).get()
            results = self._commit(ops)
        return results

    def _forget(self, path: str) -> None:
        """``path`` and everything under it may no longer exist."""
        under = path.rstrip("/") + "/"
        self._ensured = {p for p in self._ensured if p != path and not p.startswith(under)}

    def _commit(self, ops: Sequence[Op]) -> list[Any]:
        txid = uuid.uuid4().hex
        if all(op.kind == "check" for op in ops):
            # checks alone (a fence): one read decides, as a synced read would (every
            # reader of this server shares its Keeper session); an UPDATE would only
            # rewrite the rows it checks
            keys = [op.path for op in ops]
            refused = self._refusal(ops, self._await_creators(keys, self._read(keys)))
            return [True] * len(ops) if refused is None else _failed(ops, *refused)
        if len(ops) == 1 and ops[0].kind == "create":
            alone = self._create_alone(ops[0], txid)
            if alone is not None:
                return alone
        if len(ops) == 1 and ops[0].kind == "set" and ops[0].version != -1:
            alone = self._set_alone(ops[0], txid)
            if alone is not None:
                return alone
        elif all(op.kind in ("check", "set") and op.version != -1 for op in ops) and not any(
            _read_checked(op) for op in ops
        ):
            blind = self._versioned(ops, txid)
            if blind is not None:
                return blind
        elif self._unread_fits(ops):
            unread = self._unread(ops, txid)
            if unread is not None:
                return unread
        return self._steps(ops, txid)

    @staticmethod
    def _unread_fits(ops: Sequence[Op]) -> bool:
        """Creates (some deleted again) and checks at given versions, nothing else, no
        manifest chunk among them: what :meth:`_unread` does without a first read."""
        transient = _transient(ops)
        return any(op.kind == "create" and op.path not in transient for op in ops) and all(
            (op.kind == "check" and op.version != -1 and not _read_checked(op))
            or op.kind == "create"
            or (op.kind == "delete" and op.path in transient)
            for op in ops
        )

    def _versioned(self, ops: Sequence[Op], txid: str) -> list[Any] | None:
        """Checks and sets, every one at a version the caller read (a commit: the epoch,
        its record, the ledger, the owner node): step 3 and its read-back, no read
        first. Refused (or a reply that may be a retried request's), it is decided by
        the steps, which read."""
        sets = [op for op in ops if op.kind == "set"]
        if not sets:
            return None
        guards = " OR ".join(
            f"(key = {lit(op.path)} AND ver = {int(op.version)} AND pending = '')" for op in ops
        )
        values = ", ".join(f"key = {lit(op.path)}, {blob(op.data)}" for op in sets)
        named = ", ".join(lit(op.path) for op in sets)
        refused = False
        try:
            self._write(
                f"ALTER TABLE {self.table} UPDATE value = if(throwIf(NOT ({guards})) = 0, "
                f"multiIf({values}, value), value), ver = if(key IN ({named}), ver + 1, ver), "
                f"tx = if(key IN ({named}), {lit(txid)}, tx) "
                f"WHERE key IN ({', '.join(lit(op.path) for op in ops)})",
                "transaction on the state store",
            )
        except BadVersionError:
            refused = True  # or the server retried an UPDATE that had landed: read
        # the read-back: an UPDATE skips a missing row silently, every row must be there
        after = self._read(op.path for op in ops)
        before = {op.path: Row(b"", op.version, 0, "") for op in ops}
        landed = self._landed(ops, before, after, txid, set())
        if refused and not landed:
            return None  # nothing written; the steps say why
        if not landed or any(op.path not in after for op in ops):
            self._verify(ops, before, txid)  # raises what went wrong
            raise ConnectionLoss(f"a transaction on {self.where} moved right after it wrote")
        return [
            Stat(after[op.path].ver, after[op.path].czxid) if op.kind == "set" else True
            for op in ops
        ]

    def _create_alone(self, op: Op, txid: str) -> list[Any] | None:
        """A create with nothing to check beside it: one INSERT, confirmed at once.
        Strict mode makes it create-if-absent (a row of any state, a stale pending one
        included, makes it fail), and its SELECT refuses it while the parent is not
        live, as the steps would. Refused, it is decided by the steps (NodeExists, a
        stale pending row to take over, NoNode), unless the row is ours: the server
        retried an INSERT that had landed."""
        parent = _parent(op.path)
        source = (
            ""
            if parent == "/"
            else f" FROM (SELECT count() AS live FROM {self.table} WHERE key = {lit(parent)} "
            "AND pending = '') WHERE throwIf(live = 0) = 0"
        )
        try:
            self._write(
                f"INSERT INTO {self.table} (key, value, ver, czxid, pending, tx) SELECT "
                f"{lit(op.path)}, {blob(op.data)}, 0, {self._clock()}, '', {lit(txid)}{source}",
                f"create of {op.path}",
            )
        except (NodeExistsError, BadVersionError):
            row = self._read([op.path]).get(op.path)
            if row is not None and not row.pending and row.tx == txid:
                return [op.path]
            return None
        return [op.path]

    def _set_alone(self, op: Op, txid: str) -> list[Any] | None:
        """A set at a given version with nothing beside it: one guarded UPDATE (the
        compare-and-set itself) and the read-back every UPDATE needs (it skips a missing
        row silently). No read first: the version to compare is the caller's. A refusal
        is read to tell ours (a retried request that landed), NoNode and BadVersion
        apart; a row rewritten at the same version (another transaction only checked
        it) is decided again by the steps."""
        try:
            self._write(
                f"ALTER TABLE {self.table} UPDATE value = if(throwIf(NOT (ver = "
                f"{int(op.version)} AND pending = '')) = 0, {blob(op.data)}, value), "
                f"ver = ver + 1, tx = {lit(txid)} WHERE key = {lit(op.path)}",
                f"write of {op.path}",
            )
        except BadVersionError:
            row = self._read([op.path]).get(op.path)
            if row is not None and row.tx == txid and row.ver == op.version + 1:
                return [Stat(row.ver, row.czxid)]  # ours: the server retried it
            if row is None or row.pending:
                return [NoNodeError(op.path)]
            if row.ver != op.version:
                return [BadVersionError(op.path)]
            return None
        row = self._read([op.path]).get(op.path)
        if row is None or row.pending:
            return [NoNodeError(op.path)]  # nothing to write: it was gone, as Keeper says
        if row.tx != txid:
            # written again since, or skipped (absent then) and made anew since: with no
            # read first, the two cannot be told apart; the registry's step re-reads
            raise ConnectionLoss(f"{op.path} on {self.where} moved right after a write")
        return [Stat(op.version + 1, row.czxid)]

    def _steps(self, ops: Sequence[Op], txid: str) -> list[Any]:
        """The transaction in the steps of the module docstring."""
        transient = _transient(ops)
        deletes = [op for op in ops if op.kind == "delete"]
        lasting = [op for op in deletes if op.path not in transient]
        if lasting and any(op.kind in ("create", "set") and op.path not in transient for op in ops):
            raise TxSinkError(  # the registry never asks it: deletes run after the writes
                "the KeeperMap state store cannot write and delete nodes in one transaction"
            )
        keys = [op.path for op in ops] + [_parent(op.path) for op in ops]
        before = self._await_creators(keys, self._read(keys))
        refused = self._refusal(ops, before)
        if refused is not None:
            return _failed(ops, *refused)
        parent_like = len(ops) == 1 and lasting and f"/{CHUNKS_DIR}/" not in ops[0].path
        if parent_like and self._has_children(ops[0].path):
            # as ZooKeeper, a lone delete refuses a node with children (a node emptied
            # for reuse; bulk deletes name leaves only: records, chunks)
            return _failed(ops, 0, NotEmptyError(ops[0].path))
        creates = [op for op in ops if op.kind == "create"]
        try:
            self._insert_pending(creates, before, txid)
        except (NodeExistsError, BadVersionError) as exc:  # a racing create got there first
            self._drop_pending(creates, txid)
            return _failed(ops, ops.index(creates[0]), NodeExistsError(str(exc)))
        done = self._apply(ops, before, txid)
        if parent_like and not isinstance(done[0], Exception) and self._has_children(ops[0].path):
            # a child appeared between the scan and the DELETE (KeeperMap rows have no
            # hierarchy): the node is put back and the delete refused, as ZooKeeper would
            row = before.get(ops[0].path)
            with contextlib.suppress(NodeExistsError):
                self.create_async(ops[0].path, row.value if row else b"").get()
            return _failed(ops, 0, NotEmptyError(ops[0].path))
        return done

    def _unread(self, ops: Sequence[Op], txid: str) -> list[Any] | None:
        """Creates, checks at the caller's versions and creates deleted again (a prepare:
        the epoch, the xid node, a proof that a node is absent): step 2 with no read
        first, one INSERT that also requires every parent live, then steps 3 and 4.
        None, with nothing written, where the INSERT is refused: the steps decide."""
        creates = [op for op in ops if op.kind == "create"]
        made = {op.path for op in creates}
        parents = sorted({_parent(op.path) for op in creates} - made - {"/"})
        rows = ", ".join(
            f"({lit(op.path)}, {blob(op.data)}, 0, {self._clock()}, {lit(txid)}, {lit(txid)})"
            for op in creates
        )
        live = (
            f" WHERE throwIf((SELECT count() FROM {self.table} WHERE key IN "
            f"({', '.join(lit(p) for p in parents)}) AND pending = '') != {len(parents)}) = 0"
            if parents
            else ""
        )
        try:
            self._write(
                f"INSERT INTO {self.table} (key, value, ver, czxid, pending, tx) SELECT * FROM "
                f"values('key String, value String, ver UInt32, czxid UInt64, pending String, "
                f"tx String', {rows}){live}",
                "create of nodes",
            )
        except (NodeExistsError, BadVersionError):
            found = self._read(made)
            if not (len(found) == len(made) and all(r.pending == txid for r in found.values())):
                return None  # refused (not a retry of ours that landed): nothing written
        return self._apply(ops, {}, txid)

    def _apply(self, ops: Sequence[Op], before: dict[str, Row], txid: str) -> list[Any]:
        """Steps 3 and 4 of a transaction whose creates are pending under ``txid``;
        ``before``: the rows as step 1 read them (empty: every check is at a version
        the caller gave)."""
        transient = _transient(ops)
        deletes = [op for op in ops if op.kind == "delete"]
        keys = [op.path for op in ops] + [_parent(op.path) for op in ops]
        creates = [op for op in ops if op.kind == "create"]
        guarded = [op for op in ops if op.kind != "delete" and not _read_checked(op)]
        last: Exception | None = None
        for attempt in range(MAX_ROUNDS):
            try:
                if guarded:
                    self._update(guarded, before, txid, transient)
                break
            except BadVersionError as exc:
                after = self._read(keys)
                if self._landed(guarded, before, after, txid, transient):
                    break
                taken = [op for op in creates if op.path in after and after[op.path].pending
                         != txid]  # fmt: skip
                if taken:  # a racing create took our row over: it won, as in Keeper
                    self._drop_pending(creates, txid)
                    return _failed(ops, ops.index(taken[0]), NodeExistsError(taken[0].path))
                refused = self._refusal(ops, after)
                if refused is not None:
                    self._drop_pending(creates, txid)
                    return _failed(ops, *refused)
                # Nothing refuses: another transaction rewrote a row we only check (an
                # UPDATE rewrites every row it names), or an unversioned set's row moved.
                # Keeper would have taken both; decide again on what is there now.
                before = after
                time.sleep(random.uniform(0, min(0.002 * 2**attempt, 0.1)))
                last = exc
        else:
            self._drop_pending(creates, txid)
            raise ConnectionLoss(f"a transaction on {self.where} kept conflicting: {last}")
        self._verify([op for op in ops if op.kind != "delete"], before, txid)
        if deletes:
            try:
                self._delete(deletes, txid, transient)
            except BadVersionError as exc:
                left = self._read(op.path for op in deletes)
                taken = [op for op in deletes if op.path in left and op.path in transient]
                if taken and len(taken) == len([op for op in deletes if op.path in left]):
                    # another creator took a proof row over after step 3 confirmed the
                    # transaction (its guard saw the row still ours): the proof held, the
                    # transaction stands; our own unconfirmed rows go
                    self._drop_pending([op for op in creates if op.path in transient], txid)
                elif left:  # refused: nothing deleted (our own unconfirmed rows go too)
                    self._drop_pending(creates, txid)
                    culprit = next(op for op in deletes if op.path in left)
                    return _failed(ops, ops.index(culprit), exc)
        return [self._result(op, before) for op in ops]

    def _await_creators(self, keys: list[str], rows: dict[str, Row]) -> dict[str, Row]:
        """``rows`` once no node the transaction names is held unconfirmed by a creator
        that may still be at work: its create either lands (our create then hears
        NodeExists, as in Keeper) or is dropped (ours goes ahead). Only a pending row
        older than :data:`PENDING_STALE_S` (by its creator's clock, or watched that long
        here) is taken over: taking over a row in flight aborts its creator, and racing
        creators that take each other's rows over abort each other until retries run out."""
        first_seen: dict[tuple[str, str], float] = {}
        give_up = time.monotonic() + 2 * PENDING_STALE_S  # creators that keep coming
        pause = 0.005
        while time.monotonic() < give_up:
            now = time.monotonic()
            busy = False
            for key in keys:
                row = rows.get(key)
                if row is None or not row.pending:
                    continue
                seen = first_seen.setdefault((key, row.pending), now)
                busy = busy or max((self._clock() - row.czxid) / 1e9, now - seen) < PENDING_STALE_S
            if not busy:
                break
            time.sleep(pause)
            pause = min(pause * 2, 0.2)
            rows = self._read(keys)
        return rows

    @staticmethod
    def _refusal(ops: Sequence[Op], rows: dict[str, Row]) -> tuple[int, Exception] | None:
        """The first op the current rows refuse, as kazoo would refuse it: ops apply in
        order (a create makes a node the next ops see, a delete removes it), and a
        create needs its parent, as in ZooKeeper."""
        made: set[str] = set()
        removed: set[str] = set()

        def live(path: str) -> bool:
            if path in made or path == "/":
                return True
            row = rows.get(path)
            return path not in removed and row is not None and not row.pending

        for i, op in enumerate(ops):
            if op.kind == "create":
                if live(op.path):
                    return i, NodeExistsError(op.path)
                if not live(_parent(op.path)):
                    return i, NoNodeError(_parent(op.path))
                made.add(op.path)
                removed.discard(op.path)
                continue
            if not live(op.path):
                return i, NoNodeError(op.path)
            row = rows.get(op.path)
            stale = row is not None and op.version not in (-1, row.ver)
            if op.path not in made and stale:
                return i, BadVersionError(op.path)
            if op.kind == "delete":
                made.discard(op.path)
                removed.add(op.path)
        return None

    def _insert_pending(self, creates: Sequence[Op], before: dict[str, Row], txid: str) -> None:
        """Step 2: the new rows, pending under ``txid`` (a stale pending row of another
        transaction is taken over with a compare-and-set on its pending id)."""
        fresh = [op for op in creates if op.path not in before]
        for op in creates:
            if op.path in before:  # pending (live rows were refused): take it over
                self._write(
                    f"ALTER TABLE {self.table} UPDATE value = if(throwIf(pending != "
                    f"{lit(before[op.path].pending)}) = 0, {blob(op.data)}, value), "
                    f"pending = {lit(txid)}, tx = {lit(txid)}, ver = 0, czxid = {self._clock()} "
                    f"WHERE key = {lit(op.path)}",
                    f"create of {op.path} (over an unconfirmed row)",
                )
        if not fresh:
            return
        values = ", ".join(
            f"({lit(op.path)}, {blob(op.data)}, 0, {self._clock()}, {lit(txid)}, {lit(txid)})"
            for op in fresh
        )
        try:
            self._write(
                f"INSERT INTO {self.table} (key, value, ver, czxid, pending, tx) VALUES {values}",
                "create of nodes",
            )
        except NodeExistsError:
            rows = self._read(op.path for op in fresh)
            if all(rows.get(op.path, Row(b"", 0, 0, "")).pending == txid for op in fresh):
                return  # ours: the server retried an insert that had landed
            raise

    def _update(
        self, ops: Sequence[Op], before: dict[str, Row], txid: str, transient: set[str]
    ) -> None:
        """Step 3: one guarded UPDATE over every checked, set and created row (a created
        row the transaction deletes again stays unconfirmed: it only proves absence)."""
        guards: list[str] = []
        values: list[str] = []
        sets: list[str] = []
        creates: list[str] = []
        for op in ops:
            key = lit(op.path)
            if op.kind == "create":
                guards.append(f"(key = {key} AND pending = {lit(txid)})")
                if op.path not in transient:
                    creates.append(key)
                continue
            expected = before[op.path].ver if op.version == -1 else op.version
            guards.append(f"(key = {key} AND ver = {int(expected)} AND pending = '')")
            if op.kind == "set":
                values.append(f"key = {key}, {blob(op.data)}")
                sets.append(key)
        new_value = f"multiIf({', '.join(values)}, value)" if values else "value"
        keys = ", ".join(lit(op.path) for op in ops)
        # every column assignment costs the server an analysis (~1-2 ms each): only the
        # ones that change something are sent (the guard always is)
        assignments = [f"value = if(throwIf(NOT ({' OR '.join(guards)})) = 0, {new_value}, value)"]
        if sets:
            assignments.append(f"ver = if(key IN ({', '.join(sets)}), ver + 1, ver)")
        if creates:
            assignments.append(f"pending = if(key IN ({', '.join(creates)}), '', pending)")
        if sets or creates:
            assignments.append(f"tx = if(key IN ({', '.join(sets + creates)}), {lit(txid)}, tx)")
        self._write(
            f"ALTER TABLE {self.table} UPDATE {', '.join(assignments)} WHERE key IN ({keys})",
            "transaction on the state store",
        )

    @staticmethod
    def _landed(
        ops: Sequence[Op],
        before: dict[str, Row],
        after: dict[str, Row],
        txid: str,
        transient: set[str],
    ) -> bool:
        """Whether step 3 was applied although it was reported failed (a retried request):
        every row it writes carries its transaction id (``tx``), so our write is told
        from another writer's, even one of identical bytes."""
        if not any(op.kind != "check" for op in ops):
            return False  # nothing it wrote can show it: decide again
        for op in ops:
            row = after.get(op.path)
            if op.kind == "check":
                continue
            if row is None or row.tx != txid:
                return False
            if op.kind == "create" and row.pending != ("" if op.path not in transient else txid):
                return False
            if op.kind == "set" and row.ver != before[op.path].ver + 1:
                return False
        return True

    def _verify(self, ops: Sequence[Op], before: dict[str, Row], txid: str) -> None:
        """Read back: an UPDATE skips missing rows silently, so a row deleted between
        steps 1 and 3 would otherwise pass for written; and rows checked by reading only
        (manifest chunks) must still be there, at the version read."""
        after = self._read(op.path for op in ops)
        missing = [op.path for op in ops if op.path not in after]
        moved = [
            op.path
            for op in ops
            if _read_checked(op) and op.path in after and op.version not in (-1, after[op.path].ver)
        ]
        if not (missing or moved):
            return
        written = [op.path for op in ops if op.kind != "check"]
        if written == missing and len(written) == 1 and not moved:
            raise NoNodeError(written[0])  # the one node it wrote is gone: Keeper's answer
        raise TxSinkError(
            f"state store {self.where}: {', '.join(missing + moved)} vanished or changed "
            "while a transaction wrote or relied on it, so the transaction applied partly; "
            "something outside txsink changed state: stop the job and run `txsink verify`"
        )

    def _delete(self, ops: Sequence[Op], txid: str, transient: set[str]) -> None:
        guards = [
            f"(key = {lit(op.path)} AND pending = {lit(txid)})"
            if op.path in transient
            else f"key = {lit(op.path)}"
            if op.version == -1
            else f"(key = {lit(op.path)} AND ver = {int(op.version)} AND pending = '')"
            for op in ops
        ]
        self._write(
            f"DELETE FROM {self.table} WHERE key IN ({', '.join(lit(op.path) for op in ops)}) "
            f"AND throwIf(NOT ({' OR '.join(guards)})) = 0",
            "delete of nodes",
        )

    def _drop_pending(self, creates: Sequence[Op], txid: str) -> None:
        if not creates:
            return
        keys = ", ".join(lit(op.path) for op in creates)
        # left pending if this fails: hidden from readers, taken over by the next create
        with contextlib.suppress(BadVersionError, ConnectionLoss):
            self._write(
                f"DELETE FROM {self.table} WHERE key IN ({keys}) AND pending = {lit(txid)}",
                "clean-up of unconfirmed nodes",
            )

    @staticmethod
    def _result(op: Op, before: dict[str, Row]) -> Any:
        if op.kind == "create":
            return op.path
        if op.kind == "set":
            return Stat(before[op.path].ver + 1, before[op.path].czxid)
        return True


def keepermap_registry(
    client: Any,
    database: str,
    root: str,
    *,
    timeout: float = 15.0,
    retry_s: float = 30.0,
) -> Any:
    """The Keeper registry with its nodes in ``database``'s KeeperMap table on
    ``client``'s server (closing it closes ``client``)."""
    from txsink.keeper.kazoo_registry import KazooRegistry

    class KeeperMapRegistry(KazooRegistry):
        """:class:`KazooRegistry` over :class:`KeeperMapNodes` (``state=clickhouse``)."""

        def close(self) -> None:
            super().close()
            nodes.close()

    nodes = KeeperMapNodes(client, database)
    try:
        return KeeperMapRegistry(nodes.where, root, timeout=timeout, client=nodes, retry_s=retry_s)
    except BaseException:
        nodes.close()
        raise
