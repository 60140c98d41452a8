"""What ``txsink tune`` measures and recommends (pure): one sample per measured
transaction, the recommendation, the result of a run, and the defaults of the
measurement. :mod:`txsink.ops.tune` measures and advises with them."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

DEFAULT_TRANSACTIONS = 20
DEFAULT_MAX_OVERHEAD = 0.05
DEFAULT_WRITERS = 4
DEFAULT_MERGE_SECONDS = 60.0
PARTS_BUDGET = 0.1  # "well below" parts_to_delay_insert: a tenth of it per merge cycle
MIN_INTERVAL = 1.0
ROWS_PER_PARTITION = 2
SCRATCH_PREFIX = "__txsink_tune_"


@dataclass
class Sample:
    """One measured transaction."""

    batch: int
    partitions: int
    rows: int
    stage_seconds: float  # create staging + insert (the executors' fixed cost)
    commit_seconds: float  # prepare + publish + record + drop (Transactor.commit_batch)
    prepare_seconds: float
    publish_seconds: float

    @property
    def overhead_seconds(self) -> float:
        return self.stage_seconds + self.commit_seconds


@dataclass
class Recommendation:
    interval: float
    overhead_interval: float
    parts_interval: float
    rows_per_second: float | None
    rate_source: str
    rows_per_batch: int | None
    reasoning: list[str]


@dataclass
class TuneResult:
    table: str
    scratch_table: str
    job: str
    warmup_seconds: float
    samples: list[Sample]
    parts_to_delay_insert: int
    parts_to_throw_insert: int
    partitions_available: int
    max_overhead: float
    writers: int
    merge_seconds: float
    recommendation: Recommendation | None = None
    notes: list[str] = field(default_factory=list)
    shards: list[dict[str, Any]] = field(default_factory=list)  # per shard (a sharded job)

    def stats(self, attr: str, samples: Sequence[Sample] | None = None) -> dict[str, float]:
        values = [getattr(s, attr) for s in (self.samples if samples is None else samples)]
        return {
            "p50": round(percentile(values, 0.50), 4),
            "p95": round(percentile(values, 0.95), 4),
            "p99": round(percentile(values, 0.99), 4),
            "mean": round(statistics.fmean(values), 4) if values else 0.0,
        }

    def to_json(self) -> dict[str, Any]:
        by_parts = [
            {
                "partitions": k,
                **self.stats("commit_seconds", [s for s in self.samples if s.partitions == k]),
            }
            for k in sorted({s.partitions for s in self.samples})
        ]
        return {
            "table": self.table,
            "scratch_table": self.scratch_table,
            "job": self.job,
            "transactions": len(self.samples),
            "warmup_seconds": round(self.warmup_seconds, 4),
            "commit_seconds": self.stats("commit_seconds"),
            "stage_seconds": self.stats("stage_seconds"),
            "overhead_seconds": self.stats("overhead_seconds"),
            "prepare_seconds": self.stats("prepare_seconds"),
            "publish_seconds": self.stats("publish_seconds"),
            "commit_s_by_partitions": by_parts,
            "parts_to_delay_insert": self.parts_to_delay_insert,
            "parts_to_throw_insert": self.parts_to_throw_insert,
            "partitions_available": self.partitions_available,
            "max_overhead": self.max_overhead,
            "writers": self.writers,
            "merge_seconds": self.merge_seconds,
            "recommendation": asdict(self.recommendation) if self.recommendation else None,
            **({"shards": self.shards} if self.shards else {}),
            "samples": [
                {**asdict(s), "overhead_seconds": s.overhead_seconds} for s in self.samples
            ],
            "notes": list(self.notes),
        }


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (0 for no values)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, math.ceil(q * len(ordered)))
    return float(ordered[min(rank, len(ordered)) - 1])
