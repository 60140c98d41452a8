"""Where a ``state=clickhouse`` driver commit spends its time: every SQL statement the
KeeperMap store sends during ``committer.commit_batch`` of an attach batch, counted and
timed per registry call (issue 29).

    flock /tmp/txsink-heavy.lock .venv/bin/python -m benchmarks.state_trace [--batches N]

Starts a private embedded stack (no Spark), commits ``N`` batches of 4 partitions (the
first one takes the epoch and is not counted), and prints per batch: statements by
registry call and kind, with their mean latency, and the statements of the warehouse
(MOVE, staging views) beside them.
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

REGISTRY_FILES = ("kazoo_registry.py", "kazoo_xids.py", "kazoo_base.py")
WRAPPERS = {"run", "attempt", "ops", "guarded", "wrapped_f", "__call__", "<lambda>"}


def registry_call() -> str:
    """The outermost registry method on the stack (``prepare``, ``heartbeat``...) and,
    after a slash, the innermost one when it differs (``commit/_fence_now``)."""
    frame = sys._getframe(2)
    names: list[str] = []
    while frame is not None:
        name = frame.f_code.co_name
        if frame.f_code.co_filename.endswith(REGISTRY_FILES) and name not in WRAPPERS:
            names.append(name)
        frame = frame.f_back  # type: ignore[assignment]
    if not names:
        return "(outside the registry)"
    return names[-1] if names[0] == names[-1] else f"{names[-1]}/{names[0]}"


def kind_of(sql: str) -> str:
    head = sql.lstrip().split(None, 1)[0].upper()
    if head == "SELECT":
        return "list" if "startsWith" in sql else "read"
    if head == "ALTER":
        return "update"
    return head.lower()


class Tracing:
    """A client that records (registry call, kind, seconds) of every statement."""

    def __init__(self, real: Any, log: list[tuple[str, str, float]]) -> None:
        self.real = real
        self.url = real.url
        self.log = log

    def _timed(self, fn: Any, sql: str, *args: Any, **kwargs: Any) -> Any:
        call = registry_call()
        started = time.perf_counter()
        try:
            return fn(sql, *args, **kwargs)
        finally:
            self.log.append((call, kind_of(sql), time.perf_counter() - started))

    def command(self, sql: str, **kwargs: Any) -> Any:
        return self._timed(self.real.command, sql, **kwargs)

    def query_rows(self, sql: str, **kwargs: Any) -> Any:
        return self._timed(self.real.query_rows, sql, **kwargs)

    def close(self) -> None:
        self.real.close()


def trace(url: str, keeper: str, batches: int) -> dict[str, Any]:
    from benchmarks.commit_overhead import commit_target, config_for, stage
    from benchmarks.common import Bench, Sizes
    from txsink import committer, driver
    from txsink.keeper import keepermap
    from txsink.protocol.ids import batch_xid
    from txsink.spark import writer

    log: list[tuple[str, str, float]] = []
    real_init = keepermap.KeeperMapNodes.__init__

    def traced_init(self: Any, client: Any, *args: Any, **kwargs: Any) -> None:
        real_init(self, Tracing(client, log), *args, **kwargs)

    keepermap.KeeperMapNodes.__init__ = traced_init  # type: ignore[method-assign]
    bench = Bench(url, keeper, None, Sizes("trace", 0, 0, 0, 1, 0, 0, (), 0, 0, 0), Path("."))
    cfg = config_for(bench, commit_target(bench), state="clickhouse")
    plan = writer.WritePlan(cfg, "attach", run_id="")
    run_id = f"trace-{uuid.uuid4().hex[:8]}"
    handle = driver.open_job(cfg)
    walls: list[float] = []
    per_batch: list[list[tuple[str, str, float]]] = []
    try:
        handle.warehouse.ensure_staging_db()
        for b in range(batches + 1):
            xid = batch_xid(b)
            parts = stage(handle, run_id, xid, b, 4)
            msg = writer.TxCommitMessage(
                run_id, xid, b, tuple(parts), (parts[0].table,), rows=sum(p.rows for p in parts)
            )
            del log[:]
            started = time.perf_counter()
            committer.commit_batch(plan, [msg], b)
            if b:
                walls.append(time.perf_counter() - started)
                per_batch.append(list(log))
    finally:
        handle.close()
        keepermap.KeeperMapNodes.__init__ = real_init  # type: ignore[method-assign]
    return summarise(walls, per_batch)


def summarise(walls: list[float], per_batch: list[list[tuple[str, str, float]]]) -> dict[str, Any]:
    n = len(per_batch)
    counts: dict[tuple[str, str], int] = collections.Counter()
    seconds: dict[tuple[str, str], float] = collections.defaultdict(float)
    for batch in per_batch:
        for call, kind, s in batch:
            counts[(call, kind)] += 1
            seconds[(call, kind)] += s
    rows = [
        {
            "call": call,
            "kind": kind,
            "per_batch": round(counts[(call, kind)] / n, 2),
            "ms_per_batch": round(seconds[(call, kind)] / n * 1000, 2),
            "mean_ms": round(seconds[(call, kind)] / counts[(call, kind)] * 1000, 2),
        }
        for call, kind in sorted(counts, key=lambda k: -seconds[k])
    ]
    walls_sorted = sorted(walls)
    return {
        "batches": n,
        "statements_per_batch": round(sum(counts.values()) / n, 2),
        "state_ms_per_batch": round(sum(seconds.values()) / n * 1000, 1),
        "commit_p50_ms": round(walls_sorted[len(walls_sorted) // 2] * 1000, 1),
        "by_call": rows,
    }


def render(out: dict[str, Any]) -> str:
    lines = [
        f"{out['batches']} batches; state statements per batch: {out['statements_per_batch']} "
        f"({out['state_ms_per_batch']} ms of a commit p50 of {out['commit_p50_ms']} ms)",
        f"{'registry call':<36}{'kind':<8}{'per batch':>10}{'ms/batch':>10}{'mean ms':>9}",
    ]
    for row in out["by_call"]:
        lines.append(
            f"{row['call']:<36}{row['kind']:<8}{row['per_batch']:>10}"
            f"{row['ms_per_batch']:>10}{row['mean_ms']:>9}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks.state_trace", description=__doc__)
    parser.add_argument("--batches", type=int, default=30)
    args = parser.parse_args(argv)
    from benchmarks.common import private_stack

    with (
        tempfile.TemporaryDirectory(prefix="txsink-trace-") as tmp,
        private_stack(Path(tmp) / "stack") as info,
    ):
        print(render(trace(info.url, info.keeper, args.batches)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
