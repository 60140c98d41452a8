"""Bounded Keeper nodes, pure parts: the manifest layout, the request-size guard, the
bounded ledger, and how verify and status read a ledger that evicted partitions."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from tests.registry_contract import big_record, grid_record, make_record
from txsink.errors import KeeperRequestTooLarge, TxSinkError
from txsink.ops.status import assess
from txsink.ops.verify import EVICTED, fold, ledger_partition_rows, reconcile
from txsink.ports.ledger import EMPTY_LEDGER, exact_partitions, maybe_evicted, next_ledger
from txsink.ports.manifest_codec import (
    CHUNK_BYTES,
    INLINE_MANIFEST_BYTES,
    KEEPER_MAX_REQUEST,
    check_request,
    pack_record,
    parse_chunk_name,
    repack,
    unpack_record,
)
from txsink.protocol.codec import Ledger, decode_record, encode_ledger, encode_record
from txsink.protocol.states import Epoch, XidRecord, XidState

# --------------------------------------------------------------------------- layout


def test_a_200_by_30_manifest_is_one_bounded_chunk_and_reads_back_equal() -> None:
    record = grid_record("b3", tasks=200, partitions=30)
    inline_json = len(json.dumps(encode_record(record)))
    packed = pack_record(record, "abc123")
    assert inline_json > 700_000  # the old inline node, most of jute.maxbuffer
    assert len(json.dumps(packed.node)) < 2_000
    assert all(len(c) <= CHUNK_BYTES for c in packed.chunks)
    again = unpack_record(packed.node, list(packed.chunks), 0, "x")
    assert again == replace(record, version=0)


def test_a_small_manifest_stays_inline_in_the_layout_every_version_reads() -> None:
    record = make_record("x-1", parts={str(p): p + 1 for p in range(100)})
    packed = pack_record(record, "abc123")
    assert packed.chunks == () and packed.ref is None
    assert packed.node == json.loads(json.dumps(encode_record(record)))
    assert len(json.dumps(packed.node)) < INLINE_MANIFEST_BYTES
    assert decode_record(packed.node, 3) == replace(record, version=3)
    assert unpack_record(packed.node, None, 3, "x") == replace(record, version=3)


def test_an_older_reader_fails_on_a_chunked_record_instead_of_reading_no_manifest() -> None:
    packed = pack_record(big_record("b1", entries=3_000), "n0")
    assert packed.chunks
    with pytest.raises((TypeError, KeyError, AttributeError)):
        decode_record(packed.node)  # what txsink before chunking does with the node


def test_a_commit_rewrites_the_record_and_keeps_the_chunk_reference() -> None:
    record = big_record("b1", entries=3_000)
    packed = pack_record(record, "n0")
    done = record.with_state(XidState.COMMITTED, committed_at=5.0)
    node = repack(done, packed.node)
    assert node["manifest_chunks"] == packed.node["manifest_chunks"]
    assert unpack_record(node, list(packed.chunks), 1, "x") == replace(done, version=1)


def test_chunks_in_the_wrong_order_or_short_are_refused_not_guessed() -> None:
    packed = pack_record(big_record("b1", entries=10_000), "n0")
    assert len(packed.chunks) >= 2
    with pytest.raises(TxSinkError, match="checksum differs"):
        unpack_record(packed.node, list(reversed(packed.chunks)), 0, "/j/xids/b1")
    with pytest.raises(TxSinkError, match=r"/j/xids/b1 cannot be read.*1 of"):
        unpack_record(packed.node, list(packed.chunks[:1]), 0, "/j/xids/b1")


def test_chunk_names_parse_back_even_for_xids_with_dots() -> None:
    assert parse_chunk_name("u1.2.3.ab12cd.4") == ("u1.2.3", "ab12cd", 4)
    assert parse_chunk_name("b7.ab12cd.x") is None
    assert parse_chunk_name("b7") is None


def test_a_manifest_beyond_the_chunk_limit_is_refused_with_its_size() -> None:
    with pytest.raises(KeeperRequestTooLarge, match=r"xid b1 .* over txsink's limit"):
        pack_record(big_record("b1", entries=2_000), "n0", chunk_bytes=512)


def test_the_size_estimate_refuses_what_zookeeper_drops_and_passes_what_it_takes() -> None:
    # Measured on ZooKeeper 3.8.0: a create of 1,048,475 bytes lands; 1,048,575 closes
    # the connection (the server's log says "Len error ... jute.maxbuffer=1048575").
    check_request("create", [("/exp/n1000000", 1_000_000)])
    with pytest.raises(
        KeeperRequestTooLarge, match=f"about \\d+ bytes, over .*{KEEPER_MAX_REQUEST}"
    ):
        check_request("create", [("/exp/n1048575", 1_048_575)])
    with pytest.raises(KeeperRequestTooLarge):  # the whole multi-op counts
        check_request("multi", [("/exp/m1", 600_000), ("/exp/m2", 600_000)])


# --------------------------------------------------------------------------- ledger


def commits(parts_per_commit: list[dict[str, int]], keep: int) -> Ledger:
    ledger = EMPTY_LEDGER
    for i, parts in enumerate(parts_per_commit):
        ledger = next_ledger(ledger, make_record(f"b{i}", batch=i, parts=parts), 1.0, keep=keep)
    return ledger


def test_the_ledger_keeps_n_partitions_and_the_exact_total() -> None:
    ledger = commits([{f"p{i}": 10, f"q{i}": 1} for i in range(50)], keep=10)
    assert len(ledger.partitions) == 10 == len(ledger.partition_seq)
    assert ledger.rows == 550
    assert ledger.evicted_rows + sum(ledger.partitions.values()) == 550
    assert ledger.evicted_partitions == 90


def test_the_least_recently_written_partitions_are_evicted_first() -> None:
    ledger = commits([{"hot": 1, f"cold{i}": 1} for i in range(20)], keep=3)
    assert set(ledger.partitions) == {"hot", "cold18", "cold19"}
    assert ledger.partitions["hot"] == 20


def test_a_partition_back_after_eviction_is_partial_and_never_exact() -> None:
    ledger = commits([{"old": 5}] + [{f"p{i}": 1} for i in range(3)] + [{"old": 2}], keep=2)
    assert ledger.partitions["old"] == 2
    assert ledger.partial == ("old",)
    assert "old" not in exact_partitions(ledger)
    assert maybe_evicted(ledger, "p0") and not maybe_evicted(ledger, "never-seen-42")


def test_a_ledger_written_before_the_window_still_advances() -> None:
    old = {"seq": 3, "committed": 3, "rows": 9, "last_batch": 2, "last_commit_at": 1.0,
           "partitions": {"a": 4, "b": 5}}  # fmt: skip
    new = next_ledger(old, make_record("b3", batch=3, parts={"c": 1}), 2.0, keep=2)
    assert new.partitions == {"b": 5, "c": 1} and new.evicted_rows == 4
    assert new.rows == 10 and new.seq == 4


def test_the_ledger_node_stays_small_after_thousands_of_partitions() -> None:
    ledger = commits([{f"2024{i:06d}": 1000 + i} for i in range(2_000)], keep=1000)
    assert len(json.dumps(encode_ledger(ledger))) < 64 * 1024
    assert ledger.rows == sum(1000 + i for i in range(2_000))


# --------------------------------------------------------------------------- verify, status


def test_verify_reconciles_evicted_partitions_together_and_names_the_rest() -> None:
    parts = [{f"p{i}": 10} for i in range(6)] + [{"p0": 3}]
    ledger = commits(parts, keep=3)
    target = {f"p{i}": 10 for i in range(6)}
    target["p0"] = 13
    rows, folded = ledger_partition_rows([ledger], target)
    assert "p0" in folded and "p5" not in folded
    anomalies, _ = reconcile("db.t", rows, fold(target, folded))
    assert anomalies == []
    # One duplicated row in an evicted partition is still found (in the bucket)...
    target["p1"] += 1
    anomalies, _ = reconcile("db.t", rows, fold(target, folded))
    assert [a.partition for a in anomalies] == [EVICTED]
    assert "evicted from the ledger" in anomalies[0].message
    # ...and one in a window partition by name.
    target["p1"] -= 1
    target["p5"] += 1
    anomalies, _ = reconcile("db.t", rows, fold(target, folded))
    assert [a.partition for a in anomalies] == ["p5"]


def test_a_ledger_without_evictions_reconciles_every_partition_by_itself() -> None:
    ledger = commits([{"a": 1}, {"b": 2}], keep=10)
    rows, folded = ledger_partition_rows([ledger], {"a": 1, "b": 2, "c": 7})
    assert folded == set() and rows == {"a": 1, "b": 2}


def test_status_says_when_the_ledger_evicted_partitions() -> None:
    ledger = commits([{f"p{i}": 1} for i in range(5)], keep=2)
    status = assess(
        "orders",
        meta={"target": "db.t"},
        epoch=Epoch("orders", 1, 0, "run-x"),
        owner={"epoch": 1, "owner": "run-x", "heartbeat": 999.0},
        ledger=ledger,
        records=[],
        staging_sizes={},
        staging_view={},
        now=1000.0,
    )
    [w] = status.warnings
    assert (w.kind, w.level) == ("ledger-evicted", "info")
    assert "3 eviction(s)" in w.message and "txsink verify" in w.message


def test_the_ledger_counts_rows_per_shard_of_a_sharded_job() -> None:
    from txsink.ports.ledger import empty_ledger, next_ledger
    from txsink.protocol.ids import staging_name
    from txsink.protocol.states import Mode, StagedPart, XidState

    def part(shard: int | None, rows: int) -> StagedPart:
        table = staging_name("j", "b0", "00000000", 0, 0, shard or 0, shard=shard).table
        return StagedPart(table=table, partition_id="p", rows=rows)

    record = XidRecord(
        job="j", xid="b0", batch=0, state=XidState.COMMITTED, epoch=1, mode=Mode.ATTACH,
        target="db.t",
        manifest=(part(0, 5), part(2, 7), part(2, 1)),
    )  # fmt: skip
    ledger = next_ledger(next_ledger(empty_ledger(), record, 1.0), record, 2.0)
    assert ledger.shards == {"0": 10, "2": 16}
    assert sum(ledger.shards.values()) == ledger.rows
    plain = XidRecord(
        job="j", xid="b1", batch=1, state=XidState.COMMITTED, epoch=1, mode=Mode.ATTACH,
        target="db.t",
        manifest=(part(None, 3),),
    )  # fmt: skip
    assert "shards" not in encode_ledger(next_ledger(empty_ledger(), plain, 1.0))
