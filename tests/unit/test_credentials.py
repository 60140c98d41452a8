"""Credentials never leak: not in a repr, an error text, the job meta, a log line or CLI output.

Pure parts only (option parsing, the ClickHouse and Keeper error mapping, kazoo's log
records, the CLI's credential flags); the integration twin is
tests/integration/test_credentials_stack.py.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any

import pytest
from clickhouse_connect.driver import exceptions as ch_exc
from kazoo.exceptions import KazooException
from kazoo.protocol.serialization import Auth

from txsink.cli.common import add_common, resolve_credentials
from txsink.cli.main import main
from txsink.clickhouse import client as chc
from txsink.config import WriterConfig
from txsink.credentials import merge_url_credentials, redact_url, scrub, split_url
from txsink.driver import job_meta
from txsink.errors import ConfigError, TxSinkError
from txsink.keeper.kazoo_conn import KazooConn, RedactAuthFilter
from txsink.protocol.codec import encode_job_meta

SECRET = "s3cr3t-Pa55"
KEEPER_SECRET = "zk-S3cret"
BASE = {"table": "db.t", "keeper": "k:2181", "job": "j1"}


def leaky_config() -> WriterConfig:
    return WriterConfig.from_options(
        {
            **BASE,
            "url": f"http://alice:{SECRET}@ch.example:8123",
            "keeper_auth": f"w:{KEEPER_SECRET}",
        }
    )


# --------------------------------------------------------------------------- options


def test_url_userinfo_is_split_into_user_and_password_and_leaves_the_url() -> None:
    cfg = leaky_config()
    assert (cfg.url, cfg.user, cfg.password) == ("http://ch.example:8123", "alice", SECRET)
    enc = WriterConfig.from_options({**BASE, "url": "https://bob:p%40ss%3Aw@h:8443"})
    assert (enc.url, enc.user, enc.password) == ("https://h:8443", "bob", "p@ss:w")
    assert WriterConfig.from_options(cfg.to_options()) == cfg


def test_writer_config_repr_holds_no_secret() -> None:
    cfg = leaky_config()
    text = repr(cfg)
    assert SECRET not in text and KEEPER_SECRET not in text
    assert "password='***'" in text and "keeper_auth='***'" in text
    assert "user='alice'" in text
    # even one built by hand around the parser
    raw = WriterConfig(**{**cfg.__dict__, "url": f"http://alice:{SECRET}@h:1"})
    assert SECRET not in repr(raw) and SECRET not in str(raw)


def test_a_url_password_that_differs_from_the_option_is_refused_without_naming_either() -> None:
    with pytest.raises(ConfigError, match="give the password one way only") as info:
        WriterConfig.from_options(
            {**BASE, "url": f"http://alice:{SECRET}@h:8123", "password": "other-pw"}
        )
    assert SECRET not in str(info.value) and "other-pw" not in str(info.value)
    with pytest.raises(ConfigError, match="option 'user'"):
        WriterConfig.from_options({**BASE, "url": "http://alice:x@h:8123", "user": "bob"})
    same = WriterConfig.from_options(
        {**BASE, "url": f"http://alice:{SECRET}@h:8123", "password": SECRET, "user": "alice"}
    )
    assert same.password == SECRET


def test_password_and_keeper_auth_come_from_the_environment_unless_given(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TXSINK_PASSWORD", SECRET)
    monkeypatch.setenv("TXSINK_KEEPER_AUTH", f"w:{KEEPER_SECRET}")
    cfg = WriterConfig.from_options({**BASE, "url": "http://h:8123"})
    assert (cfg.password, cfg.keeper_auth) == (SECRET, f"w:{KEEPER_SECRET}")
    given = WriterConfig.from_options(
        {**BASE, "url": "http://h:8123", "password": "x", "keeper_auth": "a:b"}
    )
    assert (given.password, given.keeper_auth) == ("x", "a:b")


def test_a_bad_url_error_masks_its_userinfo() -> None:
    with pytest.raises(ConfigError) as info:
        WriterConfig.from_options({**BASE, "url": f"ftp://alice:{SECRET}@h"})
    assert SECRET not in str(info.value) and "got 'ftp://h'" in str(info.value)
    with pytest.raises(ConfigError) as info:
        chc.parse_url(f"http://alice:{SECRET}@h:notaport")
    assert SECRET not in str(info.value)


def test_job_meta_in_keeper_holds_no_credential() -> None:
    cfg = leaky_config()
    meta = json.dumps(encode_job_meta(job_meta(cfg, "attach", "q1")))
    assert SECRET not in meta and KEEPER_SECRET not in meta and "alice" not in meta
    raw = WriterConfig(**{**cfg.__dict__, "url": f"http://alice:{SECRET}@h:1"})
    assert job_meta(raw, "attach").url == "http://h:1"


def test_redaction_helpers() -> None:
    assert redact_url(f"see http://a:{SECRET}@h:1/x and https://b@h") == (
        "see http://***@h:1/x and https://***@h"
    )
    assert split_url("http://h:1").user is None
    assert scrub(f"pw {SECRET}!", [SECRET]) == "pw ***!"
    assert merge_url_credentials("http://u@h", None, "p").password == "p"


# --------------------------------------------------------------------------- ClickHouse


def server_error(code: int, text: str) -> ch_exc.DatabaseError:
    exc = ch_exc.DatabaseError(f"Code: {code}. DB::Exception: {text}")
    return exc


@pytest.mark.parametrize(
    "exc",
    [
        server_error(516, f"alice: Authentication failed: password {SECRET} is incorrect"),
        server_error(60, f"Table db.t does not exist (from http://alice:{SECRET}@h)"),
        server_error(81, f"Database db does not exist {SECRET}"),
        server_error(202, f"Too many simultaneous queries {SECRET}"),
        server_error(62, f"Syntax error near '{SECRET}'"),
        ch_exc.OperationalError(f"Connection refused to http://alice:{SECRET}@h:8123"),
        ch_exc.OperationalError(f"Read timed out {SECRET}"),
    ],
    ids=["auth", "unknown-table", "unknown-db", "busy", "permanent", "refused", "timeout"],
)
def test_mapped_clickhouse_errors_hold_no_password(exc: BaseException) -> None:
    err = chc.map_error(exc, url=f"http://alice:{SECRET}@h:8123", what="INSERT", secrets=(SECRET,))
    assert isinstance(err, TxSinkError)
    assert SECRET not in str(err)


class FailingRaw:
    def command(self, *a: Any, **k: Any) -> Any:
        raise server_error(497, f"user alice with password {SECRET}: not enough privileges")


def test_client_errors_and_retry_log_hold_no_password(caplog: pytest.LogCaptureFixture) -> None:
    client = chc.Client(
        FailingRaw(),
        f"http://alice:{SECRET}@h:8123",
        chc.RetryPolicy(attempts=1),
        secrets=(SECRET,),
    )
    assert SECRET not in repr(client) and SECRET not in client.url
    with pytest.raises(ConfigError) as info:
        client.command("ALTER TABLE db.t MOVE PARTITION 1 TO TABLE db.u")
    assert SECRET not in str(info.value)

    class Flaky:
        calls = 0

        def __call__(self) -> str:
            Flaky.calls += 1
            if Flaky.calls == 1:
                raise server_error(202, f"busy, by the way the password is {SECRET}")
            return "ok"

    caplog.set_level(logging.DEBUG)
    policy = chc.RetryPolicy(attempts=2, sleep=lambda s: None)
    assert policy.run(Flaky(), idempotent=True, what="q", secrets=(SECRET,)) == "ok"
    assert "retrying q" in caplog.text and SECRET not in caplog.text


# --------------------------------------------------------------------------- Keeper


class FakeKazoo:
    """Just enough of a KazooClient for KazooConn to authenticate a reused client."""

    def __init__(self) -> None:
        self.logger = logging.getLogger("tests.fake-kazoo")
        self.handler = type("H", (), {"timeout_exception": TimeoutError})()

    def add_auth_async(self, scheme: str, cred: str) -> Any:
        return type("R", (), {"get": lambda self, timeout=None: True})()


def test_keeper_errors_hold_no_auth() -> None:
    conn = KazooConn("zk:2181", auth=f"writer:{KEEPER_SECRET}", timeout=1, client=FakeKazoo())
    with pytest.raises(TxSinkError) as info, conn.mapped("create /x"):
        raise KazooException(f"server said writer:{KEEPER_SECRET} is odd")
    assert KEEPER_SECRET not in str(info.value) and "Keeper at zk:2181 failed" in str(info.value)


def test_kazoos_auth_packet_log_line_is_masked() -> None:
    record = logging.LogRecord(
        "kazoo.client", logging.DEBUG, __file__, 1, "Sending request(xid=%s): %s",
        (-4, Auth(0, "digest", f"writer:{KEEPER_SECRET}")), None,
    )  # fmt: skip
    assert RedactAuthFilter().filter(record) is True
    assert KEEPER_SECRET not in record.getMessage()
    assert "auth='***'" in record.getMessage()


# --------------------------------------------------------------------------- CLI


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_common(parser)
    return parser.parse_args(argv)


def test_cli_password_comes_from_a_file_or_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TXSINK_PASSWORD", raising=False)
    monkeypatch.delenv("TXSINK_USER", raising=False)
    secret_file = tmp_path / "pw"
    secret_file.write_text(f"{SECRET}\nignored second line\n")
    creds = resolve_credentials(parse(["--url", "http://h:1", "--password-file", str(secret_file)]))
    assert (creds.url, creds.user, creds.password) == ("http://h:1", "default", SECRET)
    assert SECRET not in repr(creds)

    monkeypatch.setenv("TXSINK_PASSWORD", "from-env")
    assert resolve_credentials(parse(["--url", "http://h:1"])).password == "from-env"
    assert resolve_credentials(parse(["--url", "http://h:1", "--password", "x"])).password == "x"
    creds = resolve_credentials(parse(["--url", "http://alice:from-env@h:1"]))
    assert (creds.url, creds.user, creds.password) == ("http://h:1", "alice", "from-env")
    with pytest.raises(ConfigError, match="one way only"):
        resolve_credentials(parse(["--url", f"http://alice:{SECRET}@h:1"]))
    with pytest.raises(SystemExit):  # one or the other
        parse(["--password", "x", "--password-file", str(secret_file)])


def test_cli_keeper_auth_comes_from_a_file_or_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TXSINK_KEEPER_AUTH", f"w:{KEEPER_SECRET}")
    assert resolve_credentials(parse([])).keeper_auth == f"w:{KEEPER_SECRET}"
    f = tmp_path / "zk"
    f.write_text("other:pw\n")
    assert resolve_credentials(parse(["--keeper-auth-file", str(f)])).keeper_auth == "other:pw"
    f.write_text("no-colon\n")
    with pytest.raises(ConfigError, match="user:password"):
        resolve_credentials(parse(["--keeper-auth-file", str(f)]))
    with pytest.raises(ConfigError, match="cannot read"):
        resolve_credentials(parse(["--keeper-auth-file", str(tmp_path / "missing")]))


def test_cli_error_output_holds_no_secret(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Defence in depth: whatever error text reaches the CLI seam is masked there too."""
    from txsink.keeper import kazoo_registry

    def leaky(*a: Any, **k: Any) -> Any:
        raise TxSinkError(f"adapter forgot to mask {SECRET} and w:{KEEPER_SECRET}")

    monkeypatch.setattr(kazoo_registry, "KazooRegistry", leaky)
    monkeypatch.setenv("TXSINK_PASSWORD", SECRET)
    monkeypatch.setenv("TXSINK_KEEPER_AUTH", f"w:{KEEPER_SECRET}")
    for extra in (["--json"], []):
        code = main(["status", "--url", "http://127.0.0.1:1", *extra])
        out, err = capsys.readouterr()
        assert code == 4  # Exit.OPERATOR: a TxSinkError of no narrower kind
        assert SECRET not in out + err and KEEPER_SECRET not in out + err
        assert "adapter forgot to mask ***" in out + err


# --------------------------------------------------------------------------- foreach_batch


class FakeSession:
    def __init__(self) -> None:
        self.sparkContext = self

    def getLocalProperty(self, key: str) -> str:
        return "run-1"


def test_foreach_batch_keeps_url_userinfo_out_of_the_url_it_writes_with(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from txsink.spark import foreach

    saved: list[Any] = []
    monkeypatch.setattr(foreach, "save", lambda df, config: saved.append(config))
    df = type("DF", (), {"sparkSession": FakeSession()})()
    foreach.make_foreach_batch(**BASE, url=f"http://alice:{SECRET}@h:8123")(df, 7)
    [config] = saved
    assert config.url == "http://h:8123" and config.user == "alice"
    assert config.password == SECRET
    assert (config.txn_version, config.run_id, config.micro_batch) == (7, "run-1", True)
