"""The embedded ClickHouse HTTP endpoint: one chdb engine per process, served over HTTP.

Run as ``python -m txsink.embedded.server --data DIR --port N``. The process owns one
chdb engine whose data lives in ``DIR/chdb`` and speaks enough of the ClickHouse HTTP
interface for stock ``clickhouse_connect.get_client(host, port)`` in other processes:

- ``GET /ping`` answers ``Ok.``; every other path is a query endpoint (``/`` as usual).
- The query text is the ``query`` URL parameter followed by the request body (ClickHouse's
  own rule). ``INSERT ... FORMAT X`` streams the rest of the body into
  ``Connection.send_insert`` chunk by chunk, so large inserts are never held in memory.
  An ``INSERT ... SELECT ... FROM input('<structure>') ... FORMAT X`` in the ``query``
  parameter takes the whole body as its data (:mod:`~txsink.embedded.input_insert`).
- Request bodies may be chunked and compressed (``Content-Encoding`` lz4 frame, zstd,
  gzip, deflate, br); responses are compressed when ``enable_http_compression=1`` and the
  client sent ``Accept-Encoding``.
- URL parameters that are not HTTP-interface parameters are ClickHouse settings and apply
  to that request; ``param_<name>`` binds ``{name:Type}`` placeholders.
- ``session_id`` gives the client its own chdb connection, so ``SET``/``USE`` persist for
  the session (expiring after ``session_timeout`` seconds idle, default 60).
- Errors come back as ClickHouse does it: HTTP 4xx/5xx, ``X-ClickHouse-Exception-Code``
  and a ``Code: N. DB::Exception: ... (NAME) (version V)`` body.

The pieces: :mod:`~txsink.embedded.sqlscan` (statement and parameter scanning),
:mod:`~txsink.embedded.transfer` (body framing, compression), :mod:`~txsink.embedded.engine`
(chdb connections and sessions), :mod:`~txsink.embedded.http_errors` (error codes),
:mod:`~txsink.embedded.responses` (summaries, content types, error bodies, form fields).
This module owns the HTTP side: routing, the request flow, sending headers and bodies,
and the process (``serve``/``main``).

Invariants: any failure while handling a request becomes an HTTP error and never takes
the process down; once response headers are out, a failure can only cut the connection.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import socket
import threading
import time
import uuid
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from txsink.embedded.crash import cut_move_if_armed
from txsink.embedded.engine import Engine, EngineConn, Session
from txsink.embedded.http_errors import (
    CANNOT_PARSE_INPUT,
    HTTP_LENGTH_REQUIRED,
    NOT_IMPLEMENTED,
    SYNTAX_ERROR,
    UNKNOWN_EXCEPTION,
    UNSUPPORTED_METHOD,
    ClientGone,
    HttpError,
    engine_error,
)
from txsink.embedded.input_insert import run_input_insert, spool_dir
from txsink.embedded.responses import (
    EMPTY_SUMMARY,
    STREAMABLE_FORMATS,
    content_type_for,
    error_body,
    form_fields,
    insert_summary,
    query_summary,
)
from txsink.embedded.sqlscan import (
    InsertHeader,
    format_clause,
    scan_input_insert,
    scan_insert,
    split_params,
    statement_kind,
)
from txsink.embedded.stack import QUERY_LOG_CONFIG
from txsink.embedded.transfer import Body, Compressor, negotiate_encoding

log = logging.getLogger("txsink.embedded.server")

MAX_QUERY_BYTES = 256 << 20  # a non-INSERT query (or INSERT without FORMAT) is buffered
MAX_HEADER_SCAN = 1 << 20  # the INSERT ... FORMAT X header must fit in this prefix
KEEP_ALIVE_SECONDS = 120


# statements that return no result set: ClickHouse sends them no X-ClickHouse-Format (a
# client then reads the summary: clickhouse-connect's command() returns a QuerySummary)
NO_RESULT = frozenset(
    ("INSERT", "CREATE", "DROP", "ALTER", "RENAME", "TRUNCATE", "OPTIMIZE", "SYSTEM", "SET",
     "USE", "GRANT", "REVOKE", "ATTACH", "DETACH", "DELETE", "EXCHANGE", "UPDATE")
)  # fmt: skip


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # Headers and body go out in separate writes; with Nagle's algorithm on, the body
    # waits for the client's delayed ACK of the headers (40 ms per request on keep-alive).
    disable_nagle_algorithm = True
    server_version = "txsink-embedded"
    timeout = KEEP_ALIVE_SECONDS
    engine: Engine
    data_dir: Path | None = None  # the endpoint's data directory (test faults: crash.py)
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
        body = error_body(err, self.engine.version)
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
            params.update(form_fields(content_type, body.read_all(MAX_QUERY_BYTES)))
        if params.get("decompress") in ("1", "true"):
            raise HttpError(
                NOT_IMPLEMENTED, "decompress=1 (ClickHouse native compression) is not supported"
            )
        settings, binds = split_params(params)
        query_param = params.get("query", "")
        feed = scan_input_insert(query_param) if query_param else None  # the body is data
        head = (query_param + "\n").encode() if query_param else b""
        header: InsertHeader | bool | None = False if feed is None else None
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
            if feed is not None:
                spool = spool_dir(self.data_dir)
                summary = run_input_insert(self.engine, ec, feed, body, binds, spool)
                self._reply_empty(query_id, summary)
                return
            if isinstance(header, InsertHeader):
                start = time.monotonic()
                result = self.engine.insert(
                    ec, header.sql, header.fmt, head[header.data_offset :], body
                )
                summary = insert_summary(
                    result.rows_written, result.bytes_written, time.monotonic() - start
                )
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
            if self.data_dir is not None:
                cut_move_if_armed(self.engine, ec, sql, self.data_dir)
            self._run(
                ec=ec, session=session, sql=sql, params=params, binds=binds, query_id=query_id
            )
        if params.get("close_session") in ("1", "true") and session_id:
            self.engine.close_session(session_id)

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
        fmt = format_clause(sql) or params.get("default_format") or "TabSeparated"
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
        summary = query_summary(result, len(data), time.monotonic() - start)
        encoding = self._response_encoding(params)
        payload: bytes | memoryview = data
        if encoding and len(data):
            comp = Compressor(encoding)
            payload = comp.compress(data) + comp.flush()
        self.send_response(200)
        self._common_headers(query_id)
        if kind not in NO_RESULT:  # as ClickHouse: an INSERT or DDL names no output format
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


class Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128


def serve(
    data_dir: str,
    port: int,
    host: str = "127.0.0.1",
    config_file: str | None = None,
    profile: dict[str, str] | None = None,
) -> None:
    """Run the endpoint until SIGTERM/SIGINT. ``config_file``: a ClickHouse server config
    chdb reads (``<zookeeper>``, ``<macros>``: see
    :func:`txsink.embedded.stack.keeper_config`). ``profile``: settings every connection
    starts from, as a user's settings profile would set them on a server (chdb has no
    users; tests of what a profile does to txsink use it)."""
    root = Path(data_dir)
    root.mkdir(parents=True, exist_ok=True)
    path = str(root / "chdb")
    replicated = bool(config_file)
    if not config_file:  # query_log as on a server (the evidence visibility=batch reads)
        config_file = os.path.join(data_dir, "chdb-log-config.xml")
        with open(config_file, "w", encoding="utf-8") as fh:
            fh.write(f"<clickhouse>{QUERY_LOG_CONFIG}</clickhouse>\n")
    engine = Engine(
        f"file:{path}?config-file={config_file}", profile=profile, replicated=replicated
    )
    handler = type("BoundHandler", (Handler,), {"engine": engine, "data_dir": root})
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
    parser.add_argument(
        "--config-file", help="ClickHouse config for chdb (e.g. <zookeeper>, <macros>)"
    )
    parser.add_argument(
        "--setting",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a settings-profile default of every connection (repeatable), e.g. "
        "deduplicate_insert=disable",
    )
    parser.add_argument("--log-level", default=os.environ.get("TXSINK_EMBEDDED_LOG", "INFO"))
    args = parser.parse_args(argv)
    profile = dict(item.split("=", 1) for item in args.setting if "=" in item)
    Path(args.data).mkdir(parents=True, exist_ok=True)
    logging.basicConfig(
        filename=str(Path(args.data) / "clickhouse-http.log"),
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(threadName)s %(name)s: %(message)s",
    )
    serve(args.data, args.port, args.host, args.config_file, profile)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
