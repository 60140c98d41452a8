"""FaultProxy forwards bytes faithfully and injects exactly the faults it is told to.

Every test runs the proxy against small real servers on 127.0.0.1 (an echo server, an
HTTP/1.1 keep-alive server, a length-prefixed "ZooKeeper" server); nothing is mocked.
"""

from __future__ import annotations

import http.client
import http.server
import logging
import os
import socket
import socketserver
import struct
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from tests.nemesis.proxy import (
    ZK_CREATE,
    ZK_MULTI,
    FaultProxy,
    http_request,
    zk_op,
    zk_request,
)

# -- real upstream servers ------------------------------------------------------------------


class _Quiet:
    """Peers reset by the proxy are expected here, not worth a traceback on stderr."""

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass


class EchoServer(_Quiet, socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), EchoHandler)
        self.lock = threading.Lock()
        self.received = bytearray()
        self.connections = 0


class EchoHandler(socketserver.BaseRequestHandler):
    server: EchoServer

    def handle(self) -> None:
        with self.server.lock:
            self.server.connections += 1
        while data := self.request.recv(65536):
            with self.server.lock:
                self.server.received += data
            self.request.sendall(data)


class HttpServer(_Quiet, http.server.ThreadingHTTPServer):
    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), HttpHandler)
        self.requests: list[str] = []


class HttpHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive
    server: HttpServer

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.server.requests.append(f"{self.path} {body.decode()}")
        reply = b"ok " + body
        self.send_response(200)
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, format: str, *args: Any) -> None:
        pass


class SwallowServer(_Quiet, socketserver.ThreadingTCPServer):
    """Reads one chunk, answers nothing, hangs up: the request landed, no reply ever comes."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), SwallowHandler)
        self.received: list[bytes] = []


class SwallowHandler(socketserver.BaseRequestHandler):
    server: SwallowServer

    def handle(self) -> None:
        self.server.received.append(self.request.recv(65536))


def frame(body: bytes) -> bytes:
    return struct.pack(">i", len(body)) + body


def zk_frame(xid: int, op: int, payload: bytes = b"") -> bytes:
    return frame(struct.pack(">ii", xid, op) + payload)


WATCH_EVENT = frame(struct.pack(">iqi", -1, -1, 0) + b"event")


class FramedServer(_Quiet, socketserver.ThreadingTCPServer):
    """Answers each length-prefixed frame with one frame, ZooKeeper style (xid first)."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, *, event_before_multi: bool = False) -> None:
        super().__init__(("127.0.0.1", 0), FramedHandler)
        self.frames: list[tuple[int, bytes]] = []
        self.event_before_multi = event_before_multi


class FramedHandler(socketserver.BaseRequestHandler):
    server: FramedServer

    def recv_exact(self, n: int) -> bytes:
        data = b""
        while len(data) < n:
            if not (chunk := self.request.recv(n - len(data))):
                raise EOFError
            data += chunk
        return data

    def handle(self) -> None:
        index = 0
        try:
            while True:
                body = self.recv_exact(struct.unpack(">i", self.recv_exact(4))[0])
                self.server.frames.append((index, body))
                if index == 0:
                    self.request.sendall(frame(b"\0" * 16))  # connect response
                else:
                    xid, op = struct.unpack_from(">ii", body)
                    reply = frame(struct.pack(">iqi", xid, index, 0) + b"reply")
                    if op == ZK_MULTI and self.server.event_before_multi:
                        # an unrelated frame first, then the reply split over two segments
                        self.request.sendall(WATCH_EVENT)
                        time.sleep(0.1)
                        self.request.sendall(reply[:6])
                        time.sleep(0.1)
                        reply = reply[6:]
                    self.request.sendall(reply)
                index += 1
        except EOFError:
            pass


@pytest.fixture(autouse=True)
def no_leaked_proxy_threads() -> Iterator[None]:
    yield
    alive = [t.name for t in threading.enumerate() if t.name.startswith("nemesis-")]
    assert alive == []


def serving(server: socketserver.BaseServer) -> Iterator[Any]:
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    thread.join(5)


@pytest.fixture
def echo() -> Iterator[EchoServer]:
    yield from serving(EchoServer())


@pytest.fixture
def web() -> Iterator[HttpServer]:
    yield from serving(HttpServer())


ProxyTo = Callable[[socketserver.TCPServer], FaultProxy]


@pytest.fixture
def proxy_to() -> Iterator[ProxyTo]:
    started: list[FaultProxy] = []

    def make(server: socketserver.TCPServer) -> FaultProxy:
        host, port = server.socket.getsockname()[:2]
        started.append(FaultProxy((host, port), name="test").start())
        return started[-1]

    yield make
    for proxy in started:
        proxy.stop()


# -- client helpers -------------------------------------------------------------------------


def connect(proxy: FaultProxy, timeout: float = 5.0) -> socket.socket:
    return socket.create_connection(("127.0.0.1", proxy.port), timeout=timeout)


def round_trip(sock: socket.socket, data: bytes) -> bytes:
    sock.sendall(data)
    got = b""
    while len(got) < len(data):
        if not (chunk := sock.recv(65536)):
            break
        got += chunk
    return got


def until_closed(sock: socket.socket) -> tuple[bytes, str]:
    """Everything received until the peer went away, and how: "reset" or "eof"."""
    got = b""
    try:
        while chunk := sock.recv(65536):
            got += chunk
    except ConnectionResetError:
        return got, "reset"
    return got, "eof"


def kinds(proxy: FaultProxy) -> list[str]:
    return [e.kind for e in proxy.events]


# -- forwarding and plain faults -------------------------------------------------------------


def test_bytes_pass_unchanged_both_ways_on_concurrent_connections(
    echo: EchoServer, proxy_to: ProxyTo
) -> None:
    proxy = proxy_to(echo)

    def exchange(i: int) -> bool:
        payload = bytes([i]) + os.urandom(300_000)
        with connect(proxy) as sock:
            # send from another thread: the echo comes back while we are still sending
            def send() -> None:
                sock.sendall(payload)
                sock.shutdown(socket.SHUT_WR)

            sender = threading.Thread(target=send)
            sender.start()
            got, how = until_closed(sock)
            sender.join()
        return got == payload and how == "eof"

    with ThreadPoolExecutor(8) as pool:
        assert all(pool.map(exchange, range(8)))
    assert echo.connections == 8 and len(echo.received) == 8 * 300_001
    assert proxy.events == []


def test_delay_holds_every_chunk_in_each_direction(echo: EchoServer, proxy_to: ProxyTo) -> None:
    proxy = proxy_to(echo)
    with connect(proxy) as sock:
        proxy.delay(0.3)
        start = time.monotonic()
        assert round_trip(sock, b"slow") == b"slow"
        assert time.monotonic() - start >= 2 * 0.3 - 0.01
        proxy.delay(0)
        start = time.monotonic()
        assert round_trip(sock, b"fast") == b"fast"
        assert time.monotonic() - start < 0.3
    assert kinds(proxy) == ["delay"]


def test_reset_all_resets_every_open_connection_and_new_ones_still_work(
    echo: EchoServer, proxy_to: ProxyTo
) -> None:
    proxy = proxy_to(echo)
    a, b = connect(proxy), connect(proxy)
    with a, b:
        assert round_trip(a, b"a") == b"a" and round_trip(b, b"b") == b"b"
        assert proxy.reset_all() == 2
        assert until_closed(a) == (b"", "reset")
        assert until_closed(b) == (b"", "reset")
    with connect(proxy) as c:
        assert round_trip(c, b"c") == b"c"
    assert kinds(proxy) == ["reset", "reset"]


def test_blackhole_swallows_client_bytes_until_lifted_and_upstream_sees_nothing(
    echo: EchoServer, proxy_to: ProxyTo
) -> None:
    proxy = proxy_to(echo)
    with connect(proxy, timeout=0.5) as before:
        assert round_trip(before, b"one") == b"one"
        proxy.blackhole()
        with connect(proxy, timeout=0.5) as during:
            before.sendall(b"two")
            during.sendall(b"three")
            with pytest.raises(TimeoutError):
                before.recv(100)
            with pytest.raises(TimeoutError):
                during.recv(100)
            proxy.blackhole(False)
            # a connection that was open before resumes; "two" is gone for good
            before.settimeout(5)
            assert round_trip(before, b"four") == b"four"
            during.settimeout(0.3)
            during.sendall(b"five")
            with pytest.raises(TimeoutError):
                during.recv(100)
    assert bytes(echo.received) == b"onefour"
    assert echo.connections == 1
    assert kinds(proxy) == ["blackhole", "blackhole"]


def test_refuse_resets_new_connections_without_reaching_upstream(
    echo: EchoServer, proxy_to: ProxyTo
) -> None:
    proxy = proxy_to(echo)
    proxy.refuse()
    try:
        with connect(proxy) as sock:
            assert until_closed(sock) == (b"", "reset")
    except ConnectionResetError:
        pass  # the reset can even beat connect()'s own completion check
    assert echo.connections == 0
    proxy.refuse(False)
    with connect(proxy) as sock:
        assert round_trip(sock, b"up") == b"up"
    assert kinds(proxy) == ["refuse"]


def test_stop_closes_listener_and_connections_and_is_idempotent(echo: EchoServer) -> None:
    with FaultProxy(echo.socket.getsockname()[:2], name="ctx") as proxy:
        idle = connect(proxy)
        assert round_trip(idle, b"x") == b"x"
        thread = proxy._thread
    assert thread is not None and not thread.is_alive()
    with idle:
        assert until_closed(idle)[0] == b""
    with pytest.raises(ConnectionRefusedError):
        connect(proxy).close()
    proxy.stop()


# -- lost replies: HTTP ---------------------------------------------------------------------


def post(conn: http.client.HTTPConnection, url: str, body: str = "") -> str:
    conn.request("POST", url, body=body.encode())
    return conn.getresponse().read().decode()


MOVE = "ALTER TABLE x MOVE PARTITION ID '1' TO TABLE y"


def test_http_matcher_sees_url_encoded_query_and_plain_body() -> None:
    insert = http_request(r"INSERT\s+INTO\s+t\b")
    assert insert(b"POST /?database=d&query=INSERT+INTO+t+FORMAT+Native HTTP/1.1\r\n\r\n")
    assert insert(b"POST / HTTP/1.1\r\nContent-Length: 15\r\n\r\ninsert into t 1")
    assert not insert(b"POST /?query=INSERT+INTO+t2 HTTP/1.1\r\n\r\n")
    assert http_request(r"a\+b")(b"a+b")


def test_dropped_http_reply_means_request_landed_and_client_was_reset(
    web: HttpServer, proxy_to: ProxyTo, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="txsink.nemesis")
    proxy = proxy_to(web)
    rule = proxy.drop_reply(http_request(r"MOVE\s+PARTITION"), label="lost MOVE")
    conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=5)
    try:
        assert post(conn, "/?query=SELECT+1") == "ok "
        with pytest.raises(ConnectionError):
            post(conn, "/", MOVE)
    finally:
        conn.close()
    assert proxy.wait_fired(rule, 5)
    assert web.requests == ["/?query=SELECT+1 ", f"/ {MOVE}"]
    assert (rule.fired, rule.remaining) == (1, 0)

    again = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=5)
    try:
        assert post(again, "/", MOVE) == f"ok {MOVE}"
    finally:
        again.close()
    assert rule.fired == 1
    (event,) = proxy.events
    # conn 1: the MOVE went on the keep-alive connection that had already served a SELECT
    assert (event.conn, event.kind) == (1, "drop_reply")
    assert event.detail.startswith("lost MOVE: ")
    assert "MOVE PARTITION" in event.detail
    assert "lost MOVE" in caplog.text


def test_http_request_split_over_segments_is_matched_as_a_whole(
    web: HttpServer, proxy_to: ProxyTo
) -> None:
    proxy = proxy_to(web)
    rule = proxy.drop_reply(http_request(r"ALTER TABLE x.*MOVE PARTITION"), label="split")
    body = b"MOVE PARTITION ID '1' TO TABLE y"
    with connect(proxy) as sock:
        sock.sendall(
            b"POST /?query=ALTER+TABLE+x HTTP/1.1\r\nHost: h\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body)
        )
        time.sleep(0.1)  # the body arrives as a segment of its own
        sock.sendall(body)
        assert until_closed(sock) == (b"", "reset")
    assert rule.fired == 1
    assert web.requests == [f"/?query=ALTER+TABLE+x {body.decode()}"]


def test_keep_alive_requests_are_matched_one_exchange_at_a_time(
    web: HttpServer, proxy_to: ProxyTo
) -> None:
    proxy = proxy_to(web)
    rule = proxy.drop_reply(http_request("alpha.*beta"))
    conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=5)
    try:
        assert post(conn, "/", "alpha") == "ok alpha"
        assert post(conn, "/", "beta") == "ok beta"
    finally:
        conn.close()
    assert (rule.fired, rule.remaining) == (0, 1)
    assert proxy.events == []


def test_upstream_hanging_up_after_a_matched_request_still_resets_the_client(
    proxy_to: ProxyTo,
) -> None:
    for server in serving(SwallowServer()):
        proxy = proxy_to(server)
        rule = proxy.drop_reply(http_request("boom"))
        with connect(proxy) as sock:
            sock.sendall(b"POST / HTTP/1.1\r\n\r\nboom")
            # forwarding the upstream's FIN would tell the client "no reply"; a reset does not
            assert until_closed(sock) == (b"", "reset")
        assert rule.fired == 1 and server.received == [b"POST / HTTP/1.1\r\n\r\nboom"]


# -- lost replies: length-prefixed frames (ZooKeeper) ------------------------------------------


def zk_session(proxy: FaultProxy) -> socket.socket:
    sock = connect(proxy)
    # a ConnectRequest whose bytes 4..8 read as type 14: frame 0 must never be matched
    sock.sendall(frame(struct.pack(">iii", 0, 0, ZK_MULTI) + b"\0" * 20))
    assert len(read_frame(sock)) == 16
    return sock


def recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        if not (chunk := sock.recv(n - len(data))):
            raise EOFError(data)
        data += chunk
    return data


def read_frame(sock: socket.socket) -> bytes:
    return recv_exact(sock, struct.unpack(">i", recv_exact(sock, 4))[0])


@pytest.fixture
def zk() -> Iterator[FramedServer]:
    yield from serving(FramedServer())


@pytest.fixture
def zk_chatty() -> Iterator[FramedServer]:
    yield from serving(FramedServer(event_before_multi=True))


def test_dropped_zk_multi_landed_while_other_requests_pass(
    zk: FramedServer, proxy_to: ProxyTo
) -> None:
    proxy = proxy_to(zk)
    rule = proxy.drop_reply(zk_op(ZK_MULTI), label="lost multi")
    with zk_session(proxy) as sock:
        sock.sendall(zk_frame(1, 4, b"/path"))
        assert struct.unpack_from(">i", read_frame(sock))[0] == 1
        sock.sendall(zk_frame(2, ZK_MULTI, b"ops"))
        assert until_closed(sock) == (b"", "reset")
    assert proxy.wait_fired(rule, 5) and rule.fired == 1
    assert [(i, struct.unpack_from(">i", b, 4)[0]) for i, b in zk.frames[1:]] == [
        (1, 4),
        (2, ZK_MULTI),
    ]
    (event,) = proxy.events
    assert event.detail == "lost multi: xid=2 type=14 ops"


def test_zk_frames_before_the_dropped_reply_still_reach_the_client(
    zk_chatty: FramedServer, proxy_to: ProxyTo
) -> None:
    proxy = proxy_to(zk_chatty)
    with zk_session(proxy) as sock:
        # armed mid-connection: the proxy has kept track of frame boundaries all along
        rule = proxy.drop_reply(zk_request(lambda op, body: op == ZK_MULTI and b"/xids/" in body))
        sock.sendall(zk_frame(7, ZK_MULTI, b"/other/"))
        assert read_frame(sock) == WATCH_EVENT[4:]
        assert struct.unpack_from(">i", read_frame(sock))[0] == 7
        sock.sendall(zk_frame(8, ZK_CREATE, b"/xids/1") + zk_frame(9, ZK_MULTI, b"/xids/2"))
        assert struct.unpack_from(">i", read_frame(sock))[0] == 8
        # the watch event is delivered, the multi's reply (split in two) is not: not a byte
        assert until_closed(sock) == (WATCH_EVENT, "reset")
    assert rule.fired == 1
    assert [struct.unpack_from(">i", b)[0] for _, b in zk_chatty.frames[1:]] == [7, 8, 9]
