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

Speculation needs more: Spark never runs a speculative copy on a host where the task
already runs, and every ``local-cluster`` executor shares the driver's host. So that test
starts a standalone master and two workers from pyspark's own jars, each worker bound to
its own loopback address (127.0.0.2, 127.0.0.3), shared by the module.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.sparkjob import Job, assert_exact, new_job, staging_left
from txsink.demo.chaos import job_command, kill_after_progress
from txsink.demo.job import target_ddl
from txsink.driver import open_registry
from txsink.protocol.ids import parse_staging
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


def run_with_kills(
    job: Job,
    mode: str,
    moments: list[Any],
    timeout: float = 300,
    *,
    master: str = MASTER,
    pauses: str = PAUSES,
    conf: tuple[str, ...] = (),
    fault: dict[str, str] | None = None,
) -> int:
    """Run the job on the cluster; at each moment (a predicate, polled) kill -9 one of its
    executor JVMs, or, for a moment given as ``("driver", predicate)``, the driver and
    everything under it. Returns how many executors were killed; asserts the job ended
    well (or died by the driver kill, when one was asked)."""
    env = dict(os.environ, PYSPARK_PYTHON=sys.executable, TXSINK_PAUSE=pauses)
    for key in ("TXSINK_FAULT", "TXSINK_FAULT_AFTER", "TXSINK_FAULT_TIMES"):
        env.pop(key, None)
    env["TXSINK_FAULT_STATE"] = str(job.log.parent / "arrivals")  # counted job-wide
    env.update(fault or {})
    hooks = [f"spark.executorEnv.{k}={v}" for k, v in env.items() if k.startswith("TXSINK_")]
    # (a standalone worker's executors inherit the worker's environment, not the driver's)
    confs = ["spark.task.maxFailures=8", *hooks, *conf]
    extra = [a for kv in confs for a in ("--conf", kv)]
    args = job.args("--master", master, *extra, mode=mode)
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


@pytest.mark.parametrize(
    "driver_too",  # the driver's kill -9 in local mode: test_spark_crashes
    [False, pytest.param(True, id="then-the-driver", marks=pytest.mark.slow)],
)
def test_executor_jvms_killed_mid_write_and_while_the_driver_commits_exact(
    stack: Any, ch: Any, fresh_db: str, tmp_path: Path, driver_too: bool
) -> None:
    job = new_job(tmp_path, ch, fresh_db, stack.url, stack.keeper, files=8, rows_per_file=1500)
    registry = open_registry(job.config())
    try:
        moments: list[Any] = [lambda: staging_in_use(ch, job), lambda: prepared(job)]
        if driver_too:
            moments.append(("driver", kill_after_progress(registry, job.name, random.Random(11))))
        killed = run_with_kills(job, "attach", moments)
    finally:
        registry.close()
    assert killed == 2, job.log_tail()
    if driver_too:  # the restart on a new cluster finishes the stream (the crash recovered)
        assert job.run("--master", MASTER) == 0, job.log_tail()
    assert_exact(ch, job)
    assert staging_left(ch, job) == []  # the killed attempts' staging was dropped


@pytest.mark.slow  # dedup's task rerun after a kill: also test_spark_crashes (local mode)
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


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def standalone(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A standalone master and two one-core workers on distinct loopback hosts; its URL."""
    import pyspark

    home = Path(pyspark.__file__).parent
    work = tmp_path_factory.mktemp("standalone")
    port = free_port()
    env = dict(
        os.environ, SPARK_HOME=str(home), PYSPARK_PYTHON=sys.executable, SPARK_NO_DAEMONIZE="1"
    )
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
    klass = "org.apache.spark.deploy"
    master_url = f"spark://127.0.0.1:{port}"
    commands = [
        ("master", "127.0.0.1", [f"{klass}.master.Master", "--port", str(port)]),
        *(
            (f"worker{i}", f"127.0.0.{i + 1}", [f"{klass}.worker.Worker", "--cores", "1",
             "--memory", "1g", "--work-dir", str(work / f"w{i}"), master_url])
            for i in (1, 2)
        ),
    ]  # fmt: skip
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for name, host, argv in commands:
            log = (work / f"{name}.log").open("wb")
            procs.append(
                subprocess.Popen(
                    [str(home / "bin" / "spark-class"), *argv, "--host", host,
                     "--webui-port", str(free_port())],
                    env=dict(env, SPARK_LOCAL_IP=host), stdout=log, stderr=log,
                    start_new_session=True,
                )
            )  # fmt: skip
        deadline = time.monotonic() + 90
        master_log = work / "master.log"
        while master_log.read_text(errors="replace").count("Registering worker") < 2:
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                pytest.fail(f"standalone cluster did not start:\n{master_log.read_text()[-3000:]}")
            time.sleep(0.2)
        yield master_url
    finally:
        for proc in procs:  # each worker's group holds the executors it launched
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)


SPECULATION = (
    "spark.speculation=true",
    "spark.speculation.interval=100ms",
    "spark.speculation.multiplier=2",
    "spark.speculation.quantile=0.5",
    "spark.speculation.minTaskRuntime=1s",
)


@pytest.mark.slow  # make test keeps the cluster's executor kills; its own master and workers
def test_speculation_with_a_slow_task_and_a_crashed_one_publishes_one_attempt_of_each(
    standalone: str, stack: Any, ch: Any, fresh_db: str, tmp_path: Path
) -> None:
    """The first task to send a block sleeps 60 s and the second dies there (its staging
    half-filled, no cleanup). Spark runs a copy of the sleeper on the other worker, takes
    the copy's result and kills the original; it reruns the dead one. Each batch
    publishes one attempt per partition (the sleeper's copy: attempt 1), every other
    attempt's staging is dropped, and the stream ends exact before the sleeper woke."""
    job = new_job(tmp_path, ch, fresh_db, stack.url, stack.keeper, files=2, rows_per_file=1500)
    started = time.monotonic()
    crash_second = {
        "TXSINK_FAULT": "executor.mid_write",
        "TXSINK_FAULT_AFTER": "1",
        "TXSINK_FAULT_TIMES": "1",
    }
    run_with_kills(
        job,
        "attach",
        [],
        master=standalone,
        pauses="executor.mid_write:60:1",
        conf=SPECULATION,
        fault=crash_second,
    )
    assert time.monotonic() - started < 60, "no speculative copy overtook the slow task"
    arrivals = int((job.log.parent / "arrivals.executor.mid_write").read_text())
    assert arrivals >= 2, "no task reached the crash (the second arrival)"
    assert_exact(ch, job)
    published = [
        (record.xid, parsed.partition, parsed.attempt)
        for record in job.records()
        for table in record.staging_tables
        if (parsed := parse_staging(table)) is not None
    ]
    assert len({(x, p) for x, p, _ in published}) == len(published), published  # one each
    assert any(a == 1 for _, _, a in published), f"no speculative attempt published: {published}"
    assert staging_left(ch, job) == []  # the loser's and the dead attempt's staging dropped
