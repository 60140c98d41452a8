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

from txsink.cli.output import Output
from txsink.errors import TxSinkError

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
    parser.add_argument("--user", default=os.environ.get("TXSINK_USER", "default"))
    parser.add_argument("--password", default=os.environ.get("TXSINK_PASSWORD", ""))
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
        if out.json_mode:
            out.emit({"error": str(exc), "type": type(exc).__name__, "code": exc.code})
        else:
            sys.stderr.write(f"txsink: error: {exc}\n")
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
