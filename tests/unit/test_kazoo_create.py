"""KazooConn.create on a scripted kazoo client: a node whose parent is missing is created
with it in one multi-op, and a parent deleted after this session made it (a dedup record's
``dedup/<xid>``, forgotten once the xid committed) is made again, never trusted from the
cache of known paths."""

from __future__ import annotations

from typing import Any

import pytest
from kazoo.exceptions import NodeExistsError, NoNodeError, RolledBackError

from txsink.keeper.kazoo_conn import KazooConn


class Done:
    def __init__(self, value: Any = None, error: BaseException | None = None) -> None:
        self.value, self.error = value, error

    def get(self, timeout: float | None = None) -> Any:
        if self.error is not None:
            raise self.error
        return self.value


class Txn:
    def __init__(self, zk: FakeZk) -> None:
        self.zk = zk
        self.ops: list[str] = []

    def create(self, path: str, data: bytes, acl: Any = None) -> None:
        self.ops.append(path)

    def commit_async(self) -> Done:
        self.zk.calls.append(f"multi {' '.join(self.ops)}")
        for i, path in enumerate(self.ops):
            error = self.zk.refusal(path, made=self.ops[:i])
            if error is not None:
                out: list[Any] = [RolledBackError() for _ in self.ops]
                out[i] = error
                return Done(out)
        self.zk.nodes.update(self.ops)
        return Done(list(self.ops))


class FakeZk:
    def __init__(self, nodes: set[str]) -> None:
        self.nodes = set(nodes)
        self.calls: list[str] = []

    def refusal(self, path: str, made: tuple[str, ...] | list[str] = ()) -> BaseException | None:
        if path in self.nodes or path in made:
            return NodeExistsError()
        parent = path.rsplit("/", 1)[0]
        if parent and parent not in self.nodes and parent not in made:
            return NoNodeError()
        return None

    def create_async(self, path: str, data: bytes, acl: Any = None) -> Done:
        self.calls.append(f"create {path}")
        error = self.refusal(path)
        if error is None:
            self.nodes.add(path)
        return Done(path, error)

    def transaction(self) -> Txn:
        return Txn(self)

    def ensure_path_async(self, path: str, acl: Any = None) -> Done:
        self.calls.append(f"ensure {path}")
        parts = path.strip("/").split("/")
        self.nodes.update("/" + "/".join(parts[: i + 1]) for i in range(len(parts)))
        return Done(True)


def conn(zk: FakeZk) -> KazooConn:
    return KazooConn("k:2181", auth=None, timeout=1.0, client=zk)


def test_a_node_and_its_missing_parent_are_created_in_one_multi_op() -> None:
    zk = FakeZk({"/r", "/r/dedup"})
    conn(zk).create("/r/dedup/x/p0", {"a": 1})
    assert zk.calls == ["create /r/dedup/x/p0", "multi /r/dedup/x /r/dedup/x/p0"]
    assert {"/r/dedup/x", "/r/dedup/x/p0"} <= zk.nodes


def test_a_parent_deleted_after_this_session_made_it_is_made_again() -> None:
    zk = FakeZk({"/r", "/r/dedup"})
    c = conn(zk)
    c.create("/r/dedup/x/p0", {"a": 1})
    assert "/r/dedup/x" in c.known_paths
    zk.nodes -= {"/r/dedup/x", "/r/dedup/x/p0"}  # forgotten after the commit
    zk.calls.clear()
    c.create("/r/dedup/x/p1", {"a": 1})
    assert "/r/dedup/x/p1" in zk.nodes
    assert zk.calls == ["create /r/dedup/x/p1", "multi /r/dedup/x /r/dedup/x/p1"]


def test_a_parent_a_sibling_made_meanwhile_is_used_as_it_is() -> None:
    zk = FakeZk({"/r", "/r/dedup"})
    real = zk.create_async
    raced = []

    def racing(path: str, data: bytes, acl: Any = None) -> Done:
        if not raced:  # the first try fails, then a sibling makes the parent
            raced.append(path)
            done = real(path, data, acl)
            zk.nodes.add("/r/dedup/x")
            return done
        return real(path, data, acl)

    zk.create_async = racing  # type: ignore[method-assign]
    conn(zk).create("/r/dedup/x/p0", {"a": 1})
    assert "/r/dedup/x/p0" in zk.nodes
    assert zk.calls[-1] == "create /r/dedup/x/p0"


def test_a_missing_grandparent_is_ensured_then_the_node_created() -> None:
    zk = FakeZk({"/r"})
    conn(zk).create("/r/dedup/x/p0", {"a": 1})
    assert zk.calls[-2:] == ["ensure /r/dedup/x", "create /r/dedup/x/p0"]
    assert "/r/dedup/x/p0" in zk.nodes


def test_a_node_that_exists_is_refused_as_before() -> None:
    zk = FakeZk({"/r", "/r/dedup", "/r/dedup/x", "/r/dedup/x/p0"})
    with pytest.raises(NodeExistsError):
        conn(zk).create("/r/dedup/x/p0", {"a": 1})
