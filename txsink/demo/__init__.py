"""The demo job and its chaos driver (``txsink demo`` / ``make demo``).

The package owns one streaming job and the runs that crash it on purpose:

- :mod:`~txsink.demo.job`: the job itself (``python -m txsink.demo job ...``): one
  Spark driver streaming a directory of Parquet files into ClickHouse with
  ``format("clickhouse_tx")`` (or ``foreachBatch``) until ``trigger(availableNow=True)``
  has consumed every file; its source generator and table DDL. The integration tests run
  the same entry point, so the demo and the tests exercise one code path.
- :mod:`~txsink.demo.chaos`: running that job as a child process and crashing it, with a
  fault point (``TXSINK_FAULT``) or ``kill -9`` of its whole process group.
- :mod:`~txsink.demo.scenarios`: the three demo jobs (one table, two tables in one xid,
  one table over shards), each crashed again and again until a run finishes, then checked.
- :mod:`~txsink.demo.report`: what a demo measured, and the EXACT verdict.

Invariant: every scenario ends only after a run without an injected crash finished, and
its verdict is computed from the target's rows, never from what the job said it wrote.
The names below are re-exported because tests, benchmarks and the CLI import them from
``txsink.demo``.
"""

from __future__ import annotations

from txsink.demo.chaos import (
    RunOutcome,
    crash_schedule,
    job_args,
    job_command,
    kill_after_progress,
    run_job_once,
)
from txsink.demo.job import (
    SOURCE_SCHEMA_DDL,
    daily_ddl,
    daily_table,
    job_main,
    main,
    make_source,
    target_ddl,
    two_table_handler,
)
from txsink.demo.report import DemoReport, percentile
from txsink.demo.scenarios import (
    TWO_TABLE_POINTS,
    run_demo,
    run_shard_demo,
    run_two_table_demo,
)

__all__ = [
    "SOURCE_SCHEMA_DDL",
    "TWO_TABLE_POINTS",
    "DemoReport",
    "RunOutcome",
    "crash_schedule",
    "daily_ddl",
    "daily_table",
    "job_args",
    "job_command",
    "job_main",
    "kill_after_progress",
    "main",
    "make_source",
    "percentile",
    "run_demo",
    "run_job_once",
    "run_shard_demo",
    "run_two_table_demo",
    "target_ddl",
    "two_table_handler",
]
