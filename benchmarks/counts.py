"""What a micro-batch costs that does not depend on the machine (issue 39): statements,
Keeper requests and parts added to the target, per batch, at several shapes of tasks x
partition values.

    flock /tmp/txsink-heavy.lock .venv/bin/python -m benchmarks.counts [--batches N] [--json]

Starts a private embedded stack (no Spark JVM) and, for each shape, streams ``N``
steady-state batches (after a first one that takes the job over and is not counted)
into a fresh ``MergeTree PARTITION BY p ORDER BY id`` target whose merges are stopped, in
attach mode (default visibility). Each task writes ``ROWS`` rows per partition value,
spread over every value; the tasks run in this process one after another, the real
``write_partition`` under a stand-in TaskContext, then the driver's ``commit_batch``
(:func:`benchmarks.hotpath.one_batch`). Counted per batch, median over the batches:

- ClickHouse statements of the tasks (all tasks together) besides the inserts, on their
  critical path and (in brackets) made ahead while each waits for its first rows
  (``FIRST_AFTER``: its staging, which the issue does not count), and the inserts;
- ClickHouse statements of the driver's commit, and how many of them MOVE or ATTACH;
- Keeper requests of the whole batch as kazoo sends them (a multi is one request);
- with ``--state clickhouse``: the statements of the KeeperMap state store instead;
- parts added to the target (active parts in ``system.parts``, after - before). With
  ``state=clickhouse`` the target merged on the embedded stack despite ``SYSTEM STOP
  MERGES`` (not with ``state=keeper``; cause not found yet): a figure with merged parts
  (level > 0) in the target is net, and flagged so.

``make bench`` runs it as the ``counts`` section (``benchmarks/run.py``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import uuid
from collections import Counter
from typing import Any

SHAPES = ((4, 1), (200, 1), (20, 50))  # (tasks, partition values), issue 39's
ROWS = 10  # per task per partition value
BATCHES = 2  # steady-state batches per shape (after the takeover); the counts of a
# stream's steady state repeat batch after batch, and 200 x 1 or 20 x 50 take 20 s a batch
PUBLISH = ("MOVE", "ATTACH")
# each task's first rows come this late, as Spark's read of its input makes them (tens of
# milliseconds for a file on this stack): long enough for the task to make its staging
# while it waits (txsink.spark.attach_write.AHEAD_GRACE_S), as it does under Spark
FIRST_AFTER = 0.03


def create_target(bench: Any) -> str:
    """A fresh target partitioned by ``p``, merges stopped (its parts can be counted)."""
    table = f"bench.counts_{uuid.uuid4().hex[:8]}"
    command(bench, "CREATE DATABASE IF NOT EXISTS bench")
    command(
        bench,
        f"CREATE TABLE {table} (id Int64, p Int32, v Float64) "
        "ENGINE = MergeTree PARTITION BY p ORDER BY id",
    )
    command(bench, f"SYSTEM STOP MERGES {table}")
    return table


def schema() -> Any:
    """The DataFrame's StructType (pure Python: no JVM)."""
    from pyspark.sql.types import DoubleType, IntegerType, LongType, StructField, StructType

    return StructType(
        [
            StructField("id", LongType(), False),
            StructField("p", IntegerType(), False),
            StructField("v", DoubleType(), False),
        ]
    )


def inputs(tasks: int, values: int, batch: int) -> list[list[Any]]:
    """Each task's Arrow batches: ``ROWS`` rows per partition value, over every value."""
    import numpy as np
    import pyarrow as pa

    n = ROWS * values
    out = []
    for t in range(tasks):
        start = (batch * tasks + t) * n
        ids = np.arange(start, start + n, dtype=np.int64)
        cols = {
            "id": pa.array(ids),
            "p": pa.array((ids % values).astype(np.int32)),
            "v": pa.array(ids.astype(np.float64)),
        }
        out.append([pa.RecordBatch.from_pydict(cols)])
    return out


def command(bench: Any, sql: str) -> Any:
    client = bench.client()
    try:
        return client.command(sql)
    finally:
        client.close()


def scalar(bench: Any, sql: str) -> int:
    return int(command(bench, sql))


def active_parts(bench: Any, table: str, where: str = "1") -> int:
    db, name = table.split(".")
    return scalar(
        bench,
        f"SELECT count() FROM system.parts WHERE database = '{db}' AND table = '{name}' "
        f"AND active AND {where}",
    )


def tally(phases: dict[str, list[tuple[str, str, float]]]) -> dict[str, int]:
    """The counts of one batch from the trips :func:`benchmarks.hotpath.one_batch` records."""
    c: Counter[str] = Counter()
    for phase, trips in phases.items():
        for store, kind, _ in trips:
            if store == "ClickHouse":
                head = kind.split(" ", 1)[0].upper()
                if phase == "tasks":
                    c["task_inserts" if head == "INSERT" else "task_statements"] += 1
                else:
                    c["commit_statements"] += 1
                    c["commit_publish"] += head in PUBLISH
            elif store == "ClickHouse ahead":
                c["task_ahead"] += 1
            elif store == "Keeper sent":
                c["keeper_requests"] += 1
            elif store == "Keeper":
                c["keeper_waits"] += 1
            elif store == "state":
                c["state_statements"] += 1
    return dict(c)


def kinds(phases: dict[str, list[tuple[str, str, float]]]) -> dict[str, int]:
    """Per ``phase/store/kind``: how many (the JSON's detail)."""
    return dict(Counter(f"{phase}/{s}/{k}" for phase, trips in phases.items() for s, k, _ in trips))


def kind_ms(phases: dict[str, list[tuple[str, str, float]]]) -> dict[str, float]:
    """Per ``phase/store/kind``: milliseconds spent (the JSON's detail; machine-bound)."""
    spent: Counter[str] = Counter()
    for phase, trips in phases.items():
        for store, kind, seconds in trips:
            spent[f"{phase}/{store}/{kind}"] += seconds * 1000
    return {k: round(v, 1) for k, v in spent.items()}


COLUMNS = (
    "task_statements",
    "task_ahead",
    "task_inserts",
    "commit_statements",
    "commit_publish",
    "keeper_requests",
    "keeper_waits",
    "state_statements",
    "parts_added",
)


def shape(
    bench: Any,
    tasks: int,
    values: int,
    batches: int,
    state: str,
    visibility: str = "partition",
    first_after: float = FIRST_AFTER,
) -> dict[str, Any]:
    """``batches`` steady-state batches of one stream at one shape; medians per batch."""
    from benchmarks.hotpath import one_batch, save_plan, stream_plan

    table = create_target(bench)
    first = save_plan(bench, table, schema(), state=state, visibility=visibility)
    run_id = f"counts-{uuid.uuid4().hex[:8]}"
    per_batch: list[dict[str, Any]] = []
    for b in range(batches + 1):  # the first batch takes the job over: not counted
        rows = inputs(tasks, values, b)
        before = active_parts(bench, table)
        started = time.perf_counter()
        phases = one_batch(stream_plan(first, run_id, b), rows, sent=True, first_after=first_after)
        seconds = time.perf_counter() - started
        if b:
            counts = tally(phases)
            counts["parts_added"] = active_parts(bench, table) - before
            # merged parts (level > 0) make parts_added a net figure: none expected
            counts["merged_parts"] = active_parts(bench, table, "level > 0")
            per_batch.append(
                {**counts, "seconds": round(seconds, 3), "kinds": kinds(phases),
                 "ms": kind_ms(phases)}
            )  # fmt: skip
    expected = tasks * values * ROWS * (batches + 1)
    written = scalar(bench, f"SELECT count() FROM {table}")
    if written != expected:
        raise RuntimeError(f"{table}: {written:,} rows, expected {expected:,}")
    command(bench, f"DROP TABLE IF EXISTS {table} SYNC")
    return {
        "tasks": tasks,
        "values": values,
        "state": state,
        "visibility": visibility,
        "batches": batches,
        "rows_per_task": ROWS * values,
        **{k: statistics.median(b.get(k, 0) for b in per_batch) for k in COLUMNS},
        "merged_parts": max(b["merged_parts"] for b in per_batch),
        "seconds": statistics.median(b["seconds"] for b in per_batch),
        "per_batch": per_batch,
    }


def measure(
    bench: Any,
    shapes: tuple[tuple[int, int], ...] = SHAPES,
    batches: int = BATCHES,
    states: tuple[str, ...] = ("keeper",),
    progress: Any = None,
    visibilities: tuple[str, ...] = ("partition",),
    first_after: float = FIRST_AFTER,
) -> dict[str, Any]:
    out = []
    for visibility in visibilities:
        for state in states:
            for tasks, values in shapes:
                r = shape(bench, tasks, values, batches, state, visibility, first_after)
                if progress:
                    progress(
                        f"  {tasks} x {values} (state={state}, visibility={visibility}): "
                        f"{r['seconds']:.1f} s a batch"
                    )
                out.append(r)
    return {"rows_per_value": ROWS, "batches": batches, "shapes": out}


def table(out: dict[str, Any]) -> list[str]:
    """The markdown table of :func:`measure`'s result."""
    lines = [
        "| tasks x partition values | visibility | state | task statements besides inserts "
        "(made ahead) | inserts | commit statements | of them MOVE/ATTACH | Keeper requests "
        "(waited) | state statements | parts added |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in out["shapes"]:
        state = f"{r['state_statements']:g}" if r["state"] == "clickhouse" else "-"
        # with state=clickhouse, KazooConn.wait is the KeeperMap store's: no Keeper
        keeper = (
            f"{r['keeper_requests']:g} ({r['keeper_waits']:g})" if r["state"] == "keeper" else "-"
        )
        # batch visibility merges the batch staging before it is attached: level > 0 by
        # design; elsewhere merged parts mean the target merged, and the figure is net
        batch = r.get("visibility") == "batch"
        merged = (
            f" (net; {r['merged_parts']:g} merged parts)"
            if r.get("merged_parts") and not batch
            else ""
        )
        lines.append(
            f"| {r['tasks']} x {r['values']} | {r.get('visibility', 'partition')} | "
            f"{r['state']} | {r['task_statements']:g} ({r.get('task_ahead', 0):g}) | "
            f"{r['task_inserts']:g} | {r['commit_statements']:g} | {r['commit_publish']:g} | "
            f"{keeper} | {state} | "
            f"{r['parts_added']:g}{merged} |"
        )
    return lines


def run(bench: Any, progress: Any) -> dict[str, Any]:
    """The ``counts`` section of ``make bench``."""
    # the default publish (visibility=batch where the target allows it: these targets do)
    # at every shape with state=keeper, then the state statements of state=clickhouse where
    # the tasks are many (not 20 x 50: its 20 tasks lie between 4 and 200)
    batch = ("batch",)
    out = measure(bench, progress=progress, visibilities=batch)
    out["shapes"] += measure(
        bench, SHAPES[:2], states=("clickhouse",), progress=progress, visibilities=batch
    )["shapes"]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks.counts", description=__doc__)
    parser.add_argument("--batches", type=int, default=BATCHES)
    parser.add_argument(
        "--state", default="keeper", help="comma-separated: keeper, clickhouse (default keeper)"
    )
    parser.add_argument("--shapes", default=",".join(f"{t}x{p}" for t, p in SHAPES))
    parser.add_argument(
        "--visibility", default="partition", help="comma-separated: partition, batch"
    )
    parser.add_argument(
        "--first-after",
        type=float,
        default=FIRST_AFTER,
        help=f"seconds each task waits for its first rows (default {FIRST_AFTER}; 0: at "
        "once, so its staging CREATE is on its critical path)",
    )
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args(argv)
    import logging

    from benchmarks.common import QUICK, Bench, private_stack, scratch_dir

    logging.getLogger("txsink").setLevel(logging.ERROR)  # the takeovers are expected
    shapes = tuple((int(t), int(p)) for t, p in (s.split("x") for s in args.shapes.split(",") if s))
    states = tuple(s.strip() for s in args.state.split(",") if s.strip())
    progress = None if args.json else (lambda m: print(m, file=sys.stderr, flush=True))
    started = time.monotonic()
    with scratch_dir("txsink-counts-") as work, private_stack(work / "stack") as info:
        bench = Bench(info.url, info.keeper, None, QUICK, work)
        try:
            vis = tuple(v.strip() for v in args.visibility.split(",") if v.strip())
            out = measure(bench, shapes, args.batches, states, progress, vis, args.first_after)
        finally:
            from txsink.driver import close_pooled

            close_pooled()  # before the stack stops: kazoo would retry its ZooKeeper
    out["seconds"] = round(time.monotonic() - started, 1)
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        print(
            f"per micro-batch, median of {args.batches} steady-state batches, "
            f"{ROWS} rows per task per partition value, attach mode ({out['seconds']:.0f} s)"
        )
        print("\n".join(table(out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
