"""What the per-value checks cost (docs/types.md): ``txsink.clickhouse.values.apply`` over
every batch of a dataset, next to inserting the same batches with ``insert_arrow`` (what
the at-least-once baseline does with them).

Two targets per dataset: its own table (its columns need few checks: the date range and
the non-Nullable columns' nulls), and a *checked* variant where every integer column is
unsigned and the timestamp is ``DateTime64(3)``, so every column gets range and precision
rules. The rules come from the DataFrame's Spark schema, as the writer plans them.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import pyarrow.dataset as pads

from benchmarks.common import Bench
from benchmarks.data import COLUMNS
from benchmarks.throughput import create_target, drop, truncate
from txsink.clickhouse.chtypes import SparkField
from txsink.clickhouse.sqltext import split_top_level
from txsink.clickhouse.values import apply, plan_rules
from txsink.ports.warehouse import ColumnInfo

REPEATS = 3
BATCH_ROWS = 10_000  # Spark's default Arrow batch (spark.sql.execution.arrow.maxRecordsPerBatch)


def _columns(schema: str) -> list[ColumnInfo]:
    return [ColumnInfo(*c.strip().split(" ", 1)) for c in split_top_level(COLUMNS[schema])]


def _checked_columns(schema: str) -> list[ColumnInfo]:
    out = []
    for col in _columns(schema):
        name, ch = col.name, col.type
        if ch in ("Int32", "Int64") and name != "id":
            ch = "U" + ch
        elif ch.startswith("DateTime64"):
            ch = "DateTime64(3, 'UTC')"
        out.append(ColumnInfo(name, ch))
    return out


def run(bench: Bench, log: Any) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for schema, ds in bench.data.items():
        df = bench.spark.read.parquet(ds.path)
        fields = [
            SparkField(f.name, f.dataType.simpleString(), f.nullable) for f in df.schema.fields
        ]
        batches = pads.dataset(ds.path).to_batches(batch_size=BATCH_ROWS)
        batches = list(batches)
        table = create_target(bench, schema, name=f"values_{schema}")
        client = bench.client()
        try:
            inserts = []
            for _ in range(REPEATS):
                truncate(bench, table)
                started = time.perf_counter()
                for b in batches:
                    client.insert_arrow(table, b)
                inserts.append(time.perf_counter() - started)
        finally:
            client.close()
            drop(bench, table)
        insert_s = statistics.median(inserts)
        for variant, columns in (("own", _columns(schema)), ("checked", _checked_columns(schema))):
            rules = plan_rules(fields, columns)
            runs = []
            for _ in range(REPEATS):
                started = time.perf_counter()
                for b in batches:
                    apply(rules, b, table)
                runs.append(time.perf_counter() - started)
            checks_s = statistics.median(runs)
            results[f"{schema}-{variant}"] = {
                "rows": ds.rows,
                "rules": len(rules),
                "checks_s": round(checks_s, 4),
                "insert_s": round(insert_s, 3),
                "share_pct": round(100 * checks_s / insert_s, 2),
            }
            log(f"values {schema}/{variant}: {len(rules)} rules, {checks_s:.3f}s vs insert "
                f"{insert_s:.2f}s ({100 * checks_s / insert_s:.2f}%)")  # fmt: skip
    return results
