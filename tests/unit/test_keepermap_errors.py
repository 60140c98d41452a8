"""How the KeeperMap store reads ClickHouse's answers (pure: a scripted client).

Code 999 covers several Keeper outcomes, told apart only by the message; 395 is the
store's own ``throwIf`` guard; a dropped connection leaves the outcome unknown.
"""

from __future__ import annotations

from typing import Any

import pytest
from kazoo.exceptions import BadVersionError, ConnectionLoss, NodeExistsError

from txsink.errors import ConfigError, TxSinkError, UnavailableError
from txsink.keeper import keepermap
from txsink.keeper.keepermap import COLUMNS, KeeperMapNodes


@pytest.fixture(autouse=True)
def unchecked_tables() -> None:
    """Every test meets its state table afresh (a process checks a table once)."""
    keepermap._CHECKED_TABLES.clear()


class Scripted:
    url = "http://ch:8123"

    def __init__(self) -> None:
        self.error: Exception | None = None

    def command(self, sql: str, **kwargs: Any) -> None:
        if self.error is not None and not sql.startswith("CREATE"):
            raise self.error

    def query_rows(self, sql: str, **kwargs: Any) -> list[Any]:
        return list(COLUMNS) if "system.columns" in sql else []

    def close(self) -> None:
        return None


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (TxSinkError("Transaction failed (Bad version): Op #0", code=999), BadVersionError),
        (TxSinkError("Transaction failed (Node exists): Op #0", code=999), NodeExistsError),
        (TxSinkError("Value passed to 'throwIf' function is non-zero", code=395), BadVersionError),
        (TxSinkError("Transaction failed (Connection loss)", code=999), ConnectionLoss),
        (UnavailableError("ClickHouse at http://ch:8123 did not answer"), ConnectionLoss),
    ],
)
def test_keeper_outcomes_become_kazoos_errors(error: Exception, expected: type) -> None:
    client = Scripted()
    nodes = KeeperMapNodes(client, "txsink_state")
    client.error = error
    with pytest.raises(expected):
        nodes._write("ALTER TABLE t UPDATE v = v WHERE key = 'k'", "test write")


def test_any_other_server_error_is_not_mistaken_for_a_conflict() -> None:
    client = Scripted()
    nodes = KeeperMapNodes(client, "txsink_state")
    client.error = TxSinkError("Not enough privileges", code=497)
    with pytest.raises(TxSinkError, match="privileges"):
        nodes._write("ALTER TABLE t UPDATE v = v WHERE key = 'k'", "test write")


def test_a_server_without_keepermap_is_a_config_error_naming_the_fix() -> None:
    class Disabled(Scripted):
        def query_rows(self, sql: str, **kwargs: Any) -> list[Any]:
            return []  # no state table yet

        def command(self, sql: str, **kwargs: Any) -> None:
            if "ENGINE = KeeperMap" in sql:
                raise TxSinkError(
                    "KeeperMap is disabled because 'keeper_map_path_prefix' config is not defined",
                    code=36,
                )

    with pytest.raises(ConfigError, match=r"keeper_map_path_prefix.*state=keeper"):
        KeeperMapNodes(Disabled(), "txsink_state")


def test_a_state_table_of_another_shape_is_refused_naming_it() -> None:
    class Old(Scripted):
        def query_rows(self, sql: str, **kwargs: Any) -> list[Any]:
            return [("key", "String"), ("value", "String")] if "system.columns" in sql else []

    with pytest.raises(ConfigError, match="another state_database"):
        KeeperMapNodes(Old(), "txsink_state")


class Counting(Scripted):
    def __init__(self, columns: list[Any] | None = None) -> None:
        super().__init__()
        self.statements: list[str] = []
        self.columns = list(COLUMNS) if columns is None else columns

    def command(self, sql: str, **kwargs: Any) -> None:
        self.statements.append(sql)
        if sql.startswith("CREATE TABLE"):
            self.columns = list(COLUMNS)

    def query_rows(self, sql: str, **kwargs: Any) -> list[Any]:
        self.statements.append(sql)
        return self.columns if "system.columns" in sql else []


def test_an_existing_state_table_costs_one_read_once_per_process() -> None:
    first, second = Counting(), Counting()
    KeeperMapNodes(first, "txsink_state")
    KeeperMapNodes(second, "txsink_state")
    assert len(first.statements) == 1 and "system.columns" in first.statements[0]
    assert second.statements == []


def test_a_missing_state_table_is_created_and_checked() -> None:
    client = Counting(columns=[])
    KeeperMapNodes(client, "txsink_state")
    kinds = [
        s.split()[0] + (" " + s.split()[1] if s.startswith("CREATE") else "")
        for s in client.statements
    ]
    assert kinds == ["SELECT", "CREATE DATABASE", "CREATE TABLE", "SELECT"]


def test_an_ensured_path_is_not_read_again_until_something_deletes_it() -> None:
    nodes = KeeperMapNodes(Counting(), "txsink_state")
    reads: list[list[str]] = []

    def read(keys: Any) -> dict[str, keepermap.Row]:
        reads.append(sorted(keys))
        return {k: keepermap.Row(b"", 0, 1, "") for k in reads[-1]}

    nodes._read = read  # type: ignore[method-assign]
    nodes.ensure_path_async("/a/b").get()
    nodes.ensure_path_async("/a/b").get()
    assert reads == [["/a", "/a/b"]]
    nodes.delete("/a", recursive=True)
    nodes.ensure_path_async("/a/b").get()
    assert reads == [["/a", "/a/b"]] * 2


class OneBlockDeletes(Scripted):
    """A KeeperMap table as ClickHouse's mutation treats it: a DELETE removes the rows
    of the first block it reads (``block`` rows) and returns (StorageKeeperMap::mutate)."""

    def __init__(self, rows: int, block: int) -> None:
        super().__init__()
        self.rows, self.block, self.deletes = rows, block, 0

    def command(self, sql: str, **kwargs: Any) -> None:
        if sql.startswith("DELETE"):
            self.deletes += 1
            self.rows -= min(self.rows, self.block)

    def query_rows(self, sql: str, **kwargs: Any) -> list[Any]:
        if "system.columns" in sql:
            return list(COLUMNS)
        return [(self.rows,)] if "count()" in sql else []


def test_a_recursive_delete_over_more_rows_than_a_block_deletes_them_all() -> None:
    table = OneBlockDeletes(rows=250_001, block=65_409)
    KeeperMapNodes(table, "txsink_state_blocks").delete("/root/dedup/x", recursive=True)
    assert (table.rows, table.deletes) == (0, 4)


def test_a_recursive_delete_that_removes_nothing_is_an_error_not_a_loop() -> None:
    table = OneBlockDeletes(rows=10, block=0)
    with pytest.raises(TxSinkError, match="removed none"):
        KeeperMapNodes(table, "txsink_state_stuck").delete("/root/dedup/x", recursive=True)
