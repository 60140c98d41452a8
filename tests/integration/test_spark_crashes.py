"""Exactly-once under crashes: real Spark drivers killed at every protocol step.

Each test runs the streaming job (``python -m txsink.demo job``) in a subprocess against
the embedded stack, crashes it (fault point or ``kill -9`` of the driver's process
group), restarts it from the same checkpoint and finally checks
``count() == uniqExact(id) == produced`` and the sum of a value column.

The data source's stream crashed at *every* fault point in turn (then kill -9) runs on a
3-shard cluster in tests/integration/test_shards.py: the same streaming writer, commit and
recovery, every staging operation going through the sharded warehouse onto real
endpoints. Every driver point on one server: tests/integration/test_multi_table.py (and,
with a view, test_dedup_mode.py); the nemesis streams lose the reply of every step.
"""

from __future__ import annotations

import random

import pytest

from tests.integration.sparkjob import assert_exact, new_job, staging_left
from txsink.demo import kill_after_progress
from txsink.driver import open_registry
from txsink.protocol.states import XidState

pytestmark = [pytest.mark.spark]


def test_a_random_kill_minus_9_of_the_driver_mid_stream_is_exact(stack, ch, fresh_db, tmp_path):
    # 12 one-file batches: a kill lands 0-2 s after a commit, so the killed run uses at
    # most about four of them and the kill still finds the stream running (a second kill
    # tested nothing the first does not: the every-point matrices crash at each step)
    job = new_job(tmp_path, ch, fresh_db, stack.url, stack.keeper, files=12, rows_per_file=1000)
    rng = random.Random(1234)
    registry = open_registry(job.config())
    try:  # each kill lands 0-2 s after the run committed one more batch: mid-stream
        codes = [
            job.run(files_per_trigger=1, kill_when=kill_after_progress(registry, job.name, rng))
            for _ in range(1)
        ]
    finally:
        registry.close()
    assert codes.count(-9) == 1, f"the driver was not killed mid-stream: {codes}"
    for _ in range(2):
        if job.run() == 0:
            break
    assert_exact(ch, job)
    assert staging_left(ch, job) == []

    # the same run, finished: a restart from its checkpoint rewrites nothing (a new
    # checkpoint under the old job name is refused: test_misbehaving_users.py)
    assert job.run() == 0, job.log_tail()
    assert_exact(ch, job)


def test_foreach_batch_helper_crashed_after_prepare_is_exact(stack, ch, fresh_db, tmp_path):
    job = new_job(tmp_path, ch, fresh_db, stack.url, stack.keeper)
    assert job.run("--foreach", fault="driver.after_prepare", fault_after=1) != 0
    assert job.run("--foreach") == 0, job.log_tail()
    assert_exact(ch, job)
    assert staging_left(ch, job) == []


DEDUP_DDL = (
    "CREATE TABLE {table} (id Int64, event_time DateTime64(6, 'UTC'), day Date, "
    "customer LowCardinality(String), amount Int64) ENGINE = MergeTree "
    "PARTITION BY toYYYYMM(day) ORDER BY (day, id) "
    "SETTINGS non_replicated_deduplication_window = 1000"
)


def test_dedup_mode_survives_kill_minus_9_and_a_retried_task(stack, ch, fresh_db, tmp_path):
    job = new_job(
        tmp_path, ch, fresh_db, stack.url, stack.keeper, files=8, rows_per_file=2000, ddl=DEDUP_DDL
    )
    rng = random.Random(99)
    registry = open_registry(job.config())
    try:
        killed = job.run(
            mode="dedup",
            files_per_trigger=1,
            kill_when=kill_after_progress(registry, job.name, rng),
        )
    finally:
        registry.close()
    assert killed == -9, job.log_tail()
    retried = job.run(
        "--master", "local[2,3]", mode="dedup", fault="executor.mid_write", fault_after=0
    )
    assert retried == 0, job.log_tail()
    assert_exact(ch, job)
    assert all(r.state is XidState.COMMITTED for r in job.records())
