"""Liveness follows the job's own commit cadence (txsink.ops.liveness, a pure function).

Commits are made by a real Transactor on the in-memory registry under a fake clock, so the
heartbeats and ``committed_at`` times are the ones a writer leaves in Keeper.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from txsink.ops import liveness as lv
from txsink.ops.status import assess, liveness_of
from txsink.ports.registry_memory import MemoryRegistry
from txsink.ports.warehouse_memory import MemoryWarehouse
from txsink.transactor import Transactor

JOB = "cadenced"
TARGET = "db.t"


class Clock:
    def __init__(self, t: float = 1_700_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def run_writer(every: float, commits: int) -> tuple[MemoryRegistry, Clock]:
    """A writer that commits ``commits`` empty batches ``every`` seconds apart, then stops."""
    clock = Clock()
    reg = MemoryRegistry(clock=clock)
    tx = Transactor(reg, MemoryWarehouse(), JOB, clock=clock)
    epoch = tx.begin("run-1")
    for b in range(commits):
        clock.t += every
        tx.commit_batch(epoch, f"b{b}", b, TARGET, [], streaming=True)
    return reg, clock


def verdict_after(reg: MemoryRegistry, clock: Clock, silence: float) -> lv.Liveness:
    return liveness_of(reg.owner(JOB), reg.list(JOB), clock.t + silence)


def test_a_job_committing_every_2s_reads_dead_once_its_heartbeat_is_30s_old() -> None:
    reg, clock = run_writer(every=2.0, commits=15)
    v = verdict_after(reg, clock, 1.0)
    assert (v.live, v.cadence_s, v.stale_after_s, v.stale_after_source) == (
        True,
        2.0,
        lv.STALE_FLOOR,
        "cadence",
    )
    assert verdict_after(reg, clock, 29.9).live is True
    assert verdict_after(reg, clock, 30.1).live is False  # not 600 s, as before


def test_without_the_floor_a_2s_cadence_would_read_dead_after_6s() -> None:
    assert lv.stale_threshold(2.0) == 30.0
    assert lv.stale_threshold(2.0, floor=0.0) == 6.0


def test_a_job_committing_every_5_minutes_reads_live_for_10_minutes() -> None:
    reg, clock = run_writer(every=300.0, commits=4)
    assert verdict_after(reg, clock, 599.0).live is True
    v = verdict_after(reg, clock, 601.0)
    assert (v.live, v.cadence_s, v.stale_after_s) == (False, 300.0, lv.STALE_CAP)


def test_a_job_committing_every_minute_reads_dead_after_three_minutes() -> None:
    reg, clock = run_writer(every=60.0, commits=6)
    assert verdict_after(reg, clock, 179.0).live is True
    assert verdict_after(reg, clock, 181.0).live is False


def test_an_idle_stream_without_a_cadence_yet_uses_the_cap() -> None:
    reg, clock = run_writer(every=2.0, commits=1)
    v = verdict_after(reg, clock, 599.0)
    assert (v.live, v.cadence_s, v.stale_after_s, v.stale_after_source) == (
        True,
        None,
        lv.STALE_CAP,
        "no-cadence",
    )
    assert verdict_after(reg, clock, 601.0).live is False


def test_a_writer_that_died_after_its_first_prepare_reads_gone_once_its_longest_wait_passed() -> (
    None
):
    """Killed after the first PREPARE, no commit yet: it cannot be told from a writer
    whose ATTACH waits on a lock, so it reads live for the longest statement it
    declared (send_receive_timeout + connect_timeout, 310 s) plus the 30 s floor, and
    gone after: not 600 s (the cap), not 30 s (which calls a waiting writer gone)."""
    from txsink.protocol.states import Mode, XidRecord, XidState

    clock = Clock()
    reg = MemoryRegistry(clock=clock)
    tx = Transactor(reg, MemoryWarehouse(), JOB, clock=clock)
    epoch = tx.begin("run-1")
    first = XidRecord(
        JOB, "b0", 0, XidState.PREPARED, epoch.number, Mode.ATTACH, TARGET, created_at=clock.t
    )
    reg.prepare(epoch, first)
    v = verdict_after(reg, clock, 339.0)
    assert (v.live, v.beat_s, v.stale_after_s, v.stale_after_source) == (
        True,
        5.0,
        340.0,
        "publishing",
    )
    assert "longest statement it may wait on" in lv.explain(v)
    assert verdict_after(reg, clock, 341.0).live is False
    # meanwhile status says when recovery will act (issue 41: it read live, nothing more)
    live = assess(JOB, now=clock.t + 40, **status_inputs(reg, "attach"))  # type: ignore[arg-type]
    (pending,) = [f for f in live.warnings if f.kind == "pending-prepared"]
    assert live.writer == "live" and pending.xid == "b0"
    assert "once nothing came from it for 340s (in 300s)" in pending.message
    assert "--force" in pending.message
    # and the status of that job says so, with the recovery to run
    gone = assess(JOB, now=clock.t + 341, **status_inputs(reg, "attach"))  # type: ignore[arg-type]
    assert gone.writer == "gone"
    assert not [f for f in gone.warnings if f.kind == "pending-prepared"]


def test_a_fast_stream_inside_a_long_attach_is_not_gone_after_30s() -> None:
    """Issue 38: a job committing every 2 s rests `idle` between batches (judged by
    its 30 s floor); its next commit prepares, then its ATTACH waits on a lock for up
    to lock_acquire_timeout (120 s) without a beat. The PREPARED xid of its epoch
    shows it is inside a commit: the longest statement it may wait on is allowed."""
    from txsink.protocol.states import Mode, XidRecord, XidState

    reg, clock = run_writer(every=2.0, commits=15)
    epoch = reg.current_epoch(JOB)
    assert epoch is not None
    clock.t += 1.0
    nxt = XidRecord(JOB, "b15", 15, XidState.PREPARED, epoch.number, Mode.ATTACH, TARGET)
    reg.prepare(epoch, dataclasses.replace(nxt, created_at=clock.t))
    v = verdict_after(reg, clock, 120.0)  # the ATTACH still waits on its lock
    assert (v.live, v.stale_after_source, v.stale_after_s) == (True, "publishing", 340.0)
    assert verdict_after(reg, clock, 341.0).live is False
    # a PREPARED xid of an older epoch is no sign of this writer at work
    idle = liveness_of(reg.owner(JOB), reg.list(JOB), clock.t + 120, staging=None)
    assert idle.live is True
    older = [dataclasses.replace(r, epoch=0) for r in reg.list(JOB)]
    assert liveness_of(reg.owner(JOB), older, clock.t + 120).live is False


def test_a_publish_allows_the_statement_wait_it_declared() -> None:
    busy = {
        "owner": "run-1",
        "epoch": 1,
        "heartbeat": 100.0,
        "state": "publishing",
        "beat_s": 5,
        "wait_s": 120,
    }
    assert lv.judge(busy, [], 249.0).live is True  # 120 s + the 30 s floor
    assert lv.judge(busy, [], 251.0).live is False
    assert lv.judge({**busy, "wait_s": None}, [], 439.0).live is True  # the default 310 s


def test_the_next_save_of_a_daily_job_is_a_run_at_work_not_an_orphan() -> None:
    """Issue 38: a daily batch save rests `finished` for a day; the next save's tasks
    stage before it takes the job. Staging no record references, written after the
    owner's last beat and less than the cap ago, is a run at work: live, no orphan.
    Once nothing wrote it for the cap, it is an orphan again."""
    clock = Clock()
    reg = MemoryRegistry(clock=clock)
    tx = Transactor(reg, MemoryWarehouse(), JOB, clock=clock)
    epoch = tx.begin("save-1")
    tx.commit_batch(epoch, "b1", 1, TARGET, [])
    clock.t += 86_400.0
    tx.commit_batch(epoch, "b2", 2, TARGET, [])
    clock.t += 86_400.0  # a day later the next save stages
    table = "tx_cadenced_0123abcd__b3__r0011aabb_p0_a0_t0"
    staged: dict[str, dict[str, float]] = {
        table: {"rows": 4, "bytes": 40, "modified": clock.t - 5.0}
    }
    inputs = {**status_inputs(reg, "attach"), "staging_sizes": staged}
    st = assess(JOB, now=clock.t, **inputs)  # type: ignore[arg-type]
    assert (st.live, st.writer, st.stale_after_source) == (True, "live", "staging")
    assert not [w for w in st.warnings if w.kind == "orphan-staging"]
    later = assess(JOB, now=clock.t + lv.STALE_CAP, **inputs)  # type: ignore[arg-type]
    assert later.live is False
    assert [w.kind for w in later.warnings if w.kind == "orphan-staging"] == ["orphan-staging"]
    # staging of an xid the job has a record of is that record's, not a new run's
    known = {"tx_cadenced_0123abcd__b2__r0011aabb_p0_a0_t0": staged[table]}
    old = assess(JOB, now=clock.t, **{**inputs, "staging_sizes": known})  # type: ignore[arg-type]
    assert old.live is False
    # a stream's next micro-batch is its cadence's to judge: its staging does not speak
    stream, sclock = run_writer(every=2.0, commits=5)
    running = liveness_of(stream.owner(JOB), stream.list(JOB), sclock.t + 31, None, staged)
    assert running.live is False
    # --stale-after decides alone
    flag = liveness_of(reg.owner(JOB), reg.list(JOB), clock.t, 0.0, staged)
    assert flag.live is False


def test_a_finished_batch_write_reads_finished_but_keeps_the_idle_patience() -> None:
    """Shown as finished, never warned stale; judged like an idle stream, because the
    next write of the job stages before it takes the job (its staging is no orphan)."""
    clock = Clock()
    reg = MemoryRegistry(clock=clock)
    tx = Transactor(reg, MemoryWarehouse(), JOB, clock=clock)
    epoch = tx.begin("run-1")
    tx.commit_batch(epoch, "v1", 1, TARGET, [])  # a batch write (txn_version 1)
    v = verdict_after(reg, clock, 0.5)
    assert (v.live, v.stale_after_source, v.stale_after_s) == (True, "finished", lv.STALE_CAP)
    assert "its batch write finished" in lv.explain(v)
    for later in (0.5, 700.0):
        st = assess(JOB, now=clock.t + later, **status_inputs(reg, "attach"))  # type: ignore[arg-type]
        assert st.writer == "finished"
        assert not [w for w in st.warnings if w.kind == "stale-owner"]
    with_staging = {**status_inputs(reg, "attach"), "staging_sizes": {"tx_x": {"rows": 1}}}
    st = assess(JOB, now=clock.t + 1, **with_staging)  # type: ignore[arg-type]
    assert (st.writer, st.live, st.warnings) == ("live", True, [])  # the next save, in flight


def test_a_replayed_batch_leaves_the_writer_resting_not_promising_a_beat() -> None:
    """A restart whose first batch is a skipped replay: the takeover's promise of a
    5 s beat ends with that commit, so the idle stream keeps its cadence's patience."""
    reg, clock = run_writer(every=60.0, commits=4)
    tx = Transactor(reg, MemoryWarehouse(), JOB, clock=clock)
    epoch = tx.begin("run-2")
    assert tx.commit_batch(epoch, "b3", 3, TARGET, [], streaming=True).action == "skipped"
    v = verdict_after(reg, clock, 31.0)
    assert (v.live, v.stale_after_source, v.stale_after_s) == (True, "cadence", 180.0)


def test_a_commit_of_a_slow_job_keeps_its_cadence_patience_inside_the_commit() -> None:
    """The declared beat is only kept between a commit's statements: a slow job's
    commit (a MOVE that runs 40 s) is judged by the longer of beat and cadence."""
    reg, clock = run_writer(every=120.0, commits=4)
    Transactor(reg, MemoryWarehouse(), JOB, clock=clock).begin("run-2")  # inside a commit
    v = verdict_after(reg, clock, 40.0)
    assert (v.live, v.beat_s, v.stale_after_source, v.stale_after_s) == (
        True,
        5.0,
        "cadence",
        360.0,
    )


def test_a_publish_that_waits_declares_its_beat_and_idle_does_not() -> None:
    busy = {"owner": "run-1", "epoch": 1, "heartbeat": 100.0, "state": "publishing", "beat_s": 5}
    assert lv.judge(busy, [], 439.0).live is True  # 310 s (the default wait) + 30 s
    assert lv.judge(busy, [], 441.0).live is False
    idle = {**busy, "state": "idle"}
    assert lv.judge(idle, [], 131.0).stale_after_source == "no-cadence"
    assert lv.judge({**busy, "beat_s": "junk"}, [], 131.0).stale_after_source == "no-cadence"


def test_an_explicit_stale_after_wins_over_the_cadence() -> None:
    reg, clock = run_writer(every=2.0, commits=10)
    v = liveness_of(reg.owner(JOB), reg.list(JOB), clock.t + 100, stale_after=1000)
    assert (v.live, v.stale_after_s, v.stale_after_source) == (True, 1000.0, "flag")
    v = liveness_of(reg.owner(JOB), reg.list(JOB), clock.t + 1, stale_after=0)
    assert v.live is False


def test_the_cadence_is_the_median_so_a_restart_gap_does_not_stretch_it() -> None:
    times = [0, 2, 4, 6, 3606, 3608, 3610, 3612]
    assert lv.commit_cadence(times) == 2.0
    assert lv.commit_cadence([5.0]) is None
    assert lv.commit_cadence([None, 1.0]) is None
    # only the most recent CADENCE_SAMPLE gaps count: an old slow history is forgotten
    old = [i * 600.0 for i in range(50)]
    fast = [old[-1] + i * 5.0 for i in range(1, lv.CADENCE_SAMPLE + 1)]
    assert lv.commit_cadence(old + fast) == 5.0


def test_recovery_mark_and_a_missing_heartbeat_are_never_live() -> None:
    mark = {"owner": "txsink-recover@host:1", "heartbeat": 100.0}
    assert lv.judge(mark, [], 100.5).live is False
    assert lv.judge(None, [1.0, 2.0], 3.0).live is False
    assert lv.judge({"owner": "w"}, [1.0, 2.0], 3.0).heartbeat_age is None


def status_inputs(reg: Any, mode: str) -> dict[str, Any]:
    """What :func:`assess` reads of a job, from the registry ``reg``."""
    return {
        "meta": {"target": TARGET, "mode": mode},
        "epoch": reg.current_epoch(JOB),
        "owner": reg.owner(JOB),
        "ledger": reg.ledger(JOB),
        "records": reg.list(JOB),
        "staging_sizes": {},
        "staging_view": {},
    }


def test_status_shows_cadence_and_threshold_and_warns_of_a_stale_owner() -> None:
    reg, clock = run_writer(every=2.0, commits=10)
    common = status_inputs(reg, "attach")
    fresh = assess(JOB, now=clock.t + 5, **common)  # type: ignore[arg-type]
    assert (fresh.live, fresh.cadence_s, fresh.stale_after_s) == (True, 2.0, 30.0)
    assert fresh.to_json()["stale_after_source"] == "cadence"
    assert fresh.warnings == []
    gone = assess(JOB, now=clock.t + 45, **common)  # type: ignore[arg-type]
    assert gone.live is False
    [w] = gone.warnings
    assert w.kind == "stale-owner"
    assert "45s ago (> 30s, 3 x its 2s commit cadence, within [30, 600]s)" in w.message


def test_status_names_a_dedup_batch_stopped_half_way_unless_a_live_writer_has_it_in_flight() -> (
    None
):
    from txsink.protocol.dedup import OpenBatch

    reg, clock = run_writer(every=2.0, commits=3)
    half = OpenBatch("b9", partitions=4, finished=3, rows_at_least=150, rows_at_most=160)
    common = {**status_inputs(reg, "dedup"), "open_dedup": [half]}
    in_flight = assess(JOB, now=clock.t + 1, **common)  # type: ignore[arg-type]
    assert in_flight.live and in_flight.warnings == []
    gone = assess(JOB, now=clock.t + 45, **common)  # type: ignore[arg-type]
    [w] = [w for w in gone.warnings if w.kind == "half-visible-dedup"]
    assert w.xid == "b9" and "150 to 160 row(s) from 4 Spark partition(s)" in w.message
    assert "--discard-dedup b9" in w.message and TARGET in w.message


def recorded_beats(reg: MemoryRegistry) -> list[dict[str, Any]]:
    """Every heartbeat ``reg`` is asked to write from now on, in order."""
    beats: list[dict[str, Any]] = []
    real = reg.heartbeat

    def beat(epoch: Any, info: dict[str, Any]) -> None:
        beats.append(info)
        real(epoch, info)

    reg.heartbeat = beat  # type: ignore[method-assign]
    return beats


def test_a_long_publish_beats_between_its_statements_with_the_wait_it_may_take() -> None:
    """A publish of many partitions (a MOVE each) beats `publishing` once the beat
    interval passed, declaring the longest statement it may wait on, so no gap between
    beats exceeds one statement plus a beat; a quick commit writes no extra beat."""
    from txsink.protocol.states import StagedPart

    class Ticking(Clock):
        def __call__(self) -> float:
            self.t += 2.0  # every look at the clock: 2 s of MOVEs passed
            return self.t

    for clock, beats_wanted in ((Ticking(), True), (Clock(), False)):
        reg = MemoryRegistry(clock=clock)
        wh = MemoryWarehouse()
        wh.add_table(TARGET, partition_by="p")
        tx = Transactor(reg, wh, JOB, clock=clock, statement_s=42.0)
        epoch = tx.begin("run-1")
        beats = recorded_beats(reg)
        parts = []
        for month in range(6):
            name = f"{tx.prefix}__b0__r0011aabb_p{month}_a0_t0"
            wh.create_staging(TARGET, name)
            wh.insert_blocks(name, [[{"p": month}]], block_rows=10, block_bytes=1 << 20)
            parts += [
                StagedPart(name, pid, n) for pid, n in (wh.staging_view([name])[name] or {}).items()
            ]
        tx.commit_batch(epoch, "b0", 0, TARGET, parts, streaming=True)
        publishing = [b for b in beats if b["state"] == "publishing"]
        assert bool(publishing) is beats_wanted, beats
        assert all((b["beat_s"], b["wait_s"], b["xid"]) == (5.0, 42.0, "b0") for b in publishing), (
            publishing
        )
        # the resting beat is written by the commit's own transaction, not a heartbeat
        assert beats[-1]["state"] == "publishing" if beats_wanted else not beats, beats
        owner = reg.owner(JOB)
        assert owner is not None and owner.state == "idle", owner
        assert owner.details["wait_s"] == 42.0 and owner.details["last_xid"] == "b0", owner


def test_a_clean_stop_releases_the_writer_and_status_reads_it_finished() -> None:
    """Issue 41: after a clean `query.stop()` the writer stayed `live` until its heartbeat
    went stale. A released run rests `finished`; another run (or one taken over) cannot
    release the job."""
    reg, clock = run_writer(every=2.0, commits=3)
    tx = Transactor(reg, MemoryWarehouse(), JOB, clock=clock)
    assert assess(JOB, now=clock.t + 1, **status_inputs(reg, "attach")).writer == "live"  # type: ignore[arg-type]
    assert tx.release("run-2") is False  # not the owner: nothing written
    assert tx.release("run-1") is True
    st = assess(JOB, now=clock.t + 1, **status_inputs(reg, "attach"))  # type: ignore[arg-type]
    assert st.writer == "finished" and not st.warnings
    from txsink.protocol.states import Mode, XidRecord, XidState

    epoch = tx.begin("run-2")  # a new run takes the job over
    assert tx.release("run-1") is False
    pending = XidRecord(
        JOB, "b9", 9, XidState.PREPARED, epoch.number, Mode.ATTACH, TARGET, created_at=clock.t
    )
    reg.prepare(epoch, pending)
    assert tx.release("run-2") is False  # not a clean stop: its beat must go stale
    owner = reg.owner(JOB)
    assert owner is not None and owner.state != "finished"
