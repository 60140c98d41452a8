"""The Registry contract on the ``state=clickhouse`` store: Keeper nodes in a KeeperMap
table, reached only through ClickHouse SQL (the embedded chdb engine, whose config names
the stack's ZooKeeper and a ``keeper_map_path_prefix``), plus what only KeeperMap has:
rows an UPDATE skips silently, the server's own retries, unconfirmed (pending) rows.

Every test works under its own root in one shared table, so tests never collide.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from kazoo.exceptions import (
    BadVersionError,
    ConnectionLoss,
    NodeExistsError,
    NoNodeError,
    NotEmptyError,
)

from tests.registry_contract import JOB, RegistryContract, TombstoneContract, prepared
from txsink.embedded.stack import StackInfo
from txsink.errors import FencedError, RetryableConflict, TxSinkError, UnavailableError
from txsink.keeper import keepermap
from txsink.keeper.keepermap import KeeperMapNodes, Op, keepermap_registry
from txsink.ports.registry import Registry
from txsink.protocol.states import XidState

pytestmark = pytest.mark.integration

DATABASE = "txsink_state_test"


def connect(stack: StackInfo) -> Any:
    from txsink.clickhouse.client import connect as ch_connect

    return ch_connect(stack.url)


@pytest.fixture
def root() -> str:
    return f"/txsink-test-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def open_registry(stack: StackInfo, root: str) -> Iterator[Callable[[], Registry]]:
    """Opens registries (each its own HTTP client: a driver) on the test's root."""
    opened: list[Any] = []

    def open_one() -> Registry:
        reg = keepermap_registry(connect(stack), DATABASE, root, timeout=10.0, retry_s=5.0)
        opened.append(reg)
        return reg

    yield open_one
    for reg in opened:
        reg.close()


@pytest.fixture
def registry(open_registry: Callable[[], Registry]) -> Registry:
    return open_registry()


class TestRegistryContractOnKeeperMap(RegistryContract, TombstoneContract):
    """Every contract invariant of tests/registry_contract.py, on KeeperMap."""


# -- KeeperMap only ---------------------------------------------------------------------


class Faulty:
    """The real client, with a hook around each write: ``before(sql)`` runs first (another
    actor acting at that moment), ``after(sql)`` once the write landed (its reply lost)."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.url = real.url
        self.before: Callable[[str], None] = lambda sql: None
        self.after: Callable[[str], None] = lambda sql: None

    def command(self, sql: str, **kwargs: Any) -> Any:
        self.before(sql)
        out = self.real.command(sql, **kwargs)
        self.after(sql)
        return out

    def query_rows(self, sql: str, **kwargs: Any) -> Any:
        return self.real.query_rows(sql, **kwargs)

    def close(self) -> None:
        self.real.close()


def once(kind: str, error: Exception) -> Callable[[str], None]:
    """Raise ``error`` the first time a statement starting with ``kind`` runs."""
    fired: list[bool] = []

    def hook(sql: str) -> None:
        if sql.startswith(kind) and not fired:
            fired.append(True)
            raise error

    return hook


@pytest.fixture
def faulty(stack: StackInfo, root: str) -> Iterator[tuple[Faulty, Registry]]:
    client = Faulty(connect(stack))
    registry = keepermap_registry(client, DATABASE, root, timeout=10.0, retry_s=5.0)
    yield client, registry
    registry.close()


BAD_VERSION = TxSinkError("Transaction failed (Bad version): Op #0 (KEEPER_EXCEPTION)", code=999)
NODE_EXISTS = TxSinkError("Transaction failed (Node exists): Op #0 (KEEPER_EXCEPTION)", code=999)


def test_a_transaction_that_landed_but_came_back_bad_version_is_reported_as_done(
    stack: StackInfo, root: str
) -> None:
    # the server retried the UPDATE after a connection loss; the retry saw the rows
    # changed (by the first try) and said "Bad version": the write is ours, it landed
    client = Faulty(connect(stack))
    nodes = KeeperMapNodes(client, DATABASE)
    try:
        nodes.ensure_path_async(root).get()
        nodes.commit_or_raise([Op("create", f"{root}/epoch", b"1")])
        client.after = once("ALTER TABLE", BAD_VERSION)
        done = nodes.commit(
            [Op("check", f"{root}/epoch", version=0), Op("create", f"{root}/x", b"rec"),
             Op("set", f"{root}/epoch", b"2", version=0)]
        )  # fmt: skip
        assert not any(isinstance(r, Exception) for r in done), done
        assert nodes.get_async(f"{root}/x").get()[0] == b"rec"
        assert nodes.get_async(f"{root}/epoch").get()[1].version == 1
    finally:
        nodes.close()


def test_an_insert_that_landed_but_came_back_node_exists_is_reported_as_done(
    stack: StackInfo, root: str
) -> None:
    client = Faulty(connect(stack))
    nodes = KeeperMapNodes(client, DATABASE)
    try:
        nodes.ensure_path_async(root).get()
        client.after = once("INSERT INTO", NODE_EXISTS)
        assert nodes.create_async(f"{root}/x", b"rec").get() == f"{root}/x"
        assert nodes.get_async(f"{root}/x").get()[0] == b"rec"
    finally:
        nodes.close()


def test_a_commit_whose_reply_was_lost_counts_once_in_the_ledger(
    faulty: tuple[Faulty, Registry],
) -> None:
    # the connection to ClickHouse dropped after the commit landed: the outcome is unknown,
    # the registry's step re-reads and finds the xid COMMITTED by its own epoch
    client, registry = faulty
    epoch = registry.take_epoch(JOB, "driver-a")
    record = prepared(registry, epoch, "x-1")
    client.after = once("ALTER TABLE", UnavailableError("connection reset (reply lost)"))
    with pytest.raises((UnavailableError, RetryableConflict)):
        registry.commit(epoch, record, committed_at=5.0)
    now = registry.get(JOB, "x-1")
    assert now is not None and now.state is XidState.COMMITTED
    assert registry.ledger(JOB).committed == 1
    with pytest.raises(RetryableConflict):  # a blind retry at the old version cannot count twice
        registry.commit(epoch, record, committed_at=6.0)
    assert registry.ledger(JOB).committed == 1


def test_a_row_deleted_between_the_read_and_the_update_is_an_error_not_a_success(
    stack: StackInfo, root: str
) -> None:
    # an UPDATE skips missing rows silently: without the read-back these sets "succeed"
    client = Faulty(connect(stack))
    nodes = KeeperMapNodes(client, DATABASE)
    other = connect(stack)
    try:
        nodes.ensure_path_async(root).get()
        for name in ("a", "b"):
            nodes.commit_or_raise([Op("create", f"{root}/{name}", b"0")])

        def delete_b(sql: str) -> None:
            if sql.startswith("ALTER TABLE"):
                other.command(f"DELETE FROM {DATABASE}.nodes WHERE key = '{root}/b'")

        client.before = delete_b
        with pytest.raises(TxSinkError, match="vanished"):  # two rows: it applied partly
            nodes.commit([Op("set", f"{root}/a", b"1"), Op("set", f"{root}/b", b"1")])
        client.before = lambda sql: None
        nodes.commit_or_raise([Op("create", f"{root}/b", b"0")])
        client.before = delete_b
        with pytest.raises(NoNodeError):  # one row: nothing applied, as Keeper says it
            nodes.commit_or_raise([Op("set", f"{root}/b", b"2")])
    finally:
        other.close()
        nodes.close()


def test_transactions_that_only_check_a_row_another_rewrites_are_not_refused(
    stack: StackInfo, root: str
) -> None:
    # KeeperMap's UPDATE rewrites every row it names, checked ones too: two writers that
    # both only check the epoch row collide inside Keeper; neither may be told it lost
    import threading

    nodes = [KeeperMapNodes(connect(stack), DATABASE) for _ in range(2)]
    try:
        nodes[0].ensure_path_async(root).get()
        nodes[0].commit_or_raise([Op("create", f"{root}/epoch", b"e")])
        for i in range(2):
            nodes[0].commit_or_raise([Op("create", f"{root}/n{i}", b"0")])
        errors: list[BaseException] = []

        def run(i: int) -> None:
            for k in range(40):
                try:
                    nodes[i].commit_or_raise(
                        [Op("check", f"{root}/epoch", version=0),
                         Op("set", f"{root}/n{i}", str(k).encode())]
                    )  # fmt: skip
                except BaseException as exc:
                    errors.append(exc)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert errors == []
        assert [nodes[0].get_async(f"{root}/n{i}").get()[1].version for i in range(2)] == [40, 40]
    finally:
        for n in nodes:
            n.close()


def test_an_interrupted_absence_proof_leaves_nothing_that_blocks_the_node(
    stack: StackInfo, root: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the chunk sweep proves an xid has no record by creating and deleting its node in one
    # transaction; stopped between the two, it must not leave a node that blocks a prepare
    # (the next create waits out the dead creator's row: 1 s here, not 15)
    monkeypatch.setattr(keepermap, "PENDING_STALE_S", 1.0)
    client = Faulty(connect(stack))
    nodes = KeeperMapNodes(client, DATABASE)
    try:
        nodes.ensure_path_async(root).get()
        client.before = once("DELETE FROM", UnavailableError("the driver died here"))
        with pytest.raises(ConnectionLoss):
            nodes.commit([Op("create", f"{root}/x"), Op("delete", f"{root}/x")])
        client.before = lambda sql: None
        assert nodes.exists_async(f"{root}/x").get() is None
        assert nodes.create_async(f"{root}/x", b"record").get() == f"{root}/x"
        assert nodes.get_async(f"{root}/x").get()[0] == b"record"
    finally:
        nodes.close()


def test_a_node_of_half_a_mebibyte_is_written_by_update_too(stack: StackInfo, root: str) -> None:
    # the value travels hex-encoded inside the statement (twice its size)
    nodes = KeeperMapNodes(connect(stack), DATABASE)
    try:
        nodes.ensure_path_async(root).get()
        big = bytes(range(256)) * 2048  # 512 KiB
        nodes.commit_or_raise([Op("create", f"{root}/big", b"0")])
        nodes.commit_or_raise([Op("set", f"{root}/big", big, version=0)])
        assert nodes.get_async(f"{root}/big").get()[0] == big
    finally:
        nodes.close()


def test_an_unconfirmed_row_of_a_creator_that_died_is_invisible_and_taken_over(
    stack: StackInfo, registry: Registry, root: str
) -> None:
    epoch = registry.take_epoch(JOB, "driver-a")
    key = f"{root}/jobs/{JOB}/xids/x-1"
    other = connect(stack)
    other.command(  # what a creator leaves when it dies between its INSERT and its UPDATE
        f"INSERT INTO {DATABASE}.nodes VALUES ('{key}', '{{}}', 0, 1, 'dead-tx', 'dead-tx')",
        settings={"keeper_map_strict_mode": 1},
    )
    other.close()
    assert registry.get(JOB, "x-1") is None
    assert registry.list(JOB) == []
    record = prepared(registry, epoch, "x-1")
    assert registry.get(JOB, "x-1") == record


def test_a_zombie_whose_prepare_raced_a_takeover_never_lands(
    faulty: tuple[Faulty, Registry], open_registry: Callable[[], Registry]
) -> None:
    # the zombie's rows are inserted (pending); a new writer takes the epoch before the
    # zombie's confirming UPDATE: the guard on the epoch row refuses it, nothing shows
    client, zombie = faulty
    old = zombie.take_epoch(JOB, "driver-a")
    successor = open_registry()

    def take_over(sql: str) -> None:
        if sql.startswith("ALTER TABLE") and "x-1" in sql:
            successor.take_epoch(JOB, "driver-b")

    client.before = take_over
    with pytest.raises(FencedError):
        prepared(zombie, old, "x-1")
    assert successor.get(JOB, "x-1") is None
    assert zombie.get(JOB, "x-1") is None


# -- one statement where one is enough (issue 29) ----------------------------------------


class Counting(Faulty):
    """:class:`Faulty` that also counts every statement (reads and writes)."""

    def __init__(self, real: Any) -> None:
        super().__init__(real)
        self.statements: list[str] = []

    def command(self, sql: str, **kwargs: Any) -> Any:
        self.statements.append(sql)
        return super().command(sql, **kwargs)

    def query_rows(self, sql: str, **kwargs: Any) -> Any:
        self.statements.append(sql)
        return super().query_rows(sql, **kwargs)


def test_a_lone_create_is_one_statement_and_still_needs_its_parent(
    stack: StackInfo, root: str
) -> None:
    client = Counting(connect(stack))
    nodes = KeeperMapNodes(client, DATABASE)
    try:
        nodes.ensure_path_async(root).get()
        del client.statements[:]
        assert nodes.create_async(f"{root}/x", b"rec").get() == f"{root}/x"
        assert len(client.statements) == 1
        with pytest.raises(NoNodeError):  # as ZooKeeper: no parent, no node
            nodes.create_async(f"{root}/none/x", b"rec").get()
        assert nodes.exists_async(f"{root}/none/x").get() is None
        with pytest.raises(NodeExistsError):
            nodes.create_async(f"{root}/x", b"again").get()
        assert nodes.get_async(f"{root}/x").get()[0] == b"rec"
    finally:
        nodes.close()


def test_a_lone_create_takes_a_dead_creators_unconfirmed_row_over(
    stack: StackInfo, root: str
) -> None:
    nodes = KeeperMapNodes(connect(stack), DATABASE)
    try:
        nodes.ensure_path_async(root).get()
        nodes.commit([Op("create", f"{root}/x", b"x"), Op("delete", f"{root}/x")])
        other = connect(stack)  # a creator that died between its INSERT and its UPDATE
        other.command(
            f"INSERT INTO {DATABASE}.nodes VALUES ('{root}/y', 'dead', 0, 1, 'dead-tx', 'dead-tx')",
            settings={"keeper_map_strict_mode": 1},
        )
        other.close()
        assert nodes.exists_async(f"{root}/y").get() is None
        assert nodes.create_async(f"{root}/y", b"mine").get() == f"{root}/y"
        assert nodes.get_async(f"{root}/y").get()[0] == b"mine"
    finally:
        nodes.close()


def test_racing_lone_creates_of_one_node_make_exactly_one_winner(
    stack: StackInfo, root: str
) -> None:
    import threading

    nodes = [KeeperMapNodes(connect(stack), DATABASE) for _ in range(4)]
    try:
        nodes[0].ensure_path_async(root).get()
        won: list[int] = []
        lost: list[BaseException] = []

        def run(i: int) -> None:
            try:
                nodes[i].create_async(f"{root}/x", str(i).encode()).get()
                won.append(i)
            except NodeExistsError as exc:
                lost.append(exc)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert len(won) == 1 and len(lost) == 3
        assert nodes[0].get_async(f"{root}/x").get()[0] == str(won[0]).encode()
    finally:
        for n in nodes:
            n.close()


def test_a_lone_versioned_set_is_a_compare_and_set_without_a_read_first(
    stack: StackInfo, root: str
) -> None:
    client = Counting(connect(stack))
    nodes = KeeperMapNodes(client, DATABASE)
    try:
        nodes.ensure_path_async(root).get()
        nodes.create_async(f"{root}/x", b"0").get()
        del client.statements[:]
        assert nodes.set_async(f"{root}/x", b"1", version=0).get().version == 1
        assert len(client.statements) == 2  # the guarded UPDATE and its read-back
        with pytest.raises(BadVersionError):  # a stale version writes nothing
            nodes.set_async(f"{root}/x", b"stale", version=0).get()
        data, stat = nodes.get_async(f"{root}/x").get()
        assert (data, stat.version) == (b"1", 1)
        with pytest.raises(NoNodeError):
            nodes.set_async(f"{root}/none", b"1", version=0).get()
        assert nodes.exists_async(f"{root}/none").get() is None
    finally:
        nodes.close()


def test_a_lone_set_that_landed_but_came_back_bad_version_is_reported_as_done(
    stack: StackInfo, root: str
) -> None:
    client = Faulty(connect(stack))
    nodes = KeeperMapNodes(client, DATABASE)
    try:
        nodes.ensure_path_async(root).get()
        nodes.create_async(f"{root}/x", b"0").get()
        client.after = once("ALTER TABLE", BAD_VERSION)
        assert nodes.set_async(f"{root}/x", b"1", version=0).get().version == 1
        assert nodes.get_async(f"{root}/x").get()[0] == b"1"
    finally:
        nodes.close()


def test_a_lone_set_of_a_row_deleted_before_its_update_is_no_node_not_success(
    stack: StackInfo, root: str
) -> None:
    client = Faulty(connect(stack))
    nodes = KeeperMapNodes(client, DATABASE)
    other = connect(stack)
    try:
        nodes.ensure_path_async(root).get()
        nodes.create_async(f"{root}/x", b"0").get()

        def delete_x(sql: str) -> None:
            if sql.startswith("ALTER TABLE"):
                other.command(f"DELETE FROM {DATABASE}.nodes WHERE key = '{root}/x'")

        client.before = delete_x
        with pytest.raises(NoNodeError):
            nodes.set_async(f"{root}/x", b"1", version=0).get()
    finally:
        other.close()
        nodes.close()


def test_a_lone_set_racing_transactions_that_only_check_its_row_is_not_refused(
    stack: StackInfo, root: str
) -> None:
    # another transaction's UPDATE rewrites the row it checks (same version): Keeper
    # would take both, so the lone set is decided again, never refused
    import threading

    setter, checker = (KeeperMapNodes(connect(stack), DATABASE) for _ in range(2))
    try:
        setter.ensure_path_async(root).get()
        setter.create_async(f"{root}/x", b"0").get()
        setter.create_async(f"{root}/y", b"0").get()
        stop = threading.Event()

        def check_x() -> None:
            while not stop.is_set():
                version = checker.exists_async(f"{root}/x").get().version
                with contextlib.suppress(BadVersionError):
                    checker.commit_or_raise(
                        [Op("check", f"{root}/x", version=version), Op("set", f"{root}/y", b"y")]
                    )

        thread = threading.Thread(target=check_x)
        thread.start()
        try:
            for k in range(30):
                setter.set_async(f"{root}/x", str(k).encode(), version=k).get()
        finally:
            stop.set()
            thread.join(60)
        assert setter.get_async(f"{root}/x").get()[1].version == 30
    finally:
        setter.close()
        checker.close()


def test_a_remembered_parent_deleted_elsewhere_is_made_again_by_the_next_create(
    stack: StackInfo, root: str
) -> None:
    nodes = KeeperMapNodes(connect(stack), DATABASE)
    other = connect(stack)
    try:
        nodes.ensure_path_async(f"{root}/dir").get()
        other.command(f"DELETE FROM {DATABASE}.nodes WHERE startsWith(key, '{root}')")
        nodes.ensure_path_async(f"{root}/dir").get()  # remembered: no statement, no row
        assert nodes.create_async(f"{root}/dir/x", b"x").get() == f"{root}/dir/x"
        assert nodes.exists_async(f"{root}/dir").get() is not None
        assert nodes.get_async(f"{root}/dir/x").get()[0] == b"x"
    finally:
        other.close()
        nodes.close()


def test_reads_asked_together_are_one_select_and_see_writes_made_before_them(
    stack: StackInfo, root: str
) -> None:
    client = Counting(connect(stack))
    nodes = KeeperMapNodes(client, DATABASE)
    try:
        nodes.ensure_path_async(root).get()
        for i in range(5):
            nodes.create_async(f"{root}/n{i}", str(i).encode()).get()
        del client.statements[:]
        asked = [nodes.get_async(f"{root}/n{i}") for i in range(6)]
        assert [a.get()[0] for a in asked[:5]] == [str(i).encode() for i in range(5)]
        with pytest.raises(NoNodeError):
            asked[5].get()
        assert len(client.statements) == 1
        # a read asked before a write is answered as it was before the write (FIFO)
        early = nodes.get_async(f"{root}/n0")
        nodes.set_async(f"{root}/n0", b"new", version=0).get()
        assert early.get()[0] == b"0"
        assert nodes.get_async(f"{root}/n0").get()[0] == b"new"
    finally:
        nodes.close()


def test_listing_a_missing_node_is_no_node_and_an_empty_one_is_empty(
    stack: StackInfo, root: str
) -> None:
    nodes = KeeperMapNodes(connect(stack), DATABASE)
    try:
        nodes.ensure_path_async(f"{root}/empty").get()
        nodes.create_async(f"{root}/full", b"").get()
        nodes.create_async(f"{root}/full/a", b"").get()
        nodes.ensure_path_async(f"{root}/full/b/c").get()
        assert nodes.get_children_async(f"{root}/empty").get() == []
        assert nodes.get_children_async(f"{root}/full").get() == ["a", "b"]
        with pytest.raises(NoNodeError):
            nodes.get_children_async(f"{root}/missing").get()
    finally:
        nodes.close()


def test_racing_takeovers_each_get_their_own_epoch(open_registry: Callable[[], Registry]) -> None:
    # take_epoch is a lone compare-and-set on the epoch row (one guarded UPDATE, no read
    # first): under a race, no two writers may hold one number or one token
    import threading

    drivers = [open_registry() for _ in range(3)]
    drivers[0].take_epoch(JOB, "driver-0")
    barrier = threading.Barrier(len(drivers))
    taken: list[Any] = []

    def run(i: int) -> None:
        for _ in range(4):
            barrier.wait(timeout=30)
            taken.append(drivers[i].take_epoch(JOB, f"driver-{i}"))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(drivers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(taken) == 12
    assert len({e.number for e in taken}) == 12
    assert len({e.token for e in taken}) == 12
    assert drivers[0].current_epoch(JOB).number == 13


# -- concurrency and size (issue 38, row 8) ----------------------------------------------


def test_a_racing_creator_waits_for_a_create_in_flight_and_never_aborts_it(
    stack: StackInfo, root: str
) -> None:
    # Dedup tasks of one xid each create `dedup/<xid>` with their own record. Creator A
    # has inserted its rows unconfirmed; B comes before A confirms them. B must wait and
    # hear NodeExists once A confirms, not take A's row over (A's confirmation then
    # fails, A retries and takes B's over: racing creators abort each other until their
    # retries run out).
    import threading
    import time

    a_client, b_client = Faulty(connect(stack)), Counting(connect(stack))
    a, b = KeeperMapNodes(a_client, DATABASE), KeeperMapNodes(b_client, DATABASE)
    parent = f"{root}/dedup"
    racer: list[threading.Thread] = []
    b_results: list[Any] = []
    try:
        a.ensure_path_async(root).get()

        def b_creates() -> None:
            b_results.extend(b.commit([Op("create", parent), Op("create", f"{parent}/p1")]))

        def at_confirmation(sql: str) -> None:
            if not sql.startswith("ALTER TABLE") or racer:
                return
            del b_client.statements[:]
            racer.append(threading.Thread(target=b_creates))
            racer[0].start()
            # B read A's unconfirmed row and acted on it (a take-over, then its insert)
            # or waits (reads again): its third statement, or its end
            deadline = time.monotonic() + 30
            while len(b_client.statements) < 3 and racer[0].is_alive():
                assert time.monotonic() < deadline, b_client.statements
                time.sleep(0.005)

        a_client.before = at_confirmation
        a_results = a.commit([Op("create", parent, b"a"), Op("create", f"{parent}/p0")])
        racer[0].join(60)
        assert a_results == [parent, f"{parent}/p0"]
        assert isinstance(b_results[0], NodeExistsError), b_results
        assert a.get_async(parent).get()[0] == b"a"
    finally:
        a.close()
        b.close()


def test_racing_creators_of_one_missing_parent_all_create_their_children(
    open_registry: Callable[[], Registry],
) -> None:
    # the same, eight at once, through the registry (each retries as a task does)
    import threading

    from txsink.ports.registry import CREATE

    drivers = [open_registry() for _ in range(8)]
    drivers[0].take_epoch(JOB, "driver-0")
    barrier = threading.Barrier(len(drivers))
    failed: list[BaseException] = []

    def run(i: int) -> None:
        try:
            barrier.wait(timeout=30)
            drivers[i].cas_blob(JOB, f"dedup/x-1/p{i}", {"task": i}, CREATE)
        except BaseException as exc:
            failed.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(drivers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert failed == []
    assert drivers[0].blob_children(JOB, "dedup/x-1") == sorted(f"p{i}" for i in range(8))


def test_a_recursive_delete_of_more_rows_than_one_block_leaves_none(
    stack: StackInfo, root: str
) -> None:
    # ClickHouse's KeeperMap mutation returns after the first block it reads: one
    # DELETE over more rows than a block removes only a prefix of them (blocks of 100
    # rows here, so that a few thousand rows are many blocks)
    from txsink.clickhouse.client import connect as ch_connect

    nodes = KeeperMapNodes(ch_connect(stack.url, settings={"max_block_size": 100}), DATABASE)
    other = connect(stack)
    try:
        nodes.ensure_path_async(f"{root}/big").get()
        n = 3000
        other.command(
            f"INSERT INTO {DATABASE}.nodes SELECT '{root}/big/c' || toString(number), '', 0, "
            f"1, '', '' FROM numbers({n})",
            settings={"keeper_map_strict_mode": 1},
        )
        rows = f"SELECT count() FROM {DATABASE}.nodes WHERE startsWith(key, '{root}/')"
        assert other.query_rows(rows)[0][0] == n + 1  # big and its children
        nodes.delete(f"{root}/big", recursive=True)
        assert other.query_rows(rows)[0][0] == 0
    finally:
        other.close()
        nodes.close()


def test_a_transaction_of_versioned_checks_and_sets_is_one_update_and_its_read_back(
    stack: StackInfo, root: str
) -> None:
    """A commit's shape (the epoch checked, the record and ledger set at versions read
    before): no read first, a stale version still refuses it whole, and an UPDATE the
    server retried after it landed is reported done."""
    client = Counting(connect(stack))
    nodes = KeeperMapNodes(client, DATABASE)
    epoch, a, b = (f"{root}/{n}" for n in ("epoch", "a", "b"))
    try:
        nodes.ensure_path_async(root).get()
        for path in (epoch, a, b):
            nodes.commit_or_raise([Op("create", path, b"0")])
        del client.statements[:]
        done = nodes.commit(
            [Op("check", epoch, version=0), Op("set", a, b"1", version=0),
             Op("set", b, b"1", version=0)]
        )  # fmt: skip
        assert [getattr(r, "version", r) for r in done] == [True, 1, 1]
        assert len(client.statements) == 2, client.statements
        stale = nodes.commit(
            [Op("check", epoch, version=0), Op("set", a, b"2", version=1),
             Op("set", b, b"2", version=0)]
        )  # fmt: skip
        assert isinstance(stale[2], BadVersionError), stale
        assert [nodes.get_async(p).get()[0] for p in (a, b)] == [b"1", b"1"]  # nothing written
        client.after = once("ALTER TABLE", BAD_VERSION)
        done = nodes.commit([Op("check", epoch, version=0), Op("set", a, b"3", version=1)])
        assert not any(isinstance(r, Exception) for r in done), done
        assert nodes.get_async(a).get()[1].version == 2
    finally:
        nodes.close()


def test_a_prepare_shaped_transaction_reads_nothing_first_and_leaves_no_row_when_refused(
    stack: StackInfo, root: str
) -> None:
    """A prepare's shape (the epoch checked, a node proved absent by creating and
    deleting it, the record created): one INSERT of unconfirmed rows, the guarded UPDATE,
    its read-back and the DELETE. Refused (a stale epoch, the node present, a parent
    missing), it writes nothing and leaves no unconfirmed row to block the next create."""
    client = Counting(connect(stack))
    nodes = KeeperMapNodes(client, DATABASE)
    other = connect(stack)
    epoch, proof, rec = f"{root}/epoch", f"{root}/dedup/x", f"{root}/xids/x"

    def prepare(check: int, name: str = "x") -> list[Any]:
        proof, rec = f"{root}/dedup/{name}", f"{root}/xids/{name}"
        return nodes.commit(
            [Op("check", epoch, version=check), Op("create", proof), Op("delete", proof),
             Op("create", rec, b"rec")]
        )  # fmt: skip

    def rows_under(path: str) -> int:
        return int(
            other.command(f"SELECT count() FROM {DATABASE}.nodes WHERE startsWith(key, '{path}')")
        )

    try:
        for path in (root, f"{root}/dedup", f"{root}/xids"):
            nodes.ensure_path_async(path).get()
        nodes.commit_or_raise([Op("create", epoch, b"1")])
        del client.statements[:]
        assert not any(isinstance(r, Exception) for r in prepare(0))
        assert len(client.statements) == 4, client.statements
        assert nodes.get_async(rec).get()[0] == b"rec"
        assert nodes.exists_async(proof).get() is None and rows_under(proof) == 0
        nodes.commit_or_raise([Op("set", epoch, b"2", version=0)])  # a takeover
        assert isinstance(prepare(0, "y")[0], BadVersionError)  # fenced
        nodes.commit_or_raise([Op("create", f"{root}/dedup/z", b"")])
        assert isinstance(prepare(1, "z")[1], NodeExistsError)  # the node is there
        assert rows_under(f"{root}/xids/y") == rows_under(f"{root}/xids/z") == 0
        missing = nodes.commit([Op("check", epoch, version=1), Op("create", f"{root}/no/w")])
        assert isinstance(missing[1], NoNodeError), missing
        client.after = once("INSERT INTO", NODE_EXISTS)  # the server retried it: ours
        assert not any(isinstance(r, Exception) for r in prepare(1, "v"))
        assert nodes.get_async(f"{root}/xids/v").get()[0] == b"rec"
        # another creator took the proof row over after the UPDATE confirmed the record
        # (the DELETE of our row is refused): the proof held when it counted, it stands
        client.after = lambda sql: None
        client.before = once("DELETE FROM", BAD_VERSION)
        assert not any(isinstance(r, Exception) for r in prepare(1, "u"))
        assert nodes.get_async(f"{root}/xids/u").get()[0] == b"rec"
        client.before = lambda sql: None
        # a lone delete refuses a node with children, as ZooKeeper does
        nodes.commit_or_raise([Op("create", f"{root}/dedup/t", b"")])
        nodes.commit_or_raise([Op("create", f"{root}/dedup/t/p0", b"")])
        with pytest.raises(NotEmptyError):
            nodes.delete_async(f"{root}/dedup/t").get()
        assert nodes.exists_async(f"{root}/dedup/t").get() is not None
    finally:
        other.close()
        nodes.close()


def test_a_child_made_while_its_parent_is_deleted_puts_the_parent_back_refused(
    stack: StackInfo, root: str
) -> None:
    """KeeperMap rows have no hierarchy: a child created between the delete's scan for
    children and its DELETE would be orphaned. The delete looks again after it, puts the
    node back and is refused, as ZooKeeper refuses a node with children."""
    client = Faulty(connect(stack))
    nodes = KeeperMapNodes(client, DATABASE)
    other = KeeperMapNodes(connect(stack), DATABASE)
    parent = f"{root}/dedup/x"
    try:
        nodes.ensure_path_async(parent).get()

        def child_first(sql: str) -> None:
            if sql.startswith("DELETE FROM"):
                client.before = lambda sql: None
                other.create_async(f"{parent}/p0", b"state").get()

        client.before = child_first
        with pytest.raises(NotEmptyError):
            nodes.delete_async(parent).get()
        assert nodes.exists_async(parent).get() is not None
        assert nodes.get_children_async(parent).get() == ["p0"]
    finally:
        other.close()
        nodes.close()
