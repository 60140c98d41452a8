"""The coordination store's interface: jobs, writer epochs (fencing), xid records, ledger.

Keeper layout under the root (default ``/txsink``, inside the optional chroot)::

    <root>/jobs/<job>                    job meta (JobMeta): target, mode, created_at, ...
    <root>/jobs/<job>/epoch              {"epoch": n, "owner": ..., "since": ts}
                                         its node version is the fencing token
    <root>/jobs/<job>/owner              OwnerInfo: {"epoch", "owner", "heartbeat", ...}
    <root>/jobs/<job>/ledger             Ledger: totals, bounded (:mod:`txsink.ports.ledger`)
    <root>/jobs/<job>/xids/<xid>         an XidRecord (JSON), manifest compact inline or
                                         a reference to chunk nodes
    <root>/jobs/<job>/manifests/<xid>.<nonce>.<i>
                                         chunk i of a large manifest (see
                                         :mod:`txsink.ports.manifest_codec`)
    <root>/jobs/<job>/dedup/<xid>/p<n>   dedup-mode BEFORE/AFTER state of one partition
    <root>/namespace                     {"id": random hex}: this store's id, part of every
                                         staging name (two roots never share staging)

Every node's JSON is written and read by :mod:`txsink.protocol.codec` and carries the
state format it was written in (``"format"``; nodes of releases before it read as format
0); the registries exchange typed records (``XidRecord``, ``JobMeta``, ``Ledger``,
``OwnerInfo``), never raw dicts, except blobs, whose owners encode them.

Every state change is fenced: one Keeper transaction checks that the epoch node still has
the writer's token and then creates or compare-and-sets the record. A writer whose epoch
was superseded gets :class:`txsink.errors.FencedError`. ``fence`` is that check alone
(one transaction, ordered by the leader with every write, so no lagging server answers
it; on the KeeperMap store one read through the server's Keeper session, as its sync),
for ClickHouse statements no Keeper write fences. ``prepare(..., unless_blob=key)`` also
proves, in the same transaction, that blob ``key`` does not exist (a node left empty is
deleted first; anything under it is :class:`BlobPresent`);
``commit(..., beat=facts)`` also writes the owner node, as ``heartbeat(epoch, facts)``.

Reads may be stale: a ZooKeeper follower answers from its own copy of the tree, which can
lag the leader (by a moment, or for ``syncLimit`` ticks when it is cut off). A session
always sees its own writes, not yet other sessions'. :meth:`Registry.sync` brings the
session up to every write the ensemble acknowledged before it; callers use it before a
read whose answer decides an action that no fenced write re-checks (see
docs/architecture.md, "Stale reads").

Every store implements :class:`Registry` and passes ``tests/registry_contract.py``:
:class:`~txsink.ports.registry_memory.MemoryRegistry` (the in-memory twin, for unit
tests) and :class:`~txsink.keeper.kazoo_registry.KazooRegistry` (ZooKeeper / ClickHouse
Keeper). The record rules every store applies are shared and pure
(:mod:`txsink.ports.record_rules`, :mod:`txsink.ports.ledger`,
:mod:`txsink.ports.manifest_codec`, :mod:`txsink.ports.cas`).
"""

from __future__ import annotations

import builtins
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from txsink.errors import RetryableConflict, TxSinkError
from txsink.protocol.codec import JobMeta, Ledger, OwnerInfo
from txsink.protocol.states import Cut, Epoch, XidRecord


class XidExists(RetryableConflict):
    """``prepare`` found a record for the xid already; ``existing`` is that record."""

    def __init__(self, existing: XidRecord) -> None:
        super().__init__(f"xid {existing.xid} of job {existing.job} exists ({existing.state})")
        self.existing = existing


class BlobConflict(RetryableConflict):
    """``cas_blob`` lost: the blob is not at the expected version (re-read and decide again)."""


class BlobPresent(TxSinkError):
    """``prepare(..., unless_blob=key)`` found blobs under ``key``: nothing was prepared.
    The caller decides what they mean (re-read them) and prepares again."""

    def __init__(self, job: str, key: str) -> None:
        super().__init__(f"job {job}: blob {key} exists; nothing was prepared")
        self.key = key


@dataclass(frozen=True)
class BatchView:
    """What a commit decides on, read together (one round trip; one statement on the
    KeeperMap store): the job's epoch, the batch's xid record and the ledger."""

    epoch: Epoch | None
    record: XidRecord | None
    ledger: Ledger


CREATE = -1  # ``expected_version`` of :meth:`Registry.cas_blob` meaning "must not exist yet"


class Registry(Protocol):
    """What the transaction layer needs from Keeper."""

    def ensure_job(self, job: str, meta: JobMeta | Mapping[str, Any]) -> JobMeta: ...
    def sync(self, job: str) -> None: ...
    def job_meta(self, job: str) -> JobMeta | None: ...
    def set_job_meta(self, job: str, meta: JobMeta) -> None: ...
    def blob_children(self, job: str, key: str) -> builtins.list[str]: ...
    def list_jobs(self) -> list[str]: ...
    def take_epoch(self, job: str, owner: str) -> Epoch: ...
    def current_epoch(self, job: str) -> Epoch | None: ...
    def fence(self, epoch: Epoch) -> None: ...
    def heartbeat(self, epoch: Epoch, info: Mapping[str, Any]) -> None: ...
    def owner(self, job: str) -> OwnerInfo | None: ...
    def get(self, job: str, xid: str) -> XidRecord | None: ...
    def list(self, job: str) -> builtins.list[XidRecord]: ...
    def prepare(self, epoch: Epoch, record: XidRecord, *, unless_blob: str = "") -> XidRecord: ...
    def abort(self, job: str, xid: str, tables: Iterable[str], now: float) -> XidRecord: ...
    def namespace(self) -> str: ...
    def amend(self, epoch: Epoch, record: XidRecord, cuts: Iterable[Cut]) -> XidRecord: ...
    def commit(
        self,
        epoch: Epoch,
        record: XidRecord,
        committed_at: float,
        beat: Mapping[str, Any] | None = None,
    ) -> XidRecord: ...
    def ledger(self, job: str) -> Ledger: ...
    def batch_view(self, job: str, xid: str) -> BatchView: ...
    def delete(self, epoch: Epoch, xids: builtins.list[str]) -> None: ...
    def get_blob(self, job: str, key: str) -> dict[str, Any] | None: ...
    def put_blob(self, job: str, key: str, value: dict[str, Any]) -> None: ...
    def get_blob_versioned(self, job: str, key: str) -> tuple[dict[str, Any], int] | None: ...
    def cas_blob(self, job: str, key: str, value: dict[str, Any], expected_version: int) -> int: ...
    def delete_job(self, job: str) -> None: ...
    def delete_blobs(self, job: str, key: str) -> None: ...
    def close(self) -> None: ...
