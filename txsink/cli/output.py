"""One rendering seam for the CLI: tables and lines for people, JSON for machines."""

from __future__ import annotations

import datetime as dt
import json
import sys
from collections.abc import Mapping, Sequence
from typing import Any, TextIO


class Output:
    """Renders command results; ``json_mode`` switches every call to machine output."""

    def __init__(self, json_mode: bool = False, stream: TextIO | None = None) -> None:
        self.json_mode = json_mode
        self.stream = stream or sys.stdout

    def emit(self, payload: Any, text: str | None = None) -> None:
        """Print ``payload`` as JSON in json mode, else ``text`` (or a rendering of payload)."""
        if self.json_mode:
            self.stream.write(json.dumps(payload, indent=2, sort_keys=True, default=str) + "\n")
        elif text is not None:
            self.stream.write(text.rstrip("\n") + "\n")
        elif isinstance(payload, Mapping):
            self.stream.write(kv_table(payload) + "\n")
        else:
            self.stream.write(f"{payload}\n")
        self.stream.flush()

    def progress(self, message: str) -> None:
        """Progress for people on stderr; silent in json mode so stdout stays parseable."""
        if not self.json_mode:
            sys.stderr.write(message + "\n")
            sys.stderr.flush()


def kv_table(data: Mapping[str, Any]) -> str:
    width = max((len(str(k)) for k in data), default=0)
    return "\n".join(f"{k!s:<{width}}  {v}" for k, v in data.items())


def table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str]) -> str:
    """A plain aligned text table; empty input renders as '(none)'."""
    if not rows:
        return "(none)"
    cells = [[str(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    head = "  ".join(c.upper().ljust(w) for c, w in zip(columns, widths, strict=True))
    lines = ["  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join([head, *lines])


def when(ts: float | None) -> str:
    """A Unix time as UTC text ("-" for none)."""
    if ts is None:
        return "-"
    return dt.datetime.fromtimestamp(ts, dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def age(seconds: float | None) -> str:
    """An age in seconds as "12.3s ago" ("never" for none)."""
    return "never" if seconds is None else f"{seconds:.1f}s ago"
