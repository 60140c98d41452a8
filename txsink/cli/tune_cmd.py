"""``txsink tune``: measure the commit overhead on a table and recommend a trigger interval.

Exit status 0. Measuring and the recommendation are :mod:`txsink.ops.tune`'s; this
module picks the shards, the input rate's source, and renders.
"""

from __future__ import annotations

import argparse
from typing import Any

from txsink.cli.common import jobs_of, open_stores
from txsink.cli.output import Exit, Output, table
from txsink.clickhouse.warehouse import ClickHouseWarehouse
from txsink.errors import ConfigError
from txsink.ops import tune as tn
from txsink.ops import tune_model as tm


def run_tune(args: argparse.Namespace, out: Output) -> int:
    if args.sample_seconds and not args.job:
        raise ConfigError("--sample-seconds measures a job's rate from its ledger: add --job J")
    with open_stores(args) as stores:
        if args.job:
            jobs_of(stores, args)  # a missing job is a usage error before anything is measured
        shards = list(args.shards)
        if not shards and args.job:
            meta = stores.registry.job_meta(args.job)
            shards = list(meta.shards) if meta else []

        def measure(warehouse: Any, step: Any) -> tm.TuneResult:
            return tn.measure(
                stores.registry,
                warehouse,
                args.table,
                transactions=args.transactions,
                max_overhead=args.max_overhead,
                writers=args.writers,
                merge_seconds=args.merge_seconds,
                progress=out.progress,
                step=step,
            )

        total = (args.transactions + 1) * max(1, len(shards))
        with out.bar(total, "tune") as step:
            if shards:
                db = stores.warehouse().staging_db
                result = tn.combine_shards(
                    shards,
                    [
                        measure(ClickHouseWarehouse(stores.shard_client(u), db), step)
                        for u in shards
                    ],
                )
            else:
                result = measure(stores.warehouse(), step)
        rate, source = args.rows_per_second, "--rows-per-second"
        if rate is None and args.job:
            rate, source = tn.observed_rate(
                stores.registry, args.job, sample_seconds=args.sample_seconds
            )
            if rate is None:
                result.notes.append(source)
    over = result.stats("overhead_seconds")
    result.recommendation = tn.recommend(
        over["p95"],
        max_overhead=args.max_overhead,
        parts_to_delay_insert=result.parts_to_delay_insert,
        parts_to_throw_insert=result.parts_to_throw_insert,
        writers=args.writers,
        merge_seconds=args.merge_seconds,
        rows_per_second=rate,
        rate_source=source if rate is not None else "",
        samples=len(result.samples),
    )
    payload = result.to_json()
    if args.plot:
        payload["plot"] = tn.write_plot(result, args.plot)
    data = result.to_json()
    rows = [
        {"measure": name, **data[key]}
        for name, key in (
            ("stage (create + insert)", "stage_seconds"),
            ("prepare", "prepare_seconds"),
            ("publish + record + drop", "publish_seconds"),
            ("commit total", "commit_seconds"),
            ("overhead (stage + commit)", "overhead_seconds"),
        )
    ]
    per_shard = [
        f"shard {s['shard']} ({s['url']}): commit p50 {s['commit_seconds']['p50']:.3f} s / "
        f"p95 {s['commit_seconds']['p95']:.3f} s"
        for s in data.get("shards", [])
    ]
    by_parts = ", ".join(
        f"{v['partitions']} partition(s): p50 {v['p50']:.3f} s / p95 {v['p95']:.3f} s"
        for v in data["commit_s_by_partitions"]
    )
    text = "\n".join(
        [
            f"measured {len(result.samples)} transactions into scratch copy {result.scratch_table} "
            f"(dropped), scratch job {result.job} (deleted)",
            table(rows, ["measure", "p50", "p95", "p99", "mean"]),
            f"commit by partitions touched: {by_parts}",
            *per_shard,
            *(f"note: {n}" for n in result.notes),
            "",
            "reasoning:",
            *(f"  {line}" for line in result.recommendation.reasoning),
            *([f"plot written to {args.plot}"] if args.plot else []),
        ]
    )
    return out.result(Exit.OK, text, **payload)
