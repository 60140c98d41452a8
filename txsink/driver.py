"""Opening a job on the driver: clients from a config, and the writer epoch of a run.

A Spark streaming query runs its driver-side ``commit`` in a fresh Python worker for
every micro-batch, so nothing survives in memory between batches. What identifies one
query *run* is Spark's run id (the ``spark.jobGroup.id`` executors see, carried to the
commit in the task messages). The first commit of a run takes a new writer epoch in
Keeper, which fences every older run, and recovers the job; later commits of the same
run find their run id as the epoch's owner and go straight on. A run that was once
superseded can never take the job back (``runs/<run id>`` remembers it).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from txsink.config import WriterConfig
from txsink.errors import FencedError
from txsink.keeper.registry import Registry
from txsink.protocol.states import Epoch
from txsink.transaction import Transactor

log = logging.getLogger(__name__)


def open_registry(config: WriterConfig) -> Registry:
    from txsink.keeper.kazoo_registry import KazooRegistry

    return KazooRegistry.from_options(
        config.keeper, config.keeper_root, config.keeper_auth or None, config.keeper_timeout
    )


def open_client(config: WriterConfig, **settings: Any) -> Any:
    from txsink.clickhouse.client import RetryPolicy, connect

    return connect(
        config.url,
        config.user,
        config.password,
        connect_timeout=config.connect_timeout,
        send_receive_timeout=config.send_receive_timeout,
        verify=config.verify,
        ca_cert=config.ca_cert or None,
        compress=None if config.compress == "none" else config.compress,
        settings=settings or None,
        retry=RetryPolicy(attempts=config.retry_attempts, max_wait=config.retry_max_wait),
    )


def open_warehouse(config: WriterConfig, client: Any | None = None) -> Any:
    from txsink.clickhouse.warehouse import ClickHouseWarehouse

    return ClickHouseWarehouse(client or open_client(config), config.staging_database)


@dataclass
class JobHandle:
    """The driver's view of one job for one commit: stores plus the transaction runner."""

    config: WriterConfig
    registry: Registry
    warehouse: Any
    transactor: Transactor

    def close(self) -> None:
        self.registry.close()
        close = getattr(getattr(self.warehouse, "client", None), "close", None)
        if close:
            close()


def open_job(config: WriterConfig) -> JobHandle:
    registry = open_registry(config)
    try:
        warehouse = open_warehouse(config)
    except BaseException:
        registry.close()
        raise
    return JobHandle(
        config, registry, warehouse, Transactor(registry, warehouse, config.job, retention=config.retention)
    )


def job_meta(config: WriterConfig, mode: str) -> dict[str, Any]:
    return {
        "job": config.job,
        "target": config.table,
        "mode": mode,
        "url": config.url,
        "staging_database": config.staging_database,
        "created_at": time.time(),
    }


def epoch_for_run(
    handle: JobHandle, run_id: str, mode: str, keep: Iterable[str] = ()
) -> Epoch:
    """The epoch of ``run_id``: the current one if the run owns the job, else a takeover.

    ``keep`` lists staging tables of the batch being committed: the takeover's recovery
    must not roll them back.
    """
    registry, job = handle.registry, handle.config.job
    current = registry.current_epoch(job)
    if current is not None and current.owner == run_id:
        return current
    if registry.get_blob(job, f"runs/{run_id}") is not None:
        raise FencedError(
            f"job {job}: run {run_id} was superseded by run {current.owner if current else '?'} "
            f"(epoch {current.number if current else '?'}); this query must stop. Two queries "
            f"must not write with the same job name."
        )
    registry.put_blob(job, f"runs/{run_id}", {"started_at": time.time()})
    epoch = handle.transactor.begin(run_id, meta=job_meta(handle.config, mode), keep=set(keep))
    if current is not None:
        log.warning(
            "job %s: run %s took over from %s (epoch %d -> %d)",
            job, run_id, current.owner, current.number, epoch.number,
        )
    return epoch
