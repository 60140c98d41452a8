"""A task attempt frozen mid-write (SIGSTOP, as a GC pause or a network partition freezes
an executor) and thawed after its batch was committed by another attempt: the target stays
exact whatever the target's dedup window has forgotten meanwhile (issue 38, row 1).

Each attempt is a real process (:mod:`tests.integration.zombie_task`) running the executor
entry against the embedded stack; the driver-side commit is :func:`txsink.committer.commit_batch`.
The frozen attempt stops itself when it pulls its first block: it has passed the replay check
(its batch was not committed yet) and read nothing else.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from pyspark.sql.types import LongType, StructField, StructType

from txsink.cli.main import main as cli_main
from txsink.committer import abort_batch, commit_batch
from txsink.config import WriterConfig
from txsink.errors import TxSinkError
from txsink.spark.messages import WritePlan
from txsink.spark.validate import validate

WINDOW = 5  # the target's dedup window, in parts
ROWS = 6  # the frozen partition's rows: 3 blocks of 2
BATCH = 0  # a fresh job: its first micro-batch (a later one needs option first_batch)
SCHEMA = StructType([StructField("id", LongType(), False)])


class Attempt:
    """One task attempt of partition 0 of batch ``BATCH``, in its own process."""

    def __init__(self, plan_file: Path, attempt: int, *, freeze: bool | str) -> None:
        self.plan_file, self.attempt = plan_file, attempt
        args = [str(plan_file), "0", str(attempt), str(BATCH), "0", str(ROWS)]
        how = ["freeze" if freeze is True else freeze] if freeze else []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.integration.zombie_task", *args, *how],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        if freeze:  # returns once the process stopped itself (or died: then say why)
            _, status = os.waitpid(self.proc.pid, os.WUNTRACED)
            assert os.WIFSTOPPED(status), f"the attempt did not freeze: {self.proc.stderr}"

    def thaw(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def result(self) -> dict[str, Any]:
        out, err = self.proc.communicate(timeout=120)
        assert self.proc.returncode == 0, err[-3000:]
        doc: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
        return doc

    def message(self) -> Any:
        with open(f"{self.plan_file}.{self.attempt}.msg", "rb") as fh:
            return pickle.load(fh)


def make_plan(stack: Any, table: str, tmp_path: Path, **options: str) -> tuple[WritePlan, Path]:
    opts = {"url": stack.url, "keeper": stack.keeper, "table": table, "block_rows": "2"}
    opts["job"] = f"z-{uuid.uuid4().hex[:8]}"
    plan = validate(WriterConfig.from_options({**opts, **options}), SCHEMA)
    path = tmp_path / "plan.pickle"
    path.write_bytes(pickle.dumps(plan))
    return plan, path


def other_writers(ch: Any, table: str, parts: int) -> None:
    """Other writers' parts: each insert one part (and one token) in the target's window."""
    for i in range(parts):
        ch.insert_arrow(table, pa.table({"id": pa.array([1000 + i], pa.int64())}))


def assert_exact(ch: Any, table: str, produced: int) -> None:
    expected = sum(range(ROWS)) + sum(1000 + i for i in range(produced - ROWS))
    got = ch.query(f"SELECT count(), uniqExact(id), sum(id) FROM {table}").result_rows[0]
    assert tuple(got) == (produced, produced, expected), f"{got[0] - got[1]} duplicated row(s)"


@pytest.mark.parametrize("freeze", ["freeze", "freeze-send"])
def test_a_dedup_attempt_thawed_after_its_batch_committed_writes_nothing(
    stack, ch, fresh_db, tmp_path, freeze
):
    """The straddle of the issue: the frozen attempt passed the replay check, its batch is
    then committed by another attempt (whose records the commit deletes) and more parts
    than the window holds are inserted; thawed, it must not send its blocks again.
    ``freeze-send``: frozen after every check of its own, right before its first insert
    is sent; only the server's check of the batch's seal row stops it."""
    table = f"{fresh_db}.t"
    ch.command(
        f"CREATE TABLE {table} (id Int64) ENGINE = MergeTree ORDER BY id "
        f"SETTINGS non_replicated_deduplication_window = {WINDOW}"
    )
    plan, path = make_plan(stack, table, tmp_path, mode="dedup", dedup_min_window=str(WINDOW))
    zombie = Attempt(path, 0, freeze=freeze)
    try:
        winner = Attempt(path, 1, freeze=False)
        assert winner.result()["rows"] == ROWS
        assert commit_batch(plan, [winner.message()], BATCH)["action"] == "committed"
        other_writers(ch, table, WINDOW + 1)  # the winner's tokens leave the window
    finally:
        zombie.thaw()
    late = zombie.result()
    assert_exact(ch, table, ROWS + WINDOW + 1)
    assert late.get("skipped") or "error" in late, late


@pytest.mark.parametrize("visibility", ["partition", "batch"])
def test_an_attach_attempt_thawed_after_its_batch_committed_never_publishes(
    stack, ch, fresh_db, tmp_path, visibility
):
    """In attach mode a task only stages: the thawed attempt's staging is never moved into
    the target, and ``txsink recover`` drops it (its xid is committed)."""
    table = f"{fresh_db}.t"
    ch.command(f"CREATE TABLE {table} (id Int64) ENGINE = MergeTree ORDER BY id")
    plan, path = make_plan(stack, table, tmp_path, mode="attach", visibility=visibility)
    zombie = Attempt(path, 0, freeze=True)
    try:
        winner = Attempt(path, 1, freeze=False)
        assert winner.result()["rows"] == ROWS
        assert commit_batch(plan, [winner.message()], BATCH)["action"] == "committed"
        other_writers(ch, table, WINDOW + 1)
    finally:
        zombie.thaw()
    late = zombie.result()
    assert_exact(ch, table, ROWS + WINDOW + 1)
    staged = late.get("staging", [])
    db = plan.config.staging_database
    assert staged, late  # it staged its rows after the commit: left behind, never published
    for name in staged:
        assert ch.command(f"EXISTS TABLE {db}.{name}") == 1
    flags = ["--url", stack.url, "--keeper", stack.keeper, "--job", plan.config.job]
    assert cli_main(["recover", *flags, "--yes", "--stale-after", "0"]) == 0
    assert_exact(ch, table, ROWS + WINDOW + 1)
    for name in staged:
        assert ch.command(f"EXISTS TABLE {db}.{name}") == 0, f"{name} was not dropped"


def test_a_batch_staged_after_the_target_was_retyped_is_refused_before_its_prepare(
    stack, ch, fresh_db, tmp_path
):
    """A task sends its staging CREATE without reading it back: the commit's one read
    compares every staging table with the columns the task's values were checked for.
    The target retyped after the driver's validation (``id`` Int64 -> Int32, which would
    wrap larger values) makes staging the values no longer fit: the commit refuses,
    names the table, prepares nothing, and the abort drops the staging."""
    table = f"{fresh_db}.t"
    ch.command(f"CREATE TABLE {table} (id Int64, k UInt8 DEFAULT 0) ENGINE = MergeTree ORDER BY k")
    plan, path = make_plan(stack, table, tmp_path, mode="attach")
    ch.command(f"ALTER TABLE {table} MODIFY COLUMN id Int32")
    attempt = Attempt(path, 0, freeze=False)
    assert attempt.result()["rows"] == ROWS
    message = attempt.message()
    with pytest.raises(TxSinkError, match="columns differ") as refused:
        commit_batch(plan, [message], BATCH)
    assert message.staging[0] in str(refused.value)
    abort_batch(plan, [message], BATCH)
    assert ch.command(f"SELECT count() FROM {table}") == 0
    db = plan.config.staging_database
    assert ch.command(f"EXISTS TABLE {db}.{message.staging[0]}") == 0
    flags = ["--url", stack.url, "--keeper", stack.keeper, "--job", plan.config.job, "--json"]
    assert cli_main(["status", *flags]) == 0


def test_a_target_retyped_after_the_tasks_staged_is_refused_before_the_prepare(
    stack, ch, fresh_db, tmp_path
):
    """The task's staging matches what was validated, but the target changed before the
    commit: its MOVE or ATTACH would fail after the prepare, for an operator. The commit's
    one read sees the target's columns as they are now and refuses before the prepare."""
    table = f"{fresh_db}.t"
    ch.command(f"CREATE TABLE {table} (id Int64, k UInt8 DEFAULT 0) ENGINE = MergeTree ORDER BY k")
    plan, path = make_plan(stack, table, tmp_path, mode="attach")
    attempt = Attempt(path, 0, freeze=False)
    assert attempt.result()["rows"] == ROWS
    message = attempt.message()
    ch.command(f"ALTER TABLE {table} MODIFY COLUMN id Int32")
    with pytest.raises(TxSinkError, match=r"changed while the batch ran: column\(s\) id"):
        commit_batch(plan, [message], BATCH)
    abort_batch(plan, [message], BATCH)
    assert ch.command(f"SELECT count() FROM {table}") == 0
    db = plan.config.staging_database
    assert ch.command(f"EXISTS TABLE {db}.{message.staging[0]}") == 0
    flags = ["--url", stack.url, "--keeper", stack.keeper, "--job", plan.config.job]
    assert cli_main(["recover", *flags, "--dry-run", "--json"]) == 0  # nothing PREPARED
