"""Every command's failure paths that need no server end with the exit status docs/cli.md
documents for them, and docs/cli.md's exit table is the one the code renders."""

from __future__ import annotations

import functools
import http.server
import os
import re
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from txsink.cli.main import main
from txsink.cli.output import EXIT_DOC, Exit
from txsink.clickhouse import client as ch_client
from txsink.clickhouse import retry
from txsink.clickhouse.retry import RetryPolicy
from txsink.ports.registry_memory import MemoryRegistry

CLI_MD = Path(__file__).parents[2] / "docs" / "cli.md"


def documented_statuses() -> dict[str, set[int]]:
    """docs/cli.md's command table: command -> the exit statuses it lists."""
    rows = re.findall(r"^\| `([a-z /]+)` \|[^|]*\| ([\d, ]+) \|$", CLI_MD.read_text(), re.M)
    out: dict[str, set[int]] = {}
    for names, codes in rows:
        head, _, actions = names.partition(" ")
        for name in [head] if not actions else [f"{head} {a}" for a in actions.split("/")]:
            out[name] = {int(c) for c in codes.split(",")}
    return out


def run(argv: list[str]) -> int:
    """``txsink ARGV`` in this process; its exit status (argparse's included)."""
    try:
        return main(argv)
    except SystemExit as exc:
        return int(exc.code or 0)


def command_of(argv: list[str]) -> str:
    return f"{argv[0]} {argv[1]}" if argv[0] == "embedded" else argv[0]


def dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(autouse=True)
def _no_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in os.environ if n.startswith("TXSINK_")]:
        monkeypatch.delenv(name)


@pytest.fixture
def no_retry_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    """A refused connect is retried as the writer's policy says; without its sleeps."""
    quick = functools.partial(RetryPolicy, sleep=id)
    monkeypatch.setattr(ch_client, "RetryPolicy", quick)
    monkeypatch.setattr(retry, "RetryPolicy", quick)  # the writer's, which `check` opens


@pytest.fixture
def not_clickhouse() -> Iterator[str]:
    """A web server that answers every request with 404: the url of something that is
    not ClickHouse."""

    class NotFound(http.server.BaseHTTPRequestHandler):
        def answer(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self.send_response(404)
            self.end_headers()
            self.wfile.write(b"<html>Not Found</html>")

        do_GET = do_POST = answer

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotFound)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def empty_store(monkeypatch: pytest.MonkeyPatch) -> None:
    """Commands open an in-memory state store without jobs, and a ClickHouse client
    they never get to use."""
    import txsink.driver

    monkeypatch.setattr(txsink.driver, "state_registry", lambda *a, **k: MemoryRegistry())
    monkeypatch.setattr(ch_client.ConnectSettings, "connect", lambda *a, **k: object())


def assert_documented(argv: list[str], code: int, expected: Exit) -> None:
    assert code == expected, (argv, code)
    assert expected in EXIT_DOC
    assert expected in documented_statuses()[command_of(argv)], (
        f"docs/cli.md does not list {int(expected)} for {command_of(argv)}"
    )


def test_docs_cli_md_exit_table_is_the_one_the_code_renders() -> None:
    from txsink.options_doc import main as docs_main

    assert set(EXIT_DOC) == set(Exit)
    assert "<!-- BEGIN GENERATED: exit-statuses" in CLI_MD.read_text()
    assert docs_main(["--check", str(CLI_MD)]) == 0, "stale: python -m txsink.options_doc"


def test_every_command_has_documented_statuses_and_every_one_is_an_exit() -> None:
    documented = documented_statuses()
    expected = {"status", "verify", "recover", "tune", "check", "mode", "demo"}
    assert expected | {"embedded up", "embedded down", "embedded status"} == set(documented)
    for codes in documented.values():
        assert codes <= set(Exit) and Exit.USAGE in codes


STORE_COMMANDS = [["status"], ["verify"], ["recover"], ["mode"], ["tune", "--table", "d.t"]]


@pytest.mark.parametrize(
    ("argv", "hint"),
    [
        *[([*c, "--state", "clickhuose"], "did you mean clickhouse?") for c in STORE_COMMANDS],
        (["check", "--table", "d.t", "--state", "clickhuose"], "did you mean clickhouse?"),
        (["check", "--table", "d.t", "--mode", "atach"], "did you mean attach?"),
        (["mode", "--job", "j", "--set", "dedupe"], "did you mean dedup?"),
        (["demo", "--mode", "atach"], "did you mean attach?"),
        (["tune", "--table", "d.t", "--shards", "ftp://h"], "http(s)://host:port"),
        (["status", "--connect-timeout", "0.5"], "must be >= 1"),
        (["status", "--keeper-timeout", "soon"], "keeper_timeout"),
        (["embedded", "up", "--shards", "two"], "invalid int"),
        (["status", "--no-such-flag"], "unrecognized arguments"),
    ],
)
def test_a_bad_flag_value_is_refused_before_anything_is_opened(
    argv: list[str], hint: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert_documented(argv, run(argv), Exit.USAGE)
    assert hint in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [
        ["status", "--watch", "0.1"],
        ["status", "--watch", "1", "--json"],
        ["recover", "--discard-dedup", "x"],  # needs --job
        ["tune", "--table", "d.t", "--sample-seconds", "5"],  # needs --job
    ],
)
def test_a_flag_combination_that_cannot_work_is_a_usage_error_before_connecting(
    argv: list[str],
) -> None:
    # a dead Keeper would make any connect exit 5: 2 proves nothing was opened
    argv = [*argv, "--keeper", f"127.0.0.1:{dead_port()}", "--keeper-timeout", "0.2"]
    assert_documented(argv, run(argv), Exit.USAGE)


@pytest.mark.parametrize(
    "argv",
    [
        *STORE_COMMANDS,
        ["mode", "--set", "attach"],
        ["recover", "--yes", "--dry-run"],
        ["tune", "--table", "d.t", "--rows-per-second", "10"],
    ],
)
def test_a_missing_job_is_a_usage_error(argv: list[str], empty_store: None) -> None:
    argv = [*argv, "--job", "nope"]
    assert_documented(argv, run(argv), Exit.USAGE)


@pytest.mark.parametrize("argv", [*STORE_COMMANDS, ["mode", "--set", "attach"]])
def test_a_missing_job_behind_a_dead_keeper_is_unreachable_within_its_timeout(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    port = dead_port()
    argv = [*argv, "--job", "nope", "--keeper", f"127.0.0.1:{port}", "--keeper-timeout", "0.2"]
    assert_documented(argv, run(argv), Exit.UNREACHABLE)
    assert f"Keeper at 127.0.0.1:{port}" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [*STORE_COMMANDS, ["check", "--table", "d.t"]])
def test_a_dead_clickhouse_url_is_unreachable(
    argv: list[str], no_retry_waits: None, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"http://127.0.0.1:{dead_port()}"
    argv = [*argv, "--state", "clickhouse", "--url", url, "--connect-timeout", "1"]
    assert_documented(argv, run(argv), Exit.UNREACHABLE)
    assert f"ClickHouse at {url} is unreachable" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["check", "--table", "d.t"], ["status", "--state", "clickhouse"]])
def test_a_web_server_that_is_not_clickhouse_is_unreachable_not_an_operators_problem(
    argv: list[str], not_clickhouse: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [*argv, "--url", not_clickhouse, "--keeper", f"127.0.0.1:{dead_port()}"]
    assert_documented(argv, run(argv), Exit.UNREACHABLE)
    err = capsys.readouterr().err
    assert "HTTP status 404" in err and "does not answer as ClickHouse: check --url" in err


@pytest.mark.parametrize("json", [False, True])
def test_embedded_status_of_a_stack_that_is_not_up_is_unreachable(
    json: bool, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["embedded", "status", "--dir", str(tmp_path), *(["--json"] if json else [])]
    assert_documented(argv, run(argv), Exit.UNREACHABLE)
    assert "txsink embedded up" in capsys.readouterr()[0 if json else 1]
    run(["embedded", "--help"])
    assert re.search(r"status +show pids and health; exit 5 when not up", capsys.readouterr().out)
