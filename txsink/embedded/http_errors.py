"""ClickHouse-style errors of the embedded endpoint: codes, names, HTTP statuses.

Owns the error vocabulary shared by the request parser, the engine and the HTTP handler:
the ClickHouse error codes the endpoint raises itself, their names and HTTP statuses, and
:func:`engine_error`, which turns a chdb exception into the same shape.

Invariants: every failure meant for the client is an :class:`HttpError` carrying a
ClickHouse code and the HTTP status the real server would use for it (500 unless mapped);
:class:`ClientGone` means nothing can be answered at all.
"""

from __future__ import annotations

import re

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
TOO_MANY_PARTS = 252
TABLE_IS_READ_ONLY = 242
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
