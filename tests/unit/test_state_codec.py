"""The state codec: records written by the release before format versions still read
exactly (jobs in flight survive the upgrade), every record round-trips, a newer format is
refused with a message naming the node, and a newer writer's facts survive our rewrites."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from txsink.errors import TxSinkError
from txsink.ports.ledger import next_ledger
from txsink.ports.manifest_codec import pack_record, unpack_record
from txsink.ports.registry_memory import MemoryRegistry, encode_json
from txsink.protocol import dedup, dedup_window
from txsink.protocol.codec import (
    FORMAT,
    JobMeta,
    Ledger,
    StateFormatTooNew,
    decode_epoch_node,
    decode_job_meta,
    decode_ledger,
    decode_owner,
    decode_partition_state,
    decode_record,
    encode_job_meta,
    encode_ledger,
    encode_owner,
    encode_partition_state,
    encode_record,
)
from txsink.protocol.states import Cut, Mode, StagedPart, Visibility, XidRecord, XidState

V0 = Path(__file__).resolve().parent.parent / "fixtures" / "state_v0"
NOW = 1_760_000_000.0
S0 = "tx_orders_716b2cc1__b00000007__r1a2b3c4d_p0_a0_t10"
S1 = "tx_orders_716b2cc1__b00000007__r1a2b3c4d_p1_a0_t11"
S9 = "tx_orders_716b2cc1__b00000007__r1a2b3c4d_p9_a0_t19"


def node(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((V0 / name).read_bytes())
    return data


def chunks_of(xid: str) -> list[bytes]:
    return [p.read_bytes() for p in sorted(V0.glob(f"chunk_{xid}.*"))]


def roundtrips(record: XidRecord) -> None:
    """Encoded by this release, the record decodes equal (and carries the format)."""
    data = json.loads(encode_json(encode_record(record)))
    assert data["format"] == FORMAT
    assert decode_record(data, record.version) == record


# --------------------------------------------------------------------------- fixtures

MULTI = (
    StagedPart(S0, "202401", 120, 2, "", ("0123456789abcdef", "fedcba9876543210")),
    StagedPart(S1, "202402", 80, 1),
    StagedPart(S9, "202401", 5, target="db.daily"),
)


def test_a_prepared_multi_table_batch_record_of_v0_reads_into_typed_fields() -> None:
    record = decode_record(node("xid_prepared.json"), 1)
    assert record == XidRecord(
        job="orders", xid="b00000007", batch=7, state=XidState.PREPARED, epoch=1,
        mode=Mode.ATTACH, target="db.orders", manifest=MULTI, created_at=NOW, version=1,
        tables=("db.daily", "db.orders"), visibility=Visibility.BATCH,
        cuts=(Cut(S0, "202401", {"0123456789abcdef": 60}),),
    )  # fmt: skip
    assert record.cut(S0, "202401") == {"0123456789abcdef": 60} and record.batch_visible
    roundtrips(record)


def test_a_committed_v0_record_reads_its_seq_and_committed_epoch() -> None:
    record = decode_record(node("xid_committed.json"))
    assert (record.state, record.seq, record.committed_epoch) == (XidState.COMMITTED, 1, 1)
    assert record.committed_at == NOW + 1 and record.unknown == {}
    multi = decode_record(node("xid_committed_multi.json"))
    assert (multi.seq, multi.committed_epoch, multi.tables) == (2, 1, ("db.daily", "db.orders"))
    roundtrips(record)
    roundtrips(multi)


def test_a_v0_tombstone_and_a_prepare_over_it_read_their_aborted_tables() -> None:
    tomb = decode_record(node("xid_aborted.json"))
    assert tomb.state is XidState.ABORTED and tomb.aborted_tables == {S0, S1}
    over = decode_record(node("xid_over_tombstone.json"))
    assert over.state is XidState.PREPARED and over.aborted_tables == {S0, S1}
    roundtrips(tomb)
    roundtrips(over)


def test_a_v0_dedup_record_reads_its_per_mode_fields() -> None:
    record = decode_record(node("xid_dedup.json"))
    assert record.mode is Mode.DEDUP
    assert record.manifest == (StagedPart("db.orders", "3", 150, 2, "9f8e7d6c"),)
    roundtrips(record)


def test_a_v0_chunked_manifest_reads_with_its_chunks_and_repacks_equal() -> None:
    data = node("xid_chunked.json")
    record = unpack_record(data, chunks_of("b00000010"), 0, "xids/b00000010")
    assert len(record.manifest) == 1500 and record.manifest[7].uuids == (f"{7:016x}",)
    assert record.rows == sum(range(1, 1501))
    packed = pack_record(record, "0a0b0c0d0e0f")
    assert packed.chunks == tuple(chunks_of("b00000010"))  # the chunk layout is unchanged
    again = unpack_record(json.loads(encode_json(packed.node)), list(packed.chunks), 0, "x")
    assert again == record and packed.node["format"] == FORMAT


def test_v0_job_meta_reads_typed_and_reencodes_with_the_same_keys() -> None:
    meta = decode_job_meta(node("job_meta.json"))
    assert meta == JobMeta(
        target="db.orders", mode="attach", job="orders", url="http://ch1:8123",
        staging_database="txsink_staging", query_id="q-123", created_at=NOW,
        targets={"db.daily": "attach", "db.orders": "attach"},
        shards=("http://ch1:8123", "http://ch2:8123"),
    )  # fmt: skip
    assert meta.tables == ["db.daily", "db.orders"] and meta.pinned_mode is Mode.ATTACH
    for name in ("job_meta.json", "job_meta_plain.json"):
        old = node(name)
        typed = decode_job_meta(old)
        assert typed is not None
        assert encode_job_meta(typed) == {**old, "format": FORMAT}
        assert decode_job_meta(encode_job_meta(typed)) == typed


@pytest.mark.parametrize("name", ["ledger.json", "ledger_evicted.json"])
def test_a_v0_ledger_reads_typed_and_reencodes_with_the_same_keys(name: str) -> None:
    old = node(name)
    ledger = decode_ledger(old)
    assert (ledger.seq, ledger.rows, ledger.last_batch) == (
        old["seq"],
        old["rows"],
        old["last_batch"],
    )
    assert ledger.partitions == old["partitions"] and ledger.shards == {"1": 7}
    assert encode_ledger(ledger) == {**old, "format": FORMAT}
    assert decode_ledger(encode_ledger(ledger)) == ledger


def test_a_v0_ledger_keeps_counting_where_it_stopped() -> None:
    ledger = decode_ledger(node("ledger_evicted.json"))
    assert ledger.evicted_partitions and ledger.partial == ()
    record = decode_record(node("xid_committed.json"))
    after = next_ledger(ledger, record, NOW + 99, keep=2)
    assert after.seq == ledger.seq + 1 and after.rows == ledger.rows + record.rows
    assert after.tables == ledger.tables and after.shards == ledger.shards
    assert decode_ledger(json.loads(encode_json(encode_ledger(after)))) == after


def test_a_ledger_of_a_newer_format_is_refused() -> None:
    with pytest.raises(StateFormatTooNew, match="jobs/orders/ledger"):
        decode_ledger({**node("ledger.json"), "format": FORMAT + 1}, "/txsink/jobs/orders/ledger")


def test_v0_small_nodes_read_typed() -> None:
    assert decode_epoch_node(node("epoch.json")) == (2, "driver-1")
    owner = decode_owner(node("owner.json"))
    assert owner is not None and (owner.epoch, owner.state, owner.heartbeat) == (2, "running", NOW)
    assert decode_owner(encode_owner(owner)) == owner


def test_v0_dedup_entries_read_as_before() -> None:
    before = decode_partition_state(node("dedup_before.json"))
    after = decode_partition_state(node("dedup_after.json"))
    assert before is not None and after is not None
    assert before.status is dedup.Status.BEFORE and before.track is not None
    assert before.track.first == dedup_window.Mark(41, NOW - 1) and after.rows == 150
    for state, name in ((before, "dedup_before.json"), (after, "dedup_after.json")):
        encoded = encode_partition_state(state)
        assert encoded == {**node(name), "format": FORMAT}
        assert decode_partition_state(encoded) == state
    with pytest.raises(StateFormatTooNew, match="dedup/b7/p0"):
        decode_partition_state({**node("dedup_after.json"), "format": 9}, "dedup/b7/p0")


# --------------------------------------------------------------------------- versions


@pytest.mark.parametrize("name", ["xid_prepared.json", "xid_chunked.json"])
def test_a_record_of_a_newer_format_is_refused_naming_the_node(name: str) -> None:
    data = {**node(name), "format": FORMAT + 1}
    with pytest.raises(StateFormatTooNew, match=r"jobs/orders/xids/b0000.*upgrade txsink"):
        unpack_record(data, chunks_of("b00000010"), 0, "/txsink/jobs/orders/xids/b0000000x")


@pytest.mark.parametrize(
    ("key", "value"),
    [("state", "SNAPSHOTTED"), ("mode", "merge"), ("visibility", "snapshot")],
)
def test_an_enum_value_this_release_does_not_know_is_refused_never_defaulted(
    key: str, value: str
) -> None:
    data = node("xid_prepared.json")
    if key == "visibility":
        data = {**data, "extra": {**data.get("extra", {}), "visibility": value}}
    else:
        data = {**data, key: value}
    with pytest.raises(StateFormatTooNew, match=rf"xids/b0000.*has {key} '{value}'.*upgrade"):
        unpack_record(data, chunks_of("b00000010"), 0, "/txsink/jobs/orders/xids/b0000000x")


@pytest.mark.parametrize("bad", ["1", 1.5, True, -1, None])
def test_a_format_that_is_not_a_version_number_is_refused_naming_the_node(bad: Any) -> None:
    with pytest.raises(TxSinkError, match="jobs/orders/xids/b7 says its state format") as caught:
        decode_record({**node("xid_prepared.json"), "format": bad}, 0, "jobs/orders/xids/b7")
    assert not isinstance(caught.value, StateFormatTooNew)


def test_job_meta_of_a_newer_format_is_refused() -> None:
    with pytest.raises(StateFormatTooNew) as caught:
        decode_job_meta({**node("job_meta.json"), "format": 99}, "/txsink/jobs/orders")
    assert caught.value.found == 99 and "/txsink/jobs/orders" in str(caught.value)


def test_a_newer_writers_facts_survive_an_amend_and_a_commit_of_this_release() -> None:
    reg = MemoryRegistry(clock=lambda: NOW)
    epoch = reg.take_epoch("orders", "a")
    newer = node("xid_prepared.json")
    newer["extra"]["quorum"] = {"acks": 3}  # a fact this release does not know
    reg._nodes["orders"] = {"b00000007": (newer, 0)}
    stored = reg.get("orders", "b00000007")
    assert stored is not None and stored.unknown == {"quorum": {"acks": 3}}
    amended = reg.amend(epoch, stored, [Cut(S1, "202402", {"ab" * 8: 1})])
    done = reg.commit(epoch, amended, NOW + 9)
    raw = reg._nodes["orders"]["b00000007"][0]
    assert raw["extra"]["quorum"] == {"acks": 3} and raw["format"] == FORMAT
    assert raw["extra"]["cut"] == {f"{S0}/202401": {"0123456789abcdef": 60},
                                   f"{S1}/202402": {"ab" * 8: 1}}  # fmt: skip
    assert done.seq == 1 and done.unknown == {"quorum": {"acks": 3}}


# --------------------------------------------------------------------------- round trip

names = st.text("abcdef0123456789_", min_size=1, max_size=12)
parts = st.builds(
    StagedPart,
    table=names,
    partition_id=st.text("0123456789abc-", min_size=1, max_size=8),
    rows=st.integers(0, 10**12),
    blocks=st.integers(0, 50),
    fingerprint=st.text("0123456789abcdef", max_size=8),
    uuids=st.lists(st.text("0123456789abcdef", min_size=16, max_size=16), max_size=4).map(tuple),
    target=st.sampled_from(["", "db.daily"]),
)
cuts = st.lists(
    st.builds(
        Cut,
        staging=names,
        partition_id=st.text("0123456789-", min_size=1, max_size=6),
        parts=st.dictionaries(names, st.integers(1, 1000), min_size=1, max_size=3),
    ),
    max_size=3,
    unique_by=lambda c: c.key,
).map(lambda found: sorted(found, key=lambda c: c.key))
records = st.builds(
    XidRecord,
    job=names,
    xid=names,
    batch=st.none() | st.integers(0, 10**9),
    state=st.sampled_from(XidState),
    epoch=st.integers(0, 10**6),
    mode=st.sampled_from(Mode),
    target=st.sampled_from(["db.t", ""]),
    manifest=st.lists(parts, max_size=6).map(tuple),
    created_at=st.floats(0, 2e9, allow_nan=False),
    committed_at=st.none() | st.floats(0, 2e9, allow_nan=False),
    version=st.integers(-1, 100),
    tables=st.lists(names, max_size=3, unique=True).map(tuple),
    visibility=st.sampled_from(Visibility),
    aborted_tables=st.frozensets(names, max_size=3),
    cuts=cuts.map(tuple),
    seq=st.none() | st.integers(1, 10**6),
    committed_epoch=st.none() | st.integers(1, 10**6),
    unknown=st.dictionaries(st.sampled_from(["quorum", "note"]), st.integers(), max_size=2),
)


@given(records)
def test_every_record_roundtrips_through_the_codec(record: XidRecord) -> None:
    roundtrips(record)


@given(records, st.integers(1, 4000))
def test_every_record_roundtrips_through_the_bounded_node_layout(
    record: XidRecord, inline: int
) -> None:
    packed = pack_record(record, "00aa11bb22cc", inline_bytes=inline, chunk_bytes=512)
    data = json.loads(encode_json(packed.node))
    assert unpack_record(data, list(packed.chunks), record.version, "x") == record


def test_cuts_merge_partition_by_partition_and_never_lose_a_part() -> None:
    rec = decode_record(node("xid_prepared.json"))
    more = rec.with_cuts([Cut(S0, "202401", {"b" * 16: 2}), Cut(S1, "202402", {"c" * 16: 1})])
    assert more.cut(S0, "202401") == {"0123456789abcdef": 60, "b" * 16: 2}
    assert more.cut(S1, "202402") == {"c" * 16: 1}
    assert more.with_cuts(more.cuts) == more
    assert replace(more, cuts=()).cut(S0, "202401") == {}


counts = st.dictionaries(names, st.integers(0, 10**9), max_size=4)
ledgers = st.builds(
    Ledger,
    seq=st.integers(0, 10**6),
    committed=st.integers(0, 10**6),
    rows=st.integers(0, 10**12),
    last_batch=st.none() | st.integers(0, 10**9),
    last_commit_at=st.none() | st.floats(0, 2e9, allow_nan=False),
    partitions=counts,
    partition_seq=counts,
    partial=st.lists(names, max_size=3).map(tuple),
    evicted_partitions=st.integers(0, 1000),
    evicted_rows=st.integers(0, 10**9),
    evicted_filter=st.sampled_from(["", "00ff"]),
    shards=counts,
    tables=counts,
    evicted_tables=counts,
    unknown=st.dictionaries(st.sampled_from(["window_v2", "note"]), st.integers(), max_size=2),
)
metas = st.builds(
    JobMeta,
    target=st.sampled_from(["", "db.t"]),
    mode=st.sampled_from(["", "attach", "dedup"]),
    job=names,
    url=st.sampled_from(["", "http://h:8123"]),
    staging_database=st.sampled_from(["", "txsink_staging"]),
    query_id=st.sampled_from(["", "q-1"]),
    created_at=st.floats(0, 2e9, allow_nan=False),
    targets=st.dictionaries(names, st.sampled_from(["attach", "dedup"]), max_size=3),
    shards=st.lists(names, max_size=3).map(tuple),
    mode_changed_at=st.none() | st.floats(0, 2e9, allow_nan=False),
    unknown=st.dictionaries(st.sampled_from(["tier", "note"]), st.integers(), max_size=2),
)


@given(ledgers)
def test_every_ledger_roundtrips_through_the_codec(ledger: Ledger) -> None:
    assert decode_ledger(json.loads(encode_json(encode_ledger(ledger)))) == ledger


@given(metas)
def test_every_job_meta_roundtrips_through_the_codec(meta: JobMeta) -> None:
    assert decode_job_meta(json.loads(encode_json(encode_job_meta(meta)))) == meta
