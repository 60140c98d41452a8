"""The auditor's pure parts: history anomalies (backward / overlap / gap, after eBay's ARV),
stuck PREPARED xids, ledger-vs-target reconciliation, and the status/tune decisions."""

from __future__ import annotations

import pytest

from txsink.errors import ConfigError
from txsink.ops.anomalies import committed_history, detect_anomalies, stuck_prepared
from txsink.ops.status import assess
from txsink.ops.tune import recommend
from txsink.ops.tune_model import percentile
from txsink.ops.verify import reconcile
from txsink.protocol.states import Epoch, Mode, StagedPart, XidRecord, XidState

JOB = "j"


def rec(
    xid: str,
    batch: int | None,
    seq: int | None,
    *,
    state: XidState = XidState.COMMITTED,
    created_at: float = 0.0,
    manifest: tuple[StagedPart, ...] = (),
) -> XidRecord:
    return XidRecord(
        job=JOB,
        xid=xid,
        batch=batch,
        state=state,
        epoch=1,
        mode=Mode.ATTACH,
        target="db.t",
        manifest=manifest,
        created_at=created_at,
        committed_at=None if state is XidState.PREPARED else 100.0 + (seq or 0),
        seq=seq,
    )


def linear(n: int) -> list[XidRecord]:
    return [rec(f"b{i}", i, i + 1) for i in range(n)]


def kinds(records: list[XidRecord]) -> list[tuple[str, tuple[str, ...]]]:
    return [(a.kind, a.xids) for a in detect_anomalies(records)]


# --------------------------------------------------------------------------- history


def test_consecutive_batches_in_commit_order_are_clean() -> None:
    assert detect_anomalies(linear(10)) == []


def test_history_is_ordered_by_commit_sequence_not_by_listing_order() -> None:
    shuffled = list(reversed(linear(5)))
    assert [r.xid for r in committed_history(shuffled)] == ["b0", "b1", "b2", "b3", "b4"]
    assert detect_anomalies(shuffled) == []


def test_a_pruned_prefix_is_not_a_gap() -> None:
    assert detect_anomalies(linear(10)[6:]) == []


def test_missing_batches_between_consecutive_commits_are_a_gap() -> None:
    history = [*linear(3), rec("b6", 6, 4)]
    [gap] = detect_anomalies(history)
    assert (gap.kind, gap.xids, gap.batches) == ("gap", ("b2", "b6"), (2, 6))
    assert "batch(es) 3..5 never committed" in gap.message


def test_a_single_missing_batch_is_named_alone() -> None:
    [gap] = detect_anomalies([rec("b0", 0, 1), rec("b2", 2, 2)])
    assert "batch(es) 1 never committed" in gap.message


def test_a_batch_committed_after_a_later_one_is_backward() -> None:
    history = [rec("b0", 0, 1), rec("b1", 1, 2), rec("b3", 3, 3), rec("b2", 2, 4)]
    assert kinds(history) == [("gap", ("b1", "b3")), ("backward", ("b3", "b2"))]


def test_two_xids_claiming_one_batch_are_an_overlap_reported_once() -> None:
    history = [*linear(3), rec("b7", 2, 4)]  # consecutive: M'.batch == M.batch
    assert kinds(history) == [("overlap", ("b2", "b7"))]


def test_non_consecutive_claims_of_one_batch_are_an_overlap_too() -> None:
    history = [*linear(4), rec("b9", 1, 5)]
    found = kinds(history)
    assert ("overlap", ("b1", "b9")) in found
    assert ("backward", ("b3", "b9")) in found


def test_ad_hoc_xids_are_exempt_and_do_not_break_the_chain() -> None:
    history = [rec("b0", 0, 1), rec("u0123456789ab", None, 2), rec("b1", 1, 3)]
    assert detect_anomalies(history) == []


def test_prepared_records_are_not_history() -> None:
    history = [*linear(2), rec("b5", 5, None, state=XidState.PREPARED)]
    assert detect_anomalies(history) == []


def test_a_commit_sequence_given_twice_is_reported() -> None:
    history = [rec("b0", 0, 1), rec("b1", 1, 1)]
    assert kinds(history) == [("sequence", ("b0", "b1"))]


def test_records_without_a_sequence_sort_after_sequenced_ones() -> None:
    history = [rec("b1", 1, None), rec("b0", 0, 1)]
    assert [r.xid for r in committed_history(history)] == ["b0", "b1"]
    assert detect_anomalies(history) == []


def test_stuck_prepared_only_past_the_threshold() -> None:
    records = [
        rec("b3", 3, None, state=XidState.PREPARED, created_at=1000.0),
        rec("b4", 4, None, state=XidState.PREPARED, created_at=1250.0),
    ]
    [stuck] = stuck_prepared(records, now=1400.0, older_than=300.0)
    assert stuck.xids == ("b3",) and "txsink recover --job j" in stuck.message


# --------------------------------------------------------------------------- reconciliation


def test_equal_counts_reconcile() -> None:
    assert reconcile("db.t", {"202401": 5}, {"202401": 5}) == ([], [])


def test_a_target_surplus_is_an_anomaly_unless_other_writers_are_allowed() -> None:
    [a], [] = reconcile("db.t", {"202401": 5}, {"202401": 7}, jobs=["j"])
    assert a.kind == "reconciliation" and a.partition == "202401"
    assert "has 7 rows, the ledger of j counts 5: 2 rows more" in a.message
    [], [w] = reconcile("db.t", {"202401": 5}, {"202401": 7}, allow_other_writers=True)
    assert w.kind == "other-writers"


def test_a_surplus_covered_by_prepared_rows_is_in_flight() -> None:
    [], [w] = reconcile("db.t", {"p": 5}, {"p": 8}, {"p": 3})
    assert w.kind == "in-flight"


def test_a_deficit_is_an_anomaly_unless_the_engine_merges_rows_away() -> None:
    [a], [] = reconcile("db.t", {"p": 5, "q": 2}, {"p": 5})
    assert a.partition == "q" and "2 rows missing" in a.message
    [], [w] = reconcile("db.t", {"p": 5}, {"p": 4}, engine_merges=True)
    assert w.kind == "merged-away"


def test_dedup_ledgers_are_reconciled_by_total() -> None:
    # dedup-mode ledgers count Spark partitions "0", "1", not target partitions
    assert reconcile("db.t", {"0": 3, "1": 4}, {"202401": 7}, by_partition=False) == ([], [])


# --------------------------------------------------------------------------- status


def test_status_tells_an_in_flight_batch_from_an_orphan_by_the_heartbeat() -> None:
    sizes = {"tx_j_1234abcd__b2__r00000000_p0_a0_t0": {"rows": 4, "bytes": 100}}
    args = {
        "meta": {"target": "db.t", "mode": "attach"},
        "epoch": Epoch(JOB, 2, 1, "run-x"),
        "ledger": {"committed": 2, "rows": 10, "last_batch": 1, "last_commit_at": 990.0},
        "records": linear(2),
        "staging_sizes": sizes,
        "staging_view": {},
        "now": 1000.0,
    }
    fresh = assess(JOB, owner={"epoch": 2, "owner": "run-x", "heartbeat": 995.0}, **args)
    assert fresh.live and fresh.warnings == []
    stale = assess(JOB, owner={"epoch": 2, "owner": "run-x", "heartbeat": 0.0}, **args)
    assert [(w.kind, w.level) for w in stale.warnings] == [
        ("orphan-staging", "warn"),
        ("stale-owner", "warn"),
    ]


def test_recovery_owner_is_never_a_live_writer_and_shows_as_fenced_writer() -> None:
    status = assess(
        JOB,
        meta={},
        epoch=Epoch(JOB, 3, 2, "txsink-recover@h:1"),
        owner={"epoch": 3, "owner": "txsink-recover@h:1", "heartbeat": 999.0,
               "state": "recovered", "previous_owner": "run-x"},
        ledger={},
        records=[],
        staging_sizes={},
        staging_view={},
        now=1000.0,
    )  # fmt: skip
    assert not status.live
    [w] = status.warnings
    assert w.kind == "fenced-writer" and "run-x" in w.message


def test_prepared_xid_with_missing_staging_is_lost_staging_not_stuck() -> None:
    part = StagedPart("tx_j_1234abcd__b2__r00000000_p0_a0_t0", "202401", 4)
    prepared = rec("b2", 2, None, state=XidState.PREPARED, manifest=(part,))
    status = assess(
        JOB, meta={}, epoch=None, owner=None, ledger={}, records=[prepared],
        staging_sizes={}, staging_view={part.table: None}, now=10_000.0,
    )  # fmt: skip
    assert [w.kind for w in status.warnings] == ["lost-staging"]


# --------------------------------------------------------------------------- tune


def test_recommendation_takes_the_largest_of_the_three_bounds() -> None:
    r = recommend(0.2, max_overhead=0.05, parts_to_delay_insert=1000, parts_to_throw_insert=3000)
    assert (r.overhead_interval, r.parts_interval, r.interval) == (4.0, 2.4, 4.0)
    r = recommend(0.01, max_overhead=0.05, parts_to_delay_insert=100, parts_to_throw_insert=300)
    assert r.parts_interval == 24.0 and r.interval == 24.0
    r = recommend(0.01, max_overhead=0.5, parts_to_delay_insert=10**6, parts_to_throw_insert=1)
    assert r.interval == 1.0
    assert r.rows_per_batch is None


def test_rows_per_batch_follow_the_rate_and_the_rounded_interval() -> None:
    r = recommend(
        0.11, max_overhead=0.05, parts_to_delay_insert=1000, parts_to_throw_insert=3000,
        rows_per_second=1000.0,
    )  # fmt: skip
    assert r.interval == 2.4 and r.rows_per_batch == 3000  # trigger rounded up to 3 s
    assert any('processingTime="3 seconds"' in line for line in r.reasoning)


def test_bad_max_overhead_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="--max-overhead"):
        recommend(0.1, max_overhead=1.5, parts_to_delay_insert=1, parts_to_throw_insert=1)


def test_percentile_is_nearest_rank() -> None:
    assert percentile([], 0.5) == 0.0
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert percentile([float(i) for i in range(1, 101)], 0.95) == 95.0


def test_txn_version_saves_may_skip_versions_without_a_gap_anomaly() -> None:
    from txsink.ops.anomalies import detect_anomalies
    from txsink.protocol.states import Mode, XidRecord, XidState

    def rec(batch: int, seq: int) -> XidRecord:
        return XidRecord(
            job="j", xid=f"b{batch}", batch=batch, state=XidState.COMMITTED, epoch=1,
            mode=Mode.ATTACH, target="d.t", committed_at=float(seq), seq=seq,
        )  # fmt: skip

    history = [rec(1, 1), rec(5, 2)]
    assert [f.kind for f in detect_anomalies(history)] == ["gap"]
    assert detect_anomalies(history, contiguous=False) == []
