"""The CLI's rendering seam: the JSON envelope, units, exit statuses (txsink.cli.output),
and the contract's schema (docs/cli-schema.json) refusing what breaks it."""

from __future__ import annotations

import io
import json
from typing import Any

import pytest

from tests.cli_schema import checked, validator
from txsink.cli.main import main
from txsink.cli.output import Exit, Output, error_payload, exit_of, iso, normalize, short_age
from txsink.errors import (
    CommitOutcomeUnknown,
    ConfigError,
    FencedError,
    RecoveryAlarm,
    SchemaMismatch,
    TxSinkError,
    UnavailableError,
)


@pytest.mark.parametrize(
    ("exc", "code"),
    [
        (UnavailableError("x"), Exit.UNREACHABLE),
        (ConfigError("x"), Exit.USAGE),
        (SchemaMismatch("x"), Exit.USAGE),
        (FencedError("x"), Exit.REFUSED),
        (RecoveryAlarm("x"), Exit.OPERATOR),
        (CommitOutcomeUnknown("x"), Exit.OPERATOR),
        (TxSinkError("x"), Exit.OPERATOR),
    ],
)
def test_every_error_kind_has_one_exit_status(exc: TxSinkError, code: Exit) -> None:
    assert exit_of(exc) is code
    payload = error_payload(exc, "msg")
    assert set(payload) == {"type", "code", "message", "next_step"} and payload["next_step"]


def test_the_seam_spells_units_one_way() -> None:
    data = {
        "heartbeat_age": 1.5,
        "age_seconds": 2,
        "last_commit_at": 1_764_152_725.123,
        "created_at": None,
        "cadence_s": 2.0,
        "nested": [{"commit_seconds": {"p50": 0.1}, "started_at": 0}],
        "flag_at": True,  # not a time: left alone
    }
    assert normalize(data) == {
        "heartbeat_age_s": 1.5,
        "age_s": 2,
        "last_commit_at": "2025-11-26T10:25:25.123Z",
        "created_at": None,
        "cadence_s": 2.0,
        "nested": [{"commit_s": {"p50": 0.1}, "started_at": "1970-01-01T00:00:00.000Z"}],
        "flag_at": True,
    }
    assert iso(None) is None
    assert [short_age(s) for s in (None, 4.2, 90, 7200, 200000)] == ["-", "4s", "2m", "2h", "2d"]


def test_result_is_the_envelope_and_ok_follows_the_exit_status() -> None:
    stream = io.StringIO()
    out = Output(json_mode=True, stream=stream, command="mode")
    assert out.result(Exit.FINDINGS, "text", jobs=[{"job": "j"}], clean=False) == 1
    doc = checked(json.loads(stream.getvalue()), "mode")
    assert (doc["ok"], doc["error"], doc["findings"], doc["clean"]) == (False, None, [], False)


@pytest.mark.parametrize(
    "bad",
    [
        {"heartbeat_age": 1.0},  # a duration without _s
        {"commit_seconds": 1.0},
        {"last_commit_at": 1764152725.0},  # a time as a number
        {"nested": [{"created_at": "yesterday"}]},
    ],
)
def test_the_schema_refuses_units_spelled_otherwise(bad: dict[str, Any]) -> None:
    doc = {"command": "mode", "ok": True, "jobs": [], "findings": [], "error": None, **bad}
    assert list(validator().iter_errors(doc))


def test_the_schema_refuses_a_finding_or_an_error_without_its_keys() -> None:
    base = {"command": "status", "ok": False, "jobs": [], "findings": [], "error": None}
    assert list(validator().iter_errors({**base, "findings": [{"kind": "x", "message": "m"}]}))
    assert list(validator().iter_errors({**base, "error": {"message": "m"}}))
    assert list(validator().iter_errors({k: v for k, v in base.items() if k != "error"}))


def test_watch_with_json_is_a_usage_error_before_connecting(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code = main(["status", "--keeper", "127.0.0.1:9", "--watch", "2", "--json"])
    doc = checked(json.loads(capsys.readouterr().out), "status")
    assert code == Exit.USAGE and doc["error"]["type"] == "ConfigError"
    assert "poll `txsink status --json`" in doc["error"]["message"]


def test_table_names_are_data_never_keys_the_seam_could_rename() -> None:
    """A multi-table job writing tables named like units (cpu_seconds, logins_at): their
    names and row counts reach the JSON unchanged, and the output validates."""
    from txsink.ops.status import JobStatus, PendingXid

    tables = {"db.cpu_seconds": 5, "db.logins_at": 6, "db.user_age": 7}
    job = JobStatus(
        job="j", target="db.cpu_seconds", mode="attach", staging_database="s", epoch=1,
        owner="run", owner_epoch=1, owner_state="running", heartbeat_age=1.0, live=True,
        cadence_s=None, stale_after_s=30.0, stale_after_source="declared", committed=0,
        rows_committed=0, last_batch=None, last_commit_at=None, last_commit_age=None,
        pending=[PendingXid("b1", 1, "PREPARED", 0.5, 18, ["t"], 1, tables)],
        targets=sorted(tables), writer="live", beat_s=5.0,
    )  # fmt: skip
    stream = io.StringIO()
    Output(json_mode=True, stream=stream, command="status").result(
        Exit.OK, "", jobs=[job.to_json()], keeper_root="/r", state="keeper", warnings=0
    )
    doc = checked(json.loads(stream.getvalue()), "status")
    [pending] = doc["jobs"][0]["pending"]
    assert pending["tables"] == [{"table": t, "rows": n} for t, n in tables.items()]
    assert pending["age_s"] == 0.5 and doc["jobs"][0]["heartbeat_age_s"] == 1.0
