"""ClickHouse and transport errors, classified and mapped into :mod:`txsink.errors`.

Owned by the ClickHouse adapter. Invariants:

- a server error keeps its numeric code in ``.code`` (parsed from ``Code: N.`` when the
  driver did not fill it in);
- :func:`classify` says whether a failed call may be repeated: *rejected* errors (nothing
  happened on the server) always, *ambiguous* ones (a timeout or reset after the request
  was sent) only for idempotent operations, everything else never;
- no message made here holds a password or URL userinfo: every server/driver text passes
  :func:`txsink.credentials.scrub`.

Pure: imports neither clickhouse-connect nor urllib3 (it reads errors by code and text).
"""

from __future__ import annotations

import enum
import re

from txsink.credentials import scrub
from txsink.errors import (
    ConfigError,
    FencedError,
    RetryableConflict,
    TxSinkError,
    UnavailableError,
)

# ClickHouse error codes that matter here.
UNKNOWN_TABLE = 60
UNKNOWN_DATABASE = 81
CANNOT_GET_CREATE_TABLE_QUERY = 390  # CREATE TABLE x AS <missing table>
TOO_MANY_SIMULTANEOUS_QUERIES = 202
SOCKET_TIMEOUT = 209
NETWORK_ERROR = 210
TIMEOUT_EXCEEDED = 159
TOO_MANY_PARTS = 252  # also "Too many partitions for single INSERT block": see below
ACCESS_DENIED = 497
AUTHENTICATION_FAILED = 516
REQUIRED_PASSWORD = 194
TABLE_IS_READ_ONLY = 242
TOO_FEW_LIVE_REPLICAS = 285
UNKNOWN_STATUS_OF_INSERT = 319
THROW_IF = 395  # FUNCTION_THROW_IF_VALUE_IS_NON_ZERO: a guarded dedup insert refused
# The messages of a guarded dedup insert's server-side checks (clickhouse/dedup_insert.py)
SEALED_MARK = "txsink-sealed"
WINDOW_MARK = "txsink-window"

# Rejected before any work was done: always safe to retry.
_REJECTED_CODES = frozenset(
    {TOO_MANY_SIMULTANEOUS_QUERIES, TOO_MANY_PARTS, TABLE_IS_READ_ONLY, TOO_FEW_LIVE_REPLICAS}
)
# The request may or may not have taken effect: retry only idempotent operations.
_AMBIGUOUS_CODES = frozenset(
    {SOCKET_TIMEOUT, NETWORK_ERROR, TIMEOUT_EXCEEDED, UNKNOWN_STATUS_OF_INSERT}
)
_AUTH_CODES = frozenset({ACCESS_DENIED, AUTHENTICATION_FAILED, REQUIRED_PASSWORD})

_CODE_RE = re.compile(r"\bCode:\s*(\d+)\.")
# Code 252 is shared: "Too many parts" is back-pressure (merges catch up, a retry can
# pass), "Too many partitions for single INSERT block" refuses the block's content itself
# and fails the same way on every retry until max_partitions_per_insert_block is raised.
_TOO_MANY_PARTITIONS_RE = re.compile(
    r"Too many partitions for (?:a )?single INSERT block|max_partitions_per_insert_block",
    re.IGNORECASE,
)
_REFUSED_RE = re.compile(
    r"Connection refused|Failed to establish a new connection|Name or service not known|"
    r"nodename nor servname|No route to host|ConnectTimeout|connect timeout",
    re.IGNORECASE,
)
_AMBIGUOUS_RE = re.compile(
    r"Read timed out|timed out|Connection reset|Connection aborted|RemoteDisconnected|"
    r"Broken pipe|IncompleteRead|ProtocolError",
    re.IGNORECASE,
)


class Transience(enum.Enum):
    """How safe a failed call is to repeat."""

    PERMANENT = "permanent"  # retrying cannot help
    REJECTED = "rejected"  # nothing happened on the server (refused, busy): always retry
    AMBIGUOUS = "ambiguous"  # may have landed: retry only idempotent operations


# --------------------------------------------------------------------------- error mapping


def error_code(exc: BaseException) -> int | None:
    code = getattr(exc, "code", None)
    if isinstance(code, int):
        return code
    m = _CODE_RE.search(str(exc))
    return int(m.group(1)) if m else None


def classify(exc: BaseException) -> Transience:
    """Whether a clickhouse-connect (or transport) error is worth retrying."""
    if isinstance(exc, TxSinkError):
        return Transience.PERMANENT
    code = error_code(exc)
    if too_many_partitions(exc):
        return Transience.PERMANENT
    if code in _REJECTED_CODES:
        return Transience.REJECTED
    if code in _AMBIGUOUS_CODES:
        return Transience.AMBIGUOUS
    if code is not None:
        return Transience.PERMANENT
    text = _chain_text(exc)
    if _REFUSED_RE.search(text):
        return Transience.REJECTED
    if _AMBIGUOUS_RE.search(text) or isinstance(exc, (ConnectionError, TimeoutError)):
        return Transience.AMBIGUOUS
    return Transience.PERMANENT


def too_many_partitions(exc: BaseException) -> bool:
    """Whether ``exc`` is ClickHouse's refusal of a block spanning more partitions than
    ``max_partitions_per_insert_block`` (code 252, told from TOO_MANY_PARTS by its text)."""
    return error_code(exc) == TOO_MANY_PARTS and bool(
        _TOO_MANY_PARTITIONS_RE.search(_chain_text(exc))
    )


def _chain_text(exc: BaseException) -> str:
    parts = []
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        parts.append(f"{type(cur).__name__}: {cur}")
        cur = cur.__cause__ or cur.__context__
    return " | ".join(parts)


def short_text(exc: BaseException, limit: int = 300, secrets: tuple[str, ...] = ()) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    text = scrub(text, secrets)
    return text if len(text) <= limit else text[:limit] + "..."


#: what a transport failure's wall of urllib3 text comes down to (first match wins)
_TRANSPORT_CAUSES = (
    ("Connection refused", "connection refused (nothing listens on that port)"),
    ("Failed to resolve", "unknown host (the name does not resolve)"),
    ("Name or service not known", "unknown host"),
    ("nodename nor servname", "unknown host"),
    ("Temporary failure in name resolution", "the host name does not resolve"),
    ("timed out", "timed out"),
    ("Connection reset", "connection reset"),
    ("RemoteDisconnected", "the server closed the connection"),
)


def transport_cause(detail: str) -> str:
    """The cause of a transport failure in a few words (``detail`` itself when unknown)."""
    return next((short for needle, short in _TRANSPORT_CAUSES if needle in detail), detail)


def map_error(
    exc: BaseException,
    *,
    url: str,
    what: str,
    table: str | None = None,
    secrets: tuple[str, ...] = (),
) -> TxSinkError:
    """Translate a clickhouse-connect/transport error into the txsink hierarchy.

    ``what`` says what was being done ("MOVE PARTITION 202401 of ..."), ``table`` names
    the table the operator should look at. ``secrets`` (the password) and any URL
    userinfo are masked in the message.
    """
    if isinstance(exc, TxSinkError):
        return exc
    code = error_code(exc)
    detail = short_text(exc, secrets=secrets)
    url = scrub(url, secrets)
    if code in (UNKNOWN_TABLE, CANNOT_GET_CREATE_TABLE_QUERY):
        name = table or _quoted_name(detail) or "the table"
        return ConfigError(
            f"table {name} does not exist on {url} ({what}); create it, or fix the table "
            f"option: {detail}",
            code=code,
        )
    if code == UNKNOWN_DATABASE:
        name = table or "the table"
        return ConfigError(
            f"the database of {name} does not exist on {url} ({what}); create it first: {detail}",
            code=code,
        )
    if code == THROW_IF and SEALED_MARK in detail:
        return FencedError(
            f"{what} on {url} was refused by the server: its batch was sealed by a commit "
            "(this task attempt outlived its batch; nothing of the block was written)",
            code=code,
        )
    if code == THROW_IF and WINDOW_MARK in detail:
        return RetryableConflict(
            f"{what} on {url} was refused by the server: the target's dedup window moved "
            f"since the task checked it (other writers inserted parts meanwhile); nothing "
            f"of the block was written and the task is retried: {detail}",
            code=code,
        )
    if code in _AUTH_CODES:
        return ConfigError(
            f"ClickHouse at {url} refused {what}: check user/password options and the "
            f"user's grants: {detail}",
            code=code,
        )
    if too_many_partitions(exc):
        return ConfigError(
            f"ClickHouse at {url} refused {what}: the block spans more target partitions "
            f"than the max_partitions_per_insert_block setting allows (code {code}; not "
            f"back-pressure: a retry fails the same way). txsink lifts that setting for "
            f"its own inserts (max_partitions_per_insert_block=0), so the writer's user "
            f"cannot change it (a settings constraint or readonly profile?): allow it in "
            f"the user's profile, or write fewer partitions per Spark partition "
            f"(docs/operations.md#too-many-partitions): {detail}",
            code=code,
        )
    if "CERTIFICATE_VERIFY_FAILED" in detail or "certificate verify failed" in detail:
        return ConfigError(
            f"ClickHouse at {url} failed {what}: the server's TLS certificate verify failed; "
            f"name the CA that signed it (--ca-cert PATH, option ca_cert), or for a test "
            f"server only turn the check off (--no-verify, option verify=false): {detail}"
        )
    kind = classify(exc)
    if code is None and kind is not Transience.PERMANENT:
        return UnavailableError(
            f"ClickHouse at {url} is unreachable or timed out during {what}; check that "
            f"the server runs (embedded stack: `txsink embedded status`) and the url "
            f"option, then retry: {transport_cause(detail)}",
        )
    if kind is not Transience.PERMANENT:
        return RetryableConflict(
            f"ClickHouse at {url} is busy (code {code}) during {what}; retry later or "
            f"raise the retry options: {detail}",
            code=code,
        )
    return TxSinkError(f"ClickHouse at {url} failed {what}: {detail}", code=code)


def _quoted_name(detail: str) -> str | None:
    m = re.search(r"[Tt]able (?:expression identifier )?'?`?([\w.]+)", detail)
    if m and m.group(1) not in ("does",):
        return m.group(1)
    m = re.search(r"find table: ([\w.]+)", detail)
    return m.group(1) if m else None
