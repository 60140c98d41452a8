"""Staging keeps every row it was sent until published, whatever the target does: real
Spark streams (``python -m txsink.demo job``) on the embedded stack (issue 10 rows 2, 7, 9).
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.integration.sparkjob import assert_exact, new_job, staging_left
from txsink.protocol.states import XidState

pytestmark = pytest.mark.spark

TTL_TARGET = (
    "CREATE TABLE {table} (id Int64, event_time DateTime64(6, 'UTC'), day Date, "
    "customer LowCardinality(String), amount Int64) "
    "ENGINE = MergeTree PARTITION BY toYYYYMM(day) ORDER BY (day, id) "
    "TTL day + INTERVAL 1 DAY SETTINGS non_replicated_deduplication_window = 100"
)


def old_source_with_duplicates(src: Path, files: int, distinct: int, copies: int) -> int:
    """Files of ``distinct`` rows from 2001 (older than the TTL) repeated ``copies`` times,
    so that blocks of ``distinct`` rows are identical; returns the rows produced."""
    src.mkdir(parents=True, exist_ok=True)
    for f in range(files):
        ids = [f * distinct + i for i in range(distinct)] * copies
        days = [dt.date(2001, 1 + i % 3, 1 + i % 28) for i in ids]
        pq.write_table(
            pa.table(
                {
                    "id": pa.array(ids, pa.int64()),
                    "event_time": pa.array(
                        [dt.datetime(d.year, d.month, d.day, tzinfo=dt.UTC) for d in days],
                        pa.timestamp("us", tz="UTC"),
                    ),
                    "day": pa.array(days, pa.date32()),
                    "customer": pa.array([f"c{i % 7}" for i in ids]),
                    "amount": pa.array([i % 1000 for i in ids], pa.int64()),
                }
            ),
            src / f"part-{f:05d}.parquet",
        )
    return files * distinct * copies


@pytest.mark.slow  # one job of four batches into a TTL target
def test_old_and_duplicate_rows_into_a_ttl_target_with_a_dedup_window_commit_every_batch(
    stack: Any, ch: Any, fresh_db: str, tmp_path: Path
) -> None:
    """Rows 2 and 9: the staging copy of such a target used to lose rows older than the
    TTL to a TTL merge, and identical blocks to the dedup window, so batches failed the
    row check on every retry or were counted without being published."""
    job = new_job(tmp_path, ch, fresh_db, stack.url, stack.keeper, files=1, ddl=TTL_TARGET)
    ch.command(f"SYSTEM STOP TTL MERGES {job.table}")  # keep what reached the target countable
    for old in job.src.glob("*.parquet"):
        old.unlink()
    produced = old_source_with_duplicates(job.src, files=4, distinct=100, copies=10)
    code = job.run("--option", "block_rows=100", files_per_trigger=1)
    assert code == 0, job.log_tail()
    count, distinct, amount = ch.query(
        f"SELECT count(), uniqExact(id), sum(amount) FROM {job.table}"
    ).result_rows[0]
    assert (count, distinct) == (produced, 400)
    assert amount == sum(i % 1000 for i in range(400)) * 10
    records = job.records()
    assert len(records) == 4 and all(r.state is XidState.COMMITTED for r in records)
    assert sum(r.rows for r in records) == produced
    assert all(p.uuids for r in records for p in r.manifest)  # evidence was recorded
    assert staging_left(ch, job) == []


@pytest.mark.slow  # make test keeps: nemesis/test_batch_finishers (column added between two tasks)
def test_a_column_added_to_the_target_while_a_batch_is_prepared_is_published_and_the_stream_goes_on(
    stack: Any, ch: Any, fresh_db: str, tmp_path: Path
) -> None:
    """Row 7: MOVE used to fail with code 122 after PREPARED and wedge the job."""
    job = new_job(tmp_path, ch, fresh_db, stack.url, stack.keeper, files=6, rows_per_file=500)
    crashed = job.run(fault="driver.after_prepare", fault_after=1)
    assert crashed != 0, job.log_tail()
    prepared = [r for r in job.records() if r.state is XidState.PREPARED]
    assert len(prepared) == 1, job.log_tail()
    ch.command(
        f"ALTER TABLE {job.table} ADD COLUMN region LowCardinality(String) DEFAULT 'eu' "
        "AFTER customer"
    )
    assert job.run() == 0, job.log_tail()
    assert_exact(ch, job)
    assert ch.query(f"SELECT countIf(region = 'eu') FROM {job.table}").result_rows[0][0] == (
        job.produced
    )
    records = job.records()
    assert len(records) == 3 and all(r.state is XidState.COMMITTED for r in records)
    assert staging_left(ch, job) == []
