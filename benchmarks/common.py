"""Shared plumbing of the benchmarks: sizes, the private stack, the Spark session, stats.

Every benchmark module receives one :class:`Bench` (stack addresses, Spark session,
sizes, a scratch directory) and returns plain JSON-able dicts; :mod:`benchmarks.report`
turns them into docs/benchmarks.md.
"""

from __future__ import annotations

import contextlib
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MIB = 1024 * 1024


@dataclass(frozen=True)
class Sizes:
    """How big each benchmark is; ``quick`` is a smoke run of about two minutes."""

    name: str
    narrow_rows: int
    wide_rows: int
    files: int
    reps: int
    commit_batches: int
    stream_batches: int
    sweep_intervals: tuple[int, ...]
    sweep_seconds: int
    sweep_rate: int
    memory_big_bytes: int


QUICK = Sizes("quick", 2_000_000, 300_000, 4, 1, 30, 20, (1, 2, 5), 15, 5_000, 500 * MIB)
FULL = Sizes(
    "full", 20_000_000, 2_000_000, 16, 3, 120, 100, (1, 2, 5, 10, 30), 60, 20_000, 5 * 1024 * MIB
)


@dataclass
class Bench:
    """Everything a benchmark needs: where the stack answers, Spark, sizes, scratch space."""

    url: str
    keeper: str
    spark: Any
    sizes: Sizes
    work: Path
    data: dict[str, Any] = field(default_factory=dict)  # generated datasets by schema name

    def client(self, **kwargs: Any) -> Any:
        """A stock clickhouse-connect client on the stack."""
        import clickhouse_connect

        host, port = self.url.rsplit("/", 1)[-1].split(":")
        return clickhouse_connect.get_client(
            host=host, port=int(port), autogenerate_session_id=False, **kwargs
        )

    def sink_options(self, table: str, job: str | None = None, **extra: str) -> dict[str, str]:
        return {
            "url": self.url,
            "keeper": self.keeper,
            "table": table,
            "job": job or f"bench-{uuid.uuid4().hex[:10]}",
            **extra,
        }


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def private_stack(root: Path) -> Iterator[Any]:
    """The embedded ClickHouse + ZooKeeper in ``root`` on free ports; stopped on exit."""
    from txsink.embedded import stack

    info = stack.up(root, free_port(), free_port(), timeout=120)
    try:
        yield info
    finally:
        stack.down(root)


def spark_session(master: str = "local[2]") -> Any:
    """One Spark session for the whole run; workers import ``benchmarks`` from ROOT."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    paths = [str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    from pyspark.sql import SparkSession

    spark = (
        SparkSession.builder.master(master)
        .appName("txsink-bench")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.driver.memory", "3g")
        .config("spark.sql.streaming.stopGracefullyOnShutdown", "false")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    import txsink

    txsink.register(spark)
    from benchmarks.sinks import register_sinks

    register_sinks(spark)
    return spark


@contextlib.contextmanager
def scratch_dir(prefix: str) -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


# ------------------------------------------------------------------------------ stats


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    started = time.perf_counter()
    out = fn()
    return time.perf_counter() - started, out


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in 0..100)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def spread(values: Sequence[float]) -> dict[str, float]:
    """median, min, max of repeated measurements."""
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "n": len(values),
    }


def latency_summary(seconds: Sequence[float]) -> dict[str, float]:
    """p50/p95/p99/max in milliseconds."""
    ms = [s * 1000 for s in seconds]
    return {
        "n": len(ms),
        "p50_ms": percentile(ms, 50),
        "p95_ms": percentile(ms, 95),
        "p99_ms": percentile(ms, 99),
        "max_ms": max(ms) if ms else float("nan"),
    }


# ------------------------------------------------------------------------------ machine


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def _run(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=False).stdout
    except OSError:
        return ""


def machine() -> dict[str, Any]:
    """CPU, memory and versions of what the figures were measured on."""
    import clickhouse_connect
    import pyarrow
    import pyspark

    free = _run(["free", "-g"]).strip()
    java = (
        _run(["java", "-version"])
        or subprocess.run(["java", "-version"], capture_output=True, text=True, check=False).stderr
    )
    try:
        from importlib.metadata import version

        chdb = version("chdb-core")
    except Exception:
        chdb = "unknown"
    return {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "free_g": free,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "pyspark": pyspark.__version__,
        "pyarrow": pyarrow.__version__,
        "clickhouse_connect": clickhouse_connect.__version__,
        "chdb": chdb,
        "java": java.strip().splitlines()[0] if java.strip() else "unknown",
        "git": _run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"]).strip(),
    }
