"""Writer metrics: counters, a commit-latency histogram and the time of the last
commit, as a Prometheus textfile (option ``metrics_textfile``) and a scrape endpoint on
the driver (option ``metrics_port``), both rendered by ``prometheus_client``.

The hooks the writer calls: :func:`count` (driver and executors), :func:`record_commit`
and :func:`serve` (the driver-side commit, :mod:`txsink.committer`). The totals are
persisted per host (:mod:`txsink.metrics.state`: a JSON file under a ``flock``, so
commits in different Python workers add up), and :mod:`txsink.metrics.export` renders
them; it is imported only when a writer asks for metrics. Metrics never fail a commit:
a failure to write them is logged. Exact totals (batches, rows) are the job's ledger
(``txsink status``); these are the operational series (docs/operations.md#metrics).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Mapping
from typing import Any

from txsink.config import WriterConfig
from txsink.metrics.state import BUCKETS, COUNTERS, Store, store_of, update

__all__ = ["BUCKETS", "COUNTERS", "Store", "count", "record_commit", "serve", "store_of"]
log = logging.getLogger(__name__)


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
        render = None
        if store.textfile:
            from txsink.metrics.export import write_textfile

            render = functools.partial(write_textfile, store.textfile)
        update(store, config.job, counters, seconds, committed_at, render)
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


def serve(config: WriterConfig) -> None:
    """Start the scrape endpoint on ``metrics_port``, once per process (the driver-side
    commit calls this before every commit; see :func:`txsink.metrics.export.serve`)."""
    store = store_of(config)
    if config.metrics_port is None or store is None:
        return
    from txsink.metrics.export import serve as start

    start(config.metrics_port, store, config.job)
