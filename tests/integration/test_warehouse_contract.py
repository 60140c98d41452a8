"""The Warehouse contract (tests/warehouse_contract.py) on real servers: ClickHouseWarehouse
on the embedded server, ShardedWarehouse on two embedded servers of their own."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.test_shards import _free_run
from tests.warehouse_contract import Harness, WarehouseContract, contract_staging_name
from txsink.clickhouse.client import Client, connect
from txsink.clickhouse.shards import ShardedWarehouse
from txsink.clickhouse.warehouse import ClickHouseWarehouse
from txsink.embedded import stack as embedded
from txsink.embedded.stack import StackInfo

pytestmark = pytest.mark.integration

SHARDS = 2


class ServerHarness:
    """One or more servers with a fresh database each (the same name on every server)."""

    def __init__(self, clients: list[Client], db: str) -> None:
        self.clients, self.db = clients, db
        warehouses = [ClickHouseWarehouse(c, staging_db=f"{db}_stg") for c in clients]
        self.wh: Any = warehouses[0] if len(clients) == 1 else ShardedWarehouse(warehouses)
        for c in clients:
            c.command(f"CREATE DATABASE {db}")
        self.wh.ensure_staging_db()

    def target(self, name: str, *, dedup_window: int = 0) -> str:
        for c in self.clients:
            c.command(
                f"CREATE TABLE {self.db}.{name} (p UInt32, id UInt64) ENGINE = MergeTree "
                f"PARTITION BY p ORDER BY id "
                f"SETTINGS non_replicated_deduplication_window = {dedup_window}"
            )
        return f"{self.db}.{name}"

    def staging(self, task: int, xid: str = "b1") -> str:
        shard = task % len(self.clients) if len(self.clients) > 1 else None
        return contract_staging_name(task, xid, shard)

    def merge(self, target: str, partition_id: str) -> None:
        for c in self.clients:
            c.command(f"OPTIMIZE TABLE {target} PARTITION ID '{partition_id}' FINAL")

    def close(self) -> None:
        for c in self.clients:
            for db in (self.db, f"{self.db}_stg"):
                with contextlib.suppress(Exception):
                    c.command(f"DROP DATABASE IF EXISTS {db} SYNC")
            c.close()


def _db() -> str:
    return f"wc_{uuid.uuid4().hex[:10]}"


class TestClickHouseWarehouseContract(WarehouseContract):
    @pytest.fixture
    def harness(self, stack: StackInfo) -> Iterator[Harness]:
        h = ServerHarness([connect(stack.url)], _db())
        yield h
        h.close()


@pytest.fixture(scope="module")
def shard_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StackInfo]:
    root: Path = tmp_path_factory.mktemp("contract-shards")
    info = embedded.up(root, _free_run(SHARDS), _free_run(1), timeout=120, shards=SHARDS)
    try:
        yield info
    finally:
        embedded.down(root)


class TestShardedWarehouseContract(WarehouseContract):
    @pytest.fixture
    def harness(self, shard_stack: StackInfo) -> Iterator[Harness]:
        h = ServerHarness([connect(url) for url in shard_stack.shards], _db())
        yield h
        h.close()
