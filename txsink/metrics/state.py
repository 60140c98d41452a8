"""The persisted totals of the writer metrics: one small JSON state file per host.

Owns where a writer's metrics live (:class:`Store`, :func:`store_of`), the state's shape
and how an update adds to it. Spark may reuse or replace the Python worker that runs a
driver-side commit at any batch, and executors run in other processes, so the series
cannot live in one process's memory: every update is a read-modify-write of the state
file under an exclusive ``flock`` of its lock file, and the file is replaced by a rename.

Invariants: no increment is lost between processes on one host; a reader (the scrape
endpoint, which reads without the lock) never sees half a file; a state file that is
missing, damaged or of another shape reads as empty (the next update starts afresh).

State: ``{"format": 1, "jobs": {job: {"counters": {name: n}, "commit_seconds":
{"buckets": [cumulative count per BUCKETS bound], "sum": s, "count": n}, "last_commit":
unix time}}}``. No ``prometheus_client`` here: :mod:`txsink.metrics.export` renders it.
Not its multiprocess mode: that keeps one file per process, and Spark runs a driver-side
commit in a fresh Python worker as often as every batch, so the files (and every
scrape's work) would grow without bound; it also needs ``PROMETHEUS_MULTIPROC_DIR`` set
before the library is imported in every worker.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
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
FORMAT = 1


@dataclass(frozen=True)
class Store:
    """One host's persisted totals: the state file, its lock, the textfile ("" = none)."""

    state: str
    lock: str
    textfile: str = ""


def store_of(config: WriterConfig) -> Store | None:
    """Where ``config``'s metrics live, or None when neither option asks for them."""
    if config.metrics_textfile:
        path = config.metrics_textfile
        return Store(path + ".state.json", path + ".lock", path)
    if config.metrics_port is not None:
        directory = os.path.join(tempfile.gettempdir(), f"txsink-metrics-{os.getuid()}")
        base = os.path.join(directory, f"port-{config.metrics_port}")
        return Store(base + ".state.json", base + ".lock")
    return None


def _empty_histogram() -> dict[str, Any]:
    return {"buckets": [0] * len(BUCKETS), "sum": 0.0, "count": 0}


def load(state_path: str, job: str = "") -> dict[str, Any]:
    """The state at ``state_path``: empty when missing, unreadable or not of this shape
    (the next update starts it afresh). A file of the first release (one job's flat
    totals, no ``format``) reads as ``job``'s."""
    try:
        with open(state_path) as fh:
            raw = json.load(fh)
        if isinstance(raw, dict) and "format" not in raw:
            hist = raw.pop("commit_seconds", None)
            entry = {"counters": {k: int(v) for k, v in raw.items()}}
            if hist is not None:
                entry["commit_seconds"] = hist
            raw = {"format": FORMAT, "jobs": {job: entry} if job else {}}
        if _valid(raw):
            return dict(raw)
        log.warning("metrics state %s is not of this release's shape: starting afresh", state_path)
    except (OSError, ValueError, TypeError, AttributeError):
        pass
    return {"format": FORMAT, "jobs": {}}


def _valid(state: Any) -> bool:
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        return False
    jobs = state.get("jobs")
    if not isinstance(jobs, dict):
        return False
    for entry in jobs.values():
        if not isinstance(entry, dict) or not isinstance(entry.get("counters", {}), dict):
            return False
        hist = entry.get("commit_seconds", {"buckets": []})
        if not isinstance(hist, dict) or not isinstance(hist.get("buckets"), list):
            return False
    return True


def apply(
    state: dict[str, Any],
    job: str,
    counters: Mapping[str, int],
    seconds: float | None = None,
    committed_at: float | None = None,
) -> dict[str, Any]:
    """Add ``counters``, one latency observation and the time of a commit to ``job``'s
    entry of ``state`` (in place; returned)."""
    entry = state.setdefault("jobs", {}).setdefault(job, {})
    totals = entry.setdefault("counters", {})
    for key, value in counters.items():
        totals[key] = int(totals.get(key, 0)) + value
    if seconds is not None:
        hist = entry.setdefault("commit_seconds", _empty_histogram())
        if len(hist["buckets"]) != len(BUCKETS):  # bounds of another release: start over
            hist.update(_empty_histogram())
        for i, bound in enumerate(BUCKETS):
            if seconds <= bound:
                hist["buckets"][i] += 1  # cumulative, as Prometheus' `le` buckets are
        hist["sum"] += seconds
        hist["count"] += 1
    if committed_at is not None:
        entry["last_commit"] = max(float(entry.get("last_commit", 0.0)), committed_at)
    return state


def _replace(path: str, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), prefix=".txsink-")
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def update(
    store: Store,
    job: str,
    counters: Mapping[str, int],
    seconds: float | None = None,
    committed_at: float | None = None,
    render: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Add to ``job``'s totals in ``store`` under its lock, then, still under it, hand the
    new state to ``render`` (the textfile writer: a render after the lock could replace
    a newer file with an older one). Returns the new state."""
    if not store.textfile:
        os.makedirs(os.path.dirname(store.state), mode=0o700, exist_ok=True)
    with open(store.lock, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        state = apply(load(store.state, job), job, counters, seconds, committed_at)
        _replace(store.state, json.dumps(state))
        if render is not None:
            render(state)
    return state
