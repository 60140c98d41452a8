"""The state store's cost: the same work with ``state=keeper`` and ``state=clickhouse``
(KeeperMap), side by side in one run, in rotated rounds (issue 26 aims at no more than
15 ms per batch above the Keeper store).

Per round and store:

1. driver commit: ``committer.commit_batch`` of an attach batch of 4 target partitions
   (what Spark's driver runs per micro-batch: epoch check, prepare, MOVE, commit record
   and ledger, heartbeat, stray sweep); staging is written outside the timing;
2. dedup save: a Spark batch save of 10,000 rows in 4 Spark partitions in dedup mode
   (each task records its block state before and after inserting), end to end;
3. recovery: a new writer's takeover after a predecessor died right after PREPARE
   (new epoch + roll forward) plus its next commit (``benchmarks/recovery.py``).

Reported: medians per store and the paired difference per round (ClickHouse minus
Keeper), whose median is the figure to read on a noisy machine.
"""

from __future__ import annotations

import statistics
import time
import uuid
from typing import Any

from benchmarks.commit_overhead import driver_path
from benchmarks.common import Bench, latency_summary
from benchmarks.recovery import one_restart

STORES = ("keeper", "clickhouse")
PARTITIONS = 4
SAVE_ROWS = 10_000


def dedup_saves(bench: Bench, store: str, saves: int) -> list[float]:
    table = f"bench.state_{uuid.uuid4().hex[:6]}"
    client = bench.client()
    try:
        client.command(
            f"CREATE TABLE {table} (id Int64, p Int32) ENGINE = MergeTree ORDER BY id "
            "SETTINGS non_replicated_deduplication_window = 1000"
        )
    finally:
        client.close()
    job = f"bench-state-{uuid.uuid4().hex[:8]}"
    walls = []
    for i in range(saves + 1):  # the first save takes the epoch and warms up: not counted
        df = bench.spark.range(i * SAVE_ROWS, (i + 1) * SAVE_ROWS, numPartitions=PARTITIONS)
        df = df.selectExpr("id", "cast(id % 7 as int) as p")
        writer = df.write.format("clickhouse_tx").options(
            **bench.sink_options(table, job=job, mode="dedup", state=store, txn_version=str(i))
        )
        started = time.perf_counter()
        writer.mode("append").save()
        if i:
            walls.append(time.perf_counter() - started)
    return walls


def run(bench: Bench, progress: Any) -> dict[str, Any]:
    import txsink

    txsink.register(bench.spark)
    rounds = max(2, bench.sizes.reps * 2)
    batches = max(10, bench.sizes.commit_batches // 3)
    saves = 5
    per: dict[str, dict[str, list[float]]] = {
        s: {"commit": [], "save": [], "recovery": []} for s in STORES
    }
    paired: dict[str, list[float]] = {"commit": [], "save": [], "recovery": []}
    for r in range(rounds):
        order = STORES if r % 2 == 0 else tuple(reversed(STORES))
        medians: dict[str, dict[str, float]] = {}
        for store in order:
            commit = driver_path(bench, PARTITIONS, batches, raw=True, state=store)
            save = dedup_saves(bench, store, saves)
            recovery = [one_restart(bench, True, state=store) for _ in range(3)]
            per[store]["commit"] += commit
            per[store]["save"] += save
            per[store]["recovery"] += recovery
            medians[store] = {
                "commit": statistics.median(commit),
                "save": statistics.median(save),
                "recovery": statistics.median(recovery),
            }
        for what, diffs in paired.items():
            diffs.append(medians["clickhouse"][what] - medians["keeper"][what])
        progress(
            f"  round {r + 1}/{rounds}: commit +{paired['commit'][-1] * 1000:.1f} ms, dedup save "
            f"+{paired['save'][-1] * 1000:.1f} ms, recovery +{paired['recovery'][-1] * 1000:.1f} "
            "ms (clickhouse - keeper)"
        )
    return {
        "rounds": rounds,
        "batches_per_round": batches,
        "saves_per_round": saves,
        "partitions": PARTITIONS,
        "save_rows": SAVE_ROWS,
        "stores": {s: {k: latency_summary(v) for k, v in per[s].items()} for s in STORES},
        "paired_ms": {
            k: {
                "median": round(statistics.median(v) * 1000, 1),
                "min": round(min(v) * 1000, 1),
                "max": round(max(v) * 1000, 1),
                "rounds": [round(x * 1000, 1) for x in v],
            }
            for k, v in paired.items()
        },
    }
