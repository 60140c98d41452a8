"""The two reference sinks every txsink figure is compared with, as Spark Python data sources.

- ``bench_noop``: a ``DataSourceArrowWriter`` that only counts rows: Spark's own ceiling
  (Parquet scan, Arrow conversion, hand-over to the Python worker).
- ``bench_baseline``: the at-least-once sink users write today: each task opens a stock
  clickhouse-connect client and calls ``insert_arrow`` straight into the target, in
  blocks of the same ``block_rows`` / ``block_bytes`` and with the same ``compress``
  setting as txsink's defaults, on the same HTTP endpoint. No txsink code runs.

Both go through the same Spark path as ``clickhouse_tx`` (Arrow batches into a Python
data source writer), so the ratios measure what the sink itself costs.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from pyspark.sql.datasource import (
    DataSource,
    DataSourceArrowWriter,
    DataSourceStreamArrowWriter,
    WriterCommitMessage,
)

DEFAULT_BLOCK_ROWS = 1_000_000  # txsink's block_rows default
DEFAULT_BLOCK_BYTES = 256 * 1024 * 1024  # txsink's block_bytes default


@dataclass
class RowsMessage(WriterCommitMessage):
    rows: int


class NoopDataSource(DataSource):
    @classmethod
    def name(cls) -> str:
        return "bench_noop"

    def writer(self, schema: Any, overwrite: bool) -> NoopWriter:
        return NoopWriter()

    def streamWriter(self, schema: Any, overwrite: bool) -> NoopStreamWriter:
        return NoopStreamWriter()


class NoopWriter(DataSourceArrowWriter):
    def write(self, iterator: Iterator[Any]) -> RowsMessage:
        return RowsMessage(sum(batch.num_rows for batch in iterator))


class NoopStreamWriter(DataSourceStreamArrowWriter):
    def write(self, iterator: Iterator[Any]) -> RowsMessage:
        return NoopWriter().write(iterator)

    def commit(self, messages: list[Any], batchId: int) -> None:
        pass


class BaselineDataSource(DataSource):
    @classmethod
    def name(cls) -> str:
        return "bench_baseline"

    def writer(self, schema: Any, overwrite: bool) -> BaselineWriter:
        return BaselineWriter(dict(self.options))

    def streamWriter(self, schema: Any, overwrite: bool) -> BaselineStreamWriter:
        return BaselineStreamWriter(dict(self.options))


def blocks(batches: Iterator[Any], block_rows: int, block_bytes: int) -> Iterator[Any]:
    """Group Arrow batches into tables of at most ``block_rows`` rows / ``block_bytes``."""
    import pyarrow as pa

    pending: list[Any] = []
    rows = size = 0
    for batch in batches:
        if pending and (rows + batch.num_rows > block_rows or size + batch.nbytes > block_bytes):
            yield pa.Table.from_batches(pending)
            pending, rows, size = [], 0, 0
        pending.append(batch)
        rows += batch.num_rows
        size += batch.nbytes
    if pending:
        yield pa.Table.from_batches(pending)


class BaselineWriter(DataSourceArrowWriter):
    def __init__(self, options: dict[str, str]) -> None:
        self.options = options

    def write(self, iterator: Iterator[Any]) -> RowsMessage:
        import clickhouse_connect

        opts = self.options
        host, port = opts["url"].rsplit("/", 1)[-1].split(":")
        db, table = opts["table"].split(".")
        compress = opts.get("compress", "lz4")
        client = clickhouse_connect.get_client(
            host=host,
            port=int(port),
            compress=False if compress == "none" else compress,
            autogenerate_session_id=False,
        )
        rows = 0
        try:
            for block in blocks(
                iterator,
                int(opts.get("block_rows", DEFAULT_BLOCK_ROWS)),
                int(opts.get("block_bytes", DEFAULT_BLOCK_BYTES)),
            ):
                client.insert_arrow(table, block, database=db)
                rows += block.num_rows
        finally:
            client.close()
        return RowsMessage(rows)


class BaselineStreamWriter(DataSourceStreamArrowWriter):
    """foreachBatch-style at-least-once: every micro-batch inserted, nothing recorded."""

    def __init__(self, options: dict[str, str]) -> None:
        self.options = options

    def write(self, iterator: Iterator[Any]) -> RowsMessage:
        return BaselineWriter(self.options).write(iterator)

    def commit(self, messages: list[Any], batchId: int) -> None:
        pass


def register_sinks(spark: Any) -> None:
    spark.dataSource.register(NoopDataSource)
    spark.dataSource.register(BaselineDataSource)
