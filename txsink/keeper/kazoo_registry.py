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
  :class:`UnavailableError`, never a silent success. Every public operation is a
  :func:`_step`: it is re-run from the start (it re-reads what it needs) for up to
  ``retry_s`` seconds, so an outage of a few seconds costs a pause, not a failed batch;
  a re-run after a lost reply finds what actually landed (``XidExists`` for a prepare, a
  moved version for a compare-and-set). Past ``retry_s`` the UnavailableError reaches
  the caller, which treats the outcome as unknown.
- With ``auth="user:password"`` job nodes get an ACL that gives that digest identity ALL
  and everyone else READ, so other identities can watch a job but not alter it.
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import logging
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any, Concatenate, NoReturn, ParamSpec, TypeVar

from kazoo.client import KazooClient
from kazoo.exceptions import BadVersionError, KazooException, NodeExistsError, NoNodeError

from txsink.errors import ConfigError, RetryableConflict, TxSinkError
from txsink.keeper.kazoo_conn import DEFAULT_RETRY_S, KazooConn, decode_node, encode
from txsink.keeper.ledger import empty_ledger, next_ledger
from txsink.keeper.manifest_codec import (
    CHUNKS_DIR,
    ChunkRef,
    PackedRecord,
    check_request,
    chunk_ref,
    new_nonce,
    pack_record,
    parse_chunk_name,
    repack,
    unpack_record,
)
from txsink.keeper.registry import (
    CREATE,
    BlobConflict,
    XidExists,
    committed_record,
    over_tombstone,
    superseded,
    tombstone,
    with_more_aborted,
)
from txsink.protocol.codec import encode_record
from txsink.protocol.states import Cut, Epoch, XidRecord, XidState, check_transition

log = logging.getLogger(__name__)

DEFAULT_ROOT = "/txsink"
DEFAULT_TIMEOUT = 10.0

# Names under <root>/jobs/<job> that belong to the registry itself, not to blobs.
RESERVED_KEYS = frozenset({"epoch", "owner", "ledger", "xids", CHUNKS_DIR})
# Deletes per fenced transaction: keeps one multi-op far below jute.maxbuffer (1 MiB).
DELETE_CHUNK = 500
# Manifests up to this many entries are prepared without first checking for the xid.
SMALL_MANIFEST = 200
# A CAS loop that loses this often is not contention but a bug or a runaway peer.
MAX_CAS_ROUNDS = 50


P = ParamSpec("P")
R = TypeVar("R")


def _step(
    method: Callable[Concatenate[KazooRegistry, P], R],
) -> Callable[Concatenate[KazooRegistry, P], R]:
    """Mark a registry operation as re-runnable while Keeper is unavailable.

    Only for operations that are safe to run again from the start after an unknown
    outcome: reads, and writes that re-read and compare before they act (creates that
    find the node, compare-and-sets that find the version moved)."""

    @functools.wraps(method)
    def run(registry: KazooRegistry, /, *args: P.args, **kwargs: P.kwargs) -> R:
        return registry._conn.retrying(method.__name__, lambda: method(registry, *args, **kwargs))

    return run


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

    @classmethod
    def from_options(
        cls,
        keeper: str,
        root: str = DEFAULT_ROOT,
        auth: str | None = None,
        timeout: float = 10.0,
        retry_s: float = DEFAULT_RETRY_S,
    ) -> KazooRegistry:
        """The registry named by the ``keeper``/root/auth/timeout/retry options of a job."""
        return cls(keeper, root, auth=auth, timeout=timeout, retry_s=retry_s)

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
        raise superseded(epoch, self.current_epoch(epoch.job))

    def _fence_now(self, epoch: Epoch) -> None:
        """Raise FencedError if ``epoch`` is stale (a read, for checks done outside a txn;
        synced first, so a lagging server cannot show a superseded writer its own epoch)."""
        self._conn.sync(self._epoch_path(epoch.job))
        cur = self.current_epoch(epoch.job)
        if cur is None or cur.token != epoch.token:
            self._raise_fenced(epoch)

    # -- jobs --------------------------------------------------------------------------

    @_step
    def ensure_job(self, job: str, meta: dict[str, Any]) -> dict[str, Any]:
        path = self._job(job)
        check_request(f"ensure job {path}", [(path, len(encode(meta)))], self._acl_entries())
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

    @_step
    def sync(self, job: str) -> None:
        """Bring this session up to date with the ensemble's leader (see
        :meth:`KazooConn.sync`) before a read that decides an action."""
        path = self._job(job)
        with self._conn.mapped(f"sync {path}"):
            self._conn.sync(path)

    @_step
    def job_meta(self, job: str) -> dict[str, Any] | None:
        path = self._job(job)
        with self._conn.mapped(f"read {path}"):
            found = self._conn.read(path)
        return None if found is None else found[0]

    @_step
    def set_job_meta(self, job: str, meta: dict[str, Any]) -> None:
        """Replace an existing job's meta (operator actions such as `txsink mode`)."""
        path = self._job(job)
        with self._conn.mapped(f"write {path}"):
            self._conn.wait(self._client.set_async(path, encode(meta)))

    @_step
    def blob_children(self, job: str, key: str) -> builtins.list[str]:
        """Names directly under blob ``key`` (e.g. xids with dedup state under ``dedup``)."""
        path = self._blob_path(job, key)
        with self._conn.mapped(f"list {path}"):
            try:
                return sorted(self._conn.wait(self._client.get_children_async(path)))
            except NoNodeError:
                return []

    @_step
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

    @_step
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

    @_step
    def current_epoch(self, job: str) -> Epoch | None:
        path = self._epoch_path(job)
        with self._conn.mapped(f"read {path}"):
            found = self._conn.read_json(path)
        if found is None:
            return None
        data, stat = found
        return Epoch(job, int(data["epoch"]), stat.version, str(data.get("owner", "")))

    @_step
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
                check_request(
                    f"heartbeat {path}",
                    [(epoch_path, 0), (path, len(encode(value)))],
                    self._acl_entries(),
                )
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

    @_step
    def owner(self, job: str) -> dict[str, Any] | None:
        path = f"{self._job(job)}/owner"
        with self._conn.mapped(f"read {path}"):
            found = self._conn.read(path)
        return None if found is None else found[0]

    # -- xids ----------------------------------------------------------------------------

    def _chunk_path(self, job: str, name: str) -> str:
        return f"{self._job(job)}/{CHUNKS_DIR}/{name}"

    def _fetch_chunks(self, job: str, pending: builtins.list[tuple[str, ChunkRef]]) -> Any:
        """Chunks of several records, all requests in flight at once: {xid: [bytes...]}
        (a missing chunk is left out; :func:`unpack_record` then fails on the count)."""
        asked = [
            (xid, self._client.get_async(self._chunk_path(job, name)))
            for xid, ref in pending
            for name in ref.names(xid)
        ]
        got: dict[str, builtins.list[bytes]] = {xid: [] for xid, _ in pending}
        for xid, result in asked:
            with contextlib.suppress(NoNodeError):
                got[xid].append(self._conn.wait(result)[0])
        return got

    def _unpack(self, job: str, xid: str, node: dict[str, Any], stat: Any, chunks: Any) -> Any:
        return unpack_record(node, chunks, stat.version, self._xid_path(job, xid))

    def _read_record(self, job: str, xid: str) -> tuple[XidRecord, dict[str, Any], Any] | None:
        """(record, its node, its stat), chunks reassembled and verified."""
        path = self._xid_path(job, xid)
        for _ in range(MAX_CAS_ROUNDS):
            found = self._conn.read_json(path)
            if found is None:
                return None
            node, stat = found
            ref = chunk_ref(node)
            if ref is None:
                return self._unpack(job, xid, node, stat, None), node, stat
            chunks = self._fetch_chunks(job, [(xid, ref)])[xid]
            if len(chunks) != ref.count:
                again = self._conn.read_json(path)
                if (
                    again is None
                    or again[1].czxid != stat.czxid
                    or again[1].version != stat.version
                ):
                    continue  # deleted or changed while we read its chunks: read again
            return self._unpack(job, xid, node, stat, chunks), node, stat
        raise RetryableConflict(f"xid {xid} of job {job} keeps changing while read; retry")

    @_step
    def get(self, job: str, xid: str) -> XidRecord | None:
        path = self._xid_path(job, xid)
        with self._conn.mapped(f"read {path}"):
            found = self._read_record(job, xid)
        return None if found is None else found[0]

    @_step
    def list(self, job: str) -> list[XidRecord]:
        """Every record of the job, in creation order. All node reads are in flight at
        once (then all chunk reads), so hundreds of xids cost a few round trips."""
        parent = f"{self._job(job)}/xids"
        with self._conn.mapped(f"list {parent}"):
            try:
                names = self._conn.wait(self._client.get_children_async(parent))
            except NoNodeError:
                return []
            asked = [(n, self._client.get_async(f"{parent}/{n}")) for n in names]
            nodes: builtins.list[tuple[str, dict[str, Any], Any]] = []
            for name, result in asked:
                try:
                    data, stat = self._conn.wait(result)
                except NoNodeError:
                    continue  # deleted while we listed
                node = decode_node(f"{parent}/{name}", data)
                if node is not None:
                    nodes.append((name, node, stat))
            refs = [(n, ref) for n, node, _ in nodes if (ref := chunk_ref(node)) is not None]
            chunks = self._fetch_chunks(job, refs) if refs else {}
            found: list[tuple[int, XidRecord]] = []
            for name, node, stat in nodes:
                ref = chunk_ref(node)
                if ref is not None and len(chunks[name]) != ref.count:
                    again = self._read_record(job, name)  # deleted meanwhile, or damaged
                    if again is not None:
                        found.append((again[2].czxid, again[0]))
                    continue
                record = self._unpack(job, name, node, stat, chunks.get(name))
                found.append((stat.czxid, record))
        # Creation order, like MemoryRegistry's insertion-ordered dict.
        return [rec for _, rec in sorted(found, key=lambda pair: pair[0])]

    @_step
    def manifest_chunks(self, job: str) -> builtins.list[str]:
        """Names of the job's chunk nodes (``<xid>.<nonce>.<i>``), live and orphaned."""
        parent = f"{self._job(job)}/{CHUNKS_DIR}"
        with self._conn.mapped(f"list {parent}"):
            try:
                return sorted(self._conn.wait(self._client.get_children_async(parent)))
            except NoNodeError:
                return []

    def _stage_chunks(self, epoch: Epoch, record: XidRecord) -> PackedRecord:
        """Step 1 of prepare: lay the record out and write its chunks, each its own small
        request, all in flight at once. No record references them yet."""
        packed = pack_record(replace(record, version=0), new_nonce())
        named = packed.named_chunks(record.xid)
        if not named:
            return packed
        paths = [(self._chunk_path(epoch.job, n), data) for n, data in named]
        for path, data in paths:
            check_request(f"write {path}", [(path, len(data))], self._acl_entries())
        self._conn.ensure(paths[0][0].rsplit("/", 1)[0])
        asked = [self._client.create_async(path, data, acl=self._conn.acl) for path, data in paths]
        for result in asked:
            self._conn.wait(result)
        return packed

    def _drop_own_chunks(self, job: str, packed: PackedRecord, xid: str) -> None:
        """Best effort: chunks of a prepare that definitely did not create its record
        (what fails here is an orphan for the next sweep, never an error)."""
        try:
            asked = [
                self._client.delete_async(self._chunk_path(job, n))
                for n, _ in packed.named_chunks(xid)
            ]
            for result in asked:
                with contextlib.suppress(NoNodeError):
                    self._conn.wait(result)
        except (KazooException, self._client.handler.timeout_exception) as exc:
            log.info(
                "job %s: chunks of a failed prepare of %s left for the sweep: %r", job, xid, exc
            )

    def _acl_entries(self) -> int:
        return len(self._conn.acl or [None])

    @_step
    def prepare(self, epoch: Epoch, record: XidRecord) -> XidRecord:
        """Chunks first (if the manifest does not fit inline), then ONE fenced multi-op:
        check the epoch, check every chunk still exists, create the small xid node. The
        create is the commit point; a lost reply leaves either nothing or the whole
        record, and the re-run finds it (``XidExists``). Chunks of an attempt whose create
        did not land are orphans that ``delete`` sweeps."""
        path = self._xid_path(epoch.job, record.xid)
        epoch_path = self._epoch_path(epoch.job)
        with self._conn.mapped(f"prepare {path}"):
            try:
                check_transition(None, record.state)
            except ValueError:
                self._fence_now(epoch)  # a stale writer hears FencedError first
                raise
            self._conn.ensure(path.rsplit("/", 1)[0])
            # The xid node decides: created here, or compare-and-set over an ABORTED
            # tombstone (never adopting a table the tombstone rolled back).
            incoming, over = record, None  # over: version of the tombstone we replace
            if len(record.manifest) > SMALL_MANIFEST:
                # A replay must not write megabytes of chunks to learn the xid exists;
                # synced, so a lagging server does not hide the record it would find.
                self._conn.sync(path)
                over, record = self._over_existing(epoch, incoming)
            for _ in range(MAX_CAS_ROUNDS):
                packed = self._stage_chunks(epoch, record)
                chunk_paths = [
                    self._chunk_path(epoch.job, n) for n, _ in packed.named_chunks(record.xid)
                ]
                data = encode(packed.node)
                check_request(
                    f"prepare {path}",
                    [(epoch_path, 0), (path, len(data))] + [(p, 0) for p in chunk_paths],
                    self._acl_entries(),
                )

                def ops(
                    txn: Any, data: bytes = data, chunk_paths: Any = chunk_paths, over: Any = over
                ) -> None:
                    txn.check(epoch_path, epoch.token)
                    for p in chunk_paths:
                        txn.check(p, 0)
                    if over is None:
                        txn.create(path, data, acl=self._conn.acl)
                    else:
                        txn.set_data(path, data, version=over)

                ok, results = self._conn.commit_txn(ops)
                if ok:
                    return replace(record, version=0 if over is None else over + 1)
                # A definite failure: nothing landed, so our chunks are nobody's.
                self._drop_own_chunks(epoch.job, packed, record.xid)
                if isinstance(results[0], Exception):
                    self._raise_fenced(epoch)
                last = results[-1]
                if any(isinstance(r, Exception) for r in results[1:-1]):
                    continue  # a sweep removed our chunks before the record existed: again
                if isinstance(last, (NodeExistsError, BadVersionError, NoNodeError)):
                    if isinstance(last, NoNodeError) and over is None:
                        self._conn.known_paths.discard(path.rsplit("/", 1)[0])
                        self._conn.ensure(path.rsplit("/", 1)[0])
                    # a tombstone or another prepare landed (or a tombstone went): decide again
                    over, record = self._over_existing(epoch, incoming)
                else:
                    raise self._first_error(results)
        raise RetryableConflict(f"xid {record.xid} of job {epoch.job} keeps changing; retry")

    def _over_existing(self, epoch: Epoch, record: XidRecord) -> tuple[int | None, XidRecord]:
        """(version of the ABORTED tombstone to replace or None, the record to store);
        XidExists if a PREPARED/COMMITTED record (or a tombstone of our tables) is there."""
        existing = self._read_record(epoch.job, record.xid)
        if existing is None:
            return None, record
        current, _, stat = existing
        if current.state is not XidState.ABORTED:
            self._fence_now(epoch)  # a stale writer hears FencedError first
            raise XidExists(current)
        return stat.version, over_tombstone(record, current)

    @_step
    def abort(self, job: str, xid: str, tables: Iterable[str], now: float) -> XidRecord:
        """Tombstone ``tables`` of ``xid`` (ABORTED) unless a prepare got there first.

        Unfenced on purpose: the tombstone only ever removes tables from what a prepare
        may adopt, and the xid node's atomicity orders it against every prepare."""
        tables = sorted(set(tables))
        path = self._xid_path(job, xid)
        with self._conn.mapped(f"tombstone {path}"):
            self._conn.ensure(path.rsplit("/", 1)[0])
            for _ in range(MAX_CAS_ROUNDS):
                found = self._read_record(job, xid)
                if found is None:
                    new = tombstone(job, xid, tables, now)
                    try:
                        self._conn.create(path, encode_record(new))
                    except NodeExistsError:
                        continue
                    return replace(new, version=0)
                cur, _, stat = found
                if cur.state is not XidState.ABORTED:
                    return cur
                more = with_more_aborted(cur, tables)
                if more is None:
                    return cur
                try:
                    new_stat = self._conn.wait(
                        self._client.set_async(
                            path, encode(encode_record(more)), version=stat.version
                        )
                    )
                except BadVersionError:
                    continue
                return replace(more, version=new_stat.version)
        raise RetryableConflict(f"xid {xid} of job {job} keeps changing; retry the roll-back")

    @_step
    def namespace(self) -> str:
        """This store's id (``<root>/namespace``), created on first use; cached."""
        if self._namespace_id:
            return self._namespace_id
        path = f"{self._root}/namespace"
        with self._conn.mapped(f"read {path}"):
            for _ in range(MAX_CAS_ROUNDS):
                found = self._conn.read_json(path)
                if found is not None:
                    self._namespace_id = str(found[0]["id"])
                    return self._namespace_id
                try:
                    self._conn.create(path, {"id": uuid.uuid4().hex[:16]})
                except NodeExistsError:
                    continue
        raise RetryableConflict(f"Keeper node {path} keeps changing; retry")

    @_step
    def amend(self, epoch: Epoch, record: XidRecord, cuts: Iterable[Cut]) -> XidRecord:
        """One fenced multi-op: compare-and-set the PREPARED xid node with ``cuts`` merged
        into its own (facts a publish learned; its chunks never change). A lost reply
        re-runs the step: the re-read finds the facts already there and returns."""
        path = self._xid_path(epoch.job, record.xid)
        epoch_path = self._epoch_path(epoch.job)
        with self._conn.mapped(f"amend {path}"):
            found = self._read_record(epoch.job, record.xid)
            if found is None or found[0].state is not XidState.PREPARED:
                self._fence_now(epoch)
                raise RetryableConflict(f"xid {record.xid} is no longer PREPARED; re-read")
            cur, node, stat = found
            done = cur.with_cuts(cuts)
            if done.cuts == cur.cuts:
                return cur
            data = encode(repack(done, node))
            check_request(
                f"amend {path}", [(epoch_path, 0), (path, len(data))], self._acl_entries()
            )

            def ops(txn: Any) -> None:
                txn.check(epoch_path, epoch.token)
                txn.set_data(path, data, version=stat.version)

            ok, results = self._conn.commit_txn(ops)
            if isinstance(results[0], Exception):
                self._raise_fenced(epoch)
            if not ok:
                raise RetryableConflict(f"xid {record.xid} changed under us; re-read and retry")
            return replace(done, version=results[1].version)

    @_step
    def commit(self, epoch: Epoch, record: XidRecord, committed_at: float) -> XidRecord:
        """One fenced multi-op: compare-and-set the xid node (the small record; its chunks
        never change) and the ledger."""
        path = self._xid_path(epoch.job, record.xid)
        ledger_path = f"{self._job(epoch.job)}/ledger"
        epoch_path = self._epoch_path(epoch.job)
        with self._conn.mapped(f"commit {path}"):
            for _ in range(MAX_CAS_ROUNDS):
                found = self._read_record(epoch.job, record.xid)
                if found is None or found[2].version != record.version:
                    self._fence_now(epoch)
                    raise RetryableConflict(f"xid {record.xid} changed under us; re-read and retry")
                cur, node, _ = found
                ledger_found = self._conn.read_json(ledger_path)
                ledger = empty_ledger() if ledger_found is None else ledger_found[0]
                try:
                    done = committed_record(cur, ledger, committed_at, epoch.number)
                except ValueError:
                    self._fence_now(epoch)
                    raise
                new_ledger = next_ledger(ledger, cur, committed_at)
                data, ledger_data = encode(repack(done, node)), encode(new_ledger)
                check_request(
                    f"commit {path}",
                    [(epoch_path, 0), (path, len(data)), (ledger_path, len(ledger_data))],
                    self._acl_entries(),
                )

                def ops(
                    txn: Any,
                    data: bytes = data,
                    ledger_data: bytes = ledger_data,
                    ledger_found: Any = ledger_found,
                ) -> None:
                    txn.check(epoch_path, epoch.token)
                    txn.set_data(path, data, version=record.version)
                    if ledger_found is None:
                        txn.create(ledger_path, ledger_data, acl=self._conn.acl)
                    else:
                        txn.set_data(ledger_path, ledger_data, version=ledger_found[1].version)

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

    @_step
    def ledger(self, job: str) -> dict[str, Any]:
        path = f"{self._job(job)}/ledger"
        with self._conn.mapped(f"read {path}"):
            found = self._conn.read_json(path)
        if found is None:
            return empty_ledger()
        return {**empty_ledger(), **found[0]}

    @_step
    def delete(self, epoch: Epoch, xids: builtins.list[str]) -> None:
        """Delete records (fenced, in bounded multi-ops), then sweep every chunk node no
        record references: the deleted records' chunks and orphans of failed prepares."""
        epoch_path = self._epoch_path(epoch.job)
        paths = [self._xid_path(epoch.job, xid) for xid in xids]
        with self._conn.mapped(f"delete xids of job {epoch.job}"):
            chunks = [paths[i : i + DELETE_CHUNK] for i in range(0, len(paths), DELETE_CHUNK)]
            for chunk in chunks or [[]]:
                self._delete_chunk(epoch, epoch_path, chunk)
            self._sweep_chunks(epoch, epoch_path)

    def _sweep_chunks(self, epoch: Epoch, epoch_path: str) -> None:
        """Delete chunk nodes no record references, each xid's in one fenced multi-op that
        also proves the reference is still absent: for an xid without a record it creates
        and deletes the xid node (fails if a record appeared), otherwise it checks the
        record's version. Anything that changed meanwhile is left for the next sweep."""
        parent = f"{self._job(epoch.job)}/{CHUNKS_DIR}"
        try:
            names = self._conn.wait(self._client.get_children_async(parent))
        except NoNodeError:
            return
        by_xid: dict[str, builtins.list[tuple[str, str]]] = {}
        for name in names:
            parsed = parse_chunk_name(name)
            if parsed is not None:
                by_xid.setdefault(parsed[0], []).append((parsed[1], name))
        for xid, chunks in sorted(by_xid.items()):
            path = self._xid_path(epoch.job, xid)
            found = self._conn.read_json(path)
            if found is None:
                doomed = [name for _, name in chunks]
            else:
                ref = chunk_ref(found[0])
                doomed = [name for nonce, name in chunks if ref is None or nonce != ref.nonce]
            for i in range(0, len(doomed), DELETE_CHUNK):
                part = doomed[i : i + DELETE_CHUNK]

                def ops(txn: Any, part: Any = part, found: Any = found, path: str = path) -> None:
                    txn.check(epoch_path, epoch.token)
                    if found is None:
                        txn.create(path, b"", acl=self._conn.acl)
                        txn.delete(path)
                    else:
                        txn.check(path, found[1].version)
                    for name in part:
                        txn.delete(f"{parent}/{name}")

                ok, results = self._conn.commit_txn(ops)
                if isinstance(results[0], Exception):
                    self._raise_fenced(epoch)
                if not ok:
                    log.info("job %s: chunks of xid %s changed during the sweep", epoch.job, xid)
                    break

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

    @_step
    def get_blob(self, job: str, key: str) -> dict[str, Any] | None:
        path = self._blob_path(job, key)
        with self._conn.mapped(f"read {path}"):
            found = self._conn.read(path)
        return None if found is None else found[0]

    @_step
    def put_blob(self, job: str, key: str, value: dict[str, Any]) -> None:
        path = self._blob_path(job, key)
        check_request(f"write {path}", [(path, len(encode(value)))], self._acl_entries())
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

    @_step
    def get_blob_versioned(self, job: str, key: str) -> tuple[dict[str, Any], int] | None:
        """The blob and its Keeper node version, or None (absent or an empty parent node)."""
        path = self._blob_path(job, key)
        with self._conn.mapped(f"read {path}"):
            found = self._conn.read_json(path)
        return None if found is None else (found[0], int(found[1].version))

    @_step
    def cas_blob(self, job: str, key: str, value: dict[str, Any], expected_version: int) -> int:
        """Write the blob only if its node is at ``expected_version`` (``CREATE``: absent);
        the new version, or :class:`BlobConflict` with nothing written.

        An empty node (a parent made for a child blob) counts as absent: it is filled in
        at its own version, so ``get_blob_versioned`` -> None -> ``CREATE`` still works.
        """
        path = self._blob_path(job, key)
        check_request(f"write {path}", [(path, len(encode(value)))], self._acl_entries())
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

    @_step
    def delete_blobs(self, job: str, key: str) -> None:
        """Remove blob ``key`` and its subtree (unfenced: only dedup state of COMMITTED xids)."""
        path = self._blob_path(job, key)
        with self._conn.mapped(f"delete {path}"):
            if self._conn.wait(self._client.exists_async(path)) is not None:
                self._client.delete(path, recursive=True)
        self._conn.known_paths = {p for p in self._conn.known_paths if not p.startswith(path)}

    @_step
    def delete_job(self, job: str) -> None:
        """Remove a job's whole subtree (unfenced: scratch jobs of `txsink tune`)."""
        path = self._job(job)
        with self._conn.mapped(f"delete {path}"):
            if self._conn.wait(self._client.exists_async(path)) is not None:
                self._client.delete(path, recursive=True)
        self._conn.known_paths = {p for p in self._conn.known_paths if not p.startswith(path)}

    def reusable(self) -> bool:
        """Whether this registry's session can be lent out again (see KazooConn). The
        namespace id is read again by the next borrower: ``<root>/namespace`` may have
        been recreated (a Keeper restored from backup) while it sat in the pool."""
        self._namespace_id = ""
        return self._conn.reusable()

    def close(self) -> None:
        """Stop the session if this registry started it (a reused client stays open)."""
        self._conn.close()
