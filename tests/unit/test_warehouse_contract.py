"""The Warehouse contract (tests/warehouse_contract.py) on the in-memory twin: no services.

Run twice: with every capability, and with the capabilities a sharded warehouse has (its
gated cases skip naming the capability, and the refusals are checked)."""

from __future__ import annotations

import pytest

from tests.warehouse_contract import Harness, WarehouseContract, contract_staging_name
from txsink.clickhouse.shards import ShardedWarehouse
from txsink.errors import RetryableConflict, UnavailableError
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


# -------------------------------------------------------------- the twin's own test hooks


def _twin_with_target() -> tuple[MemoryWarehouse, str, str]:
    wh = MemoryWarehouse()
    wh.add_table(f"{DB}.t", partition_by="p")
    name = contract_staging_name(1)
    wh.stage(name, {"202401": [1, 2, 3, 4]}, parts=2)
    return wh, f"{DB}.t", name


def test_a_refused_call_changes_nothing() -> None:
    wh, target, name = _twin_with_target()
    wh.fail_next("move_partition")
    with pytest.raises(RetryableConflict):
        wh.move_partition(name, "202401", target)
    assert wh.partition_rows(target) == {} and wh.moves == 0
    wh.move_partition(name, "202401", target)
    assert wh.partition_rows(target) == {"202401": 4}


def test_a_lost_reply_landed() -> None:
    wh, target, name = _twin_with_target()
    wh.lose_reply("move_partition")
    with pytest.raises(UnavailableError):
        wh.move_partition(name, "202401", target)
    assert wh.partition_rows(target) == {"202401": 4}
    assert wh.staging_view([name]) == {name: {}}


def test_a_cut_move_leaves_the_moved_parts_in_both_tables() -> None:
    wh, target, name = _twin_with_target()
    ids = wh.staged_partitions(name, every_part=True)["202401"][1]
    wh.cut_next_move(1)
    with pytest.raises(UnavailableError):
        wh.move_partition(name, "202401", target)
    assert wh.staging_view([name]) == {name: {"202401": 4}}
    assert wh.partition_rows(target) == {"202401": 2}
    assert len(wh.published_uuids(target, ids)) == 1


def test_merged_parts_get_a_new_uuid_and_the_old_ones_go_at_cleanup() -> None:
    wh, target, name = _twin_with_target()
    ids = wh.staged_partitions(name, every_part=True)["202401"][1]
    wh.move_partition(name, "202401", target)
    wh.merge(target, "202401")
    assert len(wh.tables[target].parts) == 1
    assert wh.published_uuids(target, ids) == frozenset(ids)
    wh.cleanup(target)
    assert wh.published_uuids(target, ids) == frozenset()
    assert wh.target_ids(target) == [1, 2, 3, 4]


def test_settle_is_busy_while_a_statement_runs() -> None:
    wh, _, name = _twin_with_target()
    wh.running = 2
    assert [wh.settle([name]) for _ in range(3)] == [False, False, True]
