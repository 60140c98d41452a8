"""Options people know (issue 28): ClickHouse settings passed as ``settings.<name>``,
the settings txsink owns refused with the reason, internal options kept out of what users
see, and the spellings other writers use (pure: no services)."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from txsink.clickhouse.client import Client
from txsink.clickhouse.dedup_insert import insert_settings
from txsink.clickhouse.insert_settings import (
    DEDUP_INSERT_SETTINGS,
    STAGING_INSERT_SETTINGS,
    SettingValue,
    passthrough_problems,
    refused_setting,
    refused_settings,
)
from txsink.clickhouse.warehouse import ClickHouseWarehouse
from txsink.config import WriterConfig
from txsink.errors import ConfigError, TxSinkError
from txsink.options import ALIASES, OPTIONS
from txsink.protocol.ids import staging_name

BASE = {"url": "http://h:8123", "table": "db.t", "keeper": "k:2181", "job": "j1"}

# --------------------------------------------------------------------------- settings.<name>


def test_settings_options_become_one_sorted_tuple_of_text_values() -> None:
    cfg = WriterConfig.from_options(
        {
            **BASE,
            "settings.max_insert_threads": "1",
            "settings.insert_quorum": "2",
            "settings.log_comment": " spaced, with a comma ",
        }
    )
    assert cfg.settings == (
        ("insert_quorum", "2"),
        ("log_comment", " spaced, with a comma "),
        ("max_insert_threads", "1"),
    )
    # picklable and hashable as before (executors, the validation cache), and rebuilt
    # from its options by foreach_batch, a comma in a value included
    assert pickle.loads(pickle.dumps(cfg)) == cfg and hash(cfg) == hash(
        pickle.loads(pickle.dumps(cfg))
    )
    assert WriterConfig.from_options(cfg.to_options()) == cfg
    assert "settings.log_comment" in cfg.to_options()
    assert WriterConfig.from_options(BASE).settings == ()


def test_the_settings_list_and_its_kafka_connect_spelling() -> None:
    listed = WriterConfig.from_options({**BASE, "settings": "insert_quorum=2, log_comment=etl,"})
    kafka = WriterConfig.from_options(
        {**BASE, "clickhouseSettings": "log_comment=etl,insert_quorum=2"}
    )
    assert listed.settings == kafka.settings == (("insert_quorum", "2"), ("log_comment", "etl"))
    both = WriterConfig.from_options(
        {**BASE, "settings": "insert_quorum=2", "settings.log_comment": "etl"}
    )
    assert both.settings == listed.settings


@pytest.mark.parametrize(
    ("options", "needle"),
    [
        ({"settings": "insert_quorum"}, "name=value pairs"),
        ({"settings": "insert_quorum=1,insert_quorum=2"}, "names setting insert_quorum twice"),
        ({"settings.insert-quorum": "1"}, "not a ClickHouse setting name"),
        ({"settings.": "1"}, "not a ClickHouse setting name"),
    ],
)
def test_a_malformed_setting_names_its_option(options: dict[str, str], needle: str) -> None:
    with pytest.raises(ConfigError, match="settings") as info:
        WriterConfig.from_options({**BASE, **options})
    assert needle in str(info.value)


def test_one_setting_given_twice_with_different_values_is_refused_naming_both() -> None:
    with pytest.raises(ConfigError) as info:
        WriterConfig.from_options(
            {**BASE, "settings.insert_quorum": "2", "clickhouse_setting_insert_quorum": "3"}
        )
    assert "settings.insert_quorum='2'" in str(info.value)
    assert "clickhouse_setting_insert_quorum='3'" in str(info.value)
    with pytest.raises(ConfigError, match="insert_quorum is given twice"):
        WriterConfig.from_options(
            {**BASE, "settings": "insert_quorum=2", "settings.insert_quorum": "3"}
        )
    same = WriterConfig.from_options(
        {**BASE, "settings.insert_quorum": "2", "clickhouse_setting_insert_quorum": "2"}
    )
    assert same.settings == (("insert_quorum", "2"),)


@pytest.mark.parametrize(
    ("name", "why", "fix"),
    [
        ("insert_deduplicate", "block deduplication", "leave it out"),
        ("insert_deduplication_token", "identity", "leave it out"),
        ("async_insert", "synchronous inserts", "leave it out"),
        ("wait_for_async_insert", "synchronous inserts", "leave it out"),
        ("async_insert_deduplicate", "deduplication", "leave it out"),
        ("deduplicate_blocks_in_dependent_materialized_views", "views", "leave it out"),
        ("max_insert_block_size", "blocks txsink cuts", "block_rows / block_bytes"),
        ("min_insert_block_size_rows", "blocks txsink cuts", "block_rows / block_bytes"),
        ("min_insert_block_size_bytes", "blocks txsink cuts", "block_rows / block_bytes"),
        ("input_format_null_as_default", "values stored", "leave it out"),
        ("insert_null_as_default", "values stored", "leave it out"),
        ("date_time_overflow_behavior", "values stored", "leave it out"),
        ("input_format_arrow_allow_missing_columns", "which column", "leave it out"),
        ("session_id", "connection", "writer options"),
        ("enable_http_compression", "connection", "compress"),
    ],
)
def test_a_setting_txsink_owns_is_refused_naming_it_the_reason_and_the_fix(
    name: str, why: str, fix: str
) -> None:
    for key in (f"settings.{name}", f"clickhouse_setting_{name}"):
        with pytest.raises(ConfigError) as info:
            WriterConfig.from_options({**BASE, key: "1"})
        text = str(info.value)
        assert f"settings.{name}: {name} decides" in text and why in text and fix in text
    with pytest.raises(ConfigError, match=f"settings.{name}"):
        WriterConfig.from_options({**BASE, "settings": f"log_comment=x,{name}=1"})


def test_every_refused_setting_is_named_in_one_error() -> None:
    with pytest.raises(ConfigError) as info:
        WriterConfig.from_options(
            {**BASE, "settings.async_insert": "1", "settings.max_insert_block_size": "10",
             "settings.insert_quorum": "2"}
        )  # fmt: skip
    text = str(info.value)
    assert "settings.async_insert:" in text and "settings.max_insert_block_size:" in text
    assert "insert_quorum" not in text and "docs/options.md#clickhouse-settings" in text


def test_one_list_decides_every_refusal_and_txsinks_own_settings_are_on_it() -> None:
    refused = refused_settings()
    for name in (*STAGING_INSERT_SETTINGS, *DEDUP_INSERT_SETTINGS, "insert_deduplication_token"):
        assert name in refused and refused_setting(name), name
    for allowed in ("insert_quorum", "insert_quorum_parallel", "max_insert_threads",
                    "log_comment", "insert_shard_id", "max_execution_time"):  # fmt: skip
        assert refused_setting(allowed) is None, allowed
    docs = (Path(__file__).parents[2] / "docs" / "options.md").read_text()
    assert all(f"`{name}`" in docs for name in refused)  # the generated list


# --------------------------------------------------------------------------- the inserts


class _Raw:
    """What the warehouse asks of clickhouse-connect for inserts: the settings lookup of
    Client.known and insert_arrow, recorded."""

    def __init__(self) -> None:
        self.inserts: list[dict[str, Any]] = []

    def query(self, sql: str, parameters: dict[str, Any], settings: Any) -> Any:
        class Result:
            result_rows = [(n, "0", 0, 0, None, None) for n in parameters["names"]]

        return Result()

    def insert_arrow(self, table: str, arrow: Any, database: str, settings: Any) -> None:
        self.inserts.append(dict(settings or {}))


def _batch(n: int) -> pa.RecordBatch:
    return pa.RecordBatch.from_pydict({"k": list(range(n))})


def test_staging_inserts_carry_the_users_settings_under_txsinks_own() -> None:
    raw = _Raw()
    wh = ClickHouseWarehouse(Client(raw, "http://h:8123"), "txsink_staging")
    name = staging_name("j1", "b0", "00000000", 0, 0, 1).table
    user = {"insert_quorum": "2", "async_insert": "1"}  # the second never gets past config
    wh.insert_blocks(name, [_batch(5)], block_rows=2, block_bytes=1 << 20, settings=user)
    assert len(raw.inserts) == 3
    for sent in raw.inserts:
        assert sent["insert_quorum"] == "2" and sent["async_insert"] == 0
        assert {k: sent[k] for k in STAGING_INSERT_SETTINGS} == STAGING_INSERT_SETTINGS


def test_dedup_blocks_carry_the_users_settings_under_the_token_and_txsinks_own() -> None:
    block = insert_settings("j1", "b3", 0, 1, (("insert_quorum", "2"), ("insert_deduplicate", "0")))
    assert block["insert_quorum"] == "2"
    assert {k: block[k] for k in DEDUP_INSERT_SETTINGS} == DEDUP_INSERT_SETTINGS
    assert (
        block["insert_deduplication_token"]
        == insert_settings("j1", "b3", 0, 1)["insert_deduplication_token"]
    )


# --------------------------------------------------------------------------- validation


def _have(name: str, value: str = "0", readonly: bool = False, **kw: Any) -> SettingValue:
    return SettingValue(name, value, False, readonly, **kw)


def test_an_unknown_setting_name_is_refused_with_a_did_you_mean() -> None:
    problems = passthrough_problems(
        {"log_comment": _have("log_comment", "")},
        {"insert_quorom": "2", "log_comment": "x"},
        user="etl",
        known=["insert_quorum", "log_comment", "max_insert_threads"],
    )
    assert len(problems) == 1
    assert "settings.insert_quorom" in problems[0]
    assert "(did you mean insert_quorum?)" in problems[0]


def test_a_value_the_users_constraints_forbid_is_refused_as_txsinks_own_would_be() -> None:
    effective = {
        "insert_quorum": _have("insert_quorum", "0", readonly=True),
        "max_insert_threads": _have("max_insert_threads", "0", max="4"),
    }
    problems = passthrough_problems(
        effective, {"insert_quorum": "2", "max_insert_threads": "8"}, user="etl"
    )
    assert any("insert_quorum=0 is fixed for user etl" in p for p in problems)
    assert any("max_insert_threads is bounded to [-, 4]" in p for p in problems)
    ok = passthrough_problems(
        effective, {"insert_quorum": "0", "max_insert_threads": "2"}, user="u"
    )
    assert ok == []


class _Client:
    url = "http://h:8123"

    def __init__(self, names: list[str]) -> None:
        self.names = names

    def effective_settings(self, names: Any) -> dict[str, SettingValue]:
        return {n: _have(n) for n in names if n in self.names}

    def setting_names(self) -> list[str]:
        return self.names

    def query_rows(self, sql: str, settings: dict[str, str], what: str) -> list[Any]:
        if any(not v.isdigit() for v in settings.values()):  # the server parses values
            raise TxSinkError("Code: 27. Cannot parse input: expected UInt64")
        return [(1,)]


def test_validation_refuses_an_unknown_setting_or_a_bad_value_before_anything_is_written() -> None:
    pytest.importorskip("pyspark")
    from txsink.spark.validate import check_insert_settings

    names = [*STAGING_INSERT_SETTINGS, *DEDUP_INSERT_SETTINGS, "readonly", "insert_quorum"]

    class Warehouse:
        client = _Client(names)

    cfg = WriterConfig.from_options({**BASE, "settings.insert_quorom": "2"})
    with pytest.raises(ConfigError) as info:
        check_insert_settings(cfg, Warehouse(), "attach")
    text = str(info.value)
    assert "did you mean insert_quorum?" in text and "nothing was written" in text
    bad_value = WriterConfig.from_options({**BASE, "settings.insert_quorum": "two"})
    refused = r"the server refused them \(Code: 27.*\): settings\.insert_quorum='two'"
    with pytest.raises(ConfigError, match=refused):
        check_insert_settings(bad_value, Warehouse(), "dedup")
    good = WriterConfig.from_options({**BASE, "settings.insert_quorum": "2"})
    check_insert_settings(good, Warehouse(), "dedup")


# --------------------------------------------------------------------------- internal options


def test_internal_options_are_kept_out_of_the_docs_table_and_of_errors() -> None:
    internal = [n for n, o in OPTIONS.items() if o.internal]
    assert internal == ["run_id", "micro_batch"]
    docs = (Path(__file__).parents[2] / "docs" / "options.md").read_text()
    for name in internal:
        assert f"| `{name}` |" not in docs
        with pytest.raises(ConfigError) as info:
            WriterConfig.from_options({**BASE, name.replace("_", "") + "x": "1"})
        assert name not in str(info.value)
    with pytest.raises(ConfigError) as info:
        WriterConfig.from_options({**BASE, "run_ix": "r"})
    assert "did you mean" not in str(info.value) and "run_id" not in str(info.value)


def test_foreach_batch_still_hands_internal_options_to_the_writer() -> None:
    cfg = WriterConfig.from_options({**BASE, "run_id": "r1", "micro_batch": "true"})
    again = WriterConfig.from_options(cfg.to_options())
    assert (again.run_id, again.micro_batch) == ("r1", True)


# --------------------------------------------------------------------------- aliases


@pytest.mark.parametrize(
    ("alias", "value", "option", "parsed"),
    [
        ("username", "etl", "user", "etl"),  # Kafka Connect
        ("spark.clickhouse.write.batchSize", "10000", "block_rows", 10000),  # SCC
        ("spark.clickhouse.write.compression.codec", "none", "compress", "none"),  # SCC
    ],
)
def test_spellings_from_kafka_connect_and_scc_are_aliases(
    alias: str, value: str, option: str, parsed: Any
) -> None:
    assert ALIASES[alias.lower()] == option
    cfg = WriterConfig.from_options({**BASE, alias: value})
    assert getattr(cfg, option) == parsed
    assert alias.lower() not in cfg.to_options()
    with pytest.raises(ConfigError, match=f"'{alias.lower()}' is another name for '{option}'"):
        WriterConfig.from_options({**BASE, alias: value, option: "other-" + value})


def test_every_alias_names_an_option_a_user_gives() -> None:
    assert all(name in OPTIONS and not OPTIONS[name].internal for name in ALIASES.values())
    assert all(alias == alias.lower() and alias not in OPTIONS for alias in ALIASES)


def test_a_misspelt_alias_gets_a_did_you_mean_naming_the_option() -> None:
    with pytest.raises(ConfigError, match=r"usernme \(did you mean username \(user\)\?\)"):
        WriterConfig.from_options({**BASE, "usernme": "etl"})
