"""Several tables, one xid: the pure parts (records, plans, ledger, codec, job tables) and
the transaction runner over the in-memory twins, crashed at every driver fault point."""

from __future__ import annotations

import json

import pytest

from txsink.errors import ConfigError, RecoveryAlarm
from txsink.ports import ledger as lg
from txsink.ports.manifest_codec import (
    decode_manifest,
    encode_manifest,
    pack_record,
    unpack_record,
)
from txsink.ports.registry_memory import MemoryRegistry
from txsink.ports.warehouse_memory import MemoryWarehouse
from txsink.protocol import ops as plan_ops
from txsink.protocol import planner, plans
from txsink.protocol.codec import decode_part, decode_record, encode_part, encode_record
from txsink.protocol.ids import batch_xid, staging_name
from txsink.protocol.job import JobFacts, tables_refusal
from txsink.protocol.job import primary_target as primary
from txsink.protocol.states import Mode, StagedPart, XidRecord, XidState
from txsink.spark.validate import pinned_mode
from txsink.transactor import Transactor

FACTS, DAILY, JOB = "shop.orders", "shop.daily", "orders"
U1, U2 = "a" * 16, "b" * 16


def record(*parts: StagedPart, state: XidState = XidState.PREPARED) -> XidRecord:
    return XidRecord(
        JOB, "b3", 3, state, 1, Mode.ATTACH, FACTS, tuple(parts), tables=(DAILY, FACTS)
    )


def two_tables() -> XidRecord:
    return record(
        StagedPart("s1", "202401", 5, uuids=(U1,)),
        StagedPart("s2", "202401", 2, uuids=(U2,), target=DAILY),
        StagedPart("s2", "202402", 1, target=DAILY),
    )


# ------------------------------------------------------------------------ records


def test_an_entry_of_the_records_own_table_keeps_the_old_json_and_old_records_load():
    own = StagedPart("s1", "p", 1)
    assert "target" not in encode_part(own)
    assert encode_part(StagedPart("s2", "p", 1, target=DAILY))["target"] == DAILY
    old = {"table": "s1", "partition_id": "p", "rows": 1}
    assert decode_part(old) == own
    rec = two_tables()
    assert decode_record(json.loads(json.dumps(encode_record(rec)))) == rec


def test_a_record_knows_every_table_and_rows_per_table_even_without_entries():
    rec = record(StagedPart("s1", "p", 4))
    assert set(rec.targets) == {FACTS, DAILY}
    assert rec.table_rows() == {FACTS: 4, DAILY: 0}
    assert two_tables().partition_rows(DAILY) == {"202401": 2, "202402": 1}
    assert two_tables().ledger_rows() == {"202401": 5, f"{DAILY}/202401": 2, f"{DAILY}/202402": 1}


# ------------------------------------------------------------------------ plans


def test_each_entry_is_published_into_its_own_table_and_committed_after_all():
    rec = two_tables()
    view = {"s1": {"202401": 5}, "s2": {"202401": 2, "202402": 1}}
    ops = planner.plan_publish(rec, view)
    moves = [
        (op.staging, op.partition_id, op.target) for op in ops if isinstance(op, plan_ops.Publish)
    ]
    assert moves == [("s1", "202401", FACTS), ("s2", "202401", DAILY), ("s2", "202402", DAILY)]
    kinds = [type(op).__name__ for op in ops]
    assert kinds.index("RecordCommitted") > max(i for i, k in enumerate(kinds) if k == "Publish")


def test_evidence_of_publish_is_looked_up_in_each_entrys_own_table():
    rec = two_tables()
    view = {"s1": {}, "s2": {"202402": 1}}
    assert planner.evidence_by_target(rec, view, resumed=False) == {FACTS: (U1,), DAILY: (U2,)}
    ops = planner.plan_publish(rec, view, published=frozenset({U1, U2}))
    assert [op.target for op in ops if isinstance(op, plan_ops.Publish)] == [DAILY]


def test_one_tables_staging_missing_publishes_no_table_of_the_xid():
    ops = planner.plan_publish(two_tables(), {"s1": {"202401": 5}, "s2": None})
    assert len(ops) == 1 and isinstance(ops[0], plan_ops.Alarm)


def test_a_replayed_multi_table_batch_drops_every_tables_fresh_staging():
    existing = two_tables()
    replay = record(StagedPart("s9", "202401", 5), StagedPart("s8", "p", 1, target=DAILY))
    decision = plans.decide_batch(existing, replay, 2, streaming=True, epoch=2)
    assert decision.action == "roll_forward_existing" and set(decision.drop) == {"s9", "s8"}


# ------------------------------------------------------------------------ codec


@pytest.mark.parametrize("inline", [64 * 1024, 0])
def test_the_compact_manifest_round_trips_targets_and_part_uuids(inline):
    rec = two_tables()
    compact = encode_manifest(rec.manifest)
    assert [decode_part(e) for e in decode_manifest(compact)] == list(rec.manifest)
    packed = pack_record(rec, "n0nce1", inline_bytes=inline)
    assert (packed.ref is None) == bool(inline)
    back = unpack_record(packed.node, list(packed.chunks), 0, "test")
    assert back.manifest == rec.manifest and back.targets == rec.targets


def test_a_run_of_the_records_own_table_has_no_target_field():
    compact = encode_manifest((StagedPart("tx_a", "p", 1), StagedPart("tx_b", "p", 2)))
    assert all(len(run) == 2 for run in compact["runs"])


# ------------------------------------------------------------------------ ledger


def test_the_ledger_never_mixes_two_tables_partitions_and_cuts_one_per_table():
    led = lg.next_ledger(lg.empty_ledger(), two_tables(), 1.0)
    assert led.partitions == {"202401": 5, f"{DAILY}/202401": 2, f"{DAILY}/202402": 1}
    assert led.tables == {FACTS: 5, DAILY: 3} and led.rows == 8
    facts, daily = lg.table_view(led, FACTS, FACTS), lg.table_view(led, DAILY, FACTS)
    assert facts.partitions == {"202401": 5} and facts.rows == 5
    assert daily.partitions == {"202401": 2, "202402": 1} and daily.rows == 3


def test_evicted_rows_of_each_table_stay_that_tables():
    led = lg.empty_ledger()
    for b in range(4):
        rec = record(
            StagedPart("s1", f"f{b}", 10, target=""),
            StagedPart("s2", f"d{b}", 1, target=DAILY),
        )
        led = lg.next_ledger(led, rec, float(b), keep=3)
    assert len(led.partitions) == 3
    facts, daily = lg.table_view(led, FACTS, FACTS), lg.table_view(led, DAILY, FACTS)
    assert sum(facts.partitions.values()) + facts.evicted_rows == 40
    assert sum(daily.partitions.values()) + daily.evicted_rows == 4
    assert lg.maybe_evicted(daily, "d0") and not lg.maybe_evicted(daily, "f3")


def test_a_single_table_ledger_is_unchanged():
    rec = XidRecord(
        JOB, "b1", 1, XidState.PREPARED, 1, Mode.ATTACH, FACTS, (StagedPart("s", "p", 2),)
    )
    led = lg.next_ledger(lg.empty_ledger(), rec, 1.0)
    assert not led.tables and led.partitions == {"p": 2}
    assert lg.table_view(led, FACTS, FACTS) == led


# ------------------------------------------------------------------------ job tables


def check_tables(job: str, stored: dict | None, tables: list[str]) -> None:
    refusal = tables_refusal(job, JobFacts.of(stored), tables)
    if refusal:
        raise ConfigError(refusal)


def primary_target(stored: dict | None, tables: list[str]) -> str:
    return primary(JobFacts.of(stored), tables)


def test_a_job_keeps_its_tables_and_a_transaction_may_write_a_subset():
    stored = {"target": FACTS, "targets": {FACTS: "attach", DAILY: "attach"}}
    check_tables(JOB, stored, [DAILY])
    check_tables(JOB, None, [FACTS, DAILY, "shop.new"])  # first commit: anything
    with pytest.raises(ConfigError, match=r"shop\.new"):
        check_tables(JOB, stored, [FACTS, "shop.new"])
    with pytest.raises(ConfigError, match=DAILY):
        check_tables(JOB, {"target": FACTS, "mode": "attach"}, [FACTS, DAILY])
    assert primary_target(None, [FACTS, DAILY]) == DAILY
    assert primary_target(stored, [DAILY]) == FACTS


def test_the_pinned_mode_is_per_table_for_a_transaction_job():
    meta = {"mode": "attach", "targets": {FACTS: "attach"}}
    assert pinned_mode(meta, FACTS) == "attach"
    assert pinned_mode(meta, DAILY) is None
    assert pinned_mode({"mode": "dedup", "target": FACTS}, FACTS) == "dedup"


# ------------------------------------------------------------------------ the runner


class Crash(BaseException):
    pass


def crash_at(point: str):
    def fault(p: str) -> None:
        if p == point:
            raise Crash(p)

    return fault


def staged(wh: MemoryWarehouse, run: str) -> list[StagedPart]:
    xid = batch_xid(3)
    a = staging_name(JOB, xid, run, 0, 0, 1).table
    b = staging_name(JOB, xid, run, 0, 0, 2).table
    wh.stage(a, {"202401": [1, 2, 3], "202402": [4]})
    wh.stage(b, {"202401": [100]})
    return [
        StagedPart(a, "202401", 3, target=FACTS),
        StagedPart(a, "202402", 1, target=FACTS),
        StagedPart(b, "202401", 1, target=DAILY),
    ]


@pytest.mark.parametrize(
    "point",
    [
        "driver.before_prepare",
        "driver.after_prepare",
        "driver.mid_commit",
        "driver.after_commit",
        "driver.after_record",
    ],
)
def test_a_crash_at_any_driver_point_ends_with_both_tables_or_neither(point):
    registry, wh = MemoryRegistry(), MemoryWarehouse()
    tables = (DAILY, FACTS)
    tx = Transactor(registry, wh, JOB, fault=crash_at(point))
    epoch = tx.begin("run-1")
    with pytest.raises(Crash):
        tx.commit_batch(epoch, "b3", 3, FACTS, staged(wh, "00000001"), tables=tables)
    # restart: recovery, then Spark replays batch 3 with fresh staging
    again = Transactor(registry, wh, JOB)
    epoch = again.begin("run-2")
    result = again.commit_batch(epoch, "b3", 3, FACTS, staged(wh, "00000002"), tables=tables)
    assert wh.target_ids(FACTS) == [1, 2, 3, 4] and wh.target_ids(DAILY) == [100]
    assert result.action in ("committed", "rolled_forward", "skipped")
    rec = registry.get(JOB, "b3")
    assert (
        rec is not None and rec.state is XidState.COMMITTED and set(rec.targets) == {FACTS, DAILY}
    )
    again.recover(epoch)
    assert wh.staging == {}


def test_a_prepared_xid_with_a_lost_table_is_an_alarm_not_half_a_commit():
    registry, wh = MemoryRegistry(), MemoryWarehouse()
    tx = Transactor(registry, wh, JOB, fault=crash_at("driver.after_prepare"))
    epoch = tx.begin("run-1")
    parts = staged(wh, "00000001")
    with pytest.raises(Crash):
        tx.commit_batch(epoch, "b3", 3, FACTS, parts)
    wh.drop_staging(parts[2].table)  # the daily table's staging is lost
    with pytest.raises(RecoveryAlarm):
        Transactor(registry, wh, JOB).begin("run-2")
    assert wh.target_ids(FACTS) == [] and wh.target_ids(DAILY) == []


def test_a_transaction_over_tables_on_different_servers_is_refused_before_staging(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A Distributed table is written on its cluster's shards; the transaction's handle
    reaches one server list, so a table elsewhere would be PREPARED with staging its
    publish cannot find."""
    import dataclasses

    import txsink.spark.validate as validate_module
    from txsink.config import WriterConfig
    from txsink.spark import multi
    from txsink.spark.messages import WritePlan

    def fake_validate(config: WriterConfig, schema: object) -> WritePlan:
        if config.table == "shop.orders":  # Distributed: resolved onto its shards
            config = dataclasses.replace(
                config,
                table="shop.orders_local",
                shards=("http://a:1", "http://b:1"),
                url="http://a:1",
            )
        return WritePlan(config, "attach")

    staged: list[str] = []
    monkeypatch.setattr(validate_module, "validate", fake_validate)
    monkeypatch.setattr(multi, "stage", lambda plan, df: staged.append(plan.config.table) or [])
    monkeypatch.setattr(multi.committer, "batch_mode", lambda plan, messages, xid: Mode.ATTACH)

    class Df:
        schema = None

    options = {"url": "http://h:8123", "keeper": "k:2181", "job": "j"}
    tx = multi.Transaction(None, None, 1, options)
    tx.write(Df(), table="shop.orders")
    with pytest.raises(ConfigError, match="one transaction publishes on one server"):
        tx.write(Df(), table="shop.customers")
    assert staged == ["shop.orders_local"]
