"""The embedded endpoint's replies have ClickHouse's shape: error bodies clients parse,
summaries, content types, and form fields (txsink.embedded.responses, no server)."""

from __future__ import annotations

import re

import pytest

from txsink.embedded.http_errors import NOT_IMPLEMENTED, SYNTAX_ERROR, HttpError
from txsink.embedded.responses import (
    EMPTY_SUMMARY,
    content_type_for,
    error_body,
    form_fields,
    insert_summary,
    query_summary,
)


def test_error_body_names_code_and_version_as_clickhouse_does() -> None:
    body = error_body(HttpError(SYNTAX_ERROR, "Empty query"), "26.9.1").decode()
    assert re.fullmatch(
        r"Code: 62\. DB::Exception: Empty query\. \(SYNTAX_ERROR\) \(version 26\.9\.1\)\n", body
    )


def test_error_body_keeps_an_engine_message_that_has_its_code_already() -> None:
    text = "Code: 60. DB::Exception: Unknown table. (UNKNOWN_TABLE)"
    assert error_body(HttpError(60, text), "26.9").decode() == f"{text} (version 26.9)\n"


def test_summaries_have_every_key_clients_read() -> None:
    class Result:
        def rows_read(self) -> int:
            return 5

        def bytes_read(self) -> int:
            return 50

        def rows_written(self) -> int:
            return 0

        def bytes_written(self) -> int:
            return 0

    inserted = insert_summary(3, 30, 0.002)
    queried = query_summary(Result(), 12, 0.001)
    assert set(inserted) == set(queried) == set(EMPTY_SUMMARY)
    assert inserted["written_rows"] == inserted["read_rows"] == "3"
    assert inserted["elapsed_ns"] == "2000000"
    assert queried["result_rows"] == "5" and queried["result_bytes"] == "12"


@pytest.mark.parametrize(
    ("fmt", "expected"),
    [
        ("TabSeparatedWithNames", "text/tab-separated-values; charset=UTF-8"),
        ("CSV", "text/csv; charset=UTF-8; header=absent"),
        ("JSONEachRow", "application/json; charset=UTF-8"),
        ("Native", "application/octet-stream"),
    ],
)
def test_content_type_follows_the_format(fmt: str, expected: str) -> None:
    assert content_type_for(fmt) == expected


def multipart(*fields: tuple[str, str, str]) -> tuple[str, bytes]:
    parts = b""
    for name, filename, value in fields:
        disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
        parts += f"--b\r\nContent-Disposition: {disposition}\r\n\r\n{value}\r\n".encode()
    return "multipart/form-data; boundary=b", parts + b"--b--\r\n"


def test_form_fields_are_read_by_name() -> None:
    content_type, raw = multipart(("query", "", "SELECT 1"), ("max_threads", "", "2"))
    assert form_fields(content_type, raw) == {"query": "SELECT 1", "max_threads": "2"}


def test_external_data_tables_are_refused() -> None:
    content_type, raw = multipart(("t", "t.tsv", "1\t2"))
    with pytest.raises(HttpError) as err:
        form_fields(content_type, raw)
    assert err.value.code == NOT_IMPLEMENTED
