"""What the embedded endpoint's responses say, independent of the HTTP plumbing.

Owns the ClickHouse-shaped content of a reply: the ``X-ClickHouse-Summary`` of an insert
or a query, the ``Content-Type`` of an output format, which formats may be streamed as
concatenated chunks, the text of an error body, and the fields of a
``multipart/form-data`` request. :mod:`~txsink.embedded.server` sends them.

Invariant: nothing here touches a socket, a connection or a session: every function
reads only its arguments, so a response's shape can be checked without a server.
"""

from __future__ import annotations

import email.parser
import email.policy
from typing import Any

from txsink.embedded.http_errors import ERROR_NAMES, NOT_IMPLEMENTED, HttpError

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
# A streamed query's summary: its headers go out before any row is read.
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


def insert_summary(rows: int, size: int, elapsed_s: float) -> dict[str, str]:
    """The summary of an insert of ``rows`` rows, ``size`` bytes (as ClickHouse reports
    it: the rows read from the body are the rows written)."""
    return {
        "read_rows": str(rows),
        "read_bytes": str(size),
        "written_rows": str(rows),
        "written_bytes": str(size),
        "total_rows_to_read": "0",
        "result_rows": str(rows),
        "result_bytes": str(size),
        "elapsed_ns": str(int(elapsed_s * 1e9)),
    }


def query_summary(result: Any, result_bytes: int, elapsed_s: float) -> dict[str, str]:
    """The summary of a buffered query from chdb's result counters."""
    return {
        "read_rows": str(result.rows_read()),
        "read_bytes": str(result.bytes_read()),
        "written_rows": str(result.rows_written()),
        "written_bytes": str(result.bytes_written()),
        "total_rows_to_read": str(result.rows_read()),
        "result_rows": str(result.rows_read()),
        "result_bytes": str(result_bytes),
        "elapsed_ns": str(int(elapsed_s * 1e9)),
    }


def content_type_for(fmt: str) -> str:
    low = fmt.lower()
    if low.startswith(("tabseparated", "tsv")):
        return "text/tab-separated-values; charset=UTF-8"
    if low.startswith("csv"):
        return "text/csv; charset=UTF-8; header=absent"
    if low.startswith("json"):
        return "application/json; charset=UTF-8"
    return "application/octet-stream"


def error_body(err: HttpError, version: str) -> bytes:
    """``Code: N. DB::Exception: ... (NAME) (version V)``: the body clients parse the
    code and name from (an engine error already carries its ``Code:`` prefix)."""
    message = str(err)
    if not message.startswith("Code:"):
        name = ERROR_NAMES.get(err.code, "UNKNOWN_EXCEPTION")
        message = f"Code: {err.code}. DB::Exception: {message}. ({name})"
    return f"{message} (version {version})\n".encode()


def form_fields(content_type: str, raw: bytes) -> dict[str, str]:
    """The named fields of a ``multipart/form-data`` body (the query, settings);
    external data tables (fields with a file name) are refused."""
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
