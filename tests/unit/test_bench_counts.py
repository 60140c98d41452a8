"""benchmarks/counts.py (issue 39's per-batch counts): what it counts from the recorded
trips, the rows it feeds the tasks, and the report's targets from its result."""

from __future__ import annotations

from benchmarks.counts import inputs, table, tally
from benchmarks.report import section_counts, section_targets, target_rows


def test_a_batch_is_tallied_per_phase_and_store():
    phases = {
        "tasks": [
            ("ClickHouse", "INSERT of", 1.0),
            ("ClickHouse", "INSERT of", 1.0),
            ("ClickHouse", "create staging", 1.0),
            ("Keeper", "read_json", 0.1),
            ("Keeper sent", "GetData", 0.0),
        ],
        "commit": [
            ("ClickHouse", "MOVE PARTITION IDs", 1.0),
            ("ClickHouse", "ATTACH PARTITION ALL FROM", 1.0),
            ("ClickHouse", "DROP TABLE IF EXISTS", 1.0),
            ("Keeper sent", "Transaction", 0.0),
            ("Keeper sent", "Sync", 0.0),
            ("state", "read of the state store", 1.0),
        ],
    }
    assert tally(phases) == {
        "task_inserts": 2,
        "task_statements": 1,
        "keeper_waits": 1,
        "keeper_requests": 3,
        "commit_statements": 3,
        "commit_publish": 2,
        "state_statements": 1,
    }


def test_each_task_spreads_its_rows_over_every_partition_value_with_unique_ids():
    tasks = inputs(3, 5, batch=2)
    assert len(tasks) == 3
    ids = [i for t in tasks for b in t for i in b.column("id").to_pylist()]
    assert len(ids) == len(set(ids)) == 3 * 5 * 10
    for t in tasks:
        assert sorted(set(t[0].column("p").to_pylist())) == [0, 1, 2, 3, 4]
    assert not set(ids) & {i for t in inputs(3, 5, batch=1) for i in t[0].column("id").to_pylist()}


def _counts() -> dict:
    def shape(tasks: int, values: int, state: str, **k: float) -> dict:
        base = {
            "task_statements": 3 * tasks,
            "task_inserts": tasks,
            "commit_statements": tasks + 4,
            "commit_publish": tasks,
            "keeper_requests": 2 * tasks + 13 if state == "keeper" else 0,
            "keeper_waits": 2 * tasks + 13 if state == "keeper" else 0,
            "state_statements": 0 if state == "keeper" else 20,
            "parts_added": tasks * values,
        }
        kinds = {"tasks/ClickHouse/create staging": tasks, "commit/ClickHouse/MOVE": tasks}
        return {
            "tasks": tasks,
            "values": values,
            "state": state,
            **base,
            **k,
            "per_batch": [{"kinds": kinds}],
        }

    return {
        "rows_per_value": 10,
        "batches": 3,
        "shapes": [
            shape(4, 1, "keeper", parts_added=1, commit_statements=4, keeper_requests=8),
            shape(20, 50, "keeper"),
            shape(20, 50, "clickhouse"),
        ],
    }


def test_the_counts_are_judged_against_issue_39s_targets():
    met = {name: ok for name, _, ok in target_rows({"counts": _counts()})}
    small = "(4 tasks x 1 partition values, state=keeper)"
    big = "(20 tasks x 50 partition values, state=keeper)"
    assert met[f"parts added per batch <= partition values {small}"]
    assert met[f"commit statements <= 4 {small}"]
    assert met[f"Keeper requests per batch <= 8 {small}"]
    assert not met[f"task statements besides inserts on its critical path <= 1 per task {small}"]
    assert not met[f"parts added per batch <= partition values {big}"]
    # a state store's own count only: no Keeper target at state=clickhouse, and back
    assert f"state statements per batch <= 8 {small}" not in met
    ch = "(20 tasks x 50 partition values, state=clickhouse)"
    assert f"Keeper requests per batch <= 8 {ch}" not in met
    assert not met[f"state statements per batch <= 8 {ch}"]
    assert f"parts added per batch <= partition values {ch}" not in met  # the Keeper run's


def test_a_count_not_met_names_what_it_counts():
    lines = section_targets({"counts": _counts()})
    commit = next(line for line in lines if line.startswith("| commit statements <= 4 (20"))
    assert "commit: 20 x MOVE" in commit
    tasks = next(line for line in lines if line.startswith("| task statements") and "(20" in line)
    assert "tasks: 20 x create staging" in tasks


def test_the_counts_table_has_a_row_per_shape_and_state():
    lines = table(_counts())
    assert len(lines) == 2 + 3
    small = "| 4 x 1 | partition | keeper | 12 (0) | 4 | 4 | 4 | 8 (21) | - | 1 |"
    assert lines[2].startswith(small)
    big = "| 20 x 50 | partition | clickhouse | 60 (0) | 20 | 24 | 20 | - | 20 | 1000 |"
    assert lines[4] == big
    assert "## 2e." in section_counts({"counts": _counts()})[0]
