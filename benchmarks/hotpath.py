"""Where the time goes: pyinstrument profiles of txsink's executor write and commit path.

Runs the real functions in this process (no Spark task: ``TaskContext.get`` is stood in
for), on batches shaped like Spark's (10,000-row Arrow batches of the narrow dataset):

- ``write``: ``txsink.spark.writer.write_partition`` of one partition (attach mode) next
  to the baseline's ``BaselineWriter.write`` of the same batches: the per-row path;
- ``fixed``: what one small batch ``save()`` costs besides the rows: ``validate`` on the
  driver, two tasks' ``write_partition`` of 1,000 rows, ``commit_batch``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import re
import uuid
from collections.abc import Iterator
from typing import Any

import pyarrow.dataset as pads

from benchmarks.common import Bench, timed
from benchmarks.sinks import BaselineWriter
from benchmarks.throughput import create_target, truncate
from txsink import committer
from txsink.config import WriterConfig
from txsink.protocol.ids import adhoc_xid
from txsink.spark import writer as w

TOP_LINES = 70
# call-through frames (retry wrapper, lambdas, the profiler harness) left out of the tree
WRAPPERS = re.compile(
    r"RetryPolicy\.run|Retrying\.__call__|Client\._call|<lambda>|<listcomp>|profiled|timed  "
)
SPARK_BATCH_ROWS = 10_000


class FakeTaskContext:
    """Just what ``write_partition`` reads of a Spark TaskContext."""

    def __init__(self, partition: int) -> None:
        self.partition = partition

    def partitionId(self) -> int:
        return self.partition

    def attemptNumber(self) -> int:
        return 0

    def taskAttemptId(self) -> int:
        return self.partition

    def getLocalProperty(self, key: str) -> str | None:
        return None


@contextlib.contextmanager
def task(partition: int) -> Iterator[None]:
    import pyspark

    saved = pyspark.TaskContext.get
    pyspark.TaskContext.get = staticmethod(lambda: FakeTaskContext(partition))  # type: ignore[method-assign]
    try:
        yield
    finally:
        pyspark.TaskContext.get = saved  # type: ignore[method-assign]


def batches(bench: Bench, rows: int) -> list[Any]:
    ds = pads.dataset(bench.data["narrow"].path, format="parquet")
    out, n = [], 0
    for batch in ds.to_batches(batch_size=SPARK_BATCH_ROWS):
        out.append(batch)
        n += batch.num_rows
        if n >= rows:
            break
    return out


def save_plan(bench: Bench, table: str) -> w.WritePlan:
    from txsink.spark.validate import _validate

    cfg = WriterConfig.from_options(bench.sink_options(table, mode="attach"))
    checked = _validate(cfg, bench.spark.read.parquet(bench.data["narrow"].path).schema)
    xid = adhoc_xid(uuid.uuid4().hex)
    return dataclasses.replace(checked, xid=xid, run_id=f"save-{xid}", batch=None)


def fixed_cost_save(bench: Bench, table: str, small: list[Any]) -> None:
    plan = save_plan(bench, table)
    msgs = []
    for p in range(2):
        with task(p):
            msgs.append(w.write_partition(plan, iter(small)))
    committer.commit_batch(plan, msgs, None)


def profiled(fn: Any) -> tuple[float, str]:
    from pyinstrument import Profiler

    prof = Profiler(interval=0.001)
    prof.start()
    seconds, _ = timed(fn)
    prof.stop()
    text = prof.output_text(unicode=False, color=False, show_all=False)
    lines = [ln for ln in text.splitlines() if ln.strip() and not WRAPPERS.search(ln)]
    return seconds, "\n".join(lines[:TOP_LINES])


def run(bench: Bench, progress: Any) -> dict[str, Any]:
    rows = min(bench.data["narrow"].rows, 2_000_000)
    data = batches(bench, rows)
    table = create_target(bench, "narrow", "profile")
    base_opts = {"url": bench.url, "table": table}
    baseline_s, baseline_txt = profiled(lambda: BaselineWriter(base_opts).write(iter(data)))
    truncate(bench, table)
    plan = save_plan(bench, table)
    with task(0):
        write_s, write_txt = profiled(lambda: w.write_partition(plan, iter(data)))
    small = [data[0].slice(0, 1000)]
    fixed_cost_save(bench, table, small)  # warm
    saves = 10
    fixed_s, fixed_txt = profiled(
        lambda: [fixed_cost_save(bench, table, small) for _ in itertools.repeat(None, saves)]
    )
    progress(
        f"  {rows:,} rows: baseline write {baseline_s:.2f}s, txsink write_partition "
        f"{write_s:.2f}s; fixed cost of a save {fixed_s / saves * 1000:.0f} ms"
    )
    return {
        "rows": rows,
        "baseline_write_s": baseline_s,
        "txsink_write_s": write_s,
        "fixed_save_ms": fixed_s / saves * 1000,
        "profiles": {
            "baseline_write": baseline_txt,
            "txsink_write": write_txt,
            "txsink_fixed_cost_x10": fixed_txt,
        },
    }
