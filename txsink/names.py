"""Table names and server URLs: the one parser of each, and SQL quoting of identifiers.

Owns what a ``db.table`` string and a ClickHouse URL may look like, for every caller (the
writer options, the ClickHouse client, the Spark layer, the CLI). Invariants:

- :func:`split_table` accepts exactly two dot-separated parts, each a plain identifier
  (``[A-Za-z_][A-Za-z0-9_]*``) or backquoted (inside backquotes, a backslash or a
  doubled backquote escapes a backquote; dots and spaces are plain characters); anything
  else is a :class:`ConfigError` naming the option;
- :func:`parse_url` accepts ``http(s)://[userinfo@]host[:port][/]`` (and ``chdb:...``
  only where the caller allows it); the :class:`Endpoint` it returns never holds the
  userinfo, and no error text shows it;
- identifiers reaching SQL pass :func:`quote_ident`.

Pure: the standard library, :mod:`txsink.errors` and :mod:`txsink.credentials` (masking).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import urlsplit

from txsink.credentials import redact_url
from txsink.errors import ConfigError

_IDENT_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
DEFAULT_PORTS = {"http": 8123, "https": 8443}

# --------------------------------------------------------------------------- identifiers


def quote_ident(name: str) -> str:
    """Backquote a ClickHouse identifier (escaping backslashes and backquotes).

    Not clickhouse-connect's ``quote_identifier``: it passes a name that already looks
    quoted through as it is, so a table whose name has backquotes around it would be
    read as another table."""
    if not name:
        raise ConfigError("an empty identifier is not a valid ClickHouse name")
    return "`" + name.replace("\\", "\\\\").replace("`", "\\`") + "`"


def quote_literal(value: str) -> str:
    """A single-quoted ClickHouse string literal.

    Not clickhouse-connect's ``format_str`` (the same escaping of backslash and quote):
    importing it loads the whole client driver (0.35 s here), and this module serves
    the options parser and the CLI's start too."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def qualified(db: str, table: str) -> str:
    """```db`.`table``` with both parts quoted."""
    return f"{quote_ident(db)}.{quote_ident(table)}"


def split_table(name: str, *, option: str = "table") -> tuple[str, str]:
    """``"db.table"`` -> ``("db", "table")``; ConfigError naming ``option`` otherwise.

    Names may be backquoted (``"`my db`.`t`"``, ``"db.`odd``name`"``); unquoted parts
    must be plain identifiers.
    """
    parts = _split_dotted(name)
    if parts is None or len(parts) != 2 or not all(parts):
        raise ConfigError(
            f"option {option}={name!r} is not of the form db.table (for example "
            f"analytics.events); quote names with backquotes if they contain dots"
        )
    return parts[0], parts[1]


def _split_dotted(name: str) -> list[str] | None:
    """The parts of a dotted name with backquotes resolved; None when it does not parse."""
    out: list[str] = []
    s = name.strip()
    n = len(s)
    i = 0
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
            if j >= n:  # no closing backquote
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
            if i == n:  # a trailing dot
                return None
    return out


# --------------------------------------------------------------------------- urls


@dataclass(frozen=True)
class Endpoint:
    """A validated server address. ``dsn`` is the URL as given (chdb) or
    ``scheme://host:port`` as given, never with userinfo; ``port`` is filled in from
    the scheme's default when the URL has none."""

    scheme: str  # http | https | chdb
    host: str
    port: int
    dsn: str

    @property
    def secure(self) -> bool:
        return self.scheme == "https"


def parse_url(
    url: str, *, option: str = "url", allow_chdb: bool = False, userinfo: bool = True
) -> Endpoint:
    """Validate ``http(s)://[user[:pass]@]host[:port][/]``; ConfigError naming ``option``
    (userinfo masked) otherwise.

    ``allow_chdb``: ``chdb:...`` (clickhouse-connect's in-process engine, tests only) is
    accepted as it is. ``userinfo=False`` refuses a URL carrying credentials (shard URLs:
    credentials go in user/password). The endpoint never holds the userinfo: see
    :func:`txsink.credentials.merge_url_credentials` for where it goes.
    """
    raw = (url or "").strip()
    if allow_chdb and raw.startswith("chdb:"):
        return Endpoint("chdb", "", 0, raw)
    shown = redact_url(raw)
    try:
        parsed = urlsplit(raw)
        port = parsed.port
    except ValueError:
        raise ConfigError(f"option {option!r}: {shown!r} has an invalid port") from None
    if parsed.scheme not in DEFAULT_PORTS or not parsed.hostname:
        raise ConfigError(
            f"option {option!r}: got {shown!r}, which does not look like http(s)://host:port "
            f"(for example http://127.0.0.1:8123; the embedded stack prints it with "
            f"`txsink embedded up`)"
        )
    if parsed.path not in ("", "/") or parsed.query or parsed.fragment:
        raise ConfigError(
            f"option {option!r}: {shown!r}: give only scheme, host and port; pass the database "
            f"through the table option"
        )
    if "@" in parsed.netloc and not userinfo:
        raise ConfigError(
            f"option {option}: give credentials with user/password (they apply to every "
            f"server), not inside the URL {shown!r}"
        )
    hostport = parsed.netloc.rpartition("@")[2]
    return Endpoint(
        parsed.scheme,
        parsed.hostname,
        port or DEFAULT_PORTS[parsed.scheme],
        f"{parsed.scheme}://{hostport}",
    )
