"""The coordination store's interface: jobs, writer epochs (fencing), xid records, ledger.

Keeper layout under the root (default ``/txsink``, inside the optional chroot)::

    <root>/jobs/<job>                    job meta: target, mode, created_at, options
    <root>/jobs/<job>/epoch              {"epoch": n, "owner": ..., "since": ts}
                                         its node version is the fencing token
    <root>/jobs/<job>/owner              {"epoch": n, "owner": ..., "heartbeat": ts}
    <root>/jobs/<job>/ledger             {"seq", "committed", "rows", "last_batch",
                                          "last_commit_at", "partitions": {pid: rows}}
    <root>/jobs/<job>/xids/<xid>         an XidRecord (JSON)
    <root>/jobs/<job>/dedup/<xid>/p<n>   dedup-mode BEFORE/AFTER state of one partition

Every state change is fenced: one Keeper transaction checks that the epoch node still has
the writer's token and then creates or compare-and-sets the record. A writer whose epoch
was superseded gets :class:`txsink.errors.FencedError`.

:class:`MemoryRegistry` is the in-memory twin with identical semantics, for unit tests.
"""

from __future__ import annotations

import builtins
import threading
import time
from typing import Any, Protocol

from txsink.errors import FencedError, RetryableConflict
from txsink.protocol.states import Epoch, XidRecord, XidState, check_transition


class XidExists(RetryableConflict):
    """``prepare`` found a record for the xid already; ``existing`` is that record."""

    def __init__(self, existing: XidRecord) -> None:
        super().__init__(f"xid {existing.xid} of job {existing.job} exists ({existing.state})")
        self.existing = existing


class BlobConflict(RetryableConflict):
    """``cas_blob`` lost: the blob is not at the expected version (re-read and decide again)."""


CREATE = -1  # ``expected_version`` of :meth:`Registry.cas_blob` meaning "must not exist yet"


class Registry(Protocol):
    """What the transaction layer needs from Keeper."""

    def ensure_job(self, job: str, meta: dict[str, Any]) -> dict[str, Any]: ...
    def job_meta(self, job: str) -> dict[str, Any] | None: ...
    def list_jobs(self) -> list[str]: ...
    def take_epoch(self, job: str, owner: str) -> Epoch: ...
    def current_epoch(self, job: str) -> Epoch | None: ...
    def heartbeat(self, epoch: Epoch, info: dict[str, Any]) -> None: ...
    def owner(self, job: str) -> dict[str, Any] | None: ...
    def get(self, job: str, xid: str) -> XidRecord | None: ...
    def list(self, job: str) -> builtins.list[XidRecord]: ...
    def prepare(self, epoch: Epoch, record: XidRecord) -> XidRecord: ...
    def commit(self, epoch: Epoch, record: XidRecord, committed_at: float) -> XidRecord: ...
    def ledger(self, job: str) -> dict[str, Any]: ...
    def delete(self, epoch: Epoch, xids: builtins.list[str]) -> None: ...
    def get_blob(self, job: str, key: str) -> dict[str, Any] | None: ...
    def put_blob(self, job: str, key: str, value: dict[str, Any]) -> None: ...
    def get_blob_versioned(self, job: str, key: str) -> tuple[dict[str, Any], int] | None: ...
    def cas_blob(self, job: str, key: str, value: dict[str, Any], expected_version: int) -> int: ...
    def delete_job(self, job: str) -> None: ...
    def delete_blobs(self, job: str, key: str) -> None: ...
    def close(self) -> None: ...


EMPTY_LEDGER: dict[str, Any] = {
    "seq": 0,
    "committed": 0,
    "rows": 0,
    "last_batch": None,
    "last_commit_at": None,
    "partitions": {},
}


def next_ledger(ledger: dict[str, Any], record: XidRecord, committed_at: float) -> dict[str, Any]:
    """The ledger after ``record`` commits (pure; shared by both registries)."""
    parts = dict(ledger.get("partitions", {}))
    for pid, rows in record.partition_rows().items():
        parts[pid] = parts.get(pid, 0) + rows
    last = ledger.get("last_batch")
    if record.batch is not None:
        last = record.batch if last is None else max(int(last), record.batch)
    return {
        "seq": int(ledger.get("seq", 0)) + 1,
        "committed": int(ledger.get("committed", 0)) + 1,
        "rows": int(ledger.get("rows", 0)) + record.rows,
        "last_batch": last,
        "last_commit_at": committed_at,
        "partitions": parts,
    }


def committed_record(
    record: XidRecord, ledger: dict[str, Any], committed_at: float, epoch: int | None = None
) -> XidRecord:
    """``record`` in state COMMITTED with its commit sequence number in ``extra['seq']``
    and the epoch that recorded it in ``extra['committed_epoch']`` (equal to
    ``record.epoch`` when no crash or takeover came between prepare and commit)."""
    extra = dict(record.extra)
    extra["seq"] = int(ledger.get("seq", 0)) + 1
    if epoch is not None:
        extra["committed_epoch"] = epoch
    return record.with_state(XidState.COMMITTED, committed_at=committed_at, extra=extra)


class MemoryRegistry:
    """In-memory twin of :class:`txsink.keeper.kazoo_registry.KazooRegistry` (unit tests)."""

    def __init__(self, clock: Any = time.time) -> None:
        self._lock = threading.Lock()
        self._jobs: dict[str, dict[str, Any]] = {}
        self._epochs: dict[str, Epoch] = {}
        self._owners: dict[str, dict[str, Any]] = {}
        self._xids: dict[str, dict[str, XidRecord]] = {}
        self._ledgers: dict[str, dict[str, Any]] = {}
        self._blobs: dict[tuple[str, str], dict[str, Any]] = {}
        self._blob_versions: dict[tuple[str, str], int] = {}
        self._clock = clock

    def ensure_job(self, job: str, meta: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            return self._jobs.setdefault(job, dict(meta))

    def job_meta(self, job: str) -> dict[str, Any] | None:
        return self._jobs.get(job)

    def list_jobs(self) -> builtins.list[str]:
        return sorted(self._jobs)

    def take_epoch(self, job: str, owner: str) -> Epoch:
        with self._lock:
            old = self._epochs.get(job)
            new = Epoch(job, (old.number + 1) if old else 1, (old.token + 1) if old else 0, owner)
            self._epochs[job] = new
            return new

    def current_epoch(self, job: str) -> Epoch | None:
        return self._epochs.get(job)

    def _fence(self, epoch: Epoch) -> None:
        cur = self._epochs.get(epoch.job)
        if cur is None or cur.token != epoch.token:
            raise FencedError(
                f"job {epoch.job}: writer epoch {epoch.number} was superseded by epoch "
                f"{cur.number if cur else '?'}; this writer must stop"
            )

    def heartbeat(self, epoch: Epoch, info: dict[str, Any]) -> None:
        with self._lock:
            self._fence(epoch)
            self._owners[epoch.job] = {
                "epoch": epoch.number,
                "owner": epoch.owner,
                "heartbeat": self._clock(),
                **info,
            }

    def owner(self, job: str) -> dict[str, Any] | None:
        return self._owners.get(job)

    def get(self, job: str, xid: str) -> XidRecord | None:
        return self._xids.get(job, {}).get(xid)

    def list(self, job: str) -> builtins.list[XidRecord]:
        return list(self._xids.get(job, {}).values())

    def prepare(self, epoch: Epoch, record: XidRecord) -> XidRecord:
        with self._lock:
            self._fence(epoch)
            check_transition(None, record.state)
            xids = self._xids.setdefault(epoch.job, {})
            if record.xid in xids:
                raise XidExists(xids[record.xid])
            stored = XidRecord(**{**record.__dict__, "version": 0})
            xids[record.xid] = stored
            return stored

    def commit(self, epoch: Epoch, record: XidRecord, committed_at: float) -> XidRecord:
        with self._lock:
            self._fence(epoch)
            cur = self._xids.get(epoch.job, {}).get(record.xid)
            if cur is None or cur.version != record.version:
                raise RetryableConflict(f"xid {record.xid} changed under us; re-read and retry")
            ledger = self._ledgers.get(epoch.job, dict(EMPTY_LEDGER))
            done = committed_record(cur, ledger, committed_at, epoch.number)
            done = XidRecord(**{**done.__dict__, "version": cur.version + 1})
            self._xids[epoch.job][record.xid] = done
            self._ledgers[epoch.job] = next_ledger(ledger, cur, committed_at)
            return done

    def ledger(self, job: str) -> dict[str, Any]:
        return dict(self._ledgers.get(job, EMPTY_LEDGER))

    def delete(self, epoch: Epoch, xids: builtins.list[str]) -> None:
        with self._lock:
            self._fence(epoch)
            for xid in xids:
                self._xids.get(epoch.job, {}).pop(xid, None)

    def get_blob(self, job: str, key: str) -> dict[str, Any] | None:
        return self._blobs.get((job, key))

    def put_blob(self, job: str, key: str, value: dict[str, Any]) -> None:
        with self._lock:
            self._store_blob((job, key), value)

    def _store_blob(self, k: tuple[str, str], value: dict[str, Any]) -> int:
        version = self._blob_versions[k] + 1 if k in self._blobs else 0
        self._blobs[k] = dict(value)
        self._blob_versions[k] = version
        return version

    def get_blob_versioned(self, job: str, key: str) -> tuple[dict[str, Any], int] | None:
        """The blob and its version (bumped by every write, 0 when created), or None."""
        with self._lock:
            if (job, key) not in self._blobs:
                return None
            return dict(self._blobs[(job, key)]), self._blob_versions[(job, key)]

    def cas_blob(self, job: str, key: str, value: dict[str, Any], expected_version: int) -> int:
        """Write the blob only if it is at ``expected_version`` (``CREATE``: absent); the
        new version, or :class:`BlobConflict` with nothing written."""
        with self._lock:
            k = (job, key)
            current = self._blob_versions[k] if k in self._blobs else CREATE
            if current != expected_version:
                raise BlobConflict(
                    f"job {job}: blob {key} is at version {current}, not {expected_version}; "
                    "re-read it and decide again"
                )
            return self._store_blob(k, value)

    def delete_blobs(self, job: str, key: str) -> None:
        """Remove blob ``key`` and every blob under ``key/`` (dedup state of a committed xid)."""
        with self._lock:
            doomed = [k for k in self._blobs if k[0] == job and f"{k[1]}/".startswith(f"{key}/")]
            for k in doomed:
                del self._blobs[k]
                self._blob_versions.pop(k, None)

    def delete_job(self, job: str) -> None:
        """Remove a job and everything under it (unfenced: scratch jobs of `txsink tune`)."""
        with self._lock:
            self._jobs.pop(job, None)
            self._epochs.pop(job, None)
            self._owners.pop(job, None)
            self._xids.pop(job, None)
            self._ledgers.pop(job, None)
            for key in [k for k in self._blobs if k[0] == job]:
                del self._blobs[key]
                self._blob_versions.pop(key, None)

    def close(self) -> None:
        return None
