"""The embedded ClickHouse HTTP endpoint: one chdb engine per process, served over HTTP.

Run as ``python -m txsink.embedded.server --data DIR --port N``. The process owns one
chdb engine whose data lives in ``DIR/chdb`` and speaks enough of the ClickHouse HTTP
interface for stock ``clickhouse_connect.get_client(host, port)`` in other processes:

- ``GET /ping`` answers ``Ok.``; every other path is a query endpoint (``/`` as usual).
- The query text is the ``query`` URL parameter followed by the request body (ClickHouse's
  own rule). ``INSERT ... FORMAT X`` streams the rest of the body into
  ``Connection.send_insert`` chunk by chunk, so large inserts are never held in memory.
- Request bodies may be chunked and compressed (``Content-Encoding`` lz4 frame, zstd,
  gzip, deflate, br); responses are compressed when ``enable_http_compression=1`` and the
  client sent ``Accept-Encoding``.
- URL parameters that are not HTTP-interface parameters are ClickHouse settings and apply
  to that request; ``param_<name>`` binds ``{name:Type}`` placeholders.
- ``session_id`` gives the client its own chdb connection, so ``SET``/``USE`` persist for
  the session (expiring after ``session_timeout`` seconds idle, default 60).
- Errors come back as ClickHouse does it: HTTP 4xx/5xx, ``X-ClickHouse-Exception-Code``
  and a ``Code: N. DB::Exception: ... (NAME) (version V)`` body.

Invariants: every chdb connection is used by one request at a time (sessionless requests
borrow an idle connection from a pool, sessions own theirs); a connection's settings are
tracked so each request runs with exactly the settings it asked for; any failure while
handling a request becomes an HTTP error and never takes the process down.
Set ``TXSINK_EMBEDDED_SERIALIZE=1`` to run all engine calls under one process-wide lock.
"""

from __future__ import annotations

import argparse
import contextlib
import email.parser
import email.policy
import json
import logging
import os
import re
import signal
import socket
import threading
import time
import uuid
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import chdb

try:  # optional codecs: clickhouse-connect only offers what it can decode itself
    import lz4.frame as lz4_frame
except ImportError:  # pragma: no cover - lz4 is a declared dependency
    lz4_frame = None
try:
    from backports import zstd  # type: ignore[import-not-found,unused-ignore]
except ImportError:  # pragma: no cover - Python 3.14+ ships compression.zstd
    try:
        from compression import zstd  # type: ignore[import-not-found,no-redef,unused-ignore]
    except ImportError:
        zstd = None  # type: ignore[assignment,unused-ignore]
try:
    import brotli  # type: ignore[import-not-found,unused-ignore]
except ImportError:
    brotli = None

log = logging.getLogger("txsink.embedded.server")

READ_CHUNK = 1 << 20  # body bytes per read and per chdb append
MAX_QUERY_BYTES = 256 << 20  # a non-INSERT query (or INSERT without FORMAT) is buffered
MAX_HEADER_SCAN = 1 << 20  # the INSERT ... FORMAT X header must fit in this prefix
MAX_DRAIN_BYTES = 1 << 30  # body left unread after an error is drained up to this much
MAX_SESSIONS = 1024
IDLE_POOL = 8
KEEP_ALIVE_SECONDS = 120

# ClickHouse error codes used by the endpoint itself.
UNKNOWN_FORMAT = 73
CANNOT_PARSE_INPUT = 27
NOT_IMPLEMENTED = 48
UNKNOWN_EXCEPTION = 1002
SESSION_NOT_FOUND = 372
SESSION_IS_LOCKED = 373
TOO_MANY_SESSIONS = 202
QUERY_TOO_LARGE = 369
SYNTAX_ERROR = 62
CANNOT_DECOMPRESS = 271
NETWORK_ERROR = 210
HTTP_LENGTH_REQUIRED = 381
UNSUPPORTED_METHOD = 1
ERROR_NAMES = {
    UNKNOWN_FORMAT: "UNKNOWN_FORMAT",
    CANNOT_PARSE_INPUT: "CANNOT_PARSE_INPUT_ASSERTION_FAILED",
    NOT_IMPLEMENTED: "NOT_IMPLEMENTED",
    UNKNOWN_EXCEPTION: "UNKNOWN_EXCEPTION",
    SESSION_NOT_FOUND: "SESSION_NOT_FOUND",
    SESSION_IS_LOCKED: "SESSION_IS_LOCKED",
    TOO_MANY_SESSIONS: "TOO_MANY_SIMULTANEOUS_QUERIES",
    QUERY_TOO_LARGE: "QUERY_IS_TOO_LARGE",
    SYNTAX_ERROR: "SYNTAX_ERROR",
    CANNOT_DECOMPRESS: "CANNOT_DECOMPRESS",
    NETWORK_ERROR: "NETWORK_ERROR",
    HTTP_LENGTH_REQUIRED: "HTTP_LENGTH_REQUIRED",
    UNSUPPORTED_METHOD: "UNSUPPORTED_METHOD",
}
# HTTP status per ClickHouse code, as the real server maps them (everything else is 500).
HTTP_STATUS_BY_CODE = {
    SYNTAX_ERROR: 400,
    115: 400,  # UNKNOWN_SETTING
    UNKNOWN_FORMAT: 400,
    QUERY_TOO_LARGE: 400,
    HTTP_LENGTH_REQUIRED: 411,
    60: 404,  # UNKNOWN_TABLE
    81: 404,  # UNKNOWN_DATABASE
    SESSION_NOT_FOUND: 404,
    SESSION_IS_LOCKED: 423,
}

# URL parameters that belong to the HTTP interface, never passed to the engine as settings.
HTTP_ONLY_PARAMS = frozenset(
    {
        "query",
        "database",
        "default_format",
        "user",
        "password",
        "quota_key",
        "role",
        "query_id",
        "session_id",
        "session_timeout",
        "session_check",
        "close_session",
        "compress",
        "decompress",
        "buffer_size",
        "wait_end_of_query",
        "client_protocol_version",
        "stacktrace",
        "http_response_headers",
    }
)
# Real settings that only steer the HTTP layer: handled here, not applied to the engine.
HTTP_SETTINGS = frozenset(
    {
        "enable_http_compression",
        "send_progress_in_http_headers",
        "http_headers_progress_interval_ms",
        "cancel_http_readonly_queries_on_client_close",
        "http_zlib_compression_level",
        "http_native_compression_disable_checksumming_on_decompress",
        "http_wait_end_of_query",
        "add_http_cors_header",
    }
)
# Output formats whose chunks may simply be concatenated (no header or footer per chunk).
STREAMABLE_FORMATS = frozenset(
    name.lower()
    for name in (
        "Native",
        "RowBinary",
        "TabSeparated",
        "TSV",
        "TabSeparatedRaw",
        "TSVRaw",
        "CSV",
        "JSONEachRow",
        "JSONCompactEachRow",
        "JSONStringsEachRow",
        "Values",
    )
)
EMPTY_SUMMARY = {
    k: "0"
    for k in (
        "read_rows",
        "read_bytes",
        "written_rows",
        "written_bytes",
        "total_rows_to_read",
        "result_rows",
        "result_bytes",
        "elapsed_ns",
    )
}
TRACK_IGNORED = frozenset({"database"})  # chdb reports it as a changed setting; USE owns it


class HttpError(Exception):
    """A failure to turn into a ClickHouse-style HTTP error response."""

    def __init__(self, code: int, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.status = status or HTTP_STATUS_BY_CODE.get(code, 500)


class ClientGone(Exception):
    """The client closed the connection; nothing can be answered."""


def engine_error(exc: BaseException) -> HttpError:
    """Map a chdb exception (its text carries ``Code: N. DB::Exception: ...``) to HttpError."""
    text = str(exc)
    match = re.search(r"Code: (\d+)\. ", text)
    if match is None:
        return HttpError(UNKNOWN_EXCEPTION, f"DB::Exception: {text} (UNKNOWN_EXCEPTION)")
    return HttpError(int(match.group(1)), text[match.start() :].strip())


def sql_string(value: str) -> str:
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def quote_ident(name: str) -> str:
    return "`" + name.replace("\\", "\\\\").replace("`", "\\`") + "`"


# --------------------------------------------------------------------------- SQL scanning

_WS = b" \t\r\n\f"
_WORD = re.compile(rb"[A-Za-z_][A-Za-z0-9_]*")
_FORMAT_AT_END = re.compile(r"\bFORMAT\s+([A-Za-z_][A-Za-z0-9_]*)\s*;?\s*$", re.IGNORECASE)
_FIRST_WORD = re.compile(r"^\s*(?:(?:--[^\n]*\n|/\*.*?\*/)\s*)*([A-Za-z_]+)", re.DOTALL)


@dataclass(frozen=True)
class InsertHeader:
    sql: str  # the statement without its FORMAT clause
    fmt: str
    data_offset: int  # where the data starts in the scanned bytes


def _skip_quoted(buf: bytes, pos: int) -> int:
    quote = buf[pos]
    pos += 1
    while pos < len(buf):
        c = buf[pos]
        if c == 0x5C:  # backslash escape
            pos += 2
            continue
        if c == quote:
            if pos + 1 < len(buf) and buf[pos + 1] == quote:  # doubled quote
                pos += 2
                continue
            return pos + 1
        pos += 1
    return -1


def scan_insert(buf: bytes) -> InsertHeader | bool | None:
    """Find ``INSERT ... FORMAT name`` at the start of ``buf``.

    Returns the header, ``None`` when the statement is not an INSERT with a FORMAT clause
    (run it as a plain query), or ``False`` when ``buf`` ends before that is decided.
    """
    pos, n = 0, len(buf)
    first = True
    while pos < n:
        c = buf[pos]
        if c in _WS:
            pos += 1
        elif buf.startswith(b"--", pos) or c == 0x23:
            end = buf.find(b"\n", pos)
            if end < 0:
                return False
            pos = end + 1
        elif buf.startswith(b"/*", pos):
            end = buf.find(b"*/", pos + 2)
            if end < 0:
                return False
            pos = end + 2
        elif c in (0x27, 0x22, 0x60):
            pos = _skip_quoted(buf, pos)
            if pos < 0:
                return False
        else:
            m = _WORD.match(buf, pos)
            if m is None:
                pos += 1
                continue
            word = m.group().upper()
            if first:
                if word != b"INSERT":
                    return None
                first = False
            elif word in (b"VALUES", b"SELECT", b"WITH"):
                return None
            elif word == b"FORMAT":
                fpos = m.end()
                while fpos < n and buf[fpos] in _WS:
                    fpos += 1
                fm = _WORD.match(buf, fpos)
                if fm is None or fm.end() == n:
                    return False if fpos >= n or fm is not None else None
                data = fm.end()
                while data < n and buf[data] in b" \t":
                    data += 1
                if buf.startswith(b"\r\n", data):
                    data += 2
                elif data < n and buf[data] == 0x0A:
                    data += 1
                try:
                    sql = buf[: m.start()].decode()
                except UnicodeDecodeError:
                    return None
                return InsertHeader(sql, fm.group().decode(), data)
            pos = m.end()
    return False


def statement_kind(sql: str) -> str:
    m = _FIRST_WORD.match(sql)
    return m.group(1).upper() if m else ""


# --------------------------------------------------------------------------- body streams


def _decompressor(encoding: str) -> Callable[[bytes], bytes] | None:
    enc = encoding.strip().lower()
    if enc in ("", "identity"):
        return None
    if enc == "lz4" and lz4_frame is not None:
        return lz4_frame.LZ4FrameDecompressor().decompress  # type: ignore[no-any-return]
    if enc == "zstd" and zstd is not None:
        return zstd.ZstdDecompressor().decompress
    if enc in ("gzip", "x-gzip"):
        return zlib.decompressobj(wbits=31).decompress
    if enc == "deflate":
        return zlib.decompressobj().decompress
    if enc == "br" and brotli is not None:
        return brotli.Decompressor().process  # type: ignore[no-any-return]
    raise HttpError(UNKNOWN_FORMAT, f"Unknown Content-Encoding: {encoding}")


class Compressor:
    """Incremental response compression for one negotiated encoding."""

    def __init__(self, encoding: str) -> None:
        self.encoding = encoding
        self._obj: Any
        if encoding == "lz4":
            self._obj = lz4_frame.LZ4FrameCompressor()
            self._head = self._obj.begin()
        elif encoding == "zstd":
            self._obj = zstd.ZstdCompressor()
            self._head = b""
        elif encoding == "gzip":
            self._obj = zlib.compressobj(3, wbits=31)
            self._head = b""
        elif encoding == "deflate":
            self._obj = zlib.compressobj(3)
            self._head = b""
        else:  # br
            self._obj = brotli.Compressor(quality=3)
            self._head = b""

    def compress(self, data: bytes | memoryview) -> bytes:
        if self.encoding == "br":
            out = self._head + self._obj.process(bytes(data))
        else:
            out = self._head + self._obj.compress(data)
        self._head = b""
        return out  # type: ignore[no-any-return]

    def flush(self) -> bytes:
        if self.encoding == "br":
            return self._head + self._obj.finish()  # type: ignore[no-any-return]
        return self._head + self._obj.flush()  # type: ignore[no-any-return]


def negotiate_encoding(accept: str) -> str | None:
    supported = {"gzip", "deflate"}
    if lz4_frame is not None:
        supported.add("lz4")
    if zstd is not None:
        supported.add("zstd")
    if brotli is not None:
        supported.add("br")
    for item in accept.split(","):
        name = item.split(";")[0].strip().lower()
        if name in supported:
            return name
    return None


class Body:
    """The request body as a stream of decompressed chunks, with a pushed-back prefix."""

    def __init__(self, rfile: Any, length: int | None, chunked: bool, encoding: str) -> None:
        self._rfile = rfile
        self._left = length or 0
        self._chunked = chunked
        self._chunk_left = 0
        self._eof = not chunked and not length
        self._decompress = _decompressor(encoding)
        self.raw_read = 0

    @property
    def fully_read(self) -> bool:
        return self._eof

    def _read_raw(self) -> bytes:
        if self._eof:
            return b""
        if not self._chunked:
            data = self._rfile.read(min(self._left, READ_CHUNK))
            if not data:
                raise ClientGone("client closed the connection in the middle of the body")
            self._left -= len(data)
            if self._left <= 0:
                self._eof = True
            self.raw_read += len(data)
            return data  # type: ignore[no-any-return]
        if self._chunk_left == 0:
            line = self._rfile.readline(1024)
            if not line:
                raise ClientGone("client closed the connection in the middle of the body")
            try:
                size = int(line.split(b";")[0].strip(), 16)
            except ValueError:
                raise HttpError(CANNOT_PARSE_INPUT, "Malformed chunked encoding") from None
            if size == 0:
                while True:  # trailers end with an empty line
                    trailer = self._rfile.readline(1024)
                    if trailer in (b"\r\n", b"\n", b""):
                        break
                self._eof = True
                return b""
            self._chunk_left = size
        data = self._rfile.read(min(self._chunk_left, READ_CHUNK))
        if not data:
            raise ClientGone("client closed the connection in the middle of the body")
        self._chunk_left -= len(data)
        if self._chunk_left == 0:
            self._rfile.readline(16)  # the CRLF after a chunk
        self.raw_read += len(data)
        return data  # type: ignore[no-any-return]

    def read_chunk(self) -> bytes:
        """Next decompressed bytes; ``b""`` only at the end of the body."""
        while True:
            raw = self._read_raw()
            if not raw:
                return b""
            if self._decompress is None:
                return raw
            try:
                out = self._decompress(raw)
            except Exception as exc:  # every codec raises its own error type
                raise HttpError(
                    CANNOT_DECOMPRESS, f"Cannot decompress request body: {exc}"
                ) from exc
            if out:
                return out

    def chunks(self) -> Iterator[bytes]:
        while chunk := self.read_chunk():
            yield chunk

    def read_all(self, limit: int) -> bytes:
        parts, size = [], 0
        for chunk in self.chunks():
            size += len(chunk)
            if size > limit:
                raise HttpError(QUERY_TOO_LARGE, f"Query is too large ({size} bytes, max {limit})")
            parts.append(chunk)
        return b"".join(parts)

    def drain(self) -> bool:
        """Discard what is left of the raw body; False when it is too big to bother."""
        drained = 0
        while not self._eof:
            drained += len(self._read_raw())
            if drained > MAX_DRAIN_BYTES:
                return False
        return True


# --------------------------------------------------------------------------- engine


@dataclass
class EngineConn:
    """One chdb connection and what the endpoint knows about its state."""

    conn: Any
    pristine: dict[str, str]  # settings chdb itself changed at creation
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

    def __init__(self, path: str) -> None:
        self.path = path
        self._pool: list[EngineConn] = []
        self._pool_lock = threading.Lock()
        self._sessions: dict[str, Session] = {}
        self._sessions_lock = threading.Lock()
        serialize = os.environ.get("TXSINK_EMBEDDED_SERIALIZE", "") not in ("", "0")
        self._global = threading.Lock() if serialize else contextlib.nullcontext()
        first = self._new_conn()
        version, tz = self._query_text(first, "SELECT version(), timezone()").split("\t")
        self.version = version.strip()
        self.timezone = tz.strip()
        self._release(first)

    # connections -------------------------------------------------------------
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
        """Stream an INSERT's data: ``first`` then the rest of ``body``, into chdb."""
        with self._global:
            try:
                inserter = ec.conn.send_insert(sql, fmt)
            except Exception as exc:  # bad table, bad format, ...
                raise engine_error(exc) from exc
            try:
                if first:
                    ec.conn._conn.insert_append(inserter._c_inserter, first)
                for chunk in body.chunks():
                    ec.conn._conn.insert_append(inserter._c_inserter, chunk)
                return inserter.finish()
            except BaseException as exc:
                inserter._finished = False
                with contextlib.suppress(Exception):  # cancelling a failed insert may fail too
                    inserter.cancel()
                if isinstance(exc, HttpError | ClientGone):
                    raise
                if isinstance(exc, Exception):
                    raise engine_error(exc) from exc
                raise


# --------------------------------------------------------------------------- HTTP


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # Headers and body go out in separate writes; with Nagle's algorithm on, the body
    # waits for the client's delayed ACK of the headers (40 ms per request on keep-alive).
    disable_nagle_algorithm = True
    server_version = "txsink-embedded"
    timeout = KEEP_ALIVE_SECONDS
    engine: Engine
    display_name = socket.gethostname()

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s " + format, self.address_string(), *args)

    # plumbing -----------------------------------------------------------------
    def _common_headers(self, query_id: str) -> None:
        self.send_header("X-ClickHouse-Server-Display-Name", self.display_name)
        self.send_header("X-ClickHouse-Query-Id", query_id)
        self.send_header("X-ClickHouse-Timezone", self.engine.timezone)
        self.send_header("Keep-Alive", f"timeout={KEEP_ALIVE_SECONDS}")

    def _send_error(self, err: HttpError, query_id: str) -> None:
        message = str(err)
        if not message.startswith("Code:"):
            name = ERROR_NAMES.get(err.code, "UNKNOWN_EXCEPTION")
            message = f"Code: {err.code}. DB::Exception: {message}. ({name})"
        body = f"{message} (version {self.engine.version})\n".encode()
        self.send_response(err.status)
        self._common_headers(query_id)
        self.send_header("X-ClickHouse-Exception-Code", str(err.code))
        self.send_header("Content-Type", "text/plain; charset=UTF-8")
        self.send_header("Content-Length", str(len(body)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """Protocol-level failures (bad request line, unsupported method) in ClickHouse style."""
        self.close_connection = True
        status = HTTPStatus(code) if code in HTTPStatus._value2member_map_ else HTTPStatus(400)
        text = message or status.phrase
        err = HttpError(UNSUPPORTED_METHOD if code == 501 else CANNOT_PARSE_INPUT, text, code)
        with contextlib.suppress(OSError):
            self._send_error(err, str(uuid.uuid4()))

    def do_GET(self) -> None:
        path = urlsplit(self.path).path
        if path in ("/ping", "/replicas_status"):
            body = b"Ok.\n"
            self.send_response(200)
            self.send_header("Content-Type", "text/html; charset=UTF-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        self._serve()

    def do_POST(self) -> None:
        self._serve()

    def do_HEAD(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _serve(self) -> None:
        query_id = str(uuid.uuid4())
        body: Body | None = None
        try:
            split = urlsplit(self.path)
            if split.path not in ("/", "", "/query"):
                raise HttpError(
                    NOT_IMPLEMENTED, f"There is no handle {split.path}", status=HTTPStatus.NOT_FOUND
                )
            params = dict(parse_qsl(split.query, keep_blank_values=True))
            query_id = params.get("query_id") or query_id
            body = self._body()
            self._handle(params, body, query_id)
        except ClientGone as exc:
            log.info("query %s: %s", query_id, exc)
            self.close_connection = True
        except (ConnectionError, TimeoutError) as exc:
            log.info("query %s: connection lost: %s", query_id, exc)
            self.close_connection = True
        except HttpError as exc:
            log.info("query %s failed: %s", query_id, exc)
            self._fail(exc, body, query_id)
        except Exception as exc:  # request boundary: any bug becomes a ClickHouse-style 500
            log.exception("query %s: unexpected failure", query_id)
            self._fail(HttpError(UNKNOWN_EXCEPTION, f"{type(exc).__name__}: {exc}"), body, query_id)

    def _fail(self, err: HttpError, body: Body | None, query_id: str) -> None:
        if getattr(self, "_headers_sent", False):
            self.close_connection = True  # mid-stream failure: cut the response short
            return
        try:
            if body is not None and not body.fully_read and not body.drain():
                self.close_connection = True
        except (HttpError, ClientGone, OSError):
            self.close_connection = True
        with contextlib.suppress(OSError):
            self._send_error(err, query_id)

    def _body(self) -> Body:
        chunked = "chunked" in self.headers.get("Transfer-Encoding", "").lower()
        length_header = self.headers.get("Content-Length")
        try:
            length = int(length_header) if length_header else None
        except ValueError:
            raise HttpError(CANNOT_PARSE_INPUT, "Malformed Content-Length") from None
        if length is not None and length < 0:
            raise HttpError(CANNOT_PARSE_INPUT, "Malformed Content-Length")
        if self.command == "POST" and length is None and not chunked:
            self.close_connection = True
            raise HttpError(HTTP_LENGTH_REQUIRED, "POST without Content-Length or chunked body")
        return Body(self.rfile, length, chunked, self.headers.get("Content-Encoding", ""))

    # the request --------------------------------------------------------------
    def _handle(self, params: dict[str, str], body: Body, query_id: str) -> None:
        self._headers_sent = False
        content_type = self.headers.get("Content-Type", "")
        if content_type.startswith("multipart/form-data"):
            params.update(self._form_fields(content_type, body))
        if params.get("decompress") in ("1", "true"):
            raise HttpError(
                NOT_IMPLEMENTED, "decompress=1 (ClickHouse native compression) is not supported"
            )
        binds = {k[6:]: v for k, v in params.items() if k.startswith("param_")}
        settings = {
            k: v
            for k, v in params.items()
            if k not in HTTP_ONLY_PARAMS and k not in HTTP_SETTINGS and not k.startswith("param_")
        }
        query_param = params.get("query", "")
        head = (query_param + "\n").encode() if query_param else b""
        header: InsertHeader | bool | None = False
        while header is False:
            chunk = body.read_chunk()
            head += chunk
            if not chunk or len(head) > MAX_HEADER_SCAN:
                header = scan_insert(head)
                if header is False:
                    header = None
                break
            header = scan_insert(head)
        try:
            timeout = float(params.get("session_timeout", "60"))
        except ValueError:
            raise HttpError(CANNOT_PARSE_INPUT, "Invalid session_timeout") from None
        session_id = params.get("session_id") or None
        check = params.get("session_check") in ("1", "true")
        fresh = "readonly" in settings
        with self.engine.connection(session_id, timeout, check, fresh) as (ec, session):
            self.engine.prepare(ec, settings, params.get("database") or None)
            if isinstance(header, InsertHeader):
                start = time.monotonic()
                result = self.engine.insert(
                    ec, header.sql, header.fmt, head[header.data_offset :], body
                )
                summary = {
                    "read_rows": str(result.rows_written),
                    "read_bytes": str(result.bytes_written),
                    "written_rows": str(result.rows_written),
                    "written_bytes": str(result.bytes_written),
                    "total_rows_to_read": "0",
                    "result_rows": str(result.rows_written),
                    "result_bytes": str(result.bytes_written),
                    "elapsed_ns": str(int((time.monotonic() - start) * 1e9)),
                }
                self._reply_empty(query_id, summary)
                return
            if not body.fully_read:
                head += body.read_all(MAX_QUERY_BYTES - len(head))
            try:
                sql = head.decode()
            except UnicodeDecodeError:
                raise HttpError(SYNTAX_ERROR, "Query is not valid UTF-8") from None
            if not sql.strip():
                raise HttpError(SYNTAX_ERROR, "Empty query")
            self._run(
                ec=ec, session=session, sql=sql, params=params, binds=binds, query_id=query_id
            )
        if params.get("close_session") in ("1", "true") and session_id:
            self.engine.close_session(session_id)

    def _form_fields(self, content_type: str, body: Body) -> dict[str, str]:
        raw = body.read_all(MAX_QUERY_BYTES)
        message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(
            b"Content-Type: " + content_type.encode() + b"\r\n\r\n" + raw
        )
        fields: dict[str, str] = {}
        for part in message.iter_parts():
            name = part.get_param("name", header="content-disposition")
            if part.get_param("filename", header="content-disposition"):
                raise HttpError(NOT_IMPLEMENTED, "External data tables are not supported")
            payload = part.get_payload(decode=True)
            if name and isinstance(payload, bytes):
                fields[str(name)] = payload.decode()
        return fields

    def _run(
        self,
        *,
        ec: EngineConn,
        session: Session | None,
        sql: str,
        params: dict[str, str],
        binds: dict[str, str],
        query_id: str,
    ) -> None:
        kind = statement_kind(sql)
        match = _FORMAT_AT_END.search(sql)
        fmt = match.group(1) if match else params.get("default_format") or "TabSeparated"
        start = time.monotonic()
        wait = params.get("wait_end_of_query", "0") in ("1", "true")
        if not wait and kind in ("SELECT", "WITH") and fmt.lower() in STREAMABLE_FORMATS:
            self._run_streaming(
                ec=ec, sql=sql, fmt=fmt, binds=binds, query_id=query_id, params=params
            )
            return
        result = self.engine.query(ec, sql, fmt, binds)
        if kind in ("SET", "USE"):
            self.engine.after_state_change(ec, session)
        data = result.get_memview().view() if result is not None else memoryview(b"")
        summary = {
            "read_rows": str(result.rows_read()),
            "read_bytes": str(result.bytes_read()),
            "written_rows": str(result.rows_written()),
            "written_bytes": str(result.bytes_written()),
            "total_rows_to_read": str(result.rows_read()),
            "result_rows": str(result.rows_read()),
            "result_bytes": str(len(data)),
            "elapsed_ns": str(int((time.monotonic() - start) * 1e9)),
        }
        encoding = self._response_encoding(params)
        payload: bytes | memoryview = data
        if encoding and len(data):
            comp = Compressor(encoding)
            payload = comp.compress(data) + comp.flush()
        self.send_response(200)
        self._common_headers(query_id)
        self.send_header("X-ClickHouse-Format", fmt)
        self.send_header("X-ClickHouse-Summary", json.dumps(summary))
        self.send_header("Content-Type", content_type_for(fmt))
        if encoding and len(data):
            self.send_header("Content-Encoding", encoding)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self._headers_sent = True
        self.wfile.write(payload)
        del result

    def _run_streaming(
        self,
        *,
        ec: EngineConn,
        sql: str,
        fmt: str,
        binds: dict[str, str],
        query_id: str,
        params: dict[str, str],
    ) -> None:
        stream = self.engine.stream(ec, sql, fmt, binds)
        try:
            first = stream.fetch()  # errors before the first block still get a status code
        except Exception as exc:  # ChdbError with the ClickHouse code
            stream.close()
            raise engine_error(exc) from exc
        encoding = self._response_encoding(params)
        comp = Compressor(encoding) if encoding else None
        self.send_response(200)
        self._common_headers(query_id)
        self.send_header("X-ClickHouse-Format", fmt)
        self.send_header("X-ClickHouse-Summary", json.dumps(EMPTY_SUMMARY))
        self.send_header("Content-Type", content_type_for(fmt))
        if comp is not None:
            self.send_header("Content-Encoding", comp.encoding)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self._headers_sent = True
        try:
            chunk = first
            while chunk is not None:
                data = chunk.get_memview().view()
                self._write_chunk(comp.compress(data) if comp else data)
                chunk = stream.fetch()
            if comp is not None:
                self._write_chunk(comp.flush())
            self.wfile.write(b"0\r\n\r\n")
        except Exception as exc:  # noqa: BLE001 - mid-stream: the only signal left is a cut connection
            log.warning("query %s failed mid-stream: %s", query_id, exc)
            self.close_connection = True
        finally:
            stream.close()

    def _write_chunk(self, data: bytes | memoryview) -> None:
        if len(data):
            self.wfile.write(b"%x\r\n" % len(data))
            self.wfile.write(data)
            self.wfile.write(b"\r\n")

    def _response_encoding(self, params: dict[str, str]) -> str | None:
        if params.get("enable_http_compression") not in ("1", "true"):
            return None
        return negotiate_encoding(self.headers.get("Accept-Encoding", ""))

    def _reply_empty(self, query_id: str, summary: dict[str, str]) -> None:
        self.send_response(200)
        self._common_headers(query_id)
        self.send_header("X-ClickHouse-Summary", json.dumps(summary))
        self.send_header("Content-Type", "text/plain; charset=UTF-8")
        self.send_header("Content-Length", "0")
        self.end_headers()
        self._headers_sent = True


def content_type_for(fmt: str) -> str:
    low = fmt.lower()
    if low.startswith(("tabseparated", "tsv")):
        return "text/tab-separated-values; charset=UTF-8"
    if low.startswith("csv"):
        return "text/csv; charset=UTF-8; header=absent"
    if low.startswith("json"):
        return "application/json; charset=UTF-8"
    return "application/octet-stream"


class Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128


def serve(data_dir: str, port: int, host: str = "127.0.0.1") -> None:
    """Run the endpoint until SIGTERM/SIGINT."""
    root = Path(data_dir)
    root.mkdir(parents=True, exist_ok=True)
    engine = Engine(str(root / "chdb"))
    handler = type("BoundHandler", (Handler,), {"engine": engine})
    server = Server((host, port), handler)
    stop = threading.Event()

    def reaper() -> None:
        while not stop.wait(5):
            engine.expire_sessions()

    threading.Thread(target=reaper, name="session-reaper", daemon=True).start()

    def on_signal(signum: int, _frame: Any) -> None:
        log.info("signal %d: shutting down", signum)
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    log.info(
        "serving ClickHouse %s HTTP on http://%s:%d (data %s)", engine.version, host, port, root
    )
    try:
        server.serve_forever(poll_interval=0.2)
    finally:
        stop.set()
        server.server_close()
        engine.close_all()
        log.info("stopped")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m txsink.embedded.server")
    parser.add_argument("--data", required=True, help="data directory (chdb files, log)")
    parser.add_argument("--port", type=int, default=18123)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--log-level", default=os.environ.get("TXSINK_EMBEDDED_LOG", "INFO"))
    args = parser.parse_args(argv)
    Path(args.data).mkdir(parents=True, exist_ok=True)
    logging.basicConfig(
        filename=str(Path(args.data) / "clickhouse-http.log"),
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(threadName)s %(name)s: %(message)s",
    )
    serve(args.data, args.port, args.host)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
