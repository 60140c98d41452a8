"""The demo job: one Spark driver streaming Parquet files into ClickHouse.

Owns the job process (``python -m txsink.demo job ...``, :func:`job_main`), its
deterministic source (:func:`make_source`) and the DDL of its tables. The job streams a
directory of Parquet files with ``format("clickhouse_tx")`` (or
``foreachBatch(txsink.foreach_batch(...))``, or the two-table ``txsink.transaction``
handler) until ``trigger(availableNow=True)`` has consumed every file, then exits 0; any
failure of the query exits 1. It knows nothing of crashes: fault points arrive through
the environment (:mod:`txsink.faults`), kills from outside (:mod:`txsink.demo.chaos`).

Invariant: :func:`make_source` is a pure function of its arguments (ids unique across
files, amounts from a seeded generator), so every run and every checker sees one source.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import random
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from txsink.demo.jvm import JAVA_OPTIONS_ENV

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
    fast_start = os.environ.get(JAVA_OPTIONS_ENV)  # see txsink.demo.jvm
    if fast_start:
        builder = builder.config("spark.driver.extraJavaOptions", fast_start)
    for kv in args.conf:
        key, _, value = kv.partition("=")
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    if not (args.foreach or args.two_tables):  # foreach_batch and transaction need none
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


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["job"]:
        return job_main(argv[1:])
    sys.stderr.write("usage: python -m txsink.demo job --src ... (or run `txsink demo`)\n")
    return 2
