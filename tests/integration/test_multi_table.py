"""Several tables, one xid (``txsink.transaction``) on real Spark, chdb and ZooKeeper.

In-process tests cover the batch form (``txn_version``) and the roll-back of an
exception; the crash matrix runs the two-table streaming job of the demo
(``python -m txsink.demo job --two-tables``) in a subprocess, crashed at every driver
fault point and by a fault between the two writes, restarted from its checkpoint.
"""

from __future__ import annotations

import json
import uuid

import pytest

import txsink
from tests.integration.sparkjob import NO_KEEPER, STATE_IN_CLICKHOUSE, Job, new_job, staging_left
from txsink.cli.main import main
from txsink.demo import TWO_TABLE_POINTS, daily_ddl, daily_table, target_ddl
from txsink.driver import open_registry
from txsink.errors import ConfigError
from txsink.faults import EXIT_CODE
from txsink.ops.verify import verify_job
from txsink.protocol.states import XidState

pytestmark = [pytest.mark.spark]

DRIVER_POINTS = TWO_TABLE_POINTS  # the demo crashes the same job at the same points


def _tables(ch, db):
    facts, daily = f"{db}.orders", daily_table(f"{db}.orders")
    ch.command(target_ddl(facts))
    ch.command(daily_ddl(daily))
    return facts, daily


def _frames(spark, n=3000):
    df = spark.range(n).selectExpr(
        "id",
        "timestamp '2024-01-01 00:00:00' + make_interval(0, 0, 0, cast(id % 90 as int)) "
        "as event_time",
        "date_add(date '2024-01-01', cast(id % 90 as int)) as day",
        "concat('c', cast(id % 7 as string)) as customer",
        "id * 3 as amount",
    )
    daily = df.groupBy("day").agg({"id": "count", "amount": "sum"})
    daily = daily.selectExpr(
        "cast(0 as bigint) as batch", "day", "`count(id)` as orders", "`sum(amount)` as amount"
    )
    return df, daily


def _opts(stack, job):
    return {"url": stack.url, "keeper": stack.keeper, "job": job}


def test_a_txn_version_save_of_two_tables_is_one_xid_and_its_rerun_is_a_no_op(
    spark, stack, ch, fresh_db
):
    facts, daily = _tables(ch, fresh_db)
    df, agg = _frames(spark)
    job = f"mt-{uuid.uuid4().hex[:8]}"
    for _ in range(2):  # the second run is a rerun of version 7: nothing is written again
        with txsink.transaction(spark, txn_version=7, **_opts(stack, job)) as tx:
            tx.write(df, table=facts)
            tx.write(agg, table=daily)
    assert ch.query(f"SELECT count(), uniqExact(id) FROM {facts}").result_rows[0] == (3000, 3000)
    assert ch.query(f"SELECT count(), sum(orders) FROM {daily}").result_rows[0] == (90, 3000)
    registry = open_registry(_config(stack, job, facts))
    try:
        records = registry.list(job)
        meta = registry.job_meta(job)
        ledger = registry.ledger(job)
    finally:
        registry.close()
    assert [(r.xid, r.state) for r in records] == [("b7", XidState.COMMITTED)]
    assert set(records[0].targets) == {facts, daily}
    assert records[0].table_rows() == {facts: 3000, daily: 90}
    assert meta is not None and meta.targets == {facts: "attach", daily: "attach"}
    assert ledger.tables == {facts: 3000, daily: 90} and ledger.committed == 1


def test_an_exception_inside_the_block_leaves_nothing_visible_and_no_staging(
    spark, stack, ch, fresh_db
):
    facts, daily = _tables(ch, fresh_db)
    df, agg = _frames(spark)
    job = f"mt-{uuid.uuid4().hex[:8]}"
    with (
        pytest.raises(RuntimeError, match="boom"),
        txsink.transaction(spark, txn_version=1, **_opts(stack, job)) as tx,
    ):
        assert tx.write(df, table=facts) == 3000
        tx.write(agg, table=daily)
        raise RuntimeError("boom")
    assert ch.query(f"SELECT count() FROM {facts}").result_rows[0][0] == 0
    assert ch.query(f"SELECT count() FROM {daily}").result_rows[0][0] == 0
    fake = Job(job, facts, None, None, stack.url, stack.keeper, 0, 0, None)  # type: ignore[arg-type]
    assert staging_left(ch, fake) == []
    registry = open_registry(_config(stack, job, facts))
    try:
        record = registry.get(job, "b1")
    finally:
        registry.close()
    assert record is not None and record.state is XidState.ABORTED
    # the same version written again afterwards commits both tables
    with txsink.transaction(spark, txn_version=1, **_opts(stack, job)) as tx:
        tx.write(df, table=facts)
        tx.write(agg, table=daily)
    assert ch.query(f"SELECT count() FROM {facts}").result_rows[0][0] == 3000


@pytest.mark.parametrize("first, second", [("partition", "batch"), ("batch", "partition")])
def test_a_transaction_mixing_visibilities_is_refused_and_leaves_nothing(
    spark, stack, ch, fresh_db, first, second
):
    """One xid is published one way: a second table whose options say another visibility
    than the first's is refused before it stages, and the first table's staging is rolled
    back (before, the second table silently took the first write's visibility)."""
    facts, daily = _tables(ch, fresh_db)
    df, agg = _frames(spark, n=300)
    job = f"mt-{uuid.uuid4().hex[:8]}"
    with (
        pytest.raises(ConfigError, match="visibility"),
        txsink.transaction(spark, txn_version=1, **_opts(stack, job)) as tx,
    ):
        tx.write(df, table=facts, visibility=first)
        tx.write(agg, table=daily, visibility=second)
    assert ch.query(f"SELECT count() FROM {facts}").result_rows[0][0] == 0
    assert ch.query(f"SELECT count() FROM {daily}").result_rows[0][0] == 0
    fake = Job(job, facts, None, None, stack.url, stack.keeper, 0, 0, None)  # type: ignore[arg-type]
    assert staging_left(ch, fake) == []
    with txsink.transaction(spark, txn_version=1, **_opts(stack, job)) as tx:
        tx.write(df, table=facts, visibility="batch")
        tx.write(agg, table=daily, visibility="batch")
    assert ch.query(f"SELECT count(), uniqExact(id) FROM {facts}").result_rows[0] == (300, 300)


def _config(stack, job, table):
    from txsink.config import WriterConfig

    return WriterConfig.from_options(
        {"url": stack.url, "keeper": stack.keeper, "job": job, "table": table}
    )


def _committed_xids_hold_both_tables(ch, job: Job, daily: str) -> None:
    """Every COMMITTED xid published both tables, and its daily rows count its facts."""
    per_batch = dict(ch.query(f"SELECT batch, sum(orders) FROM {daily} GROUP BY batch").result_rows)
    for r in job.records():
        if r.state is not XidState.COMMITTED:
            continue
        rows = r.table_rows()
        assert set(rows) == {job.table, daily}, r
        assert per_batch.get(r.batch, 0) == rows[job.table], (r.xid, per_batch, rows)


@pytest.mark.parametrize(
    "points",
    [
        pytest.param(("driver.mid_commit",), id="key-points"),
        pytest.param(DRIVER_POINTS, id="every-point", marks=pytest.mark.slow),
    ],
)
def test_two_table_stream_crashed_at_every_driver_point_is_exact_in_both_tables(
    stack, ch, zk, fresh_db, tmp_path, capsys, points
):
    """With its state in ClickHouse (``state=clickhouse``, KeeperMap) and a Keeper address
    nothing listens on: neither driver nor executor needs Keeper, and the CLI reads and
    changes the job through the same store."""
    job = new_job(tmp_path, ch, fresh_db, stack.url, NO_KEEPER, files=len(points) + 3,
                  rows_per_file=500, options=STATE_IN_CLICKHOUSE)  # fmt: skip
    daily = daily_table(job.table)
    ch.command(daily_ddl(daily))
    for point in points:
        crashed = job.run("--two-tables", files_per_trigger=1, fault=point, fault_after=0)
        assert crashed == EXIT_CODE, f"the job was supposed to die at {point}\n{job.log_tail()}"
        _committed_xids_hold_both_tables(ch, job, daily)
    assert job.run("--two-tables", files_per_trigger=1) == 0, job.log_tail()
    count, distinct, amount = ch.query(
        f"SELECT count(), uniqExact(id), sum(amount) FROM {job.table}"
    ).result_rows[0]
    assert (count, distinct, amount) == (job.produced, job.produced, job.amount), job.log_tail()
    per_day = ch.query(
        f"SELECT day, count() FROM {job.table} GROUP BY day ORDER BY day"
    ).result_rows
    daily_per_day = ch.query(
        f"SELECT day, sum(orders) FROM {daily} GROUP BY day ORDER BY day"
    ).result_rows
    assert per_day == daily_per_day
    assert ch.query(f"SELECT sum(amount) FROM {daily}").result_rows[0][0] == job.amount
    _committed_xids_hold_both_tables(ch, job, daily)
    assert staging_left(ch, job) == []
    records = job.records()
    assert records and all(r.state is XidState.COMMITTED for r in records)
    assert sorted(r.batch for r in records) == list(range(len(records)))
    result = verify_job(job.config())  # reconciles each table against its own ledger cut
    assert result.clean, result.to_json()
    assert set(result.checked["tables"]) == {job.table, daily}
    assert not zk.exists(f"/txsink/jobs/{job.name}"), "state=clickhouse wrote to Keeper"
    flags = ["--url", stack.url, "--keeper", NO_KEEPER, "--state", "clickhouse",
             "--job", job.name, "--json"]  # fmt: skip
    for command in ("status", "verify", "recover"):
        capsys.readouterr()
        code = main([command, *flags])
        out = json.loads(capsys.readouterr().out)
        assert code == 0, (command, out)
        assert job.name in json.dumps(out), (command, out)
