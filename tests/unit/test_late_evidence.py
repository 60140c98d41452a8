"""Evidence that may have been erased before a late resume (issue 38 rows 3-4), on the
twins: a MOVE cut by a server crash whose moved parts the target merged away before the
writer came back, an ATTACH whose query-log line a TTL deleted, staged parts the server
detached. None of them may be read as "not published" (moved again) or "published"
(recorded COMMITTED without its rows): each is a RecoveryAlarm with its runbook, and the
prompt resume stays automatic."""

from __future__ import annotations

import contextlib

import pytest

from tests.unit.test_transaction_model import JOB, TARGET, stage_batch
from txsink.errors import RecoveryAlarm, UnavailableError
from txsink.ports.registry_memory import MemoryRegistry
from txsink.ports.warehouse_memory import MemoryWarehouse
from txsink.protocol.evidence_life import (
    CLOCK_SKEW_S,
    EvidenceLife,
    attach_evidence_lost,
    cut_evidence_lost,
)
from txsink.protocol.states import Visibility, XidState
from txsink.transactor import Transactor


def life(
    uptime: float, age: float, lifetime: float = 480.0, ttl: float | None = None
) -> EvidenceLife:
    return EvidenceLife(uptime, lifetime, ttl, age_s=age)


@pytest.mark.parametrize(
    ("uptime", "age", "lost"),
    [
        (10_000, 9_000, False),  # no restart since the PREPARE: no MOVE was cut
        (60, 120, False),  # restarted, but nothing merged after the PREPARE is gone yet
        (600, 900, True),  # restarted, record older than old_parts_lifetime
        (10, 900, True),  # restarted twice, the last one recently: still older
        (900 + CLOCK_SKEW_S / 2, 900, True),  # within the clock skew: assumed restarted
    ],
)
def test_cut_evidence_is_trusted_only_while_it_cannot_have_been_cleaned_up(
    uptime: float, age: float, lost: bool
) -> None:
    assert (cut_evidence_lost(life(uptime, age)) is not None) is lost


@pytest.mark.parametrize(
    ("uptime", "age", "ttl", "lost"),
    [
        (10, 10_000, None, True),  # restarted: the line may never have been flushed
        (10, 10_000, 30 * 86400.0, True),  # the same, whatever the TTL
        (100_000, 10_000, None, False),  # no restart, no TTL: the query log shows it
        (100_000, 10_000, 30 * 86400.0, False),  # no restart: the line outlives the record
        (10, 10_000, 3600.0, True),  # line deleted, parts dropped by the restart's load
        (100_000, 10_000, 3600.0, True),  # line deleted, parts merged and cleaned up
        (100_000, 100, 60.0, False),  # line deleted, but the attached parts still show
    ],
)
def test_attach_evidence_is_trusted_while_the_log_or_the_parts_would_show_it(
    uptime: float, age: float, ttl: float | None, lost: bool
) -> None:
    assert (attach_evidence_lost(life(uptime, age, ttl=ttl)) is not None) is lost


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def cut_and_leave(clock: Clock) -> tuple[MemoryRegistry, MemoryWarehouse]:
    """b0 PREPARED, its MOVE cut between parts (2 of 3 parts in the target and still
    staged), the writer gone."""
    reg, wh = MemoryRegistry(), MemoryWarehouse()
    tx = Transactor(reg, wh, JOB, clock=clock, publish_retry_s=0.0, sleep=lambda _s: None)
    epoch = tx.begin("run-1")
    parts = stage_batch(wh, epoch.number, 0, [(i, "a") for i in range(6)], 1, 0, blocks=3)
    wh.cut_next_move(2)
    with pytest.raises(UnavailableError):
        tx.commit_batch(epoch, "b0", 0, TARGET, parts)
    assert len(wh.target_ids(TARGET)) == 4  # the cut: 4 of 6 rows in the target
    return reg, wh


def test_a_late_resume_after_the_cut_parts_were_merged_away_is_an_alarm_not_a_second_move() -> None:
    clock = Clock()
    reg, wh = cut_and_leave(clock)
    wh.merge(TARGET, "a")  # after the restart: the cut parts merged ...
    wh.cleanup(TARGET)  # ... and cleaned up: no UUID shows them any more
    clock.now += 900  # the writer comes back 15 minutes later
    wh.uptime_s = 890  # the server restarted (the crash) after the PREPARE
    with pytest.raises(RecoveryAlarm, match="old_parts_lifetime") as alarm:
        Transactor(reg, wh, JOB, clock=clock).begin("run-2")
    assert "docs/operations.md#late-restart" in str(alarm.value)
    assert len(wh.target_ids(TARGET)) == 4  # nothing moved a second time
    assert reg.get(JOB, "b0").state is XidState.PREPARED


def test_a_prompt_resume_after_a_restart_still_repairs_the_cut_alone() -> None:
    clock = Clock()
    reg, wh = cut_and_leave(clock)
    clock.now += 30
    wh.uptime_s = 20  # restarted after the PREPARE, resumed well within the lifetime
    Transactor(reg, wh, JOB, clock=clock).begin("run-2")
    assert wh.target_ids(TARGET) == list(range(6))
    assert reg.get(JOB, "b0").state is XidState.COMMITTED


def test_a_staging_partition_the_server_detached_is_an_alarm_never_published() -> None:
    reg, wh = MemoryRegistry(), MemoryWarehouse()
    tx = Transactor(reg, wh, JOB, publish_retry_s=0.0, sleep=lambda _s: None)
    epoch = tx.begin("run-1")
    rows = [(i, "a") for i in range(4)] + [(i, "b") for i in range(4, 8)]
    parts = stage_batch(wh, epoch.number, 0, rows, 1, 0)
    wh.lose_reply("move_partition")  # partition a moved, the writer went away
    with pytest.raises(UnavailableError):
        tx.commit_batch(epoch, "b0", 0, TARGET, parts)
    wh.detach(parts[1].table, "b")  # after an OS crash the server finds b's part broken
    with pytest.raises(RecoveryAlarm, match="detached"):
        Transactor(reg, wh, JOB).begin("run-2")
    assert reg.get(JOB, "b0").state is XidState.PREPARED  # not COMMITTED without b's rows


def test_a_late_batch_resume_after_a_crash_lost_the_unflushed_query_log_line_is_an_alarm() -> None:
    """visibility=batch, no query-log TTL (the OSS default). The ATTACH lands and its reply
    is lost; the server then crashes before the query log's flush (flush_interval_milliseconds,
    7.5 s by default: the ATTACH's line is never written); after the restart the target
    merges the attached parts and the replaced ones are cleaned up. The writer comes back
    15 minutes later: no UUID and no log line shows the ATTACH. attach_evidence_lost()
    returns None whenever query_log_ttl_s is None, whatever the restart, so the batch is
    attached a second time (rows doubled) instead of raising the late-restart alarm that
    the same situation raises for a cut MOVE."""
    clock = Clock()
    reg, wh = MemoryRegistry(), MemoryWarehouse()
    wh.add_table(TARGET)
    tx = Transactor(reg, wh, JOB, clock=clock, publish_retry_s=0.0, sleep=lambda _s: None)
    epoch = tx.begin("run-1")
    parts = stage_batch(wh, epoch.number, 0, [(i, "a") for i in range(6)], 2, 0)
    wh.lose_reply("attach_all")
    with pytest.raises(UnavailableError):
        tx.commit_batch(epoch, "b0", 0, TARGET, parts, visibility=Visibility.BATCH)
    assert wh.target_ids(TARGET) == list(range(6))  # the ATTACH landed
    wh.query_log.clear()  # the crash: the line was never flushed
    wh.merge(TARGET, "a")  # after the restart the attached parts merge ...
    wh.cleanup(TARGET)  # ... and the replaced ones are cleaned up
    clock.now += 900
    wh.uptime_s = 890  # restarted after the PREPARE
    assert wh.query_log_ttl_s is None
    with contextlib.suppress(RecoveryAlarm):
        Transactor(reg, wh, JOB, clock=clock).begin("run-2")
    assert wh.target_ids(TARGET) == list(range(6)), "the batch was attached a second time"


@pytest.mark.parametrize(
    "engine_full",
    [
        # tiered storage only: the log's rows are never deleted
        "MergeTree PARTITION BY toYYYYMM(event_date) ORDER BY (event_date, event_time) "
        "TTL event_date + toIntervalDay(30) TO VOLUME 'cold' SETTINGS storage_policy = 'tiered'",
        # a move after 7 days, a delete after a year (as system.tables prints it)
        "MergeTree ORDER BY event_time TTL event_date + toIntervalDay(7) TO VOLUME 'cold', "
        "event_date + toIntervalDay(365) SETTINGS storage_policy = 'tiered'",
        # a delete after 30 days and a recompression after 7 (engine_full read from chdb 26.9)
        "MergeTree ORDER BY event_time TTL event_date + toIntervalDay(30), event_date + "
        "toIntervalDay(7) RECOMPRESS CODEC(ZSTD(3)) SETTINGS index_granularity = 8192",
    ],
)
def test_a_query_log_ttl_that_keeps_lines_for_days_is_not_read_as_zero(engine_full: str) -> None:
    """log_ttl_seconds() returns 0.0 ("a TTL txsink cannot read") for a query log with a
    tiered-storage TTL: every resumed visibility=batch publish older than old_parts_lifetime
    is then a late-restart RecoveryAlarm although the ATTACH's line is still in the log."""
    from txsink.clickhouse.sqltext import log_ttl_seconds

    got = log_ttl_seconds(engine_full)
    assert got is None or got >= 6 * 86400, got
