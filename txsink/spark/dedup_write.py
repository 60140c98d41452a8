"""Dedup mode's executor path: deterministic blocks inserted straight into the target.

Used where partitions cannot be moved (see docs/modes.md). One Spark task attempt:

1. cuts its partition into deterministic blocks: rows in the order Spark delivers them
   (or sorted by ``dedup_order_by``), boundaries every ``block_rows`` rows. Byte limits
   (``block_bytes``) are *not* applied: they are computed from Arrow buffer sizes of
   whatever batches Spark happened to deliver, which may differ run to run, and a
   different cut would give a replayed block a token it never had;
2. fingerprints each block (BLAKE2b over the Arrow IPC stream of the block, one chunk per
   column, so the digest does not depend on how Spark chunked the rows);
3. asks :mod:`txsink.protocol.dedup` what to do with it given the partition's Keeper state
   ``dedup/<xid>/p<partition>``; before sending a block not yet recorded, writes a BEFORE
   record listing it (so any block that may have landed can be verified on replay);
4. inserts it with ``insert_deduplication_token = dedup_token(job, xid, partition, block)``
   (plus ``insert_deduplicate=1``, ``deduplicate_blocks_in_dependent_materialized_views=1``
   and ``insert_distributed_sync=1``), or skips it (SAME), or raises
   :class:`~txsink.errors.ContentChanged`;
5. writes AFTER once every block is acknowledged and returns a commit message whose parts
   name the target, the Spark partition, rows, blocks and a digest of the partition.

The driver then records the xid PREPARED and COMMITTED (:class:`txsink.transaction.Transactor`
with ``Mode.DEDUP``) and deletes ``dedup/<xid>``.

Memory: without ``dedup_order_by`` at most one block (plus the Spark batch being cut) is
held, as in attach mode. With ``dedup_order_by`` the whole partition is materialised and
sorted in the Python worker (about its Arrow size twice, during the sort): keep
partitions small (more Spark partitions) when using it.
"""

from __future__ import annotations

import hashlib
import io
import logging
import re
import time
from collections.abc import Iterator
from typing import Any

import pyarrow as pa
from pyarrow import ipc

from txsink.clickhouse.compat import TargetInfo
from txsink.clickhouse.warehouse import iter_blocks
from txsink.driver import open_registry, open_warehouse
from txsink.errors import ConfigError, ContentChanged
from txsink.faults import fault_point
from txsink.protocol import dedup
from txsink.protocol.ids import dedup_token
from txsink.protocol.states import StagedPart
from txsink.spark.writer import QUERY_ID_PROPERTY, TxCommitMessage, WritePlan, check_nulls

log = logging.getLogger(__name__)

# Effectively no byte limit: block boundaries depend on row counts only (see module doc).
NO_BYTE_LIMIT = 1 << 62
DIGEST_PREFIX = "b2:"  # the hash in use; a stored digest of another kind never matches


class _HashSink(io.RawIOBase):
    """A write-only file that feeds what is written into a hash (no copy of the stream)."""

    def __init__(self, digest: Any) -> None:
        self.digest = digest

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        self.digest.update(data)
        return len(data)


def fingerprint(index: int, block: pa.Table) -> dedup.BlockFingerprint:
    """Content digest of one block; independent of how its rows were chunked.

    hashlib releases the GIL on large buffers; about 25 ms per million narrow rows
    (4 columns, 31 MB) here, against about 200 ms to insert them.
    """
    digest = hashlib.blake2b(digest_size=16)
    table = block.combine_chunks()
    with ipc.new_stream(pa.PythonFile(_HashSink(digest), mode="w"), table.schema) as writer:
        writer.write_table(table)
    return dedup.BlockFingerprint(index, block.num_rows, DIGEST_PREFIX + digest.hexdigest())


def insert_settings(job: str, xid: str, partition: int, index: int) -> dict[str, Any]:
    """Per-block insert settings of dedup mode."""
    return {
        "insert_deduplication_token": dedup_token(job, xid, partition, index),
        "insert_deduplicate": 1,
        # without it a replayed block is dropped from the target but its materialized
        # views receive it again (checked on chdb 26.9: tests/integration/test_dedup_mode.py)
        "deduplicate_blocks_in_dependent_materialized_views": 1,
        # Distributed targets: insert synchronously into the shards, whose local tables
        # deduplicate; harmless for other engines (alias of distributed_foreground_insert)
        "insert_distributed_sync": 1,
    }


def checked(plan: WritePlan, batches: Iterator[Any]) -> Iterator[Any]:
    for batch in batches:
        check_nulls(plan, batch)
        yield batch


def sorted_partition(plan: WritePlan, batches: Iterator[Any], partition: int) -> Iterator[Any]:
    """The whole partition sorted by ``dedup_order_by`` (materialised: see module doc)."""
    order = plan.config.dedup_order_by
    collected = list(batches)
    if not collected:
        return iter(())
    table = pa.Table.from_batches(collected)
    missing = [c for c in order if c not in table.column_names]
    if missing:
        raise ConfigError(
            f"option dedup_order_by names {', '.join(missing)}, which the DataFrame written to "
            f"{plan.config.table} does not have (columns: {', '.join(table.column_names)})"
        )
    log.info(
        "job %s: sorting Spark partition %d (%d rows, %.1f MB) by %s for dedup mode",
        plan.config.job, partition, table.num_rows, table.nbytes / 1e6, ",".join(order),
    )  # fmt: skip
    # pyarrow's sort is stable: rows equal in the sort key keep Spark's order, so the
    # key should be unique for the order to be deterministic.
    return iter(table.sort_by([(c, "ascending") for c in order]).to_batches())


def content_changed(
    plan: WritePlan,
    *,
    xid: str,
    batch: int | None,
    partition: int,
    stored: dedup.PartitionState | None,
    refusal: dedup.Refusal,
) -> ContentChanged:
    job = plan.config.job
    attempt = stored.attempt if stored else "?"
    return ContentChanged(
        f"job {job}: replay of xid {xid} (batch {batch}) differs in Spark partition {partition}, "
        f"block {refusal.block} ({refusal.decision.value}): {refusal.detail}; recorded by task "
        f"attempt {attempt} as {stored.status.value if stored else '-'}. Nothing further of "
        f"this partition was inserted. The source did not replay the same rows in the same "
        f"partitions (docs/modes.md#what-breaks-dedup-mode): restore the batch's input and "
        f"restart. Rows of this xid already in {plan.config.table} are those recorded in "
        f"Keeper at {plan.config.keeper_root}/jobs/{job}/{dedup.xid_key(xid)}."
    )


def write_partition_dedup(
    plan: WritePlan,
    batches: Iterator[Any],
    run_id: str,
    xid: str,
    batch: int | None,
    ctx: Any,
    started: float,
) -> TxCommitMessage:
    """Executor: insert one Spark partition into the target as deterministic blocks."""
    cfg = plan.config
    partition, attempt = int(ctx.partitionId()), int(ctx.attemptNumber())
    key = dedup.partition_key(xid, partition)
    rows: Iterator[Any] = checked(plan, batches)
    if cfg.dedup_order_by:
        rows = sorted_partition(plan, rows, partition)
    blocks = iter_blocks(rows, block_rows=cfg.block_rows, block_bytes=NO_BYTE_LIMIT)
    first = next(blocks, None)
    registry = open_registry(cfg)
    try:
        stored = dedup.PartitionState.from_json(registry.get_blob(cfg.job, key))
        if first is None:  # an empty partition inserts nothing and records nothing...
            refusal = dedup.decide_end(stored, 0)  # ...unless an earlier attempt had rows
            if refusal is not None:
                raise content_changed(
                    plan, xid=xid, batch=batch, partition=partition, stored=stored, refusal=refusal
                )
            return TxCommitMessage(
                run_id, xid, batch, seconds=time.time() - started, extra=_ident(ctx)
            )
        warehouse = open_warehouse(cfg)
        done: list[dedup.BlockFingerprint] = []
        inserted = skipped = total = 0

        def chained() -> Iterator[pa.Table]:
            yield first
            yield from blocks

        for index, block in enumerate(chained()):
            fp = fingerprint(index, block)
            step = dedup.decide_block(stored, index, fp)
            if step.action is dedup.BlockAction.REFUSE and step.refusal is not None:
                raise content_changed(
                    plan,
                    xid=xid,
                    batch=batch,
                    partition=partition,
                    stored=stored,
                    refusal=step.refusal,
                )
            done.append(fp)
            if step.action is dedup.BlockAction.INSERT:
                if dedup.needs_before_record(stored, index):
                    registry.put_blob(
                        cfg.job, key, dedup.before(done, attempt, time.time()).to_json()
                    )
                warehouse.insert_blocks(
                    cfg.table,
                    block.to_batches(),
                    block_rows=block.num_rows,
                    block_bytes=NO_BYTE_LIMIT,
                    settings=insert_settings(cfg.job, xid, partition, index),
                )
                inserted += 1
            else:
                skipped += 1
            total += block.num_rows
            if index == 0:
                fault_point("executor.mid_write")
            del block
        refusal = dedup.decide_end(stored, len(done))
        if refusal is not None:
            raise content_changed(
                plan, xid=xid, batch=batch, partition=partition, stored=stored, refusal=refusal
            )
        decision = dedup.summarize(stored, inserted, skipped, len(done))
        if decision is not dedup.Decision.SAME:
            registry.put_blob(cfg.job, key, dedup.after(done, attempt, time.time()).to_json())
    finally:
        registry.close()
    if decision is dedup.Decision.SAME:
        from txsink.metrics import count

        count(cfg, dedup_skips=1)
    if decision is not dedup.Decision.NEW:
        log.warning(
            "job %s: xid %s partition %d: %s (%d block(s) re-sent with their tokens, %d skipped)",
            cfg.job, xid, partition, decision.value, inserted, skipped,
        )  # fmt: skip
    digest = hashlib.blake2b("".join(b.digest for b in done).encode(), digest_size=8)
    part = StagedPart(cfg.table, str(partition), total, len(done), digest.hexdigest())
    return TxCommitMessage(
        run_id,
        xid,
        batch,
        (part,),
        (),
        rows=total,
        seconds=time.time() - started,
        extra={
            "decision": decision.value,
            "inserted": inserted,
            "skipped": skipped,
            **_ident(ctx),
        },
    )


def _ident(ctx: Any) -> dict[str, str]:
    """The streaming query id, which the driver checks against the job's (see driver.py)."""
    return {"query_id": ctx.getLocalProperty(QUERY_ID_PROPERTY) or ""}


_TO_RE = re.compile(
    r"\bMATERIALIZED\s+VIEW\s+.+?\s+TO\s+((?:`[^`]+`|[A-Za-z_][A-Za-z0-9_]*)"
    r"(?:\s*\.\s*(?:`[^`]+`|[A-Za-z_][A-Za-z0-9_]*))?)",
    re.IGNORECASE | re.DOTALL,
)


def view_tables(warehouse: Any, info: TargetInfo) -> tuple[TargetInfo, ...]:
    """The tables ``info``'s materialized views store into (``TO`` table or inner table).

    Driver-side, for :func:`txsink.clickhouse.compat.dedup_blockers`: a view table without
    a dedup window counts a replayed block twice.
    """
    out: list[TargetInfo] = []
    for view in info.dependent_views:
        vdb, vname = view.split(".", 1)
        rows = warehouse.client.query_rows(
            "SELECT create_table_query, toString(uuid) FROM system.tables "
            "WHERE database = {db:String} AND name = {t:String}",
            parameters={"db": vdb, "t": vname},
            what=f"inspect materialized view {view}",
        )
        if not rows:
            continue
        create, uuid = str(rows[0][0]), str(rows[0][1])
        m = _TO_RE.search(create.split(" AS SELECT", 1)[0])
        if m:
            parts = [p.strip().strip("`") for p in m.group(1).split(".", 1)]
            names = [f"{parts[0]}.{parts[1]}" if len(parts) == 2 else f"{vdb}.{parts[0]}"]
        else:
            names = [f"{vdb}..inner_id.{uuid}", f"{vdb}..inner.{vname}"]
        for name in names:
            db, table = name.split(".", 1)
            found = warehouse.client.query_rows(
                "SELECT count() FROM system.tables "
                "WHERE database = {db:String} AND name = {t:String}",
                parameters={"db": db, "t": table},
                what=f"find the table of materialized view {view}",
            )
            if found and int(found[0][0]):
                quoted = f"{db}.`{table}`" if table.startswith(".") else name
                out.append(warehouse.target_info(quoted))
                break
    return tuple(out)
