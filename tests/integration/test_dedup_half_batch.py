"""A dedup-mode batch refused half-way is never silently half-visible, and no rerun can
duplicate it (docs/modes.md#a-dedup-batch-stopped-half-way).

Real Spark (local[2]), the real ClickHouse engine and ZooKeeper. 200 rows in 4 Spark
partitions of 50, blocks of 10 rows; one value (-1 into ``UInt32``) sits in the fifth
block of the last partition, so at least that partition's first four blocks, and
whatever the other tasks sent, are in the target when the batch fails. Then: status and
recover name the batch; a plain save and a new ``txn_version`` are refused with the
target untouched; the rerun of the same ``txn_version`` with the value corrected in
place completes the batch exactly (``count() == uniqExact(id) == 200``, every value as
written). The second test gives a failed plain save up with ``recover --discard-dedup``.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

import pytest

from tests.cli_schema import checked
from txsink.cli.main import main
from txsink.ops.status import job_status
from txsink.ops.stores import open_stores

pytestmark = pytest.mark.spark

ROWS, PARTITIONS, BAD_ID = 200, 4, 190


def _frame(spark: Any, bad: bool, start: int = 0) -> Any:
    value = f"if(id = {BAD_ID}, -1, id)" if bad else "id"
    return spark.range(start, start + ROWS, 1, PARTITIONS).selectExpr(
        "id", f"cast({value} as int) AS v"
    )


class World:
    def __init__(self, stack: Any, ch: Any, db: str) -> None:
        self.stack, self.ch = stack, ch
        self.table = f"{db}.half"
        self.job = f"half-{uuid.uuid4().hex[:8]}"
        self.root = f"/txsink-half-{uuid.uuid4().hex[:8]}"
        ch.command(
            f"CREATE TABLE {self.table} (id Int64, v UInt32) ENGINE = MergeTree ORDER BY id "
            "SETTINGS non_replicated_deduplication_window = 1000"
        )

    def save(self, df: Any, txn_version: int | None = None) -> None:
        w = (
            df.write.format("clickhouse_tx")
            .option("url", self.stack.url)
            .option("keeper", self.stack.keeper)
            .option("keeper_root", self.root)
            .option("table", self.table)
            .option("job", self.job)
            .option("mode", "dedup")
            .option("block_rows", "10")
        )
        if txn_version is not None:
            w = w.option("txn_version", str(txn_version))
        w.mode("append").save()

    def refused(self, df: Any, txn_version: int | None = None) -> str:
        with pytest.raises(Exception) as caught:
            self.save(df, txn_version)
        return str(caught.value)

    def counts(self) -> tuple[int, int, int]:
        c, u, wrong = self.ch.query(
            f"SELECT count(), uniqExact(id), countIf(v != id) FROM {self.table}"
        ).result_rows[0]
        return int(c), int(u), int(wrong)

    def flags(self) -> list[str]:
        return ["--url", self.stack.url, "--keeper", self.stack.keeper,
                "--keeper-root", self.root]  # fmt: skip

    def half_visible(self) -> list[str]:
        with open_stores(self.stack.url, self.stack.keeper, keeper_root=self.root) as stores:
            status = job_status(stores, self.job, stale_after=0.0)
        return [w.xid or "" for w in status.warnings if w.kind == "half-visible-dedup"]

    def cli(self, capsys: Any, *args: str) -> tuple[int, dict[str, Any]]:
        code = main(["recover", *args, "--job", self.job, *self.flags(), "--json"])
        return code, checked(json.loads(capsys.readouterr().out), "recover")


@pytest.fixture
def world(stack: Any, ch: Any, fresh_db: str) -> World:
    return World(stack, ch, fresh_db)


def test_a_refused_value_leaves_a_named_half_batch_that_only_its_rerun_completes(
    spark: Any, world: World, capsys: Any
) -> None:
    text = world.refused(_frame(spark, bad=True), txn_version=5)
    assert "column v" in text and "-1" in text
    assert "blocks of xid b5 sent before it" in text and "txn_version=5" in text
    visible = world.counts()
    assert 40 <= visible[0] < ROWS and visible[0] == visible[1] and visible[2] == 0

    # status and recover name it
    assert world.half_visible() == ["b5"]
    code, doc = world.cli(capsys, "--dry-run", "--stale-after", "0")
    assert code == 0, doc
    assert [b["xid"] for b in doc["jobs"][0]["open_dedup"]] == ["b5"]
    assert doc["jobs"][0]["open_dedup"][0]["rows_at_least"] <= visible[0]

    # no other batch may write: a plain save, a new txn_version; the target is untouched
    for version in (None, 6):
        text = world.refused(_frame(spark, bad=False), txn_version=version)
        assert "HalfVisibleBatch" in text and "b5" in text and "stopped half-way" in text
        assert world.counts() == visible

    # the rerun of b5 with the value corrected in place resumes and commits exactly
    world.save(_frame(spark, bad=False), txn_version=5)
    assert world.counts() == (ROWS, ROWS, 0)
    assert world.half_visible() == []
    world.save(_frame(spark, bad=False, start=ROWS), txn_version=6)
    assert world.counts() == (2 * ROWS, 2 * ROWS, 0)


def test_a_failed_plain_save_is_given_up_with_discard_dedup_and_never_written_again(
    spark: Any, world: World, ch: Any, capsys: Any
) -> None:
    text = world.refused(_frame(spark, bad=True))
    assert "cannot be rerun under its xid" in text
    found = re.search(r"blocks of xid (u[0-9a-f]+)", text)
    assert found is not None
    xid = found.group(1)
    assert world.half_visible() == [xid]
    code, doc = world.cli(capsys, "--yes", "--stale-after", "0")
    assert code == 4 and [b["xid"] for b in doc["jobs"][0]["open_dedup"]] == [xid]

    # the operator deletes the rows, then gives the batch up
    ch.command(f"TRUNCATE TABLE {world.table}")
    code, doc = world.cli(capsys, "--discard-dedup", "u000000000000", "--yes")
    assert code != 0 and "not a dedup batch stopped half-way" in json.dumps(doc)
    code, doc = world.cli(capsys, "--discard-dedup", xid, "--yes", "--stale-after", "0")
    assert code == 0, doc
    assert doc["jobs"][0]["outcome"]["discarded"]["xid"] == xid
    assert world.half_visible() == []

    world.save(_frame(spark, bad=False))
    assert world.counts() == (ROWS, ROWS, 0)
