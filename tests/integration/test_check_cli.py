"""`txsink check` on the embedded stack: the verdict a writer would reach, and nothing left
behind (no staging table, no probe node), for both state stores."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.cli_schema import checked
from txsink.cli.main import main

pytestmark = pytest.mark.integration


def check(stack: Any, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, Any]:
    capsys.readouterr()
    code = main(["check", "--url", stack.url, "--keeper", stack.keeper, "--json", *args])
    return code, checked(json.loads(capsys.readouterr().out), "check")


def statuses(report: Any) -> dict[str, str]:
    return {c["name"]: c["status"] for c in report["checks"]}


@pytest.mark.parametrize("state", ["keeper", "clickhouse"])
def test_a_partitioned_merge_tree_can_run_in_attach_mode_and_nothing_is_left_behind(
    stack: Any, ch: Any, fresh_db: str, capsys: pytest.CaptureFixture[str], state: str
) -> None:
    table = f"{fresh_db}.events"
    ch.command(
        f"CREATE TABLE {table} (id UInt64, d Date) ENGINE = MergeTree "
        "PARTITION BY toYYYYMM(d) ORDER BY id"
    )
    code, report = check(stack, capsys, "--table", table, "--state", state)
    assert code == 0, report
    assert report["can_run"] and report["mode"] == "attach" and report["state"] == state
    assert statuses(report)["state store"] == "ok"
    assert statuses(report)["staging"] == "ok"
    # the writer's own visibility choice (auto), its grant and query-log probes included
    visibility = next(c for c in report["checks"] if c["name"] == "visibility")
    assert (visibility["status"], visibility["detail"].split(" ")[0]) == ("ok", "batch"), report
    left = ch.query(
        "SELECT count() FROM system.tables WHERE database = 'txsink_staging' "
        "AND name LIKE '%txsink_check%'"
    ).result_rows[0][0]
    assert left == 0
    if state == "clickhouse":
        probes = ch.query(
            "SELECT count() FROM txsink_state.nodes WHERE startsWith(key, '/txsink-check/')"
        ).result_rows[0][0]
        assert probes == 0
    assert ch.query(f"SELECT count() FROM {table}").result_rows[0][0] == 0


def test_a_table_no_mode_can_write_fails_the_check_naming_why(
    stack: Any, ch: Any, fresh_db: str, capsys: pytest.CaptureFixture[str]
) -> None:
    table = f"{fresh_db}.scratch"
    ch.command(f"CREATE TABLE {table} (id UInt64) ENGINE = Memory")
    code, report = check(stack, capsys, "--table", table, "--state", "clickhouse")
    assert code == 1 and not report["can_run"]
    mode = next(c for c in report["checks"] if c["name"] == "mode")
    assert mode["status"] == "fail" and "Memory" in mode["detail"]


def test_a_dedup_window_makes_a_view_fed_table_a_dedup_job(
    stack: Any, ch: Any, fresh_db: str, capsys: pytest.CaptureFixture[str]
) -> None:
    table = f"{fresh_db}.orders"
    ch.command(
        f"CREATE TABLE {table} (id UInt64) ENGINE = MergeTree ORDER BY id "
        "SETTINGS non_replicated_deduplication_window = 1000"
    )
    ch.command(f"CREATE TABLE {fresh_db}.n (c UInt64) ENGINE = MergeTree ORDER BY c "
               "SETTINGS non_replicated_deduplication_window = 1000")  # fmt: skip
    ch.command(f"CREATE MATERIALIZED VIEW {fresh_db}.mv TO {fresh_db}.n AS "
               f"SELECT count() AS c FROM {table}")  # fmt: skip
    code, report = check(stack, capsys, "--table", table, "--state", "clickhouse")
    assert code == 0 and report["mode"] == "dedup", report
    assert "staging" not in statuses(report)


def test_a_missing_table_fails_the_check(
    stack: Any, fresh_db: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, report = check(stack, capsys, "--table", f"{fresh_db}.nope")
    assert code == 1 and statuses(report)["table"] == "fail"
    detail = next(c["detail"] for c in report["checks"] if c["name"] == "table")
    assert "create_table=if_missing" in detail
    code, report = check(stack, capsys, "--table", "no_such_db_here.t")
    detail = next(c["detail"] for c in report["checks"] if c["name"] == "table")
    assert code == 1 and "CREATE DATABASE no_such_db_here" in detail, detail
    assert "create_table=if_missing" not in detail  # it would not help


@pytest.mark.parametrize("state", ["keeper", "clickhouse"])
def test_verify_of_a_root_without_jobs_is_a_finding_not_clean(
    stack: Any, capsys: pytest.CaptureFixture[str], state: str
) -> None:
    capsys.readouterr()
    code = main(["verify", "--url", stack.url, "--keeper", stack.keeper, "--state", state,
                 "--keeper-root", "/no-such-root", "--json"])  # fmt: skip
    report = checked(json.loads(capsys.readouterr().out), "verify")
    assert code == 1 and report["clean"] is False and report["jobs"] == []
    [finding] = report["findings"]
    assert finding["kind"] == "no-jobs" and "nothing was verified" in finding["message"]
    code = main(["verify", "--url", stack.url, "--keeper", stack.keeper, "--state", state,
                 "--keeper-root", "/no-such-root"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 1 and "CLEAN" not in out and "no jobs in the " in out and "/no-such-root" in out
