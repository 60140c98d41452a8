"""Option parsing: every key documented, errors name the bad key."""

from __future__ import annotations

from pathlib import Path

import pytest

from txsink.config import OPTIONS, WriterConfig
from txsink.errors import ConfigError

BASE = {"url": "http://h:8123", "table": "db.t", "keeper": "k:2181", "job": "j1"}


def test_every_option_is_documented_in_docs_options_md() -> None:
    text = (Path(__file__).parents[2] / "docs" / "options.md").read_text()
    missing = [k for k in OPTIONS if f"`{k}`" not in text]
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
