"""``txsink status | recover | verify | tune`` against the embedded stack, on situations made
for real with the library: a driver process that dies right after PREPARED (fault point
``driver.after_prepare``), staging nobody prepared, a zombie writer, a history edited in
Keeper, rows written behind txsink's back, and a real table to tune on.

Every test has its own Keeper root and databases. The CLI runs in-process through
``txsink.cli.main.main`` (output captured with capsys), plus real ``txsink`` subprocesses.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import importlib.util
import json
import os
import socket
import ssl
import subprocess
import sys
import threading
import uuid
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pyarrow as pa
import pytest
from kazoo.client import KazooClient

from tests.cli_schema import checked
from txsink.cli.main import main
from txsink.config import WriterConfig
from txsink.driver import JobHandle, job_meta, open_job
from txsink.errors import FencedError
from txsink.faults import EXIT_CODE
from txsink.ops.verify import verify_job
from txsink.protocol.codec import decode_record, encode_record
from txsink.protocol.ids import batch_xid, run_tag, staging_name
from txsink.protocol.states import Epoch, Mode, StagedPart, XidRecord, XidState

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
COLS = "d Date, k UInt64, v String"


# --------------------------------------------------------------------------- helpers


def rows(n: int, start: int, months: int = 2) -> pa.RecordBatch:
    """``n`` rows with unique keys from ``start``, spread over ``months`` monthly partitions."""
    base = dt.date(2024, 1, 10)
    return pa.record_batch(
        {
            "d": pa.array([base + dt.timedelta(days=31 * (i % months)) for i in range(n)]),
            "k": pa.array(range(start, start + n), pa.uint64()),
            "v": pa.array([f"v{start + i}" for i in range(n)]),
        }
    )


def stage(
    handle: JobHandle, xid: str, batch: pa.RecordBatch, task: int = 0, run: str = "run"
) -> list[StagedPart]:
    """Stage ``batch`` for ``xid`` like an executor task does; the manifest parts."""
    wh = handle.warehouse
    name = staging_name(
        handle.config.job, xid, run_tag(run), 0, 0, task, handle.transactor.namespace
    ).table
    wh.ensure_staging_db()
    wh.create_staging(handle.config.table, name)
    wh.insert_blocks(name, [batch], block_rows=10_000, block_bytes=1 << 24)
    view = wh.staging_view([name])[name] or {}
    return [StagedPart(name, pid, n) for pid, n in sorted(view.items()) if n]


def begin(handle: JobHandle, owner: str) -> Epoch:
    # a streaming job (it has a query id): its batch ids are dense, so gaps are anomalies
    meta = job_meta(handle.config, "attach", query_id="query-under-test")
    return handle.transactor.begin(owner, meta=meta)


def commit(handle: JobHandle, epoch: Epoch, batch: int, n: int = 6) -> None:
    parts = stage(handle, batch_xid(batch), rows(n, start=batch * 1000), run=epoch.owner)
    handle.transactor.commit_batch(
        epoch, batch_xid(batch), batch, handle.config.table, parts, streaming=True
    )


def crash_main(raw: str) -> None:
    """Subprocess body: take over the job, stage a batch, die right after PREPARED."""
    spec = json.loads(raw)
    handle = open_job(WriterConfig.from_options(spec["options"]))
    epoch = begin(handle, spec["owner"])
    b = int(spec["batch"])
    parts = stage(handle, batch_xid(b), rows(int(spec["rows"]), start=b * 1000), run=spec["owner"])
    handle.transactor.commit_batch(epoch, batch_xid(b), b, handle.config.table, parts)
    raise SystemExit("fault point driver.after_prepare did not fire")


def count(ch: Any, table: str) -> tuple[int, int]:
    c, u = ch.query(f"SELECT count(), uniqExact(k) FROM {table}").result_rows[0]
    return int(c), int(u)


@pytest.fixture
def env(stack: Any, ch: Any, zk: KazooClient, fresh_db: str) -> Iterator[Env]:
    e = Env(stack, ch, zk, fresh_db)
    ch.command(
        f"CREATE TABLE {e.table} ({COLS}) ENGINE = MergeTree PARTITION BY toYYYYMM(d) ORDER BY k"
    )
    try:
        yield e
    finally:
        for h in e.handles:
            h.close()
        ch.command(f"DROP DATABASE IF EXISTS {e.staging} SYNC")
        if zk.exists(e.root):
            zk.delete(e.root, recursive=True)


class Env:
    """One test's world: a Keeper root, a target table, a staging database, a job."""

    def __init__(self, stack: Any, ch: Any, zk: KazooClient, db: str) -> None:
        self.stack, self.ch, self.zk, self.db = stack, ch, zk, db
        self.root = f"/txsink-ops-{uuid.uuid4().hex[:10]}"
        self.table = f"{db}.events"
        self.staging = f"{db}_stg"
        self.job = "orders-stream"
        self.handles: list[JobHandle] = []

    def options(self, job: str | None = None) -> dict[str, str]:
        return {
            "url": self.stack.url,
            "keeper": self.stack.keeper,
            "table": self.table,
            "job": job or self.job,
            "keeper_root": self.root,
            "staging_database": self.staging,
        }

    def config(self, job: str | None = None) -> WriterConfig:
        return WriterConfig.from_options(self.options(job))

    def open(self, job: str | None = None) -> JobHandle:
        handle = open_job(self.config(job))
        self.handles.append(handle)
        return handle

    def flags(self) -> list[str]:
        return [
            "--url", self.stack.url, "--keeper", self.stack.keeper,
            "--keeper-root", self.root, "--staging-database", self.staging,
        ]  # fmt: skip

    def crash_after_prepare(self, batch: int, owner: str, n: int = 6) -> None:
        spec = json.dumps({"options": self.options(), "owner": owner, "batch": batch, "rows": n})
        proc = subprocess.run(
            [sys.executable, "-c",
             "import sys; from tests.integration.test_ops_cli import crash_main; "
             "crash_main(sys.argv[1])", spec],
            check=False,
            cwd=REPO,
            env={**os.environ, "TXSINK_FAULT": "driver.after_prepare"},
            capture_output=True,
            text=True,
            timeout=120,
        )  # fmt: skip
        assert proc.returncode == EXIT_CODE, proc.stderr

    def record(self, xid: str) -> XidRecord | None:
        path = f"{self.root}/jobs/{self.job}/xids/{xid}"
        if not self.zk.exists(path):
            return None
        return decode_record(json.loads(self.zk.get(path)[0]))

    def write_record(self, record: XidRecord) -> None:
        """Write an xid record straight into Keeper, behind the registry's back."""
        path = f"{self.root}/jobs/{self.job}/xids/{record.xid}"
        data = json.dumps(encode_record(record)).encode()
        if self.zk.exists(path):
            self.zk.set(path, data)
        else:
            self.zk.create(path, data)

    def staging_tables(self) -> list[str]:
        return [
            r[0]
            for r in self.ch.query(
                "SELECT name FROM system.tables WHERE database = {d:String} ORDER BY name",
                parameters={"d": self.staging},
            ).result_rows
        ]


@pytest.fixture
def cli(env: Env, capsys: pytest.CaptureFixture[str]) -> Callable[..., tuple[int, str, str]]:
    """Run ``txsink <command> <flags...> <args>`` in-process: (exit, stdout, stderr)."""

    def run(command: str, *args: str) -> tuple[int, str, str]:
        capsys.readouterr()
        code = main([command, *env.flags(), *args])
        out, err = capsys.readouterr()
        return code, out, err

    return run


def cli_json(cli: Callable[..., tuple[int, str, str]], command: str, *args: str) -> tuple[int, Any]:
    """The exit status and the JSON of a command, checked against docs/cli-schema.json
    (``ok`` agrees with the exit status)."""
    code, out, _ = cli(command, *args, "--json")
    payload = checked(json.loads(out), command)
    assert payload["ok"] is (code == 0)
    return code, payload


def bogus(job: str, xid: str, batch: int | None, seq: int) -> XidRecord:
    """A COMMITTED record with commit sequence ``seq`` and no manifest (no ledger rows)."""
    now = 1_700_000_000.0 + seq
    return XidRecord(
        job=job, xid=xid, batch=batch, state=XidState.COMMITTED, epoch=1, mode=Mode.ATTACH,
        target="", created_at=now, committed_at=now, seq=seq,
    )  # fmt: skip


# --------------------------------------------------------------------------- stuck PREPARED


def test_stuck_prepared_xid_is_reported_then_rolled_forward_exactly_once(
    env: Env, cli: Callable[..., tuple[int, str, str]]
) -> None:
    handle = env.open()
    commit(handle, begin(handle, "run-A"), 0, n=10)
    env.crash_after_prepare(1, "run-B", n=6)  # the process really dies after PREPARED
    assert env.record("b1").state is XidState.PREPARED
    assert count(env.ch, env.table) == (10, 10)

    code, out, _ = cli("status", "-v", "--stuck-after", "0")
    assert code == 1  # a warning needs attention
    assert "stuck-prepared: xid b1 (batch 1) of job orders-stream has been PREPARED" in out
    assert "owner run-B" in out and "LIVE" in out  # run-B's heartbeat is seconds old
    code, doc = cli_json(cli, "status", "--job", env.job, "--stuck-after", "0")
    job = doc["jobs"][0]
    assert (code, job["last_batch"], job["rows_committed"], job["owner"]) == (1, 0, 10, "run-B")
    assert [(p["xid"], p["state"], p["rows"]) for p in job["pending"]] == [("b1", "PREPARED", 6)]
    assert {w["kind"] for w in job["warnings"]} == {"stuck-prepared"}
    assert [s["referenced_by"] for s in job["staging"]] == ["prepared"]

    # dry run: the plan names the roll-forward, nothing changes
    code, out, _ = cli("recover", "--dry-run", "--stale-after", "0")
    assert code == 0
    assert "plan: roll forward  b1 (PREPARED, 6 rows)" in out
    assert "dry run: nothing was changed" in out
    assert env.record("b1").state is XidState.PREPARED
    assert count(env.ch, env.table) == (10, 10)
    epoch_before = handle.registry.current_epoch(env.job)

    code, doc = cli_json(cli, "recover", "--yes", "--stale-after", "0")
    assert code == 0, doc
    entry = doc["jobs"][0]
    assert entry["outcome"]["report"]["rolled_forward"] == ["b1"]
    assert entry["outcome"]["report"]["alarms"] == []
    assert entry["plan"]["rolled_forward"] == ["b1"]  # the plan, not nested in itself
    assert entry["outcome"]["fenced_owner"] == "run-B"
    assert entry["outcome"]["epoch"] == epoch_before.number + 1
    assert doc["clean"] is True
    assert env.record("b1").state is XidState.COMMITTED
    assert count(env.ch, env.table) == (16, 16)  # the 6 rows, exactly once
    assert env.staging_tables() == []

    # idempotent: a second run has nothing to do and takes no epoch
    code, out, _ = cli("recover", "--yes", "--stale-after", "0")
    assert code == 0
    assert "nothing to do" in out
    assert handle.registry.current_epoch(env.job).number == epoch_before.number + 1
    assert count(env.ch, env.table) == (16, 16)

    code, doc = cli_json(cli, "status")
    kinds = {w["kind"]: w for w in doc["jobs"][0]["warnings"]}
    assert set(kinds) == {"fenced-writer"} and "run-B" in kinds["fenced-writer"]["message"]
    assert doc["jobs"][0]["owner"].startswith("txsink-recover@")
    code, out, _ = cli("verify")
    assert code == 0, out
    assert "verify: CLEAN" in out


def test_recover_text_output_says_which_writer_it_fences(
    env: Env, cli: Callable[..., tuple[int, str, str]]
) -> None:
    handle = env.open()
    commit(handle, begin(handle, "run-A"), 0)
    env.crash_after_prepare(1, "run-B")
    code, out, _ = cli("recover", "--yes", "--stale-after", "0")
    assert code == 0
    assert "took writer epoch 3 as txsink-recover@" in out
    assert "this fences run-B (epoch 2): its next commit fails with FencedError" in out
    assert "rolled forward  b1" in out
    assert "job orders-stream: clean" in out


# --------------------------------------------------------------------------- orphan staging


def test_orphan_staging_is_reported_when_the_owner_is_stale_and_dropped_by_recover(
    env: Env, cli: Callable[..., tuple[int, str, str]]
) -> None:
    handle = env.open()
    epoch = begin(handle, "run-A")
    commit(handle, epoch, 0)
    orphan = stage(handle, batch_xid(1), rows(4, start=5000), run="run-A")[0].table

    # while run-A's heartbeat is fresh, the staging is a batch in flight, not an orphan
    code, doc = cli_json(cli, "status")
    job = doc["jobs"][0]
    assert job["live"] is True and job["warnings"] == []
    assert [(s["table"], s["referenced_by"], s["rows"]) for s in job["staging"]] == [
        (orphan, "none", 4)
    ]

    code, out, _ = cli("status", "-v", "--stale-after", "0")
    assert code == 1
    assert f"orphan-staging: staging table {env.staging}.{orphan} (4 rows" in out
    assert "stale-owner" in out

    code, out, _ = cli("recover", "--yes", "--stale-after", "0")
    assert code == 0, out
    assert f"rolled back     {env.staging}.{orphan}" in out
    assert env.staging_tables() == []
    assert count(env.ch, env.table) == (6, 6)
    code, doc = cli_json(cli, "status", "--stale-after", "0")
    assert not [w for w in doc["jobs"][0]["warnings"] if w["kind"] == "orphan-staging"]


def test_the_next_save_of_a_daily_job_is_not_an_orphan_and_recover_leaves_it(
    env: Env, cli: Callable[..., tuple[int, str, str]]
) -> None:
    # a batch save finished a day ago (its owner rests `finished`, its beat a day old);
    # the next save's tasks are staging now, before it takes the job: a run at work
    handle = env.open()
    epoch = begin(handle, "save-1")
    parts = stage(handle, "u0a1b2c3d4e5f", rows(6, start=0), run="save-1")
    handle.transactor.commit_batch(epoch, "u0a1b2c3d4e5f", None, env.table, parts)
    path = f"{env.root}/jobs/{env.job}/owner"
    owner = json.loads(env.zk.get(path)[0])
    assert owner["state"] == "finished"
    env.zk.set(path, json.dumps({**owner, "heartbeat": owner["heartbeat"] - 86400}).encode())
    next_save = stage(handle, "u9f8e7d6c5b4a", rows(4, start=5000), run="save-2")[0].table

    code, doc = cli_json(cli, "status")
    job = doc["jobs"][0]
    assert (job["live"], job["stale_after_source"]) == (True, "staging"), job
    assert not [w for w in job["warnings"] if w["kind"] == "orphan-staging"]
    code, doc = cli_json(cli, "recover", "--yes")
    assert code == 3, doc  # refused: a live run, no --force
    assert env.staging_tables() == [next_save]


def test_lost_staging_of_a_prepared_xid_is_an_alarm_not_a_guess(
    env: Env, cli: Callable[..., tuple[int, str, str]]
) -> None:
    handle = env.open()
    commit(handle, begin(handle, "run-A"), 0)
    env.crash_after_prepare(1, "run-B")
    for table in env.staging_tables():  # someone dropped the PREPARED xid's staging
        env.ch.command(f"DROP TABLE {env.staging}.{table} SYNC")
    code, doc = cli_json(cli, "status")
    assert [w["kind"] for w in doc["jobs"][0]["warnings"]] == ["lost-staging"]
    code, out, _ = cli("recover", "--yes", "--stale-after", "0")
    assert code == 4
    assert "ALARM: job orders-stream: staging table" in out
    assert "docs/operations.md#lost-staging" in out
    assert env.record("b1").state is XidState.PREPARED
    assert count(env.ch, env.table) == (6, 6)


# --------------------------------------------------------------------------- zombie owner


def test_recover_refuses_a_live_writer_and_force_fences_the_zombie(
    env: Env, cli: Callable[..., tuple[int, str, str]]
) -> None:
    zombie = env.open()
    z_epoch = begin(zombie, "zombie-run")
    commit(zombie, z_epoch, 0)
    in_flight = stage(zombie, batch_xid(1), rows(4, start=7000), run="zombie-run")

    code, out, _ = cli("recover", "--yes")
    assert code == 3
    assert "refusing to recover job orders-stream: writer zombie-run (epoch 1) heartbeat" in out
    assert "--force" in out
    assert len(env.staging_tables()) == 1  # nothing changed
    assert zombie.registry.current_epoch(env.job) == z_epoch

    code, doc = cli_json(cli, "recover", "--yes")
    assert code == 3 and "zombie-run" in doc["jobs"][0]["refused"]

    code, out, _ = cli("recover", "--yes", "--force")
    assert code == 0, out
    assert "this fences zombie-run (epoch 1)" in out
    assert env.staging_tables() == []
    with pytest.raises(FencedError, match="superseded"):
        zombie.transactor.commit_batch(z_epoch, "b1", 1, env.table, in_flight)
    assert count(env.ch, env.table) == (6, 6)


def test_recover_without_yes_on_a_non_interactive_stdin_changes_nothing(env: Env) -> None:
    handle = env.open()
    commit(handle, begin(handle, "run-A"), 0)
    env.crash_after_prepare(1, "run-B")
    proc = subprocess.run(
        [str(Path(sys.executable).with_name("txsink")), "recover", *env.flags(), "--force"],
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "plan: roll forward  b1" in proc.stdout
    assert "stdin is not a terminal" in proc.stdout and "--yes" in proc.stdout
    assert env.record("b1").state is XidState.PREPARED


# --------------------------------------------------------------------------- verify


def test_verify_of_a_clean_history_exits_zero_and_ad_hoc_xids_are_exempt(
    env: Env, cli: Callable[..., tuple[int, str, str]]
) -> None:
    handle = env.open()
    epoch = begin(handle, "run-A")
    for b in range(3):
        commit(handle, epoch, b)
    code, out, _ = cli("verify")
    assert code == 0, out
    assert "3 committed xids retained (seq [1, 3])" in out
    assert "ledger 18 rows (orders-stream) vs target 18 rows in 2 partition(s)" in out
    env.write_record(bogus(env.job, "u0123456789ab", None, 4))
    code, doc = cli_json(cli, "verify")
    assert code == 0 and doc["clean"] is True
    assert doc["jobs"][0]["checked"]["adhoc_exempt"] == 1
    assert verify_job(env.config()).clean  # the library entry point the demo calls


@pytest.mark.parametrize(
    ("inject", "kind", "xids", "text"),
    [
        ([("b5", 5, 4)], "gap", ["b2", "b5"], "gap: batch(es) 3..4 never committed between "
         "batch 2 (xid b2 (seq 3)) and batch 5 (xid b5 (seq 4))"),
        ([("b9", 2, 4)], "overlap", ["b2", "b9"], "overlap: batch 2 was committed 2 times, by "
         "xid b2 (seq 3), xid b9 (seq 4)"),
        ([("b4", 4, 4), ("b3", 3, 5)], "backward", ["b4", "b3"], "backward: batch 3 (xid b3 "
         "(seq 5)) was committed after batch 4 (xid b4 (seq 4))"),
    ],
)  # fmt: skip
def test_verify_names_an_injected_history_anomaly(
    env: Env,
    cli: Callable[..., tuple[int, str, str]],
    inject: list[tuple[str, int, int]],
    kind: str,
    xids: list[str],
    text: str,
) -> None:
    handle = env.open()
    epoch = begin(handle, "run-A")
    for b in range(3):
        commit(handle, epoch, b)
    for xid, batch, seq in inject:
        env.write_record(bogus(env.job, xid, batch, seq))
    code, out, _ = cli("verify")
    assert code == 1
    assert text in out
    assert f"{kind.upper()}: " in out
    code, doc = cli_json(cli, "verify", "--job", env.job)
    assert code == 1 and doc["clean"] is False
    found = [a for a in doc["jobs"][0]["anomalies"] if a["kind"] == kind]
    assert found and found[0]["xids"] == xids


def test_verify_reports_rows_written_behind_txsinks_back(
    env: Env, cli: Callable[..., tuple[int, str, str]]
) -> None:
    handle = env.open()
    commit(handle, begin(handle, "run-A"), 0)
    env.ch.command(f"INSERT INTO {env.table} VALUES ('2024-01-15', 99999, 'sneaky')")
    code, out, _ = cli("verify")
    assert code == 1
    assert f"reconciliation: partition 202401 of {env.table} has 4 rows, the ledger of " in out
    assert "orders-stream counts 3: 1 rows more than txsink committed" in out
    code, doc = cli_json(cli, "verify", "--allow-other-writers")
    assert code == 0
    assert [w["kind"] for w in doc["jobs"][0]["warnings"]] == ["other-writers"]
    assert not verify_job(env.config()).clean


def test_verify_warns_about_staging_left_by_a_recent_commit(
    env: Env, cli: Callable[..., tuple[int, str, str]]
) -> None:
    handle = env.open()
    epoch = begin(handle, "run-A")
    commit(handle, epoch, 0)
    # a crash between COMMITTED and the staging drop leaves an empty staging table behind
    leftover = env.record("b0").staging_tables[0]
    env.ch.command(f"CREATE TABLE {env.staging}.{leftover} AS {env.table}")
    code, doc = cli_json(cli, "verify")
    assert code == 0
    assert [w["kind"] for w in doc["jobs"][0]["warnings"]] == ["leftover-staging"]
    assert doc["jobs"][0]["warnings"][0]["xids"] == ["b0"]


# --------------------------------------------------------------------------- status / errors


def test_status_of_a_missing_job_is_a_usage_error_and_real_subprocess_json(
    env: Env, cli: Callable[..., tuple[int, str, str]]
) -> None:
    code, _, err = cli("status", "--job", "nope")
    assert code == 2 and f"job 'nope' does not exist in the Keeper root {env.root}" in err
    code, doc = cli_json(cli, "status", "--job", "nope")
    assert code == 2 and doc["error"]["type"] == "ConfigError" and doc["error"]["next_step"]
    handle = env.open()
    commit(handle, begin(handle, "run-A"), 0)
    proc = subprocess.run(
        [str(Path(sys.executable).with_name("txsink")), "status", *env.flags(), "--json"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert [(j["job"], j["target"], j["last_batch"]) for j in doc["jobs"]] == [
        (env.job, env.table, 0)
    ]


# --------------------------------------------------------------------------- tune


def test_tune_measures_a_real_table_and_leaves_nothing_behind(
    env: Env, cli: Callable[..., tuple[int, str, str]], tmp_path: Path
) -> None:
    env.ch.command(
        f"INSERT INTO {env.table} SELECT toDate('2024-01-01') + number * 9, number, "
        "toString(number) FROM numbers(40)"
    )
    before = count(env.ch, env.table)
    code, out, err = cli(
        "tune", "--table", env.table, "--transactions", "6", "--rows-per-second", "20000"
    )
    assert code == 0, err
    assert "recommended trigger interval T = max(" in out
    assert "parts_to_delay_insert = 1000 (parts_to_throw_insert = 3000)" in out
    assert "about " in out and "rows per batch" in out

    env.ch.command(f"ALTER TABLE {env.table} MODIFY SETTING parts_to_delay_insert = 200")
    code, doc = cli_json(cli, "tune", "--table", env.table, "--transactions", "4")
    assert code == 0
    assert doc["transactions"] == 4 and doc["parts_to_delay_insert"] == 200
    assert 0 < doc["commit_s"]["p50"] <= doc["commit_s"]["p99"]
    rec = doc["recommendation"]
    assert rec["interval"] >= max(1.0, rec["overhead_interval"], rec["parts_interval"])
    assert rec["parts_interval"] == pytest.approx(60 * 4 / 20)
    assert {p["partitions"] for p in doc["commit_s_by_partitions"]} == {1, 4}

    assert count(env.ch, env.table) == before  # the target only lent sample rows
    left = env.ch.query(
        "SELECT name FROM system.tables WHERE database = {d:String} AND name LIKE '__txsink_tune%'",
        parameters={"d": env.db},
    ).result_rows
    assert left == []
    assert not [j for j in env.zk.get_children(f"{env.root}/jobs") if j.startswith("tune-")]

    png = tmp_path / "overhead.png"
    code, out, err = cli("tune", "--table", env.table, "--transactions", "2", "--plot", str(png))
    if importlib.util.find_spec("matplotlib") is None:
        assert code == 2 and "needs matplotlib" in err
    else:
        assert code == 0 and png.stat().st_size > 1000


# --------------------------------------------------------------------------- TLS flags


def make_cert(where: Path, name: str) -> tuple[Path, Path, Path]:
    """A throwaway CA and a server certificate it signed for 127.0.0.1: (ca, cert, key)."""
    where.mkdir(parents=True, exist_ok=True)
    ca, ca_key = where / f"{name}-ca.pem", where / f"{name}-ca.key"
    cert, key, csr = where / f"{name}.pem", where / f"{name}.key", where / f"{name}.csr"
    ext = where / f"{name}.ext"
    ext.write_text(
        "subjectAltName=IP:127.0.0.1\nauthorityKeyIdentifier=keyid\nbasicConstraints=CA:FALSE\n"
        "keyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n"
    )
    for argv in (
        ["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", ca_key, "-out", ca,
         "-days", "1", "-subj", f"/CN=txsink test CA {name}"],
        ["req", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", csr,
         "-subj", "/CN=127.0.0.1"],
        ["x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial",
         "-out", cert, "-days", "1", "-extfile", ext],
    ):  # fmt: skip
        subprocess.run(["openssl", *map(str, argv)], check=True, capture_output=True)
    return ca, cert, key


class TlsProxy:
    """An https endpoint in front of the stack's http one: TLS ends here, bytes go on."""

    def __init__(self, upstream: str, cert: Path, key: Path) -> None:
        up = urlsplit(upstream)
        self._up = (up.hostname or "127.0.0.1", up.port or 8123)
        self._ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self._ctx.load_cert_chain(cert, key)
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"https://127.0.0.1:{self._sock.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                raw, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(raw,), daemon=True).start()

    def _serve(self, raw: Any) -> None:
        try:
            tls = self._ctx.wrap_socket(raw, server_side=True)
        except OSError:  # the client refused our certificate: that is the test
            raw.close()
            return
        up = socket.create_connection(self._up)
        threading.Thread(target=self._pump, args=(up, tls), daemon=True).start()
        self._pump(tls, up)

    @staticmethod
    def _pump(src: Any, dst: Any) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.close()

    def close(self) -> None:
        self._sock.close()


def test_tls_flags_reach_the_clickhouse_client_of_a_command(
    env: Env, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """`--ca-cert` and `--no-verify` reach the client a command opens: against an https
    endpoint whose certificate is signed by a CA of our own, the default (system CAs) and
    another CA fail clearly, naming the certificate check; the right CA and --no-verify
    pass."""
    handle = env.open()
    commit(handle, begin(handle, "run-A"), 0)
    ca, cert, key = make_cert(tmp_path, "good")
    other_ca, _, _ = make_cert(tmp_path, "other")
    proxy = TlsProxy(env.stack.url, cert, key)
    flags = [
        "--url", proxy.url, "--keeper", env.stack.keeper, "--keeper-root", env.root,
        "--staging-database", env.staging, "--connect-timeout", "5", "--json",
    ]  # fmt: skip

    def status(*extra: str) -> tuple[int, Any]:
        capsys.readouterr()
        code = main(["status", *flags, *extra])
        return code, json.loads(capsys.readouterr().out)

    try:
        for extra in ([], ["--ca-cert", str(other_ca)]):
            code, doc = status(*extra)
            assert code == 2, doc  # a usage error: the CA flags must change
            checked(doc, "status")
            assert "certificate verify failed" in doc["error"]["message"].lower(), doc
            assert proxy.url in doc["error"]["message"] and "--ca-cert" in doc["error"]["message"]
        for extra in (["--ca-cert", str(ca)], ["--no-verify"]):
            with warnings.catch_warnings():  # urllib3 warns about --no-verify, as it should
                warnings.simplefilter("ignore")
                code, doc = status(*extra)
            assert code == 0, doc
            assert [j["job"] for j in doc["jobs"]] == [env.job]
    finally:
        proxy.close()
