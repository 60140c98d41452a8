"""``KazooRegistry``: the :class:`txsink.keeper.registry.Registry` on ZooKeeper / ClickHouse
Keeper through kazoo, with exactly :class:`~txsink.keeper.registry.MemoryRegistry`'s semantics.

This module owns the Keeper layout described in :mod:`txsink.keeper.registry` and the
registry operations on it. The session, the node primitives and the mapping of every kazoo
error onto :mod:`txsink.errors` live in :mod:`txsink.keeper.kazoo_conn`; the two modules
are the only places that import kazoo.

Invariants:

- Every fenced write (``prepare``, ``commit``, ``delete``, ``heartbeat``) is ONE Keeper
  multi-op transaction whose first op checks that ``<job>/epoch`` still has the writer's
  token (its node version). A failed check is :class:`FencedError`; nothing was written.
- ``commit`` compare-and-sets the xid node (on ``record.version``) and the ledger node in
  the same transaction, so the ledger counts every committed xid exactly once.
- A lost connection or an expired session during an operation is
  :class:`UnavailableError`, never a silent success: the caller re-runs the (idempotent)
  step, which then finds what actually landed (``XidExists``, a COMMITTED record).
- With ``auth="user:password"`` job nodes get an ACL that gives that digest identity ALL
  and everyone else READ, so other identities can watch a job but not alter it.
"""

from __future__ import annotations

import builtins
import copy
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any, NoReturn

from kazoo.client import KazooClient
from kazoo.exceptions import BadVersionError, NodeExistsError, NoNodeError

from txsink.errors import ConfigError, FencedError, RetryableConflict, TxSinkError
from txsink.keeper.kazoo_conn import KazooConn, encode
from txsink.keeper.registry import (
    CREATE,
    EMPTY_LEDGER,
    BlobConflict,
    XidExists,
    committed_record,
    next_ledger,
)
from txsink.protocol.states import Epoch, XidRecord, check_transition

log = logging.getLogger(__name__)

DEFAULT_ROOT = "/txsink"
DEFAULT_TIMEOUT = 10.0

# Names under <root>/jobs/<job> that belong to the registry itself, not to blobs.
RESERVED_KEYS = frozenset({"epoch", "owner", "ledger", "xids"})
# Deletes per fenced transaction: keeps one multi-op far below jute.maxbuffer (1 MiB).
DELETE_CHUNK = 500
# A CAS loop that loses this often is not contention but a bug or a runaway peer.
MAX_CAS_ROUNDS = 50


def _check_name(kind: str, name: str) -> str:
    if not name or "/" in name or name in {".", ".."} or name.strip() != name:
        raise ConfigError(f"invalid {kind} name {name!r}: must be non-empty, without '/'")
    return name


class KazooRegistry:
    """The coordination store on a real Keeper; see the module docstring for guarantees."""

    def __init__(
        self,
        keeper: str,
        root: str = DEFAULT_ROOT,
        *,
        auth: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        client: KazooClient | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not root.startswith("/") or (root.endswith("/") and root != "/"):
            raise ConfigError(f"Keeper root {root!r} must be an absolute path like /txsink")
        if auth is not None and ":" not in auth:
            raise ConfigError("Keeper auth must be 'user:password' (digest scheme)")
        self._root = root.rstrip("/")
        self._clock = clock
        self._conn = KazooConn(keeper, auth=auth, timeout=timeout, client=client)
        try:
            with self._conn.mapped(f"create {self._jobs_root()}"):
                # Open ACL on purpose: other identities must be able to add their own jobs.
                self._conn.wait(self._client.ensure_path_async(self._jobs_root()))
        except TxSinkError:
            self.close()
            raise

    @classmethod
    def from_options(
        cls, keeper: str, root: str = DEFAULT_ROOT, auth: str | None = None, timeout: float = 10.0
    ) -> KazooRegistry:
        """The registry named by the ``keeper``/root/auth/timeout options of a job."""
        return cls(keeper, root, auth=auth, timeout=timeout)

    @property
    def _client(self) -> Any:
        """The kazoo client of the session."""
        return self._conn.client

    # -- paths -----------------------------------------------------------------------

    def _jobs_root(self) -> str:
        return f"{self._root}/jobs"

    def _job(self, job: str) -> str:
        return f"{self._jobs_root()}/{_check_name('job', job)}"

    def _epoch_path(self, job: str) -> str:
        return f"{self._job(job)}/epoch"

    def _xid_path(self, job: str, xid: str) -> str:
        return f"{self._job(job)}/xids/{_check_name('xid', xid)}"

    def _blob_path(self, job: str, key: str) -> str:
        parts = key.split("/")
        if parts[0] in RESERVED_KEYS or any(not p or p in {".", ".."} for p in parts):
            raise ValueError(f"invalid blob key {key!r} for job {job}")
        return f"{self._job(job)}/{key}"

    # -- multi-op outcomes ----------------------------------------------------------------

    @staticmethod
    def _first_error(results: builtins.list[Any]) -> Exception:
        return next(r for r in results if isinstance(r, Exception))

    def _raise_fenced(self, epoch: Epoch) -> NoReturn:
        cur = self.current_epoch(epoch.job)
        raise FencedError(
            f"job {epoch.job}: writer epoch {epoch.number} was superseded by epoch "
            f"{cur.number if cur else '?'}; this writer must stop"
        )

    def _fence_now(self, epoch: Epoch) -> None:
        """Raise FencedError if ``epoch`` is stale (a read, for checks done outside a txn)."""
        cur = self.current_epoch(epoch.job)
        if cur is None or cur.token != epoch.token:
            self._raise_fenced(epoch)

    # -- jobs --------------------------------------------------------------------------

    def ensure_job(self, job: str, meta: dict[str, Any]) -> dict[str, Any]:
        path = self._job(job)
        with self._conn.mapped(f"ensure job {path}"):
            for _ in range(MAX_CAS_ROUNDS):
                try:
                    self._conn.create(path, meta)
                    return dict(meta)
                except NodeExistsError:
                    pass
                found = self._conn.read(path)
                if found is None:
                    continue
                stored, stat = found
                if stored is not None:
                    return stored
                # The node exists as an empty parent (take_epoch ran first): fill it in.
                try:
                    self._conn.wait(
                        self._client.set_async(path, encode(meta), version=stat.version)
                    )
                    return dict(meta)
                except BadVersionError:
                    continue
        raise RetryableConflict(f"job {job}: meta at {path} keeps changing; retry")

    def job_meta(self, job: str) -> dict[str, Any] | None:
        path = self._job(job)
        with self._conn.mapped(f"read {path}"):
            found = self._conn.read(path)
        return None if found is None else found[0]

    def list_jobs(self) -> list[str]:
        with self._conn.mapped(f"list {self._jobs_root()}"):
            names = self._conn.wait(self._client.get_children_async(self._jobs_root()))
            # A job exists once ensure_job stored its meta (MemoryRegistry's definition);
            # take_epoch alone leaves an empty parent node.
            return sorted(n for n in names if self._has_meta(n))

    def _has_meta(self, job: str) -> bool:
        found = self._conn.read(f"{self._jobs_root()}/{job}")
        return found is not None and found[0] is not None

    # -- epochs and owner -----------------------------------------------------------------

    def take_epoch(self, job: str, owner: str) -> Epoch:
        path = self._epoch_path(job)
        with self._conn.mapped(f"take epoch {path}"):
            for _ in range(MAX_CAS_ROUNDS):
                now = self._clock()
                found = self._conn.read(path)
                if found is None:
                    try:
                        self._conn.create(path, {"epoch": 1, "owner": owner, "since": now})
                    except NodeExistsError:
                        continue
                    log.info("job %s: epoch 1 taken by %s", job, owner)
                    return Epoch(job, 1, 0, owner)
                old, stat = found
                number = int((old or {}).get("epoch", 0)) + 1
                try:
                    new_stat = self._conn.wait(
                        self._client.set_async(
                            path,
                            encode({"epoch": number, "owner": owner, "since": now}),
                            version=stat.version,
                        )
                    )
                except BadVersionError:
                    continue
                log.warning(
                    "job %s: %s took over as epoch %d from %s (epoch %s)",
                    job,
                    owner,
                    number,
                    (old or {}).get("owner"),
                    (old or {}).get("epoch"),
                )
                return Epoch(job, number, new_stat.version, owner)
        raise RetryableConflict(f"job {job}: epoch node {path} keeps changing; retry")

    def current_epoch(self, job: str) -> Epoch | None:
        path = self._epoch_path(job)
        with self._conn.mapped(f"read {path}"):
            found = self._conn.read_json(path)
        if found is None:
            return None
        data, stat = found
        return Epoch(job, int(data["epoch"]), stat.version, str(data.get("owner", "")))

    def heartbeat(self, epoch: Epoch, info: dict[str, Any]) -> None:
        path = f"{self._job(epoch.job)}/owner"
        epoch_path = self._epoch_path(epoch.job)
        with self._conn.mapped(f"heartbeat {path}"):
            for _ in range(MAX_CAS_ROUNDS):
                value = {
                    "epoch": epoch.number,
                    "owner": epoch.owner,
                    "heartbeat": self._clock(),
                    **info,
                }
                exists = self._conn.wait(self._client.exists_async(path)) is not None

                def ops(txn: Any, exists: bool = exists, value: dict[str, Any] = value) -> None:
                    txn.check(epoch_path, epoch.token)
                    if exists:
                        txn.set_data(path, encode(value))
                    else:
                        txn.create(path, encode(value), acl=self._conn.acl)

                ok, results = self._conn.commit_txn(ops)
                if isinstance(results[0], Exception):
                    self._raise_fenced(epoch)
                if ok:
                    return
                if not isinstance(results[1], (NoNodeError, NodeExistsError)):
                    raise self._first_error(results)
                # The owner node appeared or vanished since exists(): go again.
        raise RetryableConflict(f"job {epoch.job}: owner node {path} keeps changing; retry")

    def owner(self, job: str) -> dict[str, Any] | None:
        path = f"{self._job(job)}/owner"
        with self._conn.mapped(f"read {path}"):
            found = self._conn.read(path)
        return None if found is None else found[0]

    # -- xids ----------------------------------------------------------------------------

    def get(self, job: str, xid: str) -> XidRecord | None:
        path = self._xid_path(job, xid)
        with self._conn.mapped(f"read {path}"):
            found = self._conn.read_json(path)
        if found is None:
            return None
        return XidRecord.from_json(found[0], version=found[1].version)

    def list(self, job: str) -> list[XidRecord]:
        parent = f"{self._job(job)}/xids"
        with self._conn.mapped(f"list {parent}"):
            try:
                names = self._conn.wait(self._client.get_children_async(parent))
            except NoNodeError:
                return []
            found: list[tuple[int, XidRecord]] = []
            for name in names:
                item = self._conn.read_json(f"{parent}/{name}")
                if item is None:
                    continue  # deleted while we listed
                data, stat = item
                found.append((stat.czxid, XidRecord.from_json(data, version=stat.version)))
        # Creation order, like MemoryRegistry's insertion-ordered dict.
        return [rec for _, rec in sorted(found, key=lambda pair: pair[0])]

    def prepare(self, epoch: Epoch, record: XidRecord) -> XidRecord:
        path = self._xid_path(epoch.job, record.xid)
        epoch_path = self._epoch_path(epoch.job)
        with self._conn.mapped(f"prepare {path}"):
            try:
                check_transition(None, record.state)
            except ValueError:
                self._fence_now(epoch)  # a stale writer hears FencedError first
                raise
            self._conn.ensure(path.rsplit("/", 1)[0])
            stored = replace(record, version=0)
            for _ in range(MAX_CAS_ROUNDS):

                def ops(txn: Any) -> None:
                    txn.check(epoch_path, epoch.token)
                    txn.create(path, encode(stored.to_json()), acl=self._conn.acl)

                ok, results = self._conn.commit_txn(ops)
                if isinstance(results[0], Exception):
                    self._raise_fenced(epoch)
                if ok:
                    return stored
                if isinstance(results[1], NodeExistsError):
                    existing = self.get(epoch.job, record.xid)
                    if existing is not None:
                        raise XidExists(existing)
                elif isinstance(results[1], NoNodeError):
                    self._conn.known_paths.discard(path.rsplit("/", 1)[0])
                    self._conn.ensure(path.rsplit("/", 1)[0])
                else:
                    raise self._first_error(results)
        raise RetryableConflict(f"xid {record.xid} of job {epoch.job} keeps changing; retry")

    def commit(self, epoch: Epoch, record: XidRecord, committed_at: float) -> XidRecord:
        path = self._xid_path(epoch.job, record.xid)
        ledger_path = f"{self._job(epoch.job)}/ledger"
        epoch_path = self._epoch_path(epoch.job)
        with self._conn.mapped(f"commit {path}"):
            for _ in range(MAX_CAS_ROUNDS):
                found = self._conn.read_json(path)
                if found is None or found[1].version != record.version:
                    self._fence_now(epoch)
                    raise RetryableConflict(f"xid {record.xid} changed under us; re-read and retry")
                cur = XidRecord.from_json(found[0], version=found[1].version)
                ledger_found = self._conn.read_json(ledger_path)
                ledger = EMPTY_LEDGER if ledger_found is None else ledger_found[0]
                try:
                    done = committed_record(cur, ledger, committed_at, epoch.number)
                except ValueError:
                    self._fence_now(epoch)
                    raise
                new_ledger = next_ledger(ledger, cur, committed_at)

                def ops(
                    txn: Any,
                    done: XidRecord = done,
                    new_ledger: dict[str, Any] = new_ledger,
                    ledger_found: Any = ledger_found,
                ) -> None:
                    txn.check(epoch_path, epoch.token)
                    txn.set_data(path, encode(done.to_json()), version=record.version)
                    if ledger_found is None:
                        txn.create(ledger_path, encode(new_ledger), acl=self._conn.acl)
                    else:
                        txn.set_data(
                            ledger_path, encode(new_ledger), version=ledger_found[1].version
                        )

                ok, results = self._conn.commit_txn(ops)
                if isinstance(results[0], Exception):
                    self._raise_fenced(epoch)
                if ok:
                    return replace(done, version=results[1].version)
                if isinstance(results[1], (BadVersionError, NoNodeError)):
                    raise RetryableConflict(f"xid {record.xid} changed under us; re-read and retry")
                if not isinstance(results[2], (BadVersionError, NodeExistsError, NoNodeError)):
                    raise self._first_error(results)
                # Only the ledger moved (another committer of this job): re-read, go again.
        raise RetryableConflict(f"job {epoch.job}: ledger {ledger_path} keeps changing; retry")

    def ledger(self, job: str) -> dict[str, Any]:
        path = f"{self._job(job)}/ledger"
        with self._conn.mapped(f"read {path}"):
            found = self._conn.read_json(path)
        if found is None:
            return copy.deepcopy(EMPTY_LEDGER)
        return found[0]

    def delete(self, epoch: Epoch, xids: builtins.list[str]) -> None:
        epoch_path = self._epoch_path(epoch.job)
        paths = [self._xid_path(epoch.job, xid) for xid in xids]
        with self._conn.mapped(f"delete xids of job {epoch.job}"):
            chunks = [paths[i : i + DELETE_CHUNK] for i in range(0, len(paths), DELETE_CHUNK)]
            for chunk in chunks or [[]]:
                self._delete_chunk(epoch, epoch_path, chunk)

    def _delete_chunk(self, epoch: Epoch, epoch_path: str, paths: builtins.list[str]) -> None:
        for _ in range(MAX_CAS_ROUNDS):
            present = [
                p for p in paths if self._conn.wait(self._client.exists_async(p)) is not None
            ]

            def ops(txn: Any, present: builtins.list[str] = present) -> None:
                txn.check(epoch_path, epoch.token)
                for p in present:
                    txn.delete(p)

            ok, results = self._conn.commit_txn(ops)
            if isinstance(results[0], Exception):
                self._raise_fenced(epoch)
            if ok:
                return
            if not any(isinstance(r, NoNodeError) for r in results):
                raise self._first_error(results)
            # A node vanished between exists() and the delete: recompute and go again.
        raise RetryableConflict(f"job {epoch.job}: xids keep changing during delete; retry")

    # -- blobs -----------------------------------------------------------------------------

    def get_blob(self, job: str, key: str) -> dict[str, Any] | None:
        path = self._blob_path(job, key)
        with self._conn.mapped(f"read {path}"):
            found = self._conn.read(path)
        return None if found is None else found[0]

    def put_blob(self, job: str, key: str, value: dict[str, Any]) -> None:
        path = self._blob_path(job, key)
        with self._conn.mapped(f"write {path}"):
            for _ in range(MAX_CAS_ROUNDS):
                try:
                    self._conn.wait(self._client.set_async(path, encode(value)))
                    return
                except NoNodeError:
                    pass
                try:
                    self._conn.create(path, value)
                    return
                except NodeExistsError:
                    continue
        raise RetryableConflict(f"job {job}: blob {path} keeps changing; retry")

    def get_blob_versioned(self, job: str, key: str) -> tuple[dict[str, Any], int] | None:
        """The blob and its Keeper node version, or None (absent or an empty parent node)."""
        path = self._blob_path(job, key)
        with self._conn.mapped(f"read {path}"):
            found = self._conn.read_json(path)
        return None if found is None else (found[0], int(found[1].version))

    def cas_blob(self, job: str, key: str, value: dict[str, Any], expected_version: int) -> int:
        """Write the blob only if its node is at ``expected_version`` (``CREATE``: absent);
        the new version, or :class:`BlobConflict` with nothing written.

        An empty node (a parent made for a child blob) counts as absent: it is filled in
        at its own version, so ``get_blob_versioned`` -> None -> ``CREATE`` still works.
        """
        path = self._blob_path(job, key)
        conflict = BlobConflict(
            f"job {job}: blob {path} is not at version {expected_version}; re-read it and "
            "decide again"
        )
        with self._conn.mapped(f"write {path}"):
            if expected_version == CREATE:
                try:
                    self._conn.create(path, value)
                    return 0
                except NodeExistsError:
                    found = self._conn.read(path)
                    if found is None or found[0] is not None:
                        raise conflict from None
                    expected_version = int(found[1].version)  # an empty parent: fill it in
            try:
                stat = self._conn.wait(
                    self._client.set_async(path, encode(value), version=expected_version)
                )
            except (BadVersionError, NoNodeError):
                raise conflict from None
            return int(stat.version)

    def delete_blobs(self, job: str, key: str) -> None:
        """Remove blob ``key`` and its subtree (unfenced: only dedup state of COMMITTED xids)."""
        path = self._blob_path(job, key)
        with self._conn.mapped(f"delete {path}"):
            if self._conn.wait(self._client.exists_async(path)) is not None:
                self._client.delete(path, recursive=True)
        self._conn.known_paths = {p for p in self._conn.known_paths if not p.startswith(path)}

    def delete_job(self, job: str) -> None:
        """Remove a job's whole subtree (unfenced: scratch jobs of `txsink tune`)."""
        path = self._job(job)
        with self._conn.mapped(f"delete {path}"):
            if self._conn.wait(self._client.exists_async(path)) is not None:
                self._client.delete(path, recursive=True)
        self._conn.known_paths = {p for p in self._conn.known_paths if not p.startswith(path)}

    def close(self) -> None:
        """Stop the session if this registry started it (a reused client stays open)."""
        self._conn.close()
