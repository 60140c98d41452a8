"""The record transitions both registries apply (pure): what a commit, a tombstone, a
tombstone's growth and a prepare over a tombstone store, and the errors they raise.
:class:`~txsink.ports.registry_memory.MemoryRegistry` and
:class:`~txsink.keeper.kazoo_registry.KazooRegistry` differ in storage only, never in
these decisions."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Any

from txsink.errors import FencedError
from txsink.ports.registry import XidExists
from txsink.protocol.codec import JobMeta, Ledger, decode_job_meta
from txsink.protocol.ids import xid_batch
from txsink.protocol.states import Epoch, Mode, XidRecord, XidState, check_transition


def committed_record(
    record: XidRecord, ledger: Ledger, committed_at: float, epoch: int | None = None
) -> XidRecord:
    """``record`` in state COMMITTED with its commit sequence number (``seq``) and the
    epoch that recorded it (``committed_epoch``; equal to ``record.epoch`` when no crash
    or takeover came between prepare and commit)."""
    return record.with_state(
        XidState.COMMITTED,
        committed_at=committed_at,
        seq=ledger.seq + 1,
        committed_epoch=record.committed_epoch if epoch is None else epoch,
    )


def typed_meta(meta: JobMeta | Mapping[str, Any]) -> JobMeta:
    """Job meta as the registries take it: typed, or a job node's mapping (decoded)."""
    if isinstance(meta, JobMeta):
        return meta
    return decode_job_meta(meta) or JobMeta()


def superseded(epoch: Epoch, current: Epoch | None) -> FencedError:
    """The error a writer whose ``epoch`` is no longer ``current`` gets."""
    return FencedError(
        f"job {epoch.job}: writer epoch {epoch.number} was superseded by epoch "
        f"{current.number if current else '?'}; this writer must stop"
    )


def tombstone(job: str, xid: str, tables: Iterable[str], now: float) -> XidRecord:
    """A fresh ABORTED record naming ``tables`` (see :mod:`txsink.protocol.states`)."""
    return XidRecord(
        job=job,
        xid=xid,
        batch=xid_batch(xid),
        state=XidState.ABORTED,
        epoch=0,
        mode=Mode.ATTACH,
        target="",
        created_at=now,
        aborted_tables=frozenset(tables),
    )


def with_more_aborted(record: XidRecord, tables: Iterable[str]) -> XidRecord | None:
    """``record`` (ABORTED) naming ``tables`` too, or None if it names them all already."""
    merged = record.aborted_tables | set(tables)
    if merged == record.aborted_tables:
        return None
    return record.with_state(XidState.ABORTED, aborted_tables=frozenset(merged))


def over_tombstone(record: XidRecord, tombstone: XidRecord) -> XidRecord:
    """``record`` (PREPARED) replacing an ABORTED tombstone; XidExists if it would adopt
    a table the tombstone rolled back. The tombstone's tables stay listed."""
    if tombstone.aborted_tables & set(record.staging_tables):
        raise XidExists(tombstone)
    check_transition(tombstone.state, record.state)
    return replace(record, aborted_tables=tombstone.aborted_tables)
