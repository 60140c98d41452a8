"""The generated tables of the docs, rendered from the code that decides them.

Owns the generated parts of docs/options.md (the writer options table and the CLI's
common flags table, from the options registry; the ClickHouse settings refused to
``settings.<name>``, from :mod:`txsink.clickhouse.insert_settings`) and of docs/types.md
(the type contract, from :func:`txsink.clickhouse.values.contract_table`, and the types
of created tables, from :func:`txsink.clickhouse.target_ddl.created_types_table`) and of
docs/cli.md (the exit statuses, from :data:`txsink.cli.output.EXIT_DOC`), each between a
pair of
``<!-- BEGIN GENERATED: ... -->`` / ``<!-- END GENERATED: ... -->`` markers. Everything
outside the markers is prose kept as it is. Unit tests fail when a file is not what
:func:`render` makes of it.

Also the whole of :mod:`txsink.writer_options` (the options as a typed dict).

Regenerate with ``python -m txsink.options_doc`` (every file; ``--check`` only
compares, exit 1 when stale).
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from pathlib import Path

from txsink.cli.common import COMMON_FLAGS, DEFAULT_HELP
from txsink.options import OPTIONS, Kind, Option

_BLOCK_RE = re.compile(
    r"(<!-- BEGIN GENERATED: (?P<name>[a-z-]+)[^>]*-->\n)(?P<body>.*?)(<!-- END GENERATED: "
    r"(?P=name) -->)",
    re.DOTALL,
)


def _cell(text: str) -> str:
    """Markdown table cell text: a ``|`` would end the cell."""
    return text.replace("|", "\\|")


def _default(opt: Option) -> str:
    if opt.required:
        return "*required*"
    return f"`{opt.default}`" if opt.default else "(empty)"


def _meaning(opt: Option) -> str:
    parts = []
    if opt.kind is Kind.CHOICE:
        parts.append(f"{' | '.join(opt.choices)}:")
    parts.append(opt.doc)
    return " ".join(parts)


def options_table() -> str:
    """Every writer option a user gives (internal ones, which txsink sets itself, left
    out): name, default, variable, meaning."""
    lines = ["| option | default | env | meaning |", "|---|---|---|---|"]
    for opt in OPTIONS.values():
        if opt.internal:
            continue
        env = f"`${opt.env}`" if opt.env and opt.env_in_writer else ""
        lines.append(f"| `{opt.name}` | {_cell(_default(opt))} | {env} | {_cell(_meaning(opt))} |")
    return "\n".join(lines)


def flags_table() -> str:
    """The CLI's common flags: flag, option, default (with its variable)."""
    lines = ["| flag | option | default |", "|---|---|---|"]
    for name in COMMON_FLAGS:
        opt = OPTIONS[name]
        flag = f"`{opt.flag}` / `--no-{name}`" if opt.kind is Kind.BOOL else f"`{opt.flag}`"
        default = DEFAULT_HELP.get(name) or _default(opt)
        lines.append(f"| {flag} | `{name}` | {_cell(default)} |")
    return "\n".join(lines)


def refused_settings_table() -> str:
    """The ClickHouse settings a user may not pass (``settings.<name>``), grouped by what
    to do instead: one sentence per reason, each setting with what it decides."""
    from txsink.clickhouse.insert_settings import refused_settings

    by_fix: dict[str, dict[str, list[str]]] = {}
    for name, (why, fix) in refused_settings().items():
        by_fix.setdefault(fix, {}).setdefault(why, []).append(f"`{name}`")
    lines = []
    for fix, whys in by_fix.items():
        parts = [f"{', '.join(names)}: {why}" for why, names in whys.items()]
        lines.append(f"- **{fix}.** {'; '.join(parts)}.")
    return "\n".join(lines)


def types_table() -> str:
    from txsink.clickhouse.values import contract_table

    return contract_table()


def created_types_table() -> str:
    from txsink.clickhouse.target_ddl import created_types_table as table

    return table()


def exit_table() -> str:
    """The CLI's exit statuses: status, name, meaning, examples."""
    from txsink.cli.output import EXIT_DOC

    lines = ["| status | name | meaning | examples |", "|---|---|---|---|"]
    for code, doc in EXIT_DOC.items():
        lines.append(f"| {int(code)} | {doc.name} | {_cell(doc.meaning)} | {_cell(doc.examples)} |")
    return "\n".join(lines)


# a value's Python type in the WriterOptions TypedDict; text is accepted too (Spark's
# options are text), except for choices, whose Literal catches a misspelt value
_TYPED = {Kind.INT: "int | str", Kind.SECONDS: "float | str", Kind.BOOL: "bool | str"}
WRITER_OPTIONS_PY = "txsink/writer_options.py"


def writer_options_module() -> str:
    """The source of :mod:`txsink.writer_options`: one typed key per writer option a
    user gives as a keyword (``foreach_batch(url=..., block_rows=...)``)."""
    lines = [
        '"""The writer options as keyword arguments: a ``TypedDict`` that mypy and IDEs check.',
        "",
        "Generated from the options registry (:data:`txsink.options.OPTIONS`) by",
        f"``python -m txsink.options_doc {WRITER_OPTIONS_PY}``; a unit test fails when it is",
        "stale. Numbers and booleans may be given as text too, as Spark options are; each",
        "key's meaning is in docs/options.md.",
        '"""',
        "",
        "from __future__ import annotations",
        "",
        "from typing import Literal, TypedDict",
        "",
        "",
        "class WriterOptions(TypedDict, total=False):",
        '    """Keyword options of ``txsink.foreach_batch``, ``txsink.transaction`` and',
        '    ``txsink.progress_listener`` (the ``settings.<name>`` form is for ``.option``)."""',
        "",
    ]
    for opt in OPTIONS.values():
        if opt.internal or not opt.name.isidentifier():
            continue
        if opt.kind is Kind.CHOICE:
            kind = "Literal[" + ", ".join(f'"{c}"' for c in opt.choices) + "]"
        else:
            kind = _TYPED.get(opt.kind, "str")
        lines.append(f"    {opt.name}: {kind}")
    return "\n".join(lines) + "\n"


def api_reference() -> str:
    """The public Python API: each entry point's signature and docstring, from the code."""
    import inspect

    import txsink
    from txsink.spark.multi import Transaction

    entries: list[tuple[str, Callable[..., object]]] = [
        (f"txsink.{name}", getattr(txsink, name))
        for name in sorted(txsink.__all__)
        if callable(getattr(txsink, name))
    ]
    entries += [(f"Transaction.{m}", getattr(Transaction, m)) for m in ("write", "commit")]
    blocks = []
    for name, obj in entries:
        signature = str(inspect.signature(obj)).replace("'", "")
        signature = signature.replace("(self, ", "(").replace("(self)", "()")
        doc = inspect.cleandoc(obj.__doc__ or "")
        blocks.append(f"### `{name}`\n\n```python\n{name}{signature}\n```\n\n{doc}\n")
    return "\n".join(blocks).rstrip("\n")


TABLES = {
    "options": options_table,
    "cli-flags": flags_table,
    "refused-settings": refused_settings_table,
    "types": types_table,
    "created-types": created_types_table,
    "exit-statuses": exit_table,
    "api": api_reference,
}


def render(text: str) -> str:
    """``text`` with every generated block replaced by its current rendering."""

    def block(m: re.Match[str]) -> str:
        make = TABLES.get(m.group("name"))
        if make is None:
            raise ValueError(f"unknown generated block {m.group('name')!r}")
        return f"{m.group(1)}{make()}\n{m.group(4)}"

    return _BLOCK_RE.sub(block, text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m txsink.options_doc", description=__doc__)
    parser.add_argument(
        "paths",
        nargs="*",
        default=[
            "docs/options.md",
            "docs/types.md",
            "docs/cli.md",
            "docs/api.md",
            WRITER_OPTIONS_PY,
        ],
    )
    parser.add_argument("--check", action="store_true", help="exit 1 if a file is stale")
    args = parser.parse_args(argv)
    stale = 0
    for path in map(Path, args.paths):
        text = path.read_text(encoding="utf-8") if path.exists() else ""
        fresh = writer_options_module() if path.suffix == ".py" else render(text)
        if not args.check:
            path.write_text(fresh, encoding="utf-8")
        elif fresh != text:
            sys.stderr.write(f"{path} is stale: run python -m txsink.options_doc {path}\n")
            stale = 1
    return stale


if __name__ == "__main__":
    sys.exit(main())
