"""The metrics textfile adds up across updates, renders every series, and never fails a
commit (txsink.metrics)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

from txsink import metrics


def config(path: Path | str) -> Any:
    return SimpleNamespace(metrics_textfile=str(path), job="j1")


def test_counters_and_latency_add_up_across_updates(tmp_path: Path) -> None:
    prom = tmp_path / "txsink.prom"
    result = SimpleNamespace(action="committed", xid="b1", rows=7, partitions=1, seconds=0.03)
    metrics.record_commit(config(prom), result)
    metrics.record_commit(config(prom), SimpleNamespace(**{**result.__dict__, "seconds": 3.0}))
    metrics.count(config(prom), recoveries=1)
    text = prom.read_text()
    assert 'txsink_batches_committed_total{job="j1"} 2' in text
    assert 'txsink_rows_committed_total{job="j1"} 14' in text
    assert 'txsink_recoveries_total{job="j1"} 1' in text
    assert 'txsink_commit_seconds_bucket{job="j1",le="0.05"} 1' in text
    assert 'txsink_commit_seconds_bucket{job="j1",le="+Inf"} 2' in text
    assert all(f"txsink_{name}_total" in text for name in metrics.COUNTERS)


def test_no_textfile_configured_writes_nothing(tmp_path: Path) -> None:
    metrics.count(config(""), recoveries=1)
    assert list(tmp_path.iterdir()) == []


def test_an_unwritable_textfile_is_logged_not_raised(tmp_path: Path) -> None:
    metrics.count(config(tmp_path / "missing-dir" / "txsink.prom"), recoveries=1)
