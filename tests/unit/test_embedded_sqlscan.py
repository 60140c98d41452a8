"""The embedded endpoint finds an ``INSERT ... SELECT ... FROM input('<structure>') ...
FORMAT X`` (its data is the body) and rewrites it to read a file instead
(txsink.embedded.sqlscan, no server)."""

from __future__ import annotations

import pytest

from txsink.embedded.http_errors import SYNTAX_ERROR, HttpError
from txsink.embedded.sqlscan import InsertHeader, scan_input_insert, scan_insert

SEALED = (
    "INSERT INTO `db`.`t` (`id`, `s`) SELECT `id`, `s` FROM input('`id` Int64, `s` String') "
    "WHERE (SELECT throwIf(count() > 0, 'txsink: sealed') FROM `txsink_staging`.`txsink_seals` "
    "WHERE tag = 'txsink-seal job xid') = 0 FORMAT Arrow"
)


def test_the_writers_dedup_insert_is_found_and_reads_the_spooled_file() -> None:
    found = scan_input_insert(SEALED)
    assert found is not None
    assert found.fmt == "Arrow"
    assert found.structure == "'`id` Int64, `s` String'"
    assert found.reading_file("/data/input/x.arrow") == (
        "INSERT INTO `db`.`t` (`id`, `s`) SELECT `id`, `s` FROM "
        "file('/data/input/x.arrow', 'Arrow', '`id` Int64, `s` String') "
        "WHERE (SELECT throwIf(count() > 0, 'txsink: sealed') FROM "
        "`txsink_staging`.`txsink_seals` WHERE tag = 'txsink-seal job xid') = 0"
    )


def test_escapes_in_the_structure_are_kept_as_written_and_the_path_is_quoted() -> None:
    sql = (
        "insert into t select * from input ( 'a String, `it''s` Nullable(DateTime64(6)), "
        "`b\\'c` Int8' ) where a != 'FORMAT x' -- FORMAT CSV\nformat   CSVWithNames ;\n"
    )
    found = scan_input_insert(sql)
    assert found is not None
    assert found.fmt == "CSVWithNames"
    assert found.structure == "'a String, `it''s` Nullable(DateTime64(6)), `b\\'c` Int8'"
    rewritten = found.reading_file("/tmp/o'k\\x")
    assert rewritten == (
        "insert into t select * from file('/tmp/o\\'k\\\\x', 'CSVWithNames', "
        "'a String, `it''s` Nullable(DateTime64(6)), `b\\'c` Int8') "
        "where a != 'FORMAT x' -- FORMAT CSV"
    )


def test_non_ascii_text_before_input_keeps_its_offsets() -> None:
    found = scan_input_insert(
        "INSERT INTO t SELECT x FROM input('x String') WHERE x != 'ünï' FORMAT TSV"
    )
    assert found is not None
    assert found.reading_file("/p").endswith("FROM file('/p', 'TSV', 'x String') WHERE x != 'ünï'")


@pytest.mark.parametrize(
    "sql",
    [
        "INSERT INTO t FORMAT Arrow",
        "INSERT INTO t (a) SELECT a FROM other FORMAT Arrow",
        "INSERT INTO t SELECT 'input(' FORMAT TSV",
        "INSERT INTO t SELECT `input`('x') FORMAT TSV",
        "INSERT INTO t SELECT * FROM db.input('x Int8') FORMAT TSV",
        "SELECT * FROM input('x Int8') FORMAT TSV",
        "INSERT INTO t /* input('x Int8') */ VALUES (1)",
        "INSERT INTO t SELECT * FROM input('x Int8) FORMAT TSV",  # unclosed: the engine says
    ],
)
def test_statements_not_reading_input_are_left_alone(sql: str) -> None:
    assert scan_input_insert(sql) is None


@pytest.mark.parametrize(
    ("sql", "names"),
    [
        ("INSERT INTO t SELECT * FROM input('x Int8')", "trailing FORMAT"),
        ("INSERT INTO t SELECT * FROM input('x Int8') FORMAT", "trailing FORMAT"),
        ("INSERT INTO t SELECT * FROM input('x Int8') FORMAT TSV WHERE 1", "trailing FORMAT"),
        ("INSERT INTO t SELECT * FROM input(`x Int8`) FORMAT TSV", "one string literal"),
        ("INSERT INTO t SELECT * FROM input('x Int8', 'y') FORMAT TSV", "one string literal"),
        ("INSERT INTO t SELECT * FROM input() FORMAT TSV", "one string literal"),
        ("INSERT INTO t SELECT * FROM input('x Int8' FORMAT TSV", "one string literal"),
        (
            "INSERT INTO t SELECT * FROM input('x Int8') JOIN input('y Int8') USING 1 FORMAT TSV",
            "calls it 2 times",
        ),
    ],
)
def test_other_shapes_of_input_are_a_syntax_error_naming_the_shape(sql: str, names: str) -> None:
    with pytest.raises(HttpError, match=names) as info:
        scan_input_insert(sql)
    assert info.value.code == SYNTAX_ERROR
    assert "FROM input('<col Type, ...>')" in str(info.value)


@pytest.mark.parametrize(
    ("buf", "want"),
    [
        (b"INSERT INTO t FORMAT Arrow\nDATA", ("INSERT INTO t ", "Arrow", 27)),
        (b"INSERT INTO t FORMAT Arrow\r\nDATA", ("INSERT INTO t ", "Arrow", 28)),
        (
            b"/* c */ INSERT INTO `t` -- x\n FORMAT CSV 1,2",
            ("/* c */ INSERT INTO `t` -- x\n ", "CSV", 41),
        ),
        (b"insert into 'format' FORMAT Native", False),  # the name may go on
        (b"INSERT INTO t FORMAT", False),
        (b"INSERT INTO t /* open", False),
        (b"INSERT INTO t -- open", False),
        (b"INSERT INTO 'open", False),
        (b"INSERT INTO t VALUES (1)", None),
        (b"INSERT INTO t SELECT 1", None),
        (b"SELECT 1 FORMAT CSV", None),
        (b"", False),
    ],
)
def test_scan_insert_finds_the_format_clause_of_a_streamed_insert(buf: bytes, want: object) -> None:
    got = scan_insert(buf)
    if isinstance(want, tuple):
        assert isinstance(got, InsertHeader)
        assert (got.sql, got.fmt, got.data_offset) == want
    else:
        assert got is want
