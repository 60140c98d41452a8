"""The operator's view of many jobs, and every command's ``--json`` against the contract
(docs/cli-schema.json) on the embedded stack: real Keeper, real ClickHouse, real
``txsink`` processes where a terminal or a signal matters."""

from __future__ import annotations

import dataclasses
import json
import os
import pty
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.cli_schema import checked
from tests.integration import test_ops_cli as ops
from tests.integration.conftest import free_port
from tests.integration.test_ops_cli import REPO, Env, begin, cli_json, commit, count, rows, stage
from txsink.protocol.ids import batch_xid

pytestmark = pytest.mark.integration
env, cli = ops.env, ops.cli  # the fixtures of the ops tests: a root, a table, a job
TXSINK = str(Path(sys.executable).with_name("txsink"))


def age_heartbeat(env: Env, job: str, seconds: float) -> None:
    """Make the owner's last heartbeat ``seconds`` older (time passing, without the wait)."""
    path = f"{env.root}/jobs/{job}/owner"
    owner = json.loads(env.zk.get(path)[0])
    owner["heartbeat"] -= seconds
    env.zk.set(path, json.dumps(owner).encode())


def test_status_shows_one_line_per_job_the_ones_that_need_attention_first(
    env: Env, cli: Callable[..., tuple[int, str, str]]
) -> None:
    """25 jobs: 22 whose writer is inside its first commit, one idle stream, one finished
    batch write, and one that died after its first PREPARE (gone once its longest
    statement, 310 s, and 30 s passed, so `recover` needs no --force)."""
    quiet = [f"job-{i:02d}" for i in range(22)]
    for name in quiet:
        begin(env.open(name), f"run-{name}")
    stream = env.open("stream")
    commit(stream, begin(stream, "run-s"), 3)  # rows 3000..3005
    batch = env.open("batch")
    epoch = begin(batch, "run-b")
    parts = stage(batch, batch_xid(1), rows(4, start=100), run="run-b")
    batch.transactor.commit_batch(epoch, batch_xid(1), 1, env.table, parts)  # not streaming
    env.crash_after_prepare(0, "run-crashed")  # job orders-stream, PREPARED b0, no commit
    # inside a commit it is allowed its longest statement (310 s) + 30 s after its last
    # sign of life, the heartbeat or the PREPARE: both made 341 s older
    age_heartbeat(env, env.job, 341.0)
    b0 = env.record("b0")
    assert b0 is not None
    env.write_record(dataclasses.replace(b0, created_at=b0.created_at - 341.0))

    late = ("--stuck-after", "3600")  # its PREPARED b0 is 341 s old: not stuck yet
    code, out, _ = cli("status", *late)
    lines = out.strip().splitlines()
    assert code == 1  # the crashed job needs attention
    assert lines[0].split() == [
        "JOB", "TARGET", "MODE", "STORE", "LAST_BATCH", "AGE", "PENDING", "WRITER", "ATTENTION",
    ]  # fmt: skip
    assert len(lines) == 1 + 25 + 1 and lines[-1].startswith("25 job(s), 1 need attention")
    first = lines[1].split()
    assert first[0] == env.job and first[6:] == ["1", "gone", "stale-owner"]
    by_job = {line.split()[0]: line.split() for line in lines[1:-1]}
    assert by_job["batch"][7] == "finished" and by_job["batch"][4] == "1"
    assert by_job["stream"][7] == "live" and by_job["stream"][4] == "3"
    assert all(by_job[j][7] == "live" and by_job[j][4] == "-" for j in quiet)
    assert "None" not in out

    code, doc = cli_json(cli, "status", *late)
    assert code == 1 and len(doc["jobs"]) == 25 and doc["jobs"][0]["job"] == env.job
    crashed = doc["jobs"][0]
    assert (crashed["writer"], crashed["stale_after_s"], crashed["beat_s"]) == ("gone", 340.0, 5.0)
    assert crashed["last_commit_at"] is None and crashed["attention"] == "stale-owner"
    assert {f["job"] for f in doc["findings"] if f["level"] == "warn"} == {env.job}
    batch_job = next(j for j in doc["jobs"] if j["job"] == "batch")
    assert batch_job["writer"] == "finished" and batch_job["last_commit_at"].endswith("Z")

    code, out, _ = cli("status", "--job", env.job, *late)
    assert "GONE: epoch" in out and "longest statement it may wait on" in out
    assert "batch None" not in out and "warnings:\n    [warn] stale-owner" in out

    code, doc = cli_json(cli, "recover", "--yes", "--job", env.job)  # no --force needed
    assert code == 0 and doc["jobs"][0]["refused"] is None, doc
    assert doc["jobs"][0]["outcome"]["report"]["rolled_forward"] == ["b0"]
    assert count(env.ch, env.table) == (4 + 6 + 6, 4 + 6 + 6)  # batch, stream, b0: once


def test_every_command_speaks_the_json_contract(
    env: Env, cli: Callable[..., tuple[int, str, str]], tmp_path: Path
) -> None:
    """One schema check per command (status, verify, recover, mode, tune, check,
    embedded), its exit status, and the error envelope."""
    handle = env.open()
    commit(handle, begin(handle, "run-A"), 0)
    expect = {
        ("status",): 0,
        ("status", "--job", env.job): 0,
        ("verify",): 0,
        ("recover", "--dry-run"): 0,
        ("recover", "--yes", "--force"): 0,
        ("mode",): 0,
        ("tune", "--table", env.table, "--transactions", "2"): 0,
        ("status", "--job", "nope"): 2,
        ("status", "--watch", "1"): 2,
    }
    for argv, want in expect.items():
        code, doc = cli_json(cli, *argv)  # checked against the schema inside
        assert code == want, (argv, doc)
        assert (doc["error"] is None) is (want == 0), (argv, doc)
    code, doc = cli_json(cli, "check", "--table", env.table)
    assert code == 0 and doc["can_run"] is True
    code, doc = cli_json(cli, "check", "--table", f"{env.db}.missing")
    assert code == 1 and [f["level"] for f in doc["findings"]] == ["error"]

    down = subprocess.run(
        [TXSINK, "embedded", "status", "--dir", str(tmp_path), "--json"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    doc = checked(json.loads(down.stdout), "embedded")
    assert down.returncode == 5 and doc["ok"] is False and doc["findings"][0]["kind"]
    gone = subprocess.run(
        [TXSINK, "status", "--keeper", "127.0.0.1:9", "--keeper-timeout", "1", "--json"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    doc = checked(json.loads(gone.stdout), "status")
    assert gone.returncode == 5 and doc["error"]["type"] == "UnavailableError"
    assert "127.0.0.1:9" in doc["error"]["message"] and gone.stderr == ""


def _pty_run(argv: list[str]) -> tuple[int, str]:
    """Run ``argv`` with stderr on a pseudo-terminal (stdout on a pipe): exit, stderr."""
    leader, follower = pty.openpty()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=follower, cwd=REPO)
    os.close(follower)
    seen = b""
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:
            break
        if not chunk:
            break
        seen += chunk
    proc.communicate(timeout=120)
    os.close(leader)
    return proc.returncode, seen.decode(errors="replace")


def test_verify_shows_progress_on_a_terminal_and_none_on_a_pipe_or_with_json(
    env: Env, cli: Callable[..., tuple[int, str, str]]
) -> None:
    for name in ("a", "b", "c"):
        begin(env.open(name), f"run-{name}")
    argv = [TXSINK, "verify", *env.flags()]
    code, tty_err = _pty_run(argv)
    assert code == 0 and "verify" in tty_err and "3/3" in tty_err, tty_err
    piped = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    assert piped.returncode == 0 and piped.stderr == "" and "verify: CLEAN" in piped.stdout
    code, tty_err = _pty_run([*argv, "--json"])
    assert code == 0 and tty_err == ""


def _ignoring_sigint() -> None:
    """Start a child as a shell's background job (or a CI runner started that way) does:
    SIGINT ignored, which the child inherits unless it sets its own handler."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _interrupt_once_seen(
    proc: subprocess.Popen[str], stream: Any, needle: str, times: int = 1
) -> tuple[str, float]:
    """Read ``stream`` of ``proc`` until ``needle`` was printed ``times`` times (the
    command is provably where the test wants it), then send SIGINT; what was read and
    the monotonic time the signal was sent. Fails if the line never comes."""
    seen = ""
    deadline = time.monotonic() + 120
    while seen.count(needle) < times:
        line = stream.readline()
        assert line and time.monotonic() < deadline, (needle, seen, proc.poll())
        seen += line
    proc.send_signal(signal.SIGINT)
    return seen, time.monotonic()


def test_status_watch_redraws_until_interrupted(
    env: Env, cli: Callable[..., tuple[int, str, str]]
) -> None:
    begin(env.open(), "run-A")
    proc = subprocess.Popen(
        [TXSINK, "status", *env.flags(), "--watch", "0.5"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=_ignoring_sigint,  # noqa: PLW1509 - a signal disposition, no threads
    )  # fmt: skip
    # the third header: two whole redraws are on the pipe, the watch is in its sleep
    # or drawing again
    seen, sent = _interrupt_once_seen(proc, proc.stdout, "txsink status, every 0.5s", 3)
    out, err = proc.communicate(timeout=30)  # at once: generous, never the bound tested
    assert proc.returncode == 0, err
    assert time.monotonic() - sent < 30
    assert (seen + out).count(env.job) >= 2


def test_ctrl_c_ends_a_watch_whose_keeper_went_silent(env: Env) -> None:
    """Ctrl-C while the watch waits on a Keeper that answers nothing (a black hole): the
    sessions cannot close in time, and kazoo's own stop at interpreter exit would wait
    for them; the watch leaves within its close bound, with 0."""
    from tests.nemesis.proxy import FaultProxy

    begin(env.open(), "run-A")
    host, port = env.stack.keeper.rsplit(":", 1)
    proxy = FaultProxy((host, int(port)), name="keeper").start()
    try:
        flags = [*env.flags()]
        flags[flags.index("--keeper") + 1] = proxy.address
        proc = subprocess.Popen(
            [TXSINK, "status", *flags, "--watch", "0.5"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            preexec_fn=_ignoring_sigint,  # noqa: PLW1509 - a signal disposition, no threads
        )  # fmt: skip
        seen = ""
        while seen.count("txsink status, every 0.5s") < 2:
            line = proc.stdout.readline()  # type: ignore[union-attr]
            assert line, (seen, proc.poll())
            seen += line
        proxy.blackhole(True)
        time.sleep(1.5)  # the next draw now waits on Keeper
        proc.send_signal(signal.SIGINT)
        sent = time.monotonic()
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err[-2000:]
        assert time.monotonic() - sent < 8, err[-2000:]
    finally:
        proxy.stop()


def test_ctrl_c_ends_a_command_inside_a_keeper_retry_at_once(tmp_path: Path) -> None:
    # nothing listens on a freshly closed port: kazoo's connect loop retries until the
    # 120 s timeout; Ctrl-C inside it ends the command with 130 at once
    dead = free_port()
    proc = subprocess.Popen(
        [TXSINK, "--debug", "status", "--keeper", f"127.0.0.1:{dead}", "--keeper-timeout", "120"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
        preexec_fn=_ignoring_sigint,  # noqa: PLW1509 - a signal disposition, no threads
    )  # fmt: skip
    _, sent = _interrupt_once_seen(proc, proc.stderr, "Connection dropped", 2)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err[-2000:]
    assert time.monotonic() - sent < 30, err[-2000:]


def test_an_unreachable_keeper_is_one_line_within_seconds(tmp_path: Path) -> None:
    started = time.monotonic()
    proc = subprocess.run(
        [TXSINK, "status", "--keeper", "127.0.0.1:9", "--keeper-timeout", "2"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    took = time.monotonic() - started
    assert proc.returncode == 5 and took < 6, (took, proc.stderr)
    [line] = proc.stderr.strip().splitlines()  # no kazoo warnings
    assert "127.0.0.1:9" in line and "within 2s" in line and "txsink embedded status" in line
