"""Writer metrics: counters and a commit-latency histogram, as a Prometheus textfile.

Spark may reuse or replace the Python worker that runs a driver-side commit at any
batch, and executors run in other processes and on other hosts, so metrics cannot live
in process memory. Totals that must be exact (batches, rows) come from the job's ledger
in Keeper (``txsink status``); this module keeps the operational series, per host, in
the textfile named by the ``metrics_textfile`` option (node_exporter's textfile
collector format): counters (:data:`COUNTERS`) and the histogram of a commit's seconds
(prepare + publish + record, :data:`BUCKETS`).

The running totals live next to it in ``<file>.state.json``; every update is a
read-modify-write of that state under an exclusive ``flock`` on ``<file>.lock``, and
both files are replaced by an atomic rename, so concurrent writers on one host never
lose an increment and a scrape never reads half a file. Writing is best effort: a
failure is logged, never raised into the commit.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import tempfile
from typing import Any

from txsink.config import WriterConfig

log = logging.getLogger(__name__)
BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
COUNTERS = {
    "batches_committed": "micro-batches committed by this writer",
    "batches_skipped": "replayed batches found already committed (no-op)",
    "batches_rolled_forward": "batches whose earlier PREPARED record was finished",
    "rows_committed": "rows published into the target",
    "recoveries": "takeovers that ran recovery",
    "fencing_events": "commits refused because a newer writer owns the job",
    "dedup_skips": "dedup-mode partitions skipped as already inserted",
}


def _load(state_path: str) -> dict[str, Any]:
    try:
        with open(state_path) as fh:
            return dict(json.load(fh))
    except (OSError, ValueError):
        return {}


def render(job: str, state: dict[str, Any]) -> str:
    lines = []
    for name, help_text in COUNTERS.items():
        lines += [f"# HELP txsink_{name}_total {help_text}", f"# TYPE txsink_{name}_total counter"]
        lines.append(f'txsink_{name}_total{{job="{job}"}} {int(state.get(name, 0))}')
    hist = state.get("commit_seconds", {"buckets": [0] * len(BUCKETS), "sum": 0.0, "count": 0})
    lines += [
        "# HELP txsink_commit_seconds prepare + publish + record time of one batch",
        "# TYPE txsink_commit_seconds histogram",
    ]
    for bound, n in zip(BUCKETS, hist["buckets"], strict=True):
        lines.append(f'txsink_commit_seconds_bucket{{job="{job}",le="{bound}"}} {n}')
    lines.append(f'txsink_commit_seconds_bucket{{job="{job}",le="+Inf"}} {hist["count"]}')
    lines.append(f'txsink_commit_seconds_sum{{job="{job}"}} {hist["sum"]}')
    lines.append(f'txsink_commit_seconds_count{{job="{job}"}} {hist["count"]}')
    return "\n".join(lines) + "\n"


def update(path: str, job: str, counters: dict[str, int], seconds: float | None = None) -> None:
    """Add ``counters`` (and one latency observation) to the textfile at ``path``."""
    state_path = path + ".state.json"
    with open(path + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        state = _load(state_path)
        for key, value in counters.items():
            state[key] = int(state.get(key, 0)) + value
        if seconds is not None:
            hist = state.setdefault(
                "commit_seconds", {"buckets": [0] * len(BUCKETS), "sum": 0.0, "count": 0}
            )
            for i, bound in enumerate(BUCKETS):
                if seconds <= bound:
                    hist["buckets"][i] += 1
            hist["sum"] += seconds
            hist["count"] += 1
        directory = os.path.dirname(os.path.abspath(path))
        for target, text in ((state_path, json.dumps(state)), (path, render(job, state))):
            fd, tmp = tempfile.mkstemp(dir=directory, prefix=".txsink-metrics-")
            with os.fdopen(fd, "w") as fh:
                fh.write(text)
            os.replace(tmp, target)


def count(config: WriterConfig, **counters: int) -> None:
    """Add to counters of the metrics textfile, if one is configured."""
    _try_update(config, counters)


def _try_update(
    config: WriterConfig, counters: dict[str, int], seconds: float | None = None
) -> None:
    if not config.metrics_textfile:
        return
    try:
        update(config.metrics_textfile, config.job, counters, seconds)
    except OSError as exc:  # best effort: metrics never fail a commit
        log.warning("metrics textfile %s not written: %s", config.metrics_textfile, exc)


def record_commit(config: WriterConfig, result: Any) -> None:
    """Log one commit and, when configured, add it to the metrics textfile."""
    log.info(
        "job %s: %s %s (%d rows, %d partitions) in %.3fs",
        config.job,
        result.action,
        result.xid,
        result.rows,
        result.partitions,
        result.seconds,
    )
    if not config.metrics_textfile:
        return
    counters = {
        "committed": {"batches_committed": 1, "rows_committed": result.rows},
        "skipped": {"batches_skipped": 1},
        "rolled_forward": {"batches_rolled_forward": 1, "rows_committed": result.rows},
    }.get(result.action, {})
    _try_update(config, counters, result.seconds)
