"""The generated datasets: a narrow 4-column and a wide 30-column schema, as Parquet files.

Generated once per run (vectorised numpy, deterministic seed) and read back by every sink,
so all sinks see exactly the same rows and Spark partitions. ``arrow_bytes`` (the Arrow
in-memory size of the data) is the "MB" of every MB/s figure.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

DAY0 = np.datetime64("2024-01-01")
MONTHS = 4  # rows spread over four monthly target partitions
WIDE_INTS, WIDE_FLOATS, WIDE_STRINGS, WIDE_SMALL = 9, 9, 5, 4


@dataclass(frozen=True)
class Dataset:
    schema: str  # "narrow" | "wide"
    path: str
    rows: int
    files: int
    arrow_bytes: int
    columns: int


def _base(rng: np.random.Generator, start: int, n: int) -> dict[str, pa.Array]:
    days = rng.integers(0, 30 * MONTHS, n)
    return {
        "id": pa.array(np.arange(start, start + n, dtype=np.int64)),
        "day": pa.array(DAY0 + days.astype("timedelta64[D]"), pa.date32()),
    }


def narrow_table(rng: np.random.Generator, start: int, n: int) -> pa.Table:
    cols = _base(rng, start, n)
    cols["customer"] = pa.array(rng.integers(0, 100_000, n, dtype=np.int32))
    cols["amount"] = pa.array(rng.random(n) * 1000)
    return pa.table(cols)


def wide_table(rng: np.random.Generator, start: int, n: int) -> pa.Table:
    cols = _base(rng, start, n)
    seconds = rng.integers(0, 86_400 * 30 * MONTHS, n).astype("timedelta64[s]")
    cols["ts"] = pa.array(DAY0.astype("datetime64[us]") + seconds, pa.timestamp("us", tz="UTC"))
    for i in range(WIDE_INTS):
        cols[f"i{i}"] = pa.array(rng.integers(0, 1 << 40, n, dtype=np.int64))
    for i in range(WIDE_FLOATS):
        cols[f"f{i}"] = pa.array(rng.random(n))
    for i in range(WIDE_STRINGS):
        nums = pc.cast(pa.array(rng.integers(0, 10**6, n, dtype=np.int64)), pa.string())
        cols[f"s{i}"] = pc.binary_join_element_wise(f"name{i}-", nums, "")
    for i in range(WIDE_SMALL):
        cols[f"k{i}"] = pa.array(rng.integers(0, 1000, n, dtype=np.int32))
    return pa.table(cols)


MAKERS = {"narrow": narrow_table, "wide": wide_table}


def generate(schema: str, root: Path, rows: int, files: int, seed: int = 11) -> Dataset:
    """Write ``rows`` rows of ``schema`` as ``files`` Parquet files under ``root/schema``."""
    out = root / schema
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    per_file = -(-rows // files)
    nbytes = columns = written = 0
    for f in range(files):
        n = min(per_file, rows - written)
        if n <= 0:
            break
        table = MAKERS[schema](rng, written, n)
        nbytes += table.nbytes
        columns = table.num_columns
        pq.write_table(table, out / f"part-{f:04d}.parquet", row_group_size=256 * 1024)
        written += n
    return Dataset(schema, str(out), written, files, nbytes, columns)


def _wide_columns() -> str:
    cols = ["id Int64", "day Date", "ts DateTime64(6, 'UTC')"]
    cols += [f"i{i} Int64" for i in range(WIDE_INTS)]
    cols += [f"f{i} Float64" for i in range(WIDE_FLOATS)]
    cols += [f"s{i} String" for i in range(WIDE_STRINGS)]
    cols += [f"k{i} Int32" for i in range(WIDE_SMALL)]
    return ", ".join(cols)


COLUMNS = {
    "narrow": "id Int64, day Date, customer Int32, amount Float64",
    "wide": _wide_columns(),
}


def target_ddl(table: str, schema: str) -> str:
    """One DDL for every sink: monthly partitions, and a dedup window so mode=dedup may
    write it too (the window costs every sink the same block hashing)."""
    return (
        f"CREATE TABLE {table} ({COLUMNS[schema]}) ENGINE = MergeTree "
        "PARTITION BY toYYYYMM(day) ORDER BY id "
        "SETTINGS non_replicated_deduplication_window = 1000"
    )
