"""The chdb engine of the endpoint: connection pool, sessions, settings tracking.

Owns the process's one chdb database (``DIR/chdb``): sessionless requests borrow an idle
connection from a pool, ``session_id`` gives a client its own connection so ``SET``/``USE``
persist (expiring after ``session_timeout`` seconds idle), and every statement runs here.

Invariants: every chdb connection is used by one request at a time (sessionless requests
borrow an idle connection from a pool, sessions own theirs); a connection's settings are
tracked so each request runs with exactly the settings it asked for; chdb failures come
out as :class:`HttpError` with the ClickHouse code. Set ``TXSINK_EMBEDDED_SERIALIZE=1`` to
run all engine calls under one process-wide lock.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import chdb

from txsink.embedded.http_errors import (
    SESSION_IS_LOCKED,
    SESSION_NOT_FOUND,
    TABLE_IS_READ_ONLY,
    TOO_MANY_PARTS,
    TOO_MANY_SESSIONS,
    ClientGone,
    HttpError,
    engine_error,
)
from txsink.embedded.transfer import Body
from txsink.names import quote_ident
from txsink.names import quote_literal as sql_string

log = logging.getLogger("txsink.embedded.server")  # one logger for the endpoint process

MAX_SESSIONS = 1024
_INSERT_TABLE_RE = re.compile(
    r"\s*INSERT\s+INTO\s+(?:TABLE\s+)?((?:`[^`]+`|\"[^\"]+\"|[\w]+)"
    r"(?:\.(?:`[^`]+`|\"[^\"]+\"|[\w]+))?)",
    re.IGNORECASE,
)
IDLE_POOL = 8
# Errors a table raises for an insert's rows that chdb's streaming insert reports as a
# success: TOO_MANY_PARTS (also "too many partitions for single INSERT block"),
# VIOLATED_CONSTRAINT, SIZES_OF_ARRAYS_DONT_MATCH (unequal Nested lengths).
INSERT_REFUSALS = (252, 469, 190)
TRACK_IGNORED = frozenset({"database"})  # chdb reports it as a changed setting; USE owns it


# system.query_log, as every ClickHouse server has it by default: the evidence that an
# ATTACH of visibility=batch landed (docs/modes.md#visibility); flushed each second.


@dataclass
class EngineConn:
    """One chdb connection and what the endpoint knows about its state."""

    conn: Any
    pristine: dict[str, str]  # settings chdb itself (or the profile) changed at creation
    current: dict[str, str]  # changed settings right now
    base: dict[str, str]  # settings a request starts from (session SETs live here)
    current_db: str = "default"
    base_db: str = "default"

    def close(self) -> None:
        with contextlib.suppress(Exception):  # closing a broken connection may fail again
            self.conn.close()


@dataclass
class Session:
    id: str
    conn: EngineConn
    timeout: float
    lock: threading.Lock = field(default_factory=threading.Lock)
    last_used: float = field(default_factory=time.monotonic)


class Engine:
    """Owns the chdb engine: connection pool, sessions, and running statements."""

    def __init__(
        self, path: str, profile: dict[str, str] | None = None, *, replicated: bool | None = None
    ) -> None:
        self.path = path
        # the settings profile of the endpoint's one user: defaults every connection
        # starts from (a server's users.xml profile; chdb itself has no users)
        self.profile = dict(profile or {})
        # given a Keeper (in its config file), replicated tables exist and are read-only
        self.replicated = "config-file=" in path if replicated is None else replicated
        self._pool: list[EngineConn] = []
        self._pool_lock = threading.Lock()
        self._sessions: dict[str, Session] = {}
        self._sessions_lock = threading.Lock()
        serialize = os.environ.get("TXSINK_EMBEDDED_SERIALIZE", "") not in ("", "0")
        # re-entrant: an insert holds it while it probes system.processes
        self._global = threading.RLock() if serialize else contextlib.nullcontext()
        first = self._new_conn()
        version, tz = self._query_text(first, "SELECT version(), timezone()").split("\t")
        self.version = version.strip()
        self.timezone = tz.strip()
        self._release(first)

    # connections -------------------------------------------------------------
    def text(self, ec: EngineConn, sql: str) -> str:
        """The result of ``sql`` as TabSeparated text (for the endpoint's own statements)."""
        return self._query_text(ec, sql)

    def _query_text(self, ec: EngineConn, sql: str) -> str:
        with self._global:
            return bytes(ec.conn.query(sql, "TabSeparated").bytes()).decode()

    def _changed_settings(self, ec: EngineConn) -> dict[str, str]:
        text = self._query_text(
            ec, "SELECT name, value FROM system.settings WHERE changed FORMAT TabSeparatedRaw"
        )
        pairs = (line.split("\t", 1) for line in text.splitlines() if line)
        return {k: v for k, v in pairs if k not in TRACK_IGNORED}

    def _new_conn(self) -> EngineConn:
        conn = chdb.connect(self.path)
        if self.profile:
            assignments = ", ".join(f"{k} = {sql_string(v)}" for k, v in self.profile.items())
            with self._global:
                conn.query(f"SET {assignments}", "TabSeparated")
        ec = EngineConn(conn, {}, {}, {})
        ec.pristine = self._changed_settings(ec)
        ec.current = dict(ec.pristine)
        ec.base = dict(ec.pristine)
        return ec

    def _acquire(self) -> EngineConn:
        with self._pool_lock:
            if self._pool:
                return self._pool.pop()
        return self._new_conn()

    def _release(self, ec: EngineConn) -> None:
        with self._pool_lock:
            if len(self._pool) < IDLE_POOL:
                self._pool.append(ec)
                return
        ec.close()

    @contextlib.contextmanager
    def connection(
        self, session_id: str | None, timeout: float, check: bool, fresh: bool
    ) -> Iterator[tuple[EngineConn, Session | None]]:
        """The connection a request runs on: the session's own, or one from the pool."""
        if not session_id:
            ec = self._new_conn() if fresh else self._acquire()
            ok = False
            try:
                yield ec, None
                ok = True
            finally:
                if ok and not fresh:
                    self._release(ec)
                else:
                    ec.close()
            return
        with self._sessions_lock:
            session = self._sessions.get(session_id)
            if session is None:
                if check:
                    raise HttpError(SESSION_NOT_FOUND, f"Session {session_id} not found")
                if len(self._sessions) >= MAX_SESSIONS:
                    raise HttpError(TOO_MANY_SESSIONS, "Too many sessions")
                session = Session(session_id, self._new_conn(), timeout)
                self._sessions[session_id] = session
            if not session.lock.acquire(blocking=False):
                raise HttpError(
                    SESSION_IS_LOCKED,
                    f"Session {session_id} is locked by a concurrent client",
                )
        try:
            session.timeout = timeout
            if fresh:  # readonly requests run on a throwaway copy of the session state
                ec = self._new_conn()
                ec.base, ec.base_db = dict(session.conn.base), session.conn.base_db
                try:
                    yield ec, None
                finally:
                    ec.close()
            else:
                yield session.conn, session
        finally:
            session.last_used = time.monotonic()
            session.lock.release()

    def expire_sessions(self) -> None:
        now = time.monotonic()
        with self._sessions_lock:
            for sid, session in list(self._sessions.items()):
                if now - session.last_used > session.timeout and session.lock.acquire(False):
                    del self._sessions[sid]
                    session.conn.close()
                    log.info("session %s expired", sid)

    def close_all(self) -> None:
        """Close every connection (at shutdown, so chdb flushes and detaches cleanly)."""
        with self._sessions_lock:
            sessions, self._sessions = list(self._sessions.values()), {}
        with self._pool_lock:
            pool, self._pool = self._pool, []
        for ec in [s.conn for s in sessions] + pool:
            ec.close()

    def close_session(self, session_id: str) -> None:
        with self._sessions_lock:
            session = self._sessions.pop(session_id, None)
        if session is not None:
            session.conn.close()

    # state --------------------------------------------------------------------
    def prepare(self, ec: EngineConn, settings: dict[str, str], database: str | None) -> None:
        """Make the connection's settings and database exactly what this request wants."""
        desired = dict(ec.base)
        desired.update(settings)
        assignments = [
            f"{k} = {sql_string(v)}" for k, v in desired.items() if ec.current.get(k) != v
        ]
        for k in ec.current:
            if k not in desired:
                value = ec.pristine.get(k)
                assignments.append(f"{k} = {sql_string(value) if value is not None else 'DEFAULT'}")
        if assignments:
            try:
                with self._global:
                    ec.conn.query("SET " + ", ".join(assignments), "TabSeparated")
            except Exception as exc:  # chdb raises ChdbError/RuntimeError: resync, then report
                ec.current = self._changed_settings(ec)
                raise engine_error(exc) from exc
            ec.current = desired
        db = database or ec.base_db
        if db != ec.current_db:
            try:
                with self._global:
                    ec.conn.query(f"USE {quote_ident(db)}", "TabSeparated")
            except Exception as exc:  # unknown database and the like
                raise engine_error(exc) from exc
            ec.current_db = db

    def after_state_change(self, ec: EngineConn, session: Session | None) -> None:
        """A SET or USE ran: learn the new state; it persists only for a session."""
        ec.current = self._changed_settings(ec)
        db = self._query_text(ec, "SELECT currentDatabase()").strip()
        ec.current_db = db
        if session is not None:
            ec.base = dict(ec.current)
            ec.base_db = db

    # statements -----------------------------------------------------------------
    def query(self, ec: EngineConn, sql: str, fmt: str, params: dict[str, str]) -> Any:
        try:
            with self._global:
                return ec.conn.query(sql, fmt, params=params or None)
        except Exception as exc:  # ChdbError / RuntimeError carry the ClickHouse code
            raise engine_error(exc) from exc

    def stream(self, ec: EngineConn, sql: str, fmt: str, params: dict[str, str]) -> Any:
        try:
            with self._global:
                return ec.conn.send_query(sql, fmt, params=params or None)
        except Exception as exc:  # see query()
            raise engine_error(exc) from exc

    def insert(self, ec: EngineConn, sql: str, fmt: str, first: bytes, body: Body) -> Any:
        """Stream an INSERT's data: ``first`` then the rest of ``body``, into chdb.

        chdb's streaming insert reports a refusal of the table's sink as a success
        (seen with TOO_MANY_PARTS, which ClickHouse raises when the sink starts: the
        rows written it reports are 0, or not 0 when the table feeds a view), so a
        client would believe its rows landed. The statement therefore carries a
        marker, and before it is finished its own ProfileEvents in system.processes
        are asked whether the insert was rejected; if so it is cancelled and answered
        with ClickHouse's error (one small query per insert; inserts are whole blocks).
        Refusals raised only when the data is written (too many partitions for one
        block, CHECK constraints) are looked up after it finished (:meth:`_refusal`).
        """
        if self.replicated:
            self._refuse_read_only(sql)
        marker = f"txsink-insert-{uuid.uuid4().hex}"
        with self._global:
            try:
                inserter = ec.conn.send_insert(f"{sql} /* {marker} */", fmt)
            except Exception as exc:  # bad table, bad format, ...
                raise engine_error(exc) from exc
            try:
                if first:
                    ec.conn._conn.insert_append(inserter._c_inserter, first)
                for chunk in body.chunks():
                    ec.conn._conn.insert_append(inserter._c_inserter, chunk)
                rejected, query_id = self._rejected(marker)
                if rejected:
                    raise HttpError(
                        TOO_MANY_PARTS,
                        "Code: 252. DB::Exception: Too many parts: the table refused the "
                        "insert (parts_to_throw_insert / max_parts_in_total); nothing was "
                        "written. Merges are processing significantly slower than inserts. "
                        "(TOO_MANY_PARTS)",
                    )
                result = inserter.finish()
            except BaseException as exc:
                inserter._finished = False
                with contextlib.suppress(Exception):  # cancelling a failed insert may fail too
                    inserter.cancel()
                if isinstance(exc, HttpError | ClientGone):
                    raise
                if isinstance(exc, Exception):
                    raise engine_error(exc) from exc
                raise
            refusal = self._refusal(query_id)
            if refusal is not None:
                raise refusal
            return result

    def _refuse_read_only(self, sql: str) -> None:
        """Answer TABLE_IS_READ_ONLY for an insert into a read-only replica at once.

        chdb 26.9's streaming insert into one waits about 140 s for Keeper retries, then
        reports success with nothing written: a silent loss."""
        m = _INSERT_TABLE_RE.match(sql)
        if m is None:
            return
        db, _, table = (part.strip('`"') for part in m.group(1).rpartition("."))
        ec = self._acquire()
        try:
            with self._global:
                found = ec.conn.query(
                    "SELECT replica_path FROM system.replicas WHERE is_readonly AND "
                    "database = if({d:String} = '', currentDatabase(), {d:String}) "
                    "AND table = {t:String}",
                    "TabSeparatedRaw",
                    params={"d": db, "t": table},
                )
            path = bytes(found.bytes()).decode().strip()
        finally:
            self._release(ec)
        if path:
            raise HttpError(
                TABLE_IS_READ_ONLY,
                f"Code: 242. DB::Exception: Table is in readonly mode: replica_path={path}. "
                "(TABLE_IS_READ_ONLY)",
            )

    def _rejected(self, marker: str) -> tuple[bool, str]:
        """Whether the running insert whose text contains ``marker`` was rejected so far,
        and its query id."""
        ec = self._acquire()
        try:
            with self._global:
                found = ec.conn.query(
                    "SELECT max(ProfileEvents['RejectedInserts']), any(query_id) "
                    "FROM system.processes "
                    "WHERE position(query, {m:String}) > 0 AND query_id != queryID()",
                    "TabSeparatedRaw",
                    params={"m": marker},
                )
            count, _, query_id = bytes(found.bytes()).decode().strip().partition("\t")
            return (count or "0") not in ("0", "\\N"), query_id
        finally:
            self._release(ec)

    def _refusal(self, query_id: str) -> HttpError | None:
        """The error the table raised for the finished insert ``query_id`` although chdb
        reported success (chdb 26.9 does so for "Too many partitions for single INSERT
        block" and CHECK constraints: the rows written it reports are the rows sent, the
        table has none of them). ``system.errors`` keeps the last error of each code with its
        query id; another query failing with the same code in the few milliseconds before
        this read would hide the refusal (a test-stack limit, not a real server's)."""
        if not query_id:
            return None
        ec = self._acquire()
        try:
            with self._global:
                found = ec.conn.query(
                    "SELECT code, name, last_error_message FROM system.errors "
                    "WHERE query_id = {q:String} AND code IN {codes:Array(Int32)} LIMIT 1",
                    "TabSeparatedRaw",
                    params={"q": query_id, "codes": list(INSERT_REFUSALS)},
                )
            line = bytes(found.bytes()).decode().strip()
        finally:
            self._release(ec)
        if not line:
            return None
        code, name, message = line.split("\t", 2)
        text = message.strip().rstrip(".")
        return HttpError(int(code), f"Code: {code}. DB::Exception: {text}. ({name})")
