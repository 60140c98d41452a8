"""The job's mode is decided once and pinned (issue 10, row 1): pure decisions only."""

from __future__ import annotations

from typing import Any

import pytest

from tests.unit.test_compat import info
from txsink.committer import batch_mode
from txsink.config import WriterConfig
from txsink.errors import ConfigError, FencedError
from txsink.ops.mode import change_mode
from txsink.ops.stores import Stores
from txsink.ports.registry_memory import MemoryRegistry
from txsink.ports.warehouse_memory import MemoryWarehouse
from txsink.protocol.ids import staging_name
from txsink.protocol.states import StagedPart, XidRecord
from txsink.spark.messages import TxCommitMessage, WritePlan
from txsink.spark.validate import choose_mode, pinned_mode
from txsink.transactor import Transactor

BASE = {"url": "http://h:8123", "keeper": "k:2181", "table": "db.t", "job": "j"}


def config(mode: str = "auto") -> WriterConfig:
    return WriterConfig.from_options({**BASE, "mode": mode})


def with_view() -> object:
    return info(
        dependent_views=("db.mv",), settings={"non_replicated_deduplication_window": "1000"}
    )


def test_auto_follows_the_pinned_mode_not_the_target_of_the_moment() -> None:
    plain = info(settings={"non_replicated_deduplication_window": "1000"})
    assert choose_mode(config(), plain, pinned="dedup") == "dedup"  # auto would say attach
    assert choose_mode(config(), plain, pinned=None) == "attach"


def test_a_view_on_a_target_pinned_to_attach_is_refused_with_the_mode_command() -> None:
    with pytest.raises(ConfigError, match=r"pinned to attach.*txsink mode --job j --set dedup"):
        choose_mode(config(), with_view(), pinned="attach")  # type: ignore[arg-type]


def test_an_explicit_mode_other_than_the_pinned_one_is_refused() -> None:
    plain = info(settings={"non_replicated_deduplication_window": "1000"})
    with pytest.raises(ConfigError, match="pinned to mode attach"):
        choose_mode(config("dedup"), plain, pinned="attach")


def test_only_attach_and_dedup_pin_a_job() -> None:
    assert pinned_mode({"mode": "attach"}) == "attach"
    assert pinned_mode({"mode": "auto"}) is None and pinned_mode(None) is None


def message(mode: str, skipped: bool = False) -> TxCommitMessage:
    return TxCommitMessage("run", "b1", 1, skipped=skipped, extra={"mode": mode})


def test_a_batch_whose_tasks_wrote_in_another_mode_is_never_committed() -> None:
    plan = WritePlan(config(), "dedup")
    with pytest.raises(ConfigError, match="wrote in mode attach"):
        batch_mode(plan, [message("attach"), message("attach")], "b1")
    with pytest.raises(ConfigError, match="attach/dedup"):
        batch_mode(plan, [message("attach"), message("dedup")], "b1")
    assert batch_mode(plan, [message("dedup"), message("attach", skipped=True)], "b1").value == (
        "dedup"
    )


# -- changing the mode: fence first, and never stage a batch dedup mode began ------------


class PrepareDuringCheck(MemoryRegistry):
    """A registry on which a writer prepares right after `txsink mode` read the xids."""

    def __init__(self) -> None:
        super().__init__()
        self.writer: Any = None
        self.outcome: str = ""

    def list(self, job: str) -> list[XidRecord]:
        seen = super().list(job)
        if self.writer is not None and not self.outcome:
            tx, epoch, parts = self.writer
            try:
                tx.commit_batch(epoch, "b1", 1, "db.t", parts)
                self.outcome = "prepared"
            except FencedError:
                self.outcome = "fenced"
        return seen


def test_a_prepare_racing_the_mode_change_is_fenced_not_left_in_the_old_mode() -> None:
    reg, wh = PrepareDuringCheck(), MemoryWarehouse()
    reg.ensure_job("j", {"target": "db.t", "mode": "attach"})
    tx = Transactor(reg, wh, "j", fault=lambda _p: None)
    epoch = tx.begin("run-1")
    wh.stage(staging_name("j", "b1", "0000000a", 0, 0, 0).table, {"p": [1, 2]})
    parts = [StagedPart(staging_name("j", "b1", "0000000a", 0, 0, 0).table, "p", 2)]
    reg.writer = (tx, epoch, parts)
    change_mode(Stores(reg, None), "j", "dedup", stale_after=600, force=True)  # type: ignore[arg-type]
    assert reg.outcome == "fenced"
    assert reg.get("j", "b1") is None and wh.target_ids("db.t") == []


def test_an_attach_batch_whose_xid_has_dedup_state_is_refused_not_staged_again() -> None:
    reg, wh = MemoryRegistry(), MemoryWarehouse()
    tx = Transactor(reg, wh, "j")
    epoch = tx.begin("run-2")
    reg.put_blob("j", "dedup/b5/p0", {"status": "BEFORE", "blocks": []})  # a dedup task ran
    table = staging_name("j", "b5", "0000000b", 0, 0, 0).table
    wh.stage(table, {"p": [1]})
    with pytest.raises(ConfigError, match="dedup-mode state"):
        tx.commit_batch(epoch, "b5", 5, "db.t", [StagedPart(table, "p", 1)])
    assert wh.target_ids("db.t") == [] and reg.get("j", "b5") is None


def test_a_sharded_job_cannot_be_switched_to_dedup() -> None:
    """Its target is a local table on every shard: dedup would insert through another
    table, visible before the commit refuses it."""
    reg = MemoryRegistry()
    reg.ensure_job("j", {"target": "db.t_local", "mode": "attach", "shards": ["http://a:1"]})
    with pytest.raises(ConfigError, match="takes attach mode only"):
        change_mode(Stores(reg, None), "j", "dedup", stale_after=600, force=True)  # type: ignore[arg-type]
    assert reg.job_meta("j").mode == "attach"  # type: ignore[union-attr]


def test_a_mode_change_refused_for_a_live_writer_is_exit_3_and_after_the_fence_exit_4() -> None:
    """Refused with nothing done (a live writer: Exit.REFUSED), or refused after the
    writer was fenced (a PREPARED xid: Exit.OPERATOR, the message says it is fenced)."""
    from txsink.cli.output import Exit, exit_of
    from txsink.errors import RecoveryAlarm, Refused
    from txsink.protocol.states import Mode, XidRecord, XidState

    reg = MemoryRegistry()
    reg.ensure_job("j", {"target": "db.t", "mode": "attach"})
    epoch = Transactor(reg, MemoryWarehouse(), "j").begin("run-1")  # heartbeat: now
    with pytest.raises(Refused, match="live writer") as live:
        change_mode(Stores(reg, None), "j", "dedup", stale_after=None, force=False)  # type: ignore[arg-type]
    assert exit_of(live.value) is Exit.REFUSED
    assert reg.current_epoch("j") == epoch  # nothing was done
    reg.prepare(
        epoch, XidRecord("j", "b1", 1, XidState.PREPARED, epoch.number, Mode.ATTACH, "db.t")
    )
    with pytest.raises(RecoveryAlarm, match="fenced now") as fenced:
        change_mode(Stores(reg, None), "j", "dedup", stale_after=None, force=True)  # type: ignore[arg-type]
    assert exit_of(fenced.value) is Exit.OPERATOR
    assert reg.job_meta("j").mode == "attach"  # type: ignore[union-attr]
