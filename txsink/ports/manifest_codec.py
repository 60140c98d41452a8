"""How an :class:`~txsink.protocol.states.XidRecord` is laid out in bounded Keeper nodes.

Pure (no kazoo): both registries store records through these functions, so the in-memory
twin and ZooKeeper hold byte-for-byte the same nodes.

ZooKeeper refuses any request larger than ``jute.maxbuffer`` (1 MiB - 1 byte by default;
the whole multi-op counts) by closing the connection: the client sees ``ConnectionLoss``,
which txsink must read as "outcome unknown". Checked on this machine's ZooKeeper 3.8.0:
a 1,048,475-byte create lands, a 1,048,575-byte one closes the session's socket ("Len
error ... greater than jute.maxbuffer=1048575" in the server log). So nothing larger may
ever be sent: :func:`check_request` estimates every write before it goes out and raises
:class:`~txsink.errors.KeeperRequestTooLarge` instead.

An xid node holds the record's JSON (:func:`txsink.protocol.codec.encode_record`), either

- whole, manifest inline as a list of entry objects (the layout every txsink version
  reads), when that JSON is at most ``INLINE_MANIFEST_BYTES``; or
- with ``"manifest_chunks"``: ``{"nonce", "count", "bytes", "sha256", "entries"}``, a
  reference to ``count`` chunk nodes ``<job>/manifests/<xid>.<nonce>.<i>``, each at most
  ``CHUNK_BYTES`` of the zlib-compressed compact manifest (:func:`encode_manifest`).
  ``sha256`` covers the concatenated chunks, ``entries`` the decoded entry count: reads
  verify both and fail loudly on any difference. ``"manifest"`` then holds a non-list
  (``CHUNKED_SENTINEL``), so that an older txsink fails on it instead of reading an empty
  manifest and publishing nothing.

Invariants the registries keep with this layout: chunks are written (each its own small
request) BEFORE the fenced multi-op that creates the xid node, and that multi-op also
checks that every chunk still exists, so a record whose chunks are missing cannot be
created; a chunk set no record references is an orphan, never read as a record, and is
swept by ``delete`` (prune, recovery); deleting a record deletes its chunks.
"""

from __future__ import annotations

import hashlib
import json
import os
import zlib
from dataclasses import dataclass, replace
from typing import Any

from txsink.errors import KeeperRequestTooLarge, TxSinkError
from txsink.protocol.codec import check_format, decode_record, encode_record
from txsink.protocol.states import StagedPart, XidRecord

# ZooKeeper's default jute.maxbuffer: the largest request (packet) the server accepts.
KEEPER_MAX_REQUEST = 1024 * 1024 - 1
# A compact manifest up to this size stays inline in the xid node (one request).
INLINE_MANIFEST_BYTES = 64 * 1024
# Chunk nodes hold at most this many bytes of compressed manifest.
CHUNK_BYTES = 256 * 1024
# At most this many chunks per record (16 MiB compressed): beyond it, prepare refuses.
MAX_CHUNKS = 64
# Bytes of request framing per op (header, lengths, flags, version) and per ACL entry;
# both over-estimates of the jute encoding (measured: 47 bytes for a create, 60 per op
# in a multi, with the world ACL).
OP_OVERHEAD = 96
ACL_OVERHEAD = 160

CHUNKS_DIR = "manifests"
NODE_CHUNKS = "manifest_chunks"
CHUNKED_SENTINEL = {"stored_in": CHUNKS_DIR}


def _dumps(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


# --------------------------------------------------------------------------- request size


def request_size(ops: list[tuple[str, int]], acl_entries: int = 1) -> int:
    """An upper estimate of one Keeper request's size: ``ops`` as (path, data bytes)."""
    per_op = OP_OVERHEAD + ACL_OVERHEAD * max(1, acl_entries)
    return 64 + sum(per_op + len(path.encode()) + data for path, data in ops)


def check_request(what: str, ops: list[tuple[str, int]], acl_entries: int = 1) -> int:
    """Raise :class:`KeeperRequestTooLarge` if the request would exceed ZooKeeper's limit."""
    size = request_size(ops, acl_entries)
    if size > KEEPER_MAX_REQUEST:
        raise KeeperRequestTooLarge(
            f"Keeper request for {what} would be about {size} bytes, over ZooKeeper's "
            f"limit of {KEEPER_MAX_REQUEST} bytes (jute.maxbuffer, the whole multi-op "
            "counts); nothing was sent. The server would drop the connection instead of "
            "answering. Write smaller batches (fewer Spark partitions or target partitions "
            "per batch); see docs/operations.md#keeper-limits",
            code=size,
        )
    return size


# --------------------------------------------------------------------------- manifests


def _common_prefix(names: list[str]) -> str:
    """The longest string every name starts with (characters, not path components)."""
    lo, hi = min(names), max(names)
    n = 0
    while n < min(len(lo), len(hi)) and lo[n] == hi[n]:
        n += 1
    return lo[:n]


def encode_manifest(manifest: tuple[StagedPart, ...]) -> dict[str, Any]:
    """The compact form: table names' common prefix once, then runs of consecutive
    entries of one staging table as ``[table suffix, [[pid, rows(, blocks(, fingerprint
    (, uuids)))], ...](, target)]``: ``uuids`` comma-joined (evidence of publish), and
    ``target`` only for entries of another table than the record's (a multi-table xid;
    one staging table always belongs to one target). Order is kept exactly, so decoding
    gives an equal manifest."""
    tables = [p.table for p in manifest]
    prefix = _common_prefix(tables) if len(set(tables)) > 1 else ""
    runs: list[list[Any]] = []
    for p in manifest:
        entry: list[Any] = [p.partition_id, p.rows]
        if p.blocks or p.fingerprint or p.uuids:
            entry.append(p.blocks)
        if p.fingerprint or p.uuids:
            entry.append(p.fingerprint)
        if p.uuids:
            entry.append(",".join(p.uuids))
        suffix = p.table[len(prefix) :]
        target = runs[-1][2] if runs and len(runs[-1]) > 2 else ""
        if runs and runs[-1][0] == suffix and target == p.target:
            runs[-1][1].append(entry)
        else:
            runs.append([suffix, [entry], p.target] if p.target else [suffix, [entry]])
    return {"prefix": prefix, "runs": runs, "entries": len(manifest)}


def decode_manifest(data: dict[str, Any]) -> list[dict[str, Any]]:
    """Entry objects (:func:`~txsink.protocol.codec.encode_part` form) of a compact manifest."""
    prefix = str(data.get("prefix", ""))
    out: list[dict[str, Any]] = []
    for run in data["runs"]:
        suffix, entries = run[0], run[1]
        target = str(run[2]) if len(run) > 2 else ""
        for e in entries:
            entry = {
                "table": prefix + suffix,
                "partition_id": e[0],
                "rows": e[1],
                "blocks": e[2] if len(e) > 2 else 0,
                "fingerprint": e[3] if len(e) > 3 else "",
            }
            if len(e) > 4 and e[4]:
                entry["uuids"] = e[4]
            if target:
                entry["target"] = target
            out.append(entry)
    if len(out) != int(data.get("entries", len(out))):
        raise ValueError(f"holds {len(out)} manifest entries, its header says {data['entries']}")
    return out


@dataclass(frozen=True)
class ChunkRef:
    """What an xid node says about its chunk nodes."""

    nonce: str
    count: int
    bytes: int
    sha256: str
    entries: int

    def to_json(self) -> dict[str, Any]:
        return {
            "nonce": self.nonce,
            "count": self.count,
            "bytes": self.bytes,
            "sha256": self.sha256,
            "entries": self.entries,
        }

    @staticmethod
    def from_json(data: dict[str, Any]) -> ChunkRef:
        return ChunkRef(
            str(data["nonce"]),
            int(data["count"]),
            int(data["bytes"]),
            str(data["sha256"]),
            int(data["entries"]),
        )

    def names(self, xid: str) -> list[str]:
        return [chunk_name(xid, self.nonce, i) for i in range(self.count)]


def chunk_name(xid: str, nonce: str, index: int) -> str:
    return f"{xid}.{nonce}.{index}"


def parse_chunk_name(name: str) -> tuple[str, str, int] | None:
    """(xid, nonce, index) of a chunk node name; None for anything else."""
    parts = name.rsplit(".", 2)
    if len(parts) != 3 or not parts[2].isdigit() or not parts[1].isalnum():
        return None
    return parts[0], parts[1], int(parts[2])


def new_nonce() -> str:
    return os.urandom(6).hex()


@dataclass(frozen=True)
class PackedRecord:
    """An xid node's JSON and the chunk payloads (in order) it references, if any."""

    node: dict[str, Any]
    chunks: tuple[bytes, ...] = ()
    ref: ChunkRef | None = None

    def named_chunks(self, xid: str) -> list[tuple[str, bytes]]:
        """(chunk node name, payload) in order; empty for an inline manifest."""
        if self.ref is None:
            return []
        return list(zip(self.ref.names(xid), self.chunks, strict=True))


def _record_node(record: XidRecord) -> dict[str, Any]:
    """``encode_record(record)`` without its manifest (a copy, as JSON keeps it)."""
    node: dict[str, Any] = json.loads(_dumps(encode_record(replace(record, manifest=()))))
    node["rows"] = record.rows
    del node["manifest"]
    return node


def pack_record(
    record: XidRecord,
    nonce: str,
    *,
    inline_bytes: int = INLINE_MANIFEST_BYTES,
    chunk_bytes: int = CHUNK_BYTES,
) -> PackedRecord:
    """Lay ``record`` out as an xid node plus chunks (none if the manifest fits inline)."""
    compact = _dumps(encode_manifest(record.manifest))
    if len(compact) <= inline_bytes:
        legacy: dict[str, Any] = json.loads(_dumps(encode_record(record)))
        if len(_dumps(legacy)) <= inline_bytes:
            return PackedRecord(legacy)  # readable by every txsink version and by tools
    node = _record_node(record)
    # Older txsink versions would read a missing manifest as an empty one and publish
    # nothing; a non-list makes them fail loudly instead.
    node["manifest"] = CHUNKED_SENTINEL
    payload = zlib.compress(compact, 6)
    chunks = tuple(payload[i : i + chunk_bytes] for i in range(0, len(payload), chunk_bytes))
    if len(chunks) > MAX_CHUNKS:
        raise KeeperRequestTooLarge(
            f"xid {record.xid} of job {record.job}: its manifest of {len(record.manifest)} "
            f"entries compresses to {len(payload)} bytes, over txsink's limit of "
            f"{MAX_CHUNKS} Keeper chunks of {chunk_bytes} bytes; nothing was prepared. "
            "Write smaller batches (fewer Spark partitions or target partitions per batch); "
            "see docs/operations.md#keeper-limits",
            code=len(payload),
        )
    ref = ChunkRef(
        nonce, len(chunks), len(payload), hashlib.sha256(payload).hexdigest(), len(record.manifest)
    )
    node[NODE_CHUNKS] = ref.to_json()
    return PackedRecord(node, chunks, ref)


def repack(record: XidRecord, stored_node: dict[str, Any]) -> dict[str, Any]:
    """The node of ``record`` (a new state of a stored one) keeping ``stored_node``'s
    manifest storage as it is: a commit rewrites the small record, never the chunks."""
    node = _record_node(record)
    for key in (NODE_CHUNKS, "manifest"):
        if key in stored_node:
            node[key] = stored_node[key]
    return node


def chunk_ref(node: dict[str, Any]) -> ChunkRef | None:
    raw = node.get(NODE_CHUNKS)
    return None if raw is None else ChunkRef.from_json(raw)


def unpack_record(
    node: dict[str, Any], chunks: list[bytes] | None, version: int, where: str
) -> XidRecord:
    """The XidRecord of an xid node (and its chunks, in order, if it references any).

    Raises :class:`TxSinkError` naming ``where`` if the chunks do not match the reference
    (missing, extra, corrupt): a record is never guessed from partial data.
    """
    # A newer format may lay chunks out differently: refuse before reading them.
    check_format(node, where)
    data = dict(node)
    ref = chunk_ref(node)
    try:
        if ref is not None:
            got = list(chunks or [])
            payload = b"".join(got)
            same = hashlib.sha256(payload).hexdigest() == ref.sha256
            if len(got) != ref.count or not same:
                raise ValueError(
                    f"{len(got)} of {ref.count} chunk(s) found, checksum "
                    f"{'matches' if same else 'differs'}"
                )
            compact = json.loads(zlib.decompress(payload).decode())
            data["manifest"] = decode_manifest(compact)
            if len(data["manifest"]) != ref.entries:
                raise ValueError(f"{len(data['manifest'])} entries, expected {ref.entries}")
        data.pop(NODE_CHUNKS, None)
        return decode_record(data, version, where)
    except (ValueError, KeyError, TypeError, IndexError, zlib.error) as exc:
        raise TxSinkError(
            f"Keeper record {where} cannot be read: its manifest is damaged ({exc}); "
            "nothing was published from it. Do not delete it: inspect the record and its "
            f"chunk nodes under {CHUNKS_DIR}/ and see docs/operations.md#keeper-limits"
        ) from exc
