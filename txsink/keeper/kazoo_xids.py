"""Xid records on Keeper: prepare, tombstone, amend, commit, read, delete (and the sweep
of chunk nodes no record references), for :class:`~txsink.keeper.kazoo_registry.KazooRegistry`.

Invariants (beyond :mod:`txsink.keeper.kazoo_base`'s):

- ``prepare`` writes chunks first, then ONE fenced multi-op that checks every chunk still
  exists and creates the xid node (or compare-and-sets it over an ABORTED tombstone).
- ``commit`` compare-and-sets the xid node (on ``record.version``) and the ledger node in
  the same transaction, so the ledger counts every committed xid exactly once.
- A record is read only whole: its chunks reassembled and verified, re-read if it moved
  while they were fetched.
"""

from __future__ import annotations

import builtins
import contextlib
import logging
from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Any

from kazoo.exceptions import (
    BadVersionError,
    KazooException,
    NodeExistsError,
    NoNodeError,
    NotEmptyError,
)

from txsink.errors import RetryableConflict
from txsink.keeper.kazoo_base import CasRetry, KazooBase, cas, step
from txsink.keeper.kazoo_conn import decode_node, encode
from txsink.ports.ledger import next_ledger
from txsink.ports.manifest_codec import (
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
from txsink.ports.record_rules import (
    committed_record,
    over_tombstone,
    tombstone,
    with_more_aborted,
)
from txsink.ports.registry import BatchView, BlobPresent, XidExists
from txsink.protocol.codec import Ledger, decode_ledger, encode_ledger, encode_record
from txsink.protocol.states import Cut, Epoch, XidRecord, XidState, check_transition

log = logging.getLogger(__name__)

# Deletes per fenced transaction: keeps one multi-op far below jute.maxbuffer (1 MiB).
DELETE_CHUNK = 500
# Manifests up to this many entries are prepared without first checking for the xid.
SMALL_MANIFEST = 200
ABSENT = -1  # the version KazooBase._known gives a node read as missing


class KazooXids(KazooBase):
    """The xid-record operations of the Keeper registry."""

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

    def _read_record(
        self, job: str, xid: str, asked: Any = None
    ) -> tuple[XidRecord, dict[str, Any], Any] | None:
        """(record, its node, its stat), chunks reassembled and verified. ``asked``: the
        node's ``get_async`` sent earlier (reads in flight together)."""
        path = self._xid_path(job, xid)
        first = [asked]

        def attempt() -> tuple[XidRecord, dict[str, Any], Any] | None:
            found = self._conn.read_json(path, first.pop() if first else None)
            if found is None:
                return None
            node, stat = found
            self._remember(path, node, stat.version)
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
                    raise CasRetry  # deleted or changed while we read its chunks
            return self._unpack(job, xid, node, stat, chunks), node, stat

        return cas(f"xid {xid} of job {job} (while read)", attempt)

    @step
    def get(self, job: str, xid: str) -> XidRecord | None:
        path = self._xid_path(job, xid)
        with self._conn.mapped(f"read {path}"):
            found = self._read_record(job, xid)
        return None if found is None else found[0]

    @step
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

    @step
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
        request, all in flight at once. No record references them yet. A lone chunk is
        not written here: the prepare's transaction creates it with the record."""
        packed = pack_record(replace(record, version=0), new_nonce())
        named = packed.named_chunks(record.xid)
        if not named or (len(named) == 1 and self._chunks_in_txn()):
            return packed
        paths = [(self._chunk_path(epoch.job, n), data) for n, data in named]
        for path, data in paths:
            check_request(f"write {path}", [(path, len(data))], self._acl_entries())
        self._conn.ensure(paths[0][0].rsplit("/", 1)[0])
        asked = [self._client.create_async(path, data, acl=self._conn.acl) for path, data in paths]
        for result in asked:
            self._conn.wait(result)
        return packed

    def _chunks_in_txn(self) -> bool:
        """Whether a lone manifest chunk is created by the prepare's own transaction
        (the client may say not: the KeeperMap store)."""
        return bool(getattr(self._client, "chunks_in_transactions", True))

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

    @step
    def prepare(self, epoch: Epoch, record: XidRecord, *, unless_blob: str = "") -> XidRecord:
        """Chunks first (if the manifest does not fit inline), then ONE fenced multi-op:
        check the epoch, check every chunk still exists, prove blob ``unless_blob`` absent
        (create and delete it), create the small xid node. The create is the commit
        point; a lost reply leaves either nothing or the whole record, and the re-run
        finds it (``XidExists``). Chunks of an attempt whose create did not land are
        orphans that ``delete`` sweeps."""
        path = self._xid_path(epoch.job, record.xid)
        epoch_path = self._epoch_path(epoch.job)
        absent = self._blob_path(epoch.job, unless_blob) if unless_blob else ""
        with self._conn.mapped(f"prepare {path}"):
            try:
                check_transition(None, record.state)
            except ValueError:
                self._fence_now(epoch)  # a stale writer hears FencedError first
                raise
            # The parent (``xids``) is made only when the create finds it missing (the
            # job's first prepare): one request fewer per batch.
            # The xid node decides: created here, or compare-and-set over an ABORTED
            # tombstone (never adopting a table the tombstone rolled back).
            incoming = record
            # over: version of the tombstone we replace; decided again after a lost race
            decided: list[tuple[int | None, XidRecord]] = [(None, record)]
            seen_absent = self._known.pop(path, None) == (None, ABSENT)
            if len(record.manifest) > SMALL_MANIFEST and not seen_absent:
                # A replay must not write megabytes of chunks to learn the xid exists;
                # synced, so a lagging server does not hide the record it would find.
                # (Not when this session's synced batch_view just found no record: one
                # that appeared since makes the create fail, and it is decided again.)
                self._conn.sync(path)
                decided[0] = self._over_existing(epoch, incoming)

            def attempt() -> XidRecord:
                over, rec = decided[0]
                packed = self._stage_chunks(epoch, rec)
                named = packed.named_chunks(rec.xid)
                chunk_paths = [self._chunk_path(epoch.job, n) for n, _ in named]
                lone = named[0][1] if len(named) == 1 and self._chunks_in_txn() else None
                data = encode(packed.node)
                check_request(
                    f"prepare {path}",
                    [(epoch_path, 0), (path, len(data))]
                    + [(p, 0 if lone is None else len(lone)) for p in chunk_paths],
                    self._acl_entries(),
                )

                def ops(txn: Any) -> None:
                    txn.check(epoch_path, epoch.token)
                    for p in chunk_paths:
                        if lone is None:
                            txn.check(p, 0)
                        else:
                            txn.create(p, lone, acl=self._conn.acl)
                    if absent:
                        txn.create(absent, b"", acl=self._conn.acl)
                        txn.delete(absent)
                    if over is None:
                        txn.create(path, data, acl=self._conn.acl)
                    else:
                        txn.set_data(path, data, version=over)

                ok, results = self._conn.commit_txn(ops)
                if ok:
                    version = 0 if over is None else over + 1
                    self._remember(path, packed.node, version)
                    return replace(rec, version=version)
                # A definite failure: nothing landed, so our chunks are nobody's.
                if lone is None:  # (a lone chunk was the transaction's: not made)
                    self._drop_own_chunks(epoch.job, packed, rec.xid)
                if isinstance(results[0], Exception):
                    self._raise_fenced(epoch)
                last = results[-1]
                if absent:
                    proof = results[1 + len(chunk_paths)]
                    if isinstance(proof, NodeExistsError):
                        self._clear_empty(epoch.job, unless_blob, absent)
                        raise CasRetry  # it was empty, and is gone: prove it absent again
                    if isinstance(proof, NoNodeError):  # its parent is not made yet
                        self._conn.ensure(absent.rsplit("/", 1)[0])
                        raise CasRetry
                    results = results[: 1 + len(chunk_paths)] + results[3 + len(chunk_paths) :]
                if lone is not None and isinstance(results[1], NoNodeError):
                    parent = chunk_paths[0].rsplit("/", 1)[0]  # the job's first chunk
                    self._conn.known_paths.discard(parent)
                    self._conn.ensure(parent)
                    raise CasRetry
                if any(isinstance(r, Exception) for r in results[1:-1]):
                    raise CasRetry  # a sweep removed our chunks before the record existed
                if not isinstance(last, (NodeExistsError, BadVersionError, NoNodeError)):
                    raise self._first_error(results)
                if isinstance(last, NoNodeError) and over is None:
                    self._conn.known_paths.discard(path.rsplit("/", 1)[0])
                    self._conn.ensure(path.rsplit("/", 1)[0])
                # a tombstone or another prepare landed (or a tombstone went): decide again
                decided[0] = self._over_existing(epoch, incoming)
                raise CasRetry

            return cas(f"xid {record.xid} of job {epoch.job}", attempt)

    def _clear_empty(self, job: str, key: str, path: str) -> None:
        """Blob node ``path`` exists: :class:`BlobPresent` if anything is under it, else
        delete it (a node left empty by a clean-up cut short). The delete is refused if
        a child appeared since the listing (``NotEmpty``): then it is present after all."""
        try:
            if self._conn.wait(self._client.get_children_async(path)):
                raise BlobPresent(job, key)
            self._conn.wait(self._client.delete_async(path))
        except NotEmptyError:
            raise BlobPresent(job, key) from None
        except NoNodeError:
            pass  # gone meanwhile
        self._conn.known_paths.discard(path)

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

    @step
    def abort(self, job: str, xid: str, tables: Iterable[str], now: float) -> XidRecord:
        """Tombstone ``tables`` of ``xid`` (ABORTED) unless a prepare got there first.

        Unfenced on purpose: the tombstone only ever removes tables from what a prepare
        may adopt, and the xid node's atomicity orders it against every prepare."""
        names = sorted(set(tables))
        path = self._xid_path(job, xid)

        def attempt() -> XidRecord:
            found = self._read_record(job, xid)
            if found is None:
                new = tombstone(job, xid, names, now)
                self._create_new(path, encode_record(new))
                return replace(new, version=0)
            cur, _, stat = found
            if cur.state is not XidState.ABORTED:
                return cur
            more = with_more_aborted(cur, names)
            if more is None:
                return cur
            new_stat = self._set_at(path, encode(encode_record(more)), stat.version)
            return replace(more, version=new_stat.version)

        with self._conn.mapped(f"tombstone {path}"):
            self._conn.ensure(path.rsplit("/", 1)[0])
            return cas(f"xid {xid} of job {job} (its roll-back)", attempt)

    @step
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
            self._remember(path, repack(done, node), results[1].version)
            return replace(done, version=results[1].version)

    @step
    def commit(
        self,
        epoch: Epoch,
        record: XidRecord,
        committed_at: float,
        beat: Mapping[str, Any] | None = None,
    ) -> XidRecord:
        """One fenced multi-op: compare-and-set the xid node (the small record; its chunks
        never change) and the ledger, and write the owner node with ``beat`` (as
        :meth:`heartbeat` would). The xid and ledger nodes this session read or wrote
        last are not read again: the transaction compares their versions."""
        path = self._xid_path(epoch.job, record.xid)
        ledger_path = self._ledger_path(epoch.job)
        epoch_path = self._epoch_path(epoch.job)
        owner_path = self._owner_path(epoch.job)
        # the owner node exists after the job's first beat (NoNode makes the next round
        # create it), at the version this session's last beat left if it is known (a
        # transaction of versioned writes only is cheaper on the KeeperMap store)
        known_owner = self._known.pop(owner_path, None)
        owner_exists, owner_version = True, -1 if known_owner is None else known_owner[1]

        def known() -> tuple[XidRecord, dict[str, Any], tuple[Any, int] | None] | None:
            """(stored record, its node, ledger (JSON, version) or None) as this session
            last saw them, if it saw both at the versions the transaction will compare."""
            node = self._known.pop(path, None)
            ledger = self._known.pop(ledger_path, None)
            if node is None or ledger is None or node[1] != record.version:
                return None
            return record, node[0], None if ledger[1] < 0 else ledger

        def read() -> tuple[XidRecord, dict[str, Any], tuple[Any, int] | None]:
            # both reads in flight at once (one statement on the KeeperMap store)
            ledger_asked = self._client.get_async(ledger_path)
            found = self._read_record(epoch.job, record.xid)
            if found is None or found[2].version != record.version:
                self._fence_now(epoch)
                raise RetryableConflict(f"xid {record.xid} changed under us; re-read and retry")
            ledger_found = self._conn.read_json(ledger_path, ledger_asked)
            ledger = None if ledger_found is None else (ledger_found[0], ledger_found[1].version)
            return found[0], found[1], ledger

        def attempt() -> XidRecord:
            nonlocal owner_exists, owner_version
            cur, node, ledger_found = known() or read()
            ledger = decode_ledger(None if ledger_found is None else ledger_found[0], ledger_path)
            try:
                done = committed_record(cur, ledger, committed_at, epoch.number)
            except ValueError:
                self._fence_now(epoch)
                raise
            data = encode(repack(done, node))
            ledger_data = encode(encode_ledger(next_ledger(ledger, cur, committed_at)))
            owner_data = b"" if beat is None else self._owner_data(epoch, beat)
            sizes = [(epoch_path, 0), (path, len(data)), (ledger_path, len(ledger_data))]
            if beat is not None:
                sizes.append((owner_path, len(owner_data)))
            check_request(f"commit {path}", sizes, self._acl_entries())

            def ops(txn: Any) -> None:
                txn.check(epoch_path, epoch.token)
                txn.set_data(path, data, version=record.version)
                if ledger_found is None:
                    txn.create(ledger_path, ledger_data, acl=self._conn.acl)
                else:
                    txn.set_data(ledger_path, ledger_data, version=ledger_found[1])
                if beat is not None and owner_exists:
                    txn.set_data(owner_path, owner_data, version=owner_version)
                elif beat is not None:
                    txn.create(owner_path, owner_data, acl=self._conn.acl)

            ok, results = self._conn.commit_txn(ops)
            if isinstance(results[0], Exception):
                self._raise_fenced(epoch)
            if ok:
                if beat is not None:
                    self._remember(owner_path, None, getattr(results[3], "version", 0))
                return replace(done, version=results[1].version)
            if isinstance(results[1], (BadVersionError, NoNodeError)):
                self._fence_now(epoch)
                raise RetryableConflict(f"xid {record.xid} changed under us; re-read and retry")
            if beat is not None and isinstance(
                results[3], (NoNodeError, NodeExistsError, BadVersionError)
            ):
                owner_exists = not isinstance(results[3], NoNodeError)
                owner_version = -1
                raise CasRetry  # the owner node is not (or no longer) as guessed
            if not isinstance(results[2], (BadVersionError, NodeExistsError, NoNodeError)):
                raise self._first_error(results)
            raise CasRetry  # only the ledger moved (another committer of this job)

        with self._conn.mapped(f"commit {path}"):
            return cas(f"job {epoch.job}: ledger {ledger_path}", attempt)

    @step
    def ledger(self, job: str) -> Ledger:
        path = self._ledger_path(job)
        with self._conn.mapped(f"read {path}"):
            return self._ledger_of(path, self._conn.read_json(path))

    def _ledger_of(self, path: str, found: tuple[dict[str, Any], Any] | None) -> Ledger:
        self._remember(path, *((None, -1) if found is None else (found[0], found[1].version)))
        return decode_ledger(None if found is None else found[0], path)

    @step
    def batch_view(self, job: str, xid: str) -> BatchView:
        """The epoch, the xid's record and the ledger: the three reads in flight at once."""
        epoch_path, path = self._epoch_path(job), self._xid_path(job, xid)
        ledger_path = self._ledger_path(job)
        with self._conn.mapped(f"read {path}"):
            asked = [self._client.get_async(p) for p in (epoch_path, path, ledger_path)]
            epoch = self._epoch_of(epoch_path, self._conn.read_json(epoch_path, asked[0]))
            found = self._read_record(job, xid, asked[1])
            if found is None:
                self._remember(path, None, ABSENT)
            ledger = self._ledger_of(ledger_path, self._conn.read_json(ledger_path, asked[2]))
        return BatchView(epoch, None if found is None else found[0], ledger)

    @step
    def delete(self, epoch: Epoch, xids: builtins.list[str]) -> None:
        """Delete records (fenced, in bounded multi-ops), then sweep every chunk node no
        record references: the deleted records' chunks and orphans of failed prepares."""
        epoch_path = self._epoch_path(epoch.job)
        paths = [self._xid_path(epoch.job, xid) for xid in xids]
        for path in paths:  # a record made again at version 0 is another node
            self._known.pop(path, None)
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
        def attempt() -> None:
            present = [
                p for p in paths if self._conn.wait(self._client.exists_async(p)) is not None
            ]

            def ops(txn: Any) -> None:
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
            raise CasRetry  # a node vanished between exists() and the delete

        cas(f"job {epoch.job}: xids (during delete)", attempt)
