"""Helpers for end-to-end tests: a source, a target and a job run in a subprocess.

Spark runs in a child process (``python -m txsink.demo job``) so that fault points and
``kill -9`` end a real driver, exactly as in production; the test process only reads
the results back through ClickHouse and Keeper.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from txsink.config import WriterConfig
from txsink.demo import job_args, make_source, run_job_once, target_ddl
from txsink.driver import open_registry
from txsink.protocol.ids import staging_prefix
from txsink.protocol.states import XidRecord


@dataclass
class Job:
    name: str
    table: str
    src: Path
    checkpoint: Path
    url: str
    keeper: str
    produced: int
    amount: int
    log: Path
    options: dict[str, str] = field(default_factory=dict)  # more sink options, every run

    def args(self, *extra: str, mode: str = "attach", files_per_trigger: int = 2) -> list[str]:
        more = [a for k, v in self.options.items() for a in ("--option", f"{k}={v}")]
        return job_args(
            self.src, self.checkpoint, self.table, self.name, self.url, self.keeper,
            *more, *extra, mode=mode, files_per_trigger=files_per_trigger,
        )  # fmt: skip

    def run(
        self, *extra: str, mode: str = "attach", files_per_trigger: int = 2, **kwargs: Any
    ) -> int:
        args = self.args(*extra, mode=mode, files_per_trigger=files_per_trigger)
        return run_job_once(args, log_path=str(self.log), **kwargs)

    def log_tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""

    def config(self) -> WriterConfig:
        return WriterConfig.from_options(
            {"url": self.url, "keeper": self.keeper, "table": self.table, "job": self.name}
            | self.options
        )

    def records(self) -> list[XidRecord]:
        registry = open_registry(self.config())
        try:
            return registry.list(self.name)
        finally:
            registry.close()


def new_job(
    tmp_path: Path,
    ch: Any,
    db: str,
    url: str,
    keeper: str,
    *,
    files: int = 4,
    rows_per_file: int = 3000,
    ddl: str | None = None,
    options: dict[str, str] | None = None,
) -> Job:
    table = f"{db}.orders"
    ch.command(ddl.format(table=table) if ddl else target_ddl(table))
    source = make_source(tmp_path / "src", files, rows_per_file)
    return Job(
        name=f"it-{uuid.uuid4().hex[:10]}",
        table=table,
        src=tmp_path / "src",
        checkpoint=tmp_path / "ckpt",
        url=url,
        keeper=keeper,
        produced=source["rows"],
        amount=source["amount"],
        log=tmp_path / "job.log",
        options=dict(options or {}),
    )


#: the state in ClickHouse (KeeperMap) and a Keeper address nothing listens on: a job
#: with these options proves that neither driver nor executor opens a Keeper connection
STATE_IN_CLICKHOUSE = {"state": "clickhouse"}
NO_KEEPER = "127.0.0.1:9"


def assert_exact(ch: Any, job: Job) -> None:
    count, distinct, amount = ch.query(
        f"SELECT count(), uniqExact(id), sum(amount) FROM {job.table}"
    ).result_rows[0]
    assert (count, distinct) == (job.produced, job.produced), (
        f"count={count} uniqExact={distinct} produced={job.produced}\n{job.log_tail()}"
    )
    assert amount == job.amount


def staging_left(ch: Any, job: Job) -> list[str]:
    registry = open_registry(job.config())
    try:
        prefix = staging_prefix(job.name, registry.namespace())
    finally:
        registry.close()
    rows = ch.query(
        "SELECT name FROM system.tables "
        "WHERE database = 'txsink_staging' AND startsWith(name, {p:String})",
        parameters={"p": prefix + "__"},
    ).result_rows
    return [r[0] for r in rows]
