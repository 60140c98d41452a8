"""The one door to ClickHouse: connect, run, map errors, retry what is safe to retry.

Owned by the ClickHouse adapter. Everything above this module sees only
:mod:`txsink.errors`; clickhouse-connect and urllib3 exceptions never escape. Invariants:

- errors are classified and mapped in :mod:`txsink.clickhouse.error_map` (a server error
  keeps its code) and retried per :class:`~txsink.clickhouse.retry.RetryPolicy`: an
  error whose outcome is unknown only for operations the caller declares idempotent (a
  blind retry of a staging insert could stage a block twice);
- URLs and ``db.table`` strings are validated by :mod:`txsink.names` (the one parser of
  each), identifiers reaching SQL pass :func:`quote_ident`;
- no message or log line made here holds the password or URL userinfo: a URL's userinfo
  is split off in :func:`connect` and every server/driver text is scrubbed.

Error mapping lives in :mod:`.error_map`, retry policy in :mod:`.retry`.
``chdb://...`` URLs open clickhouse-connect's in-process engine (tests of pure
ClickHouse behaviour only; the product always talks HTTP).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import clickhouse_connect
from clickhouse_connect.driver import exceptions as ch_exc
from clickhouse_connect.driver.query import arrow_buffer

from txsink.clickhouse.error_map import (
    map_error,
)
from txsink.clickhouse.insert_settings import SettingValue
from txsink.clickhouse.retry import RetryPolicy
from txsink.credentials import merge_url_credentials, redact_url, secrets_of
from txsink.names import parse_url

__all__ = [
    "Client",
    "ConnectSettings",
    "connect",
]

log = logging.getLogger(__name__)
T = TypeVar("T")


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
        # what this process learned of the server's behaviour, and when (time.monotonic),
        # e.g. the staging's "keeps_staging_settings" (txsink.clickhouse.staging.Stager)
        self.facts: dict[str, float] = {}

    def __repr__(self) -> str:
        return f"Client({self.url!r})"

    def _call(
        self,
        fn: Callable[[], T],
        *,
        what: str,
        idempotent: bool,
        table: str | None,
        resend_ok: Callable[[], bool] | None = None,
    ) -> T:
        try:
            return self.retry.run(
                fn, idempotent=idempotent, what=what, secrets=self._secrets, resend_ok=resend_ok
            )
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
        resend_ok: Callable[[], bool] | None = None,
    ) -> Any:
        """Insert one Arrow table as one block; retried on ambiguous errors only if
        ``idempotent`` (for example the block carries an ``insert_deduplication_token``
        and the table deduplicates), and only while ``resend_ok()`` says so."""
        return self._call(
            lambda: self.raw.insert_arrow(
                table, arrow_table, database=db, settings=dict(settings) if settings else None
            ),
            what=f"INSERT of {arrow_table.num_rows} rows into {db}.{table}",
            idempotent=idempotent,
            table=f"{db}.{table}",
            resend_ok=resend_ok,
        )

    def insert_arrow_sql(
        self,
        sql: str,
        arrow_table: Any,
        *,
        settings: Mapping[str, Any] | None = None,
        idempotent: bool = False,
        resend_ok: Callable[[], bool] | None = None,
        table: str | None = None,
    ) -> Any:
        """Run ``sql`` (an ``INSERT ... SELECT ... FROM input(...) FORMAT Arrow``) with the
        Arrow table as its data; retried as :meth:`insert_arrow` is."""
        body: Any = arrow_buffer(arrow_table)[1]  # a pyarrow Buffer
        return self._call(
            lambda: self.raw.command(
                sql, data=bytes(body), settings=dict(settings) if settings else None
            ),
            what=f"INSERT of {arrow_table.num_rows} rows into {table}",
            idempotent=idempotent,
            table=table,
            resend_ok=resend_ok,
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

    def setting_names(self) -> list[str]:
        """Every setting name the server has (for a did-you-mean on an unknown one)."""
        rows = self.query_rows(
            "SELECT name FROM system.settings",
            what="list the server's settings (system.settings)",
        )
        return [str(r[0]) for r in rows]

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
    ep = parse_url(url, allow_chdb=True)
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


@dataclass(frozen=True)
class ConnectSettings:
    """How a client reaches its server: TLS and timeouts (the writer options and CLI
    flags of the same names; the defaults are theirs, a unit test keeps them equal)."""

    verify: bool = True
    ca_cert: str = ""  # empty: the system's CA bundle
    connect_timeout: float = 10
    send_receive_timeout: float = 300

    def connect(self, url: str, user: str | None = None, password: str | None = None) -> Client:
        """:func:`connect` with these settings."""
        return connect(
            url,
            user,
            password,
            verify=self.verify,
            ca_cert=self.ca_cert or None,
            connect_timeout=self.connect_timeout,
            send_receive_timeout=self.send_receive_timeout,
        )
