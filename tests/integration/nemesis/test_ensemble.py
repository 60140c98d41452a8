"""Keeper as a real three-member ZooKeeper ensemble under a commit (issue 23): the leader
killed in the middle of a prepare or a commit, a follower cut off from its leader while
txsink's session stays on it (its reads lag, then it rejoins), a session moving to another
member. Real ZooKeeper quorum (``tests/nemesis/ensemble.py``), real engine (the shared
stack's ClickHouse endpoint), the real Transactor on the real KazooRegistry.

The invariant: each test ends exact. The target holds every produced row once
(``count() == uniqExact(id) ==`` rows), the xid is COMMITTED, and a new run's recovery
finds no PREPARED xid.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.integration.conftest import client_for
from tests.integration.nemesis.test_keeper_faults import at
from tests.integration.test_rollback_races import counts, stage
from tests.nemesis.ensemble import SIDS, Ensemble
from txsink.config import WriterConfig
from txsink.driver import JobHandle, open_job
from txsink.embedded.stack import StackInfo
from txsink.errors import FencedError
from txsink.protocol.states import XidState


@pytest.fixture(scope="module")
def ensemble(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Ensemble]:
    with Ensemble(tmp_path_factory.mktemp("zk-ensemble")) as started:
        yield started


@pytest.fixture
def quorum(ensemble: Ensemble) -> Iterator[Ensemble]:
    """The ensemble, whole again after the test: links healed, killed members restarted."""
    yield ensemble
    ensemble.heal()
    for sid in SIDS:
        if ensemble.members[sid].proc is None:
            ensemble.start_member(sid, wait=False)
    ensemble.wait_serving(SIDS)


@pytest.fixture
def ch(stack: StackInfo) -> Iterator[Any]:
    client = client_for(stack)
    yield client
    client.close()


@pytest.fixture
def target(ch: Any) -> Iterator[str]:
    db = f"zk_{uuid.uuid4().hex[:10]}"
    ch.command(f"CREATE DATABASE {db}")
    ch.command(
        f"CREATE TABLE {db}.t (id Int64, p UInt8) ENGINE = MergeTree PARTITION BY p ORDER BY id"
    )
    yield f"{db}.t"
    with contextlib.suppress(Exception):
        ch.command(f"DROP DATABASE IF EXISTS {db} SYNC")


def open_handle(stack: StackInfo, keeper: str, target: str, **options: str) -> JobHandle:
    config = WriterConfig.from_options(
        {
            "url": stack.url,
            "keeper": keeper,
            "table": target,
            "job": f"ens-{uuid.uuid4().hex[:8]}",
            "keeper_timeout": "5",
            **options,
        }
    )
    handle = open_job(config)
    handle.warehouse.ensure_staging_db()
    return handle


def assert_exact(stack: StackInfo, keeper: str, ch: Any, target: str, job: str, rows: int) -> None:
    """Every row once, the batch COMMITTED, and a new run's recovery leaves no PREPARED."""
    assert counts(ch, target) == (rows, rows)
    check = open_handle(stack, keeper, target, job=job)
    try:
        check.transactor.begin("run-check")
        records = check.registry.list(job)
        assert [r.xid for r in records if r.state is XidState.PREPARED] == []
        assert any(r.xid == "b1" and r.state is XidState.COMMITTED for r in records)
        assert counts(ch, target) == (rows, rows)
    finally:
        check.close()


def later(seconds: float, action: Callable[[], object]) -> threading.Thread:
    def run() -> None:
        time.sleep(seconds)
        action()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize(
    "point",
    [
        "driver.before_prepare",  # (a) the prepare meets the election
        "driver.after_commit",  # (b) moved; recording COMMITTED meets the election
    ],
)
def test_the_leader_killed_under_a_commit_costs_an_election_and_the_batch_is_exact(
    quorum: Ensemble, stack: StackInfo, ch: Any, target: str, point: str
) -> None:
    handle = open_handle(stack, quorum.hosts, target)
    try:
        tx = handle.transactor
        epoch = tx.begin("run-1")
        parts = stage(handle, "b1", "0000000a", range(0, 300))
        killed: list[int] = []

        def kill_leader() -> None:
            killed.append(quorum.leader())
            quorum.kill(killed[0])

        tx.fault = at(point, kill_leader)
        result = tx.commit_batch(epoch, "b1", 1, target, parts, streaming=True)
        assert killed, f"the fault hook never reached {point}"
        assert result.action in ("committed", "rolled_forward")
        assert quorum.leader() != killed[0]  # a new leader was elected meanwhile
        job = handle.config.job
    finally:
        handle.close()
    assert_exact(stack, quorum.hosts, ch, target, job, 300)


def test_a_follower_cut_off_from_its_leader_lags_then_rejoins_and_the_commit_is_exact(
    quorum: Ensemble, stack: StackInfo, ch: Any, target: str
) -> None:
    """(c) The writer's session is pinned to one follower. At the prepare that follower is
    cut off from the leader: it still answers reads, from its old tree (the control: a
    blob written on the leader meanwhile is not there), cannot forward the prepare, drops
    its clients once ``syncLimit`` passes, and rejoins when the link heals."""
    lead = quorum.leader()
    follower = quorum.followers()[0]
    handle = open_handle(stack, quorum.members[follower].address, target)
    job = handle.config.job
    other = open_handle(stack, quorum.members[lead].address, target, job=job)
    seen: dict[str, Any] = {}
    try:
        tx = handle.transactor
        epoch = tx.begin("run-1")
        parts = stage(handle, "b1", "0000000a", range(0, 200))

        def cut_off() -> None:
            quorum.cut(follower, lead)
            other.registry.put_blob(job, "probe", {"written": "on the leader"})
            seen["stale"] = handle.registry.get_blob(job, "probe")
            seen["healer"] = later(3.0, quorum.heal)

        tx.fault = at("driver.before_prepare", cut_off)
        started = time.monotonic()
        result = tx.commit_batch(epoch, "b1", 1, target, parts, streaming=True)
        took = time.monotonic() - started
        seen["healer"].join(30)
        assert seen["stale"] is None  # the control: the cut-off follower served a stale read
        assert handle.registry.get_blob(job, "probe") == {"written": "on the leader"}
        assert result.action in ("committed", "rolled_forward")
        assert took >= 2.5  # it really waited for the follower to rejoin
    finally:
        handle.close()
        other.close()
    assert_exact(stack, quorum.hosts, ch, target, job, 200)


def test_a_superseded_writer_on_a_cut_off_follower_is_fenced_not_shown_its_old_epoch(
    quorum: Ensemble, stack: StackInfo, ch: Any, target: str
) -> None:
    """(c) The lagging follower shows the old writer its own epoch after a new run took the
    job on the leader (the control); the fence check syncs first, so it waits for the
    follower to catch up and answers FencedError. The new run's replay ends exact."""
    lead = quorum.leader()
    follower = quorum.followers()[0]
    old = open_handle(stack, quorum.members[follower].address, target)
    job = old.config.job
    new = open_handle(stack, quorum.members[lead].address, target, job=job)
    try:
        epoch = old.transactor.begin("run-1")
        stage(old, "b1", "0000000a", range(0, 100))
        quorum.cut(follower, lead)
        epoch2 = new.transactor.begin("run-2")  # its recovery rolls run-1's staging back
        stale = old.registry.current_epoch(job)
        assert stale is not None and stale.owner == "run-1"  # the control
        healer = later(3.0, quorum.heal)
        with pytest.raises(FencedError):
            old.transactor._check_fence(epoch)
        healer.join(30)
        replay = stage(new, "b1", "0000000b", range(0, 100))
        result = new.transactor.commit_batch(epoch2, "b1", 1, target, replay, streaming=True)
        assert result.action == "committed"
    finally:
        old.close()
        new.close()
    assert_exact(stack, quorum.hosts, ch, target, job, 100)


def test_a_session_moved_to_another_member_mid_commit_keeps_going_and_the_batch_is_exact(
    quorum: Ensemble, stack: StackInfo, ch: Any, target: str
) -> None:
    """(d) The member holding the writer's session is killed after the prepare: kazoo
    moves the same session to another member (which has seen everything the session
    saw), and the publish and the COMMITTED record go on through it."""
    handle = open_handle(stack, quorum.hosts, target)
    try:
        tx = handle.transactor
        epoch = tx.begin("run-1")
        parts = stage(handle, "b1", "0000000a", range(0, 300))
        client = handle.registry._conn.client  # type: ignore[attr-defined]
        session = client.client_id[0]
        moved: list[int | None] = []

        def kill_its_member() -> None:
            moved.append(quorum.session_member(session))
            assert moved[0] is not None
            quorum.kill(moved[0])

        tx.fault = at("driver.after_prepare", kill_its_member)
        result = tx.commit_batch(epoch, "b1", 1, target, parts, streaming=True)
        assert moved, "the fault hook never fired"
        assert result.action in ("committed", "rolled_forward")
        assert client.client_id[0] == session  # the same session, not a new one
        now_on = quorum.session_member(session)
        assert now_on is not None and now_on != moved[0]
        job = handle.config.job
    finally:
        handle.close()
    assert_exact(stack, quorum.hosts, ch, target, job, 300)
