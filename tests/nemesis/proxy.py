"""A fault-injecting TCP proxy between a client (ClickHouse HTTP, ZooKeeper) and its server.

``FaultProxy`` owns one listening socket on 127.0.0.1, one asyncio loop in a daemon thread,
and, per accepted client connection, one upstream connection plus four tasks: a reader and
a sender for each direction. Tests point a client at ``proxy.address`` and switch faults
from the test thread while traffic flows.

Invariants:

* Bytes go through in order and unmodified; a fault only holds, discards or cuts them.
* A ``drop_reply`` rule fires only after the matched request was handed to the upstream
  socket, and the client gets none of that request's reply, only a TCP RST. So a fired rule
  means "the request landed, its reply was lost".
* Fault settings, rules and the event log sit behind one lock and may be changed from any
  thread; per-connection state is touched only by the loop thread.
* ``stop()`` closes the listener and every connection and joins the thread.

Matching. A plain matcher (``Callable[[bytes], bool]``, e.g. ``http_request``) sees the
bytes the client sent since upstream reply bytes last began flowing back on that connection
(one exchange on a keep-alive connection), capped at the first ``REQUEST_CAP`` bytes and
re-checked as more chunks arrive. A ``FrameMatcher`` (e.g. ``zk_op``) sees int32
length-prefixed frames one at a time (``index`` 0 is the first frame of the connection) and
also picks which upstream frame is the reply, so replies to other requests (ZooKeeper pings,
watch events) still reach the client until the real reply shows up. Compressed or chunked
request bodies are matched as they appear on the wire. A connection carries at most one
pending drop at a time (the drop resets it); a claim whose connection ends before any reply
is given back to its rule.

Events: every fault action is appended to ``events`` and logged on ``txsink.nemesis``;
"delay" and "blackhole" once per connection each time they start applying to it, so the log
stays bounded under heavy traffic.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import re
import socket
import struct
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeVar
from urllib.parse import unquote_plus

log = logging.getLogger("txsink.nemesis")
T = TypeVar("T")

REQUEST_CAP = 64 * 1024
_REPLY_HEAD = 64  # enough for any reply header a FrameMatcher needs (ZooKeeper's is 16)
_CHUNK = 64 * 1024
_QUEUE_CHUNKS = 64  # per direction: bounds memory while a delay holds chunks back
_MAX_FRAME = 64 * 1024 * 1024  # a bigger "length" means the stream is not framed

ZK_CREATE = 1
ZK_DELETE = 2
ZK_EXISTS = 3
ZK_GET_DATA = 4
ZK_SET_DATA = 5
ZK_GET_CHILDREN = 8
ZK_SYNC = 9
ZK_PING = 11
ZK_GET_CHILDREN2 = 12
ZK_CHECK = 13
ZK_MULTI = 14
ZK_CREATE2 = 15


class Event(NamedTuple):
    time: float  # time.monotonic()
    conn: int
    kind: str  # "delay" | "reset" | "blackhole" | "refuse" | "drop_reply"
    detail: str


def _printable(data: bytes | str, limit: int = 120) -> str:
    text = data.decode("latin-1") if isinstance(data, bytes) else data
    return re.sub(r"[^\x20-\x7e]", ".", text[:limit])


class HttpRequest:
    """Plain matcher: a regex found in the request text, raw or URL-unquoted."""

    def __init__(self, pattern: str) -> None:
        self.pattern = re.compile(pattern, re.IGNORECASE | re.DOTALL)

    def _search(self, data: bytes) -> tuple[str, re.Match[str]] | None:
        raw = data.decode("latin-1")
        # unquoting finds SQL sent in the query string; the raw text keeps a literal '+'
        for text in (unquote_plus(raw, encoding="latin-1"), raw):
            if found := self.pattern.search(text):
                return text, found
        return None

    def __call__(self, data: bytes) -> bool:
        return self._search(data) is not None

    def excerpt(self, data: bytes) -> str:
        hit = self._search(data)
        if hit is None:
            return _printable(data)
        text, found = hit
        return _printable(text[max(0, found.start() - 40) : found.end() + 40])


def http_request(pattern: str) -> HttpRequest:
    """Match HTTP requests (URL query string or body) in which ``pattern`` is found."""
    return HttpRequest(pattern)


class FrameMatcher:
    """Matcher of int32 length-prefixed frames; the proxy calls it once per client frame.

    ``body`` is the frame without its length prefix, cut to ``REQUEST_CAP`` bytes (replies:
    their first 64 bytes).
    """

    def __call__(self, index: int, body: bytes) -> bool:
        raise NotImplementedError

    def is_reply(self, request: bytes, index: int, body: bytes) -> bool:
        """Whether upstream frame ``index`` answers ``request``; by default the next one does."""
        return True

    def excerpt(self, index: int, body: bytes) -> str:
        return f"frame {index}: {_printable(body, 60)}"


class ZkRequest(FrameMatcher):
    """ZooKeeper client requests for which ``predicate(type, body)`` holds.

    ``body`` starts with the xid/type header; a multi is one request of type ZK_MULTI with its
    operations (paths included) in its body.
    """

    def __init__(self, predicate: Callable[[int, bytes], bool]) -> None:
        self.predicate = predicate

    def __call__(self, index: int, body: bytes) -> bool:
        # frame 0 is the ConnectRequest, which has no xid/type header
        if index == 0 or len(body) < 8:
            return False
        return self.predicate(struct.unpack_from(">i", body, 4)[0], body)

    def is_reply(self, request: bytes, index: int, body: bytes) -> bool:
        # a reply repeats its request's xid; pings (-2) and watch events (-1) do not
        return index > 0 and body[:4] == request[:4]

    def excerpt(self, index: int, body: bytes) -> str:
        xid, op = struct.unpack_from(">ii", body)
        return f"xid={xid} type={op} {_printable(body[8:], 60)}".rstrip()


def zk_op(*opcodes: int) -> ZkRequest:
    """Match ZooKeeper client request frames whose type is one of ``opcodes``."""
    wanted = frozenset(opcodes)
    return ZkRequest(lambda op, _body: op in wanted)


def zk_request(predicate: Callable[[int, bytes], bool]) -> ZkRequest:
    """Match ZooKeeper request frames by ``predicate(type, body)``, e.g. a multi on a path."""
    return ZkRequest(predicate)


Matcher = Callable[[bytes], bool] | FrameMatcher


class Rule:
    """An armed ``drop_reply``; ``fired`` and ``remaining`` change under the proxy's lock."""

    def __init__(self, match: Matcher, times: int, label: str) -> None:
        self.match = match
        self.label = label
        self.remaining = times
        self.fired = 0
        self._fired_once = threading.Event()

    def __repr__(self) -> str:
        return f"Rule({self.label!r}, fired={self.fired}, remaining={self.remaining})"


class _Frames:
    """Follows the frame boundaries of one direction of a stream, keeping only frame heads."""

    def __init__(self, head_size: int) -> None:
        self.head_size = head_size
        self.broken = False  # the stream is not length-prefixed; stop looking
        self.index = 0
        self._prefix = bytearray()
        self._head = bytearray()
        self._want = 0
        self._left = 0
        self._start = 0  # where the current frame began, relative to the next chunk fed

    def feed(self, data: bytes) -> list[tuple[int, int, bytes]]:
        """(start offset in ``data``, may be < 0; frame index; head) of heads completed."""
        heads: list[tuple[int, int, bytes]] = []
        pos, end = 0, len(data)
        while pos < end and not self.broken:
            if len(self._prefix) < 4:
                if not self._prefix:
                    self._start = pos
                take = min(4 - len(self._prefix), end - pos)
                self._prefix += data[pos : pos + take]
                pos += take
                if len(self._prefix) < 4:
                    break
                length = int.from_bytes(self._prefix, "big", signed=True)
                if not 0 <= length <= _MAX_FRAME:
                    self.broken = True
                    break
                self._left, self._want = length, min(length, self.head_size)
                self._head.clear()
                if self._want == 0:
                    heads.append((self._start, self.index, b""))
            take = min(self._left, end - pos)
            need = self._want - len(self._head)
            if need > 0 and take > 0:
                self._head += data[pos : pos + min(need, take)]
                if len(self._head) == self._want:
                    heads.append((self._start, self.index, bytes(self._head)))
            pos += take
            self._left -= take
            if self._left == 0:
                self._prefix.clear()
                self.index += 1
        self._start -= end
        return heads

    def open_head(self) -> int:
        """Trailing bytes fed so far that belong to a frame whose head is still incomplete."""
        if self.broken or not self._prefix:
            return 0
        if len(self._prefix) == 4 and len(self._head) == self._want:
            return 0
        return -self._start


@dataclass(eq=False)
class _Claim:
    rule: Rule
    request: bytes  # the matched frame's head (framed rules)
    excerpt: str
    landed: bool = False  # handed to the upstream socket
    done: bool = False


@dataclass(eq=False)
class _Conn:
    id: int
    client: asyncio.StreamWriter
    upstream: asyncio.StreamWriter | None = None
    work: asyncio.Task[None] | None = None
    request: bytearray = field(default_factory=bytearray)
    replying: bool = False
    sent: _Frames = field(default_factory=lambda: _Frames(REQUEST_CAP))
    received: _Frames = field(default_factory=lambda: _Frames(_REPLY_HEAD))
    claim: _Claim | None = None
    withheld: bytes = b""
    delay_noted: float = 0.0
    blackholed: bool = False


class _Item(NamedTuple):
    deadline: float
    data: bytes
    claim: _Claim | None = None
    cut: bool = False  # swallow the rest and reset the client: the reply arrived


def _rst(writer: asyncio.StreamWriter | None) -> None:
    if writer is None:
        return
    sock = writer.get_extra_info("socket")
    if sock is not None and sock.fileno() >= 0:
        # linger 0 makes close() send RST instead of FIN, like a crashed peer or middlebox
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


class FaultProxy:
    """Forwards 127.0.0.1:<port> -> upstream host:port; faults can be switched while running."""

    def __init__(self, upstream: tuple[str, int], *, name: str = "proxy", listen_port: int = 0):
        self.upstream = upstream
        self.name = name
        self.port = listen_port
        self._lock = threading.Lock()
        self._delay = 0.0
        self._blackhole = False
        self._refuse = False
        self._rules: list[Rule] = []
        self._events: list[Event] = []
        self._ids = itertools.count(1)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.Server | None = None
        self._conns: dict[int, _Conn] = {}
        self._handlers: set[asyncio.Task[Any]] = set()
        self._closing = False

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> FaultProxy:
        if self._loop is not None:
            raise RuntimeError(f"{self.name} already started")
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name=f"nemesis-{self.name}", daemon=True
        )
        self._thread.start()
        self._server = self._in_loop(asyncio.start_server(self._serve, "127.0.0.1", self.port))
        self.port = self._server.sockets[0].getsockname()[1]
        log.info("%s: listening on %s -> %s:%d", self.name, self.address, *self.upstream)
        return self

    def stop(self) -> None:
        loop, thread = self._loop, self._thread
        if loop is None or thread is None or loop.is_closed():
            return
        self._in_loop(self._shutdown())
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
        log.info("%s: stopped", self.name)

    def __enter__(self) -> FaultProxy:
        return self if self._loop is not None else self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # -- faults (any thread) ---------------------------------------------------------------

    def delay(self, seconds: float) -> None:
        """Hold every chunk, both directions, ``seconds`` before forwarding it (0 = off)."""
        if seconds < 0:
            raise ValueError("delay must be >= 0")
        with self._lock:
            self._delay = float(seconds)
        log.info("%s: delay %gs", self.name, seconds)

    def blackhole(self, on: bool = True) -> None:
        """Read and discard everything, answer nothing; connections opened meanwhile stay dead."""
        with self._lock:
            self._blackhole = on
        log.info("%s: blackhole %s", self.name, "on" if on else "off")

    def refuse(self, on: bool = True) -> None:
        """Accept new connections and reset them at once, like a server that is down."""
        with self._lock:
            self._refuse = on
        log.info("%s: refuse %s", self.name, "on" if on else "off")

    def reset_all(self) -> int:
        """Reset (RST) every open connection now, both sides; returns how many."""
        if self._loop is None or self._loop.is_closed():
            return 0

        async def reset() -> int:
            victims = [c for c in self._conns.values() if not c.client.is_closing()]
            for conn in victims:
                self._record(conn.id, "reset", "reset_all")
                self._kill(conn)
            return len(victims)

        return self._in_loop(reset())

    def drop_reply(self, match: Matcher, *, times: int = 1, label: str = "") -> Rule:
        """Forward the next ``times`` matching requests, then swallow each reply and reset."""
        rule = Rule(match, times, label or repr(match))
        with self._lock:
            self._rules.append(rule)
        log.info("%s: armed drop_reply %r x%d", self.name, rule.label, times)
        return rule

    def disarm(self, rule: Rule) -> None:
        """Disarm one rule; a drop already awaiting its reply still fires."""
        with self._lock:
            rule.remaining = 0
            if rule in self._rules:
                self._rules.remove(rule)

    def clear(self) -> None:
        """All faults off, all rules disarmed; a drop already awaiting its reply still fires."""
        with self._lock:
            self._delay, self._blackhole, self._refuse = 0.0, False, False
            for rule in self._rules:
                rule.remaining = 0
            self._rules.clear()
        log.info("%s: faults cleared", self.name)

    def wait_fired(self, rule: Rule, timeout: float) -> bool:
        """Whether ``rule`` fired at least once within ``timeout`` seconds."""
        return rule._fired_once.wait(timeout)

    @property
    def events(self) -> list[Event]:
        """A snapshot of the fault actions taken so far, oldest first."""
        with self._lock:
            return list(self._events)

    # -- loop side -------------------------------------------------------------------------

    def _in_loop(self, coro: Coroutine[Any, Any, T]) -> T:
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=10)

    def _record(self, conn: int, kind: str, detail: str = "") -> None:
        with self._lock:
            self._events.append(Event(time.monotonic(), conn, kind, detail))
        log.info("%s: conn %d %s %s", self.name, conn, kind, detail)

    async def _shutdown(self) -> None:
        self._closing = True
        if self._server is not None:
            self._server.close()
        # a few rounds: accepts already under way still reach _serve (which now resets them),
        # and aborted transports close their sockets in call_soon callbacks
        for _ in range(5):
            await asyncio.sleep(0)
            for conn in list(self._conns.values()):
                self._kill(conn)
            await asyncio.gather(*self._handlers, return_exceptions=True)

    def _kill(self, conn: _Conn) -> None:
        _rst(conn.client)
        _rst(conn.upstream)
        if conn.work is not None:
            conn.work.cancel()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # the handler itself is never cancelled: asyncio's done-callback for it would choke
        handler = asyncio.current_task()
        assert handler is not None
        self._handlers.add(handler)
        conn = _Conn(next(self._ids), writer)
        self._conns[conn.id] = conn
        conn.work = asyncio.create_task(self._connection(conn, reader))
        try:
            await asyncio.wait([conn.work])
            if not conn.work.cancelled() and (exc := conn.work.exception()) is not None:
                log.error("%s: conn %d failed", self.name, conn.id, exc_info=exc)
                self._kill(conn)
        finally:
            for w in (writer, conn.upstream):
                if w is not None and not w.is_closing():
                    w.close()
            self._release(conn)
            del self._conns[conn.id]
            self._handlers.discard(handler)

    async def _connection(self, conn: _Conn, reader: asyncio.StreamReader) -> None:
        with self._lock:
            refuse, blackhole = self._refuse, self._blackhole
        if refuse or self._closing:
            if refuse:
                self._record(conn.id, "refuse", "accepted and reset")
            _rst(conn.client)
            return
        if blackhole:
            # no upstream connection at all: this one stays dead even after blackhole(False)
            self._record(conn.id, "blackhole", "opened while blackholed")
            try:
                while await reader.read(_CHUNK):
                    pass
            except ConnectionError:
                pass
            return
        try:
            up_reader, conn.upstream = await asyncio.open_connection(*self.upstream)
        except OSError as exc:
            # the server being down is an expected state in nemesis runs, not an error
            log.info("%s: conn %d: upstream unreachable: %s", self.name, conn.id, exc)
            _rst(conn.client)
            return
        to_up: asyncio.Queue[_Item | None] = asyncio.Queue(_QUEUE_CHUNKS)
        to_client: asyncio.Queue[_Item | None] = asyncio.Queue(_QUEUE_CHUNKS)
        await asyncio.gather(
            self._guard(conn, self._read(conn, reader, to_up, upstream_bound=True)),
            self._guard(conn, self._send(conn, to_up, conn.upstream)),
            self._guard(conn, self._read(conn, up_reader, to_client, upstream_bound=False)),
            self._guard(conn, self._send(conn, to_client, conn.client)),
        )

    async def _guard(self, conn: _Conn, coro: Coroutine[Any, Any, None]) -> None:
        try:
            await coro
        except OSError as exc:  # ConnectionResetError and friends
            # one side died abruptly: pass it on as a reset to the other side
            log.debug("%s: conn %d: %r", self.name, conn.id, exc)
            self._kill(conn)

    async def _read(
        self,
        conn: _Conn,
        reader: asyncio.StreamReader,
        queue: asyncio.Queue[_Item | None],
        *,
        upstream_bound: bool,
    ) -> None:
        loop = asyncio.get_running_loop()
        deadline = 0.0
        while data := await reader.read(_CHUNK):
            with self._lock:
                delay, blackhole = self._delay, self._blackhole
            if blackhole:
                if not conn.blackholed:
                    conn.blackholed = True
                    self._record(conn.id, "blackhole", "discarding")
                continue
            conn.blackholed = False
            if delay != conn.delay_noted:
                conn.delay_noted = delay
                if delay > 0:
                    self._record(conn.id, "delay", f"{delay:g}s")
            # never earlier than the previous chunk, so a shorter delay cannot reorder bytes
            deadline = max(deadline, loop.time() + delay)
            if upstream_bound:
                await queue.put(_Item(deadline, data, self._from_client(conn, data)))
                continue
            out, cut = self._from_upstream(conn, data)
            if out or cut:
                await queue.put(_Item(deadline, out, cut=cut))
            if cut:
                return
        if not upstream_bound and conn.claim is not None and conn.claim.landed:
            # upstream closed instead of replying: the client still must not learn the outcome
            await queue.put(_Item(deadline, b"", cut=True))
            return
        await queue.put(None)

    async def _send(
        self, conn: _Conn, queue: asyncio.Queue[_Item | None], writer: asyncio.StreamWriter
    ) -> None:
        loop = asyncio.get_running_loop()
        while (item := await queue.get()) is not None:
            if (wait := item.deadline - loop.time()) > 0:
                await asyncio.sleep(wait)
            if item.data:
                writer.write(item.data)
            if item.claim is not None:
                item.claim.landed = True
            await writer.drain()
            if item.cut:
                self._drop(conn)
                return
        if writer.can_write_eof():
            writer.write_eof()

    def _from_client(self, conn: _Conn, data: bytes) -> _Claim | None:
        if conn.replying:
            conn.request.clear()
            conn.replying = False
        room = REQUEST_CAP - len(conn.request)
        if room > 0:
            conn.request += data[:room]
        heads = conn.sent.feed(data)
        if conn.claim is not None:
            return None  # one drop per connection: it is reset when the drop happens
        with self._lock:
            for rule in self._rules:
                if rule.remaining > 0 and (hit := self._hit(rule, conn, heads, room > 0)):
                    rule.remaining -= 1
                    conn.claim = _Claim(rule, *hit)
                    return conn.claim
        return None

    @staticmethod
    def _hit(
        rule: Rule, conn: _Conn, heads: list[tuple[int, int, bytes]], grew: bool
    ) -> tuple[bytes, str] | None:
        if isinstance(rule.match, FrameMatcher):
            for _start, index, head in heads:
                if rule.match(index, head):
                    return head, rule.match.excerpt(index, head)
            return None
        request = bytes(conn.request)
        if grew and rule.match(request):
            excerpt = getattr(rule.match, "excerpt", _printable)
            return b"", excerpt(request)
        return None

    def _from_upstream(self, conn: _Conn, data: bytes) -> tuple[bytes, bool]:
        """(bytes to pass to the client, whether the pending drop's reply has begun)."""
        conn.replying = True
        heads = conn.received.feed(data)
        claim = conn.claim
        if claim is None or not claim.landed:
            return data, False
        if not isinstance(matcher := claim.rule.match, FrameMatcher) or conn.received.broken:
            return b"", True
        shift = len(conn.withheld)
        data, conn.withheld = conn.withheld + data, b""
        for start, index, head in heads:
            if matcher.is_reply(claim.request, index, head):
                return data[: max(0, start + shift)], True
        # a frame whose head is still partial may be the reply: hold it until we can tell
        keep = min(conn.received.open_head(), len(data))
        if keep:
            data, conn.withheld = data[:-keep], data[-keep:]
        return data, False

    def _drop(self, conn: _Conn) -> None:
        claim = conn.claim
        assert claim is not None
        with self._lock:
            claim.done = True
            claim.rule.fired += 1
        claim.rule._fired_once.set()
        self._record(conn.id, "drop_reply", f"{claim.rule.label}: {claim.excerpt}")
        _rst(conn.client)
        if conn.upstream is not None:
            # FIN, not RST: whatever the client sent is still delivered upstream
            conn.upstream.close()
        if conn.work is not None:
            conn.work.cancel()

    def _release(self, conn: _Conn) -> None:
        claim = conn.claim
        if claim is None or claim.done:
            return
        with self._lock:
            # the connection ended before the reply: the drop did not happen, give it back
            if claim.rule in self._rules:
                claim.rule.remaining += 1
