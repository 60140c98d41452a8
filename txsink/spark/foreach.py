"""``txsink.foreach_batch(**options)``: the sink for users who transform in foreachBatch.

Each call writes the micro-batch DataFrame through ``mapInArrow``
(:func:`txsink.spark.multi.save`: the executor write and the commit of the data source,
on every Spark version, 3.5 included), using the streaming batch id as ``txn_version``
(so the xid is ``b<batchId>``, as with ``format("clickhouse_tx")``) and the streaming
run id for fencing. A replayed batch is therefore a no-op, exactly as in the streaming
sink.

A second call for the same job and batch in the same run (two saves in one foreachBatch
call) is refused before it writes anything, in this process: on a restart, Spark replays
the batch and its first save is skipped as committed, so the Keeper record alone could
not tell the second save from a replay, and its rows would be dropped silently.

Under Spark Connect the function runs in a Python worker of the Connect server, on a
session without a SparkContext, and the save it issues runs on another thread than the
micro-batch, so Spark's run id is out of reach. The callable then draws its own run id
once, on its first batch: Spark Connect unpickles the function afresh for every start of
the query, so the id is stable across the batches of one run and new for every restart,
which is what fencing needs (a run id per save would make every batch a takeover).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from typing import Any

from txsink.config import WriterConfig
from txsink.credentials import split_url
from txsink.errors import ConfigError
from txsink.spark.multi import require_arrow_map, save

log = logging.getLogger(__name__)

# (keeper, root, job) -> (run id, batch id) of the last save in this process
_LAST_BATCH: dict[tuple[str, str, str], tuple[str, int]] = {}


def make_foreach_batch(**options: Any) -> Callable[[Any, int], None]:
    WriterConfig.from_options(options)  # fail fast on bad options, before the query starts
    require_arrow_map()
    url = str(options.get("url") or "")
    creds = split_url(url)
    if creds.url != url:  # keep userinfo out of the Spark plan (Spark masks `password`)
        options = {**options, "url": creds.url}
        if creds.user is not None:
            options["user"] = creds.user
        if creds.password is not None:
            options["password"] = creds.password
    config = WriterConfig.from_options(options)
    job_key = (config.keeper, config.keeper_root, config.job)
    own_run: list[str] = []  # Spark Connect: this run's id, drawn on the first batch
    released_on_stop: set[str] = set()  # runs whose clean stop releases the writer

    def write_batch(df: Any, batch_id: int) -> None:
        spark = df.sparkSession
        try:
            run_id = spark.sparkContext.getLocalProperty("spark.jobGroup.id") or ""
        except Exception:  # noqa: BLE001 - Spark Connect sessions have no SparkContext
            if not own_run:
                own_run.append(f"connect-{uuid.uuid4().hex}")
            run_id = own_run[0]
        if _LAST_BATCH.get(job_key) == (run_id, batch_id):
            raise ConfigError(
                f"job {config.job}: batch {batch_id} was already saved in this foreachBatch "
                f"call (run {run_id or '?'}); a second save under one job would be skipped as "
                f"a replay. Nothing was written. Write every table of a batch inside one "
                f"`txsink.transaction(...)`, or keep this job for the first save and give the "
                f"second its own job name, with option first_batch={batch_id} (its batches "
                f"start at the replay of this one)"
            )
        _LAST_BATCH[job_key] = (run_id, batch_id)
        if run_id and not own_run and run_id not in released_on_stop:
            released_on_stop.add(run_id)
            release_on_stop(config, run_id)
        opts = {k: str(v) for k, v in options.items()}
        opts["txn_version"] = str(batch_id)
        opts["micro_batch"] = "true"
        if run_id:
            opts["run_id"] = run_id
        save(df, WriterConfig.from_options(opts))

    return write_batch


def release_on_stop(config: WriterConfig, run_id: str) -> None:
    """When the query of ``run_id`` stops cleanly (``query.stop()``, or its input is
    exhausted), mark the job's writer finished (:meth:`Transactor.release`): status then
    reads the job stopped at once instead of live until its heartbeat goes stale. A query
    that ends in an error, or a run that lost the job, changes nothing. Best effort: a
    store that cannot be reached leaves the writer to go stale as before."""
    from pyspark.sql import SparkSession
    from pyspark.sql.streaming.listener import StreamingQueryListener

    from txsink.driver import borrowed_job
    from txsink.errors import TxSinkError

    class ReleaseOnStop(StreamingQueryListener):
        def onQueryStarted(self, event: Any) -> None:
            return None

        def onQueryProgress(self, event: Any) -> None:
            return None

        def onQueryIdle(self, event: Any) -> None:
            return None

        def onQueryTerminated(self, event: Any) -> None:
            if str(event.runId) != run_id:
                return
            try:
                if event.exception is None:
                    with borrowed_job(config) as handle:
                        handle.transactor.release(run_id)
            except TxSinkError as exc:
                log.warning("job %s: run %s stopped; writer not released: %s", config.job,
                            run_id, exc)  # fmt: skip
            finally:
                started_on.streams.removeListener(self)

    # Not on the batch's session: that is the stream's clone, whose listener bus hears
    # only queries started on it. The query was started from the process's session.
    started_on = SparkSession.builder.getOrCreate()
    started_on.streams.addListener(ReleaseOnStop())
