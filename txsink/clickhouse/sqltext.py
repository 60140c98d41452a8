"""SQL text txsink reads back from the server: engine clauses, CREATE statements, view
SELECTs, SETTINGS lists, type argument lists.

Owned by the ClickHouse adapter; pure (no I/O, no clickhouse-connect). Invariants: every
scan is quote-aware (a keyword or a parenthesis inside a string literal or a backquoted
name is not one) and conservative: what it cannot read it reports as absent or raises
ValueError, never guesses.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping

# ClickHouse prints keywords in upper case: a column named ttl is not a TTL clause
_TTL_RE = re.compile(r"\sTTL\s")
_BACKQUOTED_RE = re.compile(r"`(?:[^`\\]|\\.)*`")
_QUOTED_RE = re.compile(r"'(?:[^'\\]|\\.)*'")


def split_top_level(s: str, sep: str = ",") -> list[str]:
    """Split on ``sep`` outside parentheses, angle brackets and quotes."""
    parts: list[str] = []
    depth = 0
    quote: str | None = None
    cur: list[str] = []
    i = 0
    while i < len(s):
        ch = s[i]
        if quote:
            cur.append(ch)
            if ch == "\\" and i + 1 < len(s):
                cur.append(s[i + 1])
                i += 1
            elif ch == quote:
                quote = None
        elif ch in "'`\"":
            quote = ch
            cur.append(ch)
        elif ch in "(<":
            depth += 1
            cur.append(ch)
        elif ch in ")>":
            depth -= 1
            cur.append(ch)
        elif ch == sep and depth == 0:
            parts.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
        i += 1
    tail = "".join(cur).strip()
    if tail or parts:
        parts.append(tail)
    return parts


def outside_quotes(text: str) -> Iterator[tuple[int, str]]:
    """Each character of ``text`` outside quotes and backquotes, with its index (a
    backslash inside quotes escapes the next character); ValueError at the end of a text
    that leaves a quote open."""
    quote, i = "", 0
    while i < len(text):
        ch = text[i]
        if quote:
            if ch == "\\":
                i += 1
            elif ch == quote:
                quote = ""
        elif ch in "'`\"":
            quote = ch
        else:
            yield i, ch
        i += 1
    if quote:
        raise ValueError(f"an unclosed {quote} in {text!r}")


def closing_paren(text: str) -> int:
    """Index of the parenthesis closing the one ``text`` starts with (quote-aware)."""
    depth = 0
    for i, ch in outside_quotes(text):
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
            if depth == 0:
                return i
    raise ValueError(f"unbalanced parentheses in {text!r}")


def mask_quoted(text: str) -> str:
    """``text`` with the inside of every quoted string blanked (same length), so keyword
    searches do not match inside literals."""
    return re.sub(r"'(?:[^'\\]|\\.)*'", lambda m: "'" + "_" * (len(m.group(0)) - 2) + "'", text)


_CALL_RE = re.compile(r"(?<![\w.`$])([A-Za-z_][A-Za-z0-9_]*)\(")


def called_functions(expr: str) -> tuple[str, ...]:
    """The names of the functions ``expr`` calls, once each, in order of appearance.
    ``name(`` only: the server writes a call without a space, and an operator with its
    parenthesis apart (``id IN (1, 2)``); names inside string literals do not count."""
    return tuple(dict.fromkeys(m.group(1) for m in _CALL_RE.finditer(mask_quoted(expr))))


def sql_string(value: str) -> str:
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


_SETTINGS_TAIL_RE = re.compile(r"\sSETTINGS\s+(.*)$", re.DOTALL)
_SETTING_RE = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_]*)\s*=\s*('(?:[^'\\]|\\.)*'|[^,]+?)\s*(?:,|$)")


def parse_settings_clause(engine_full: str) -> dict[str, str]:
    """``... SETTINGS a = 1, storage_policy = 'x'`` -> ``{"a": "1", "storage_policy": "x"}``."""
    m = _SETTINGS_TAIL_RE.search(engine_full)
    if not m:
        return {}
    out: dict[str, str] = {}
    for key, value in _SETTING_RE.findall(m.group(1)):
        out[key] = value[1:-1] if value.startswith("'") else value
    return out


def ttl_columns(create_query: str) -> tuple[str, ...]:
    """Columns with a column TTL in a ``system.tables.create_table_query``."""
    start = create_query.find("(")
    if start < 0:
        return ()
    try:
        end = start + closing_paren(create_query[start:])
    except ValueError:
        end = len(create_query)
    found = []
    for element in split_top_level(create_query[start + 1 : end]):
        m = re.match(r"^(`(?:[^`\\]|\\.)+`|[A-Za-z_][A-Za-z0-9_]*)\s+(.*)$", element, re.DOTALL)
        if not m or m.group(1).upper() in ("INDEX", "PROJECTION", "CONSTRAINT"):
            continue
        if _TTL_RE.search(_QUOTED_RE.sub("''", m.group(2))):
            found.append(re.sub(r"\\(.)", r"\1", m.group(1).strip("`")))
    return tuple(found)


def reads_from(select: str, view_db: str, db: str, table: str) -> bool:
    """Whether a view's SELECT reads FROM ``db.table`` (unqualified names are ``view_db``)."""
    ident = r"(?:`(?:[^`\\]|\\.)+`|[A-Za-z_][A-Za-z0-9_]*)"
    for m in re.finditer(rf"\bFROM\s+({ident})(?:\s*\.\s*({ident}))?", select, re.IGNORECASE):
        first, second = m.group(1).strip("`"), m.group(2)
        src_db, src = (first, second.strip("`")) if second else (view_db, first)
        if src_db == db and src == table:
            return True
    return False


def has_ttl(engine_full: str) -> bool:
    """Whether an ``engine_full`` carries a table TTL (outside string literals)."""
    return bool(_TTL_RE.search(_BACKQUOTED_RE.sub("``", _QUOTED_RE.sub("''", engine_full))))


# a month / quarter counted at its shortest
_INTERVAL_S = {"second": 1, "minute": 60, "hour": 3600, "day": 86400, "week": 7 * 86400}
_INTERVAL_S |= {"month": 28 * 86400, "quarter": 89 * 86400, "year": 365 * 86400}
_TTL_CLAUSE_RE = re.compile(r"\bTTL\b(.*?)(?:\bSETTINGS\b|$)", re.IGNORECASE | re.DOTALL)
_TTL_DELETE_RE = re.compile(
    r"^(\w+)\s*\+\s*toInterval(Second|Minute|Hour|Day|Week|Month|Quarter|Year)\((\d+)\)"
    r"\s*(?:DELETE\b.*)?$",
    re.IGNORECASE | re.DOTALL,
)
# TTL elements that move, recompress or aggregate rows: they delete nothing
_TTL_KEEPS_RE = re.compile(r"\b(?:TO\s+(?:VOLUME|DISK)|RECOMPRESS|GROUP\s+BY)\b", re.IGNORECASE)


def log_ttl_seconds(engine_full: str) -> float | None:
    """The least time a row of a log table with this ``engine_full`` survives its TTL:
    None when no TTL element deletes rows (none, or only ``TO VOLUME``/``TO DISK``/
    ``RECOMPRESS``/``GROUP BY`` ones), 0.0 for a deleting element this does not read
    (``col + toIntervalX(n)`` is read, with or without ``DELETE [WHERE ...]``; a TTL on a
    Date column may delete a row a day early)."""
    if not has_ttl(engine_full):
        return None
    clause = _TTL_CLAUSE_RE.search(_QUOTED_RE.sub("''", engine_full))
    least: float | None = None
    for raw in split_top_level(clause.group(1) if clause else ""):
        element = raw.strip()
        if not element or _TTL_KEEPS_RE.search(element):
            continue
        m = _TTL_DELETE_RE.match(element)
        if m is None:
            return 0.0
        column, unit, n = m.groups()
        seconds = float(int(n) * _INTERVAL_S[unit.lower()])
        if "date" in column.lower() and "time" not in column.lower():
            seconds -= 86400.0
        least = max(0.0, seconds) if least is None else min(least, max(0.0, seconds))
    return least


_BARE_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_KINDS = ("DEFAULT", "MATERIALIZED", "ALIAS", "EPHEMERAL")


def _name_forms(name: str) -> tuple[str, ...]:
    """How the server may print an identifier: backquoted, or bare where it can be."""
    quoted = "`" + name.replace("\\", "\\\\").replace("`", "\\`") + "`"
    return (name, quoted) if _BARE_NAME_RE.fullmatch(name) else (quoted,)


def batch_ddl(
    create_query: str,
    engine_full: str,
    table: tuple[str, str],
    layout: tuple[tuple[str, str, str], ...],
    settings: Mapping[str, object],
) -> str:
    """What follows the name in a CREATE of a table shaped exactly as ``table`` (db,
    name), from its ``system.tables`` ``create_query`` and ``engine_full``, with
    ``settings`` in place of the table's own of the same names: ``(<columns, indexes,
    projections>) ENGINE = <engine_full, settings merged>``. ``""`` unless the query is
    read exactly: it names ``table`` and ends with ``engine_full`` (no comment), its
    columns are ``layout`` ((name, type, kind) in order, from ``system.columns``) and
    none is MATERIALIZED (a CREATE ... AS SELECT computes those again) or Nested (a
    session's ``flatten_nested`` would flatten it) or has a TTL, nor has the table (a
    TTL merge in the new table would drop rows). The CREATE is sent with
    :data:`~.insert_settings.CREATE_GATHER_SETTINGS` (session settings that would read
    the column list otherwise)."""
    head = "CREATE TABLE "
    if not engine_full or not create_query.startswith(head):
        return ""
    if not create_query.endswith(" ENGINE = " + engine_full) or has_ttl(engine_full):
        return ""
    middle = create_query[len(head) : len(create_query) - len(engine_full) - len(" ENGINE = ")]
    db, name = table
    start = next(
        (
            len(d) + 1 + len(n) + 1
            for d in _name_forms(db)
            for n in _name_forms(name)
            if middle.startswith(f"{d}.{n} (")
        ),
        -1,
    )
    body = middle[start:] if start > 0 else ""
    try:
        if not body or closing_paren(body) != len(body) - 1:
            return ""
    except ValueError:
        return ""
    if ttl_columns(f"{head}x {body}"):
        return ""
    elements = [
        e
        for e in split_top_level(body[1:-1])
        if e.split(" ", 1)[0].upper() not in ("INDEX", "PROJECTION", "CONSTRAINT")
    ]
    if len(elements) != len(layout):
        return ""
    for element, (column, ctype, kind) in zip(elements, layout, strict=True):
        if kind == "MATERIALIZED" or "Nested(" in ctype:  # computed again; re-flattened
            return ""
        rest = next(
            (element[len(f) + 1 :] for f in _name_forms(column) if element.startswith(f + " ")),
            None,
        )
        if rest is None or not (rest == ctype or rest.startswith(ctype + " ")):
            return ""
        word = rest[len(ctype) :].split(maxsplit=1)[:1]
        said = word[0] if word and word[0] in _KINDS else ""
        if said != kind:
            return ""
    try:  # the keyword outside quotes and backquoted names
        outside = dict(outside_quotes(engine_full))
    except ValueError:
        return ""
    bare = "".join(outside.get(i, "_") for i in range(len(engine_full)))
    at = re.search(r"\sSETTINGS\s", bare)
    engine, own = engine_full, []
    if at is not None:
        engine = engine_full[: at.start()]
        own = _SETTING_RE.findall(engine_full[at.end() :])
    merged = [f"{k} = {v}" for k, v in own if k not in settings]
    merged += [f"{k} = {v}" for k, v in settings.items()]
    return f"{body} ENGINE = {engine} SETTINGS {', '.join(merged)}"
