"""The embedded stack as separate processes see it: concurrent writers lose nothing, data
survives down/up, the CLI starts and stops exactly its processes, and ZooKeeper is real."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from clickhouse_connect.driver.client import Client
from kazoo.client import KazooClient
from kazoo.exceptions import BadVersionError, NodeExistsError

from tests.integration.conftest import client_for, free_port
from txsink.embedded import stack as embedded
from txsink.embedded.stack import StackInfo

ROOT = Path(__file__).resolve().parents[2]
ROWS_PER_WRITER = 200_000
BATCHES = 20


def _writer(url: str, table: str, writer: int) -> None:
    import pyarrow as pa

    host, port = url.rsplit("/", 1)[-1].split(":")
    import clickhouse_connect

    client = clickhouse_connect.get_client(host=host, port=int(port))
    per_batch = ROWS_PER_WRITER // BATCHES
    for batch in range(BATCHES):
        start = writer * ROWS_PER_WRITER + batch * per_batch
        ids = pa.array(range(start, start + per_batch), pa.uint64())
        if batch % 2:
            client.insert_arrow(
                table, pa.table({"id": ids, "w": pa.array([writer] * per_batch, pa.uint8())})
            )
        else:
            client.insert(table, [[i, writer] for i in ids.to_pylist()], column_names=["id", "w"])
    client.close()


def test_four_processes_inserting_concurrently_lose_nothing(
    stack: StackInfo, ch: Client, fresh_db: str
) -> None:
    table = f"{fresh_db}.conc"
    ch.command(f"CREATE TABLE {table} (id UInt64, w UInt8) ENGINE = MergeTree ORDER BY id")
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(stack.url, table, w)) for w in range(4)]
    for proc in procs:
        proc.start()
    # a reader keeps querying while they write
    stop = threading.Event()
    errors: list[BaseException] = []

    def reader() -> None:
        client = client_for(stack)
        try:
            while not stop.is_set():
                client.query(f"SELECT count(), max(id) FROM {table}")
        except BaseException as exc:  # report in the main thread
            errors.append(exc)
        finally:
            client.close()

    thread = threading.Thread(target=reader)
    thread.start()
    for proc in procs:
        proc.join(timeout=300)
    stop.set()
    thread.join()
    assert [p.exitcode for p in procs] == [0, 0, 0, 0]
    assert not errors
    total = 4 * ROWS_PER_WRITER
    count, distinct, low, high = ch.query(
        f"SELECT count(), uniqExact(id), min(id), max(id) FROM {table}"
    ).result_rows[0]
    assert (count, distinct, low, high) == (total, total, 0, total - 1)
    per_writer = dict(ch.query(f"SELECT w, count() FROM {table} GROUP BY w").result_rows)
    assert per_writer == dict.fromkeys(range(4), ROWS_PER_WRITER)


@pytest.fixture
def private_stack(tmp_path: Path) -> Iterator[Path]:
    """A stack directory of its own (not the session stack); always taken down."""
    root = tmp_path / "stack"
    yield root
    embedded.down(root)


def test_data_survives_down_and_up(private_stack: Path) -> None:
    ports = free_port(), free_port()
    info = embedded.up(private_stack, *ports, timeout=90)
    client = client_for(info)
    client.command("CREATE TABLE keep (a UInt64, s String) ENGINE = MergeTree ORDER BY a")
    client.insert("keep", [[i, str(i)] for i in range(1000)])
    client.close()
    zk = KazooClient(hosts=info.keeper)
    zk.start(timeout=15)
    zk.create("/survivor", b"still here", makepath=True)
    zk.stop()
    stopped = embedded.down(private_stack)
    assert sorted(stopped) == sorted([info.clickhouse_pid, info.zookeeper_pid])
    assert not embedded.status(private_stack).up

    again = embedded.up(private_stack, *ports, timeout=90)
    assert again.clickhouse_pid != info.clickhouse_pid
    client = client_for(again)
    assert client.query("SELECT count(), sum(a) FROM keep").result_rows == [
        (1000, sum(range(1000)))
    ]
    client.close()
    zk = KazooClient(hosts=again.keeper)
    zk.start(timeout=15)
    assert zk.get("/survivor")[0] == b"still here"
    zk.stop()


def test_up_is_idempotent_and_handles_stale_pid_files(private_stack: Path) -> None:
    ports = free_port(), free_port()
    first = embedded.up(private_stack, *ports, timeout=90)
    second = embedded.up(private_stack, timeout=30)
    assert (second.clickhouse_pid, second.zookeeper_pid) == (
        first.clickhouse_pid,
        first.zookeeper_pid,
    )
    assert second.url == first.url
    embedded.down(private_stack)
    # a pid file naming a live process that is not ours (this test) must not be signalled
    (private_stack / "clickhouse.pid").write_text(
        json.dumps({"pid": os.getpid(), "port": ports[0]})
    )
    (private_stack / "zookeeper.pid").write_text(json.dumps({"pid": 2**22 - 7, "port": ports[1]}))
    st = embedded.status(private_stack)
    assert not st.clickhouse.alive and not st.zookeeper.alive and not st.up
    assert embedded.down(private_stack) == []
    third = embedded.up(private_stack, *ports, timeout=90)
    assert embedded.status(private_stack).up
    assert third.clickhouse_pid != os.getpid()


def test_port_taken_by_another_program_is_a_clear_error(private_stack: Path) -> None:
    import socket

    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        taken = squatter.getsockname()[1]
        with pytest.raises(Exception, match=f"port {taken}.*taken"):
            embedded.up(private_stack, taken, free_port(), timeout=30)
    assert not embedded.status(private_stack).up


def _txsink(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "txsink.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        check=False,
    )


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] not in ("Z", "X")


def test_cli_up_million_rows_from_another_process_then_down(tmp_path: Path) -> None:
    root = str(tmp_path / "cli-stack")
    ch_port, zk_port = free_port(), free_port()
    try:
        up = _txsink(
            "embedded", "up", "--dir", root, "--json",
            "--clickhouse-port", str(ch_port), "--zookeeper-port", str(zk_port),
        )  # fmt: skip
        assert up.returncode == 0, up.stderr + up.stdout
        info = json.loads(up.stdout)
        assert info["url"] == f"http://127.0.0.1:{ch_port}"
        assert info["keeper"] == f"127.0.0.1:{zk_port}"
        pids = [info["clickhouse_pid"], info["zookeeper_pid"]]
        assert all(_alive(p) for p in pids)  # outlived the CLI process
        status = _txsink("embedded", "status", "--dir", root, "--json")
        assert status.returncode == 0 and json.loads(status.stdout)["up"] is True

        script = textwrap.dedent(
            f"""
            import time, clickhouse_connect, numpy as np, pyarrow as pa
            c = clickhouse_connect.get_client(host="127.0.0.1", port={ch_port})
            c.command("CREATE TABLE million (id UInt64, v Int64) ENGINE = MergeTree ORDER BY id")
            n = 1_000_000
            t = pa.table({{"id": pa.array(np.arange(n, dtype=np.uint64)),
                           "v": pa.array(np.arange(n, dtype=np.int64) * -1)}})
            start = time.perf_counter()
            c.insert_arrow("million", t)
            took = time.perf_counter() - start
            print(c.command("SELECT count() FROM million"),
                  c.command("SELECT sum(v) FROM million"), took)
            """
        )
        run = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, timeout=180, check=False
        )
        assert run.returncode == 0, run.stderr
        count, total, took = run.stdout.split()
        assert int(count) == 1_000_000
        assert int(total) == -sum(range(1_000_000))
        print(f"insert_arrow: 1M narrow rows in {float(took):.3f}s")
    finally:
        down = _txsink("embedded", "down", "--dir", root)
    assert down.returncode == 0, down.stderr
    assert not any(_alive(p) for p in pids)
    status = _txsink("embedded", "status", "--dir", root)
    assert status.returncode != 0


def test_kazoo_create_cas_and_watch(zk: KazooClient) -> None:
    base = f"/txsink-test/{os.getpid()}-{id(zk)}"
    zk.ensure_path(base)
    path = zk.create(f"{base}/node", b"v0")
    with pytest.raises(NodeExistsError):
        zk.create(path, b"again")
    data, stat = zk.get(path)
    assert data == b"v0"
    zk.set(path, b"v1", version=stat.version)
    with pytest.raises(BadVersionError):
        zk.set(path, b"stale", version=stat.version)
    fired = threading.Event()
    seen: list[bytes] = []

    def on_change(value: bytes | None, _stat: object) -> None:
        if value is not None:
            seen.append(value)
            if value == b"v2":
                fired.set()

    zk.DataWatch(path, on_change)
    zk.set(path, b"v2")
    assert fired.wait(10)
    assert seen[0] == b"v1" and seen[-1] == b"v2"
    children = threading.Event()
    zk.ChildrenWatch(base, lambda kids: children.set() if "seq" in "".join(kids) else None)
    zk.create(f"{base}/seq-", b"", sequence=True)
    assert children.wait(10)
    zk.delete(base, recursive=True)


def test_cli_up_three_shards_each_its_own_engine_then_down_stops_them_all(
    tmp_path: Path,
) -> None:
    """`txsink embedded up --shards 3`: three independent ClickHouse endpoints,
    each its own engine and data dir and port, plus one ZooKeeper; status and down cover
    all; a shard killed -9 comes back on its own port with its data at the next `up`."""
    root = str(tmp_path / "cluster")
    ch_port, zk_port = free_port(), free_port()
    pids: list[int] = []
    try:
        up = _txsink(
            "embedded", "up", "--dir", root, "--json", "--shards", "3",
            "--clickhouse-port", str(ch_port), "--zookeeper-port", str(zk_port),
        )  # fmt: skip
        assert up.returncode == 0, up.stderr + up.stdout
        info = json.loads(up.stdout)
        urls = [f"http://127.0.0.1:{ch_port + k}" for k in range(3)]
        assert info["url"] == urls[0] and info["shards"] == urls
        assert info["keeper"] == f"127.0.0.1:{zk_port}"
        pids = [*info["shard_pids"], info["zookeeper_pid"]]
        assert len(set(pids)) == 4 and all(_alive(p) for p in pids)
        clients = [client_for(StackInfo(root, url, info["keeper"], 0, 0)) for url in info["shards"]]
        for k, client in enumerate(clients):  # each shard is its own engine
            client.command("CREATE TABLE IF NOT EXISTS s (k UInt8) ENGINE = MergeTree ORDER BY k")
            client.command(f"INSERT INTO s VALUES ({k})")
        assert [c.command("SELECT sum(k) + 10 * count() FROM s") for c in clients] == [10, 11, 12]
        assert sorted(p.name for p in Path(root).glob("clickhouse*") if p.is_dir()) == [
            "clickhouse",
            "clickhouse-1",
            "clickhouse-2",
        ]
        status = _txsink("embedded", "status", "--dir", root, "--json")
        assert status.returncode == 0, status.stdout
        assert json.loads(status.stdout)["shards"] == urls

        os.kill(info["shard_pids"][1], 9)  # one shard dies: the stack is not up
        status = _txsink("embedded", "status", "--dir", root, "--json")
        assert status.returncode == 5 and json.loads(status.stdout)["up"] is False  # unreachable
        again = _txsink("embedded", "up", "--dir", root, "--json")  # brings it back
        assert again.returncode == 0, again.stderr
        back = json.loads(again.stdout)
        assert back["shards"] == urls and back["shard_pids"][0] == info["shard_pids"][0]
        pids.append(back["shard_pids"][1])
        assert clients[1].command("SELECT sum(k) + 10 * count() FROM s") == 11  # its data survived
        wrong = _txsink("embedded", "up", "--dir", root, "--shards", "2")
        assert wrong.returncode != 0 and "runs 3 ClickHouse shard(s)" in wrong.stderr
    finally:
        down = _txsink("embedded", "down", "--dir", root)
    assert down.returncode == 0, down.stderr
    assert not any(_alive(p) for p in pids)
