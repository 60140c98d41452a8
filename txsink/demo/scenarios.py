"""The demo's scenarios: three jobs, each crashed until a run finishes, then checked.

- :func:`run_demo`: the main job (one table), crashed once at every fault point and by
  ``kills`` kills of the driver, then counted, timed and verified; it runs the other two
  scenarios after it.
- :func:`run_two_table_demo`: rows and their daily counts committed as one xid per batch
  (``txsink.transaction``), crashed at random driver points; checks that no COMMITTED xid
  published one table without the other.
- :func:`run_shard_demo`: the main job on a table sharded over several endpoints; checks
  every shard holds exactly the rows routed to it.

Invariants: each scenario owns its tables (it drops and recreates them, and deletes the
Keeper jobs earlier demo runs left on them, which describe rows that are gone); a
scenario's verdict comes from the tables' contents and ``verify``, never from the job's
own accounting.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from txsink.demo.chaos import (
    RunOutcome,
    crash_schedule,
    crashed_runs,
    job_args,
    run_job_once,
)
from txsink.demo.job import daily_ddl, daily_table, make_source, target_ddl
from txsink.demo.report import DemoReport, percentile
from txsink.protocol.codec import JobMeta


def forget_old_jobs(registry: Any, prefix: str, tables: Sequence[str]) -> None:
    """Delete the jobs of earlier demo runs (named ``prefix...``) that wrote ``tables``:
    the scenario has just recreated those tables, so the jobs describe rows that are gone."""
    for old in registry.list_jobs():
        if old.startswith(prefix) and (registry.job_meta(old) or JobMeta()).target in tables:
            registry.delete_job(old)


def run_demo(
    url: str,
    keeper: str,
    workdir: str | Path,
    *,
    files: int = 12,
    rows_per_file: int = 20_000,
    kills: int = 2,
    seed: int = 42,
    mode: str = "auto",
    two_tables: bool = True,
    shards: Sequence[str] = (),
    progress: Callable[[str], None] = lambda _m: None,
) -> DemoReport:
    from txsink.clickhouse.client import connect
    from txsink.config import WriterConfig
    from txsink.driver import open_registry

    rng = random.Random(seed)
    work = Path(workdir)
    job = f"demo-{int(time.time())}"
    table = "txsink_demo.orders"
    client = connect(url)
    client.command("CREATE DATABASE IF NOT EXISTS txsink_demo")
    client.command(f"DROP TABLE IF EXISTS {table} SYNC")
    client.command(target_ddl(table))
    config = WriterConfig.from_options({"url": url, "keeper": keeper, "table": table, "job": job})
    registry = open_registry(config)
    forget_old_jobs(registry, "demo-", [table])
    src, ckpt = work / "source", work / "checkpoint"
    source = make_source(src, files, rows_per_file, seed)
    progress(
        f"source: {source['files']} Parquet files, {source['rows']:,} rows with unique ids in {src}"
    )
    args = job_args(src, ckpt, table, job, url, keeper, mode=mode, files_per_trigger=1)
    runs: list[RunOutcome] = []
    log_path = str(work / "job.log")
    try:
        for n, (kind, what) in enumerate([*crash_schedule(kills, rng), ("clean", "")], start=1):
            started = time.time()
            for code in crashed_runs(
                args, kind, what, registry=registry, job=job, rng=rng, log_path=log_path,
                fault_after=rng.randrange(2) if kind == "fault" else 0,
            ):  # fmt: skip
                runs.append(RunOutcome(n, what or "none", code, round(time.time() - started, 1)))
                ledger = registry.ledger(job)
                progress(
                    f"run {n:2d}  crash={what or 'none':22s} exit={code:4d}  "
                    f"committed batches={ledger.committed:3d} "
                    f"rows={ledger.rows:,}"
                )
                started = time.time()
        records = registry.list(job)
    finally:
        registry.close()
    count, distinct, amount = client.query_rows(
        f"SELECT count(), uniqExact(id), sum(amount) FROM {table}"
    )[0]
    # commit latency of commits no crash interrupted (prepared and recorded by one epoch)
    latencies = [
        (r.committed_at - r.created_at) * 1000
        for r in records
        if r.committed_at is not None and r.committed_epoch == r.epoch
    ]
    report = DemoReport(
        produced=source["rows"],
        in_target=int(count),
        distinct_ids=int(distinct),
        duplicates=int(count) - int(distinct),
        missing=source["rows"] - int(distinct),
        amount_expected=source["amount"],
        amount_in_target=int(amount or 0),
        batches=len([r for r in records if r.committed_at is not None]),
        commit_p50_ms=round(percentile(latencies, 0.50), 1),
        commit_p99_ms=round(percentile(latencies, 0.99), 1),
        runs=runs,
    )
    try:
        from txsink.ops.verify import verify_job

        result = verify_job(config)
        report.verify = result.to_json() if hasattr(result, "to_json") else dict(result.__dict__)
        report.verify_clean = bool(getattr(result, "clean", False))
    except ImportError:
        report.verify = {"error": "txsink.ops.verify is not available"}
    if two_tables:
        report.two_tables = run_two_table_demo(client, url, keeper, work, rng, progress)
        report.verify_clean = report.verify_clean and report.two_tables["verify_clean"]
    client.close()
    if len(shards) > 1:
        report.shards = run_shard_demo(shards, keeper, work, rng, progress)
        report.verify_clean = report.verify_clean and report.shards["verify_clean"]
    return report


TWO_TABLE_POINTS = (
    "driver.between_writes",
    "driver.before_prepare",
    "driver.after_prepare",
    "driver.mid_commit",
    "driver.after_commit",
    "driver.after_record",
)


def run_two_table_demo(
    client: Any,
    url: str,
    keeper: str,
    work: Path,
    rng: random.Random,
    progress: Callable[[str], None],
    *,
    files: int = 4,
    rows_per_file: int = 5_000,
    crashes: int = 2,
) -> dict[str, Any]:
    """The two-table job (rows + their daily counts, one ``txsink.transaction`` per
    batch), crashed at ``crashes`` random driver points, then checked: both tables exact,
    and every COMMITTED xid published both tables."""
    from txsink.config import WriterConfig
    from txsink.driver import open_registry
    from txsink.ops.verify import verify_job

    job = f"demo2-{int(time.time())}"
    table = "txsink_demo.orders2"
    daily = daily_table(table)
    for name, ddl in ((table, target_ddl(table)), (daily, daily_ddl(daily))):
        client.command(f"DROP TABLE IF EXISTS {name} SYNC")
        client.command(ddl)
    config = WriterConfig.from_options({"url": url, "keeper": keeper, "table": table, "job": job})
    registry = open_registry(config)
    forget_old_jobs(registry, "demo2-", [table, daily])
    source = make_source(work / "source2", files, rows_per_file, 11)
    args = job_args(
        work / "source2", work / "checkpoint2", table, job, url, keeper, "--two-tables",
        files_per_trigger=1,
    )  # fmt: skip
    points = rng.sample(TWO_TABLE_POINTS, k=min(crashes, len(TWO_TABLE_POINTS)))
    runs = []
    try:
        for what in [*points, ""]:
            started = time.time()
            code = run_job_once(args, fault=what or None, log_path=str(work / "job2.log"))
            runs.append({"crash": what or "none", "exit_code": code})
            progress(
                f"two-table run  crash={what or 'none':22s} exit={code:4d}  "
                f"({time.time() - started:.0f}s)"
            )
        records = registry.list(job)
    finally:
        registry.close()
    count, distinct, amount = client.query_rows(
        f"SELECT count(), uniqExact(id), sum(amount) FROM {table}"
    )[0]
    orders, daily_amount = client.query_rows(f"SELECT sum(orders), sum(amount) FROM {daily}")[0]
    per_batch = dict(client.query_rows(f"SELECT batch, sum(orders) FROM {daily} GROUP BY batch"))
    torn = [
        r.xid
        for r in records
        if r.state.value == "COMMITTED"
        and (set(r.targets) != {table, daily} or per_batch.get(r.batch, 0) != r.table_rows()[table])
    ]
    result = verify_job(config)
    exact = (
        int(count) == int(distinct) == source["rows"]
        and int(amount or 0) == source["amount"]
        and int(orders or 0) == source["rows"]
        and int(daily_amount or 0) == source["amount"]
        and not torn
    )
    return {
        "job": job,
        "tables": [table, daily],
        "runs": runs,
        "produced": source["rows"],
        "rows_in_target": int(count),
        "distinct_ids": int(distinct),
        "daily_orders": int(orders or 0),
        "torn_xids": torn,
        "exact": exact,
        "verify_clean": result.clean,
        "verify": result.to_json(),
    }


def run_shard_demo(
    shards: Sequence[str],
    keeper: str,
    work: Path,
    rng: random.Random,
    progress: Callable[[str], None],
    *,
    files: int = 6,
    rows_per_file: int = 5_000,
    kills: int = 1,
) -> dict[str, Any]:
    """The main job on a table sharded over ``shards`` (``shard_by=id``), crashed at every
    fault point and by ``kills`` kill -9 of the driver, then checked per shard: exactly
    the rows routed to it (``intHash64(id) % N``), no duplicates, the total exact."""
    from txsink.clickhouse.client import connect
    from txsink.config import WriterConfig
    from txsink.driver import open_registry
    from txsink.ops.verify import verify_job

    job = f"demo3-{int(time.time())}"
    table = "txsink_demo.orders_local"
    clients = [connect(url) for url in shards]
    try:
        for client in clients:
            client.command("CREATE DATABASE IF NOT EXISTS txsink_demo")
            client.command(f"DROP TABLE IF EXISTS {table} SYNC")
            client.command(target_ddl(table))
        options = {"shards": ",".join(shards), "keeper": keeper, "table": table, "job": job}
        config = WriterConfig.from_options({**options, "shard_by": "id"})
        registry = open_registry(config)
        forget_old_jobs(registry, "demo3-", [table])
        source = make_source(work / "source3", files, rows_per_file, 13)
        args = job_args(
            work / "source3", work / "checkpoint3", table, job, shards[0], keeper,
            "--option", f"shards={','.join(shards)}", "--option", "shard_by=id",
            mode="attach", files_per_trigger=1,
        )  # fmt: skip
        runs = []
        try:
            for kind, what in [*crash_schedule(kills, rng), ("clean", "")]:
                started = time.time()
                log = str(work / "job3.log")
                *_, code = crashed_runs(  # the run's exit code is its last attempt's
                    args, kind, what, registry=registry, job=job, rng=rng, log_path=log
                )
                runs.append({"crash": what or "none", "exit_code": code})
                progress(
                    f"sharded run  crash={what or 'none':22s} exit={code:4d}  "
                    f"({time.time() - started:.0f}s)"
                )
        finally:
            registry.close()
        n = len(shards)
        per_shard: list[dict[str, Any]] = []
        for k, client in enumerate(clients):
            count, distinct, misplaced, amount = client.query_rows(
                f"SELECT count(), uniqExact(id), countIf(intHash64(id) % {n} != {k}), "
                f"sum(amount) FROM {table}"
            )[0]
            per_shard.append(
                {
                    "shard": shards[k],
                    "rows": int(count),
                    "distinct_ids": int(distinct),
                    "duplicates": int(count) - int(distinct),
                    "rows_of_other_shards": int(misplaced),
                    "amount": int(amount or 0),
                }
            )
    finally:
        for client in clients:
            client.close()
    total = sum(s["rows"] for s in per_shard)
    result = verify_job(config)
    exact = (
        total == source["rows"]
        and sum(s["amount"] for s in per_shard) == source["amount"]
        and all(s["duplicates"] == 0 and s["rows_of_other_shards"] == 0 for s in per_shard)
    )
    return {
        "job": job,
        "table": table,
        "runs": runs,
        "produced": source["rows"],
        "rows_in_shards": total,
        "per_shard": per_shard,
        "exact": exact,
        "verify_clean": result.clean,
        "verify": result.to_json(),
    }
