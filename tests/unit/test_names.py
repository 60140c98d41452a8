"""Table names and URLs have one parser each (txsink.names), and every caller agrees."""

from __future__ import annotations

import pytest

from txsink.config import WriterConfig
from txsink.errors import ConfigError
from txsink.names import Endpoint, parse_url, qualified, split_table

BASE = {"url": "http://h:8123", "table": "db.t", "keeper": "k:2181", "job": "j1"}


@pytest.mark.parametrize(
    ("name", "parts"),
    [
        ("db.events", ("db", "events")),
        ("  db.events  ", ("db", "events")),
        ("_db.t_1", ("_db", "t_1")),
        ("db.`my table`", ("db", "my table")),
        ("`db`.`t`", ("db", "t")),
        ("`my.db`.`odd``name`", ("my.db", "odd`name")),
        ("`a\\`b`.t", ("a`b", "t")),
        ("`my-db`.t", ("my-db", "t")),
    ],
)
def test_a_dotted_or_backquoted_name_splits_into_database_and_table(
    name: str, parts: tuple[str, str]
) -> None:
    assert split_table(name) == parts


@pytest.mark.parametrize(
    "name",
    [
        "nodot",
        "a.b.c",
        "db.",
        ".t",
        "db..t",
        "my-db.t",
        "1db.t",
        "db.`open",
        "`db`x.t",
        "db.t.",
        "",
        "'db'.'t'",
        '"db"."t"',
    ],
)
def test_a_bad_table_name_is_refused_naming_the_option(name: str) -> None:
    with pytest.raises(ConfigError, match=r"option tbl=.*db\.table"):
        split_table(name, option="tbl")


def test_the_writer_and_the_client_agree_on_backquoted_names() -> None:
    cfg = WriterConfig.from_options({**BASE, "table": "db.`my table`"})
    assert (cfg.database, cfg.table_name) == ("db", "my table")
    assert cfg.table == "db.`my table`"  # kept as given: it is the job's recorded target
    assert split_table(cfg.table) == ("db", "my table")  # what the warehouse reads
    assert qualified(cfg.database, cfg.table_name) == "`db`.`my table`"
    for bad in ("db.`my.table", "my-db.t", "a.b.c"):
        with pytest.raises(ConfigError, match="table"):
            WriterConfig.from_options({**BASE, "table": bad})


@pytest.mark.parametrize(
    ("url", "endpoint"),
    [
        ("http://h", Endpoint("http", "h", 8123, "http://h")),
        ("https://h", Endpoint("https", "h", 8443, "https://h")),
        ("http://h:18123", Endpoint("http", "h", 18123, "http://h:18123")),
        ("http://h:18123/", Endpoint("http", "h", 18123, "http://h:18123")),
        ("http://u:p@h:1", Endpoint("http", "h", 1, "http://h:1")),
        ("http://[::1]:9", Endpoint("http", "::1", 9, "http://[::1]:9")),
    ],
)
def test_a_url_parses_to_an_endpoint_without_userinfo(url: str, endpoint: Endpoint) -> None:
    assert parse_url(url) == endpoint


@pytest.mark.parametrize(
    ("url", "needle"),
    [
        ("h:8123", "does not look like"),
        ("127.0.0.1:8123", "does not look like"),
        ("ftp://h", "does not look like"),
        ("http://", "does not look like"),
        ("", "does not look like"),
        ("http://h:8123/db", "only scheme, host and port"),
        ("http://h:8123?database=x", "only scheme, host and port"),
        ("http://h:port", "invalid port"),
        ("chdb://memory", "does not look like"),
    ],
)
def test_a_bad_url_is_refused_naming_the_option(url: str, needle: str) -> None:
    with pytest.raises(ConfigError, match="option 'srv'") as info:
        parse_url(url, option="srv")
    assert needle in str(info.value)


def test_userinfo_is_refused_where_credentials_must_come_separately() -> None:
    with pytest.raises(ConfigError, match="credentials") as info:
        parse_url("http://u:secret@h:1", option="shards", userinfo=False)
    assert "secret" not in str(info.value)


def test_chdb_urls_only_where_the_caller_allows_them() -> None:
    assert parse_url("chdb://memory", allow_chdb=True).scheme == "chdb"
    with pytest.raises(ConfigError):
        WriterConfig.from_options({**BASE, "url": "chdb://memory"})


def test_the_writer_refuses_what_the_client_would_refuse() -> None:
    """The writer validates url with the client's parser: a path is refused up front,
    not at the first connection."""
    with pytest.raises(ConfigError, match="only scheme, host and port"):
        WriterConfig.from_options({**BASE, "url": "http://h:8123/db"})
    assert WriterConfig.from_options({**BASE, "url": "http://h:8123/"}).url == "http://h:8123"
