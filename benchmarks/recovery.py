"""Recovery time after a crash: restart to first commit, with Spark's own start-up left out.

1. Library level, repeated: a writer crashes right after PREPARE (the fault point
   ``driver.after_prepare``, raised as an exception here), a new writer takes over
   (``Transactor.begin``: new epoch + recovery rolls the PREPARED xid forward) and commits
   its next batch. Timed from the takeover to that commit done, against the same with a
   clean predecessor (nothing to roll forward).
2. End to end, once each: the demo streaming job (``python -m txsink.demo job``) crashed
   by ``TXSINK_FAULT=driver.after_prepare`` in its second batch, then restarted; and a
   clean restart of a finished job with new files. From the Keeper records: the new run's
   epoch (taken by its first commit, i.e. after Spark started and the first tasks wrote)
   to the first COMMITTED record written under that epoch.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from pathlib import Path
from typing import Any

from benchmarks.commit_overhead import commit_target, config_for, stage
from benchmarks.common import Bench, latency_summary, timed
from txsink.config import WriterConfig
from txsink.driver import open_job, open_registry
from txsink.protocol.ids import batch_xid

PARTITIONS = 4


class Crash(Exception):
    """Stands in for the process dying at a fault point."""


def crash_at(point: str) -> Any:
    def fault(name: str) -> None:
        if name == point:
            raise Crash(name)

    return fault


def one_restart(bench: Bench, crashed: bool, **options: str) -> float:
    """Takeover (+ roll forward when ``crashed``) + the next batch's commit, seconds
    (``options``: more sink options, e.g. ``state="clickhouse"``)."""
    cfg = config_for(bench, commit_target(bench), **options)
    first, second = open_job(cfg), open_job(cfg)
    try:
        first.warehouse.ensure_staging_db()
        run1, run2 = "run-a", "run-b"
        epoch = first.transactor.begin(run1)
        parts = stage(first, run1, batch_xid(0), 0, PARTITIONS)
        if crashed:
            first.transactor.fault = crash_at("driver.after_prepare")
        with contextlib.suppress(Crash):
            first.transactor.commit_batch(epoch, batch_xid(0), 0, cfg.table, parts)
        next_parts = stage(second, run2, batch_xid(1), 1, PARTITIONS)

        def restart() -> None:
            new_epoch = second.transactor.begin(run2, keep={next_parts[0].table})
            second.transactor.commit_batch(new_epoch, batch_xid(1), 1, cfg.table, next_parts)

        seconds, _ = timed(restart)
        expected = 2 * PARTITIONS * 1000
        landed = second.warehouse.partition_rows(cfg.table)
        if sum(landed.values()) != expected:
            raise RuntimeError(f"recovery bench: {landed} in {cfg.table}, expected {expected} rows")
        return seconds
    finally:
        first.close()
        second.close()


def library_level(bench: Bench, trials: int) -> dict[str, Any]:
    return {
        kind: latency_summary([one_restart(bench, kind == "crashed") for _ in range(trials)])
        for kind in ("clean", "crashed")
    }


# ------------------------------------------------------------------ end to end (demo job)


def demo_job(bench: Bench, src: Path, ckpt: Path, table: str, job: str, **crash: Any) -> int:
    from txsink.demo import run_job_once

    args = [
        "--src",
        str(src),
        "--checkpoint",
        str(ckpt),
        "--table",
        table,
        "--job",
        job,
        "--url",
        bench.url,
        "--keeper",
        bench.keeper,
        "--mode",
        "attach",
        "--files-per-trigger",
        "1",
    ]
    return run_job_once(args, timeout=600, log_path=str(bench.work / "recovery-job.log"), **crash)


def epoch_since(bench: Bench, job: str) -> float:
    from kazoo.client import KazooClient

    zk = KazooClient(hosts=bench.keeper)
    zk.start(timeout=15)
    try:
        data, _ = zk.get(f"/txsink/jobs/{job}/epoch")
    finally:
        zk.stop()
        zk.close()
    return float(json.loads(data)["since"])


def first_commit_after_takeover(bench: Bench, job: str) -> dict[str, Any]:
    since = epoch_since(bench, job)
    registry = open_registry(WriterConfig.from_options(bench.sink_options("x.y", job)))
    try:
        current = registry.current_epoch(job)
        records = registry.list(job)
    finally:
        registry.close()
    assert current is not None
    mine = sorted(
        (r.committed_at, r.xid)
        for r in records
        if r.committed_at and r.committed_epoch == current.number
    )
    if not mine:
        raise RuntimeError(f"job {job}: no commit by epoch {current.number}")
    return {"seconds": mine[0][0] - since, "xid": mine[0][1], "epoch": current.number}


def end_to_end(bench: Bench) -> dict[str, Any]:
    from txsink.demo import make_source, target_ddl

    out: dict[str, Any] = {}
    client = bench.client()
    for kind in ("clean", "crashed"):
        table = f"bench.recovery_{kind}_{uuid.uuid4().hex[:6]}"
        client.command(target_ddl(table))
        job = f"rec-{kind}-{uuid.uuid4().hex[:6]}"
        src, ckpt = bench.work / f"rec-{job}", bench.work / f"rec-ckpt-{job}"
        make_source(src, 3, 5_000)
        if kind == "clean":
            first = demo_job(bench, src, ckpt, table, job)
            extra = bench.work / f"rec-extra-{job}"
            make_source(extra, 6, 5_000)  # files 3..5 hold new ids for the restarted run
            for f in range(3, 6):
                (extra / f"part-{f:05d}.parquet").rename(src / f"part-{f:05d}.parquet")
        else:
            first = demo_job(
                bench, src, ckpt, table, job, fault="driver.after_prepare", fault_after=1
            )
        second = demo_job(bench, src, ckpt, table, job)
        rows = int(client.command(f"SELECT count() FROM {table}"))
        out[kind] = {
            **first_commit_after_takeover(bench, job),
            "exit_codes": [first, second],
            "rows": rows,
        }
    client.close()
    return out


def run(bench: Bench, progress: Any) -> dict[str, Any]:
    trials = max(5, bench.sizes.reps * 5)
    out = {"library": library_level(bench, trials), "partitions": PARTITIONS}
    lib = out["library"]
    progress(
        f"  library: clean p50 {lib['clean']['p50_ms']:.0f} ms, after crash p50 "
        f"{lib['crashed']['p50_ms']:.0f} ms"
    )
    out["end_to_end"] = end_to_end(bench)
    e2e = out["end_to_end"]
    progress(
        f"  end to end: clean {e2e['clean']['seconds'] * 1000:.0f} ms, crashed "
        f"{e2e['crashed']['seconds'] * 1000:.0f} ms"
    )
    return out
