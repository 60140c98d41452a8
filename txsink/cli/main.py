"""Entry point of the ``txsink`` console script.

Each command module exposes ``register(subparsers)`` which adds its parser and sets
``func(args, out) -> int``. An error derived from :class:`txsink.errors.TxSinkError` ends
the command with the exit status of its kind (:class:`txsink.cli.output.Exit`; an HTTP
server at ``--url`` that is not ClickHouse counts as unreachable, :func:`reported`) and its
message on stderr, or the common JSON envelope with ``error`` set under ``--json``
(docs/cli.md).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import signal
import sys
import threading

from txsink.cli.output import Exit, Output, reported
from txsink.credentials import scrub
from txsink.errors import TxSinkError

__all__ = ["build_parser", "main"]
#: libraries whose own log lines a command hides unless -v (txsink's errors name the
#: address, the timeout and the next step), and txsink's per-attempt retry warnings
QUIET_LIBRARIES = ("kazoo", "urllib3", "clickhouse_connect", "txsink.clickhouse.retry")
COMMAND_MODULES = (
    "txsink.cli.embedded_cmd",
    "txsink.cli.ops_cmd",
    "txsink.cli.demo_cmd",
    "txsink.cli.mode_cmd",
    "txsink.cli.check_cmd",
)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("txsink")
    except PackageNotFoundError:  # a source tree that was never installed
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="txsink", description="Exactly-once Spark -> ClickHouse writes"
    )
    # no -v here: after the command, -v is status's --detail (issue 41)
    parser.add_argument(
        "--debug", "--verbose", dest="verbose", action="store_true", help="log at debug level"
    )
    parser.add_argument("--version", action="version", version=f"txsink {_version()}")
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
    """Run one command; its exit status (docs/cli.md#exit-statuses). Ctrl-C (SIGINT)
    ends any command at once with 130, whatever it waits on (``status --watch``, whose
    normal end it is, with 0)."""
    if threading.current_thread() is threading.main_thread():
        # A process started with SIGINT ignored (a shell's background job, a test or CI
        # runner started that way) would otherwise ignore Ctrl-C and `kill -INT` alike.
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return _run(argv)
    except KeyboardInterrupt:
        return Exit.INTERRUPTED


def _run(argv: list[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not args.verbose:  # their retries and reconnects are txsink's to report, in one line
        for name in QUIET_LIBRARIES:
            logging.getLogger(name).setLevel(logging.CRITICAL)
    out = Output(json_mode=getattr(args, "json", False), command=args.command)
    try:
        return int(args.func(args, out) or 0)
    except TxSinkError as exc:
        exc = reported(exc)
        return out.failure(exc, scrub(str(exc), getattr(args, "secrets", ())))


if __name__ == "__main__":
    sys.exit(main())
