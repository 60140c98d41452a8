"""Trigger-interval sweep: a rate-limited stream into clickhouse_tx (mode=attach).

Spark's ``rate`` source produces a fixed number of rows per second, each carrying its
generation time (``timestamp``) as ``event_time``. For each trigger interval a fresh
target and job run for ``sweep_seconds``. A poller thread reads the target's ``count()``
and ``max(event_time)`` every ``POLL_SECONDS``; since each batch becomes visible
atomically and batches commit in order, a row is visible from the first poll whose
``max(event_time)`` reaches it. Visibility latency = that poll's time - event time
(poll granularity adds up to ``POLL_SECONDS``). Throughput = rows visible at the end /
run time (includes the first interval, before any batch ran); ``capacity`` = rows / time
spent in batches; ``busy`` = mean batch duration / interval (above 1: it cannot keep up).
"""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

import numpy as np

from benchmarks.common import Bench, percentile

POLL_SECONDS = 0.1
DDL = (
    "CREATE TABLE {table} (id Int64, event_time DateTime64(6, 'UTC')) ENGINE = MergeTree "
    "PARTITION BY toYYYYMMDD(event_time) ORDER BY id"
)


class Poller(threading.Thread):
    """Records (wall time, count, max event time in seconds) of the target."""

    def __init__(self, bench: Bench, table: str) -> None:
        super().__init__(daemon=True)
        self.client = bench.client()
        self.table = table
        self.samples: list[tuple[float, int, float]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        sql = f"SELECT count(), toUnixTimestamp64Micro(max(event_time)) FROM {self.table}"
        while not self.stop.is_set():
            count, max_us = self.client.query(sql).result_rows[0]
            self.samples.append((time.time(), int(count), int(max_us) / 1e6))
            self.stop.wait(POLL_SECONDS)
        self.client.close()


def row_latencies(event_times: np.ndarray, samples: list[tuple[float, int, float]]) -> np.ndarray:
    """Seconds from each row's event time to the first poll that saw it."""
    polls = np.array([s[0] for s in samples])
    maxima = np.maximum.accumulate(np.array([s[2] for s in samples]))
    first = np.searchsorted(maxima, event_times, side="left")
    seen = first < len(polls)
    return polls[first[seen]] - event_times[seen]


def one_interval(bench: Bench, interval: int, seconds: int, rate: int) -> dict[str, Any]:
    table = f"bench.sweep_{interval}s_{uuid.uuid4().hex[:6]}"
    client = bench.client()
    client.command(DDL.format(table=table))
    spark = bench.spark
    df = (
        spark.readStream.format("rate")
        .option("rowsPerSecond", rate)
        .option("numPartitions", 2)
        .load()
        .selectExpr("value AS id", "timestamp AS event_time")
    )
    poller = Poller(bench, table)
    poller.start()
    query = (
        df.writeStream.format("clickhouse_tx")
        .options(**bench.sink_options(table, mode="attach"))
        .option("checkpointLocation", str(bench.work / f"sweep-ckpt-{uuid.uuid4().hex[:8]}"))
        .trigger(processingTime=f"{interval} seconds")
        .start()
    )
    started = time.time()
    time.sleep(seconds)
    query.stop()
    elapsed = time.time() - started
    poller.stop.set()
    poller.join()
    progress = [p for p in query.recentProgress if p.get("numInputRows")]
    times = (
        client.query_np(
            f"SELECT toUnixTimestamp64Micro(event_time) FROM {table} ORDER BY event_time"
        )[:, 0].astype(np.float64)
        / 1e6
    )
    client.close()
    lat = row_latencies(times, poller.samples)
    durations = [p["durationMs"]["triggerExecution"] / 1000 for p in progress]
    processed = sum(int(p["numInputRows"]) for p in progress)
    return {
        "interval_s": interval,
        "rows": len(times),
        "batches": len(progress),
        "rows_per_s": len(times) / elapsed,
        "capacity_rows_per_s": processed / sum(durations) if durations else float("nan"),
        "latency_p50_s": percentile(list(lat), 50),
        "latency_p95_s": percentile(list(lat), 95),
        "latency_max_s": float(lat.max()) if len(lat) else float("nan"),
        "batch_seconds_mean": float(np.mean(durations)) if durations else float("nan"),
        "busy": float(np.mean(durations)) / interval if durations else float("nan"),
    }


def run(bench: Bench, progress: Any) -> dict[str, Any]:
    sizes = bench.sizes
    points = []
    for interval in sizes.sweep_intervals:
        point = one_interval(bench, interval, sizes.sweep_seconds, sizes.sweep_rate)
        points.append(point)
        progress(
            f"  trigger {interval:2d}s: {point['rows_per_s']:8,.0f} rows/s, latency p50 "
            f"{point['latency_p50_s']:.2f}s p95 {point['latency_p95_s']:.2f}s, "
            f"busy {point['busy']:.2f}"
        )
    return {
        "rate": sizes.sweep_rate,
        "seconds": sizes.sweep_seconds,
        "poll_seconds": POLL_SECONDS,
        "points": points,
    }


def plot(result: dict[str, Any], path: Any) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = result["points"]
    xs = [p["interval_s"] for p in pts]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(xs, [p["latency_p50_s"] for p in pts], "o-", label="p50")
    left.plot(xs, [p["latency_p95_s"] for p in pts], "s-", label="p95")
    left.plot(xs, xs, ":", color="grey", label="= interval")
    left.set(
        xscale="log",
        yscale="log",
        xlabel="trigger interval (s)",
        ylabel="event time -> visible (s)",
        title="visibility latency",
    )
    left.set_xticks(xs, [str(x) for x in xs])
    left.legend()
    right.plot(xs, [p["rows_per_s"] for p in pts], "o-", label="delivered rows/s into target")
    right.axhline(result["rate"], color="grey", linestyle=":", label="source rate")
    right.set(xscale="log", xlabel="trigger interval (s)", ylabel="rows/s", title="throughput")
    right.set_xticks(xs, [str(x) for x in xs])
    right.set_ylim(0, 1.15 * max(result["rate"], *(p["rows_per_s"] for p in pts)))
    right.legend()
    fig.suptitle(f"clickhouse_tx attach, Spark local[2], rate source {result['rate']:,} rows/s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
