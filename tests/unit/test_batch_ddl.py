"""The batch staging's CREATE text made from the target's (txsink.clickhouse.sqltext.batch_ddl):
exact or nothing. What the server does with it is tested on the real engine
(tests/integration/test_clickhouse_warehouse.py)."""

from __future__ import annotations

import pytest

from txsink.clickhouse.sqltext import batch_ddl

ENGINE = "MergeTree PARTITION BY p ORDER BY id SETTINGS index_granularity = 8192, x = 'a, b'"
LAYOUT = (("id", "Int64", ""), ("p", "Int32", ""), ("s", "String", "DEFAULT"))
COLUMNS = "(`id` Int64, `p` Int32, `s` String DEFAULT 'x', INDEX ix s TYPE set(0) GRANULARITY 1)"
STAGING = {"assign_part_uuids": 1, "index_granularity": 1024}


def query(name: str = "d.t", columns: str = COLUMNS, engine: str = ENGINE) -> str:
    return f"CREATE TABLE {name} {columns} ENGINE = {engine}"


def test_the_target_s_create_with_the_staging_settings_in_place_of_its_own() -> None:
    made = batch_ddl(query(), ENGINE, ("d", "t"), LAYOUT, STAGING)
    assert made == (
        f"{COLUMNS} ENGINE = MergeTree PARTITION BY p ORDER BY id "
        "SETTINGS x = 'a, b', assign_part_uuids = 1, index_granularity = 1024"
    )
    quoted = query("`my db`.`t``x`".replace("``", "\\`"))
    assert batch_ddl(quoted, ENGINE, ("my db", "t`x"), LAYOUT, STAGING) == made
    bare = "MergeTree ORDER BY id"
    assert batch_ddl(query(engine=bare), bare, ("d", "t"), LAYOUT, {"a": 1}).endswith(
        "ENGINE = MergeTree ORDER BY id SETTINGS a = 1"
    )


@pytest.mark.parametrize(
    ("name", "columns", "engine", "layout"),
    [
        ("d.other", COLUMNS, ENGINE, LAYOUT),  # another table's CREATE
        ("d.t", COLUMNS, ENGINE, LAYOUT[:2]),  # a column more than read
        ("d.t", COLUMNS, ENGINE, (*LAYOUT[:2], ("s", "String", ""))),  # another kind
        ("d.t", COLUMNS, ENGINE, (*LAYOUT[:2], ("s", "LowCardinality(String)", "DEFAULT"))),
        ("d.t", COLUMNS.replace("DEFAULT 'x'", "MATERIALIZED 'x'"), ENGINE,
         (*LAYOUT[:2], ("s", "String", "MATERIALIZED"))),  # computed again by the CREATE
        ("d.t", COLUMNS.replace("`s` String DEFAULT 'x'", "`s` Nested(a String)"), ENGINE,
         (*LAYOUT[:2], ("s", "Nested(a String)", ""))),  # flattened by a session
        ("d.t", COLUMNS.replace("DEFAULT 'x'", "TTL toDate(p) + 1"), ENGINE,
         (*LAYOUT[:2], ("s", "String", ""))),  # a column TTL
        ("d.t", COLUMNS, ENGINE.replace(" SETTINGS", " TTL toDate(p) SETTINGS"), LAYOUT),
        ("d.t", COLUMNS[:-1], ENGINE, LAYOUT),  # unbalanced
    ],
)  # fmt: skip
def test_a_create_that_is_not_read_exactly_has_no_shape(
    name: str, columns: str, engine: str, layout: tuple[tuple[str, str, str], ...]
) -> None:
    assert batch_ddl(query(name, columns, engine), engine, ("d", "t"), layout, STAGING) == ""


def test_a_comment_or_a_settings_word_inside_a_name_is_no_clause() -> None:
    engine = "MergeTree ORDER BY `k SETTINGS x` SETTINGS index_granularity = 8192"
    layout = (("k SETTINGS x", "Int64", ""),)
    columns = "(`k SETTINGS x` Int64)"
    made = batch_ddl(query(columns=columns, engine=engine), engine, ("d", "t"), layout, {"a": 1})
    assert made == f"{columns} ENGINE = MergeTree ORDER BY `k SETTINGS x` SETTINGS " + (
        "index_granularity = 8192, a = 1"
    )
    commented = query(columns=columns, engine=engine) + " COMMENT 'c'"
    assert batch_ddl(commented, engine, ("d", "t"), layout, {"a": 1}) == ""


def test_a_column_named_ttl_is_not_a_ttl_clause() -> None:
    """Every staging of a target partitioned by a column named ttl was refused as a TTL
    target (found in the review of issue 39's task CREATE)."""
    from txsink.clickhouse.sqltext import has_ttl

    assert not has_ttl("MergeTree PARTITION BY ttl ORDER BY k SETTINGS index_granularity = 8192")
    assert not has_ttl("MergeTree PARTITION BY `TTL x` ORDER BY k")
    assert not has_ttl("MergeTree ORDER BY k COMMENT ' TTL '")
    assert has_ttl("MergeTree ORDER BY k TTL d + toIntervalDay(1) SETTINGS x = 1")
