"""The Registry contract on the ``state=clickhouse`` store: Keeper nodes in a KeeperMap
table, reached only through ClickHouse SQL (the embedded chdb engine, whose config names
the stack's ZooKeeper and a ``keeper_map_path_prefix``), plus what only KeeperMap has:
rows an UPDATE skips silently, the server's own retries, unconfirmed (pending) rows.

Every test works under its own root in one shared table, so tests never collide.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.registry_contract import RegistryContract, TombstoneContract
from txsink.embedded.stack import StackInfo
from txsink.keeper.keepermap import keepermap_registry
from txsink.ports.registry import Registry

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
