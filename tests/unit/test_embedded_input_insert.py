"""An INSERT reading input() spools the body to a file the rewritten statement reads, on the
request's connection, and the file is removed whatever happens
(txsink.embedded.input_insert on a fake engine, no chdb)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest

from txsink.embedded.http_errors import HttpError
from txsink.embedded.input_insert import run_input_insert, spool_dir
from txsink.embedded.sqlscan import scan_input_insert

SQL = "INSERT INTO t (a) SELECT a FROM input('a String') WHERE a != 'x' FORMAT TSV"


class FakeBody:
    def __init__(self, *chunks: bytes) -> None:
        self._chunks = chunks

    def chunks(self) -> Iterator[bytes]:
        yield from self._chunks


class FakeResult:
    def rows_written(self) -> int:
        return 2

    def bytes_written(self) -> int:
        return 20


class FakeEngine:
    def __init__(self, fail: HttpError | None = None) -> None:
        self.fail = fail
        self.calls: list[tuple[object, str, str, dict[str, str], bytes]] = []

    def query(self, ec: object, sql: str, fmt: str, binds: dict[str, str]) -> FakeResult:
        path = re.search(r"file\('([^']+)'", sql)
        assert path is not None
        self.calls.append((ec, sql, fmt, binds, Path(path.group(1)).read_bytes()))
        if self.fail is not None:
            raise self.fail
        return FakeResult()


def _run(engine: FakeEngine, body: FakeBody, directory: Path) -> dict[str, str]:
    stmt = scan_input_insert(SQL)
    assert stmt is not None
    return run_input_insert(
        cast(Any, engine), cast(Any, "conn"), stmt, cast(Any, body), {"p": "1"}, directory
    )


def test_the_body_is_spooled_read_by_file_on_the_requests_connection_then_removed(
    tmp_path: Path,
) -> None:
    engine = FakeEngine()
    summary = _run(engine, FakeBody(b"a\n", b"b\n"), spool_dir(tmp_path))
    [(ec, sql, fmt, binds, data)] = engine.calls
    assert (ec, fmt, binds, data) == ("conn", "TabSeparated", {"p": "1"}, b"a\nb\n")
    spooled = str(tmp_path / "input" / "input-")
    assert sql.startswith(f"INSERT INTO t (a) SELECT a FROM file('{spooled}")
    assert sql.endswith(".tsv', 'TSV', 'a String') WHERE a != 'x'")
    assert summary["written_rows"] == "2"
    assert list((tmp_path / "input").iterdir()) == []


def test_the_spooled_body_is_removed_when_the_statement_fails(tmp_path: Path) -> None:
    engine = FakeEngine(HttpError(395, "Code: 395. DB::Exception: txsink: sealed"))
    with pytest.raises(HttpError) as info:
        _run(engine, FakeBody(b"a\n"), tmp_path)
    assert info.value.code == 395
    assert list(tmp_path.iterdir()) == []


def test_a_directory_file_would_read_as_a_glob_is_refused_by_name(tmp_path: Path) -> None:
    engine = FakeEngine()
    with pytest.raises(HttpError, match=r"input\[1\].*glob.*data directory") as info:
        _run(engine, FakeBody(b"a\n"), tmp_path / "input[1]")
    assert info.value.code == 75
    assert engine.calls == []
