"""Keeper fails under a commit: ZooKeeper killed and restarted, a session expired, the
reply of a prepare or commit lost. Real ZooKeeper, real engine, the real Transactor.

The invariant: a Keeper outage shorter than ``keeper_retry_s`` costs a pause, not a
failed batch, and whatever the outage, the target ends with every row exactly once.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest

from tests.integration.test_rollback_races import counts, stage
from tests.nemesis.services import Services, expire_session
from txsink.config import WriterConfig
from txsink.driver import JobHandle, open_job
from txsink.errors import CommitOutcomeUnknown
from txsink.protocol.states import XidState


def open_handle(nemesis: Services, target: str, **options: str) -> JobHandle:
    config = WriterConfig.from_options(
        {
            "url": nemesis.info.url,
            "keeper": nemesis.info.keeper,
            "table": target,
            "job": f"nem-{uuid.uuid4().hex[:8]}",
            "keeper_timeout": "5",
            **options,
        }
    )
    handle = open_job(config)
    handle.warehouse.ensure_staging_db()
    return handle


def at(point: str, action: Callable[[], object]) -> Callable[[str], None]:
    """A fault hook for the Transactor: run ``action`` once when ``point`` is reached."""
    fired: list[str] = []

    def hook(reached: str) -> None:
        if reached == point and not fired:
            fired.append(point)
            action()

    return hook


@pytest.mark.parametrize("point", ["driver.before_prepare", "driver.after_commit"])
def test_a_zookeeper_restart_during_the_commit_is_ridden_out_and_the_batch_is_exact(
    nemesis: Services, ch: Any, target: str, point: str
) -> None:
    handle = open_handle(nemesis, target)
    try:
        tx = handle.transactor
        epoch = tx.begin("run-1")
        parts = stage(handle, "b1", "0000000a", range(0, 300))
        restarts: list[Any] = []
        tx.fault = at(point, lambda: restarts.append(nemesis.outage("zookeeper", 2.0)))
        started = time.monotonic()
        result = tx.commit_batch(epoch, "b1", 1, target, parts, streaming=True)
        took = time.monotonic() - started
        assert restarts, f"the fault hook never reached {point}"
        restarts[0].join(60)
        assert result.action in ("committed", "rolled_forward")
        assert counts(ch, target) == (300, 300)
        assert handle.registry.get(handle.config.job, "b1").state is XidState.COMMITTED
        assert took >= 2.0  # it really waited for ZooKeeper to come back
    finally:
        handle.close()


def test_without_keeper_retries_the_same_outage_fails_the_commit_and_recovery_is_exact(
    nemesis: Services, ch: Any, target: str
) -> None:
    """The control: with ``keeper_retry_s=0`` the outage surfaces as an unknown outcome (the
    old behaviour, a failed Spark batch); the restart's recovery still ends exact."""
    handle = open_handle(nemesis, target, keeper_retry_s="0")
    try:
        tx = handle.transactor
        epoch = tx.begin("run-1")
        parts = stage(handle, "b1", "0000000a", range(0, 200))
        restarts: list[Any] = []
        # longer than two keeper_timeouts (5 s each): neither the commit nor the re-read
        # that asks whether it landed anyway can wait it out (kazoo sends a request queued
        # during an outage once it reconnects: with a shorter outage the re-read finds
        # the commit landed, and the batch is reported committed, also exact)
        tx.fault = at(
            "driver.after_commit", lambda: restarts.append(nemesis.outage("zookeeper", 15.0))
        )
        with pytest.raises(CommitOutcomeUnknown):
            tx.commit_batch(epoch, "b1", 1, target, parts, streaming=True)
        restarts[0].join(60)
    finally:
        handle.close()
    again = open_handle(nemesis, target, job=handle.config.job)
    try:
        again.transactor.begin("run-2")
        assert counts(ch, target) == (200, 200)
        assert again.registry.get(handle.config.job, "b1").state is XidState.COMMITTED
    finally:
        again.close()


@pytest.mark.parametrize("point", ["driver.before_prepare", "driver.after_commit"])
def test_an_expired_keeper_session_during_the_commit_is_ridden_out(
    nemesis: Services, ch: Any, target: str, point: str
) -> None:
    handle = open_handle(nemesis, target)
    try:
        tx = handle.transactor
        epoch = tx.begin("run-1")
        parts = stage(handle, "b1", "0000000a", range(0, 100))
        client = handle.registry._conn.client  # type: ignore[attr-defined]
        before = client.client_id[0]
        tx.fault = at(point, lambda: expire_session(client, nemesis.info.keeper))
        result = tx.commit_batch(epoch, "b1", 1, target, parts, streaming=True)
        assert result.action in ("committed", "rolled_forward")
        assert client.client_id[0] != before  # a new session really was opened
        assert counts(ch, target) == (100, 100)
        assert handle.registry.get(handle.config.job, "b1").state is XidState.COMMITTED
    finally:
        handle.close()
