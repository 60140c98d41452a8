"""The Registry contract (tests/registry_contract.py) on the in-memory twin: no services."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.registry_contract import RegistryContract, TombstoneContract
from txsink.ports.registry import Registry
from txsink.ports.registry_memory import MemoryRegistry

# Every factory returns a store and a way to open another driver on that same store.
# MemoryRegistry lives in one process, so "another driver" is the same object.
RegistryFactory = Callable[[], tuple[Registry, Callable[[], Registry]]]


def _memory() -> tuple[Registry, Callable[[], Registry]]:
    registry = MemoryRegistry()
    return registry, lambda: registry


FACTORIES: dict[str, RegistryFactory] = {"memory": _memory}


@pytest.fixture(params=sorted(FACTORIES))
def _store(request: pytest.FixtureRequest) -> tuple[Registry, Callable[[], Registry]]:
    factory: RegistryFactory = FACTORIES[request.param]
    return factory()


@pytest.fixture
def registry(_store: tuple[Registry, Callable[[], Registry]]) -> Registry:
    return _store[0]


@pytest.fixture
def open_registry(_store: tuple[Registry, Callable[[], Registry]]) -> Callable[[], Registry]:
    return _store[1]


class TestRegistryContract(RegistryContract, TombstoneContract):
    """All contract invariants, once per factory in FACTORIES."""
