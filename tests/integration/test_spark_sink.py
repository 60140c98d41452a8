"""The ``clickhouse_tx`` data source in one Spark session: validation before any write,
batch saves with ``txn_version``, and option handling."""

from __future__ import annotations

import time
import uuid
from decimal import Decimal

import pytest

import txsink
from txsink.errors import ConfigError

pytestmark = pytest.mark.spark


def write(df, stack, table, job=None, **opts):
    w = (
        df.write.format("clickhouse_tx")
        .option("url", opts.pop("url", stack.url))
        .option("keeper", opts.pop("keeper", stack.keeper))
        .option("table", table)
        .option("job", job or f"t-{uuid.uuid4().hex[:8]}")
    )
    for k, v in opts.items():
        w = w.option(k, v)
    w.mode("append").save()


def job_recorded(zk, job):
    """The job has meta or an xid record other than a roll-back tombstone (ABORTED: the
    abort of a failed write names the staging it dropped, and nothing else)."""
    import json

    if zk.exists(f"/txsink/jobs/{job}") is None:
        return False
    meta, _ = zk.get(f"/txsink/jobs/{job}")
    xids = (
        zk.get_children(f"/txsink/jobs/{job}/xids") if zk.exists(f"/txsink/jobs/{job}/xids") else []
    )
    states = [json.loads(zk.get(f"/txsink/jobs/{job}/xids/{x}")[0])["state"] for x in xids]
    return bool(meta) or any(s != "ABORTED" for s in states)


def job_exists(zk, job):
    return zk.exists(f"/txsink/jobs/{job}") is not None


@pytest.fixture
def target(ch, fresh_db):
    table = f"{fresh_db}.t"
    ch.command(
        f"CREATE TABLE {table} (id Int64, name String, price Decimal(10, 2), day Date) "
        "ENGINE = MergeTree PARTITION BY toYYYYMM(day) ORDER BY id"
    )
    return table


def rows(spark, n=100, start=0):
    import datetime as dt

    return spark.createDataFrame(
        [
            (i, f"n{i}", Decimal("1.25"), dt.date(2024, 1 + i % 3, 1))
            for i in range(start, start + n)
        ],
        "id long, name string, price decimal(10,2), day date",
    )


def test_batch_save_publishes_all_rows_once(spark, stack, ch, target):
    write(rows(spark, 500), stack, target)
    assert ch.query(f"SELECT count(), uniqExact(id) FROM {target}").result_rows[0] == (500, 500)


def test_batch_save_with_txn_version_rerun_twice_appears_once(spark, stack, ch, target):
    job = f"v-{uuid.uuid4().hex[:8]}"
    for _ in range(3):
        write(rows(spark, 300), stack, target, job=job, txn_version="7")
    write(rows(spark, 10, start=1000), stack, target, job=job, txn_version="8")
    assert ch.query(f"SELECT count(), uniqExact(id) FROM {target}").result_rows[0] == (310, 310)


def test_saves_without_txn_version_are_independent_transactions(spark, stack, ch, target):
    job = f"u-{uuid.uuid4().hex[:8]}"
    write(rows(spark, 50), stack, target, job=job)
    write(rows(spark, 50), stack, target, job=job)
    assert ch.query(f"SELECT count() FROM {target}").result_rows[0][0] == 100


@pytest.mark.parametrize(
    ("ddl", "frame", "expect"),
    [
        (
            "id Int64, name String, price Decimal(10,2), day Date, extra String",
            "id long, name string, price decimal(10,2), day date",
            "extra",
        ),
        ("id Int64, day Date", "id long, name string, price decimal(10,2), day date", "name"),
        (
            "id Int64, name Int32, price Decimal(10,2), day Date",
            "id long, name string, price decimal(10,2), day date",
            "name",
        ),
        (
            "id Int64, name String, price Decimal(4,2), day Date",
            "id long, name string, price decimal(10,2), day date",
            "price",
        ),
    ],
    ids=["missing-column", "extra-column", "type-mismatch", "decimal-precision"],
)
def test_schema_mismatch_is_refused_before_any_write(
    spark, stack, ch, zk, fresh_db, ddl, frame, expect
):
    table = f"{fresh_db}.bad"
    ch.command(f"CREATE TABLE {table} ({ddl}) ENGINE = MergeTree ORDER BY id")
    import datetime as dt

    df = spark.createDataFrame([(1, "a", Decimal("1.00"), dt.date(2024, 1, 1))], frame)
    job = f"bad-{uuid.uuid4().hex[:8]}"
    with pytest.raises(Exception) as info:
        write(df, stack, table, job=job)
    message = str(info.value)
    assert table in message and expect in message
    assert ch.query(f"SELECT count() FROM {table}").result_rows[0][0] == 0
    assert not job_exists(zk, job)


def test_nulls_into_a_non_nullable_column_fail_the_write_and_leave_the_target_untouched(
    spark, stack, ch, zk, target
):
    import datetime as dt

    df = spark.createDataFrame(
        [
            (1, None, Decimal("1.00"), dt.date(2024, 1, 1)),
            (2, "b", Decimal("2.00"), dt.date(2024, 1, 1)),
        ],
        "id long, name string, price decimal(10,2), day date",
    )
    job = f"null-{uuid.uuid4().hex[:8]}"
    with pytest.raises(Exception, match="not Nullable") as info:
        write(df, stack, target, job=job)
    assert "name" in str(info.value)
    assert ch.query(f"SELECT count() FROM {target}").result_rows[0][0] == 0
    assert not job_recorded(zk, job)
    left = ch.query(
        "SELECT count() FROM system.tables "
        "WHERE database='txsink_staging' AND name LIKE {p:String}",
        parameters={"p": f"%{job.replace('-', '_')}%"},
    ).result_rows[0][0]
    assert left == 0


def test_mode_attach_on_a_target_with_a_materialized_view_is_refused_naming_the_view(
    spark, stack, ch, target, fresh_db
):
    ch.command(
        f"CREATE TABLE {fresh_db}.agg (day Date, n UInt64) ENGINE = SummingMergeTree ORDER BY day"
    )
    ch.command(
        f"CREATE MATERIALIZED VIEW {fresh_db}.mv TO {fresh_db}.agg "
        f"AS SELECT day, count() AS n FROM {target} GROUP BY day"
    )
    with pytest.raises(Exception, match="mode=attach is impossible") as info:
        write(rows(spark, 10), stack, target, mode="attach")
    assert "mv" in str(info.value)
    assert ch.query(f"SELECT count() FROM {target}").result_rows[0][0] == 0


def test_unreachable_clickhouse_is_named_in_the_error(spark, stack, ch, target):
    with pytest.raises(Exception, match=r"127\.0\.0\.1:1") as info:
        write(rows(spark, 10), stack, target, url="http://127.0.0.1:1", connect_timeout="2")
    assert "Unavailable" in str(info.value) or "reach" in str(info.value).lower()


def test_unreachable_keeper_is_named_and_nothing_is_written(spark, stack, ch, target):
    with pytest.raises(Exception, match=r"127\.0\.0\.1:2") as info:
        write(rows(spark, 10), stack, target, keeper="127.0.0.1:2", keeper_timeout="2")
    assert "zookeeper" in str(info.value).lower() or "keeper" in str(info.value).lower()
    assert ch.query(f"SELECT count() FROM {target}").result_rows[0][0] == 0


def test_unknown_option_is_refused_with_the_list_of_known_ones(spark, stack, target):
    with pytest.raises(Exception, match="unknown option") as info:
        write(rows(spark, 1), stack, target, blocksize="10")
    assert "block_rows" in str(info.value)


def test_overwrite_mode_is_refused(spark, stack, target):
    df = rows(spark, 1)
    with pytest.raises(Exception, match="only appends"):
        (
            df.write.format("clickhouse_tx")
            .option("url", stack.url)
            .option("keeper", stack.keeper)
            .option("table", target)
            .option("job", "ow")
            .mode("overwrite")
            .save()
        )


def test_sql_insert_into_a_table_of_a_bound_source_is_exact(spark, stack, ch, target):
    """Issue 40's SQL, as Spark 4.x allows it: a table's OPTIONS never reach a Python data
    source writer (pyspark 4.3: empty), so the options are bound to a source registered
    under a name of its own; `CREATE TABLE ... USING` it, then `INSERT INTO` (each one
    transaction), `DataFrameWriterV2.append`. `INSERT OVERWRITE` is refused, nothing
    written. A table without a column list needs a schema the source does not give."""
    name, job = f"tx_{uuid.uuid4().hex[:8]}", f"sql-{uuid.uuid4().hex[:8]}"
    txsink.register(spark, name, url=stack.url, keeper=stack.keeper, table=target, job=job)
    table = f"{name}_orders"
    spark.sql(
        f"CREATE TABLE {table} (id BIGINT, name STRING, price DECIMAL(10,2), day DATE) USING {name}"
    )
    try:
        spark.sql(
            f"INSERT INTO {table} SELECT id, concat('n', id), 1.25, DATE'2024-02-01' FROM range(40)"
        )
        rows(spark, 10, start=100).writeTo(table).append()
        with pytest.raises(Exception, match="only appends"):
            spark.sql(f"INSERT OVERWRITE {table} SELECT 1, 'x', 1.0, DATE'2024-01-01'")
        got = ch.query(f"SELECT count(), uniqExact(id), sum(price) FROM {target}").result_rows
        assert got == [(50, 50, Decimal("62.50"))]
        with pytest.raises(Exception, match="schema"):
            spark.sql(f"CREATE TABLE {table}_x USING {name}")
        with pytest.raises(ConfigError, match="identifier"):
            txsink.register(spark, "clickhouse_tx", url=stack.url, table=target, job=job)
        with pytest.raises(ConfigError, match="replay"):
            txsink.register(spark, "again", url=stack.url, table=target, txn_version=3)
        with pytest.raises(ConfigError, match="a name of its own"):
            txsink.register(spark, url=stack.url, table=target, job=job)
    finally:
        spark.sql(f"DROP TABLE IF EXISTS {table}")


def test_foreach_batch_refuses_bad_options_before_the_query_starts():
    with pytest.raises(ConfigError, match="table"):
        txsink.foreach_batch(url="http://h:1", keeper="k:1", job="j", table="nodot")


def test_metrics_textfile_and_endpoint_count_commits_skips_and_latency(
    spark, stack, tmp_path, ch, target
):
    """The textfile and the driver's scrape endpoint (``metrics_port``, read with urllib
    after the saves, as Prometheus would) show the same totals: the rows written once."""
    import socket
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    metrics = tmp_path / "txsink.prom"
    job = f"m-{uuid.uuid4().hex[:8]}"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for _ in range(2):  # the second save is a replay of txn_version 1: skipped
        write(
            rows(spark, 40), stack, target, job=job, txn_version="1",
            metrics_textfile=str(metrics), metrics_port=str(port),
        )  # fmt: skip
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        scraped = resp.read().decode()

    def values(text):
        return {
            s.name: s.value
            for f in text_string_to_metric_families(text)
            for s in f.samples
            if s.labels.get("job") == job and "le" not in s.labels
        }

    for text in (metrics.read_text(), scraped):
        got = values(text)
        assert got["txsink_batches_committed_total"] == 1
        assert got["txsink_batches_skipped_total"] == 1
        assert got["txsink_rows_committed_total"] == 40
        assert got["txsink_commit_seconds_count"] == 2
        assert got["txsink_last_commit_timestamp_seconds"] > time.time() - 600
    assert "txsink_metrics_endpoint_info" in scraped


def test_the_kafka_example_of_docs_install_over_json_files_is_exact(
    spark, stack, ch, target, tmp_path
):
    """docs/install.md's pipeline (``from_json`` over the value, ``foreach_batch``) with a
    file source in place of Kafka (its connector jars cannot be fetched here); a second
    run over the same checkpoint with one more file adds only that file's rows."""
    import json

    from pyspark.sql import functions as F

    source, job = tmp_path / "topic", f"kafka-{uuid.uuid4().hex[:8]}"
    source.mkdir()

    def produce(k: int, start: int, n: int) -> None:
        lines = [
            json.dumps({"id": i, "name": f"n{i}", "price": "1.25", "day": f"2024-0{1 + i % 3}-01"})
            for i in range(start, start + n)
        ]
        (source / f"part-{k}.json").write_text("\n".join(lines) + "\n")

    def run() -> None:
        schema = "id long, name string, price decimal(10,2), day date"
        (
            spark.readStream.text(str(source))  # Kafka: .format("kafka")...load()
            .select(F.from_json(F.col("value").cast("string"), schema).alias("o"))
            .select("o.*")
            .writeStream.foreachBatch(
                txsink.foreach_batch(url=stack.url, keeper=stack.keeper, table=target, job=job)
            )
            .option("checkpointLocation", str(tmp_path / "chk"))
            .option("maxFilesPerTrigger", 1)
            .trigger(availableNow=True)
            .start()
            .awaitTermination(180)
        )

    listener = txsink.progress_listener(url=stack.url, keeper=stack.keeper, table=target, job=job)
    spark.streams.addListener(listener)
    try:
        produce(0, 0, 120)
        produce(1, 120, 80)
        run()
        produce(2, 200, 50)
        run()
        deadline = time.monotonic() + 30  # listener events arrive asynchronously
        while time.monotonic() < deadline:
            if sum({e.batch: e.rows for e in listener.history}.values()) >= 250:
                break
            time.sleep(0.2)
    finally:
        spark.streams.removeListener(listener)
        listener.close()
    # Spark's progress, next to it what txsink committed: one xid per micro-batch
    seen = {e.batch: e for e in listener.history}
    assert sorted(seen) == list(range(len(seen))) and len(seen) >= 2, listener.history
    assert sum(e.rows for e in seen.values()) == 250
    assert {(e.xid, e.state, e.mode) for e in seen.values()} == {
        (f"b{b}", "COMMITTED", "attach") for b in seen
    }
    assert all(e.commit_ms is not None and e.commit_ms >= 0 for e in seen.values())
    got = ch.query(
        f"SELECT count(), uniqExact(id), sum(price), countIf(name != concat('n', toString(id)))"
        f" FROM {target}"
    ).result_rows[0]
    assert got == (250, 250, Decimal("312.50"), 0)
    # each run ended cleanly (availableNow): its writer is released, not left live
    # until its heartbeat goes stale (issue 41)
    from txsink.config import WriterConfig
    from txsink.driver import borrowed_registry

    config = WriterConfig.from_options(
        {"url": stack.url, "keeper": stack.keeper, "table": target, "job": job}
    )
    deadline, state = time.monotonic() + 30, None  # the listener bus is asynchronous
    while time.monotonic() < deadline and state != "finished":
        with borrowed_registry(config) as registry:
            owner = registry.owner(job)
        state = owner.state if owner is not None else None
        time.sleep(0.2)
    assert state == "finished"


def test_a_job_keeps_its_state_store_for_life_the_other_one_is_refused(spark, stack, ch, target):
    """A job's records live in one store; a writer naming the other would find no job
    there and start it afresh (a txn_version already committed would be written again).
    It is refused before anything is written, naming both stores, in both directions."""
    for first, then in (("keeper", "clickhouse"), ("clickhouse", "keeper")):
        job = f"s-{uuid.uuid4().hex[:8]}"
        before = ch.query(f"SELECT count() FROM {target}").result_rows[0][0]
        write(rows(spark, 40, start=before), stack, target, job=job, txn_version="1", state=first)
        with pytest.raises(Exception, match="fixed for its life") as refused:
            write(rows(spark, 40, start=before), stack, target, job=job, txn_version="1",
                  state=then)  # fmt: skip
        assert "Nothing was written" in str(refused.value) and first in str(refused.value)
        after = ch.query(f"SELECT count(), uniqExact(id) FROM {target}").result_rows[0]
        assert after == (before + 40, before + 40)


def _nothing_written(ch, zk, target, job):
    """The target is empty, no staging of ``job`` is left and Keeper has no record of it."""
    staged = ch.query(
        "SELECT count() FROM system.tables WHERE database = 'txsink_staging' "
        "AND startsWith(name, {p:String})",
        parameters={"p": f"tx_{job}_"},
    ).result_rows[0][0]
    return (
        ch.query(f"SELECT count() FROM {target}").result_rows[0][0] == 0
        and staged == 0
        and not job_recorded(zk, job)
    )


def test_settings_options_reach_every_insert_into_staging_and_the_target(
    spark, stack, ch, fresh_db
):
    """settings.<name> options (issue 28) are sent with txsink's inserts: the server's
    query_log shows the staging inserts of an attach write and the blocks of a dedup
    write carrying the log_comment and max_insert_threads given."""
    target = f"{fresh_db}.s"
    ch.command(
        f"CREATE TABLE {target} (id Int64, name String, price Decimal(10, 2), day Date) "
        "ENGINE = MergeTree PARTITION BY toYYYYMM(day) ORDER BY id "
        "SETTINGS non_replicated_deduplication_window = 1000"
    )
    tags = {}
    for n, mode in enumerate(("attach", "dedup")):
        tags[mode] = tag = f"txsink-test-{uuid.uuid4().hex[:8]}"
        settings = {"settings.log_comment": tag, "settings.max_insert_threads": "1"}
        write(rows(spark, 60, start=100 * n), stack, target, mode=mode, **settings)
    assert ch.query(f"SELECT count(), uniqExact(id) FROM {target}").result_rows[0] == (120, 120)
    ch.command("SYSTEM FLUSH LOGS")
    for mode, tag in tags.items():
        logged = ch.query(
            "SELECT count(), countIf(Settings['max_insert_threads'] = '1'), "
            "groupUniqArrayArray(tables) FROM merge('system', '^query_log(_[0-9]+)?$') "
            "WHERE log_comment = {tag:String} AND query_kind = 'Insert' "
            "AND type = 'QueryFinish'",
            parameters={"tag": tag},
        ).result_rows[0]
        inserts, with_threads, tables = logged
        assert inserts >= 1 and with_threads == inserts, (mode, logged)
        into = {t.split(".", 1)[0] for t in tables}
        if mode == "attach":
            assert into == {"txsink_staging"}, (mode, tables)
        else:  # a guarded block also reads its seal, the block counter and its input
            assert f"{fresh_db}.s" in tables, (mode, tables)
            assert into - {fresh_db} <= {"txsink_staging", "system", "_table_function"}, tables


def test_a_refused_or_unknown_setting_fails_before_anything_is_written(
    spark, stack, ch, zk, target
):
    """A setting txsink owns is refused naming it, why and what to do instead; a name
    the server does not know gets a did-you-mean; in both cases nothing is written."""
    job = f"r-{uuid.uuid4().hex[:8]}"
    with pytest.raises(Exception, match=r"settings\.insert_deduplicate") as refused:
        write(rows(spark, 10), stack, target, job=job, **{"settings.insert_deduplicate": "0"})
    assert "which txsink owns" in str(refused.value) and "leave it out" in str(refused.value)
    assert _nothing_written(ch, zk, target, job)
    with pytest.raises(Exception, match="did you mean insert_quorum") as unknown:
        write(rows(spark, 10), stack, target, job=job, **{"settings.insert_quorom": "1"})
    assert "nothing was written" in str(unknown.value)
    assert _nothing_written(ch, zk, target, job)
    with pytest.raises(Exception, match="the server refused them") as bad_value:
        write(rows(spark, 10), stack, target, job=job, **{"settings.insert_quorum": "two"})
    assert "insert_quorum" in str(bad_value.value)
    assert _nothing_written(ch, zk, target, job)
