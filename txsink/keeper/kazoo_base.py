"""The base of :class:`~txsink.keeper.kazoo_registry.KazooRegistry`: its session, paths,
fencing checks and the compare-and-set primitives its write loops are made of.

Invariants:

- Every fenced write (``prepare``, ``commit``, ``delete``, ``heartbeat``, ``amend``) is
  ONE Keeper multi-op transaction whose first op checks that ``<job>/epoch`` still has
  the writer's token (its node version). A failed check is :class:`FencedError`;
  nothing was written.
- A lost connection or an expired session during an operation is
  :class:`UnavailableError`, never a silent success. Every public operation is a
  :func:`step`: it is re-run from the start (it re-reads what it needs) for up to
  ``retry_s`` seconds, so an outage of a few seconds costs a pause, not a failed batch;
  a re-run after a lost reply finds what actually landed (``XidExists`` for a prepare, a
  moved version for a compare-and-set). Past ``retry_s`` the UnavailableError reaches
  the caller, which treats the outcome as unknown.
- Compare-and-set: every loop of read, decide, conditional write is
  :func:`txsink.ports.cas.cas` (the in-memory twin runs the same helper).
"""

from __future__ import annotations

import builtins
import functools
import time
from collections.abc import Callable, Mapping
from typing import Any, Concatenate, NoReturn, ParamSpec, TypeVar

from kazoo.client import KazooClient
from kazoo.exceptions import BadVersionError, NodeExistsError

from txsink.errors import ConfigError, TxSinkError
from txsink.keeper.kazoo_conn import DEFAULT_RETRY_S, KazooConn, encode
from txsink.ports.cas import MAX_CAS_ROUNDS, CasRetry, cas
from txsink.ports.manifest_codec import CHUNKS_DIR
from txsink.ports.record_rules import superseded
from txsink.protocol.codec import OwnerInfo, decode_epoch_node, encode_owner
from txsink.protocol.states import Epoch

DEFAULT_ROOT = "/txsink"
DEFAULT_TIMEOUT = 10.0
KNOWN = 64  # nodes a session keeps for its next commit (see KazooBase._known)

# Names under <root>/jobs/<job> that belong to the registry itself, not to blobs.
RESERVED_KEYS = frozenset({"epoch", "owner", "ledger", "xids", CHUNKS_DIR})

P = ParamSpec("P")
R = TypeVar("R")
B = TypeVar("B", bound="KazooBase")

__all__ = ["MAX_CAS_ROUNDS", "CasRetry", "KazooBase", "cas", "check_name", "step"]


def step(method: Callable[Concatenate[B, P], R]) -> Callable[Concatenate[B, P], R]:
    """Mark a registry operation as re-runnable while Keeper is unavailable.

    Only for operations that are safe to run again from the start after an unknown
    outcome: reads, and writes that re-read and compare before they act (creates that
    find the node, compare-and-sets that find the version moved)."""

    @functools.wraps(method)
    def run(registry: B, /, *args: P.args, **kwargs: P.kwargs) -> R:
        return registry._conn.retrying(method.__name__, lambda: method(registry, *args, **kwargs))

    return run


def check_name(kind: str, name: str) -> str:
    if not name or "/" in name or name in {".", ".."} or name.strip() != name:
        raise ConfigError(f"invalid {kind} name {name!r}: must be non-empty, without '/'")
    return name


class KazooBase:
    """Session, layout paths and fencing of a Keeper-backed registry."""

    def __init__(
        self,
        keeper: str,
        root: str = DEFAULT_ROOT,
        *,
        auth: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        client: KazooClient | None = None,
        clock: Callable[[], float] = time.time,
        retry_s: float = DEFAULT_RETRY_S,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if not root.startswith("/") or (root.endswith("/") and root != "/"):
            raise ConfigError(f"Keeper root {root!r} must be an absolute path like /txsink")
        if auth is not None and ":" not in auth:
            raise ConfigError("Keeper auth must be 'user:password' (digest scheme)")
        self._root = root.rstrip("/")
        self._clock = clock
        self._namespace_id = ""
        # path -> (node JSON, version) of the xid and ledger nodes this session last read
        # or wrote: a commit compare-and-sets on them without reading them again (a node
        # that moved since fails the transaction, and the next round reads). Each entry
        # serves one commit at most.
        self._known: dict[str, tuple[Any, int]] = {}
        self._conn = KazooConn(
            keeper, auth=auth, timeout=timeout, client=client, retry_s=retry_s, sleep=sleep
        )
        try:
            self._conn.retrying("create jobs root", self._ensure_root)
        except TxSinkError:
            self.close()
            raise

    def _ensure_root(self) -> None:
        with self._conn.mapped(f"create {self._jobs_root()}"):
            # Open ACL on purpose: other identities must be able to add their own jobs.
            self._conn.wait(self._client.ensure_path_async(self._jobs_root()))

    @property
    def _client(self) -> Any:
        """The kazoo client of the session."""
        return self._conn.client

    # -- paths -----------------------------------------------------------------------

    def _jobs_root(self) -> str:
        return f"{self._root}/jobs"

    def _job(self, job: str) -> str:
        return f"{self._jobs_root()}/{check_name('job', job)}"

    def _epoch_path(self, job: str) -> str:
        return f"{self._job(job)}/epoch"

    def _xid_path(self, job: str, xid: str) -> str:
        return f"{self._job(job)}/xids/{check_name('xid', xid)}"

    def _remember(self, path: str, node: Any, version: int) -> None:
        """Keep ``node`` at ``version`` for the next commit (at most ``KNOWN`` nodes: what
        no commit used is forgotten)."""
        if len(self._known) >= KNOWN:
            self._known.clear()
        self._known[path] = (node, version)

    def _ledger_path(self, job: str) -> str:
        return f"{self._job(job)}/ledger"

    def _owner_path(self, job: str) -> str:
        return f"{self._job(job)}/owner"

    def _owner_data(self, epoch: Epoch, info: Mapping[str, Any]) -> bytes:
        """The owner node of a beat of ``epoch`` with ``info`` (``state`` and details)."""
        details = {k: v for k, v in info.items() if k != "state"}
        beat = OwnerInfo(epoch.number, epoch.owner, self._clock(), info.get("state", ""), details)
        return encode(encode_owner(beat))

    def _blob_path(self, job: str, key: str) -> str:
        parts = key.split("/")
        if parts[0] in RESERVED_KEYS or any(not p or p in {".", ".."} for p in parts):
            raise ValueError(f"invalid blob key {key!r} for job {job}")
        return f"{self._job(job)}/{key}"

    # -- multi-op outcomes ----------------------------------------------------------------

    @staticmethod
    def _first_error(results: builtins.list[Any]) -> Exception:
        return next(
            (r for r in results if isinstance(r, Exception)),
            TxSinkError(f"a Keeper transaction failed without naming an op: {results!r}"),
        )

    def _raise_fenced(self, epoch: Epoch) -> NoReturn:
        raise superseded(epoch, self.current_epoch(epoch.job))

    def _fence_now(self, epoch: Epoch) -> None:
        """Raise FencedError if ``epoch`` is stale (a read, for checks done outside a txn;
        synced first, so a lagging server cannot show a superseded writer its own epoch)."""
        self._conn.sync(self._epoch_path(epoch.job))
        cur = self.current_epoch(epoch.job)
        if cur is None or cur.token != epoch.token:
            self._raise_fenced(epoch)

    @step
    def fence(self, epoch: Epoch) -> None:
        """FencedError unless ``epoch`` still holds the job: a transaction that only checks
        the epoch node's version. Answered by the leader (a transaction is ordered with
        every write), so no sync is needed: one request where a synced read takes two."""
        epoch_path = self._epoch_path(epoch.job)
        with self._conn.mapped(f"fence {epoch_path}"):
            ok, _ = self._conn.commit_txn(lambda txn: txn.check(epoch_path, epoch.token))
        if not ok:
            self._raise_fenced(epoch)

    def _acl_entries(self) -> int:
        return len(self._conn.acl or [None])

    # -- compare-and-set primitives (a lost race is CasRetry) -----------------------------

    def _set_at(self, path: str, data: bytes, version: int) -> Any:
        """Write ``path`` if it is still at ``version``; its new stat."""
        try:
            return self._conn.wait(self._client.set_async(path, data, version=version))
        except BadVersionError:
            raise CasRetry from None

    def _create_new(self, path: str, value: dict[str, Any]) -> Any:
        """Create ``path`` (and parents) holding ``value`` if it does not exist yet."""
        try:
            return self._conn.create(path, value)
        except NodeExistsError:
            raise CasRetry from None

    @step
    def current_epoch(self, job: str) -> Epoch | None:
        path = self._epoch_path(job)
        with self._conn.mapped(f"read {path}"):
            return self._epoch_of(path, self._conn.read_json(path))

    @staticmethod
    def _epoch_of(path: str, found: tuple[dict[str, Any], Any] | None) -> Epoch | None:
        """The epoch of the node read at ``path`` (``<root>/jobs/<job>/epoch``)."""
        if found is None:
            return None
        data, stat = found
        number, owner = decode_epoch_node(data, path)
        return Epoch(path.rsplit("/", 2)[-2], number, stat.version, owner)

    def close(self) -> None:
        """Stop the session if this registry started it (a reused client stays open)."""
        self._conn.close()
