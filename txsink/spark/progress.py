"""``txsink.progress_listener(**options)``: what txsink did in each micro-batch, next to
Spark's own progress.

Spark's Python data source API lets a sink report no custom metrics into
``StreamingQueryProgress`` (its Python metrics are the worker's own timings), so txsink
offers a ``StreamingQueryListener`` the user attaches in one line::

    spark.streams.addListener(txsink.progress_listener(url=..., keeper=..., table=..., job=...))

For every progress event of a query it reads the job's xid record of that micro-batch
(``b<batchId>``: the same for ``format("clickhouse_tx")``, ``foreach_batch`` and
``transaction``), logs one line (logger ``txsink.progress``, INFO) and keeps the newest
entries in :attr:`TxProgressListener.history`: xid, mode, state, rows and the
milliseconds from PREPARE to COMMITTED. A batch committed and already pruned, or one that
wrote nothing, reads as ``state=None``. It runs on the driver, reads Keeper once per
micro-batch and never writes.
"""

from __future__ import annotations

import collections
import logging
from dataclasses import asdict, dataclass
from typing import Any

from pyspark.sql.streaming.listener import StreamingQueryListener

from txsink.config import WriterConfig
from txsink.errors import TxSinkError
from txsink.protocol.ids import batch_xid

log = logging.getLogger("txsink.progress")


@dataclass(frozen=True)
class BatchProgress:
    """What txsink recorded for one micro-batch."""

    query: str  # the query's name, else its id
    batch: int
    xid: str
    state: str | None  # PREPARED | COMMITTED | ABORTED, None when there is no record
    mode: str | None
    rows: int
    commit_ms: float | None  # PREPARE to COMMITTED

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class TxProgressListener(StreamingQueryListener):
    """See the module doc; ``history`` holds the newest ``keep`` entries."""

    def __init__(self, config: WriterConfig, keep: int = 200) -> None:
        self.config = config
        self.history: collections.deque[BatchProgress] = collections.deque(maxlen=keep)
        self._registry: Any = None

    def onQueryStarted(self, event: Any) -> None:
        return None

    def onQueryProgress(self, event: Any) -> None:
        progress = event.progress
        batch = int(progress.batchId)
        entry = self.read(progress.name or str(progress.id), batch)
        if entry is None:
            return
        self.history.append(entry)
        log.info(
            "txsink: query %s batch %d: xid %s %s, mode %s, %d rows, commit %s ms",
            entry.query, batch, entry.xid, entry.state, entry.mode, entry.rows,
            "-" if entry.commit_ms is None else f"{entry.commit_ms:.0f}",
        )  # fmt: skip

    def onQueryTerminated(self, event: Any) -> None:
        self.close()

    def read(self, query: str, batch: int) -> BatchProgress | None:
        """The entry of ``batch`` from Keeper (None when Keeper cannot be read: the
        listener must never disturb the query)."""
        from txsink.driver import open_registry

        xid = batch_xid(batch)
        try:
            if self._registry is None:
                self._registry = open_registry(self.config)
            record = self._registry.get(self.config.job, xid)
        except TxSinkError as exc:
            log.warning(
                "txsink progress: cannot read xid %s of job %s: %s", xid, self.config.job, exc
            )
            return None
        if record is None:
            return BatchProgress(query, batch, xid, None, None, 0, None)
        done = record.committed_at
        return BatchProgress(
            query,
            batch,
            xid,
            record.state.value,
            record.mode.value,
            record.rows,
            None if done is None else round((done - record.created_at) * 1000.0, 1),
        )

    def close(self) -> None:
        if self._registry is not None:
            self._registry.close()
            self._registry = None


def progress_listener(**options: Any) -> TxProgressListener:
    """A listener for ``spark.streams.addListener`` (the sink's options; see the module doc)."""
    return TxProgressListener(WriterConfig.from_options(options))
