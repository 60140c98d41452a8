"""The one door to ClickHouse: connect, run, map errors, retry what is safe to retry.

Owned by the ClickHouse adapter. Everything above this module sees only
:mod:`txsink.errors`; clickhouse-connect and urllib3 exceptions never escape. Invariants:

- a server error keeps its numeric code in ``.code`` (parsed from ``Code: N.`` when the
  driver did not fill it in);
- only *classified* transient errors are retried, and an error whose outcome is unknown
  (a timeout or reset after the request was sent) is retried only for operations the
  caller declares idempotent: a blind retry of a staging insert could stage a block twice;
- identifiers reaching SQL pass :func:`quote_ident`; ``db.table`` strings pass
  :func:`split_table`;
- no message or log line made here holds the password or URL userinfo: a URL's userinfo
  is split off in :func:`connect` and every server/driver text passes
  :func:`txsink.credentials.scrub` in :func:`map_error` and in the retry log.

``chdb://...`` URLs open clickhouse-connect's in-process engine (tests of pure ClickHouse
behaviour only; the product always talks HTTP).
"""

from __future__ import annotations

import enum
import logging
import re
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import urlparse

import clickhouse_connect
import tenacity
from clickhouse_connect.driver import exceptions as ch_exc

from txsink.clickhouse.compat import SettingValue
from txsink.credentials import merge_url_credentials, redact_url, scrub, secrets_of
from txsink.errors import ConfigError, RetryableConflict, TxSinkError, UnavailableError

log = logging.getLogger(__name__)
T = TypeVar("T")

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
CLUSTER_DOESNT_EXIST = 701

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
_IDENT_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
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


# --------------------------------------------------------------------------- identifiers


def quote_ident(name: str) -> str:
    """Backquote a ClickHouse identifier (escaping backslashes and backquotes)."""
    if not name:
        raise ConfigError("an empty identifier is not a valid ClickHouse name")
    return "`" + name.replace("\\", "\\\\").replace("`", "\\`") + "`"


def quote_literal(value: str) -> str:
    """A single-quoted ClickHouse string literal."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def split_table(name: str, *, option: str = "table") -> tuple[str, str]:
    """``"db.table"`` -> ``("db", "table")``; ConfigError naming the bad value otherwise.

    Names may be backquoted (``"`my db`.`t`"``); unquoted parts must be plain identifiers.
    """
    parts = _split_dotted(name)
    if parts is None or len(parts) != 2 or not all(parts):
        raise ConfigError(
            f"option {option}={name!r} is not of the form db.table (for example "
            f"analytics.events); quote names with backquotes if they contain dots"
        )
    return parts[0], parts[1]


def qualified(db: str, table: str) -> str:
    return f"{quote_ident(db)}.{quote_ident(table)}"


def _split_dotted(name: str) -> list[str] | None:
    out: list[str] = []
    i = 0
    n = len(name.strip())
    s = name.strip()
    while i < n:
        if s[i] == "`":
            j = i + 1
            buf: list[str] = []
            while j < n:
                if s[j] == "\\" and j + 1 < n:
                    j += 1
                elif s[j] == "`":
                    if j + 1 < n and s[j + 1] == "`":  # doubled backquote
                        j += 1
                    else:
                        break
                buf.append(s[j])
                j += 1
            if j >= n:
                return None
            out.append("".join(buf))
            i = j + 1
        else:
            j = s.find(".", i)
            j = n if j < 0 else j
            part = s[i:j]
            if not _IDENT_RE.match(part):
                return None
            out.append(part)
            i = j
        if i < n:
            if s[i] != ".":
                return None
            i += 1
            if i == n:
                return None
    return out


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


def _short(exc: BaseException, limit: int = 300, secrets: tuple[str, ...] = ()) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    text = scrub(text, secrets)
    return text if len(text) <= limit else text[:limit] + "..."


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
    detail = _short(exc, secrets=secrets)
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
    kind = classify(exc)
    if code is None and kind is not Transience.PERMANENT:
        return UnavailableError(
            f"ClickHouse at {url} is unreachable or timed out during {what}; check that "
            f"the server runs (embedded stack: `txsink embedded status`) and the url "
            f"option, then retry: {detail}",
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


# --------------------------------------------------------------------------- retry policy

OPT_RETRY_ATTEMPTS = "clickhouse_retry_attempts"
DEFAULT_RETRY_ATTEMPTS = 5
OPT_RETRY_MAX_WAIT = "clickhouse_retry_max_wait_s"
DEFAULT_RETRY_MAX_WAIT = 10.0


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how long to retry classified transient errors.

    ``sleep`` is injectable (tests pass a recorder); ``attempts`` counts the first try.
    """

    attempts: int = DEFAULT_RETRY_ATTEMPTS
    max_wait: float = DEFAULT_RETRY_MAX_WAIT
    initial_wait: float = 0.2
    sleep: Callable[[float], None] = time.sleep

    @classmethod
    def from_options(
        cls, options: Mapping[str, str], *, sleep: Callable[[float], None] = time.sleep
    ) -> RetryPolicy:
        try:
            attempts = int(options.get(OPT_RETRY_ATTEMPTS, DEFAULT_RETRY_ATTEMPTS))
        except ValueError:
            raise ConfigError(
                f"option {OPT_RETRY_ATTEMPTS}={options[OPT_RETRY_ATTEMPTS]!r} is not an integer"
            ) from None
        try:
            max_wait = float(options.get(OPT_RETRY_MAX_WAIT, DEFAULT_RETRY_MAX_WAIT))
        except ValueError:
            raise ConfigError(
                f"option {OPT_RETRY_MAX_WAIT}={options[OPT_RETRY_MAX_WAIT]!r} is not a number"
            ) from None
        if attempts < 1 or max_wait < 0:
            raise ConfigError(
                f"options {OPT_RETRY_ATTEMPTS}={attempts} / {OPT_RETRY_MAX_WAIT}={max_wait} "
                "must be >= 1 / >= 0"
            )
        return cls(attempts=attempts, max_wait=max_wait, sleep=sleep)

    def run(
        self, fn: Callable[[], T], *, idempotent: bool, what: str, secrets: tuple[str, ...] = ()
    ) -> T:
        """Call ``fn``, retrying classified transient errors (raw, unmapped) per policy."""

        def retryable(exc: BaseException) -> bool:
            kind = classify(exc)
            return kind is Transience.REJECTED or (kind is Transience.AMBIGUOUS and idempotent)

        def before_sleep(state: tenacity.RetryCallState) -> None:
            exc = state.outcome.exception() if state.outcome else None
            log.warning(
                "retrying %s after attempt %d/%d: %s",
                what,
                state.attempt_number,
                self.attempts,
                _short(exc, secrets=secrets) if exc else "?",
            )

        retrying = tenacity.Retrying(
            stop=tenacity.stop_after_attempt(self.attempts),
            wait=tenacity.wait_exponential_jitter(
                multiplier=self.initial_wait, max=self.max_wait, jitter=self.initial_wait
            ),
            retry=tenacity.retry_if_exception(retryable),
            sleep=self.sleep,
            before_sleep=before_sleep,
            reraise=True,
        )
        return retrying(fn)


NO_RETRY = RetryPolicy(attempts=1)


# --------------------------------------------------------------------------- client


class Client:
    """A clickhouse-connect client with txsink error mapping and retries.

    Only the handful of calls the warehouse needs; ``raw`` is the underlying client for
    tests. All methods raise only :class:`txsink.errors.TxSinkError` subclasses.
    """

    def __init__(
        self,
        raw: Any,
        url: str,
        retry: RetryPolicy | None = None,
        *,
        secrets: tuple[str, ...] = (),
    ) -> None:
        self.raw = raw
        self.url = redact_url(url)
        self.retry = retry or RetryPolicy()
        self._secrets = secrets
        self._known: dict[str, bool] = {}  # setting name -> the server has it

    def __repr__(self) -> str:
        return f"Client({self.url!r})"

    def _call(self, fn: Callable[[], T], *, what: str, idempotent: bool, table: str | None) -> T:
        try:
            return self.retry.run(fn, idempotent=idempotent, what=what, secrets=self._secrets)
        except (ch_exc.ClickHouseError, OSError) as exc:
            raise map_error(
                exc, url=self.url, what=what, table=table, secrets=self._secrets
            ) from exc

    def command(
        self,
        sql: str,
        *,
        parameters: Mapping[str, Any] | None = None,
        settings: Mapping[str, Any] | None = None,
        idempotent: bool = True,
        table: str | None = None,
        what: str | None = None,
    ) -> Any:
        return self._call(
            lambda: self.raw.command(
                sql,
                parameters=dict(parameters) if parameters else None,
                settings=dict(settings) if settings else None,
            ),
            what=what or _what(sql),
            idempotent=idempotent,
            table=table,
        )

    def query_rows(
        self,
        sql: str,
        *,
        parameters: Mapping[str, Any] | None = None,
        settings: Mapping[str, Any] | None = None,
        table: str | None = None,
        what: str | None = None,
    ) -> list[tuple[Any, ...]]:
        """Rows of a read-only query (always retried: reads are idempotent)."""
        result = self._call(
            lambda: self.raw.query(
                sql,
                parameters=dict(parameters) if parameters else None,
                settings=dict(settings) if settings else None,
            ),
            what=what or _what(sql),
            idempotent=True,
            table=table,
        )
        return [tuple(r) for r in result.result_rows]

    def insert_arrow(
        self,
        db: str,
        table: str,
        arrow_table: Any,
        *,
        settings: Mapping[str, Any] | None = None,
        idempotent: bool = False,
    ) -> Any:
        """Insert one Arrow table as one block; retried on ambiguous errors only if
        ``idempotent`` (for example the block carries an ``insert_deduplication_token``
        and the table deduplicates)."""
        return self._call(
            lambda: self.raw.insert_arrow(
                table, arrow_table, database=db, settings=dict(settings) if settings else None
            ),
            what=f"INSERT of {arrow_table.num_rows} rows into {db}.{table}",
            idempotent=idempotent,
            table=f"{db}.{table}",
        )

    def effective_settings(self, names: Iterable[str]) -> dict[str, SettingValue]:
        """The settings ``names`` as this connection's user has them (profile and server
        defaults applied), with their constraints; names the server does not know are
        absent. Remembers which names exist (see :meth:`known`)."""
        wanted = sorted(set(names))
        rows = self.query_rows(
            "SELECT name, value, changed, readonly, min, max "
            "FROM system.settings WHERE name IN {names:Array(String)}",
            parameters={"names": wanted},
            what="read the effective settings of the writer's user (system.settings)",
        )
        found = {
            str(n): SettingValue(str(n), str(v), bool(c), bool(ro), _opt(lo), _opt(hi))
            for n, v, c, ro, lo, hi in rows
        }
        self._known.update((n, n in found) for n in wanted)
        return found

    def known(self, settings: Mapping[str, Any], optional: Iterable[str]) -> dict[str, Any]:
        """``settings`` without the ``optional`` names this server does not know (older
        servers refuse an unknown setting; 26.x ones override older spellings, so they
        must be sent where they exist). One read of ``system.settings`` per client."""
        maybe = [n for n in optional if n in settings]
        unknown = [n for n in maybe if n not in self._known]
        if unknown:
            self.effective_settings(unknown)
        return {k: v for k, v in settings.items() if k not in maybe or self._known.get(k)}

    def ping(self) -> bool:
        try:
            return bool(self.raw.ping())
        except (ch_exc.ClickHouseError, OSError):
            return False

    def close(self) -> None:
        try:
            self.raw.close()
        except (ch_exc.ClickHouseError, OSError) as exc:
            log.debug("closing ClickHouse client %s: %s", self.url, exc)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _opt(value: Any) -> str | None:
    return None if value is None else str(value)


def _what(sql: str) -> str:
    flat = " ".join(sql.split())
    return flat if len(flat) <= 120 else flat[:117] + "..."


# --------------------------------------------------------------------------- connect


@dataclass(frozen=True)
class Endpoint:
    scheme: str  # http | https | chdb
    host: str
    port: int
    dsn: str  # the URL as given (chdb) or scheme://host:port (never userinfo)

    @property
    def secure(self) -> bool:
        return self.scheme == "https"


def parse_url(url: str) -> Endpoint:
    """Validate ``http(s)://[user[:pass]@]host[:port]`` (or ``chdb://...``); ConfigError
    naming it (userinfo masked). The endpoint never holds the userinfo: see
    :func:`txsink.credentials.merge_url_credentials` for where it goes."""
    raw = (url or "").strip()
    if raw.startswith("chdb:"):
        return Endpoint("chdb", "", 0, raw)
    shown = redact_url(url or "")
    parsed = urlparse(raw)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ConfigError(
            f"option url={shown!r} is not http(s)://host:port (for example "
            f"http://127.0.0.1:8123; the embedded stack prints it with `txsink embedded up`)"
        )
    if parsed.path not in ("", "/") or parsed.query:
        raise ConfigError(
            f"option url={shown!r}: give only scheme, host and port; pass the database "
            f"through the table option"
        )
    try:
        port = parsed.port or (8443 if parsed.scheme == "https" else 8123)
    except ValueError:
        raise ConfigError(f"option url={shown!r} has an invalid port") from None
    hostport = parsed.netloc.rpartition("@")[2]
    return Endpoint(parsed.scheme, parsed.hostname, port, f"{parsed.scheme}://{hostport}")


def connect(
    url: str,
    user: str | None = None,
    password: str | None = None,
    database: str | None = None,
    *,
    verify: bool = True,
    ca_cert: str | None = None,
    connect_timeout: float = 10,
    send_receive_timeout: float = 300,
    settings: Mapping[str, Any] | None = None,
    retry: RetryPolicy | None = None,
    compress: bool | str | None = True,
) -> Client:
    """Open a client; the handshake runs now, so a dead server fails here, clearly.

    ``https://`` turns TLS on (``verify``/``ca_cert`` apply); ``chdb://memory`` or
    ``chdb:///path`` opens the in-process engine (one per process; user/password ignored).
    ``compress`` is clickhouse-connect's (True, "lz4", "zstd", "gzip"; None/False = off).
    A URL with userinfo (``http://user:pass@host``) supplies user/password; given both
    ways, they must agree (ConfigError otherwise).
    """
    ep = parse_url(url)
    if ep.scheme != "chdb":
        creds = merge_url_credentials(url.strip(), user, password)
        user, password = creds.user, creds.password
    secrets = secrets_of(password)
    policy = retry or RetryPolicy()

    def open_raw() -> Any:
        if ep.scheme == "chdb":
            return clickhouse_connect.get_client(
                dsn=ep.dsn, database=database, settings=dict(settings or {})
            )
        return clickhouse_connect.get_client(
            host=ep.host,
            port=ep.port,
            interface=ep.scheme,
            secure=ep.secure,
            username=user or "default",
            password=password or "",
            database=database,
            verify=verify,
            ca_cert=ca_cert,
            connect_timeout=connect_timeout,
            send_receive_timeout=send_receive_timeout,
            settings=dict(settings or {}),
            compress=compress if compress is not None else False,
            query_retries=0,  # retries are ours, classified
            autogenerate_session_id=False,  # concurrent use from threads; no temp tables
        )

    shown = ep.dsn
    try:
        raw = policy.run(open_raw, idempotent=True, what=f"connect to {shown}", secrets=secrets)
    except (ch_exc.ClickHouseError, OSError) as exc:
        raise map_error(exc, url=shown, what="connect", table=None, secrets=secrets) from exc
    return Client(raw, shown, policy, secrets=secrets)
