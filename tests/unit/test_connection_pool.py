"""The per-process pool of Keeper and ClickHouse connections (txsink.driver):
Spark reuses Python workers, so a task or commit borrows what an earlier one opened.
What must hold: a borrower has its object alone; an object whose borrower raised, or that
is no longer usable, is closed and never lent again; a forked child never touches its
parent's objects; different credentials never share a connection."""

from __future__ import annotations

import os
import threading
from typing import Any

import pytest

from txsink import driver
from txsink.config import WriterConfig


class Conn:
    opened = 0

    def __init__(self) -> None:
        Conn.opened += 1
        self.closed = False
        self.ok = True

    def reusable(self) -> bool:
        return self.ok and not self.closed

    def close(self) -> None:
        self.closed = True


@pytest.fixture(autouse=True)
def empty_pool() -> Any:
    driver.close_pooled()
    Conn.opened = 0
    yield
    driver.close_pooled()


def borrow(key: tuple[Any, ...] = ("k",)) -> Any:
    return driver._borrowed(key, lambda c: c.reusable(), Conn)


def test_a_connection_given_back_is_lent_again() -> None:
    with borrow() as first:
        pass
    with borrow() as second:
        assert second is first and not second.closed
    assert Conn.opened == 1


def test_a_connection_whose_borrower_raised_is_closed_and_never_lent_again() -> None:
    with pytest.raises(RuntimeError), borrow() as broken:
        raise RuntimeError("reply lost")
    assert broken.closed
    with borrow() as fresh:
        assert fresh is not broken
    assert Conn.opened == 2


def test_an_unusable_idle_connection_is_closed_and_replaced() -> None:
    with borrow() as first:
        pass
    first.ok = False  # e.g. its Keeper session is down
    with borrow() as second:
        assert second is not first
    assert first.closed


def test_concurrent_borrowers_never_share_and_at_most_max_idle_are_kept() -> None:
    n = driver._MAX_IDLE + 2
    barrier = threading.Barrier(n)
    seen: list[Any] = []

    def work() -> None:
        with borrow() as conn:
            seen.append(conn)
            barrier.wait(timeout=10)

    threads = [threading.Thread(target=work) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({id(c) for c in seen}) == n  # all held at once: all distinct
    assert sum(c.closed for c in seen) == n - driver._MAX_IDLE


def test_a_forked_child_opens_its_own_and_leaves_the_parents_alone() -> None:
    with borrow() as parent_conn:
        pass
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        try:
            with borrow() as child_conn:
                same = child_conn is parent_conn
            os.write(write, b"same" if same or parent_conn.closed else b"own!")
        finally:
            os._exit(0)
    os.close(write)
    answer = os.read(read, 4)
    os.waitpid(pid, 0)
    assert answer == b"own!"
    assert not parent_conn.closed
    with borrow() as again:
        assert again is parent_conn


def options(**extra: str) -> dict[str, str]:
    return {
        "url": "http://127.0.0.1:1",
        "keeper": "127.0.0.1:1",
        "table": "db.t",
        "job": "j",
        **extra,
    }


def test_connections_of_different_credentials_or_endpoints_are_never_shared() -> None:
    base = WriterConfig.from_options(options(user="alice", password="a"))
    keys = {
        driver._client_key(base),
        driver._client_key(WriterConfig.from_options(options(user="alice", password="b"))),
        driver._client_key(WriterConfig.from_options(options(user="bob", password="a"))),
        driver._client_key(WriterConfig.from_options({**options(), "url": "http://h:2"})),
    }
    assert len(keys) == 4
    assert driver._registry_key(base) != driver._registry_key(
        WriterConfig.from_options(options(keeper_auth="u:p"))
    )
    # what changes per save does not split the pool
    assert driver._client_key(base) == driver._client_key(
        WriterConfig.from_options(options(user="alice", password="a", txn_version="7"))
    )


def test_a_child_forked_during_a_loan_never_pools_the_parents_connection() -> None:
    class Conn:
        def close(self) -> None:
            pass

    driver.close_pooled()
    r, w = os.pipe()
    with driver._borrowed(("fork-test",), lambda c: True, Conn) as parent_conn:
        pid = os.fork()
    if pid == 0:  # the child left the block normally, as if its loan were its own
        try:
            with driver._borrowed(("fork-test",), lambda c: True, Conn) as c:
                os.write(w, b"SAME" if c is parent_conn else b"own!")
        finally:
            os._exit(0)
    os.close(w)
    answer = os.read(r, 4)
    os.waitpid(pid, 0)
    assert answer == b"own!"
