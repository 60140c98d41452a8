"""Credentials: where they may come from, and the one place they are kept out of text.

Owns the rules for the ClickHouse user/password and the Keeper digest ``user:password``:

- A URL may carry userinfo (``http://user:pass@host:port``). It is split off once, where
  the URL enters txsink (:func:`merge_url_credentials`): from then on the URL is
  ``scheme://host:port`` and the secret travels only in the ``password`` field.
- An explicit ``user``/``password`` and the URL's userinfo must agree: a difference is a
  :class:`ConfigError` (which names the option, never the value). Silently preferring one
  would let a stale secret in an environment variable win without anyone noticing.
- Secrets never reach a message: :func:`scrub` replaces every known secret and every URL
  userinfo in a text; :func:`redact_url` shows a URL without its userinfo.
- Secrets never need the command line: :func:`read_secret_file` reads the first line of a
  file (``--password-file``, ``--keeper-auth-file``).

Pure apart from reading a secret file; no txsink module below this one.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit, urlunsplit

from txsink.errors import ConfigError

MASK = "***"
# scheme://userinfo@ anywhere in a text (also inside a URL that does not parse).
_USERINFO_RE = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)[^/@\s'\"]*@")


@dataclass(frozen=True)
class UrlCredentials:
    """A URL without userinfo and what its userinfo held (None where absent)."""

    url: str
    user: str | None
    password: str | None


def redact_url(url: str) -> str:
    """``url`` with any userinfo replaced by ``***`` (safe to show; works on bad URLs too)."""
    return _USERINFO_RE.sub(lambda m: f"{m.group('scheme')}{MASK}@", url)


def split_url(url: str) -> UrlCredentials:
    """Split ``http://user:pass@host:port`` into the bare URL and the credentials.

    Userinfo is percent-decoded (``p%40ss`` is ``p@ss``), as RFC 3986 requires.
    """
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return UrlCredentials(url, None, None)
    userinfo, _, hostport = parts.netloc.rpartition("@")
    user, colon, password = userinfo.partition(":")
    bare = urlunsplit((parts.scheme, hostport, parts.path, parts.query, parts.fragment))
    return UrlCredentials(bare, unquote(user) or None, unquote(password) if colon else None)


def merge_url_credentials(
    url: str, user: str | None, password: str | None, *, where: str = "option"
) -> UrlCredentials:
    """The bare URL and the user/password to use, from explicit values and URL userinfo.

    ``user``/``password`` are None when not given. A value given both ways must be equal;
    otherwise ConfigError naming the two sources (``where`` says "option" or "flag").
    """
    found = split_url(url)
    for name, explicit, in_url in (
        ("user", user, found.user),
        ("password", password, found.password),
    ):
        if explicit is not None and in_url is not None and explicit != in_url:
            raise ConfigError(
                f"{where} {name!r} and the {name} in the userinfo of url {redact_url(url)!r} "
                f"differ; give the {name} one way only (preferably the {name} {where}, "
                f"or $TXSINK_PASSWORD / a password file, and a url without userinfo)"
            )
    return UrlCredentials(
        found.url,
        user if user is not None else found.user,
        password if password is not None else found.password,
    )


def secrets_of(*values: str | None) -> tuple[str, ...]:
    """The non-trivial secrets among ``values``; a Keeper ``user:password`` also yields its
    password part (a message may hold either)."""
    out: list[str] = []
    for value in values:
        if not value:
            continue
        out.append(value)
        _, colon, tail = value.partition(":")
        if colon and tail:
            out.append(tail)
    # Longest first, so "user:pw" is replaced whole before "pw" is.
    return tuple(sorted({s for s in out if len(s) >= 3}, key=len, reverse=True))


def scrub(text: str, secrets: Iterable[str] = ()) -> str:
    """``text`` without URL userinfo and without any of ``secrets`` (see :func:`secrets_of`).

    Secrets shorter than 3 characters are not replaced (they would mangle every message);
    such passwords are not worth keeping secret anyway.
    """
    text = redact_url(text)
    for secret in sorted(secrets, key=len, reverse=True):
        if len(secret) >= 3:
            text = text.replace(secret, MASK)
    return text


def read_secret_file(path: str, *, flag: str) -> str:
    """The first line of ``path`` without its line end (``--password-file``)."""
    try:
        with Path(path).open(encoding="utf-8") as fh:
            return fh.readline().rstrip("\r\n")
    except OSError as exc:
        raise ConfigError(
            f"{flag} {path}: cannot read it ({exc.strerror or type(exc).__name__}); give a "
            f"readable file whose first line is the secret"
        ) from None
