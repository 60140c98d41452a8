"""``KazooRegistry``: the :class:`txsink.keeper.registry.Registry` on ZooKeeper / ClickHouse
Keeper through kazoo, with exactly :class:`~txsink.keeper.registry.MemoryRegistry`'s semantics.

This module owns the Keeper layout described in :mod:`txsink.keeper.registry` and is the
only place that imports kazoo: every kazoo error is mapped here onto :mod:`txsink.errors`.

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
import json
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, NoReturn

from kazoo.client import KazooClient
from kazoo.exceptions import (
    BadVersionError,
    ConnectionDropped,
    KazooException,
    NoAuthError,
    NodeExistsError,
    NoNodeError,
    OperationTimeoutError,
    RolledBackError,
    RuntimeInconsistency,
    SessionExpiredError,
    SessionMovedError,
)
from kazoo.exceptions import (
    ConnectionLoss as KazooConnectionLoss,
)
from kazoo.security import make_acl, make_digest_acl

from txsink.errors import (
    ConfigError,
    FencedError,
    RetryableConflict,
    TxSinkError,
    UnavailableError,
)
from txsink.keeper.registry import EMPTY_LEDGER, XidExists, committed_record, next_ledger
from txsink.protocol.states import Epoch, XidRecord, check_transition

log = logging.getLogger(__name__)

DEFAULT_ROOT = "/txsink"
DEFAULT_TIMEOUT = 10.0
NEXT_STEP = "is ZooKeeper running? `txsink embedded status`"
# Names under <root>/jobs/<job> that belong to the registry itself, not to blobs.
RESERVED_KEYS = frozenset({"epoch", "owner", "ledger", "xids"})
# Deletes per fenced transaction: keeps one multi-op far below jute.maxbuffer (1 MiB).
DELETE_CHUNK = 500
# A CAS loop that loses this often is not contention but a bug or a runaway peer.
MAX_CAS_ROUNDS = 50

_CONNECTION_ERRORS: tuple[type[BaseException], ...] = (
    KazooConnectionLoss,
    SessionExpiredError,  # includes ConnectionClosedError
    SessionMovedError,
    OperationTimeoutError,
    ConnectionDropped,
)

# Results of the ops of a failed multi-op that did not cause the failure.
_NOT_THE_CAUSE = (RolledBackError, RuntimeInconsistency)


def _encode(value: dict[str, Any]) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def _decode(data: bytes) -> dict[str, Any] | None:
    """Node data as a dict; an empty node (a parent made by ``makepath``) is ``None``."""
    if not data:
        return None
    value = json.loads(data.decode())
    if not isinstance(value, dict):
        raise ValueError(f"holds a JSON {type(value).__name__}, expected an object")
    return value


def _check_name(kind: str, name: str) -> str:
    if not name or "/" in name or name in {".", ".."} or name.strip() != name:
        raise ConfigError(f"invalid {kind} name {name!r}: must be non-empty, without '/'")
    return name


def _split_connect_string(keeper: str) -> tuple[str, str]:
    """``host:port[,host:port...][/chroot]`` -> (hosts, chroot or "")."""
    hosts, sep, chroot = keeper.partition("/")
    if not hosts.strip():
        raise ConfigError(f"option keeper={keeper!r}: expected host:port[,host:port...][/chroot]")
    return hosts, (sep + chroot).rstrip("/")


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
        self._keeper = keeper
        self._root = root.rstrip("/")
        self._timeout = timeout
        self._clock = clock
        self._acl: list[Any] | None = None
        if auth is not None:
            user, _, password = auth.partition(":")
            self._acl = [
                make_digest_acl(user, password, all=True),
                make_acl("world", "anyone", read=True),
            ]
        self._known_paths: set[str] = set()
        self._owns_client = client is None
        self._closed = False
        self._client: Any = client if client is not None else self._connect(keeper, auth, timeout)
        try:
            if client is not None and auth is not None:
                with self._mapped("authenticate"):
                    self._wait(client.add_auth_async("digest", auth))
            with self._mapped(f"create {self._jobs_root()}"):
                # Open ACL on purpose: other identities must be able to add their own jobs.
                self._wait(self._client.ensure_path_async(self._jobs_root()))
        except TxSinkError:
            self.close()
            raise

    @classmethod
    def from_options(
        cls, keeper: str, root: str = DEFAULT_ROOT, auth: str | None = None, timeout: float = 10.0
    ) -> KazooRegistry:
        """The registry named by the ``keeper``/root/auth/timeout options of a job."""
        return cls(keeper, root, auth=auth, timeout=timeout)

    # -- connection and error mapping ------------------------------------------------

    def _connect(self, keeper: str, auth: str | None, timeout: float) -> KazooClient:
        hosts, chroot = _split_connect_string(keeper)
        if chroot:
            self._ensure_chroot(hosts, chroot, timeout)
        try:
            client = KazooClient(
                hosts=keeper,
                timeout=timeout,
                auth_data=[("digest", auth)] if auth else None,
                connection_retry={"max_tries": -1, "max_delay": 2.0},
            )
        except ValueError as exc:
            raise ConfigError(f"option keeper={keeper!r}: {exc}") from exc
        self._start(client, timeout)
        return client

    def _start(self, client: KazooClient, timeout: float) -> None:
        try:
            client.start(timeout=timeout)
        except client.handler.timeout_exception as exc:
            # kazoo has already stopped and closed the client.
            raise UnavailableError(
                f"cannot connect to Keeper at {self._keeper} within {timeout:g}s; {NEXT_STEP}"
            ) from exc

    def _ensure_chroot(self, hosts: str, chroot: str, timeout: float) -> None:
        """kazoo does not create a missing chroot; create it from a chroot-less session."""
        boot = KazooClient(hosts=hosts, timeout=timeout)
        self._start(boot, timeout)
        try:
            with self._mapped(f"create chroot {chroot}"):
                boot.ensure_path_async(chroot).get(timeout=timeout)
        finally:
            boot.stop()
            boot.close()

    @contextmanager
    def _mapped(self, what: str) -> Iterator[None]:
        """Map kazoo's errors onto txsink's for the operation ``what``."""
        try:
            yield
        except _CONNECTION_ERRORS as exc:
            raise UnavailableError(
                f"Keeper at {self._keeper} lost the connection or session during {what} "
                f"({type(exc).__name__}); the outcome is unknown: re-run the step, it is "
                f"idempotent; {NEXT_STEP}"
            ) from exc
        except NoAuthError as exc:
            raise ConfigError(
                f"Keeper at {self._keeper} denied {what} (NoAuth): the node belongs to another "
                "identity; pass the job's `auth` (user:password)"
            ) from exc
        except KazooException as exc:
            raise TxSinkError(f"Keeper at {self._keeper} failed {what}: {exc!r}") from exc
        except self._timeout_exception() as exc:
            raise UnavailableError(
                f"Keeper at {self._keeper} did not answer {what} within {self._timeout:g}s; "
                f"the outcome is unknown: re-run the step, it is idempotent; {NEXT_STEP}"
            ) from exc

    def _timeout_exception(self) -> type[BaseException]:
        client = getattr(self, "_client", None)
        if client is None:
            return _NeverRaised
        exc: type[BaseException] = client.handler.timeout_exception
        return exc

    def _wait(self, async_result: Any) -> Any:
        # Bounded: a request queued while kazoo reconnects would otherwise wait forever.
        return async_result.get(timeout=self._timeout)

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

    # -- primitive reads and writes (callers wrap them in _mapped) ----------------------

    def _read(self, path: str) -> tuple[dict[str, Any] | None, Any] | None:
        """(decoded data, stat) of ``path``, or None if the node does not exist."""
        try:
            data, stat = self._wait(self._client.get_async(path))
        except NoNodeError:
            return None
        try:
            return _decode(data), stat
        except ValueError as exc:  # not JSON: someone else wrote this node
            raise TxSinkError(f"Keeper node {path} does not hold txsink's JSON: {exc}") from exc

    def _read_json(self, path: str) -> tuple[dict[str, Any], Any] | None:
        """Like :meth:`_read`, but an empty node counts as absent."""
        found = self._read(path)
        if found is None or found[0] is None:
            return None
        return found[0], found[1]

    def _ensure(self, path: str) -> None:
        """Make sure ``path`` and its parents exist (job nodes get the job ACL)."""
        if path in self._known_paths:
            return
        self._wait(self._client.ensure_path_async(path, acl=self._acl))
        self._known_paths.add(path)

    def _create(self, path: str, value: dict[str, Any]) -> Any:
        """Create ``path`` (and parents); returns the path. NodeExistsError propagates."""
        try:
            return self._wait(self._client.create_async(path, _encode(value), acl=self._acl))
        except NoNodeError:
            parent = path.rsplit("/", 1)[0]
            self._known_paths.discard(parent)
            self._ensure(parent)
            return self._wait(self._client.create_async(path, _encode(value), acl=self._acl))

    def _commit_txn(self, ops: Callable[[Any], None]) -> tuple[bool, builtins.list[Any]]:
        """Run one multi-op; returns (all applied, per-op results).

        In a failed multi-op only the failing op carries its real error: ZooKeeper reports
        the ops before it as rolled back and those after it as not attempted. Both become
        ``None`` here, so ``isinstance(results[i], Exception)`` names the culprit.
        """
        txn = self._client.transaction()
        ops(txn)
        raw: builtins.list[Any] = self._wait(txn.commit_async())
        ok = not any(isinstance(r, Exception) for r in raw)
        return ok, [None if isinstance(r, _NOT_THE_CAUSE) else r for r in raw]

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
        with self._mapped(f"ensure job {path}"):
            for _ in range(MAX_CAS_ROUNDS):
                try:
                    self._create(path, meta)
                    return dict(meta)
                except NodeExistsError:
                    pass
                found = self._read(path)
                if found is None:
                    continue
                stored, stat = found
                if stored is not None:
                    return stored
                # The node exists as an empty parent (take_epoch ran first): fill it in.
                try:
                    self._wait(self._client.set_async(path, _encode(meta), version=stat.version))
                    return dict(meta)
                except BadVersionError:
                    continue
        raise RetryableConflict(f"job {job}: meta at {path} keeps changing; retry")

    def job_meta(self, job: str) -> dict[str, Any] | None:
        path = self._job(job)
        with self._mapped(f"read {path}"):
            found = self._read(path)
        return None if found is None else found[0]

    def list_jobs(self) -> list[str]:
        with self._mapped(f"list {self._jobs_root()}"):
            names = self._wait(self._client.get_children_async(self._jobs_root()))
            # A job exists once ensure_job stored its meta (MemoryRegistry's definition);
            # take_epoch alone leaves an empty parent node.
            return sorted(n for n in names if self._has_meta(n))

    def _has_meta(self, job: str) -> bool:
        found = self._read(f"{self._jobs_root()}/{job}")
        return found is not None and found[0] is not None

    # -- epochs and owner -----------------------------------------------------------------

    def take_epoch(self, job: str, owner: str) -> Epoch:
        path = self._epoch_path(job)
        with self._mapped(f"take epoch {path}"):
            for _ in range(MAX_CAS_ROUNDS):
                now = self._clock()
                found = self._read(path)
                if found is None:
                    try:
                        self._create(path, {"epoch": 1, "owner": owner, "since": now})
                    except NodeExistsError:
                        continue
                    log.info("job %s: epoch 1 taken by %s", job, owner)
                    return Epoch(job, 1, 0, owner)
                old, stat = found
                number = int((old or {}).get("epoch", 0)) + 1
                try:
                    new_stat = self._wait(
                        self._client.set_async(
                            path,
                            _encode({"epoch": number, "owner": owner, "since": now}),
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
        with self._mapped(f"read {path}"):
            found = self._read_json(path)
        if found is None:
            return None
        data, stat = found
        return Epoch(job, int(data["epoch"]), stat.version, str(data.get("owner", "")))

    def heartbeat(self, epoch: Epoch, info: dict[str, Any]) -> None:
        path = f"{self._job(epoch.job)}/owner"
        epoch_path = self._epoch_path(epoch.job)
        with self._mapped(f"heartbeat {path}"):
            for _ in range(MAX_CAS_ROUNDS):
                value = {
                    "epoch": epoch.number,
                    "owner": epoch.owner,
                    "heartbeat": self._clock(),
                    **info,
                }
                exists = self._wait(self._client.exists_async(path)) is not None

                def ops(txn: Any, exists: bool = exists, value: dict[str, Any] = value) -> None:
                    txn.check(epoch_path, epoch.token)
                    if exists:
                        txn.set_data(path, _encode(value))
                    else:
                        txn.create(path, _encode(value), acl=self._acl)

                ok, results = self._commit_txn(ops)
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
        with self._mapped(f"read {path}"):
            found = self._read(path)
        return None if found is None else found[0]

    # -- xids ----------------------------------------------------------------------------

    def get(self, job: str, xid: str) -> XidRecord | None:
        path = self._xid_path(job, xid)
        with self._mapped(f"read {path}"):
            found = self._read_json(path)
        if found is None:
            return None
        return XidRecord.from_json(found[0], version=found[1].version)

    def list(self, job: str) -> list[XidRecord]:
        parent = f"{self._job(job)}/xids"
        with self._mapped(f"list {parent}"):
            try:
                names = self._wait(self._client.get_children_async(parent))
            except NoNodeError:
                return []
            found: list[tuple[int, XidRecord]] = []
            for name in names:
                item = self._read_json(f"{parent}/{name}")
                if item is None:
                    continue  # deleted while we listed
                data, stat = item
                found.append((stat.czxid, XidRecord.from_json(data, version=stat.version)))
        # Creation order, like MemoryRegistry's insertion-ordered dict.
        return [rec for _, rec in sorted(found, key=lambda pair: pair[0])]

    def prepare(self, epoch: Epoch, record: XidRecord) -> XidRecord:
        path = self._xid_path(epoch.job, record.xid)
        epoch_path = self._epoch_path(epoch.job)
        with self._mapped(f"prepare {path}"):
            try:
                check_transition(None, record.state)
            except ValueError:
                self._fence_now(epoch)  # a stale writer hears FencedError first
                raise
            self._ensure(path.rsplit("/", 1)[0])
            stored = replace(record, version=0)
            for _ in range(MAX_CAS_ROUNDS):

                def ops(txn: Any) -> None:
                    txn.check(epoch_path, epoch.token)
                    txn.create(path, _encode(stored.to_json()), acl=self._acl)

                ok, results = self._commit_txn(ops)
                if isinstance(results[0], Exception):
                    self._raise_fenced(epoch)
                if ok:
                    return stored
                if isinstance(results[1], NodeExistsError):
                    existing = self.get(epoch.job, record.xid)
                    if existing is not None:
                        raise XidExists(existing)
                elif isinstance(results[1], NoNodeError):
                    self._known_paths.discard(path.rsplit("/", 1)[0])
                    self._ensure(path.rsplit("/", 1)[0])
                else:
                    raise self._first_error(results)
        raise RetryableConflict(f"xid {record.xid} of job {epoch.job} keeps changing; retry")

    def commit(self, epoch: Epoch, record: XidRecord, committed_at: float) -> XidRecord:
        path = self._xid_path(epoch.job, record.xid)
        ledger_path = f"{self._job(epoch.job)}/ledger"
        epoch_path = self._epoch_path(epoch.job)
        with self._mapped(f"commit {path}"):
            for _ in range(MAX_CAS_ROUNDS):
                found = self._read_json(path)
                if found is None or found[1].version != record.version:
                    self._fence_now(epoch)
                    raise RetryableConflict(f"xid {record.xid} changed under us; re-read and retry")
                cur = XidRecord.from_json(found[0], version=found[1].version)
                ledger_found = self._read_json(ledger_path)
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
                    txn.set_data(path, _encode(done.to_json()), version=record.version)
                    if ledger_found is None:
                        txn.create(ledger_path, _encode(new_ledger), acl=self._acl)
                    else:
                        txn.set_data(
                            ledger_path, _encode(new_ledger), version=ledger_found[1].version
                        )

                ok, results = self._commit_txn(ops)
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
        with self._mapped(f"read {path}"):
            found = self._read_json(path)
        if found is None:
            return copy.deepcopy(EMPTY_LEDGER)
        return found[0]

    def delete(self, epoch: Epoch, xids: builtins.list[str]) -> None:
        epoch_path = self._epoch_path(epoch.job)
        paths = [self._xid_path(epoch.job, xid) for xid in xids]
        with self._mapped(f"delete xids of job {epoch.job}"):
            chunks = [paths[i : i + DELETE_CHUNK] for i in range(0, len(paths), DELETE_CHUNK)]
            for chunk in chunks or [[]]:
                self._delete_chunk(epoch, epoch_path, chunk)

    def _delete_chunk(self, epoch: Epoch, epoch_path: str, paths: builtins.list[str]) -> None:
        for _ in range(MAX_CAS_ROUNDS):
            present = [p for p in paths if self._wait(self._client.exists_async(p)) is not None]

            def ops(txn: Any, present: builtins.list[str] = present) -> None:
                txn.check(epoch_path, epoch.token)
                for p in present:
                    txn.delete(p)

            ok, results = self._commit_txn(ops)
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
        with self._mapped(f"read {path}"):
            found = self._read(path)
        return None if found is None else found[0]

    def put_blob(self, job: str, key: str, value: dict[str, Any]) -> None:
        path = self._blob_path(job, key)
        with self._mapped(f"write {path}"):
            for _ in range(MAX_CAS_ROUNDS):
                try:
                    self._wait(self._client.set_async(path, _encode(value)))
                    return
                except NoNodeError:
                    pass
                try:
                    self._create(path, value)
                    return
                except NodeExistsError:
                    continue
        raise RetryableConflict(f"job {job}: blob {path} keeps changing; retry")

    def delete_blobs(self, job: str, key: str) -> None:
        """Remove blob ``key`` and its subtree (unfenced: only dedup state of COMMITTED xids)."""
        path = self._blob_path(job, key)
        with self._mapped(f"delete {path}"):
            if self._wait(self._client.exists_async(path)) is not None:
                self._client.delete(path, recursive=True)
        self._known_paths = {p for p in self._known_paths if not p.startswith(path)}

    def delete_job(self, job: str) -> None:
        """Remove a job's whole subtree (unfenced: scratch jobs of `txsink tune`)."""
        path = self._job(job)
        with self._mapped(f"delete {path}"):
            if self._wait(self._client.exists_async(path)) is not None:
                self._client.delete(path, recursive=True)
        self._known_paths = {p for p in self._known_paths if not p.startswith(path)}

    def close(self) -> None:
        """Stop the session if this registry started it (a reused client stays open)."""
        if self._closed:
            return
        self._closed = True
        client = getattr(self, "_client", None)
        if client is not None and self._owns_client:
            client.stop()
            client.close()


class _NeverRaised(Exception):
    """Placeholder for the handler's timeout exception before a client exists."""
