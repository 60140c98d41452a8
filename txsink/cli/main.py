"""Entry point of the ``txsink`` console script.

Each command module exposes ``register(subparsers)`` which adds its parser and sets
``func(args, out) -> int``. Errors derived from :class:`txsink.errors.TxSinkError` map to
exit status 2 with the message (JSON ``{"error": ...}`` under ``--json``).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from dataclasses import dataclass

from txsink.cli.output import Output
from txsink.credentials import merge_url_credentials, read_secret_file, scrub, secrets_of
from txsink.errors import ConfigError, TxSinkError

DEFAULT_URL = "http://127.0.0.1:18123"
DEFAULT_KEEPER = "127.0.0.1:12181"
COMMAND_MODULES = (
    "txsink.cli.embedded_cmd",
    "txsink.cli.ops_cmd",
    "txsink.cli.demo_cmd",
    "txsink.cli.mode_cmd",
)


def add_common(parser: argparse.ArgumentParser, *, job: bool = True) -> None:
    """Flags shared by the commands that talk to a deployment."""
    parser.add_argument(
        "--url",
        default=os.environ.get("TXSINK_URL", DEFAULT_URL),
        help="ClickHouse HTTP URL (default: the embedded stack, or $TXSINK_URL)",
    )
    parser.add_argument(
        "--user",
        default=None,
        help="ClickHouse user (default: the url's userinfo, $TXSINK_USER, else 'default')",
    )
    secret = parser.add_mutually_exclusive_group()
    secret.add_argument(
        "--password-file",
        metavar="PATH",
        default=None,
        help="read the ClickHouse password from the first line of PATH",
    )
    secret.add_argument(
        "--password",
        default=None,
        help="ClickHouse password; VISIBLE to every local user in `ps`: prefer "
        "$TXSINK_PASSWORD or --password-file",
    )
    parser.add_argument(
        "--keeper-auth-file",
        metavar="PATH",
        default=None,
        help="Keeper digest credentials user:password from the first line of PATH "
        "(default: $TXSINK_KEEPER_AUTH; needed to change a job written with keeper_auth)",
    )
    parser.add_argument(
        "--keeper",
        default=os.environ.get("TXSINK_KEEPER", DEFAULT_KEEPER),
        help="Keeper host:port[,host:port][/chroot] (default: embedded, or $TXSINK_KEEPER)",
    )
    if job:
        parser.add_argument(
            "--job",
            default=os.environ.get("TXSINK_JOB"),
            help="the writer's job name (default: all jobs where that makes sense)",
        )


@dataclass(frozen=True, repr=False)
class Credentials:
    """What the common flags resolved to (see :func:`resolve_credentials`)."""

    url: str
    user: str
    password: str
    keeper_auth: str | None

    def __repr__(self) -> str:
        return f"Credentials(url={self.url!r}, user={self.user!r}, password=***)"


def resolve_credentials(args: argparse.Namespace) -> Credentials:
    """The ClickHouse URL/user/password and Keeper auth of a command.

    Password: ``--password`` or ``--password-file`` (one or the other), else
    ``$TXSINK_PASSWORD``, else the url's userinfo; user: ``--user``, else
    ``$TXSINK_USER``, else the url's userinfo, else ``default``. A user or password given
    both in the url and another way must agree (ConfigError otherwise). Keeper auth:
    ``--keeper-auth-file``, else ``$TXSINK_KEEPER_AUTH``, else none.
    """
    password = args.password
    if args.password_file is not None:
        password = read_secret_file(args.password_file, flag="--password-file")
    if password is None:
        password = os.environ.get("TXSINK_PASSWORD")
    user = args.user if args.user is not None else os.environ.get("TXSINK_USER")
    creds = merge_url_credentials(args.url, user, password, where="flag/variable")
    keeper_auth = os.environ.get("TXSINK_KEEPER_AUTH") or None
    if args.keeper_auth_file is not None:
        keeper_auth = read_secret_file(args.keeper_auth_file, flag="--keeper-auth-file")
    if keeper_auth is not None and ":" not in keeper_auth:
        raise ConfigError(
            "Keeper auth (--keeper-auth-file / $TXSINK_KEEPER_AUTH) must be user:password"
        )
    # main() masks these in any error text it prints (defence in depth; adapters mask too)
    args.secrets = secrets_of(creds.password, keeper_auth)
    return Credentials(creds.url, creds.user or "default", creds.password or "", keeper_auth)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="txsink", description="Exactly-once Spark -> ClickHouse writes"
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at debug level")
    subs = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:
                raise
            continue
        module.register(subs)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    out = Output(json_mode=getattr(args, "json", False))
    try:
        return int(args.func(args, out) or 0)
    except TxSinkError as exc:
        message = scrub(str(exc), getattr(args, "secrets", ()))
        if out.json_mode:
            out.emit({"error": message, "type": type(exc).__name__, "code": exc.code})
        else:
            sys.stderr.write(f"txsink: error: {message}\n")
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
