"""The chaos driver: the demo job run as a child process, and crashed on purpose.

Owns how one job process is started (:func:`job_args`, :func:`job_command`), how it is
crashed (a fault point armed through ``TXSINK_FAULT*`` for exactly one hit, or
``kill -9`` of its whole process group) and the crash schedules the scenarios draw from.

Invariants: a job process never inherits fault settings from the caller's environment
(only the ones armed here); whatever happens to it, its process group is killed before
:func:`run_job_once` returns, because Spark's JVM outlives a dead Python driver and
would keep writing into the next run.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from txsink.faults import POINTS

KILL = "kill -9 driver"  # the schedule entry of a kill, as the reports show it


def job_args(
    src: str | Path,
    checkpoint: str | Path,
    table: str,
    job: str,
    url: str,
    keeper: str,
    *extra: str,
    mode: str = "auto",
    files_per_trigger: int = 2,
) -> list[str]:
    """Command-line arguments of :func:`job_main`."""
    return [
        *("--src", str(src), "--checkpoint", str(checkpoint), "--table", table),
        *("--job", job, "--url", url, "--keeper", keeper, "--mode", mode),
        *("--files-per-trigger", str(files_per_trigger), *extra),
    ]


def job_command(args: Sequence[str]) -> list[str]:
    return [sys.executable, "-m", "txsink.demo", "job", *args]


@dataclass
class RunOutcome:
    run: int
    crash: str
    exit_code: int
    seconds: float


def run_job_once(
    args: Sequence[str],
    *,
    fault: str | None = None,
    fault_after: int = 0,
    kill_after: float | None = None,
    kill_when: Callable[[], bool] | None = None,
    timeout: float = 600,
    log_path: str | None = None,
    env: dict[str, str] | None = None,
) -> int:
    """Run one job process; crash it with a fault point or a kill -9 of its process group.

    ``kill_after``: kill after that many seconds. ``kill_when``: kill as soon as the
    predicate (polled twice a second) holds, e.g. "a new batch was committed", so the
    kill lands mid-stream rather than during Spark's start-up.
    """
    environ = dict(os.environ if env is None else env)
    environ.setdefault("PYSPARK_PYTHON", sys.executable)
    for key in ("TXSINK_FAULT", "TXSINK_FAULT_AFTER", "TXSINK_FAULT_TIMES", "TXSINK_FAULT_STATE"):
        environ.pop(key, None)
    state_dir = tempfile.mkdtemp(prefix="txsink-fault-")
    if fault:
        environ.update(
            TXSINK_FAULT=fault,
            TXSINK_FAULT_AFTER=str(fault_after),
            TXSINK_FAULT_TIMES="1",
            TXSINK_FAULT_STATE=os.path.join(state_dir, "count"),
        )
    log = open(log_path or os.devnull, "ab")  # noqa: SIM115 - closed below
    try:
        proc = subprocess.Popen(
            job_command(args), env=environ, stdout=log, stderr=log, start_new_session=True
        )
        try:
            if kill_when is not None:
                deadline = time.monotonic() + timeout
                while proc.poll() is None and time.monotonic() < deadline:
                    if kill_when():
                        raise subprocess.TimeoutExpired(job_command(args), 0)
                    time.sleep(0.5)
            proc.wait(timeout=kill_after if kill_after is not None else timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return -9
        finally:
            _reap_group(proc.pid)
        return proc.returncode
    finally:
        log.close()


def kill_after_progress(registry: Any, job: str, rng: random.Random) -> Callable[[], bool]:
    """A kill trigger: true a random 0-2 s after the job commits one more batch."""
    start = registry.ledger(job).committed
    fire_at: list[float] = []

    def ready() -> bool:
        if not fire_at and registry.ledger(job).committed > start:
            fire_at.append(time.monotonic() + rng.uniform(0.0, 2.0))
        return bool(fire_at) and time.monotonic() >= fire_at[0]

    return ready


def _reap_group(pgid: int) -> None:
    """Kill what is left of a job's process group (the JVM outlives a dead Python driver)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        return


def crash_schedule(kills: int, rng: random.Random) -> list[tuple[str, str]]:
    """Every fault point once and ``kills`` kills, shuffled: ``(kind, what)`` pairs."""
    schedule = [("fault", p) for p in POINTS]
    schedule += [("kill", KILL)] * kills
    rng.shuffle(schedule)
    return schedule


def crashed_runs(
    args: Sequence[str],
    kind: str,
    what: str,
    *,
    registry: Any,
    job: str,
    rng: random.Random,
    log_path: str,
    fault_after: int = 0,
) -> Iterator[int]:
    """The runs of one schedule entry, yielding each exit code: crashed at fault point
    ``what`` (``kind="fault"``), killed after its next commit (``"kill"``), or left alone
    (``"clean"``). A clean run is tried up to three times, until one exits 0: the
    scenario's checks are only meaningful after a finished run."""
    for _attempt in range(3 if kind == "clean" else 1):
        if kind == "fault":
            code = run_job_once(args, fault=what, fault_after=fault_after, log_path=log_path)
        elif kind == "kill":
            trigger = kill_after_progress(registry, job, rng)
            code = run_job_once(args, kill_when=trigger, log_path=log_path)
        else:
            code = run_job_once(args, log_path=log_path)
        yield code
        if kind != "clean" or code == 0:
            return
