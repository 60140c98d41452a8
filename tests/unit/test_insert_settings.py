"""Insert settings txsink relies on: code 252 told apart by its message, the 26.x
spellings sent only where the server knows them, and a writer's profile that would break
the guarantee refused by name (pure: no services)."""

from __future__ import annotations

from typing import Any

import pytest

from txsink.clickhouse.client import Client
from txsink.clickhouse.dedup_insert import insert_settings
from txsink.clickhouse.error_map import Transience, classify, map_error, too_many_partitions
from txsink.clickhouse.insert_settings import (
    DEDUP_INSERT_SETTINGS,
    STAGING_INSERT_SETTINGS,
    SettingValue,
    after_prepare_settings,
    insert_settings_problems,
    statement_settings_problems,
)
from txsink.clickhouse.retry import RetryPolicy
from txsink.errors import ConfigError, FencedError, RetryableConflict

PARTITIONS = (
    "Code: 252. DB::Exception: Too many partitions for single INSERT block (more than "
    "100). The limit is controlled by 'max_partitions_per_insert_block' setting. Large "
    "number of partitions is a common misconception. (TOO_MANY_PARTS) (version 26.9.2.1)"
)
PARTS = (
    "Code: 252. DB::Exception: Too many parts (300 with average size of 1.00 KiB) in "
    "table 'db.t'. Merges are processing significantly slower than inserts. "
    "(TOO_MANY_PARTS) (version 26.9.2.1)"
)


class ServerError(Exception):
    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.code = 252


def test_too_many_partitions_per_block_is_never_back_pressure() -> None:
    exc = ServerError(PARTITIONS)
    assert too_many_partitions(exc)
    assert classify(exc) is Transience.PERMANENT
    mapped = map_error(exc, url="http://h:8123", what="INSERT of 150 rows into db.t")
    assert isinstance(mapped, ConfigError) and mapped.code == 252
    text = str(mapped)
    assert "max_partitions_per_insert_block" in text and "busy" not in text
    assert "db.t" in text and "not back-pressure" in text


def test_too_many_parts_stays_back_pressure_and_is_retried() -> None:
    exc = ServerError(PARTS)
    assert not too_many_partitions(exc)
    assert classify(exc) is Transience.REJECTED
    assert isinstance(map_error(exc, url="http://h:8123", what="INSERT"), RetryableConflict)


def test_a_block_refused_for_its_partitions_is_sent_once_not_retried() -> None:
    calls: list[int] = []

    def insert() -> None:
        calls.append(1)
        raise ServerError(PARTITIONS)

    policy = RetryPolicy(attempts=5, sleep=lambda _: None)
    with pytest.raises(ServerError):
        policy.run(insert, idempotent=True, what="INSERT")
    assert len(calls) == 1


def test_a_dedup_block_is_not_sent_again_once_its_batch_is_sealed() -> None:
    """A block with a dedup token is retried after an unknown outcome (the reply lost),
    possibly minutes later (back-off, timeouts): by then the batch may have committed on
    another attempt and the token left the window. ``resend_ok`` is asked before every
    retry, never before the first send (issue 38 row 1, review finding 3)."""
    sent: list[int] = []
    asked: list[int] = []
    sealed = False

    def insert() -> None:
        nonlocal sealed
        sent.append(1)
        sealed = True  # the batch commits on another attempt while this reply is lost
        raise OSError("Connection reset by peer")

    def resend_ok() -> bool:
        asked.append(1)
        return not sealed

    policy = RetryPolicy(attempts=5, sleep=lambda _: None)
    with pytest.raises(FencedError, match="not sent again"):
        policy.run(insert, idempotent=True, what="INSERT", resend_ok=resend_ok)
    assert (len(sent), len(asked)) == (1, 1)
    sealed_never = RetryPolicy(attempts=3, sleep=lambda _: None)
    sent.clear()
    with pytest.raises(OSError):  # still wanted: retried as before, up to the attempts
        sealed_never.run(insert, idempotent=True, what="INSERT", resend_ok=lambda: True)
    assert len(sent) == 3


def test_staging_and_dedup_inserts_pin_both_spellings_of_deduplication() -> None:
    assert STAGING_INSERT_SETTINGS["insert_deduplicate"] == 0
    assert STAGING_INSERT_SETTINGS["deduplicate_insert"] == "disable"
    assert STAGING_INSERT_SETTINGS["max_partitions_per_insert_block"] == 0
    block = insert_settings("job", "b1", 3, 0)
    assert block["insert_deduplication_token"]
    assert block["insert_deduplicate"] == 1 and block["deduplicate_insert"] == "enable"
    assert block["async_insert"] == 0 and block["max_partitions_per_insert_block"] == 0
    assert {k: block[k] for k in DEDUP_INSERT_SETTINGS} == DEDUP_INSERT_SETTINGS


class _Result:
    def __init__(self, rows: list[tuple[Any, ...]]) -> None:
        self.result_rows = rows


class _Raw:
    """The two calls Client.known makes of clickhouse-connect, with a server's settings."""

    def __init__(self, names: set[str]) -> None:
        self.names = names
        self.queries = 0

    def query(self, sql: str, parameters: dict[str, Any], settings: Any) -> _Result:
        self.queries += 1
        return _Result([(n, "0", 0, 0, None, None) for n in parameters["names"] if n in self.names])


def test_a_setting_the_server_does_not_know_is_left_out_and_looked_up_once() -> None:
    old = _Raw({"insert_deduplicate", "async_insert"})  # a server before deduplicate_insert
    client = Client(old, "http://old:8123")
    for _ in range(3):
        sent = client.known(dict(STAGING_INSERT_SETTINGS), ["deduplicate_insert"])
        assert "deduplicate_insert" not in sent and sent["insert_deduplicate"] == 0
    assert old.queries == 1
    new = Client(_Raw({"deduplicate_insert"}), "http://new:8123")
    assert new.known(dict(STAGING_INSERT_SETTINGS), ["deduplicate_insert"]) == (
        STAGING_INSERT_SETTINGS
    )


def _eff(**values: SettingValue) -> dict[str, SettingValue]:
    return dict(values)


def test_profile_defaults_that_txsink_overrides_are_accepted() -> None:
    effective = _eff(
        deduplicate_insert=SettingValue("deduplicate_insert", "disable", True, False),
        async_insert=SettingValue("async_insert", "1", True, False),
        readonly=SettingValue("readonly", "0", False, False),
    )
    assert insert_settings_problems(effective, DEDUP_INSERT_SETTINGS, user="u", mode="dedup") == []


@pytest.mark.parametrize(
    ("effective", "words"),
    [
        (
            {"deduplicate_insert": SettingValue("deduplicate_insert", "disable", True, True)},
            ["deduplicate_insert=disable", "needs deduplicate_insert=enable", "user etl"],
        ),
        (
            {"async_insert": SettingValue("async_insert", "1", True, True)},
            ["async_insert=1", "needs async_insert=0", "synchronous"],
        ),
        (
            {
                "max_partitions_per_insert_block": SettingValue(
                    "max_partitions_per_insert_block", "100", False, False, "1", "1000"
                )
            },
            [
                "max_partitions_per_insert_block is bounded",
                "needs max_partitions_per_insert_block=0",
            ],
        ),
        ({"readonly": SettingValue("readonly", "1", True, False)}, ["readonly=1", "user etl"]),
    ],
)
def test_a_profile_that_forbids_a_needed_setting_is_refused_naming_it(
    effective: dict[str, SettingValue], words: list[str]
) -> None:
    problems = insert_settings_problems(effective, DEDUP_INSERT_SETTINGS, user="etl", mode="dedup")
    assert len(problems) == 1
    for word in words:
        assert word in problems[0]
    assert "profile" in problems[0]


@pytest.mark.parametrize(
    ("name", "value", "lo", "hi"),
    [
        ("log_queries", "0", None, None),  # const: the profile does not log queries
        ("log_comment", "", None, None),  # read-only: any tag is a change
        ("log_queries_min_type", "QUERY_FINISH", None, None),
        ("log_queries_min_query_duration_ms", "1000", "1000", None),  # bounded below
        ("log_queries_probability", "0.1", None, "0.5"),
    ],
)
def test_a_profile_that_forbids_a_setting_of_the_batch_publish_refuses_the_job(
    name: str, value: str, lo: str | None, hi: str | None
) -> None:
    """Issue 38 row 5: the ATTACH of visibility=batch sends log_* settings; a constraint
    on any of them is found before anything is staged, with the way around it."""
    fixed = lo is None and hi is None
    effective = {name: SettingValue(name, value, True, fixed, lo, hi)}
    (sender, fix, settings), gather = after_prepare_settings("attach", "batch", "keeper")
    (msg,) = statement_settings_problems(effective, settings, user="etl", sender=sender, fix=fix)
    assert name in msg and "user etl" in msg and "use visibility=partition" in msg
    assert dict(gather[2]) == {"insert_allow_materialized_columns": 1}
    forbids = {k: SettingValue(k, "0", True, True, None, None) for k in gather[2]}
    (msg,) = statement_settings_problems(
        forbids, gather[2], user="etl", sender=gather[0], fix=gather[1]
    )
    assert "gathers a batch" in msg and "set compact_bytes=0 or use visibility=partition" in msg
    assert after_prepare_settings("attach", "partition", "keeper") == []
    assert after_prepare_settings("dedup", "batch", "keeper") == []  # batch needs attach
    names = [
        n for _, _, s in after_prepare_settings("attach", "partition", "clickhouse") for n in s
    ]
    assert names == ["keeper_map_strict_mode", "max_query_size"]


def test_a_constraint_that_already_holds_the_needed_value_is_fine() -> None:
    effective = {"async_insert": SettingValue("async_insert", "0", True, True)}
    assert (
        insert_settings_problems(effective, STAGING_INSERT_SETTINGS, user="u", mode="attach") == []
    )
    bools = {"async_insert": SettingValue("async_insert", "false", True, True)}
    assert insert_settings_problems(bools, STAGING_INSERT_SETTINGS, user="u", mode="attach") == []
