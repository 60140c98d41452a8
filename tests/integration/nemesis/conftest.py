"""Fixtures of the nemesis tests: a stack of their own (its services are killed and
restarted), and ``ch`` / ``target`` on it (they replace the shared stack's here)."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from tests.integration.conftest import client_for, free_port
from tests.nemesis.services import Services
from txsink.embedded import stack as embedded


@pytest.fixture(scope="module")
def nemesis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A stack of its own for tests that kill and restart its services (so the shared
    ``stack`` of every other test is never disturbed)."""
    root = tmp_path_factory.mktemp("nemesis-stack")
    services = Services(embedded.up(root, free_port(), free_port(), timeout=90))
    try:
        yield services
    finally:
        embedded.down(root)


@pytest.fixture
def ch(nemesis: Services) -> Iterator[Any]:
    client = client_for(nemesis.info)
    yield client
    client.close()


@pytest.fixture
def target(ch: Any) -> Iterator[str]:
    db = f"n_{uuid.uuid4().hex[:10]}"
    ch.command(f"CREATE DATABASE {db}")
    ch.command(
        f"CREATE TABLE {db}.t (id Int64, p UInt8) ENGINE = MergeTree PARTITION BY p ORDER BY id"
    )
    yield f"{db}.t"
    with contextlib.suppress(Exception):  # the endpoint may have been killed by the test
        ch.command(f"DROP DATABASE IF EXISTS {db} SYNC")
