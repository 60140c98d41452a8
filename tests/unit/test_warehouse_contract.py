"""The Warehouse contract (tests/warehouse_contract.py) on the in-memory twin: no services.

Run twice: with every capability, and with the capabilities a sharded warehouse has (its
gated cases skip naming the capability, and the refusals are checked)."""

from __future__ import annotations

import pytest

from tests.warehouse_contract import Harness, WarehouseContract, contract_staging_name
from txsink.clickhouse.shards import ShardedWarehouse
from txsink.ports.warehouse import WarehouseCapabilities
from txsink.ports.warehouse_memory import MemoryWarehouse

DB = "contract"


class MemoryHarness:
    def __init__(self, capabilities: WarehouseCapabilities | None) -> None:
        self.wh = MemoryWarehouse(capabilities=capabilities)

    def target(self, name: str, *, dedup_window: int = 0) -> str:
        self.wh.add_table(f"{DB}.{name}", partition_by="p", dedup_window=dedup_window)
        return f"{DB}.{name}"

    def staging(self, task: int, xid: str = "b1") -> str:
        return contract_staging_name(task, xid)

    def merge(self, target: str, partition_id: str) -> None:
        self.wh.merge(target, partition_id)


CAPABILITIES = {"full": None, "as-sharded": ShardedWarehouse.capabilities}


class TestMemoryWarehouseContract(WarehouseContract):
    @pytest.fixture(params=sorted(CAPABILITIES))
    def harness(self, request: pytest.FixtureRequest) -> Harness:
        return MemoryHarness(CAPABILITIES[request.param])
