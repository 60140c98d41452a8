"""Executors that die: a real multi-process Spark cluster, each executor its own JVM.

Spark's ``local-cluster[2,1,1024]`` master starts a standalone master and two workers
inside the driver's JVM and launches every executor as a separate JVM (a
``CoarseGrainedExecutorBackend`` process), exactly as a standalone or YARN cluster does:
killing one with ``kill -9`` while the driver lives on is the failure the design answers
(an executor lost to preemption, its tasks rescheduled on another).

The job is the demo's streaming job (``python -m txsink.demo job``) in a subprocess.
``TXSINK_PAUSE`` holds each task for a moment after its first block reached staging (or
the target, in dedup mode) and the driver for a moment after PREPARE, so that the kills
land where they are meant to: one executor while a batch's tasks write, another while
the driver commits, then (attach mode) the driver itself after one more commit, and a
restart on a new cluster. Spark reruns the lost tasks on the surviving (or relaunched)
executor; the stream must end exact, values included, with no staging left behind.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.integration.sparkjob import Job, assert_exact, new_job, staging_left
from txsink.demo.chaos import job_command, kill_after_progress
from txsink.demo.job import target_ddl
from txsink.driver import open_registry
from txsink.protocol.states import XidState

pytestmark = pytest.mark.spark

MASTER = "local-cluster[2,1,1024]"
PAUSES = "executor.mid_write:1,driver.after_prepare:1"


def executors_of(root: int) -> list[int]:
    """Executor JVMs descending from process ``root``."""
    parents: dict[int, int] = {}
    commands: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            commands[int(entry.name)] = (entry / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])

    def descends(pid: int) -> bool:
        while pid > 1:
            pid = parents.get(pid, 0)
            if pid == root:
                return True
        return False

    return sorted(
        pid
        for pid, cmd in commands.items()
        if "CoarseGrainedExecutorBackend" in cmd and descends(pid)
    )


def staging_in_use(ch: Any, job: Job) -> bool:
    return bool(staging_left(ch, job))


def dedup_blocks_sent(job: Job) -> bool:
    registry = open_registry(job.config())
    try:
        return bool(registry.blob_children(job.name, "dedup"))
    finally:
        registry.close()


def prepared(job: Job) -> bool:
    return any(r.state is XidState.PREPARED for r in job.records())


def run_with_kills(job: Job, mode: str, moments: list[Any], timeout: float = 300) -> int:
    """Run the job on the cluster; at each moment (a predicate, polled) kill -9 one of its
    executor JVMs, or, for a moment given as ``("driver", predicate)``, the driver and
    everything under it. Returns how many executors were killed; asserts the job ended
    well (or died by the driver kill, when one was asked)."""
    env = dict(os.environ, PYSPARK_PYTHON=sys.executable, TXSINK_PAUSE=PAUSES)
    for key in ("TXSINK_FAULT", "TXSINK_FAULT_AFTER", "TXSINK_FAULT_TIMES"):
        env.pop(key, None)
    args = job.args("--master", MASTER, "--conf", "spark.task.maxFailures=8", mode=mode)
    killed: list[int] = []
    driver_killed = False
    with job.log.open("ab") as log:
        proc = subprocess.Popen(
            job_command(args), env=env, stdout=log, stderr=log, start_new_session=True
        )
        try:
            deadline = time.monotonic() + timeout
            pending = list(moments)
            while proc.poll() is None and time.monotonic() < deadline:
                alive = executors_of(proc.pid)
                if pending and isinstance(pending[0], tuple) and pending[0][1]():
                    os.killpg(proc.pid, signal.SIGKILL)  # the driver, its JVM, executors
                    driver_killed = True
                    proc.wait(30)
                    break
                executor_moment = pending and not isinstance(pending[0], tuple)
                if executor_moment and len(alive) == 2 and pending[0]():
                    os.kill(alive[0], signal.SIGKILL)
                    killed.append(alive[0])
                    pending.pop(0)
                time.sleep(0.05)
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                pytest.fail(f"the job did not end in {timeout:.0f}s\n{job.log_tail()}")
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    wanted_driver_kill = any(isinstance(m, tuple) for m in moments)
    assert driver_killed == wanted_driver_kill, job.log_tail()
    if not driver_killed:
        assert proc.returncode == 0, job.log_tail()
    lost = job.log_tail(200_000).count("Lost executor")
    assert lost == len(killed), f"Spark saw {lost} executor(s) lost, {len(killed)} killed"
    return len(killed)


def test_executor_jvms_killed_mid_write_and_while_the_driver_commits_then_the_driver_exact(
    stack: Any, ch: Any, fresh_db: str, tmp_path: Path
) -> None:
    job = new_job(tmp_path, ch, fresh_db, stack.url, stack.keeper, files=8, rows_per_file=1500)
    registry = open_registry(job.config())
    try:
        progress = kill_after_progress(registry, job.name, random.Random(11))
        killed = run_with_kills(
            job,
            "attach",
            [lambda: staging_in_use(ch, job), lambda: prepared(job), ("driver", progress)],
        )
    finally:
        registry.close()
    assert killed == 2, job.log_tail()
    # the restart on a new cluster finishes the stream (the driver's crash recovered)
    assert job.run("--master", MASTER) == 0, job.log_tail()
    assert_exact(ch, job)
    assert staging_left(ch, job) == []  # the killed attempts' staging was dropped


def test_an_executor_jvm_killed_mid_write_in_dedup_mode_leaves_it_exact(
    stack: Any, ch: Any, fresh_db: str, tmp_path: Path
) -> None:
    ddl = target_ddl("{table}") + " SETTINGS non_replicated_deduplication_window = 1000"
    job = new_job(
        tmp_path, ch, fresh_db, stack.url, stack.keeper, files=4, rows_per_file=2000, ddl=ddl
    )
    killed = run_with_kills(job, "dedup", [lambda: dedup_blocks_sent(job)])
    assert killed == 1, job.log_tail()
    assert_exact(ch, job)
