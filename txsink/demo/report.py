"""What a demo run measured, and its verdict.

Owns :class:`DemoReport` (rows produced against rows in the target, duplicates, missing
ids, sums, batches, commit latency, the runs and their crashes, the ``verify`` results of
every scenario) and the EXACT verdict the CLI and ``make demo`` exit on.

Invariant: :attr:`DemoReport.exact` holds only when the main table has every produced id
exactly once with the expected ``sum(amount)``, and every other scenario that ran
reported itself exact too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from txsink.demo.chaos import RunOutcome


@dataclass
class DemoReport:
    produced: int
    in_target: int
    distinct_ids: int
    duplicates: int
    missing: int
    amount_expected: int
    amount_in_target: int
    batches: int
    commit_p50_ms: float
    commit_p99_ms: float
    runs: list[RunOutcome] = field(default_factory=list)
    verify_clean: bool = False
    verify: dict[str, Any] = field(default_factory=dict)
    two_tables: dict[str, Any] = field(default_factory=dict)
    shards: dict[str, Any] = field(default_factory=dict)

    @property
    def exact(self) -> bool:
        return (
            self.in_target == self.distinct_ids == self.produced
            and self.amount_in_target == self.amount_expected
            and self.two_tables.get("exact", True)
            and self.shards.get("exact", True)
        )

    def to_json(self) -> dict[str, Any]:
        data = dict(self.__dict__)
        data["runs"] = [r.__dict__ for r in self.runs]
        data["exact"] = self.exact
        return data


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    idx = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[idx]
