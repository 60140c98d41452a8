"""``KazooRegistry``: the :class:`txsink.ports.registry.Registry` on ZooKeeper / ClickHouse
Keeper through kazoo, with exactly the semantics of its twin
:class:`~txsink.ports.registry_memory.MemoryRegistry`.

This module owns the job-level nodes of the Keeper layout described in
:mod:`txsink.ports.registry` (job meta, epoch, owner, namespace, blobs); the xid records
are :mod:`txsink.keeper.kazoo_xids`', the session, paths, fencing and the compare-and-set
helper :mod:`txsink.keeper.kazoo_base`'s. The session, the node primitives and the mapping
of every kazoo error onto :mod:`txsink.errors` live in :mod:`txsink.keeper.kazoo_conn`;
these modules are the only places that import kazoo. Node contents are encoded by
:mod:`txsink.protocol.codec` (every node carries its format version).

Invariants (beyond those of the modules above):

- ``take_epoch`` compare-and-sets the epoch node: its node version is the fencing token,
  so exactly one writer holds each token.
- With ``auth="user:password"`` job nodes get an ACL that gives that digest identity ALL
  and everyone else READ, so other identities can watch a job but not alter it.
"""

from __future__ import annotations

import builtins
import logging
import uuid
from collections.abc import Mapping
from typing import Any

from kazoo.exceptions import BadVersionError, NodeExistsError, NoNodeError

from txsink.keeper.kazoo_base import (
    DEFAULT_ROOT,
    CasRetry,
    cas,
    step,
)
from txsink.keeper.kazoo_conn import DEFAULT_RETRY_S, encode
from txsink.keeper.kazoo_xids import ABSENT, KazooXids
from txsink.ports.manifest_codec import check_request
from txsink.ports.record_rules import typed_meta
from txsink.ports.registry import CREATE, BlobConflict
from txsink.protocol.codec import (
    JobMeta,
    OwnerInfo,
    decode_epoch_node,
    decode_job_meta,
    decode_owner,
    encode_epoch_node,
    encode_job_meta,
)
from txsink.protocol.states import Epoch

__all__ = [
    "KazooRegistry",
]

log = logging.getLogger(__name__)


class KazooRegistry(KazooXids):
    """The coordination store on a real Keeper; see the module docstring for guarantees."""

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

    # -- jobs --------------------------------------------------------------------------

    @step
    def ensure_job(self, job: str, meta: JobMeta | Mapping[str, Any]) -> JobMeta:
        path = self._job(job)
        typed = typed_meta(meta)
        node = encode_job_meta(typed)
        check_request(f"ensure job {path}", [(path, len(encode(node)))], self._acl_entries())

        def attempt() -> JobMeta:
            try:
                self._conn.create(path, node)
                return typed
            except NodeExistsError:
                pass
            found = self._conn.read(path)
            if found is None:
                raise CasRetry
            stored, stat = found
            if stored is not None:
                return decode_job_meta(stored, path) or typed
            # The node exists as an empty parent (take_epoch ran first): fill it in.
            self._set_at(path, encode(node), stat.version)
            return typed

        with self._conn.mapped(f"ensure job {path}"):
            return cas(f"job {job}: meta at {path}", attempt)

    @step
    def sync(self, job: str) -> None:
        """Bring this session up to date with the ensemble's leader (see
        :meth:`KazooConn.sync`) before a read that decides an action."""
        path = self._job(job)
        with self._conn.mapped(f"sync {path}"):
            self._conn.sync(path)

    @step
    def job_meta(self, job: str) -> JobMeta | None:
        path = self._job(job)
        with self._conn.mapped(f"read {path}"):
            found = self._conn.read(path)
        return None if found is None else decode_job_meta(found[0], path)

    @step
    def set_job_meta(self, job: str, meta: JobMeta) -> None:
        """Replace an existing job's meta (operator actions such as `txsink mode`)."""
        path = self._job(job)
        with self._conn.mapped(f"write {path}"):
            self._conn.wait(self._client.set_async(path, encode(encode_job_meta(meta))))

    @step
    def blob_children(self, job: str, key: str) -> builtins.list[str]:
        """Names directly under blob ``key`` (e.g. xids with dedup state under ``dedup``)."""
        path = self._blob_path(job, key)
        with self._conn.mapped(f"list {path}"):
            try:
                return sorted(self._conn.wait(self._client.get_children_async(path)))
            except NoNodeError:
                return []

    @step
    def list_jobs(self) -> list[str]:
        with self._conn.mapped(f"list {self._jobs_root()}"):
            names = self._conn.wait(self._client.get_children_async(self._jobs_root()))
            # A job exists once ensure_job stored its meta, or once a dedup task recorded
            # state (a first batch that stopped half-way has rows in the target and must
            # be seen): MemoryRegistry's definition. take_epoch alone leaves an empty
            # parent node.
            return sorted(n for n in names if self._has_meta(n) or self._has_dedup(n))

    def _has_dedup(self, job: str) -> bool:
        return self._conn.wait(self._client.exists_async(self._blob_path(job, "dedup"))) is not None

    def _has_meta(self, job: str) -> bool:
        found = self._conn.read(f"{self._jobs_root()}/{job}")
        return found is not None and found[0] is not None

    # -- epochs and owner -----------------------------------------------------------------

    @step
    def take_epoch(self, job: str, owner: str) -> Epoch:
        path = self._epoch_path(job)

        def attempt() -> Epoch:
            now = self._clock()
            found = self._conn.read(path)
            if found is None:
                self._create_new(path, encode_epoch_node(1, owner, now))
                log.info("job %s: epoch 1 taken by %s", job, owner)
                return Epoch(job, 1, 0, owner)
            old, stat = found
            number, previous = decode_epoch_node(old or {}, path)
            node = encode_epoch_node(number + 1, owner, now)
            new_stat = self._set_at(path, encode(node), stat.version)
            log.warning(
                "job %s: %s took over as epoch %d from %s (epoch %s)",
                job, owner, number + 1, previous or None, number or None,
            )  # fmt: skip
            return Epoch(job, number + 1, new_stat.version, owner)

        with self._conn.mapped(f"take epoch {path}"):
            return cas(f"job {job}: epoch node {path}", attempt)

    @step
    def heartbeat(self, epoch: Epoch, info: Mapping[str, Any]) -> None:
        path = self._owner_path(epoch.job)
        epoch_path = self._epoch_path(epoch.job)
        # The owner node exists after the job's first beat: set it without asking first
        # (one round trip less per batch); a NoNode answer makes the next round create it.
        exists = True

        def attempt() -> None:
            nonlocal exists
            data = self._owner_data(epoch, info)
            check_request(
                f"heartbeat {path}", [(epoch_path, 0), (path, len(data))], self._acl_entries()
            )

            def ops(txn: Any) -> None:
                txn.check(epoch_path, epoch.token)
                if exists:
                    txn.set_data(path, data)
                else:
                    txn.create(path, data, acl=self._conn.acl)

            ok, results = self._conn.commit_txn(ops)
            if isinstance(results[0], Exception):
                self._raise_fenced(epoch)
            if ok:  # its version, for the commit that writes the next beat (see commit)
                self._remember(path, None, getattr(results[1], "version", 0))
                return
            if not isinstance(results[1], (NoNodeError, NodeExistsError)):
                raise self._first_error(results)
            exists = isinstance(results[1], NodeExistsError)
            raise CasRetry  # the owner node is not (or no longer) as guessed

        with self._conn.mapped(f"heartbeat {path}"):
            cas(f"job {epoch.job}: owner node {path}", attempt)

    @step
    def owner(self, job: str) -> OwnerInfo | None:
        path = f"{self._job(job)}/owner"
        with self._conn.mapped(f"read {path}"):
            found = self._conn.read(path)
        return None if found is None else decode_owner(found[0], path)

    @step
    def namespace(self) -> str:
        """This store's id (``<root>/namespace``), created on first use; cached."""
        if self._namespace_id:
            return self._namespace_id
        path = f"{self._root}/namespace"

        def attempt() -> str:
            found = self._conn.read_json(path)
            if found is None:
                self._create_new(path, {"id": uuid.uuid4().hex[:16]})
                raise CasRetry  # read back what landed (ours or a concurrent creator's)
            self._namespace_id = str(found[0]["id"])
            return self._namespace_id

        with self._conn.mapped(f"read {path}"):
            return cas(f"Keeper node {path}", attempt)

    # -- blobs -----------------------------------------------------------------------------

    @step
    def get_blob(self, job: str, key: str) -> dict[str, Any] | None:
        path = self._blob_path(job, key)
        with self._conn.mapped(f"read {path}"):
            found = self._conn.read(path)
        return None if found is None else found[0]

    @step
    def put_blob(self, job: str, key: str, value: dict[str, Any]) -> None:
        path = self._blob_path(job, key)
        check_request(f"write {path}", [(path, len(encode(value)))], self._acl_entries())

        def attempt() -> None:
            try:
                self._conn.wait(self._client.set_async(path, encode(value)))
            except NoNodeError:
                self._create_new(path, value)

        with self._conn.mapped(f"write {path}"):
            cas(f"job {job}: blob {path}", attempt)

    @step
    def get_blob_versioned(self, job: str, key: str) -> tuple[dict[str, Any], int] | None:
        """The blob and its Keeper node version, or None (absent or an empty parent node)."""
        path = self._blob_path(job, key)
        with self._conn.mapped(f"read {path}"):
            found = self._conn.read_json(path)
        return None if found is None else (found[0], int(found[1].version))

    @step
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

    @step
    def delete_blobs(self, job: str, key: str) -> None:
        """Remove blob ``key`` and its subtree (unfenced: only dedup state of COMMITTED xids)."""
        path = self._blob_path(job, key)
        with self._conn.mapped(f"delete {path}"):
            if self._conn.wait(self._client.exists_async(path)) is not None:
                self._client.delete(path, recursive=True)
        self._conn.known_paths = {p for p in self._conn.known_paths if not p.startswith(path)}

    @step
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
        self._namespace_id = ""  # (the nodes kept for a commit stay: each is compared)
        # an xid seen absent is not for the next borrower: its prepare would skip the
        # existence check that keeps a replay from writing megabytes of chunks
        self._known = {k: v for k, v in self._known.items() if v != (None, ABSENT)}
        return self._conn.reusable()
