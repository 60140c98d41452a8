"""One rendering seam for the CLI: tables and lines for people, JSON for machines.

Every command's ``--json`` output is one object of the same family (docs/cli.md, and
``docs/cli-schema.json`` which tests check every command against)::

    {"command": "verify", "ok": false, "jobs": [...], "findings": [...], "error": null, ...}

- ``ok``: the command's exit status is 0;
- ``jobs``: one object per job the command looked at (``[]`` for commands without jobs);
- ``findings``: what needs attention, each ``{"kind", "level", "message", "job", ...}``;
- ``error``: ``null``, or ``{"type", "code", "message", "next_step"}`` when the command
  failed before it could report (:func:`error_payload`);
- command-specific keys beside them.

Units are spelled once, here, for every command: a duration is in seconds under a key
ending ``_s`` (a Python field ``x_seconds`` or ``x_age`` is renamed at this seam), a
point in time is ISO-8601 UTC text under a key ending ``_at``.

Exit statuses (:class:`Exit`) are the same for every command.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import enum
import json
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple, TextIO

from txsink.errors import (
    ConfigError,
    FencedError,
    Refused,
    TxSinkError,
    UnavailableError,
)


class Exit(enum.IntEnum):
    """The exit statuses every command follows; what each means is :data:`EXIT_DOC`."""

    OK = 0
    FINDINGS = 1
    USAGE = 2
    REFUSED = 3
    OPERATOR = 4
    UNREACHABLE = 5
    INTERRUPTED = 130


class ExitDoc(NamedTuple):
    name: str
    meaning: str
    examples: str


#: each status's name, meaning and examples: docs/cli.md's exit table is rendered from
#: these (``python -m txsink.options_doc docs/cli.md``; a unit test fails when stale).
EXIT_DOC = {
    Exit.OK: ExitDoc(
        "ok",
        "done; nothing needs attention",
        "`verify: CLEAN`; a recovery that left the job clean",
    ),
    Exit.FINDINGS: ExitDoc(
        "findings",
        "done, and something needs attention, or there was nothing to look at",
        "a `warn` in `status`; an anomaly in `verify`; a failed `check`; no jobs under the root",
    ),
    Exit.USAGE: ExitDoc(
        "usage",
        "a bad flag or option, a missing job or table, a TLS certificate the flags do not "
        "trust: nothing was done",
        "`--job nope`; `--state clickhuose` (refused before connecting, with its likely "
        "meaning); `--watch` with `--json`; an unknown flag",
    ),
    Exit.REFUSED: ExitDoc(
        "refused",
        "refused to act: nothing was done",
        "a live writer holds the job (no `--force`); no confirmation; a fenced run",
    ),
    Exit.OPERATOR: ExitDoc(
        "needs an operator",
        "a state remains that txsink must not repair alone",
        "lost staging (an alarm); a dedup batch stopped half-way; any other txsink error",
    ),
    Exit.UNREACHABLE: ExitDoc(
        "unreachable",
        "Keeper or ClickHouse did not answer in time, or what answered is not ClickHouse",
        "a wrong `--keeper` or `--url` (a web server's 404 included); the embedded stack is not up",
    ),
    Exit.INTERRUPTED: ExitDoc(
        "interrupted",
        "Ctrl-C (SIGINT) ended the command at once, whatever it waited on; what it had "
        "done stays done, as after a crash (`txsink status` shows it)",
        "Ctrl-C during a Keeper retry; `status --watch` ends with 0, its normal end",
    ),
}


def reported(exc: TxSinkError) -> TxSinkError:
    """``exc`` as a command reports it: an HTTP answer without a ClickHouse error code
    (a web server's 404 at ``--url``) becomes :class:`UnavailableError`, since nothing
    there is ClickHouse. The error map leaves it a plain :class:`TxSinkError`, which a
    writer treats as permanent; for a command it is a wrong address, like a closed port."""
    cause = exc.__cause__
    if (
        type(exc) is TxSinkError
        and exc.code is None
        and cause is not None
        and type(cause).__module__.startswith("clickhouse_connect")
        and "HTTP status" in str(cause)
    ):
        return UnavailableError(
            f"{exc}; that server does not answer as ClickHouse: check --url (ClickHouse's "
            "HTTP port, 8123 by default; the embedded stack's is 18123)"
        )
    return exc


def exit_of(exc: TxSinkError) -> Exit:
    """The exit status of a command that failed with ``exc``."""
    if isinstance(exc, UnavailableError):
        return Exit.UNREACHABLE
    if isinstance(exc, ConfigError):
        return Exit.USAGE
    if isinstance(exc, FencedError | Refused):
        return Exit.REFUSED
    return Exit.OPERATOR


#: the next step of an error whose message does not carry one, by kind.
_NEXT_STEP = {
    Exit.UNREACHABLE: "check the address and that the server is up; --connect-timeout and "
    "--keeper-timeout bound the wait, -v shows the client libraries' log",
    Exit.USAGE: "correct the flag or option named in the message (`txsink COMMAND --help`)",
    Exit.REFUSED: "see the message: another writer or the operator holds the job",
    Exit.OPERATOR: "inspect with `txsink status --job J`, then follow docs/operations.md",
}


def error_payload(exc: TxSinkError, message: str) -> dict[str, Any]:
    """``{"type", "code", "message", "next_step"}`` of a failed command (``message``:
    the scrubbed text of ``exc``)."""
    return {
        "type": type(exc).__name__,
        "code": exc.code,
        "message": message,
        "next_step": _NEXT_STEP[exit_of(exc)],
    }


def iso(ts: float | None) -> str | None:
    """A Unix time as ISO-8601 UTC text (``2026-11-26T10:25:25.123Z``)."""
    if ts is None:
        return None
    stamp = dt.datetime.fromtimestamp(float(ts), dt.UTC)
    return stamp.strftime("%Y-%m-%dT%H:%M:%S.") + f"{stamp.microsecond // 1000:03d}Z"


def _key(name: str) -> str:
    if name.endswith("_seconds"):
        return name[: -len("seconds")] + "s"
    if name.endswith("_age") or name == "age":
        return name + "_s"
    return name


def normalize(value: Any) -> Any:
    """``value`` with the JSON contract's spelling of units (see the module docstring)."""
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            key = _key(str(k))
            if key.endswith("_at") and isinstance(v, int | float) and not isinstance(v, bool):
                out[key] = iso(v)
            else:
                out[key] = normalize(v)
        return out
    if isinstance(value, list | tuple):
        return [normalize(v) for v in value]
    return value


def finding(
    kind: str, level: str, message: str, job: str | None = None, **more: Any
) -> dict[str, Any]:
    """One entry of ``findings`` (``level``: error | warn | info)."""
    return {"kind": kind, "level": level, "message": message, "job": job, **more}


class Output:
    """Renders command results; ``json_mode`` switches every call to machine output."""

    def __init__(
        self, json_mode: bool = False, stream: TextIO | None = None, command: str = ""
    ) -> None:
        self.json_mode = json_mode
        self.stream = stream or sys.stdout
        self.command = command

    def emit(self, payload: Any, text: str | None = None) -> None:
        """Print ``payload`` as JSON in json mode, else ``text`` (or a rendering of payload)."""
        if self.json_mode:
            data = json.dumps(normalize(payload), indent=2, sort_keys=True, default=str)
            self.stream.write(data + "\n")
        elif text is not None:
            self.stream.write(text.rstrip("\n") + "\n")
        elif isinstance(payload, Mapping):
            self.stream.write(kv_table(payload) + "\n")
        else:
            self.stream.write(f"{payload}\n")
        self.stream.flush()

    def result(
        self,
        code: int,
        text: str,
        *,
        jobs: Sequence[Any] = (),
        findings: Sequence[Mapping[str, Any]] = (),
        **extra: Any,
    ) -> int:
        """Emit the command's result in the common envelope; returns ``code``."""
        self.emit(
            {
                **extra,
                "command": self.command,
                "ok": code == Exit.OK,
                "jobs": list(jobs),
                "findings": list(findings),
                "error": None,
            },
            text,
        )
        return int(code)

    def failure(self, exc: TxSinkError, message: str) -> int:
        """Report a command that failed with ``exc``; returns its exit status."""
        code = exit_of(exc)
        if self.json_mode:
            self.emit(
                {
                    "command": self.command,
                    "ok": False,
                    "jobs": [],
                    "findings": [],
                    "error": error_payload(exc, message),
                }
            )
        else:
            sys.stderr.write(f"txsink: error: {message}\n")
        return int(code)

    def progress(self, message: str) -> None:
        """Progress for people on stderr; silent in json mode so stdout stays parseable."""
        if not self.json_mode:
            sys.stderr.write(message + "\n")
            sys.stderr.flush()

    @contextlib.contextmanager
    def bar(self, total: int, what: str) -> Iterator[Callable[[str], None]]:
        """A progress bar over ``total`` steps on a terminal's stderr (rich, the ``cli``
        extra; without it a counter redrawn on one line); nothing on a pipe or with
        ``--json``. Yields ``advance(label)``: one step done."""
        if self.json_mode or not sys.stderr.isatty() or total <= 1:
            yield lambda _label: None
            return
        try:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
        except ImportError:  # executors never draw bars: rich is not a core dependency
            yield from _counter(total, what)
            return

        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn())
        with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
            task = bar.add_task(what, total=total)

            def advance(label: str) -> None:
                bar.update(task, advance=1, description=f"{what}: {label}")

            yield advance


def _counter(total: int, what: str) -> Iterator[Callable[[str], None]]:
    """The plain progress of :meth:`Output.bar`: ``what: n/total label`` redrawn in place,
    the line cleared at the end."""
    done = [0]

    def advance(label: str) -> None:
        done[0] += 1
        sys.stderr.write(f"\r\x1b[K{what}: {done[0]}/{total} {label}"[:200])
        sys.stderr.flush()

    try:
        yield advance
    finally:
        sys.stderr.write("\r\x1b[K")
        sys.stderr.flush()


def kv_table(data: Mapping[str, Any]) -> str:
    width = max((len(str(k)) for k in data), default=0)
    return "\n".join(f"{k!s:<{width}}  {v}" for k, v in data.items())


def table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str]) -> str:
    """A plain aligned text table; empty input renders as '(none)'. Not rich's Table:
    rich is the optional ``cli`` extra, and a pipe or a log wants plain columns."""
    if not rows:
        return "(none)"
    cells = [[str(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    head = "  ".join(c.upper().ljust(w) for c, w in zip(columns, widths, strict=True))
    lines = ["  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join([head, *(line.rstrip() for line in lines)])


def when(ts: float | None) -> str:
    """A Unix time as UTC text ("-" for none)."""
    if ts is None:
        return "-"
    return dt.datetime.fromtimestamp(ts, dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def age(seconds: float | None) -> str:
    """An age in seconds as "12.3s ago" ("never" for none)."""
    return "never" if seconds is None else f"{seconds:.1f}s ago"


def short_age(seconds: float | None) -> str:
    """An age for a one-line view: 42s, 7m, 3h, 2d ("-" for none)."""
    if seconds is None:
        return "-"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit}"
    return f"{seconds:.0f}s"
