"""Reading a request's SQL and parameters without parsing SQL.

Owns the lexical scans the endpoint needs: finding an ``INSERT ... FORMAT X`` header at
the start of a (possibly partial) body, an ``INSERT ... SELECT ... FROM input('<structure>')
... FORMAT X`` whose data is the body, the statement kind, a trailing ``FORMAT`` clause;
splitting URL parameters into HTTP-interface parameters, engine settings and
``param_<name>`` bindings for ``{name:Type}`` placeholders; quoting values and identifiers.

Invariants: scanning never consumes more than it is given and says "undecided" (``False``)
rather than guessing when the bytes end early; quotes and comments are skipped, so words
inside them never count; HTTP-interface parameters and HTTP-only settings never reach the
engine as settings.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

from txsink.embedded.http_errors import SYNTAX_ERROR, HttpError
from txsink.names import quote_literal as sql_string

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
# Real settings that only steer the HTTP layer: the handler acts on them, never the engine.
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
    n = len(buf)
    first = True
    try:
        for start, end in _lexemes(buf, complete=False):
            m = _WORD.match(buf, start, end)
            if m is None or m.end() != end:
                continue  # a quoted literal or another character
            word = m.group().upper()
            if first:
                if word != b"INSERT":
                    return None
                first = False
            elif word in (b"VALUES", b"SELECT", b"WITH"):
                return None
            elif word == b"FORMAT":
                fpos = end
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
                    sql = buf[:start].decode()
                except UnicodeDecodeError:
                    return None
                return InsertHeader(sql, fm.group().decode(), data)
    except _Unclosed:
        return False
    return False


@dataclass(frozen=True)
class InputInsert:
    """``INSERT ... SELECT ... FROM input('<structure>') ... FORMAT <fmt>``: the body is
    the data ``input()`` reads, in format ``fmt``."""

    before: str  # the statement up to ``input``
    structure: str  # input()'s string literal as written, quotes and escapes included
    after: str  # from after input(...) up to the FORMAT clause (WHERE, SETTINGS, ...)
    fmt: str

    def reading_file(self, path: str) -> str:
        """The statement with ``input(...)`` read from ``file(path, fmt, structure)`` and
        without its FORMAT clause (``path`` must hold no glob characters)."""
        source = f"file({sql_string(path)}, {sql_string(self.fmt)}, {self.structure})"
        return f"{self.before}{source}{self.after}".rstrip()


_INPUT_SHAPE = (
    "INSERT INTO t (cols) SELECT cols FROM input('<col Type, ...>') [WHERE ...] FORMAT <name>"
)


class _Unclosed(Exception):
    """A quote or comment of the buffer is not closed (yet)."""


def _lexemes(buf: bytes, *, complete: bool) -> Iterator[tuple[int, int]]:
    """(start, end) of each word, quoted literal and other character of ``buf``, skipping
    whitespace and comments; :class:`_Unclosed` when a quote or block comment is not
    closed, or (``complete`` false: more of the statement may follow) a line comment has
    no end of line yet."""
    pos, n = 0, len(buf)
    while pos < n:
        c = buf[pos]
        if c in _WS:
            pos += 1
        elif buf.startswith(b"--", pos) or c == 0x23:
            end = buf.find(b"\n", pos)
            if end < 0 and not complete:
                raise _Unclosed
            pos = n if end < 0 else end + 1
        elif buf.startswith(b"/*", pos):
            end = buf.find(b"*/", pos + 2)
            if end < 0:
                raise _Unclosed
            pos = end + 2
        else:
            if c in (0x27, 0x22, 0x60):
                end = _skip_quoted(buf, pos)
                if end < 0:
                    raise _Unclosed
            else:
                m = _WORD.match(buf, pos)
                end = m.end() if m is not None else pos + 1
            yield pos, end
            pos = end


def _token_spans(buf: bytes) -> list[tuple[int, int]] | None:
    """Every lexeme of a whole statement (:func:`_lexemes`); ``None`` when a quote or
    comment is not closed."""
    try:
        return list(_lexemes(buf, complete=True))
    except _Unclosed:
        return None


def scan_input_insert(sql: str) -> InputInsert | None:
    """``sql`` as an INSERT reading its data from ``input()``, or ``None`` when it is not one.

    ``sql`` is the whole statement (the ``query`` URL parameter; the body is the data).
    Raises :class:`HttpError` (SYNTAX_ERROR) for an INSERT calling ``input(`` in another
    shape than :data:`_INPUT_SHAPE`.
    """
    buf = sql.encode()
    spans = _token_spans(buf)
    if spans is None:
        return None
    toks = [buf[a:b] for a, b in spans]
    if not toks or toks[0].upper() != b"INSERT":
        return None
    calls = [
        i
        for i in range(1, len(toks) - 1)
        if toks[i].lower() == b"input" and toks[i + 1] == b"(" and toks[i - 1] != b"."
    ]
    if not calls:
        return None
    if len(calls) > 1:
        raise HttpError(
            SYNTAX_ERROR,
            f"An INSERT may read input() once; this one calls it {len(calls)} times. "
            f"The shape served: {_INPUT_SHAPE}",
        )
    i = calls[0]
    if i + 3 >= len(toks) or not toks[i + 2].startswith(b"'") or toks[i + 3] != b")":
        raise HttpError(
            SYNTAX_ERROR,
            f"input() takes one string literal, the structure of the data, as in {_INPUT_SHAPE}",
        )
    end = len(toks)
    while end > 0 and toks[end - 1] == b";":
        end -= 1
    fmt_at = end - 2
    if fmt_at <= i + 3 or toks[fmt_at].upper() != b"FORMAT" or not _WORD.fullmatch(toks[end - 1]):
        raise HttpError(
            SYNTAX_ERROR,
            "An INSERT reading input() needs a trailing FORMAT clause naming the format of "
            f"the request body, as in {_INPUT_SHAPE}",
        )
    return InputInsert(
        before=buf[: spans[i][0]].decode(),
        structure=toks[i + 2].decode(),
        after=buf[spans[i + 3][1] : spans[fmt_at][0]].decode(),
        fmt=toks[end - 1].decode(),
    )


def statement_kind(sql: str) -> str:
    m = _FIRST_WORD.match(sql)
    return m.group(1).upper() if m else ""


def format_clause(sql: str) -> str | None:
    """The format named by a ``FORMAT X`` clause at the end of ``sql``, if any."""
    match = _FORMAT_AT_END.search(sql)
    return match.group(1) if match else None


def split_params(params: dict[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """(engine settings, ``param_<name>`` bindings by name) from a request's parameters."""
    binds = {k[6:]: v for k, v in params.items() if k.startswith("param_")}
    settings = {
        k: v
        for k, v in params.items()
        if k not in HTTP_ONLY_PARAMS and k not in HTTP_SETTINGS and not k.startswith("param_")
    }
    return settings, binds
