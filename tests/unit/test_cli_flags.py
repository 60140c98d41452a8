"""The CLI's common flags are made from the options registry and reach the clients it opens."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from txsink.cli import common
from txsink.cli.main import main
from txsink.options import OPTIONS


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    common.add_common(parser)
    return parser.parse_args(argv)


def test_every_common_flag_is_a_registered_option_with_its_default() -> None:
    args = parse([])
    for name in common.COMMON_FLAGS:
        assert name in OPTIONS
        opt = OPTIONS[name]
        if name in common.CLI_DEFAULTS or opt.env:
            continue
        assert getattr(args, name) == opt.parse(opt.default or ""), name
    assert (args.url, args.keeper) == (common.DEFAULT_URL, common.DEFAULT_KEEPER)
    assert (args.verify, args.ca_cert, args.keeper_root) == (True, "", "/txsink")


def test_flag_defaults_follow_the_option_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TXSINK_URL", "http://env:1")
    monkeypatch.setenv("TXSINK_KEEPER", "envk:2")
    monkeypatch.setenv("TXSINK_JOB", "j9")
    monkeypatch.setenv("TXSINK_PASSWORD", "not-a-default")  # a secret: resolved later
    args = parse([])
    assert (args.url, args.keeper, args.job, args.password) == (
        "http://env:1",
        "envk:2",
        "j9",
        None,
    )


def test_a_bad_numeric_flag_is_a_usage_error_naming_the_option(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as info:
        parse(["--connect-timeout", "soon"])
    assert info.value.code == 2
    assert "connect_timeout" in capsys.readouterr().err
    assert parse(["--keeper-retry-s", "0"]).keeper_retry_s == 0.0


def test_a_misspelt_choice_flag_is_a_usage_error_with_its_likely_meaning(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`--state clickhuose` used to be accepted, wait 5.6 s for Keeper and fail there."""
    with pytest.raises(SystemExit) as info:
        parse(["--state", "clickhuose"])
    assert info.value.code == 2
    assert "did you mean clickhouse?" in capsys.readouterr().err
    assert parse(["--state", "ClickHouse"]).state == "clickhouse"


def test_keeper_auth_may_be_given_inline_and_must_be_user_password() -> None:
    assert common.resolve_credentials(parse(["--keeper-auth", "u:pw"])).keeper_auth == "u:pw"
    with pytest.raises(SystemExit):
        parse(["--keeper-auth", "u:pw", "--keeper-auth-file", "/x"])


class FakeRegistry:
    def __init__(self, *a: Any, **k: Any) -> None:
        FakeRegistry.opened = (a, k)

    opened: tuple[Any, ...] = ()

    def close(self) -> None:
        pass


def test_tls_and_timeout_flags_reach_the_clickhouse_and_keeper_clients(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """What the https test does against a real TLS endpoint (tests/integration/
    test_ops_cli.py), here without one: the flags arrive in clickhouse-connect's call."""
    import clickhouse_connect

    from txsink.keeper import kazoo_registry

    seen: dict[str, Any] = {}

    def get_client(**kwargs: Any) -> Any:
        seen.update(kwargs)
        raise OSError("stop here")

    monkeypatch.setattr(kazoo_registry, "KazooRegistry", FakeRegistry)
    monkeypatch.setattr(clickhouse_connect, "get_client", get_client)
    code = main(
        [
            "status",
            "--url",
            "https://ch.example:9440",
            "--ca-cert",
            "/etc/ca.pem",
            "--no-verify",
            "--connect-timeout",
            "3",
            "--send-receive-timeout",
            "7.5",
            "--keeper-timeout",
            "4",
            "--keeper-retry-s",
            "0",
            "--keeper-root",
            "/other/",
        ]
    )
    assert code == 4 and "stop here" in capsys.readouterr().err  # Exit.OPERATOR
    assert (seen["host"], seen["port"], seen["secure"], seen["interface"]) == (
        "ch.example",
        9440,
        True,
        "https",
    )
    assert (seen["verify"], seen["ca_cert"]) == (False, "/etc/ca.pem")
    assert (seen["connect_timeout"], seen["send_receive_timeout"]) == (3.0, 7.5)
    args, kwargs = FakeRegistry.opened
    assert args == ("127.0.0.1:12181", "/other")
    assert (kwargs["timeout"], kwargs["retry_s"]) == (4.0, 0.0)
    main(["status", "--url", "https://ch.example"])
    assert (seen["verify"], seen["ca_cert"], seen["port"]) == (True, None, 8443)


def test_the_clis_clickhouse_retries_are_the_writers_defaults() -> None:
    from txsink.clickhouse.retry import RetryPolicy
    from txsink.config import WriterConfig

    config = WriterConfig.from_options(
        {"url": "http://h:8123", "keeper": "h:2181", "table": "d.t", "job": "j"}
    )
    policy = RetryPolicy()  # what the CLI's stores use
    assert (policy.attempts, policy.max_wait) == (config.retry_attempts, config.retry_max_wait)


def test_a_command_fails_fast_its_timeouts_are_its_own() -> None:
    """A wrong address is one line within seconds: 5 s for Keeper and ClickHouse in a
    command, while a writer keeps its 15 s and 10 s."""
    from txsink.cli.main import build_parser
    from txsink.options import default_of

    args = build_parser().parse_args(["status"])
    assert (args.keeper_timeout, args.connect_timeout) == (5.0, 5.0)
    assert (default_of("keeper_timeout"), default_of("connect_timeout")) == (15.0, 10.0)


def _parsers(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> Any:
    """Every (sub)command parser under ``parser``, with its command words."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield (*path, name), sub
                yield from _parsers(sub, (*path, name))


def test_every_help_fits_a_screen_with_the_command_s_own_flags_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 41: 93-111 lines of --help per store command, 16 shared flags each time. Now
    under 45 lines at 80 columns; the command's own flags come before the common ones,
    which the usage line names once."""
    from txsink.cli.main import build_parser

    monkeypatch.setenv("COLUMNS", "80")
    seen = 0
    for words, sub in _parsers(build_parser()):
        text = sub.format_help()
        lines = text.splitlines()
        assert len(lines) < 45, f"txsink {' '.join(words)} --help: {len(lines)} lines"
        assert max(map(len, lines)) <= 80, words
        if common.SHARED_TITLE + ":" in lines:
            seen += 1
            assert text.index("--json") < text.index(common.SHARED_TITLE + ":"), words
            assert "[common flags]" in text.split("\n\n")[0], words
            assert "--keeper-retry-s" not in text.split("\n\n")[0], words
    assert seen >= 6  # status, recover, verify, tune, check, mode
