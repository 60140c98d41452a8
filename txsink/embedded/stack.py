"""Start, stop and inspect the embedded stack: chdb HTTP endpoints plus ZooKeeper.

Every service runs as a detached process (own session, so it outlives the command that
started it) with its state in one stack directory::

    <dir>/clickhouse/          chdb data + clickhouse-http.log (the endpoint's log)
    <dir>/clickhouse-<k>/      the same for shard k of a cluster (``up(shards=N)``, k >= 1)
    <dir>/zookeeper/           zoo.cfg, data/, zookeeper.log
    <dir>/clickhouse.pid       {"pid": ..., "port": ...}  (JSON); clickhouse-<k>.pid
    <dir>/zookeeper.pid
    <dir>/*.out                stdout/stderr of each process

A cluster of N shards is N independent ClickHouse endpoints (each its own chdb engine,
data directory and port: the first on the ClickHouse port, shard k on that port + k) and
one ZooKeeper they share with the writers.

Invariants: ``down`` only signals a pid whose ``/proc/<pid>/cmdline`` shows it is this
stack's own service (a stale pid file, or a pid reused by another program, is just
removed); ``up`` is a no-op when both services already run and answer; a port held by
another program is reported, never fought over.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

from txsink.embedded import zookeeper
from txsink.errors import ConfigError, UnavailableError

# In every config written: the server's query log, flushed every second (tests read it),
# and a server's old_parts_lifetime (chdb's own default is 0: replaced parts vanish at
# once, so a cut MOVE's evidence would never outlive a restart; docs/operations.md#late-restart)
QUERY_LOG_CONFIG = (
    "<query_log><database>system</database><table>query_log</table>"
    "<flush_interval_milliseconds>1000</flush_interval_milliseconds></query_log>"
    "<merge_tree><old_parts_lifetime>480</old_parts_lifetime></merge_tree>"
)

DEFAULT_CLICKHOUSE_PORT = 18123
DEFAULT_ZOOKEEPER_PORT = 12181
DEFAULT_TIMEOUT = 60.0
STOP_GRACE_SECONDS = 10.0
DIR_ENV = "TXSINK_EMBEDDED_DIR"
SERVER_MODULE = "txsink.embedded.server"
# KeeperMap tables (the `state=clickhouse` store) live under this ZooKeeper path
KEEPER_MAP_PREFIX = "/clickhouse/keeper_map"
KEEPER_CONFIG = "chdb-config.xml"  # in a shard's data dir: the endpoint talks to ZooKeeper
PACKAGE_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class StackInfo:
    """Where a running stack answers."""

    dir: str
    url: str  # http://127.0.0.1:N (the first shard)
    keeper: str  # 127.0.0.1:N
    clickhouse_pid: int
    zookeeper_pid: int
    shards: tuple[str, ...] = ()  # the url of every shard, the first is ``url``
    shard_pids: tuple[int, ...] = ()


@dataclass(frozen=True)
class ServiceStatus:
    name: str
    pid: int | None
    alive: bool  # the pid runs this stack's service
    answering: bool  # the service answers its health check
    address: str | None  # url for ClickHouse, host:port for ZooKeeper


@dataclass(frozen=True)
class StackStatus:
    dir: str
    clickhouse: ServiceStatus
    zookeeper: ServiceStatus
    shards: tuple[ServiceStatus, ...] = ()  # every ClickHouse shard, the first included

    @property
    def up(self) -> bool:
        services = (*(self.shards or (self.clickhouse,)), self.zookeeper)
        return all(s.alive and s.answering for s in services)

    def as_dict(self) -> dict[str, object]:
        return {
            "dir": self.dir,
            "up": self.up,
            "url": self.clickhouse.address,
            "shards": [s.address for s in self.shards or (self.clickhouse,)],
            "keeper": self.zookeeper.address,
            "clickhouse": asdict(self.clickhouse),
            "zookeeper": asdict(self.zookeeper),
            "shard_services": [asdict(s) for s in self.shards or (self.clickhouse,)],
        }


def shard_name(k: int) -> str:
    """The service name of shard ``k`` (0 is plain ``clickhouse``)."""
    return "clickhouse" if k == 0 else f"clickhouse-{k}"


def _is_clickhouse(name: str) -> bool:
    return name == "clickhouse" or name.startswith("clickhouse-")


def _shard_names(root: Path) -> list[str]:
    """Shard services that have a pid file in ``root``, in shard order."""
    found = {p.stem for p in root.glob("clickhouse*.pid") if _is_clickhouse(p.stem)}

    def index(name: str) -> int:
        return 0 if name == "clickhouse" else int(name.rsplit("-", 1)[1])

    return sorted((n for n in found if n == "clickhouse" or n.rsplit("-", 1)[1].isdigit()),
                  key=index)  # fmt: skip


def default_dir() -> Path:
    """``$TXSINK_EMBEDDED_DIR``, else ``.txsink/embedded`` under the current directory."""
    return Path(os.environ.get(DIR_ENV) or Path.cwd() / ".txsink" / "embedded")


# --------------------------------------------------------------------------- processes


def _pid_file(root: Path, name: str) -> Path:
    return root / f"{name}.pid"


def _read_pid(root: Path, name: str) -> tuple[int, int] | None:
    try:
        record = json.loads(_pid_file(root, name).read_text())
        return int(record["pid"]), int(record["port"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _write_pid(root: Path, name: str, pid: int, port: int) -> None:
    tmp = _pid_file(root, name).with_suffix(".tmp")
    tmp.write_text(json.dumps({"pid": pid, "port": port}))
    tmp.replace(_pid_file(root, name))


def _cmdline(pid: int) -> list[str]:
    raw = b""
    for _ in range(50):
        try:
            raw = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            return []
        if raw or _is_zombie(pid):
            break
        time.sleep(0.01)  # a process in the middle of exec() briefly shows an empty cmdline
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def _is_zombie(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[-1].split()[0] in ("Z", "X")


def _reap(pid: int) -> None:
    """Collect the exit status when the service is our own child (the test fixture case)."""
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)


def _marker(root: Path, name: str) -> str:
    return str(root / name) if _is_clickhouse(name) else str(root / "zookeeper" / "zoo.cfg")


def _is_ours(root: Path, name: str, pid: int) -> bool:
    """True when ``pid`` is alive and runs this stack directory's ``name`` service."""
    _reap(pid)
    argv = _cmdline(pid)
    if not argv or _is_zombie(pid):
        return False
    program = SERVER_MODULE if _is_clickhouse(name) else zookeeper.MAIN_CLASS
    return program in argv and _marker(root, name) in argv


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _clickhouse_answers(port: int, timeout: float = 1.0) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/ping", timeout=timeout) as resp:
            return bool(resp.status == 200 and resp.read() == b"Ok.\n")
    except (OSError, urllib.error.URLError):
        return False


def _answers(name: str, port: int) -> bool:
    return _clickhouse_answers(port) if _is_clickhouse(name) else zookeeper.ruok(port)


def _argv(root: Path, name: str, port: int) -> list[str]:
    if _is_clickhouse(name):
        data = root / name
        argv = [sys.executable, "-m", SERVER_MODULE, "--data", str(data), "--port", str(port)]
        if (data / KEEPER_CONFIG).exists():
            argv += ["--config-file", str(data / KEEPER_CONFIG)]
        return argv
    return zookeeper.command(root / "zookeeper", port)


def keeper_config(keeper: str, macros: dict[str, str]) -> str:
    """A chdb config naming the ZooKeeper ``host:port``, the server's ``<macros>`` and
    the ``keeper_map_path_prefix`` that enables ``KeeperMap`` tables (the
    ``state=clickhouse`` store).

    With it chdb (26.9) registers ``Replicated*MergeTree`` tables in Keeper, but every
    one stays read-only: chdb never sets an interserver address, so no replica can
    announce itself. DDL, Keeper paths and their cleanup can be tested, inserts cannot."""
    host, _, port = keeper.partition(":")
    nodes = f"<node><host>{host}</host><port>{port or 2181}</port></node>"
    tags = "".join(f"<{k}>{v}</{k}>" for k, v in macros.items())
    return (
        f"<clickhouse><zookeeper>{nodes}</zookeeper><macros>{tags}</macros>"
        f"<keeper_map_path_prefix>{KEEPER_MAP_PREFIX}</keeper_map_path_prefix>"
        f"{QUERY_LOG_CONFIG}</clickhouse>\n"
    )


def _configure_keeper(root: Path, name: str, zookeeper_port: int, replicated: bool | None) -> None:
    """Every endpoint gets the stack's ZooKeeper and the KeeperMap prefix; the macros of
    ``Replicated*MergeTree`` only when ``replicated`` (None: as the directory had it)."""
    config = root / name / KEEPER_CONFIG
    if replicated is None:
        replicated = config.exists() and "<macros><shard>" in config.read_text()
    k = 0 if name == "clickhouse" else int(name.rsplit("-", 1)[1])
    config.parent.mkdir(parents=True, exist_ok=True)
    macros = {"shard": f"{k + 1:02d}", "replica": "r1"} if replicated else {}
    config.write_text(keeper_config(f"127.0.0.1:{zookeeper_port}", macros))


def _spawn(root: Path, name: str, port: int) -> int:
    argv = _argv(root, name, port)
    (root / name).mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PACKAGE_ROOT), env.get("PYTHONPATH")]))
    with open(root / f"{name}.out", "ab") as out:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=str(root),
            env=env,
            start_new_session=True,  # outlive the CLI; not hit by its terminal's Ctrl-C
            close_fds=True,
        )
    _write_pid(root, name, proc.pid, port)
    return proc.pid


def _log_tail(root: Path, name: str, lines: int = 15) -> str:
    logs = [root / f"{name}.out"]
    logs.append(
        root / name / "clickhouse-http.log"
        if _is_clickhouse(name)
        else root / "zookeeper" / "zookeeper.log"
    )
    tail: list[str] = []
    for path in logs:
        with contextlib.suppress(OSError):
            tail += path.read_text(errors="replace").splitlines()[-lines:]
    return "\n".join(tail[-lines:])


def _stop_pid(pid: int, grace: float) -> None:
    """SIGTERM, SIGKILL after ``grace`` seconds, and wait until the process is gone."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    killed = False
    while True:
        _reap(pid)
        if not _cmdline(pid) or _is_zombie(pid):
            return
        if not killed and time.monotonic() > deadline:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            killed = True
            deadline = time.monotonic() + grace
        elif killed and time.monotonic() > deadline:
            raise UnavailableError(f"process {pid} survived SIGKILL for {grace:.0f}s")
        time.sleep(0.05)


# --------------------------------------------------------------------------- API


def up(
    dir: str | Path | None = None,
    clickhouse_port: int | None = None,
    zookeeper_port: int | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    shards: int | None = None,
    replicated: bool | None = None,
) -> StackInfo:
    """Start the stack (or find it running) and wait until every service answers.

    ``shards``: how many ClickHouse endpoints (a cluster of independent shards); None
    means as many as run already, else 1. A running stack with another number of shards
    is refused (``down`` it first). ``replicated``: give each ClickHouse endpoint the
    stack's ZooKeeper and the macros ``{shard}`` (01, 02, ...) and ``{replica}`` (r1), so
    ``Replicated*MergeTree`` tables can be created (they stay read-only, see
    :func:`keeper_config`); None keeps what the directory had. It
    applies to endpoints started now. Every endpoint gets the stack's ZooKeeper and a
    ``keeper_map_path_prefix``, so ``KeeperMap`` tables (the ``state=clickhouse`` store)
    work without a flag."""
    root = Path(dir) if dir is not None else default_dir()
    root = root.resolve()
    if importlib.util.find_spec("chdb") is None:
        raise ConfigError(
            "the embedded stack runs the chdb engine, which is not installed in this Python: "
            "pip install 'txsink[embedded]' (a production install does not need it)"
        )
    root.mkdir(parents=True, exist_ok=True)
    zookeeper.check_installed()
    running = [n for n in _shard_names(root) if _is_ours(root, n, (_read_pid(root, n) or (0,))[0])]
    if shards is not None and shards < 1:
        raise ConfigError(f"--shards must be at least 1, got {shards}")
    if shards is not None and running and len(running) != shards:
        raise ConfigError(
            f"the embedded stack of {root} runs {len(running)} ClickHouse shard(s), not "
            f"{shards}: run `txsink embedded down --dir {root}` first"
        )
    # a shard that died keeps its pid file: it counts, and comes back on its old port
    count = shards or max(1, len(_shard_names(root)))
    base = clickhouse_port or DEFAULT_CLICKHOUSE_PORT
    wanted: dict[str, int | None] = {"zookeeper": zookeeper_port}
    defaults = {"zookeeper": DEFAULT_ZOOKEEPER_PORT}
    for k in range(count):
        wanted[shard_name(k)] = None if clickhouse_port is None else clickhouse_port + k
        defaults[shard_name(k)] = base + k
    pids: dict[str, int] = {}
    ports: dict[str, int] = {}
    started: list[str] = []
    try:
        for name, asked in wanted.items():
            record = _read_pid(root, name)
            if record is not None and _is_ours(root, name, record[0]):
                pid, port = record
                if asked is not None and asked != port:
                    raise ConfigError(
                        f"the embedded {name} of {root} already runs on port {port}, not "
                        f"{asked}: run `txsink embedded down --dir {root}` first"
                    )
                pids[name], ports[name] = pid, port
                continue
            _pid_file(root, name).unlink(missing_ok=True)  # stale: dead or reused pid
            port = asked or (record[1] if record is not None else defaults[name])
            if _is_clickhouse(name):
                _configure_keeper(root, name, ports["zookeeper"], replicated)
            if not _port_free(port):
                raise UnavailableError(
                    f"port {port} on 127.0.0.1 is taken by another program, so the embedded "
                    f"{name} cannot start: stop it or pass "
                    f"--{'clickhouse' if _is_clickhouse(name) else name}-port"
                )
            pids[name], ports[name] = _spawn(root, name, port), port
            started.append(name)
        _wait_answering(root, pids, ports, timeout)
    except BaseException:
        for name in started:  # leave nothing half-started behind
            with contextlib.suppress(UnavailableError):
                _stop_pid(pids[name], 2.0)
            _pid_file(root, name).unlink(missing_ok=True)
        raise
    names = [shard_name(k) for k in range(count)]
    return StackInfo(
        dir=str(root),
        url=f"http://127.0.0.1:{ports['clickhouse']}",
        keeper=f"127.0.0.1:{ports['zookeeper']}",
        clickhouse_pid=pids["clickhouse"],
        zookeeper_pid=pids["zookeeper"],
        shards=tuple(f"http://127.0.0.1:{ports[n]}" for n in names),
        shard_pids=tuple(pids[n] for n in names),
    )


def _wait_answering(
    root: Path, pids: dict[str, int], ports: dict[str, int], timeout: float
) -> None:
    deadline = time.monotonic() + timeout
    pending = set(pids)
    while pending:
        for name in sorted(pending):
            if not _is_ours(root, name, pids[name]):
                raise UnavailableError(
                    f"the embedded {name} exited during startup; its log ends with:\n"
                    + _log_tail(root, name)
                )
            if _answers(name, ports[name]):
                pending.discard(name)
        if pending and time.monotonic() > deadline:
            raise UnavailableError(
                f"the embedded {', '.join(sorted(pending))} did not answer within "
                f"{timeout:.0f}s; logs are in {root}"
            )
        if pending:
            time.sleep(0.1)


def down(dir: str | Path | None = None, grace: float = STOP_GRACE_SECONDS) -> list[int]:
    """Stop exactly the processes this stack directory started; returns their pids."""
    root = (Path(dir) if dir is not None else default_dir()).resolve()
    stopped: list[int] = []
    for name in (*_shard_names(root), "zookeeper"):
        record = _read_pid(root, name)
        if record is not None and _is_ours(root, name, record[0]):
            _stop_pid(record[0], grace)
            stopped.append(record[0])
        _pid_file(root, name).unlink(missing_ok=True)
    return stopped


def status(dir: str | Path | None = None) -> StackStatus:
    """What really runs: per service the pid, whether it is ours and alive, and answering."""
    root = (Path(dir) if dir is not None else default_dir()).resolve()
    services = {}
    names = _shard_names(root)
    if "clickhouse" not in names:
        names.insert(0, "clickhouse")
    for name in (*names, "zookeeper"):
        record = _read_pid(root, name)
        if record is None:
            services[name] = ServiceStatus(name, None, False, False, None)
            continue
        pid, port = record
        alive = _is_ours(root, name, pid)
        address = f"http://127.0.0.1:{port}" if _is_clickhouse(name) else f"127.0.0.1:{port}"
        services[name] = ServiceStatus(name, pid, alive, alive and _answers(name, port), address)
    return StackStatus(
        str(root),
        services["clickhouse"],
        services["zookeeper"],
        tuple(services[n] for n in names),
    )
