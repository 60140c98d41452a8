"""The flags every command that talks to a deployment shares, made from the options registry.

Owns which writer options are CLI flags (:data:`COMMON_FLAGS`), where the CLI's default
differs from the writer's (:data:`CLI_DEFAULTS`: the embedded stack instead of
*required*, "every job" instead of one), how credentials are resolved
(:func:`resolve_credentials`) and how a command opens its stores with the flags' TLS
and timeout settings (:func:`open_stores`). Type, default, environment variable and
help of each flag come from :data:`txsink.options.OPTIONS`, so a flag and its option
cannot drift apart. Secrets never need the command line: ``--password-file`` and
``--keeper-auth-file`` read them from a file.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from txsink.clickhouse.client import ConnectSettings
from txsink.credentials import merge_url_credentials, read_secret_file, secrets_of
from txsink.errors import ConfigError, TxSinkError
from txsink.options import OPTIONS, Kind, Option, closest

if TYPE_CHECKING:
    from txsink.ops.stores import Stores

DEFAULT_URL = "http://127.0.0.1:18123"
DEFAULT_KEEPER = "127.0.0.1:12181"

#: the writer options that are common flags, in the order ``--help`` lists them.
COMMON_FLAGS = (
    "url",
    "user",
    "password",
    "keeper",
    "state",
    "state_database",
    "keeper_root",
    "keeper_auth",
    "job",
    "staging_database",
    "verify",
    "ca_cert",
    "connect_timeout",
    "send_receive_timeout",
    "keeper_timeout",
    "keeper_retry_s",
)
#: where the CLI's default is not the writer's; None: resolved later (see the help).
CLI_DEFAULTS: dict[str, str | None] = {
    "url": DEFAULT_URL,
    "keeper": DEFAULT_KEEPER,
    "user": None,
    "password": None,
    "keeper_auth": None,
    "job": None,
    "staging_database": None,
    # a command fails fast on a wrong address: one line within seconds, not a writer's
    # patience (the writer's defaults are 15 s and 10 s)
    "keeper_timeout": "5",
    "connect_timeout": "5",
}
#: what the help says about a default the registry does not know.
DEFAULT_HELP = {
    "url": f"$TXSINK_URL, else the embedded stack {DEFAULT_URL}",
    "keeper": f"$TXSINK_KEEPER, else the embedded stack {DEFAULT_KEEPER}",
    "user": "the url's userinfo, $TXSINK_USER, else 'default'",
    "password": "$TXSINK_PASSWORD, else the url's userinfo; VISIBLE to every local user in "
    "`ps`: prefer $TXSINK_PASSWORD or --password-file",
    "keeper_auth": "$TXSINK_KEEPER_AUTH, else none (open ACL); VISIBLE in `ps`: prefer "
    "$TXSINK_KEEPER_AUTH or --keeper-auth-file; needed to change a job written with "
    "keeper_auth",
    "job": "$TXSINK_JOB, else every job where that makes sense",
    "staging_database": "the job's own, else txsink_staging",
    "keeper_timeout": "5 for a command (a writer's is 15)",
    "connect_timeout": "5 for a command (a writer's is 10)",
}
#: each common flag's line in ``--help``: the whole story (defaults, variables, what is
#: visible in ``ps``) is in docs/options.md#the-clis-common-flags, generated from above
SHORT_HELP = {
    "url": "ClickHouse http(s)://host:port",
    "user": "ClickHouse user (default: 'default')",
    "password": "ClickHouse password: visible in ps",
    "keeper": "Keeper host:port[,host:port][/chroot]",
    "state": "where the state lives: keeper | clickhouse",
    "state_database": "database of state=clickhouse (KeeperMap)",
    "keeper_root": "root node of the layout (default /txsink)",
    "keeper_auth": "Keeper digest user:password: visible in ps",
    "job": "one job (default: every job)",
    "staging_database": "database of the staging tables",
    "verify": "verify the server's TLS certificate",
    "ca_cert": "CA bundle for https URLs",
    "connect_timeout": "ClickHouse connect timeout (default 5)",
    "send_receive_timeout": "ClickHouse read timeout (default 300)",
    "keeper_timeout": "Keeper session timeout (default 5)",
    "keeper_retry_s": "retry Keeper while it is away (default 30)",
}
_METAVARS = {
    "keeper": "HOSTS",
    "state": "STORE",
    "state_database": "DB",
    "staging_database": "DB",
    "keeper_root": "PATH",
    "keeper_auth": "USER:PW",
    "password": "PW",
    "ca_cert": "PATH",
}
SHARED_TITLE = "common flags"
_COMMON_USAGE = "[common flags]"
SHARED_DESCRIPTION = "defaults and $TXSINK_* variables: docs/options.md"


class CompactHelp(argparse.HelpFormatter):
    """``--help`` that fits a screen: the command's own flags first, one line per common
    flag, and a usage line that names the common flags once."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=28)

    def _format_usage(self, usage: Any, actions: Any, groups: Any, prefix: Any) -> str:
        own = [a for a in actions if not getattr(a, "common", False)]
        text = super()._format_usage(usage, own, groups, prefix).rstrip("\n")
        last = text.rsplit("\n", 1)[-1]
        if len(last) + len(_COMMON_USAGE) + 1 > self._width:
            text += "\n" + " " * len(f"usage: {self._prog} ")
        else:
            text += " "
        return f"{text}{_COMMON_USAGE}\n\n"


#: timeouts clickhouse-connect truncates to whole seconds: 0.5 would become 0, which
#: urllib3 rejects with a traceback deep in the first connect
WHOLE_SECONDS = ("connect_timeout", "send_receive_timeout")
# Secrets with a file alternative: flag -> the flag reading it from a file.
_SECRET_FILES = {"password": "--password-file", "keeper_auth": "--keeper-auth-file"}


def option_type(opt: Option) -> Callable[[str], Any]:
    """An argparse ``type`` that parses with the registry (its errors become usage errors)."""

    def parse(raw: str) -> Any:
        try:
            value = opt.parse(raw)
        except TxSinkError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        if opt.name in WHOLE_SECONDS and value < 1:
            raise argparse.ArgumentTypeError(
                f"option {opt.name!r} must be >= 1, got {value:g} (the ClickHouse client "
                "counts whole seconds; below 1 it would wait 0)"
            )
        return value

    parse.__name__ = opt.kind.value  # argparse names the type in its messages
    return parse


def choice(*values: str) -> Callable[[str], str]:
    """An argparse ``type`` for a flag that is not an option: one of ``values`` in any
    case, else a usage error naming the likely one (argparse's own ``choices`` has no
    did-you-mean before Python 3.14)."""

    def parse(raw: str) -> str:
        low = raw.lower()
        if low in values:
            return low
        match = closest(low, values)
        hint = f" (did you mean {match}?)" if match else ""
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(values)}, got {raw!r}{hint}")

    parse.__name__ = "choice"
    return parse


def choices_metavar(values: tuple[str, ...]) -> str:
    return "{" + ",".join(values) + "}"


def flag_default(name: str) -> str | None:
    """The text default of a common flag: its variable if set, else the CLI's default,
    else the writer's."""
    opt = OPTIONS[name]
    if opt.env and not opt.secret and os.environ.get(opt.env):
        return os.environ[opt.env]
    return CLI_DEFAULTS.get(name, opt.default)


def add_common(parser: argparse.ArgumentParser, *, job: bool = True) -> None:
    """Add the common flags (``--job`` only with ``job``) to a command's parser, in a
    group of their own listed after the command's own flags (:class:`CompactHelp`)."""
    parser.formatter_class = CompactHelp
    shared = parser.add_argument_group(SHARED_TITLE, SHARED_DESCRIPTION)
    added: list[argparse.Action] = []
    for name in COMMON_FLAGS:
        if name == "job" and not job:
            continue
        opt = OPTIONS[name]
        kwargs: dict[str, Any] = {"default": flag_default(name), "help": SHORT_HELP[name]}
        if opt.kind is Kind.SECONDS:
            kwargs["metavar"] = "S"
        kwargs["metavar"] = _METAVARS.get(name, kwargs.get("metavar"))
        if name in _SECRET_FILES:
            group = shared.add_mutually_exclusive_group()
            added.append(
                group.add_argument(
                    _SECRET_FILES[name],
                    metavar="PATH",
                    default=None,
                    help=f"read the {name.replace('_', ' ')} from PATH's first line",
                )
            )
            added.append(group.add_argument(opt.flag, **kwargs))
        elif opt.kind is Kind.BOOL:
            default = opt.parse(opt.default or "")
            added.append(
                shared.add_argument(
                    opt.flag,
                    action=argparse.BooleanOptionalAction,
                    default=default,
                    help=SHORT_HELP[name],
                )
            )
        else:
            if opt.kind in (Kind.INT, Kind.SECONDS, Kind.CHOICE):
                kwargs["type"] = option_type(opt)  # a wrong value is a usage error at once
            added.append(shared.add_argument(opt.flag, **kwargs))
    for action in added:
        action.common = True  # type: ignore[attr-defined]  # CompactHelp leaves it out of usage


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
    ``--keeper-auth`` or ``--keeper-auth-file``, else ``$TXSINK_KEEPER_AUTH``, else none.
    """
    password = args.password
    if args.password_file is not None:
        password = read_secret_file(args.password_file, flag="--password-file")
    if password is None:
        password = os.environ.get("TXSINK_PASSWORD")
    user = args.user if args.user is not None else os.environ.get("TXSINK_USER")
    creds = merge_url_credentials(args.url, user, password, where="flag/variable")
    keeper_auth = getattr(args, "keeper_auth", None) or os.environ.get("TXSINK_KEEPER_AUTH")
    if args.keeper_auth_file is not None:
        keeper_auth = read_secret_file(args.keeper_auth_file, flag="--keeper-auth-file")
    if keeper_auth is not None and ":" not in keeper_auth:
        raise ConfigError(
            "Keeper auth (--keeper-auth, --keeper-auth-file, $TXSINK_KEEPER_AUTH) must be "
            "user:password"
        )
    # main() masks these in any error text it prints (defence in depth; adapters mask too)
    args.secrets = secrets_of(creds.password, keeper_auth)
    return Credentials(creds.url, creds.user or "default", creds.password or "", keeper_auth)


def connect_settings(args: argparse.Namespace) -> ConnectSettings:
    """The TLS and timeout flags of a command, for every ClickHouse client it opens."""
    return ConnectSettings(
        verify=args.verify,
        ca_cert=args.ca_cert or "",
        connect_timeout=args.connect_timeout,
        send_receive_timeout=args.send_receive_timeout,
    )


def store_name(args: argparse.Namespace) -> str:
    """Where a command's state store is, in words (for messages)."""
    root = "/" + args.keeper_root.strip("/")
    if getattr(args, "state", "keeper") == "clickhouse":
        return f"root {root} of the state table {args.state_database}.nodes at {args.url}"
    return f"Keeper root {root} at {args.keeper}"


def jobs_of(stores: Stores, args: argparse.Namespace) -> list[str]:
    """The job ``--job`` names (ConfigError naming the store if it is missing), or every
    job in the store."""
    from txsink.ops.stores import resolve_jobs

    return resolve_jobs(stores.registry, args.job, args.keeper_root, where=store_name(args))


def open_stores(args: argparse.Namespace) -> Stores:
    """Connect to Keeper and ClickHouse as the common flags say (both fail fast with a
    named error): :class:`txsink.ops.stores.Stores`, shards reached with the same
    credentials and TLS settings."""
    from txsink.driver import state_registry
    from txsink.ops.stores import Stores

    creds = resolve_credentials(args)
    tls = connect_settings(args)
    registry = state_registry(
        getattr(args, "state", "keeper"),
        keeper=args.keeper,
        root=args.keeper_root,
        state_database=args.state_database,
        connect=lambda: tls.connect(creds.url, creds.user, creds.password),
        auth=creds.keeper_auth,
        timeout=args.keeper_timeout,
        retry_s=args.keeper_retry_s,
    )
    try:
        client = tls.connect(creds.url, creds.user, creds.password)
    except BaseException:
        registry.close()
        raise
    return Stores(
        registry,
        client,
        args.staging_database,
        connect_shard=lambda u: tls.connect(u, creds.user, creds.password),
    )
