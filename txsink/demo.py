"""The demo job and its chaos driver (``txsink demo`` / ``make demo``).

Two halves:

- :func:`job_main` (``python -m txsink.demo job ...``): one Spark driver running a
  streaming query from a directory of Parquet files into ClickHouse with
  ``format("clickhouse_tx")`` (or ``foreachBatch(txsink.foreach_batch(...))``) until
  ``trigger(availableNow=True)`` has consumed every file. The integration tests run the
  same entry point, so the demo and the tests exercise one code path.
- :func:`run_demo`: generates a deterministic source with unique ids, then runs the job
  again and again, each run crashed by a fault point (``TXSINK_FAULT``) or by ``kill -9``
  of the whole driver process group, until a run finishes; then it reports produced vs
  target rows, duplicates, missing ids, batches, commit latency and runs ``verify``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from txsink.faults import POINTS
from txsink.protocol.codec import JobMeta

SOURCE_SCHEMA_DDL = "id BIGINT, event_time TIMESTAMP, day DATE, customer STRING, amount BIGINT"


def target_ddl(table: str) -> str:
    return (
        f"CREATE TABLE {table} (id Int64, event_time DateTime64(6, 'UTC'), day Date, "
        "customer LowCardinality(String), amount Int64) "
        "ENGINE = MergeTree PARTITION BY toYYYYMM(day) ORDER BY (day, id)"
    )


def daily_table(table: str) -> str:
    """The second table of the two-table job: per batch and day, orders and amount."""
    return f"{table}_daily"


def daily_ddl(table: str) -> str:
    return (
        f"CREATE TABLE {table} (batch Int64, day Date, orders Int64, amount Int64) "
        "ENGINE = MergeTree PARTITION BY toYYYYMM(day) ORDER BY (batch, day)"
    )


def two_table_handler(
    spark: Any, table: str, options: dict[str, Any]
) -> Callable[[Any, int], None]:
    """The foreachBatch function of the two-table job: the rows into ``table`` and their
    daily counts into :func:`daily_table`, one ``txsink.transaction`` per micro-batch."""
    import txsink

    common = {k: v for k, v in options.items() if k != "table"}

    def handle(df: Any, batch_id: int) -> None:
        from pyspark.sql import functions as F

        daily = df.groupBy("day").agg(F.count("*").alias("orders"), F.sum("amount").alias("amount"))
        daily = daily.select(
            F.lit(batch_id).cast("bigint").alias("batch"), "day", "orders", "amount"
        )
        with txsink.transaction(spark, batch_id, **common) as tx:
            tx.write(df, table=table)
            tx.write(daily, table=daily_table(table))

    return handle


def make_source(path: str | Path, files: int, rows_per_file: int, seed: int = 7) -> dict[str, int]:
    """Write ``files`` Parquet files of unique ids spread over four monthly partitions."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    base = dt.datetime(2024, 1, 1, tzinfo=dt.UTC)
    total_amount = 0
    for f in range(files):
        ids = list(range(f * rows_per_file, (f + 1) * rows_per_file))
        times = [
            base + dt.timedelta(days=rng.randrange(120), seconds=rng.randrange(86400)) for _ in ids
        ]
        amounts = [rng.randrange(1, 100_000) for _ in ids]
        total_amount += sum(amounts)
        table = pa.table(
            {
                "id": pa.array(ids, pa.int64()),
                "event_time": pa.array(times, pa.timestamp("us", tz="UTC")),
                "day": pa.array([t.date() for t in times], pa.date32()),
                "customer": pa.array([f"c{rng.randrange(50)}" for _ in ids]),
                "amount": pa.array(amounts, pa.int64()),
            }
        )
        pq.write_table(table, out / f"part-{f:05d}.parquet")
    return {"rows": files * rows_per_file, "amount": total_amount, "files": files}


# ---------------------------------------------------------------------------- the job


def job_main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m txsink.demo job")
    parser.add_argument("--src", required=True)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--table", required=True)
    parser.add_argument("--job", required=True)
    parser.add_argument("--url", default=os.environ.get("TXSINK_URL"))
    parser.add_argument("--keeper", default=os.environ.get("TXSINK_KEEPER"))
    parser.add_argument("--mode", default="auto")
    parser.add_argument("--files-per-trigger", type=int, default=2)
    parser.add_argument("--master", default="local[2]")
    parser.add_argument(
        "--foreach", action="store_true", help="use foreachBatch(txsink.foreach_batch)"
    )
    parser.add_argument(
        "--two-tables",
        action="store_true",
        help="foreachBatch with txsink.transaction: the rows and their daily counts, one xid",
    )
    parser.add_argument("--option", action="append", default=[], help="extra sink option k=v")
    parser.add_argument("--conf", action="append", default=[], help="extra Spark conf k=v")
    args = parser.parse_args(argv)

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    import txsink

    builder = (
        SparkSession.builder.master(args.master)
        .appName(f"txsink-{args.job}")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.streaming.stopGracefullyOnShutdown", "false")
    )
    for kv in args.conf:
        key, _, value = kv.partition("=")
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    txsink.register(spark)
    options = {
        "url": args.url,
        "keeper": args.keeper,
        "table": args.table,
        "job": args.job,
        "mode": args.mode,
    }
    for kv in args.option:
        key, _, value = kv.partition("=")
        options[key] = value
    df = (
        spark.readStream.schema(SOURCE_SCHEMA_DDL)
        .option("maxFilesPerTrigger", args.files_per_trigger)
        .parquet(args.src)
    )
    writer = df.writeStream.option("checkpointLocation", args.checkpoint).trigger(availableNow=True)
    if args.two_tables:
        query = writer.foreachBatch(two_table_handler(spark, args.table, options)).start()
    elif args.foreach:
        query = writer.foreachBatch(txsink.foreach_batch(**options)).start()
    else:
        query = writer.format("clickhouse_tx").options(**options).start()
    try:
        query.awaitTermination()
    except Exception as exc:  # noqa: BLE001 - the process boundary: report and exit 1
        sys.stderr.write(f"txsink demo job failed: {str(exc)[:2000]}\n")
        return 1
    finally:
        spark.stop()
    return 0


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


# ------------------------------------------------------------------------ the demo


@dataclass
class DemoReport:
    produced: int
    in_target: int
    distinct_ids: int
    duplicates: int
    missing: int
    amount_expected: int
    amount_in_target: int
    batches: int
    commit_p50_ms: float
    commit_p99_ms: float
    runs: list[RunOutcome] = field(default_factory=list)
    verify_clean: bool = False
    verify: dict[str, Any] = field(default_factory=dict)
    two_tables: dict[str, Any] = field(default_factory=dict)
    shards: dict[str, Any] = field(default_factory=dict)

    @property
    def exact(self) -> bool:
        return (
            self.in_target == self.distinct_ids == self.produced
            and self.amount_in_target == self.amount_expected
            and self.two_tables.get("exact", True)
            and self.shards.get("exact", True)
        )

    def to_json(self) -> dict[str, Any]:
        data = dict(self.__dict__)
        data["runs"] = [r.__dict__ for r in self.runs]
        data["exact"] = self.exact
        return data


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    idx = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[idx]


def crash_schedule(kills: int, rng: random.Random) -> list[tuple[str, str]]:
    schedule = [("fault", p) for p in POINTS]
    schedule += [("kill", "kill -9 driver")] * kills
    rng.shuffle(schedule)
    return schedule


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
    # the demo owns its table: jobs of earlier demo runs described rows that are gone now
    for old in registry.list_jobs():
        if old.startswith("demo-") and (registry.job_meta(old) or JobMeta()).target == table:
            registry.delete_job(old)
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
            for _attempt in range(3 if kind == "clean" else 1):
                started = time.time()
                if kind == "fault":
                    code = run_job_once(
                        args, fault=what, fault_after=rng.randrange(2), log_path=log_path
                    )
                elif kind == "kill":
                    trigger = kill_after_progress(registry, job, rng)
                    code = run_job_once(args, kill_when=trigger, log_path=log_path)
                else:
                    code = run_job_once(args, log_path=log_path)
                runs.append(RunOutcome(n, what or "none", code, round(time.time() - started, 1)))
                ledger = registry.ledger(job)
                progress(
                    f"run {n:2d}  crash={what or 'none':22s} exit={code:4d}  "
                    f"committed batches={ledger.committed:3d} "
                    f"rows={ledger.rows:,}"
                )
                if kind != "clean" or code == 0:
                    break
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
    for old in registry.list_jobs():
        if old.startswith("demo2-") and (registry.job_meta(old) or JobMeta()).target in (
            table,
            daily,
        ):
            registry.delete_job(old)
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
        for old in registry.list_jobs():
            if old.startswith("demo3-") and (registry.job_meta(old) or JobMeta()).target == table:
                registry.delete_job(old)
        source = make_source(work / "source3", files, rows_per_file, 13)
        args = job_args(
            work / "source3", work / "checkpoint3", table, job, shards[0], keeper,
            "--option", f"shards={','.join(shards)}", "--option", "shard_by=id",
            mode="attach", files_per_trigger=1,
        )  # fmt: skip
        schedule = [*(("fault", p) for p in POINTS), *(("kill", "kill -9 driver"),) * kills]
        rng.shuffle(schedule)
        runs = []
        try:
            for kind, what in [*schedule, ("clean", "")]:
                started = time.time()
                log = str(work / "job3.log")
                for _attempt in range(3 if kind == "clean" else 1):
                    if kind == "fault":
                        code = run_job_once(args, fault=what, log_path=log)
                    elif kind == "kill":
                        trigger = kill_after_progress(registry, job, rng)
                        code = run_job_once(args, kill_when=trigger, log_path=log)
                    else:
                        code = run_job_once(args, log_path=log)
                    if kind != "clean" or code == 0:
                        break
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


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["job"]:
        return job_main(argv[1:])
    sys.stderr.write("usage: python -m txsink.demo job --src ... (or run `txsink demo`)\n")
    return 2


if __name__ == "__main__":
    sys.exit(main())
