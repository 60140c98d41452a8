"""Where the time goes: pyinstrument profiles of txsink's executor write and commit path.

Runs the real functions in this process (no Spark task: ``TaskContext.get`` is stood in
for), on batches shaped like Spark's (10,000-row Arrow batches of the narrow dataset):

- ``write``: ``txsink.spark.writer.write_partition`` of one partition (attach mode) next
  to the baseline's ``BaselineWriter.write`` of the same batches: the per-row path;
- ``fixed``: what one small batch ``save()`` costs besides the rows: ``validate`` on the
  driver, two tasks' ``write_partition`` of 1,000 rows, ``commit_batch``;
- ``trips``: every round trip of one such batch of 4 tasks (4 staging tables of one
  target partition, as a streaming micro-batch of 4 files), counted and timed where
  txsink makes it (``Client._call`` for ClickHouse statements, ``KazooConn.wait`` for
  Keeper requests), next to the floor of one round trip (``SELECT 1``, one Keeper read).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import re
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pyarrow.dataset as pads

from benchmarks.common import Bench, timed
from benchmarks.sinks import BaselineWriter
from benchmarks.throughput import create_target, truncate
from txsink import committer
from txsink.config import WriterConfig
from txsink.protocol.ids import adhoc_xid, batch_xid
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


def save_plan(bench: Bench, table: str, schema: Any = None, **options: str) -> w.WritePlan:
    """The plan of one attach-mode ``save()`` into ``table``, as the driver validates it;
    ``schema``: the DataFrame's StructType (default: the narrow dataset's, read by Spark);
    ``options``: more sink options (``state``...)."""
    from txsink.spark.validate import _validate

    cfg = WriterConfig.from_options(bench.sink_options(table, mode="attach", **options))
    if schema is None:
        schema = bench.spark.read.parquet(bench.data["narrow"].path).schema
    checked = _validate(cfg, schema)
    xid = adhoc_xid(uuid.uuid4().hex)
    return dataclasses.replace(checked, xid=xid, run_id=f"save-{xid}", batch=None)


def fixed_cost_save(bench: Bench, table: str, small: list[Any]) -> None:
    plan = save_plan(bench, table)
    msgs = []
    for p in range(2):
        with task(p):
            msgs.append(w.write_partition(plan, iter(small)))
    committer.commit_batch(plan, msgs, None)


TRIP_TASKS = 4
# a statement's kind: its description up to the first name, number or literal in it
_NAMED = re.compile(r"[.`'{(:0-9]")


def _kind(what: str) -> str:
    words = []
    for word in what.split():
        if _NAMED.search(word):
            break
        words.append(word)
    return " ".join(words[:4]) or what.split(" ", 1)[0]


Trip = tuple[str, str, float]
STATE_STORE_FILE = "keepermap.py"  # txsink/keeper/keepermap.py: state=clickhouse's store


AHEAD_THREAD = "txsink-staging"  # txsink.spark.attach_write's thread that makes staging ahead


def _store_of_statement() -> str:
    """``state`` for a statement the KeeperMap state store sends (state=clickhouse),
    ``ClickHouse ahead`` for one a task makes while it waits for its first rows (its
    staging, off its critical path), else ``ClickHouse``."""
    if threading.current_thread().name.startswith(AHEAD_THREAD):
        return "ClickHouse ahead"
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename.endswith(STATE_STORE_FILE):
            return "state"
        frame = frame.f_back  # type: ignore[assignment]
    return "ClickHouse"


@contextlib.contextmanager
def traced(trips: list[Trip], sent: bool = False) -> Iterator[None]:
    """Append ``(store, kind, ms)`` of every ClickHouse statement and Keeper request made
    while inside (instrumentation of the real calls, not a stand-in). A statement of the
    ``state=clickhouse`` store is ``state``, not ``ClickHouse``. ``sent``: also
    ``("Keeper sent", request type, 0)`` for each request kazoo puts on the wire (a
    multi is one; ``ensure_path`` one per level it creates), waited on or not."""
    from kazoo.client import KazooClient

    from txsink.clickhouse.client import Client
    from txsink.keeper.kazoo_conn import KazooConn

    call, wait, queue = Client._call, KazooConn.wait, KazooClient._call

    def timed_call(self: Any, fn: Callable[[], Any], **kw: Any) -> Any:
        store = _store_of_statement()
        t = time.perf_counter()
        try:
            return call(self, fn, **kw)
        finally:
            trips.append((store, _kind(kw["what"]), (time.perf_counter() - t) * 1000))

    def queued(self: Any, request: Any, async_object: Any) -> Any:
        trips.append(("Keeper sent", type(request).__name__, 0.0))
        return queue(self, request, async_object)

    def timed_wait(self: Any, async_result: Any) -> Any:
        caller = sys._getframe(1).f_code.co_name
        caller = sys._getframe(2).f_code.co_name if caller in ("attempt", "read") else caller
        t = time.perf_counter()
        try:
            return wait(self, async_result)
        finally:
            trips.append(("Keeper", caller, (time.perf_counter() - t) * 1000))

    Client._call = timed_call  # type: ignore[method-assign]
    KazooConn.wait = timed_wait  # type: ignore[method-assign]
    if sent:
        KazooClient._call = queued  # type: ignore[method-assign]
    try:
        yield
    finally:
        Client._call = call  # type: ignore[method-assign]
        KazooConn.wait = wait  # type: ignore[method-assign]
        KazooClient._call = queue  # type: ignore[method-assign]


def stream_plan(first: w.WritePlan, run_id: str, b: int) -> w.WritePlan:
    """Batch ``b`` of one stream's run ``run_id``, planned as ``first`` was."""
    return dataclasses.replace(
        first,
        config=dataclasses.replace(first.config, micro_batch=True),
        xid=batch_xid(b),
        run_id=run_id,
        batch=b,
    )


def one_batch(
    plan: w.WritePlan, inputs: Sequence[list[Any]], sent: bool = False, first_after: float = 0.0
) -> dict[str, list[Trip]]:
    """Run one batch in this process: a task per element of ``inputs`` (its Arrow
    batches; partition ids 0, 1, ...) one after another, then the driver's commit; the
    trips of each phase (``tasks``, ``commit``), as :func:`traced` records them.
    ``first_after``: seconds each task's first rows take to come (Spark's read of its
    input; 0: at once, and nothing is made ahead)."""
    phases: dict[str, list[Trip]] = {"tasks": [], "commit": []}
    msgs = []
    with traced(phases["tasks"], sent):
        for p, rows in enumerate(inputs):
            with task(p):
                msgs.append(w.write_partition(plan, _late(rows, first_after)))
    with traced(phases["commit"], sent):
        committer.commit_batch(plan, msgs, plan.batch)
    return phases


def _late(rows: Sequence[Any], first_after: float) -> Iterator[Any]:
    if first_after:
        time.sleep(first_after)
    yield from rows


def trips_of_a_batch(bench: Bench, table: str, small: list[Any], reps: int) -> dict[str, Any]:
    """Round trips of a micro-batch of ``TRIP_TASKS`` tasks in a stream's steady state
    (one run, batch after batch; the takeover of the first batch is left out), per phase
    (tasks / commit): count and p50 ms per kind over ``reps`` batches; the floor of one
    round trip."""
    from txsink.driver import borrowed_job

    per: dict[tuple[str, str, str], list[list[float]]] = {}
    first = save_plan(bench, table)
    run_id = f"trips-{uuid.uuid4().hex[:8]}"
    for b in range(reps + 1):  # batches of one stream's run; the first takes the job over
        phases = one_batch(stream_plan(first, run_id, b), [small] * TRIP_TASKS)
        if not b:
            continue
        for phase, trips in phases.items():
            seen: dict[tuple[str, str, str], list[float]] = {}
            for store, kind, ms in trips:
                seen.setdefault((phase, store, kind), []).append(ms)
            for key, values in seen.items():
                per.setdefault(key, []).append(values)
    rows = []
    for (phase, store, kind), batches_ in per.items():
        rows.append(
            {
                "phase": phase,
                "store": store,
                "kind": kind,
                "count": statistics.median(len(b) for b in batches_),
                "ms": statistics.median(sum(b) for b in batches_),
            }
        )
    cfg = WriterConfig.from_options(bench.sink_options(table, mode="attach"))
    floor: dict[str, list[float]] = {"ClickHouse": [], "Keeper": []}
    with borrowed_job(cfg) as handle:
        for _ in range(30):
            t = time.perf_counter()
            handle.warehouse.client.query_rows("SELECT 1", what="SELECT 1")
            floor["ClickHouse"].append((time.perf_counter() - t) * 1000)
            t = time.perf_counter()
            handle.registry.owner(cfg.job)
            floor["Keeper"].append((time.perf_counter() - t) * 1000)
    return {
        "tasks": TRIP_TASKS,
        "batches": reps,
        "rows": sorted(rows, key=lambda r: (r["phase"] != "tasks", r["store"], -r["ms"])),
        "floor_ms": {k: statistics.median(v) for k, v in floor.items()},
    }


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
    trips = trips_of_a_batch(bench, table, small, reps=10)
    progress(
        f"  {rows:,} rows: baseline write {baseline_s:.2f}s, txsink write_partition "
        f"{write_s:.2f}s; fixed cost of a save {fixed_s / saves * 1000:.0f} ms"
    )
    return {
        "rows": rows,
        "baseline_write_s": baseline_s,
        "txsink_write_s": write_s,
        "fixed_save_ms": fixed_s / saves * 1000,
        "trips": trips,
        "profiles": {
            "baseline_write": baseline_txt,
            "txsink_write": write_txt,
            "txsink_fixed_cost_x10": fixed_txt,
        },
    }
