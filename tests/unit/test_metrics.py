"""Writer metrics (txsink.metrics): totals persisted per host add up across processes
without losing an increment, prometheus_client renders them (textfile and scrape
endpoint, both parsed back with its parser), and metrics never fail a commit."""

from __future__ import annotations

import json
import logging
import multiprocessing
import socket
import tempfile
import urllib.request
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from txsink import metrics
from txsink.config import WriterConfig
from txsink.metrics import export
from txsink.protocol.codec import JobMeta

BASE = {"url": "http://h:8123", "table": "db.t", "keeper": "k:2181", "job": "j1"}


def config(**options: Any) -> WriterConfig:
    return WriterConfig.from_options({**BASE, **{k: str(v) for k, v in options.items()}})


def commit(rows: int = 7, seconds: float = 0.03, action: str = "committed") -> Any:
    return SimpleNamespace(action=action, xid="b1", rows=rows, partitions=1, seconds=seconds)


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of an exposition text: (name, sorted labels) -> value."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(text: str, name: str, job: str = "j1", **labels: str) -> float:
    return samples(text)[(name, tuple(sorted({"job": job, **labels}.items())))]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        return str(resp.read().decode())


@pytest.fixture
def port_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The temp directory a port-only store lives under, per test."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def test_counters_latency_and_last_commit_add_up_across_updates(tmp_path: Path) -> None:
    prom = tmp_path / "txsink.prom"
    cfg = config(metrics_textfile=prom)
    metrics.record_commit(cfg, commit(seconds=0.03))
    metrics.record_commit(cfg, commit(seconds=3.0))
    metrics.record_commit(cfg, commit(action="skipped", rows=0, seconds=0.002))
    metrics.count(cfg, recoveries=1)
    text = prom.read_text()
    assert value(text, "txsink_batches_committed_total") == 2
    assert value(text, "txsink_batches_skipped_total") == 1
    assert value(text, "txsink_rows_committed_total") == 14
    assert value(text, "txsink_recoveries_total") == 1
    assert value(text, "txsink_commit_seconds_count") == 3
    assert value(text, "txsink_last_commit_timestamp_seconds") > 0
    names = {f.name for f in text_string_to_metric_families(text)}
    assert {f"txsink_{name}" for name in metrics.COUNTERS} <= names
    assert {"txsink_commit_seconds", "txsink_last_commit_timestamp_seconds"} <= names


def test_histogram_buckets_are_cumulative_with_inclusive_upper_bounds(tmp_path: Path) -> None:
    prom = tmp_path / "txsink.prom"
    observed = [0.005, 0.01, 0.02, 0.3, 7.0, 20.0]
    for seconds in observed:
        metrics.record_commit(config(metrics_textfile=prom), commit(seconds=seconds))
    text = prom.read_text()
    want = {
        "0.01": 2, "0.025": 3, "0.05": 3, "0.1": 3, "0.25": 3, "0.5": 4, "1.0": 4,
        "2.5": 4, "5.0": 4, "10.0": 5, "+Inf": 6,
    }  # fmt: skip
    got = {le: value(text, "txsink_commit_seconds_bucket", le=le) for le in want}
    assert got == want
    assert value(text, "txsink_commit_seconds_count") == 6
    assert value(text, "txsink_commit_seconds_sum") == pytest.approx(sum(observed))


def _hammer(cfg: WriterConfig, n: int) -> None:
    for i in range(n):
        metrics.record_commit(cfg, commit(rows=3, seconds=0.001 * (i % 20)))
        metrics.count(cfg, dedup_skips=1)


def test_concurrent_processes_on_one_textfile_lose_no_increment(tmp_path: Path) -> None:
    prom = tmp_path / "txsink.prom"
    cfg = config(metrics_textfile=prom)
    procs, per = 4, 40
    ctx = multiprocessing.get_context("fork")
    workers = [ctx.Process(target=_hammer, args=(cfg, per)) for _ in range(procs)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
    assert [w.exitcode for w in workers] == [0] * procs
    text = prom.read_text()
    assert value(text, "txsink_batches_committed_total") == procs * per
    assert value(text, "txsink_rows_committed_total") == 3 * procs * per
    assert value(text, "txsink_dedup_skips_total") == procs * per
    assert value(text, "txsink_commit_seconds_count") == procs * per
    assert value(text, "txsink_commit_seconds_bucket", le="0.01") == procs * 11 * per // 20
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "txsink.prom", "txsink.prom.lock", "txsink.prom.state.json"
    ]  # fmt: skip


def test_jobs_sharing_a_textfile_keep_their_own_series(tmp_path: Path) -> None:
    prom = tmp_path / "txsink.prom"
    metrics.record_commit(config(metrics_textfile=prom, job="a"), commit(rows=5))
    metrics.record_commit(config(metrics_textfile=prom, job="b"), commit(rows=9))
    text = prom.read_text()
    assert value(text, "txsink_rows_committed_total", job="a") == 5
    assert value(text, "txsink_rows_committed_total", job="b") == 9


def test_a_state_file_of_the_first_release_carries_on(tmp_path: Path) -> None:
    prom = tmp_path / "txsink.prom"
    old = {"batches_committed": 4, "rows_committed": 40, "commit_seconds": {
        "buckets": [0, 0, 1, 4, 4, 4, 4, 4, 4, 4], "sum": 0.2, "count": 4}}  # fmt: skip
    (tmp_path / "txsink.prom.state.json").write_text(json.dumps(old))
    metrics.record_commit(config(metrics_textfile=prom), commit(rows=10))
    text = prom.read_text()
    assert value(text, "txsink_batches_committed_total") == 5
    assert value(text, "txsink_rows_committed_total") == 50
    assert value(text, "txsink_commit_seconds_count") == 5


@pytest.mark.parametrize("junk", ["{not json", "[1, 2]", '{"format": 1, "jobs": [3]}'])
def test_a_damaged_state_file_starts_afresh_and_never_fails_the_commit(
    tmp_path: Path, junk: str
) -> None:
    prom = tmp_path / "txsink.prom"
    (tmp_path / "txsink.prom.state.json").write_text(junk)
    metrics.record_commit(config(metrics_textfile=prom), commit(rows=2))
    assert value(prom.read_text(), "txsink_rows_committed_total") == 2


def test_no_metrics_configured_writes_nothing(tmp_path: Path, port_dir: Path) -> None:
    metrics.count(config(), recoveries=1)
    metrics.serve(config())
    assert list(tmp_path.iterdir()) == []


def test_an_unwritable_textfile_is_logged_not_raised(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    metrics.count(config(metrics_textfile=tmp_path / "missing-dir" / "txsink.prom"), recoveries=1)
    assert "not written" in caplog.text


def test_the_endpoint_serves_what_every_process_on_the_host_committed(port_dir: Path) -> None:
    """The endpoint reads the persisted totals at each scrape: commits of another process
    (a Python worker Spark started later) show on it; a second serve() keeps it."""
    port = free_port()
    cfg = config(metrics_port=port)
    metrics.serve(cfg)
    metrics.serve(cfg)  # this process already serves the port: nothing happens
    metrics.record_commit(cfg, commit(rows=11))
    ctx = multiprocessing.get_context("fork")
    other = ctx.Process(target=_hammer, args=(cfg, 5))
    other.start()
    other.join(60)
    text = scrape(port)
    assert value(text, "txsink_rows_committed_total") == 11 + 3 * 5
    assert value(text, "txsink_batches_committed_total") == 6
    state = metrics.store_of(cfg)
    assert state is not None and Path(state.state).parent.parent == port_dir
    assert not any(p.suffix == ".prom" for p in Path(state.state).parent.iterdir())


def test_a_port_held_by_another_program_is_one_warning_and_retried_later(
    port_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    now = [0.0]
    with socket.socket() as squatter:
        squatter.bind(("0.0.0.0", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        cfg = config(metrics_port=port)
        store = metrics.store_of(cfg)
        assert store is not None
        with caplog.at_level(logging.INFO, logger="txsink.metrics"):
            for _ in range(3):
                export.serve(port, store, "j1", clock=lambda: now[0])
                metrics.record_commit(cfg, commit())
    warnings = [r for r in caplog.records if "not served by this process" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
    now[0] = export.RETRY_BIND_S + 1  # the other program is gone: a later commit binds
    export.serve(port, store, "j1", clock=lambda: now[0])
    assert value(scrape(port), "txsink_batches_committed_total") == 3


def _serve_until(cfg: WriterConfig, ready: Any, done: Any) -> None:
    metrics.serve(cfg)
    ready.set()
    done.wait(60)


def test_a_port_held_by_an_earlier_txsink_worker_of_the_same_state_is_no_warning(
    port_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Spark replaced the Python worker while the old one still holds the port: the new
    one says so at info, and its commits show on the old one's endpoint."""
    port = free_port()
    cfg = config(metrics_port=port)
    ctx = multiprocessing.get_context("fork")
    ready, done = ctx.Event(), ctx.Event()
    old = ctx.Process(target=_serve_until, args=(cfg, ready, done))
    old.start()
    try:
        assert ready.wait(30)
        with caplog.at_level(logging.INFO, logger="txsink.metrics"):
            metrics.serve(cfg)
            metrics.record_commit(cfg, commit(rows=4))
        text = scrape(port)
    finally:
        done.set()
        old.join(30)
    assert "served by txsink process" in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert value(text, "txsink_rows_committed_total") == 4
    info = samples(text)
    assert any(name == "txsink_metrics_endpoint_info" and ("pid", str(old.pid)) in labels
               for name, labels in info)  # fmt: skip


def test_a_writer_without_metrics_never_imports_prometheus_client() -> None:
    """Every commit calls the hooks; a Python worker pays for prometheus_client (about
    50 ms) only when a writer asks for metrics."""
    import subprocess
    import sys

    code = (
        "import sys; from types import SimpleNamespace as N; import txsink.committer; "
        "from txsink import metrics; from txsink.config import WriterConfig; "
        f"cfg = WriterConfig.from_options({BASE!r}); metrics.serve(cfg); "
        "metrics.count(cfg, recoveries=1); metrics.record_commit(cfg, N(action='committed', "
        "xid='b1', rows=1, partitions=1, seconds=0.1)); "
        "assert 'prometheus_client' not in sys.modules, 'imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_a_takeover_counts_the_batches_and_rows_its_recovery_rolled_forward(
    tmp_path: Path,
) -> None:
    """A driver killed after PREPARE: the next run's recovery publishes the batch, and
    the metrics count it as rolled forward with its rows (the replay is then skipped)."""
    from txsink.committer import rolled_forward_at_takeover
    from txsink.ports.registry_memory import MemoryRegistry
    from txsink.ports.warehouse_memory import MemoryWarehouse
    from txsink.protocol.ids import staging_name
    from txsink.protocol.states import StagedPart
    from txsink.transactor import Transactor

    class Crash(Exception):
        pass

    def crash(point: str) -> None:
        if point == "driver.after_prepare":
            raise Crash(point)

    registry, wh = MemoryRegistry(), MemoryWarehouse()
    first = Transactor(registry, wh, "j1", fault=crash)
    epoch = first.begin("run-1")
    staging = staging_name("j1", "b3", "00000001", 0, 0, 1).table
    wh.stage(staging, {"202401": [1, 2, 3], "202402": [4]})
    parts = [StagedPart(staging, "202401", 3), StagedPart(staging, "202402", 1)]
    with pytest.raises(Crash):
        first.commit_batch(epoch, "b3", 3, "db.t", parts)
    again = Transactor(registry, wh, "j1")
    _, report = again.take_run("run-2", JobMeta())
    assert report is not None
    handle = SimpleNamespace(
        transactor=again, registry=registry, config=config(metrics_textfile=tmp_path / "m.prom")
    )
    counted = rolled_forward_at_takeover(handle, report)  # type: ignore[arg-type]
    assert counted == {"batches_rolled_forward": 1, "rows_committed": 4}
    handle.config = config()  # no metrics asked for: not even the record reads
    assert rolled_forward_at_takeover(handle, report) == {}  # type: ignore[arg-type]


def test_the_grafana_dashboard_queries_only_series_txsink_exports(tmp_path: Path) -> None:
    import re

    prom = tmp_path / "txsink.prom"
    metrics.record_commit(config(metrics_textfile=prom), commit())
    exported = set()
    for family in text_string_to_metric_families(prom.read_text()):
        exported |= {s.name for s in family.samples}
    dashboard = Path(__file__).parents[2] / "docs" / "grafana" / "txsink-dashboard.json"
    panels = json.loads(dashboard.read_text())["panels"]
    queried = {
        name
        for panel in panels
        for target in panel.get("targets", [])
        for name in re.findall(r"txsink_[a-z_]+", target["expr"])
    }
    assert queried and queried <= exported, queried - exported
    assert {f"txsink_{name}_total" for name in metrics.COUNTERS} - queried == set()
