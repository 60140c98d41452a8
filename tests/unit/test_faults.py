"""Fault points hard-exit exactly where and when TXSINK_FAULT says, and cost nothing unset."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import txsink
from txsink.faults import EXIT_CODE, FEATURE_POINTS, POINTS, fault_point

SCRIPT = (
    "from txsink.faults import fault_point\n"
    "for i in range(5):\n"
    "    fault_point('driver.after_prepare')\n"
    "    print(i, flush=True)\n"
)


def run(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("TXSINK_FAULT")}
    full.update(env)
    return subprocess.run(
        [sys.executable, "-c", SCRIPT], env=full, capture_output=True, text=True, check=False
    )


def test_unset_fault_never_exits() -> None:
    out = run({})
    assert out.returncode == 0 and out.stdout.split() == ["0", "1", "2", "3", "4"]


def test_named_point_exits_hard_at_first_arrival() -> None:
    out = run({"TXSINK_FAULT": "driver.after_prepare"})
    assert out.returncode == EXIT_CODE and out.stdout == ""


def test_after_lets_arrivals_pass_first() -> None:
    out = run({"TXSINK_FAULT": "driver.mid_commit,driver.after_prepare", "TXSINK_FAULT_AFTER": "2"})
    assert out.returncode == EXIT_CODE and out.stdout.split() == ["0", "1"]


def test_times_limits_crashes_and_state_file_counts_across_processes(tmp_path) -> None:
    env = {
        "TXSINK_FAULT": "driver.after_prepare",
        "TXSINK_FAULT_TIMES": "1",
        "TXSINK_FAULT_STATE": str(tmp_path / "count"),
    }
    assert run(env).returncode == EXIT_CODE  # first process: crashes at arrival 1
    second = run(env)  # second process: arrival 2..6 are past the single crash
    assert second.returncode == 0 and second.stdout.split() == ["0", "1", "2", "3", "4"]


def test_other_points_do_not_fire() -> None:
    os.environ.pop("TXSINK_FAULT", None)
    for point in POINTS:
        fault_point(point)  # returns: nothing configured
    out = run({"TXSINK_FAULT": "executor.mid_write"})
    assert out.returncode == 0


def test_a_pause_with_n_sleeps_only_at_the_nth_arrival_counted_across_processes(
    tmp_path: Path, monkeypatch: Any
) -> None:
    slept: list[float] = []
    monkeypatch.setattr("txsink.faults.time.sleep", slept.append)
    monkeypatch.delenv("TXSINK_FAULT", raising=False)
    monkeypatch.setenv("TXSINK_FAULT_STATE", str(tmp_path / "count"))
    monkeypatch.setenv("TXSINK_PAUSE", "driver.mid_commit:0.5,executor.mid_write:7:2")
    for _ in range(3):
        fault_point("executor.mid_write")
        fault_point("driver.mid_commit")
    assert slept == [0.5, 7.0, 0.5, 0.5]  # every mid_commit; mid_write's 2nd arrival only
    # the count lives in the shared file: another process's next arrival is the 4th
    assert (tmp_path / "count.executor.mid_write").read_text() == "3"


def test_a_pause_and_a_fault_read_one_count_taken_before_the_sleep(tmp_path: Path) -> None:
    script = SCRIPT.replace("driver.after_prepare", "executor.mid_write")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TXSINK_")}
    env.update(
        TXSINK_PAUSE="executor.mid_write:0.01:1",
        TXSINK_FAULT="executor.mid_write",
        TXSINK_FAULT_AFTER="1",
        TXSINK_FAULT_TIMES="1",
        TXSINK_FAULT_STATE=str(tmp_path / "count"),
    )
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=False
    )
    # arrival 1 slept and passed, arrival 2 died: one count for both
    assert out.returncode == EXIT_CODE and out.stdout.split() == ["0"]


CALLED = r"""\b(?:fault|fault_point|FaultPoint)\(\s*["']([a-z_.]+)["']"""


def test_every_fault_point_in_the_package_is_listed() -> None:
    """Chaos schedules draw from POINTS and FEATURE_POINTS: a point the code reaches but
    no list names is never crashed at (points are called, or yielded by the protocol's
    publish sequence as ``FaultPoint``)."""
    package = Path(txsink.__file__).parent
    called = {m.group(1) for f in package.rglob("*.py") for m in re.finditer(CALLED, f.read_text())}
    assert called, "no fault point found: the pattern no longer matches the code"
    assert called == set(POINTS) | set(FEATURE_POINTS)
