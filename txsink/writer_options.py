"""The writer options as keyword arguments: a ``TypedDict`` that mypy and IDEs check.

Generated from the options registry (:data:`txsink.options.OPTIONS`) by
``python -m txsink.options_doc txsink/writer_options.py``; a unit test fails when it is
stale. Numbers and booleans may be given as text too, as Spark options are; each
key's meaning is in docs/options.md.
"""

from __future__ import annotations

from typing import Literal, TypedDict


class WriterOptions(TypedDict, total=False):
    """Keyword options of ``txsink.foreach_batch``, ``txsink.transaction`` and
    ``txsink.progress_listener`` (the ``settings.<name>`` form is for ``.option``)."""

    url: str
    user: str
    password: str
    table: str
    keeper: str
    state: Literal["keeper", "clickhouse"]
    state_database: str
    job: str
    mode: Literal["auto", "attach", "dedup"]
    visibility: Literal["auto", "partition", "batch"]
    compact_bytes: int | str
    staging_database: str
    keeper_root: str
    keeper_auth: str
    keeper_timeout: float | str
    keeper_retry_s: float | str
    block_rows: int | str
    block_bytes: int | str
    compress: Literal["lz4", "zstd", "gzip", "none"]
    connect_timeout: float | str
    send_receive_timeout: float | str
    verify: bool | str
    ca_cert: str
    retry_attempts: int | str
    retry_max_wait: float | str
    publish_retry_s: float | str
    txn_version: int | str
    retention: int | str
    dedup_order_by: str
    dedup_min_window: int | str
    first_batch: int | str
    skip_committed_replays: bool | str
    metrics_textfile: str
    metrics_port: int | str
    shards: str
    shard_by: str
    shard_http_port: int | str
    settings: str
    create_table: Literal["never", "if_missing"]
    order_by: str
    partition_by: str
    engine: str
    table_settings: str
