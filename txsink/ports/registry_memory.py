"""The in-memory twin of the :class:`~txsink.ports.registry.Registry` port.

:class:`MemoryRegistry` keeps every record in process memory with exactly
:class:`~txsink.keeper.kazoo_registry.KazooRegistry`'s semantics (fencing, CAS, bounded
nodes, the ledger), so the protocol is tested exhaustively without services; both pass
``tests/registry_contract.py``.
"""

from __future__ import annotations

import builtins
import json
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Any

from txsink.errors import FencedError, RetryableConflict
from txsink.ports.cas import CasRetry, cas
from txsink.ports.ledger import next_ledger
from txsink.ports.manifest_codec import (
    CHUNKS_DIR,
    PackedRecord,
    check_request,
    chunk_ref,
    new_nonce,
    pack_record,
    parse_chunk_name,
    repack,
    unpack_record,
)
from txsink.ports.record_rules import (
    committed_record,
    over_tombstone,
    superseded,
    tombstone,
    typed_meta,
    with_more_aborted,
)
from txsink.ports.registry import CREATE, BatchView, BlobConflict, BlobPresent, XidExists
from txsink.protocol.codec import (
    JobMeta,
    Ledger,
    OwnerInfo,
    decode_job_meta,
    decode_ledger,
    decode_owner,
    encode_job_meta,
    encode_ledger,
    encode_owner,
    encode_record,
)
from txsink.protocol.states import Cut, Epoch, XidRecord, XidState, check_transition


def encode_json(value: dict[str, Any]) -> bytes:
    """Node data as Keeper holds it (canonical JSON; same bytes as kazoo_conn.encode)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


class MemoryRegistry:
    """In-memory twin of :class:`txsink.keeper.kazoo_registry.KazooRegistry` (unit tests)."""

    def __init__(self, clock: Any = time.time, namespace: str = "") -> None:
        self._lock = threading.RLock()
        self._jobs: dict[str, dict[str, Any]] = {}
        self._epochs: dict[str, Epoch] = {}
        self._owners: dict[str, dict[str, Any]] = {}
        self._nodes: dict[str, dict[str, tuple[dict[str, Any], int]]] = {}
        self._chunks: dict[str, dict[str, bytes]] = {}
        self._ledgers: dict[str, dict[str, Any]] = {}
        self._blobs: dict[tuple[str, str], dict[str, Any]] = {}
        # "" keeps pre-namespace staging names (unit tests build names without one)
        self._namespace = namespace
        self._blob_versions: dict[tuple[str, str], int] = {}
        self._clock = clock

    def ensure_job(self, job: str, meta: JobMeta | Mapping[str, Any]) -> JobMeta:
        path = self._path(job, "")
        node = encode_job_meta(typed_meta(meta))
        check_request(f"ensure job {path}", [(path, len(encode_json(node)))])
        with self._lock:
            return typed_meta(self._jobs.setdefault(job, node))

    def sync(self, job: str) -> None:
        """Nothing to do: this twin's reads are never stale."""

    def job_meta(self, job: str) -> JobMeta | None:
        return decode_job_meta(self._jobs.get(job), self._path(job, ""))

    def list_jobs(self) -> builtins.list[str]:
        """Jobs with meta, and jobs whose only trace is dedup state (a first batch that
        stopped half-way)."""
        dedup = {job for job, key in self._blobs if key.startswith("dedup/")}
        return sorted(set(self._jobs) | dedup)

    def set_job_meta(self, job: str, meta: JobMeta) -> None:
        """Replace an existing job's meta (operator actions such as `txsink mode`)."""
        with self._lock:
            if job not in self._jobs:
                raise KeyError(job)
            self._jobs[job] = encode_job_meta(meta)

    def blob_children(self, job: str, key: str) -> builtins.list[str]:
        """Names directly under blob ``key`` (e.g. xids with dedup state under ``dedup``)."""
        prefix = f"{key}/"
        names = {k[1][len(prefix) :].split("/")[0] for k in self._blobs if k[0] == job
                 and k[1].startswith(prefix)}  # fmt: skip
        return sorted(names)

    def namespace(self) -> str:
        return self._namespace

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
            raise superseded(epoch, cur)

    def fence(self, epoch: Epoch) -> None:
        with self._lock:
            self._fence(epoch)

    def heartbeat(self, epoch: Epoch, info: Mapping[str, Any]) -> None:
        with self._lock:
            self._fence(epoch)
            self._owners[epoch.job] = self._owner_node(epoch, info)

    def _owner_node(self, epoch: Epoch, info: Mapping[str, Any]) -> dict[str, Any]:
        details = {k: v for k, v in info.items() if k != "state"}
        beat = OwnerInfo(epoch.number, epoch.owner, self._clock(), info.get("state", ""), details)
        return encode_owner(beat)

    def owner(self, job: str) -> OwnerInfo | None:
        return decode_owner(self._owners.get(job), self._path(job, "owner"))

    # Xid records are stored as Keeper would hold them: the packed node (JSON) and its
    # chunk nodes, so the twin runs the same layout code as KazooRegistry.

    def _path(self, job: str, name: str) -> str:
        return f"/txsink/jobs/{job}/{name}"

    def _unpack(self, job: str, xid: str, node: dict[str, Any], version: int) -> XidRecord:
        ref = chunk_ref(node)
        chunks = None
        if ref is not None:
            store = self._chunks.get(job, {})
            chunks = [store[n] for n in ref.names(xid) if n in store]
        return unpack_record(node, chunks, version, self._path(job, f"xids/{xid}"))

    def get(self, job: str, xid: str) -> XidRecord | None:
        with self._lock:
            found = self._nodes.get(job, {}).get(xid)
            return None if found is None else self._unpack(job, xid, *found)

    def list(self, job: str) -> builtins.list[XidRecord]:
        with self._lock:
            return [self._unpack(job, x, *f) for x, f in self._nodes.get(job, {}).items()]

    def manifest_chunks(self, job: str) -> builtins.list[str]:
        """Names of the job's chunk nodes (``<xid>.<nonce>.<i>``), live and orphaned."""
        with self._lock:
            return sorted(self._chunks.get(job, {}))

    def _stage_chunks(self, epoch: Epoch, record: XidRecord) -> PackedRecord:
        """Step 1 of prepare: lay the record out and write its chunks (no record yet)."""
        packed = pack_record(replace(record, version=0), new_nonce())
        store = self._chunks.setdefault(epoch.job, {})
        for name, data in packed.named_chunks(record.xid):
            check_request(
                f"write {name}", [(self._path(epoch.job, f"{CHUNKS_DIR}/{name}"), len(data))]
            )
            with self._lock:
                store[name] = data
        return packed

    def prepare(self, epoch: Epoch, record: XidRecord, *, unless_blob: str = "") -> XidRecord:
        with self._lock:
            self._fence(epoch)
            check_transition(None, record.state)
        incoming = record

        def attempt() -> XidRecord:
            with self._lock:
                existing = self._nodes.get(epoch.job, {}).get(incoming.xid)
                record, over = incoming, None
                if existing is not None:
                    cur = self._unpack(epoch.job, incoming.xid, *existing)
                    if cur.state is not XidState.ABORTED:
                        raise XidExists(cur)
                    record, over = over_tombstone(incoming, cur), existing[1]
            packed = self._stage_chunks(epoch, record)
            names = packed.ref.names(record.xid) if packed.ref else []
            xid_path = self._path(epoch.job, f"xids/{record.xid}")
            check_request(
                f"prepare {xid_path}",
                [(self._path(epoch.job, "epoch"), 0), (xid_path, len(encode_json(packed.node)))]
                + [(self._path(epoch.job, f"{CHUNKS_DIR}/{n}"), 0) for n in names],
            )
            with self._lock:
                store = self._chunks.setdefault(epoch.job, {})
                try:
                    self._fence(epoch)
                except FencedError:
                    for n in names:
                        store.pop(n, None)
                    raise
                if any(n not in store for n in names):
                    raise CasRetry  # a sweep took our chunks before the record existed
                if unless_blob and self._has_blob(epoch.job, unless_blob):
                    for n in names:
                        store.pop(n, None)
                    raise BlobPresent(epoch.job, unless_blob)
                xids = self._nodes.setdefault(epoch.job, {})
                now = xids.get(record.xid)
                if (now[1] if now else None) != over:
                    for n in names:  # the node changed since we read it: decide again
                        store.pop(n, None)
                    raise CasRetry
                version = 0 if over is None else over + 1
                xids[record.xid] = (packed.node, version)
                return self._unpack(epoch.job, record.xid, packed.node, version)

        return cas(f"xid {record.xid} of job {epoch.job}", attempt)

    def abort(self, job: str, xid: str, tables: Iterable[str], now: float) -> XidRecord:
        with self._lock:
            xids = self._nodes.setdefault(job, {})
            found = xids.get(xid)
            if found is None:
                new = tombstone(job, xid, tables, now)
                xids[xid] = (encode_record(new), 0)
                return replace(new, version=0)
            cur = self._unpack(job, xid, *found)
            if cur.state is not XidState.ABORTED:
                return cur
            more = with_more_aborted(cur, tables)
            if more is None:
                return cur
            xids[xid] = (encode_record(more), found[1] + 1)
            return replace(more, version=found[1] + 1)

    def amend(self, epoch: Epoch, record: XidRecord, cuts: Iterable[Cut]) -> XidRecord:
        with self._lock:
            self._fence(epoch)
            found = self._nodes.get(epoch.job, {}).get(record.xid)
            if found is None:
                raise RetryableConflict(f"xid {record.xid} is no longer PREPARED; re-read")
            node, version = found
            cur = self._unpack(epoch.job, record.xid, node, version)
            if cur.state is not XidState.PREPARED:
                raise RetryableConflict(f"xid {record.xid} is no longer PREPARED; re-read")
            done = cur.with_cuts(cuts)
            if done.cuts == cur.cuts:
                return cur
            new_node = repack(done, node)
            check_request(
                f"amend xid {record.xid} of job {epoch.job}",
                [(self._path(epoch.job, "epoch"), 0),
                 (self._path(epoch.job, f"xids/{record.xid}"), len(encode_json(new_node)))],
            )  # fmt: skip
            self._nodes[epoch.job][record.xid] = (new_node, version + 1)
            return replace(done, version=version + 1)

    def commit(
        self,
        epoch: Epoch,
        record: XidRecord,
        committed_at: float,
        beat: Mapping[str, Any] | None = None,
    ) -> XidRecord:
        with self._lock:
            self._fence(epoch)
            found = self._nodes.get(epoch.job, {}).get(record.xid)
            if found is None or found[1] != record.version:
                raise RetryableConflict(f"xid {record.xid} changed under us; re-read and retry")
            node, version = found
            cur = self._unpack(epoch.job, record.xid, node, version)
            ledger = decode_ledger(self._ledgers.get(epoch.job))
            done = committed_record(cur, ledger, committed_at, epoch.number)
            new_ledger = encode_ledger(next_ledger(ledger, cur, committed_at))
            new_node = repack(done, node)
            check_request(
                f"commit xid {record.xid} of job {epoch.job}",
                [
                    (self._path(epoch.job, "epoch"), 0),
                    (self._path(epoch.job, f"xids/{record.xid}"), len(encode_json(new_node))),
                    (self._path(epoch.job, "ledger"), len(encode_json(new_ledger))),
                ],
            )
            self._nodes[epoch.job][record.xid] = (new_node, version + 1)
            self._ledgers[epoch.job] = new_ledger
            if beat is not None:
                self._owners[epoch.job] = self._owner_node(epoch, beat)
            return replace(done, version=version + 1)

    def ledger(self, job: str) -> Ledger:
        return decode_ledger(self._ledgers.get(job), self._path(job, "ledger"))

    def batch_view(self, job: str, xid: str) -> BatchView:
        with self._lock:
            return BatchView(self.current_epoch(job), self.get(job, xid), self.ledger(job))

    def delete(self, epoch: Epoch, xids: builtins.list[str]) -> None:
        """Delete records, then every chunk no record references (theirs and orphans)."""
        with self._lock:
            self._fence(epoch)
            nodes = self._nodes.get(epoch.job, {})
            for xid in xids:
                nodes.pop(xid, None)
            store = self._chunks.get(epoch.job, {})
            for name in builtins.list(store):
                parsed = parse_chunk_name(name)
                if parsed is None:
                    continue
                found = nodes.get(parsed[0])
                ref = None if found is None else chunk_ref(found[0])
                if ref is None or ref.nonce != parsed[1]:
                    del store[name]

    def _has_blob(self, job: str, key: str) -> bool:
        return any(k[0] == job and f"{k[1]}/".startswith(f"{key}/") for k in self._blobs)

    def get_blob(self, job: str, key: str) -> dict[str, Any] | None:
        return self._blobs.get((job, key))

    def put_blob(self, job: str, key: str, value: dict[str, Any]) -> None:
        path = self._path(job, key)
        check_request(f"write {path}", [(path, len(encode_json(value)))])
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
        path = self._path(job, key)
        check_request(f"write {path}", [(path, len(encode_json(value)))])
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
            self._nodes.pop(job, None)
            self._chunks.pop(job, None)
            self._ledgers.pop(job, None)
            for key in [k for k in self._blobs if k[0] == job]:
                del self._blobs[key]
                self._blob_versions.pop(key, None)

    def close(self) -> None:
        return None
