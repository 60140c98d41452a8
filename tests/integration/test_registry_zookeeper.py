"""The Registry contract on a real ZooKeeper (``KazooRegistry``), plus what only a real
Keeper has: chroots, digest ACLs, unreachable servers, expired sessions, racing sessions.

ZooKeeper comes from the ``stack`` and ``zk`` fixtures of ``tests/integration/conftest.py``
(``stack.keeper`` is ``127.0.0.1:PORT``). Every test works under its own root (or chroot),
so tests never collide.
"""

from __future__ import annotations

import json
import logging
import socket
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kazoo.client import KazooClient
from kazoo.exceptions import ConnectionLoss as KazooConnectionLoss
from kazoo.exceptions import NoAuthError
from kazoo.security import Permissions

from tests.registry_contract import (
    JOB,
    RegistryContract,
    TombstoneContract,
    big_record,
    grid_record,
    prepared,
)
from txsink.embedded.stack import StackInfo
from txsink.errors import (
    ConfigError,
    FencedError,
    KeeperRequestTooLarge,
    TxSinkError,
    UnavailableError,
)
from txsink.keeper.kazoo_registry import KazooRegistry
from txsink.ports.manifest_codec import CHUNK_BYTES
from txsink.ports.registry import CREATE, Registry, XidExists
from txsink.protocol.codec import FORMAT, StateFormatTooNew
from txsink.protocol.states import Cut, Epoch, XidRecord, XidState

pytestmark = pytest.mark.integration

TIMEOUT = 10.0
AUTH = "alice:s3cret"


@pytest.fixture
def keeper_hosts(stack: StackInfo) -> str:
    return stack.keeper


@pytest.fixture
def raw_zk(zk: KazooClient) -> KazooClient:
    """The conftest's plain kazoo session, with digest ``AUTH`` attached so it can inspect
    and clean up nodes that the ACL tests protect."""
    zk.add_auth("digest", AUTH)
    return zk


@pytest.fixture
def root(raw_zk: KazooClient) -> Iterator[str]:
    path = f"/txsink-test-{uuid.uuid4().hex[:12]}"
    yield path
    raw_zk.delete(path, recursive=True)


@pytest.fixture
def open_registry(keeper_hosts: str, root: str) -> Iterator[Callable[[], Registry]]:
    """Opens KazooRegistries (each its own session: a driver) on the test's root."""
    opened: list[KazooRegistry] = []

    def open_one() -> Registry:
        reg = KazooRegistry(keeper_hosts, root, timeout=TIMEOUT)
        opened.append(reg)
        return reg

    yield open_one
    for reg in opened:
        reg.close()


@pytest.fixture
def registry(open_registry: Callable[[], Registry]) -> Registry:
    return open_registry()


class TestRegistryContractOnZooKeeper(RegistryContract, TombstoneContract):
    """Every contract invariant of tests/registry_contract.py, on ZooKeeper."""


# -- ZooKeeper only ---------------------------------------------------------------------


def test_epoch_token_is_the_epoch_nodes_version(
    registry: KazooRegistry, raw_zk: KazooClient, root: str
) -> None:
    for _ in range(3):
        epoch = registry.take_epoch(JOB, "driver-a")
        _, stat = raw_zk.get(f"{root}/jobs/{JOB}/epoch")
        assert epoch.token == stat.version


def test_takeover_is_logged_with_the_previous_owner(
    registry: KazooRegistry, caplog: pytest.LogCaptureFixture
) -> None:
    registry.take_epoch(JOB, "driver-a")
    with caplog.at_level(logging.WARNING, logger="txsink.keeper.kazoo_registry"):
        registry.take_epoch(JOB, "driver-b")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("driver-b" in m and "driver-a" in m and "epoch 2" in m for m in warnings)


def test_nodes_are_json_under_the_documented_layout(
    registry: KazooRegistry, raw_zk: KazooClient, root: str
) -> None:
    registry.ensure_job(JOB, {"target": "db.events"})
    epoch = registry.take_epoch(JOB, "driver-a")
    record = prepared(registry, epoch, "x-1")
    registry.commit(epoch, record, committed_at=5.0)
    registry.put_blob(JOB, "dedup/x-1/p0", {"state": "AFTER"})
    job = f"{root}/jobs/{JOB}"
    assert sorted(raw_zk.get_children(job)) == ["dedup", "epoch", "ledger", "xids"]
    assert b'"state":"COMMITTED"' in raw_zk.get(f"{job}/xids/x-1")[0]
    assert b'"seq":1' in raw_zk.get(f"{job}/ledger")[0]
    assert raw_zk.exists(f"{job}/dedup/x-1/p0") is not None


def test_chroot_holds_every_node(keeper_hosts: str, raw_zk: KazooClient) -> None:
    chroot = f"/txsink-chroot-{uuid.uuid4().hex[:12]}"
    reg = KazooRegistry(f"{keeper_hosts}{chroot}", "/txsink", timeout=TIMEOUT)
    try:
        reg.ensure_job(JOB, {"target": "db.events"})
        epoch = reg.take_epoch(JOB, "driver-a")
        prepared(reg, epoch, "x-1")
        assert raw_zk.exists(f"{chroot}/txsink/jobs/{JOB}/xids/x-1") is not None
        assert reg.list_jobs() == [JOB]
    finally:
        reg.close()
        raw_zk.delete(chroot, recursive=True)


def test_another_identity_can_read_a_job_but_not_alter_it(
    keeper_hosts: str, root: str, raw_zk: KazooClient
) -> None:
    owner = KazooRegistry(keeper_hosts, root, auth=AUTH, timeout=TIMEOUT)
    stranger = KazooClient(hosts=keeper_hosts, timeout=TIMEOUT)
    stranger.start(timeout=TIMEOUT)
    intruder = KazooRegistry(keeper_hosts, root, auth="mallory:guess", timeout=TIMEOUT)
    try:
        owner.ensure_job(JOB, {"target": "db.events"})
        epoch = owner.take_epoch(JOB, "driver-a")
        record = prepared(owner, epoch, "x-1")
        path = f"{root}/jobs/{JOB}/xids/x-1"

        acl, _ = raw_zk.get_acls(path)
        assert {(a.id.scheme, a.id.id.split(":")[0], a.perms) for a in acl} == {
            ("digest", "alice", Permissions.ALL),
            ("world", "anyone", Permissions.READ),
        }
        data, _ = stranger.get(path)  # everyone may read
        assert b'"xid":"x-1"' in data
        with pytest.raises(NoAuthError):
            stranger.set(path, b"{}")
        with pytest.raises(NoAuthError):
            stranger.create(f"{root}/jobs/{JOB}/xids/x-evil", b"{}")

        assert intruder.get(JOB, "x-1") == record  # a registry with other credentials reads
        with pytest.raises(ConfigError, match="NoAuth"):
            intruder.take_epoch(JOB, "mallory")

        done = owner.commit(epoch, record, committed_at=1.0)  # the owner still writes
        assert done.state is XidState.COMMITTED
    finally:
        intruder.close()
        stranger.stop()
        stranger.close()
        owner.close()


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def test_unreachable_keeper_is_unavailable_within_the_timeout() -> None:
    keeper = f"127.0.0.1:{_closed_port()}"
    started = time.monotonic()
    with pytest.raises(UnavailableError) as info:
        KazooRegistry(keeper, timeout=2.0)
    assert time.monotonic() - started < 2.0 + 3.0
    message = str(info.value)
    assert keeper in message
    assert "txsink embedded status" in message


def test_a_reused_client_stays_open_after_close(keeper_hosts: str, root: str) -> None:
    client = KazooClient(hosts=keeper_hosts, timeout=TIMEOUT)
    client.start(timeout=TIMEOUT)
    try:
        reg = KazooRegistry(keeper_hosts, root, client=client)
        reg.ensure_job(JOB, {"target": "t"})
        reg.close()
        assert client.connected
        assert client.exists(f"{root}/jobs/{JOB}") is not None
    finally:
        client.stop()
        client.close()


def _expire_session(keeper_hosts: str, victim: KazooClient) -> None:
    """Expire ``victim``'s session for real: open a second connection on the same session
    (id + password) and close it; the server ends the session for both connections."""
    session_id, password = victim.client_id
    twin = KazooClient(hosts=keeper_hosts, client_id=(session_id, password), timeout=TIMEOUT)
    twin.start(timeout=TIMEOUT)
    twin.stop()
    twin.close()


def test_session_expiry_never_loses_a_fenced_write_silently(
    keeper_hosts: str, root: str, registry: KazooRegistry, raw_zk: KazooClient
) -> None:
    epoch = registry.take_epoch(JOB, "driver-a")
    prepared(registry, epoch, "x-1")
    old_session = registry._client.client_id[0]

    _expire_session(keeper_hosts, registry._client)

    unavailable: list[UnavailableError] = []
    stored = None
    deadline = time.monotonic() + 30
    while stored is None and time.monotonic() < deadline:
        try:
            stored = prepared(registry, epoch, "x-2", batch=2)
        except UnavailableError as exc:
            unavailable.append(exc)  # outcome unknown: re-run the idempotent step
            time.sleep(0.2)
        except XidExists as exc:  # an earlier attempt landed after all
            stored = exc.existing
    assert stored is not None, unavailable
    # The write that returned (or that a retry found) is really in ZooKeeper...
    assert raw_zk.exists(f"{root}/jobs/{JOB}/xids/x-2") is not None
    observer = KazooRegistry(keeper_hosts, root, timeout=TIMEOUT)
    try:
        assert observer.get(JOB, "x-2") == stored
    finally:
        observer.close()
    # ...on a new session, and the epoch (a persistent node) still fences correctly.
    registry.heartbeat(epoch, {"after": "expiry"})
    assert registry._client.client_id[0] != old_session
    done = registry.commit(epoch, stored, committed_at=9.0)
    assert done.state is XidState.COMMITTED
    assert all("txsink embedded status" in str(e) for e in unavailable)


def test_every_write_during_expiry_is_either_reported_or_really_landed(
    keeper_hosts: str, root: str, registry: KazooRegistry
) -> None:
    epoch = registry.take_epoch(JOB, "driver-a")
    old_session = registry._client.client_id[0]
    _expire_session(keeper_hosts, registry._client)
    outcomes: dict[str, object] = {}
    for i in range(30):  # writes straddle the expiry, the reconnect and the new session
        xid = f"x-{i}"
        try:
            outcomes[xid] = prepared(registry, epoch, xid, batch=i)
        except UnavailableError as exc:
            outcomes[xid] = exc
        except XidExists as exc:  # the step's own re-run found its lost write
            outcomes[xid] = exc.existing
        time.sleep(0.02)
    assert registry._client.client_id[0] != old_session
    unknown = [xid for xid, outcome in outcomes.items() if isinstance(outcome, UnavailableError)]
    for xid in unknown:
        # Unknown outcome: re-running the step finds the write or makes it, never both.
        try:
            outcomes[xid] = prepared(registry, epoch, xid, batch=int(xid[2:]))
        except XidExists as exc:
            outcomes[xid] = exc.existing
    # Every reported success, and every re-run, is exactly what ZooKeeper holds.
    assert {r.xid: r for r in registry.list(JOB)} == outcomes


def test_racing_takeovers_leave_exactly_one_writer(
    open_registry: Callable[[], Registry],
) -> None:
    drivers = [open_registry() for _ in range(3)]
    epochs = [reg.take_epoch(JOB, f"driver-{i}") for i, reg in enumerate(drivers)]
    outcomes = []
    for reg, epoch in zip(drivers, epochs, strict=True):
        try:
            prepared(reg, epoch, f"x-{epoch.number}", batch=epoch.number)
            outcomes.append("won")
        except FencedError:
            outcomes.append("fenced")
    assert outcomes == ["fenced", "fenced", "won"]
    assert [r.xid for r in drivers[0].list(JOB)] == ["x-3"]


# -- bounded nodes on the real ZooKeeper ---------------------------------------------------


def _chunk_paths(raw_zk: KazooClient, root: str) -> list[str]:
    parent = f"{root}/jobs/{JOB}/manifests"
    return sorted(f"{parent}/{n}" for n in raw_zk.get_children(parent))


def test_a_10000_entry_prepare_that_used_to_wedge_lands_and_its_replay_finds_it(
    registry: KazooRegistry, raw_zk: KazooClient, root: str
) -> None:
    # 200 tasks x 50 partitions: inline, this manifest is a 1.3 MB request; ZooKeeper
    # closed the connection and every replay of the batch raised CommitOutcomeUnknown.
    epoch = registry.take_epoch(JOB, "driver-a")
    record = grid_record("b9", tasks=200, partitions=50)
    assert len(record.manifest) == 10_000
    stored = registry.prepare(epoch, record)
    assert stored.manifest == record.manifest
    node, _ = raw_zk.get(f"{root}/jobs/{JOB}/xids/b9")
    assert len(node) < 4096  # the record itself stays small
    assert all(len(raw_zk.get(p)[0]) <= CHUNK_BYTES for p in _chunk_paths(raw_zk, root))
    with pytest.raises(XidExists) as info:  # the replay: no wedge
        registry.prepare(epoch, grid_record("b9", tasks=200, partitions=50))
    assert info.value.existing == stored
    done = registry.commit(epoch, stored, committed_at=7.0)
    assert [r.state for r in registry.list(JOB)] == [XidState.COMMITTED]
    assert registry.get(JOB, "b9") == done
    assert registry.ledger(JOB).rows == record.rows


def test_a_damaged_or_missing_chunk_fails_loudly_and_is_never_guessed(
    registry: KazooRegistry, raw_zk: KazooClient, root: str
) -> None:
    epoch = registry.take_epoch(JOB, "driver-a")
    registry.prepare(epoch, big_record("b1", entries=10_000))
    first, second, *_ = _chunk_paths(raw_zk, root)
    data, _ = raw_zk.get(first)
    raw_zk.set(first, data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(TxSinkError, match=r"xids/b1 cannot be read.*checksum differs"):
        registry.get(JOB, "b1")
    raw_zk.set(first, data)
    assert registry.get(JOB, "b1") is not None
    raw_zk.delete(second)
    with pytest.raises(TxSinkError, match=r"xids/b1 cannot be read.*of \d+ chunk"):
        registry.list(JOB)


def test_a_sweep_between_chunk_write_and_create_never_leaves_a_record_without_chunks(
    registry: KazooRegistry, monkeypatch: pytest.MonkeyPatch
) -> None:
    epoch = registry.take_epoch(JOB, "driver-a")
    stage = registry._stage_chunks
    staged: list[int] = []

    def stage_then_sweep(ep: Epoch, record: XidRecord) -> Any:
        packed = stage(ep, record)
        staged.append(len(packed.chunks))
        if len(staged) == 1:
            registry.delete(ep, [])  # a prune/recovery sweep: these chunks are orphans now
        return packed

    monkeypatch.setattr(registry, "_stage_chunks", stage_then_sweep)
    stored = registry.prepare(epoch, big_record("b1", entries=10_000))
    assert len(staged) == 2  # the create saw its chunks gone and wrote them again
    assert registry.get(JOB, "b1") == stored
    assert len(registry.manifest_chunks(JOB)) == staged[1]


def test_a_prepare_whose_reply_was_lost_is_found_by_the_rerun_and_orphans_are_swept(
    registry: KazooRegistry, monkeypatch: pytest.MonkeyPatch
) -> None:
    epoch = registry.take_epoch(JOB, "driver-a")
    # the job's xids node, made by its first prepare (a prepare into a missing one does
    # not land: it makes the node and runs again)
    registry._conn.ensure(registry._xid_path(JOB, "b1").rsplit("/", 1)[0])
    commit_txn = registry._conn.commit_txn

    def lands_but_reply_lost(ops: Any) -> Any:
        commit_txn(ops)
        raise KazooConnectionLoss()

    monkeypatch.setattr(registry._conn, "commit_txn", lands_but_reply_lost)
    # The step is re-run while Keeper is unavailable: the re-run finds its own record.
    with pytest.raises(XidExists) as own:
        registry.prepare(epoch, big_record("b1", entries=10_000))
    assert own.value.existing.manifest == big_record("b1", entries=10_000).manifest
    monkeypatch.undo()
    # A later re-run (a fresh nonce) finds the record the lost reply created, whole.
    with pytest.raises(XidExists) as info:
        registry.prepare(epoch, big_record("b1", entries=10_000, seed=5))
    assert info.value.existing.manifest == big_record("b1", entries=10_000).manifest
    live = registry.manifest_chunks(JOB)
    registry.delete(epoch, [])
    assert registry.manifest_chunks(JOB) == live  # nothing of the record was swept
    assert registry.get(JOB, "b1") == info.value.existing


def test_an_oversized_request_is_refused_instead_of_dropping_the_session(
    registry: KazooRegistry,
) -> None:
    session = registry._client.client_id
    with pytest.raises(KeeperRequestTooLarge, match=r"about \d+ bytes, over .* 1048575"):
        registry.ensure_job(JOB, {"target": "db.t", "notes": "x" * 1_100_000})
    assert registry._client.client_id == session and registry._client.connected
    assert registry.job_meta(JOB) is None


def test_nodes_written_before_format_versions_are_read_and_carried_forward(
    registry: KazooRegistry, raw_zk: KazooClient, root: str
) -> None:
    """A job in flight across the upgrade: its v0 nodes (tests/fixtures/state_v0), written
    straight into ZooKeeper, are read, amended and committed by this release; the
    rewritten nodes carry the format and keep a newer writer's facts."""
    fixtures = Path(__file__).resolve().parent.parent / "fixtures" / "state_v0"
    job = f"{root}/jobs/orders"
    prepared_v0 = json.loads((fixtures / "xid_prepared.json").read_bytes())
    prepared_v0["extra"]["quorum"] = {"acks": 3}  # a fact this release does not know
    raw_zk.create(job, (fixtures / "job_meta.json").read_bytes(), makepath=True)
    raw_zk.create(f"{job}/xids/b00000007", json.dumps(prepared_v0).encode(), makepath=True)
    raw_zk.create(f"{job}/xids/b00000010", (fixtures / "xid_chunked.json").read_bytes())
    for chunk in sorted(fixtures.glob("chunk_b00000010.*")):
        name = chunk.name.removeprefix("chunk_")
        raw_zk.create(f"{job}/manifests/{name}", chunk.read_bytes(), makepath=True)
    meta = registry.job_meta("orders")
    assert meta is not None and meta.targets == {"db.daily": "attach", "db.orders": "attach"}
    chunked = registry.get("orders", "b00000010")
    assert chunked is not None and len(chunked.manifest) == 1500
    record = registry.get("orders", "b00000007")
    assert record is not None and record.unknown == {"quorum": {"acks": 3}}
    epoch = registry.take_epoch("orders", "upgraded-driver")
    staging = record.manifest[1].table
    amended = registry.amend(epoch, record, [Cut(staging, "202402", {"ab" * 8: 1})])
    done = registry.commit(epoch, amended, 5.0)
    assert done.seq == 1 and done.cut(staging, "202402") == {"ab" * 8: 1}
    node = json.loads(raw_zk.get(f"{job}/xids/b00000007")[0])
    assert node["format"] == FORMAT and node["extra"]["quorum"] == {"acks": 3}
    assert json.loads(raw_zk.get(f"{job}/ledger")[0])["format"] == FORMAT
    assert json.loads(raw_zk.get(f"{job}/epoch")[0])["format"] == FORMAT


def test_a_node_of_a_newer_format_is_refused_naming_it(
    registry: KazooRegistry, raw_zk: KazooClient, root: str
) -> None:
    path = f"{root}/jobs/{JOB}/xids/b1"
    raw_zk.create(path, json.dumps({"format": FORMAT + 1, "xid": "b1"}).encode(), makepath=True)
    with pytest.raises(StateFormatTooNew, match=f"{path}.*upgrade txsink"):
        registry.get(JOB, "b1")


def test_a_dedup_record_of_a_forgotten_xid_makes_its_parent_again_with_the_job_acl(
    keeper_hosts: str, root: str, raw_zk: KazooClient
) -> None:
    """The parent ``dedup/<xid>`` is made together with the first record (one multi-op);
    deleted by another session (the xid forgotten after its commit) while this one still
    remembers making it, the next record makes it again."""
    writer = KazooRegistry(keeper_hosts, root, auth=AUTH, timeout=TIMEOUT)
    driver = KazooRegistry(keeper_hosts, root, auth=AUTH, timeout=TIMEOUT)
    try:
        writer.ensure_job(JOB, {"target": "db.events"})
        assert writer.cas_blob(JOB, "dedup/x-1/p0", {"status": "BEFORE"}, CREATE) == 0
        parent = f"{root}/jobs/{JOB}/dedup/x-1"
        acl, _ = raw_zk.get_acls(parent)
        assert {(a.id.scheme, a.id.id.split(":")[0], a.perms) for a in acl} == {
            ("digest", "alice", Permissions.ALL),
            ("world", "anyone", Permissions.READ),
        }
        driver.delete_blobs(JOB, "dedup/x-1")  # forgotten by another session
        assert raw_zk.exists(parent) is None
        assert writer.cas_blob(JOB, "dedup/x-1/p1", {"status": "BEFORE"}, CREATE) == 0
        assert writer.cas_blob(JOB, "dedup/x-1/p2", {"status": "BEFORE"}, CREATE) == 0
        assert sorted(raw_zk.get_children(parent)) == ["p1", "p2"]
        assert writer.get_blob_versioned(JOB, "dedup/x-1/p1") is not None
    finally:
        writer.close()
        driver.close()
