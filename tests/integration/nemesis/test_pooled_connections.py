"""Connections pooled across tasks and batches (issue 12) against services that die.

Spark reuses Python workers, so the Keeper session and the ClickHouse client of one batch
serve the next (txsink.driver). A pooled connection must never make a batch fail or
publish twice because the server behind it was restarted in between: the next borrower
gets a working connection (kazoo's reconnected session, or a new one), and a statement
that is not idempotent (CREATE of staging, MOVE) is not lost to a stale socket.
"""

from __future__ import annotations

import uuid
from typing import Any

from tests.integration.test_rollback_races import counts, stage
from tests.nemesis.services import Services
from txsink import driver
from txsink.config import WriterConfig
from txsink.protocol.ids import batch_xid, run_tag
from txsink.protocol.states import XidState


def config_for(nemesis: Services, target: str) -> WriterConfig:
    return WriterConfig.from_options(
        {
            "url": nemesis.info.url,
            "keeper": nemesis.info.keeper,
            "table": target,
            "job": f"pool-{uuid.uuid4().hex[:8]}",
            "keeper_timeout": "5",
        }
    )


def commit(config: WriterConfig, b: int, ids: range) -> None:
    """One batch as a reused commit worker runs it: everything on borrowed connections."""
    with driver.borrowed_job(config) as handle:
        handle.warehouse.ensure_staging_db()
        epoch = handle.transactor.begin("run-1") if b == 0 else None
        epoch = epoch or handle.registry.current_epoch(config.job)
        assert epoch is not None
        parts = stage(handle, batch_xid(b), run_tag("run-1"), ids)
        result = handle.transactor.commit_batch(
            epoch, batch_xid(b), b, config.table, parts, streaming=True
        )
        assert result.action == "committed"


def test_pooled_connections_serve_the_next_batch_after_zookeeper_and_clickhouse_restart(
    nemesis: Services, ch: Any, target: str
) -> None:
    driver.close_pooled()
    config = config_for(nemesis, target)
    commit(config, 0, range(0, 100))
    with driver.borrowed_registry(config) as registry:
        first_registry = registry
    with driver.borrowed_warehouse(config) as warehouse:
        first_client = warehouse.client
    assert not first_registry._conn._closed

    nemesis.kill("zookeeper")
    nemesis.kill("clickhouse")
    nemesis.restart()

    # the idle connections are stale now; the next batch must not notice
    commit(config, 1, range(100, 200))
    commit(config, 2, range(200, 300))
    with driver.borrowed_registry(config) as registry:
        assert registry.get(config.job, batch_xid(2)).state is XidState.COMMITTED  # type: ignore[union-attr]
    with driver.borrowed_warehouse(config) as warehouse:
        assert warehouse.client is first_client  # the HTTP client reconnects under the hood
    assert counts(ch, target) == (300, 300)
    driver.close_pooled()
