"""Writer metrics on ``prometheus_client``: counters, a commit-latency histogram and the
time of the last commit, as a Prometheus textfile and, on the driver, a scrape endpoint.

Spark may reuse or replace the Python worker that runs a driver-side commit at any
batch, and executors run in other processes (and hosts), so the series cannot live in
one process's ``prometheus_client`` registry: a new worker would start from zero and a
dead one would take its increments with it. The running totals are persisted instead,
per host, in a small JSON *state file*, and ``prometheus_client`` renders them:
:class:`StateCollector` turns the persisted totals into metric families, which
``write_to_textfile`` writes as the textfile (option ``metrics_textfile``) and the
endpoint's registry (option ``metrics_port``, :func:`serve`) reads at every scrape.
Nothing here renders exposition text by hand.

Where the state lives: ``<metrics_textfile>.state.json`` (lock ``<metrics_textfile>.lock``)
when the option names a textfile, else ``<tmp>/txsink-metrics-<uid>/port-<metrics_port>
.state.json``. The series (:data:`COUNTERS`, :data:`BUCKETS`) carry a ``job`` label; one
state file may hold several jobs.

Invariants:

- no increment is lost between processes on one host: every update is a
  read-modify-write of the state under an exclusive ``flock`` of the lock file;
- a reader never sees half a file: the state and the textfile are replaced by renames;
- metrics never fail a commit: an ``OSError`` is logged, never raised; the endpoint is
  started at most once per process and port, and a port held by another program is a
  warning (once), not an error.

Exact totals (batches, rows) are the job's ledger (``txsink status``); these are the
operational series (docs/operations.md#metrics).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server, write_to_textfile
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

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
COMMIT_SECONDS_HELP = "prepare + publish + record time of one batch"
LAST_COMMIT_HELP = "Unix time of the last batch committed or rolled forward"
FORMAT = 1
RETRY_BIND_S = 30.0  # a port held by another program is tried again at most this often


# ------------------------------------------------------------------------- state


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


def families(state: Mapping[str, Any]) -> Iterator[Metric]:
    """The metric families of ``state``: every counter of every job (zeros included),
    the commit-latency histogram and the last-commit gauge of jobs that have them."""
    jobs = dict(sorted(state.get("jobs", {}).items()))
    for name, help_text in COUNTERS.items():
        counter = CounterMetricFamily(f"txsink_{name}", help_text, labels=["job"])
        for job, entry in jobs.items():
            counter.add_metric([job], int(entry.get("counters", {}).get(name, 0)))
        yield counter
    hist = HistogramMetricFamily("txsink_commit_seconds", COMMIT_SECONDS_HELP, labels=["job"])
    for job, entry in jobs.items():
        h = entry.get("commit_seconds")
        if h is None or len(h["buckets"]) != len(BUCKETS):
            continue
        buckets = [(repr(b), n) for b, n in zip(BUCKETS, h["buckets"], strict=True)]
        hist.add_metric([job], [*buckets, ("+Inf", h["count"])], h["sum"])
    yield hist
    gauge = GaugeMetricFamily(
        "txsink_last_commit_timestamp_seconds", LAST_COMMIT_HELP, labels=["job"]
    )
    for job, entry in jobs.items():
        if "last_commit" in entry:
            gauge.add_metric([job], float(entry["last_commit"]))
    yield gauge


class StateCollector(Collector):
    """A ``prometheus_client`` collector of the totals ``read()`` returns (the state
    just written, or the state file read again at every scrape)."""

    def __init__(self, read: Callable[[], Mapping[str, Any]]) -> None:
        self.read = read

    def collect(self) -> Iterator[Metric]:
        return families(self.read())


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
) -> dict[str, Any]:
    """Add to ``job``'s totals in ``store`` under its lock; rewrite the textfile, if any,
    with ``prometheus_client.write_to_textfile``. Returns the new state."""
    if not store.textfile:
        os.makedirs(os.path.dirname(store.state), mode=0o700, exist_ok=True)
    with open(store.lock, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        state = apply(load(store.state, job), job, counters, seconds, committed_at)
        _replace(store.state, json.dumps(state))
        if store.textfile:
            registry = CollectorRegistry()
            registry.register(StateCollector(lambda: state))
            write_to_textfile(store.textfile, registry)
    return state


# ------------------------------------------------------------------------- writer hooks


def count(config: WriterConfig, **counters: int) -> None:
    """Add to counters, if metrics are configured (executors and the driver)."""
    _try_update(config, counters)


def _try_update(
    config: WriterConfig,
    counters: Mapping[str, int],
    seconds: float | None = None,
    committed_at: float | None = None,
) -> None:
    store = store_of(config)
    if store is None:
        return
    try:
        update(store, config.job, counters, seconds, committed_at)
    except (OSError, ValueError, TypeError, KeyError) as exc:  # metrics never fail a commit
        log.warning("metrics state %s not written: %s", store.state, exc)


def record_commit(config: WriterConfig, result: Any) -> None:
    """Log one commit and, when metrics are configured, add it to them."""
    log.info(
        "job %s: %s %s (%d rows, %d partitions) in %.3fs",
        config.job,
        result.action,
        result.xid,
        result.rows,
        result.partitions,
        result.seconds,
    )
    counters = {
        "committed": {"batches_committed": 1, "rows_committed": result.rows},
        "skipped": {"batches_skipped": 1},
        "rolled_forward": {"batches_rolled_forward": 1, "rows_committed": result.rows},
    }.get(result.action, {})
    published = result.action in ("committed", "rolled_forward")
    _try_update(config, counters, result.seconds, time.time() if published else None)


# ------------------------------------------------------------------------- endpoint


@dataclass
class _Endpoint:
    state: str
    serving: bool = False
    said: bool = False  # the one log line about a port we could not take was written
    retry_at: float = 0.0


_endpoints: dict[int, _Endpoint] = {}
_endpoints_lock = threading.Lock()
# A forked child has no server thread (only, perhaps, the listening socket).
os.register_at_fork(after_in_child=_endpoints.clear)


def endpoint_registry(state_path: str) -> CollectorRegistry:
    """What the endpoint serves: the totals in ``state_path``, read at every scrape, and
    ``txsink_metrics_endpoint_info`` naming this process and the state file."""
    registry = CollectorRegistry()
    registry.register(StateCollector(lambda: load(state_path)))
    registry.register(_InfoCollector(state_path))
    return registry


class _InfoCollector(Collector):
    def __init__(self, state_path: str) -> None:
        self.labels = {"pid": str(os.getpid()), "state_file": state_path}

    def collect(self) -> Iterator[Metric]:
        yield InfoMetricFamily(
            "txsink_metrics_endpoint", "the process serving this endpoint", value=self.labels
        )


def serve(config: WriterConfig, clock: Callable[[], float] = time.monotonic) -> None:
    """Start the scrape endpoint on ``metrics_port`` in this process, once (driver: the
    committer calls this before every commit). A port this process already serves is
    kept; a port another process holds is tried again at most every RETRY_BIND_S seconds,
    logged once: as info when that process is a txsink endpoint of the same state file
    (an earlier Python worker: its endpoint shows this process's commits too), else as a
    warning. Never raises."""
    port = config.metrics_port
    store = store_of(config)
    if port is None or store is None:
        return
    with _endpoints_lock:
        ep = _endpoints.setdefault(port, _Endpoint(store.state))
        if ep.serving or clock() < ep.retry_at:
            if ep.state != store.state and not ep.said:
                ep.said = True
                log.warning(
                    "metrics port %d serves %s in this process; job %s writes %s, which it "
                    "does not show (writers sharing a port must share metrics_textfile)",
                    port, ep.state, config.job, store.state,
                )  # fmt: skip
            return
        try:
            start_http_server(port, registry=endpoint_registry(store.state))
        except (OSError, OverflowError) as exc:
            ep.retry_at = clock() + RETRY_BIND_S
            if not ep.said:
                ep.said = True
                _say_port_taken(port, store.state, exc)
            return
        ep.serving = True
        log.info("job %s: metrics endpoint on port %d (state %s)", config.job, port, store.state)


def _say_port_taken(port: int, state_path: str, exc: BaseException) -> None:
    holder = endpoint_holder(port)
    if holder is not None and holder.get("state_file") == state_path:
        log.info(
            "metrics port %d is served by txsink process %s on this host, from the same "
            "state file %s: commits of this process show there",
            port, holder.get("pid"), state_path,
        )  # fmt: skip
        return
    log.warning(
        "metrics port %d not served by this process (%s; held by %s); the series still go "
        "to %s. Choose another metrics_port, or read the textfile",
        port, exc, f"txsink process {holder.get('pid')}" if holder else "another program",
        state_path,
    )  # fmt: skip


def endpoint_holder(port: int, timeout: float = 0.5) -> dict[str, str] | None:
    """The labels of ``txsink_metrics_endpoint_info`` served on localhost:``port``, or
    None when nothing, or something other than a txsink endpoint, answers there."""
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:  # a fixed http URL
            text = resp.read().decode("utf-8", "replace")
        for family in text_string_to_metric_families(text):
            if family.name in ("txsink_metrics_endpoint", "txsink_metrics_endpoint_info"):
                return dict(family.samples[0].labels)
    except (OSError, ValueError, IndexError):
        return None
    return None
