"""The job's mode is decided once and pinned (issue 10, row 1): pure decisions only."""

from __future__ import annotations

import pytest

from tests.unit.test_compat import info
from txsink.config import WriterConfig
from txsink.errors import ConfigError
from txsink.spark.validate import pinned_mode, resolve_mode
from txsink.spark.writer import TxCommitMessage, WritePlan, batch_mode

BASE = {"url": "http://h:8123", "keeper": "k:2181", "table": "db.t", "job": "j"}


def config(mode: str = "auto") -> WriterConfig:
    return WriterConfig.from_options({**BASE, "mode": mode})


def with_view() -> object:
    return info(
        dependent_views=("db.mv",), settings={"non_replicated_deduplication_window": "1000"}
    )


def test_auto_follows_the_pinned_mode_not_the_target_of_the_moment() -> None:
    plain = info(settings={"non_replicated_deduplication_window": "1000"})
    assert resolve_mode(config(), plain, pinned="dedup") == "dedup"  # auto would say attach
    assert resolve_mode(config(), plain, pinned=None) == "attach"


def test_a_view_on_a_target_pinned_to_attach_is_refused_with_the_mode_command() -> None:
    with pytest.raises(ConfigError, match=r"pinned to attach.*txsink mode --job j --set dedup"):
        resolve_mode(config(), with_view(), pinned="attach")  # type: ignore[arg-type]


def test_an_explicit_mode_other_than_the_pinned_one_is_refused() -> None:
    plain = info(settings={"non_replicated_deduplication_window": "1000"})
    with pytest.raises(ConfigError, match="pinned to mode attach"):
        resolve_mode(config("dedup"), plain, pinned="attach")


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
