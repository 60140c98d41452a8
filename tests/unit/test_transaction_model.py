"""Model-based tests of the transaction runner: random batches, crashes and replays.

A scripted "Spark" drives :class:`txsink.transactor.Transactor` against the in-memory
registry and warehouse (:class:`~txsink.ports.warehouse_memory.MemoryWarehouse`: parts
with UUIDs, the evidence of publish). Crashes are raised at random protocol fault
points; the warehouse loses MOVE replies and cuts MOVEs between parts (a server crash);
the target merges its parts between runs. After each failure a new driver run starts
(new epoch, recovery) and Spark replays the first batch whose commit did not return.
After every run to completion, the target must hold every produced row exactly once.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from txsink.errors import FencedError, RecoveryAlarm, RetryableConflict, UnavailableError
from txsink.faults import POINTS
from txsink.ports.registry_memory import MemoryRegistry
from txsink.ports.warehouse_memory import MemoryWarehouse
from txsink.protocol.ids import batch_xid, staging_name
from txsink.protocol.states import StagedPart, XidState
from txsink.transactor import Transactor

TARGET = "db.events"
JOB = "orders-eo"


class Crash(BaseException):
    """A simulated kill -9 of the driver at a fault point."""


class Faults:
    def __init__(self, plan: list[tuple[str, int]]) -> None:
        self.plan = list(plan)  # (point, arrivals to let pass first)
        self.seen: dict[str, int] = {}

    def __call__(self, point: str) -> None:
        self.seen[point] = self.seen.get(point, 0) + 1
        if self.plan and self.plan[0][0] == point:
            name, skip = self.plan[0]
            if self.seen[point] > skip:
                self.plan.pop(0)
                self.seen.clear()
                raise Crash(name)


def stage_batch(
    wh: MemoryWarehouse,
    epoch: int,
    batch: int,
    rows: list[tuple[int, str]],
    spark_parts: int,
    failed_attempts: int,
    blocks: int = 1,
) -> list[StagedPart]:
    """Executors: each Spark partition writes a staging table (``blocks`` parts per
    partition) and reports what it staged with the evidence ids of its largest parts, as
    the Spark writer does; failed attempts leave junk."""
    parts: list[StagedPart] = []
    for sp in range(spark_parts):
        mine = [r for i, r in enumerate(rows) if i % spark_parts == sp]
        by_pid: dict[str, list[int]] = {}
        for rid, pid in mine:
            by_pid.setdefault(pid, []).append(rid)
        attempt = 0
        for attempt in range(failed_attempts):
            dead = staging_name(
                JOB, batch_xid(batch), f"{epoch:08x}", sp, attempt, 1000 * sp + attempt
            )
            wh.stage(dead.table, {p: ids[: len(ids) // 2] for p, ids in by_pid.items()})
        attempt = failed_attempts
        name = staging_name(
            JOB, batch_xid(batch), f"{epoch:08x}", sp, attempt, 1000 * sp + attempt
        ).table
        wh.stage(name, by_pid, parts=blocks)
        parts.extend(
            StagedPart(name, pid, n, uuids=uuids)
            for pid, (n, uuids) in sorted(wh.staged_partitions(name).items())
        )
    return parts


def run_job(
    batches: list[list[tuple[int, str]]],
    crashes: list[tuple[str, int]],
    spark_parts: int,
    failed_attempts: int,
    *,
    blocks: int = 1,
    wh_faults: list[tuple[str, int]] = (),  # type: ignore[assignment]
    merge_between_runs: bool = False,
    publish_retry_s: float = 60.0,
) -> tuple[MemoryRegistry, MemoryWarehouse]:
    """``wh_faults``: ("lost", _) a MOVE lands and its reply is lost, ("cut", k) a MOVE
    moves k parts of its partition and the server goes away, in this order."""
    reg, wh = MemoryRegistry(), MemoryWarehouse()
    for kind, k in wh_faults:
        if kind == "lost":
            wh.lose_reply("move_partition")
        else:
            wh.cut_next_move(k)
    faults = Faults(crashes)
    spark_done = -1  # Spark's checkpoint commit log: last batch whose commit returned
    for _run in range(len(crashes) + len(wh_faults) + 2):
        tx = Transactor(
            reg, wh, JOB, fault=faults, publish_retry_s=publish_retry_s, sleep=lambda _s: None
        )
        try:
            epoch = tx.begin("driver")
            for b in range(spark_done + 1, len(batches)):
                parts = stage_batch(
                    wh, epoch.number, b, batches[b], spark_parts, failed_attempts, blocks
                )
                tx.commit_batch(epoch, batch_xid(b), b, TARGET, parts)
                spark_done = b
            return reg, wh
        except (Crash, UnavailableError, RetryableConflict):
            if merge_between_runs and TARGET in wh.tables:
                for pid in sorted({p.partition_id for p in wh.tables[TARGET].parts}):
                    wh.merge(TARGET, pid)  # ClickHouse's own merges; parts get new UUIDs
            continue
    raise AssertionError("job did not finish")


row_batches = st.lists(
    st.lists(st.sampled_from(["202401", "202402", "202403", "all"]), min_size=0, max_size=12),
    min_size=1,
    max_size=6,
)
crash_plans = st.lists(
    st.tuples(st.sampled_from([p for p in POINTS if p.startswith("driver.")]), st.integers(0, 3)),
    max_size=4,
)


def number(batches: list[list[str]]) -> list[list[tuple[int, str]]]:
    out, n = [], 0
    for b in batches:
        out.append([(n + i, pid) for i, pid in enumerate(b)])
        n += len(b)
    return out


@settings(max_examples=300, deadline=None)
@given(row_batches, crash_plans, st.integers(1, 3), st.integers(0, 2))
def test_every_produced_row_is_published_exactly_once_whatever_the_crashes(
    batches: list[list[str]], crashes: list[tuple[str, int]], spark_parts: int, failed: int
) -> None:
    numbered = number(batches)
    reg, wh = run_job(numbered, crashes, spark_parts, failed)
    produced = sorted(rid for b in numbered for rid, _ in b)
    assert wh.target_ids(TARGET) == produced
    records = reg.list(JOB)
    assert all(r.state is XidState.COMMITTED for r in records)
    assert sorted(r.batch for r in records) == list(range(len(numbered)))
    assert reg.ledger(JOB).rows == len(produced)


wh_fault_plans = st.lists(
    st.tuples(st.sampled_from(["lost", "cut"]), st.integers(1, 3)), max_size=3
)


@settings(max_examples=300, deadline=None)
@given(
    row_batches,
    crash_plans,
    wh_fault_plans,
    st.integers(1, 3),
    st.integers(1, 4),
    st.booleans(),
    st.sampled_from([0.0, 60.0]),
)
def test_lost_replies_cut_moves_and_target_merges_never_duplicate_or_lose_a_row(
    batches: list[list[str]],
    crashes: list[tuple[str, int]],
    wh_faults: list[tuple[str, int]],
    spark_parts: int,
    blocks: int,
    merges: bool,
    retry_s: float,
) -> None:
    """The UUID evidence path: a MOVE whose reply was lost, a MOVE cut between parts by
    a server crash, crashes between MOVE and the COMMITTED record, and the target merging
    the moved parts (new UUIDs; the old ones outdated) before the next attempt looks."""
    numbered = number(batches)
    reg, wh = run_job(
        numbered,
        crashes,
        spark_parts,
        0,
        blocks=blocks,
        wh_faults=wh_faults,
        merge_between_runs=merges,
        publish_retry_s=retry_s,
    )
    produced = sorted(rid for b in numbered for rid, _ in b)
    assert wh.target_ids(TARGET) == produced
    records = reg.list(JOB)
    assert all(r.state is XidState.COMMITTED for r in records)
    assert reg.ledger(JOB).rows == len(produced)


def test_a_cut_move_is_finished_from_the_uuids_already_in_the_target() -> None:
    reg, wh = MemoryRegistry(), MemoryWarehouse()
    tx = Transactor(reg, wh, JOB, sleep=lambda _s: None)
    epoch = tx.begin()
    parts = stage_batch(wh, epoch.number, 0, [(i, "a") for i in range(6)], 1, 0, blocks=3)
    wh.cut_next_move(2)
    assert tx.commit_batch(epoch, "b0", 0, TARGET, parts).action == "committed"
    assert wh.target_ids(TARGET) == list(range(6))
    record = reg.get(JOB, "b0")
    assert record is not None and record.cuts  # the repair was recorded


def test_a_move_whose_reply_was_lost_and_whose_parts_were_merged_is_not_moved_again() -> None:
    reg, wh = MemoryRegistry(), MemoryWarehouse()
    tx = Transactor(reg, wh, JOB, publish_retry_s=0.0, sleep=lambda _s: None)
    epoch = tx.begin()
    first = stage_batch(wh, epoch.number, 0, [(1, "a"), (2, "a")], 1, 0)
    tx.commit_batch(epoch, "b0", 0, TARGET, first)
    parts = stage_batch(wh, epoch.number, 1, [(3, "a"), (4, "a")], 1, 0)
    wh.lose_reply("move_partition")
    with pytest.raises(UnavailableError):
        tx.commit_batch(epoch, "b1", 1, TARGET, parts)
    wh.merge(TARGET, "a")  # the moved part now lives on only as an outdated part
    Transactor(reg, wh, JOB).begin()  # recovery rolls b1 forward from the UUID evidence
    assert wh.target_ids(TARGET) == [1, 2, 3, 4]
    assert reg.get(JOB, "b1").state is XidState.COMMITTED


@settings(max_examples=100, deadline=None)
@given(row_batches, crash_plans)
def test_no_staging_is_left_after_a_clean_restart(
    batches: list[list[str]], crashes: list[tuple[str, int]]
) -> None:
    reg, wh = run_job(number(batches), crashes, 2, 1)
    Transactor(reg, wh, JOB).begin("final")
    assert wh.staging == {}


def test_replay_of_committed_batch_publishes_nothing_and_drops_its_staging() -> None:
    reg, wh = MemoryRegistry(), MemoryWarehouse()
    tx = Transactor(reg, wh, JOB)
    epoch = tx.begin()
    parts = stage_batch(wh, epoch.number, 0, [(1, "a"), (2, "b")], 1, 0)
    assert tx.commit_batch(epoch, "b0", 0, TARGET, parts).action == "committed"
    epoch2 = Transactor(reg, wh, JOB).begin()
    again = stage_batch(wh, epoch2.number, 0, [(1, "a"), (2, "b")], 1, 0)
    result = tx.commit_batch(epoch2, "b0", 0, TARGET, again)
    assert result.action == "skipped"
    assert wh.target_ids(TARGET) == [1, 2]
    assert wh.staging == {}


def test_stale_epoch_cannot_prepare_after_takeover() -> None:
    reg, wh = MemoryRegistry(), MemoryWarehouse()
    old = Transactor(reg, wh, JOB)
    old_epoch = old.begin("zombie")
    Transactor(reg, wh, JOB).begin("new-driver")
    parts = stage_batch(wh, old_epoch.number, 0, [(1, "a")], 1, 0)
    with pytest.raises(FencedError, match="superseded"):
        old.commit_batch(old_epoch, "b0", 0, TARGET, parts)
    assert wh.target_ids(TARGET) == []


def test_prepared_xid_with_lost_staging_raises_an_alarm_instead_of_guessing() -> None:
    reg, wh = MemoryRegistry(), MemoryWarehouse()
    tx = Transactor(reg, wh, JOB, fault=Faults([("driver.after_prepare", 0)]))
    epoch = tx.begin()
    parts = stage_batch(wh, epoch.number, 0, [(1, "a")], 1, 0)
    with pytest.raises(Crash):
        tx.commit_batch(epoch, "b0", 0, TARGET, parts)
    wh.staging.clear()  # an operator dropped the staging database
    with pytest.raises(RecoveryAlarm, match="missing"):
        Transactor(reg, wh, JOB).begin()


def test_orphan_staging_of_other_jobs_is_never_touched() -> None:
    reg, wh = MemoryRegistry(), MemoryWarehouse()
    other = staging_name("another-job", "b0", "0000000a", 0, 0, 0).table
    wh.stage(other, {"a": [1]})
    mine = staging_name(JOB, "b0", "0000000a", 0, 0, 0).table
    wh.stage(mine, {"a": [2]})
    Transactor(reg, wh, JOB).begin()
    assert other in wh.staging
    assert mine not in wh.staging


def test_replay_of_a_batch_pruned_by_retention_is_still_skipped() -> None:
    reg, wh = MemoryRegistry(), MemoryWarehouse()
    tx = Transactor(reg, wh, JOB, retention=1)
    epoch = tx.begin()
    for b in range(3):
        parts = stage_batch(wh, epoch.number, b, [(b, "a")], 1, 0)
        tx.commit_batch(epoch, batch_xid(b), b, TARGET, parts)
    tx.prune(epoch)
    assert reg.get(JOB, "b0") is None  # pruned
    replay = stage_batch(wh, epoch.number, 0, [(0, "a")], 1, 0)
    assert tx.commit_batch(epoch, "b0", 0, TARGET, replay).action == "skipped"
    assert wh.target_ids(TARGET) == [0, 1, 2]
    assert wh.staging == {}


def test_txn_version_lower_than_the_last_committed_is_skipped_like_delta() -> None:
    reg, wh = MemoryRegistry(), MemoryWarehouse()
    tx = Transactor(reg, wh, JOB)
    epoch = tx.begin()
    tx.commit_batch(epoch, "b5", 5, TARGET, stage_batch(wh, epoch.number, 5, [(5, "a")], 1, 0))
    late = stage_batch(wh, epoch.number, 3, [(3, "a")], 1, 0)
    assert tx.commit_batch(epoch, "b3", 3, TARGET, late).action == "skipped"
    assert wh.target_ids(TARGET) == [5]
