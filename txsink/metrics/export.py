"""The writer metrics rendered by ``prometheus_client``: the textfile and the scrape
endpoint, both from the persisted totals of :mod:`txsink.metrics.state`.

:class:`StateCollector` turns a state into metric families (counters per job, the
commit-latency histogram, the last-commit gauge); ``write_to_textfile`` writes them as
the textfile, and the endpoint's registry reads the state file again at every scrape,
so it shows the commits of every process on the host (a Python worker Spark started
later included), not only its own. Nothing here renders exposition text by hand.

The endpoint (:func:`serve`) is started at most once per process and port; a port held
by another program is a warning once, never an error: metrics never fail a commit.
Imported only when a writer asks for metrics (importing ``prometheus_client`` costs a
Python worker about 50 ms).
"""

from __future__ import annotations

import logging
import os
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

from txsink.metrics.state import BUCKETS, COUNTERS, Store, load

log = logging.getLogger(__name__)
COMMIT_SECONDS_HELP = "prepare + publish + record time of one batch"
LAST_COMMIT_HELP = "Unix time of the last batch committed or rolled forward"
RETRY_BIND_S = 30.0  # a port held by another program is tried again at most this often


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


def write_textfile(path: str, state: Mapping[str, Any]) -> None:
    """``state`` as a Prometheus textfile at ``path`` (replaced by a rename)."""
    registry = CollectorRegistry()
    registry.register(StateCollector(lambda: state))
    write_to_textfile(path, registry)


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


def serve(port: int, store: Store, job: str, clock: Callable[[], float] = time.monotonic) -> None:
    """Start the scrape endpoint on ``port`` in this process, once, serving ``store``.
    A port this process already serves is kept; a port another process holds is tried
    again at most every :data:`RETRY_BIND_S` seconds, and said once: at info when the
    holder is a txsink endpoint of the same state file (an earlier Python worker: it
    shows this process's commits too), else as a warning. Never raises."""
    with _endpoints_lock:
        ep = _endpoints.setdefault(port, _Endpoint(store.state))
        if ep.serving or clock() < ep.retry_at:
            if ep.state != store.state and not ep.said:
                ep.said = True
                log.warning(
                    "metrics port %d serves %s in this process; job %s writes %s, which it "
                    "does not show (writers sharing a port must share metrics_textfile)",
                    port, ep.state, job, store.state,
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
        log.info("job %s: metrics endpoint on port %d (state %s)", job, port, store.state)


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
