"""Request and response bytes on the wire: body framing and content encodings.

Owns reading a request body (``Content-Length`` or chunked, optionally compressed with
``Content-Encoding`` lz4 frame, zstd, gzip, deflate or br) as a stream of decompressed
chunks, and compressing responses for an ``Accept-Encoding`` the client offered.

Invariants: a body is read at most ``READ_CHUNK`` bytes at a time, so large inserts are
never held in memory; a client that disconnects mid-body is :class:`ClientGone`, a
malformed or undecodable body is an :class:`HttpError`; only encodings whose codec is
installed are negotiated.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterator
from typing import Any

from txsink.embedded.http_errors import (
    CANNOT_DECOMPRESS,
    CANNOT_PARSE_INPUT,
    QUERY_TOO_LARGE,
    UNKNOWN_FORMAT,
    ClientGone,
    HttpError,
)

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

READ_CHUNK = 1 << 20  # body bytes per read and per chdb append
MAX_DRAIN_BYTES = 1 << 30  # body left unread after an error is drained up to this much


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
