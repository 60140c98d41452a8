"""In-memory twin of the ClickHouse warehouse, for unit tests of pure protocol logic only.

Tables map partition id -> list of row ids. MOVE PARTITION is atomic per partition and a
repeated MOVE of an empty partition is a no-op, as in ClickHouse.
"""

from __future__ import annotations

from collections.abc import Sequence


class MemoryWarehouse:
    def __init__(self) -> None:
        self.staging: dict[str, dict[str, list[int]]] = {}
        self.targets: dict[str, dict[str, list[int]]] = {}
        self.moves = 0

    def create_staging(self, table: str, rows: dict[str, list[int]]) -> None:
        self.staging[table] = {pid: list(ids) for pid, ids in rows.items()}

    def staging_view(self, tables: Sequence[str]) -> dict[str, dict[str, int] | None]:
        view: dict[str, dict[str, int] | None] = {}
        for t in tables:
            parts = self.staging.get(t)
            view[t] = None if parts is None else {p: len(ids) for p, ids in parts.items() if ids}
        return view

    def move_partition(self, staging: str, partition_id: str, target: str) -> None:
        rows = self.staging[staging].pop(partition_id, [])
        self.targets.setdefault(target, {}).setdefault(partition_id, []).extend(rows)
        self.moves += 1

    def move_partitions(self, staging: str, partition_ids: Sequence[str], target: str) -> None:
        for partition_id in partition_ids:
            self.move_partition(staging, partition_id, target)

    def drop_stagings(self, tables: Sequence[str]) -> None:
        for table in tables:
            self.drop_staging(table)

    def staged_partitions(
        self, table: str, every_part: bool = False
    ) -> dict[str, tuple[int, tuple[str, ...]]]:
        """Rows per partition; the twin has no parts, so no part UUIDs (no evidence)."""
        return {p: (len(ids), ()) for p, ids in self.staging.get(table, {}).items() if ids}

    def staged_part_rows(self, table: str) -> dict[str, dict[str, int]]:
        """The twin has no parts, so no part UUIDs (no evidence)."""
        return {}

    def drop_parts(self, staging: str, partition_id: str, evidence: Sequence[str]) -> None:
        """No parts in the twin: nothing is ever proven in the target part by part."""

    def drop_staging(self, table: str) -> None:
        self.staging.pop(table, None)

    def list_staging(self, prefix: str) -> list[str]:
        return sorted(t for t in self.staging if t.startswith(prefix + "__"))

    def target_ids(self, target: str) -> list[int]:
        return sorted(i for ids in self.targets.get(target, {}).values() for i in ids)

    def settle(self, names: Sequence[str]) -> bool:
        """Nothing runs in the background of the twin."""
        return True
