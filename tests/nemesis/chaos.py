"""The nemesis: a streaming job into ClickHouse while ClickHouse, ZooKeeper, the network
and the job's own processes fail under it, then an exact count.

One :class:`Arena` is one embedded stack (its services killable), a fault-injecting proxy
in front of ClickHouse and one in front of ZooKeeper (the job talks only to the proxies),
a target (attach mode: a plain MergeTree; dedup mode: a MergeTree feeding a materialized
view) and a Parquet source that grows in rounds. :func:`play` runs the job (a real Spark
driver in its own process, restarted like a supervisor would when it dies) while a
nemesis thread applies faults one after another, then checks
``count() == uniqExact(id) == produced`` (and the view's totals in dedup mode).

- The integration tests (``tests/integration/nemesis/test_stream_faults.py``, in ``make test``)
  play a fixed list of faults and assert that every one of them really happened.
- ``make chaos`` (``python -m tests.nemesis.chaos --minutes 15 --seed S``) draws faults at
  random from :data:`FAULTS` with a seed for as long as asked and prints the verdict table.
  A seed that fails is a regression test: the same seed draws the same faults.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import clickhouse_connect

from tests.nemesis import proxy as fp
from tests.nemesis.services import Services
from txsink.demo import job_args, job_command, make_source, target_ddl
from txsink.embedded import stack as embedded
from txsink.embedded.crash import CRASH_FLAG, CRASH_LOG
from txsink.keeper.kazoo_registry import KazooRegistry

log = logging.getLogger("txsink.nemesis")

ROWS_PER_FILE = 2000
KEEPER_TIMEOUT = 4  # seconds: a black hole a little longer than this expires the session


# ----------------------------------------------------------------------------- the arena


@dataclass
class Arena:
    """Everything one nemesis run needs; see the module docstring."""

    services: Services
    work: Path
    mode: str  # "attach" | "dedup"
    ch_proxy: fp.FaultProxy
    zk_proxy: fp.FaultProxy
    db: str
    job: str
    state: str = "keeper"  # or "clickhouse": the state in KeeperMap, through ch_proxy
    visibility: str = ""  # the job's visibility option ("": its default)
    produced: int = 0
    amount: int = 0
    files: int = 0
    job_pid: int | None = None
    job_log: Path = field(init=False)

    def __post_init__(self) -> None:
        self.job_log = self.work / "job.log"

    @property
    def table(self) -> str:
        return f"{self.db}.orders"

    def client(self) -> Any:
        host, port = self.services.info.url.rsplit("/", 1)[-1].split(":")
        return clickhouse_connect.get_client(host=host, port=int(port))

    def registry(self) -> Any:
        """The state store straight, not through a proxy: the nemesis must see the truth."""
        if self.state == "clickhouse":
            from txsink.clickhouse.client import connect
            from txsink.keeper.keepermap import keepermap_registry

            client = connect(self.services.info.url)
            return keepermap_registry(client, "txsink_state", "/txsink", timeout=10, retry_s=60)
        return KazooRegistry(self.services.info.keeper, timeout=10, retry_s=60)

    def grow(self, files: int, rows_per_file: int = ROWS_PER_FILE) -> None:
        """Add ``files`` Parquet files of new unique ids to the source."""
        tmp = self.work / f"gen-{self.files}"
        made = make_source(tmp, files, rows_per_file, seed=self.files + 1)
        for i, path in enumerate(sorted(tmp.iterdir())):
            n = self.files + i
            ids_from = n * rows_per_file
            # make_source numbers ids from 0: shift by rewriting the file's ids
            _shift_ids(path, ids_from, self.work / "src" / f"part-{n:05d}.parquet")
        self.files += files
        self.produced += made["rows"]
        self.amount += made["amount"]

    def args(self) -> list[str]:
        extra = [
            *("--master", "local[2,4]"),  # a failed task is retried, as on a cluster
            *("--option", f"keeper_timeout={KEEPER_TIMEOUT}"),
            *("--option", "retry_attempts=3"),
        ]
        # several blocks per task: several parts per staged partition (a MOVE can be cut
        # between them: clickhouse-crash-inside-move), several dedup blocks per task
        extra += ["--option", "block_rows=500"]
        if self.state == "clickhouse":
            extra += ["--option", "state=clickhouse"]
        if self.visibility:
            extra += ["--option", f"visibility={self.visibility}"]
        return job_args(
            self.work / "src",
            self.work / "ckpt",
            self.table,
            self.job,
            f"http://{self.ch_proxy.address}",
            self.zk_proxy.address,
            *extra,
            mode=self.mode,
            files_per_trigger=1,
        )

    def close(self) -> None:
        self.ch_proxy.stop()
        self.zk_proxy.stop()


def _shift_ids(src: Path, first: int, dest: Path) -> None:
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    table = pq.read_table(src)
    ids = pc.add(pc.subtract(table["id"], pc.min(table["id"])), pa.scalar(first, pa.int64()))
    dest.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table.set_column(0, "id", ids), dest)
    src.unlink()


def open_arena(
    services: Services, work: Path, mode: str, state: str = "keeper", visibility: str = ""
) -> Arena:
    ch_port = int(services.info.url.rsplit(":", 1)[-1])
    zk_port = int(services.info.keeper.rsplit(":", 1)[-1])
    ch_proxy = fp.FaultProxy(("127.0.0.1", ch_port), name="clickhouse").start()
    zk_proxy = fp.FaultProxy(("127.0.0.1", zk_port), name="zookeeper").start()
    arena = Arena(
        services,
        work,
        mode,
        ch_proxy,
        zk_proxy,
        db=f"nemesis_{uuid.uuid4().hex[:8]}",
        job=f"nemesis-{mode}-{uuid.uuid4().hex[:6]}",
        state=state,
        visibility=visibility,
    )
    client = arena.client()
    try:
        client.command(f"CREATE DATABASE {arena.db}")
        ddl = target_ddl(arena.table)
        if mode == "dedup":
            ddl += " SETTINGS non_replicated_deduplication_window = 1000"
        client.command(ddl)
        if mode == "dedup":
            client.command(
                f"CREATE TABLE {arena.db}.totals (customer String, n UInt64, amount Int64) "
                "ENGINE = SummingMergeTree ORDER BY customer "
                "SETTINGS non_replicated_deduplication_window = 1000"
            )
            client.command(
                f"CREATE MATERIALIZED VIEW {arena.db}.mv TO {arena.db}.totals AS SELECT "
                "toString(customer) AS customer, count() AS n, sum(amount) AS amount "
                f"FROM {arena.table} GROUP BY customer"
            )
    finally:
        client.close()
    return arena


# ----------------------------------------------------------------------------- faults


@dataclass
class Injected:
    """One fault as it happened: ``fired`` is False when its trigger never came (a lost
    reply armed for a statement the job did not send in time)."""

    kind: str
    started: float
    cleared: float = 0.0
    fired: bool = False
    detail: str = ""


def _drop(proxy_of: Callable[[Arena], fp.FaultProxy], match: Any, label: str) -> Any:
    def fault(arena: Arena, rng: random.Random, wait: float) -> tuple[bool, str]:
        proxy = proxy_of(arena)
        rule = proxy.drop_reply(match, times=1, label=label)
        fired = proxy.wait_fired(rule, wait)
        if not fired:
            proxy.disarm(rule)
        return fired, label

    return fault


def _outage(name: str) -> Any:
    def fault(arena: Arena, rng: random.Random, wait: float) -> tuple[bool, str]:
        down = rng.uniform(0.5, 3.0)
        arena.services.kill(name)
        time.sleep(down)
        arena.services.restart()
        return True, f"{name} down {down:.1f}s"

    return fault


def _crash_inside_move(arena: Arena, rng: random.Random, wait: float) -> tuple[bool, str]:
    """The ClickHouse server crashes inside a MOVE PARTITION, some of the partition's parts
    already in the target and all still in staging (:mod:`txsink.embedded.crash` makes
    that state on the next MOVE of a partition with two or more parts, then exits like
    kill -9); restarted on the same data after a pause."""
    data = arena.services.root / "clickhouse"
    pid = arena.services.pid("clickhouse")
    (data / CRASH_FLAG).touch()
    deadline = time.monotonic() + wait
    while pid is not None and arena.services.pid("clickhouse") == pid:
        if time.monotonic() > deadline:
            (data / CRASH_FLAG).unlink(missing_ok=True)
            return False, "no MOVE of a partition with two or more parts came"
        time.sleep(0.05)
    time.sleep(rng.uniform(0.5, 2.0))
    arena.services.restart()
    lines = (data / CRASH_LOG).read_text().splitlines()
    return True, f"crashed inside a MOVE: {lines[-1] if lines else '?'} were in the target"


def _reset(proxy_of: Callable[[Arena], fp.FaultProxy]) -> Any:
    def fault(arena: Arena, rng: random.Random, wait: float) -> tuple[bool, str]:
        deadline = time.monotonic() + wait
        while (n := proxy_of(arena).reset_all()) == 0 and time.monotonic() < deadline:
            time.sleep(0.05)  # nothing open right now: reset the next connection
        return n > 0, f"{n} connections reset"

    return fault


def _blackhole(proxy_of: Callable[[Arena], fp.FaultProxy], low: float, high: float) -> Any:
    def fault(arena: Arena, rng: random.Random, wait: float) -> tuple[bool, str]:
        proxy, seconds = proxy_of(arena), rng.uniform(low, high)
        proxy.blackhole(True)
        time.sleep(seconds)
        proxy.blackhole(False)
        proxy.reset_all()  # connections opened meanwhile stay dead: end them
        return True, f"black hole {seconds:.1f}s"

    return fault


def _delay(arena: Arena, rng: random.Random, wait: float) -> tuple[bool, str]:
    seconds, lag = rng.uniform(2, 5), rng.uniform(0.05, 0.3)
    arena.ch_proxy.delay(lag)
    time.sleep(seconds)
    arena.ch_proxy.delay(0)
    return True, f"{lag * 1000:.0f} ms per chunk for {seconds:.1f}s"


def _too_many_parts(arena: Arena, rng: random.Random, wait: float) -> tuple[bool, str]:
    """Real back-pressure from the engine for a while: the target's part limits lowered
    until every INSERT into it is refused with TOO_MANY_PARTS (code 252), then restored.
    Staging lifts these limits (it never merges), so only dedup mode, which inserts into
    the target, is refused."""
    seconds = rng.uniform(1.5, 4.0)
    client = arena.client()
    try:
        before = _rejected(client)
        client.command(
            f"ALTER TABLE {arena.table} MODIFY SETTING parts_to_delay_insert = 1, "
            "parts_to_throw_insert = 1"
        )
        # at least ``seconds``, and on until an insert met it (the job may be between
        # runs or batches when the limits drop): a fault that never bit tests nothing
        started = time.monotonic()
        while time.monotonic() - started < 30:
            time.sleep(0.25)
            if time.monotonic() - started >= seconds and _rejected(client) > before:
                break
        seconds = time.monotonic() - started
        client.command(
            f"ALTER TABLE {arena.table} RESET SETTING parts_to_delay_insert, parts_to_throw_insert"
        )
        refused = _rejected(client) - before
    finally:
        client.close()
    return refused > 0, f"{refused} inserts refused over {seconds:.1f}s"


def _rejected(client: Any) -> int:
    rows = client.query("SELECT sum(value) FROM system.events WHERE name = 'RejectedInserts'")
    return int(rows.result_rows[0][0] or 0)


def _descendants(root: int) -> list[int]:
    """Every process below ``root`` (the job's driver): its JVM, pyspark daemons, workers."""
    parents = {
        int(e.name): _parent(int(e.name)) for e in Path("/proc").iterdir() if e.name.isdigit()
    }
    found, frontier = [], [root]
    while frontier:
        pid = frontier.pop()
        kids = [p for p, pp in parents.items() if pp == pid]
        found += kids
        frontier += kids
    return found


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _worker_kill(arena: Arena, rng: random.Random, wait: float) -> tuple[bool, str]:
    """SIGKILL a Python worker of the job's executors (a forked child of pyspark.daemon)."""
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        if arena.job_pid is not None:
            procs = _descendants(arena.job_pid)
            daemons = {p for p in procs if "pyspark.daemon" in _cmdline(p)}
            workers = [p for p in procs if p in daemons and _parent(p) in daemons]
            if workers:
                victim = rng.choice(workers)
                os.kill(victim, signal.SIGKILL)
                return True, f"worker pid {victim}"
        time.sleep(0.05)
    return False, "no executor worker seen"


def _parent(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[1])
    except OSError:
        return -1


def _driver_kill(arena: Arena, rng: random.Random, wait: float) -> tuple[bool, str]:
    if arena.job_pid is None:
        return False, "no job running"
    pid = arena.job_pid
    os.killpg(pid, signal.SIGKILL)
    return True, f"kill -9 of the driver's process group {pid}"


def _state(needle: str) -> str:
    return r"ALTER\s+TABLE\s+\S*nodes\s+UPDATE.{0,2000}" + needle


def _staging(statement: str) -> str:
    return statement + r".{0,200}txsink_staging"


CH = lambda a: a.ch_proxy  # noqa: E731 - a table of one-liners reads best this way
ZK = lambda a: a.zk_proxy  # noqa: E731


def _zk_multi(needle: bytes) -> Any:
    return fp.zk_request(lambda op, body: op == fp.ZK_MULTI and needle in body)


FAULTS: dict[str, Any] = {
    "clickhouse-kill": _outage("clickhouse"),
    "clickhouse-crash-inside-move": _crash_inside_move,
    "zookeeper-kill": _outage("zookeeper"),
    "keeper-session-expiry": _blackhole(ZK, KEEPER_TIMEOUT + 1.0, KEEPER_TIMEOUT + 2.5),
    "lost-reply-create-staging": _drop(
        CH, fp.http_request(_staging(r"CREATE\s+TABLE")), "CREATE staging"
    ),
    "lost-reply-insert": _drop(CH, fp.http_request(r"INSERT\s+INTO"), "INSERT block"),
    "lost-reply-move": _drop(CH, fp.http_request(r"MOVE\s+PARTITION"), "MOVE PARTITION"),
    # visibility=batch: the statement that fills the batch staging (held under the
    # finisher's own name: __all_..._c...): the copy of every task's staging (ALTER ...
    # ATTACH PARTITION) or the gather of their rows (INSERT INTO ... SELECT, or CREATE
    # TABLE ... AS SELECT where the target's CREATE is reproduced); the ATTACH into the
    # target
    "lost-reply-fill": _drop(
        CH,
        fp.http_request(
            r"(__all_[0-9a-f]+_c[0-9a-f]+`?\s+ATTACH\s+PARTITION)"
            r"|(INSERT\s+INTO\s+\S*__all_[0-9a-f]+_c[0-9a-f]+`?\s+\()"
            r"|(CREATE\s+TABLE\s+\S*__all_[0-9a-f]+_c[0-9a-f]+`?\s+\()"
        ),
        "copy or gather (into the batch staging, or creating it gathered)",
    ),
    "lost-reply-attach": _drop(
        CH, fp.http_request(r"ATTACH\s+PARTITION\s+ALL\s+FROM\s+\S*__all_"), "ATTACH"
    ),
    "lost-reply-drop-staging": _drop(
        CH, fp.http_request(_staging(r"DROP\s+TABLE")), "DROP staging"
    ),
    "lost-reply-keeper-prepare": _drop(ZK, _zk_multi(b"/xids/"), "Keeper prepare"),
    "lost-reply-keeper-commit": _drop(ZK, _zk_multi(b"/ledger"), "Keeper commit"),
    "lost-reply-keeper-dedup-state": _drop(
        ZK,
        fp.zk_request(
            lambda op, body: (
                op in (fp.ZK_CREATE, fp.ZK_SET_DATA, fp.ZK_CREATE2) and b"/dedup/" in body
            )
        ),
        "Keeper dedup state",
    ),
    # state=clickhouse: the guarded UPDATE that confirms a new xid record (its key is
    # followed by the creating transaction's id) and the one that commits (the ledger)
    "lost-reply-state-prepare": _drop(
        CH, fp.http_request(_state(r"/xids/[^']*' AND pending = '[0-9a-f]{32}'")), "state prepare"
    ),
    "lost-reply-state-commit": _drop(CH, fp.http_request(_state("/ledger")), "state commit"),
    "clickhouse-connection-reset": _reset(CH),
    "zookeeper-connection-reset": _reset(ZK),
    "clickhouse-black-hole": _blackhole(CH, 1.0, 4.0),
    "clickhouse-slow-network": _delay,
    "too-many-parts": _too_many_parts,
    "executor-worker-kill": _worker_kill,
    "driver-kill": _driver_kill,
}
ATTACH_ONLY = {
    "lost-reply-create-staging",
    "lost-reply-move",
    "lost-reply-fill",
    "lost-reply-attach",
    "lost-reply-drop-staging",
    "clickhouse-crash-inside-move",
}
DEDUP_ONLY = {"lost-reply-keeper-dedup-state"}
STATE_CLICKHOUSE_ONLY = {"lost-reply-state-prepare", "lost-reply-state-commit"}


def faults_for(mode: str) -> list[str]:
    skip = DEDUP_ONLY if mode == "attach" else ATTACH_ONLY | {"lost-reply-keeper-prepare"}
    return [k for k in FAULTS if k not in skip | STATE_CLICKHOUSE_ONLY]


# ----------------------------------------------------------------------------- playing


@dataclass
class Verdict:
    mode: str
    seed: int | None
    produced: int
    in_target: int
    distinct: int
    amount_ok: bool
    view_ok: bool
    batches: int
    job_runs: int
    restarts: int
    faults: list[Injected]
    max_recover_s: float
    seconds: float

    @property
    def duplicates(self) -> int:
        return self.in_target - self.distinct

    @property
    def missing(self) -> int:
        return self.produced - self.distinct

    @property
    def exact(self) -> bool:
        return self.in_target == self.distinct == self.produced and self.amount_ok and self.view_ok

    def to_json(self) -> dict[str, Any]:
        data = {k: v for k, v in self.__dict__.items() if k != "faults"}
        data.update(duplicates=self.duplicates, missing=self.missing, exact=self.exact)
        data["faults"] = [f.__dict__ for f in self.faults]
        return data

    def table(self) -> str:
        by_kind = Counter(f.kind for f in self.faults)
        fired = Counter(f.kind for f in self.faults if f.fired)
        lines = [
            f"nemesis verdict: mode={self.mode} seed={self.seed} "
            f"{'EXACT' if self.exact else 'NOT EXACT'} ({self.seconds:.0f} s)",
            "",
            f"{'fault':32s} {'injected':>8s} {'happened':>8s}",
        ]
        lines += [f"{k:32s} {by_kind[k]:8d} {fired[k]:8d}" for k in sorted(by_kind)]
        lines += [
            "",
            f"{'batches committed':32s} {self.batches:8d}",
            f"{'job runs (all rounds)':32s} {self.job_runs:8d}",
            f"{'runs that died (restarted)':32s} {self.restarts:8d}",
            f"{'rows produced':32s} {self.produced:8d}",
            f"{'rows in target':32s} {self.in_target:8d}",
            f"{'duplicates':32s} {self.duplicates:8d}",
            f"{'missing':32s} {self.missing:8d}",
            f"{'sum(amount) exact':32s} {self.amount_ok!s:>8s}",
            f"{'view exact (dedup mode)':32s} {self.view_ok!s:>8s}",
            f"{'max time to recover (s)':32s} {self.max_recover_s:8.1f}",
        ]
        return "\n".join(lines)


class Nemesis(threading.Thread):
    """Applies faults one after another while the job runs."""

    def __init__(
        self,
        arena: Arena,
        schedule: Callable[[], str | None],
        rng: random.Random,
        *,
        pause: tuple[float, float] = (1.0, 3.0),
        wait: float = 90.0,  # a loaded machine takes a while to start Spark
    ) -> None:
        super().__init__(name="nemesis", daemon=True)
        self.arena, self.schedule, self.rng = arena, schedule, rng
        self.pause, self.wait = pause, wait
        self.done: list[Injected] = []
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.is_set():
            if self.stopping.wait(self.rng.uniform(*self.pause)):
                return
            kind = self.schedule()
            if kind is None:
                return
            event = Injected(kind, time.time())
            log.warning("nemesis: %s", kind)
            try:
                event.fired, event.detail = FAULTS[kind](self.arena, self.rng, self.wait)
            except Exception as exc:
                event.detail = f"fault failed: {exc!r}"
            event.cleared = time.time()
            log.warning("nemesis: %s done: fired=%s %s", kind, event.fired, event.detail)
            self.done.append(event)


def run_job(arena: Arena, timeout: float) -> int:
    """One run of the job until it ends (0: the source is consumed) or dies."""
    env = dict(os.environ)
    env.setdefault("PYSPARK_PYTHON", sys.executable)
    env.pop("TXSINK_FAULT", None)
    with open(arena.job_log, "ab") as out:
        proc = subprocess.Popen(
            job_command(arena.args()), env=env, stdout=out, stderr=out, start_new_session=True
        )
        arena.job_pid = proc.pid
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return -1
        finally:
            arena.job_pid = None
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def play(
    arena: Arena,
    schedule: Callable[[], str | None],
    rng: random.Random,
    *,
    seed: int | None = None,
    rounds: Callable[[int], bool] = lambda n: n == 0,
    files_per_round: int = 6,
    max_runs: int = 12,
    pause: tuple[float, float] = (1.0, 3.0),
) -> Verdict:
    """Run rounds (grow the source, run the job until it finishes it) while the nemesis
    applies ``schedule``'s faults; then count. ``rounds(n)`` says whether round ``n`` runs;
    rounds go on anyway while the schedule has faults left, so each one meets a stream."""
    started = time.time()
    nemesis = Nemesis(arena, schedule, rng, pause=pause)
    runs = died = 0
    round_no = 0
    nemesis.start()
    try:
        # a round more while the nemesis still has faults to play (or one under way)
        while (rounds(round_no) or nemesis.is_alive()) and runs < max_runs:
            arena.grow(files_per_round)
            while runs < max_runs:
                runs += 1
                code = run_job(arena, timeout=600)
                log.warning("nemesis: job run %d ended with %d", runs, code)
                if code == 0:
                    break
                died += 1
            round_no += 1
    finally:
        nemesis.stopping.set()
        nemesis.join(120)
    # a last clean run: everything the nemesis broke must be repaired by a restart
    arena.ch_proxy.clear()
    arena.zk_proxy.clear()
    for _ in range(3):
        runs += 1
        if run_job(arena, timeout=600) == 0:
            break
        died += 1
    return count(arena, nemesis.done, runs, died, seed, time.time() - started)


def count(
    arena: Arena,
    faults: list[Injected],
    runs: int,
    died: int,
    seed: int | None,
    seconds: float,
) -> Verdict:
    client = arena.client()
    registry = arena.registry()
    try:
        n, distinct, amount = client.query(
            f"SELECT count(), uniqExact(id), sum(amount) FROM {arena.table}"
        ).result_rows[0]
        view_ok = True
        if arena.mode == "dedup":
            target = client.query(
                f"SELECT toString(customer), count(), sum(amount) FROM {arena.table} "
                "GROUP BY 1 ORDER BY 1"
            ).result_rows
            view = client.query(
                f"SELECT customer, sum(n), sum(amount) FROM {arena.db}.totals GROUP BY 1 ORDER BY 1"
            ).result_rows
            view_ok = [tuple(r) for r in view] == [tuple(r) for r in target]
        records = registry.list(arena.job)
        commits = sorted(r.committed_at for r in records if r.committed_at is not None)
    finally:
        client.close()
        registry.close()
    recover = [
        next((c for c in commits if c >= f.cleared), f.cleared) - f.cleared
        for f in faults
        if f.fired
    ]
    return Verdict(
        mode=arena.mode,
        seed=seed,
        produced=arena.produced,
        in_target=int(n),
        distinct=int(distinct),
        amount_ok=int(amount or 0) == arena.amount,
        view_ok=view_ok,
        batches=len(commits),
        job_runs=runs,
        restarts=died,
        faults=faults,
        max_recover_s=round(max(recover, default=0.0), 1),
        seconds=round(seconds, 1),
    )


def scripted(kinds: Sequence[str]) -> Callable[[], str | None]:
    """A schedule that plays ``kinds`` in order, then stops."""
    queue = list(kinds)
    return lambda: queue.pop(0) if queue else None


def randomized(mode: str, rng: random.Random, until: float) -> Callable[[], str | None]:
    kinds = faults_for(mode)
    return lambda: rng.choice(kinds) if time.time() < until else None


# ----------------------------------------------------------------------------- make chaos


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.nemesis.chaos",
        description="Stream into ClickHouse while faults drawn at random (with a seed) hit "
        "ClickHouse, ZooKeeper, the network and the job; then count every row.",
    )
    parser.add_argument("--minutes", type=float, default=15.0, help="total time, split over modes")
    parser.add_argument("--seed", type=int, default=None, help="default: drawn and printed")
    parser.add_argument("--mode", choices=("attach", "dedup", "both"), default="both")
    parser.add_argument("--json", help="also write the verdicts to this file")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 31)
    modes = ["attach", "dedup"] if args.mode == "both" else [args.mode]
    print(f"chaos: seed={seed} minutes={args.minutes} modes={','.join(modes)}", flush=True)
    work = Path(tempfile.mkdtemp(prefix="txsink-chaos-"))
    services = Services(embedded.up(work / "stack", _free_port(), _free_port(), timeout=120))
    verdicts: list[Verdict] = []
    try:
        for i, mode in enumerate(modes):
            rng = random.Random(seed * 2 + i)
            until = time.time() + args.minutes * 60 / len(modes)
            arena = open_arena(services, work / mode, mode)
            try:
                verdict = play(
                    arena,
                    randomized(mode, rng, until),
                    rng,
                    seed=seed,
                    rounds=lambda n, until=until: time.time() < until,
                    max_runs=10_000,
                    pause=(2.0, 6.0),
                )
            finally:
                arena.close()
            verdicts.append(verdict)
            print(verdict.table(), flush=True)
            print(flush=True)
    finally:
        embedded.down(work / "stack")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps([v.to_json() for v in verdicts], indent=2))
    ok = all(v.exact for v in verdicts)
    print(f"chaos: {'PASS' if ok else 'FAIL'} seed={seed} (work directory {work})")
    return 0 if ok else 1


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


if __name__ == "__main__":
    sys.exit(main())
