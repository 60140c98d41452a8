"""Option parsing: every key documented, errors name the bad key."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

import pytest

from txsink.clickhouse.client import ConnectSettings
from txsink.config import OPTIONS, WriterConfig
from txsink.errors import ConfigError
from txsink.options import Kind

BASE = {"url": "http://h:8123", "table": "db.t", "keeper": "k:2181", "job": "j1"}


def test_every_option_is_documented_in_docs_options_md() -> None:
    text = (Path(__file__).parents[2] / "docs" / "options.md").read_text()
    missing = [k for k in OPTIONS if not OPTIONS[k].internal and f"`{k}`" not in text]
    assert missing == []


def test_defaults_and_round_trip_through_options() -> None:
    cfg = WriterConfig.from_options(BASE)
    assert (cfg.mode, cfg.staging_database, cfg.keeper_root) == (
        "auto",
        "txsink_staging",
        "/txsink",
    )
    assert WriterConfig.from_options(cfg.to_options()) == cfg


@pytest.mark.parametrize(
    ("key", "value", "needle"),
    [
        ("table", "nodot", "db.table"),
        ("url", "ftp://x", "http(s)://"),
        ("mode", "sometimes", "auto, attach, dedup"),
        ("block_rows", "ten", "integer"),
        ("block_rows", "0", ">= 1"),
        ("job", "bad/name", "job"),
        ("keeper_timeout", "-1", "> 0"),
        ("verify", "maybe", "true or false"),
        ("compress", "snappy", "lz4"),
    ],
)
def test_a_bad_value_names_its_key(key: str, value: str, needle: str) -> None:
    with pytest.raises(ConfigError, match=key) as info:
        WriterConfig.from_options({**BASE, key: value})
    assert needle in str(info.value)


def test_missing_required_option_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TXSINK_KEEPER", raising=False)
    with pytest.raises(ConfigError, match="'keeper' is required"):
        WriterConfig.from_options({k: v for k, v in BASE.items() if k != "keeper"})


def test_spark_owned_options_are_ignored_and_unknown_ones_refused() -> None:
    WriterConfig.from_options({**BASE, "checkpointLocation": "/c", "path": "p"})
    with pytest.raises(ConfigError, match="unknown option"):
        WriterConfig.from_options({**BASE, "blocksize": "1"})


_TYPES = {
    Kind.INT: int,
    Kind.SECONDS: float,
    Kind.BOOL: bool,
    Kind.LIST: tuple[str, ...],
    Kind.URLS: tuple[str, ...],
    Kind.SETTINGS: tuple[tuple[str, str], ...],
}


def test_the_registry_and_the_config_fields_name_the_same_options_with_the_same_types() -> None:
    hints = typing.get_type_hints(WriterConfig)
    assert set(hints) == set(OPTIONS)
    for name, opt in OPTIONS.items():
        want = _TYPES.get(opt.kind, str)
        assert hints[name] == (want | None if opt.optional else want), name


def test_every_default_parses_and_field_defaults_agree_with_the_registry() -> None:
    cfg = WriterConfig.from_options(BASE)
    for name, opt in OPTIONS.items():
        if opt.default is not None and name not in BASE:
            assert getattr(cfg, name) == opt.parse(opt.default), name
    for f in dataclasses.fields(WriterConfig):
        if f.default is not dataclasses.MISSING:
            assert f.default == OPTIONS[f.name].parse(OPTIONS[f.name].default or ""), f.name


def test_defaults_are_unchanged() -> None:
    """Option names and defaults are a contract (renames are another issue's)."""
    assert {n: o.default for n, o in OPTIONS.items()} == {
        "url": None, "user": "default", "password": "", "table": None, "keeper": None,
        "job": None, "mode": "auto", "visibility": "auto", "compact_bytes": "1073741824",
        "staging_database": "txsink_staging", "keeper_root": "/txsink", "keeper_auth": "",
        "state": "keeper", "state_database": "txsink_state",
        "keeper_timeout": "15", "keeper_retry_s": "30", "block_rows": "1000000",
        "block_bytes": "268435456", "compress": "lz4", "connect_timeout": "10",
        "send_receive_timeout": "300", "verify": "true", "ca_cert": "",
        "retry_attempts": "5", "retry_max_wait": "30", "publish_retry_s": "60",
        "txn_version": "", "first_batch": "", "retention": "1000", "dedup_order_by": "",
        "dedup_min_window": "100", "skip_committed_replays": "true", "metrics_textfile": "",
        "shards": "", "shard_by": "", "shard_http_port": "", "settings": "", "metrics_port": "",
        "run_id": "", "micro_batch": "false", "create_table": "never", "order_by": "",
        "partition_by": "", "engine": "MergeTree", "table_settings": "",
    }  # fmt: skip
    assert [n for n, o in OPTIONS.items() if o.internal] == ["run_id", "micro_batch"]


def test_internal_options_are_still_accepted() -> None:
    cfg = WriterConfig.from_options({**BASE, "run_id": "r1", "micro_batch": "true"})
    assert (cfg.run_id, cfg.micro_batch) == ("r1", True)


def test_client_connect_settings_default_to_the_option_defaults() -> None:
    cfg = WriterConfig.from_options(BASE)
    assert ConnectSettings() == ConnectSettings(
        cfg.verify, cfg.ca_cert, cfg.connect_timeout, cfg.send_receive_timeout
    )


@pytest.mark.parametrize(
    ("key", "value", "accepted"),
    [
        ("visibility", "rows", "partition, batch"),
        ("compress", "snappy", "lz4, zstd, gzip, none"),
        ("keeper_auth", "nocolon", "user:password"),
        ("publish_retry_s", "-1", ">= 0"),
        ("block_bytes", "10", ">= 1024"),
        ("txn_version", "x", "integer"),
        ("shard_http_port", "0", ">= 1"),
        ("metrics_port", "0", ">= 1"),
        ("metrics_port", "65536", "<= 65535"),
    ],
)
def test_a_bad_value_error_names_the_key_and_what_it_accepts(
    key: str, value: str, accepted: str
) -> None:
    with pytest.raises(ConfigError, match=f"'{key}'") as info:
        WriterConfig.from_options({**BASE, key: value})
    assert accepted in str(info.value)


def test_environment_fallbacks_are_the_registry_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TXSINK_URL", "http://env:1")
    monkeypatch.setenv("TXSINK_KEEPER", "envk:2")
    monkeypatch.setenv("TXSINK_USER", "not-for-writers")  # the CLI's variable only
    monkeypatch.setenv("TXSINK_JOB", "not-for-writers")
    cfg = WriterConfig.from_options({"table": "db.t", "job": "j", "url": ""})
    assert (cfg.url, cfg.keeper, cfg.user, cfg.job) == ("http://env:1", "envk:2", "default", "j")
    sharded = WriterConfig.from_options({"table": "db.t", "job": "j", "shards": "http://s:3"})
    assert sharded.url == "http://s:3"  # the first shard comes before $TXSINK_URL


def test_docs_options_md_is_what_the_generator_makes_of_it() -> None:
    from txsink.options_doc import main, render

    path = Path(__file__).parents[2] / "docs" / "options.md"
    text = path.read_text()
    assert "<!-- BEGIN GENERATED: options" in text and "<!-- BEGIN GENERATED: cli-flags" in text
    assert render(text) == text, "stale: run python -m txsink.options_doc docs/options.md"
    assert main(["--check", str(path)]) == 0


def test_the_typed_keyword_options_are_the_registry_s() -> None:
    """txsink/writer_options.py (the TypedDict of foreach_batch & co.) is generated."""
    from txsink import writer_options
    from txsink.options import user_options
    from txsink.options_doc import WRITER_OPTIONS_PY, writer_options_module

    path = Path(__file__).parents[2] / WRITER_OPTIONS_PY
    assert path.read_text() == writer_options_module(), "stale: run make docs"
    keys = set(writer_options.WriterOptions.__annotations__)
    assert keys == {n for n in user_options() if n.isidentifier()}
    assert (path.parent / "py.typed").exists()


def test_docs_types_md_is_the_contract_the_code_applies() -> None:
    from txsink.options_doc import main

    path = Path(__file__).parents[2] / "docs" / "types.md"
    assert "<!-- BEGIN GENERATED: types" in path.read_text()
    assert main(["--check", str(path)]) == 0, "stale: run make docs"


def test_spellings_from_other_writers_are_aliases_of_txsinks_options() -> None:
    cfg = WriterConfig.from_options(
        {**BASE, "txnVersion": "7", "commit_mode": "dedup", "tls_verify": "false"}
    )
    assert (cfg.txn_version, cfg.mode, cfg.verify) == (7, "dedup", False)
    delta = WriterConfig.from_options({k: v for k, v in BASE.items() if k != "job"}
                                      | {"txnAppId": "orders-writer"})  # fmt: skip
    assert delta.job == "orders-writer"
    assert "txnversion" not in cfg.to_options()  # the canonical names go on


def test_an_alias_and_its_option_with_different_values_are_refused_naming_both() -> None:
    with pytest.raises(ConfigError, match="'txnversion' is another name for 'txn_version'"):
        WriterConfig.from_options({**BASE, "txnVersion": "7", "txn_version": "8"})
    same = WriterConfig.from_options({**BASE, "txnVersion": "7", "txn_version": "7"})
    assert same.txn_version == 7


def test_an_unknown_option_close_to_a_known_one_says_which() -> None:
    with pytest.raises(ConfigError, match=r"txn_verison \(did you mean txn_version\?\)"):
        WriterConfig.from_options({**BASE, "txn_verison": "1"})
    with pytest.raises(ConfigError, match=r"unknown option\(s\) zzz; known"):
        WriterConfig.from_options({**BASE, "zzz": "1"})


def test_the_cli_prints_its_version(capsys: pytest.CaptureFixture[str]) -> None:
    from txsink.cli.main import main

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.startswith("txsink ")


def test_library_loggers_are_quiet_unless_verbose(capsys: pytest.CaptureFixture[str]) -> None:
    import logging

    from txsink.cli.main import QUIET_LIBRARIES, main

    try:
        main(["embedded", "status", "--dir", "/nonexistent-txsink-dir"])
        assert all(logging.getLogger(n).level == logging.CRITICAL for n in QUIET_LIBRARIES)
        for name in QUIET_LIBRARIES:
            logging.getLogger(name).setLevel(logging.NOTSET)
        main(["--debug", "embedded", "status", "--dir", "/nonexistent-txsink-dir"])
        assert all(logging.getLogger(n).level == logging.NOTSET for n in QUIET_LIBRARIES)
    finally:
        for name in QUIET_LIBRARIES:
            logging.getLogger(name).setLevel(logging.NOTSET)
    capsys.readouterr()


def test_docs_api_md_is_the_code_s_public_api() -> None:
    from txsink.options_doc import main

    path = Path(__file__).parents[2] / "docs" / "api.md"
    assert "<!-- BEGIN GENERATED: api" in path.read_text()
    assert main(["--check", str(path)]) == 0, "stale: run make docs"
