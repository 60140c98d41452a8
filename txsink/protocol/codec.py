"""The one codec of txsink's persisted state: typed records <-> the JSON Keeper holds.

Owns the wire form of every node txsink writes (xid records and their manifest entries,
job meta, the ledger, dedup BEFORE/AFTER entries, epoch and owner nodes) and its format
version.
Pure: no I/O; :mod:`txsink.ports.manifest_codec` lays encoded records out in bounded
nodes, the registries send the bytes.

Versions (the ``"format"`` key, written on every node from format 1 on)::

    (none)  format 0: what every release before format versions wrote. Read exactly as
            those releases read it, so jobs in flight survive an upgrade.
    1       format 0 plus ``"format": 1`` (on xid records, job meta, the ledger, dedup
            entries, epoch and owner nodes). The wire layout is otherwise unchanged, so a
            release that predates versions still reads format 1 nodes (it ignores the
            key): a rolling upgrade (old and new drivers of one job) stays safe.

Rules every change of a node's layout follows:

- A new *fact* of an xid record (something a newer txsink learns and an older one may
  ignore) goes into ``extra``, the record's dict of facts. An older reader keeps facts
  it does not know (:attr:`XidRecord.unknown`) and writes them back unchanged with
  every rewrite (amend, commit, a tombstone's growth), so a newer writer's facts are
  never erased by an older one. Job meta and the ledger keep their unknown keys the same
  way (``unknown``). Dedup entries and owner nodes are never read-modify-written (every
  write replaces them whole), so they carry none.
- Anything an older reader must NOT ignore (a changed meaning, a new top-level key of an
  xid record, a manifest layout) bumps :data:`FORMAT`. A reader refuses a node of a
  newer format, or an enum value (state, mode, visibility) it does not know, with
  :class:`StateFormatTooNew` naming the node, never guessing.
- Decoding never invents a fact: a missing key reads as the default that release had.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from txsink.errors import TxSinkError
from txsink.protocol.dedup import PartitionState
from txsink.protocol.states import Cut, Mode, StagedPart, Visibility, XidRecord, XidState

FORMAT = 1
FORMAT_KEY = "format"

# Keys of an xid record's ``extra`` this release reads into typed fields.
_FACTS = frozenset({"tables", "visibility", "aborted_tables", "cut", "seq", "committed_epoch"})
_JOB_KEYS = frozenset(
    {"job", "target", "mode", "url", "staging_database", "query_id", "created_at", "targets",
     "shards", "mode_changed_at", FORMAT_KEY}
)  # fmt: skip


class StateFormatTooNew(TxSinkError):
    """A Keeper node was written by a newer txsink in a format this one cannot read (a
    newer format number, or, ``what`` given, an enum value this release does not know:
    never read as a default, a guessed visibility or mode could publish wrongly)."""

    def __init__(self, where: str, found: int, what: str = "") -> None:
        what = (
            what or f"is in state format {found}, newer than the format {FORMAT} this txsink reads"
        )
        super().__init__(
            f"Keeper node {where} {what}; nothing was changed. A newer txsink wrote it: "
            "upgrade txsink on this driver (and every tool that reads this job) to the "
            "release that wrote it, then run again",
            code=found,
        )
        self.where = where
        self.found = found


def check_format(data: Mapping[str, Any], where: str) -> int:
    """The node's format (0 when it has none); StateFormatTooNew when newer than ours."""
    raw = data.get(FORMAT_KEY, 0)
    if isinstance(raw, bool) or not isinstance(raw, int) or raw < 0:
        raise TxSinkError(
            f"Keeper node {where} says its state format is {raw!r}, not a version number: "
            "txsink did not write it this way. Nothing was changed; inspect the node (and "
            "who else writes under this Keeper root) before running again"
        )
    if raw > FORMAT:
        raise StateFormatTooNew(where, raw)
    return raw


# --------------------------------------------------------------------------- manifest


def encode_part(part: StagedPart) -> dict[str, Any]:
    """One manifest entry as an object (``uuids`` and ``target`` only when set)."""
    out: dict[str, Any] = {
        "table": part.table,
        "partition_id": part.partition_id,
        "rows": part.rows,
        "blocks": part.blocks,
        "fingerprint": part.fingerprint,
    }
    if part.uuids:
        out["uuids"] = ",".join(part.uuids)
    if part.target:
        out["target"] = part.target
    return out


def decode_part(data: Mapping[str, Any]) -> StagedPart:
    raw = data.get("uuids") or ""
    ids = raw.split(",") if isinstance(raw, str) else [str(u) for u in raw]
    return StagedPart(
        table=str(data["table"]),
        partition_id=str(data["partition_id"]),
        rows=int(data["rows"]),
        blocks=int(data.get("blocks", 0)),
        fingerprint=str(data.get("fingerprint", "")),
        uuids=tuple(u for u in ids if u),
        target=str(data.get("target") or ""),
    )


# --------------------------------------------------------------------------- xid records


def _encode_facts(record: XidRecord) -> dict[str, Any]:
    """The record's ``extra``: its typed facts in their format-0 keys, then the facts of
    a newer writer it carries unchanged."""
    facts: dict[str, Any] = dict(record.unknown)
    if record.tables:
        facts["tables"] = list(record.tables)
    if record.visibility is not Visibility.PARTITION:
        facts["visibility"] = record.visibility.value
    if record.aborted_tables:
        facts["aborted_tables"] = sorted(record.aborted_tables)
    if record.cuts:
        facts["cut"] = {c.key: dict(c.parts) for c in record.cuts}
    if record.seq is not None:
        facts["seq"] = record.seq
    if record.committed_epoch is not None:
        facts["committed_epoch"] = record.committed_epoch
    return facts


def encode_record(record: XidRecord) -> dict[str, Any]:
    """The xid node's JSON (manifest inline; the node layout is manifest_codec's)."""
    return {
        FORMAT_KEY: FORMAT,
        "job": record.job,
        "xid": record.xid,
        "batch": record.batch,
        "state": record.state.value,
        "epoch": record.epoch,
        "mode": record.mode.value,
        "target": record.target,
        "manifest": [encode_part(p) for p in record.manifest],
        "rows": record.rows,
        "created_at": record.created_at,
        "committed_at": record.committed_at,
        "extra": _encode_facts(record),
    }


def _decode_cuts(raw: Any) -> tuple[Cut, ...]:
    cuts = []
    for key, parts in dict(raw or {}).items():
        # Staging names never contain a slash (the partition id may come after it).
        staging, _, pid = str(key).partition("/")
        cuts.append(Cut(staging, pid, {str(u): int(n) for u, n in dict(parts).items()}))
    return tuple(sorted(cuts, key=lambda c: c.key))


_E = TypeVar("_E", bound=enum.Enum)


def _known(kind: type[_E], raw: Any, name: str, where: str) -> _E:
    try:
        return kind(raw)
    except ValueError:
        known = ", ".join(repr(m.value) for m in kind)
        what = f"has {name} {raw!r}, which this txsink does not know (it knows {known})"
        raise StateFormatTooNew(where, FORMAT, what) from None


def decode_record(data: Mapping[str, Any], version: int = -1, where: str = "") -> XidRecord:
    """The XidRecord of an xid node's JSON (manifest inline), ``version`` its Keeper node
    version. KeyError/ValueError/TypeError for a damaged node (the caller names it)."""
    where = where or f"xids/{data.get('xid', '?')}"
    check_format(data, where)
    facts = dict(data.get("extra") or {})
    seq, committed_epoch = facts.get("seq"), facts.get("committed_epoch")
    return XidRecord(
        job=str(data["job"]),
        xid=str(data["xid"]),
        batch=None if data.get("batch") is None else int(data["batch"]),
        state=_known(XidState, data["state"], "state", where),
        epoch=int(data["epoch"]),
        mode=_known(Mode, data.get("mode", "attach"), "mode", where),
        target=str(data.get("target", "")),
        manifest=tuple(decode_part(p) for p in data.get("manifest", [])),
        created_at=float(data.get("created_at", 0.0)),
        committed_at=None if data.get("committed_at") is None else float(data["committed_at"]),
        version=version,
        tables=tuple(str(t) for t in facts.get("tables") or ()),
        visibility=_known(
            Visibility, facts.get("visibility") or Visibility.PARTITION.value, "visibility", where
        ),
        aborted_tables=frozenset(str(t) for t in facts.get("aborted_tables") or ()),
        cuts=_decode_cuts(facts.get("cut")),
        seq=None if seq is None else int(seq),
        committed_epoch=None if committed_epoch is None else int(committed_epoch),
        unknown={k: v for k, v in facts.items() if k not in _FACTS},
    )


# --------------------------------------------------------------------------- job meta


@dataclass(frozen=True)
class JobMeta:
    """The job node: what the job writes and how; fixed by its first run (identity).

    ``targets``: every table of a :func:`txsink.transaction` job and its pinned mode
    (empty for a job of one table, whose ``target`` and ``mode`` say it). ``shards``:
    the shard URLs of a sharded job. No credential is ever stored here (Keeper nodes are
    world-readable): ``url`` is without userinfo.
    """

    target: str = ""
    mode: str = ""
    job: str = ""
    url: str = ""
    staging_database: str = ""
    query_id: str = ""
    created_at: float = 0.0
    targets: Mapping[str, str] = field(default_factory=dict)
    shards: tuple[str, ...] = ()
    mode_changed_at: float | None = None
    unknown: Mapping[str, Any] = field(default_factory=dict)

    @property
    def pinned_mode(self) -> Mode | None:
        """The job's mode as pinned by its first run, None when not pinned (yet)."""
        return Mode(self.mode) if self.mode in {m.value for m in Mode} else None

    @property
    def blank(self) -> bool:
        """Whether nothing at all is recorded (a job created without meta)."""
        return self == JobMeta()

    @property
    def tables(self) -> list[str]:
        """Every table the job writes: its ``targets`` or its one ``target``."""
        if self.targets:
            return sorted(self.targets)
        return [self.target] if self.target else []


def encode_job_meta(meta: JobMeta) -> dict[str, Any]:
    out: dict[str, Any] = {**meta.unknown, FORMAT_KEY: FORMAT}
    out.update(
        job=meta.job,
        target=meta.target,
        mode=meta.mode,
        url=meta.url,
        staging_database=meta.staging_database,
        query_id=meta.query_id,
        created_at=meta.created_at,
    )
    if meta.targets:
        out["targets"] = dict(sorted(meta.targets.items()))
    if meta.shards:
        out["shards"] = list(meta.shards)
    if meta.mode_changed_at is not None:
        out["mode_changed_at"] = meta.mode_changed_at
    return out


def decode_job_meta(data: Mapping[str, Any] | None, where: str = "job meta") -> JobMeta | None:
    """The typed job meta of a job node (None: no meta stored)."""
    if data is None:
        return None
    check_format(data, where)
    targets = data.get("targets")
    changed = data.get("mode_changed_at")
    return JobMeta(
        target=str(data.get("target") or ""),
        mode=str(data.get("mode") or ""),
        job=str(data.get("job") or ""),
        url=str(data.get("url") or ""),
        staging_database=str(data.get("staging_database") or ""),
        query_id=str(data.get("query_id") or ""),
        created_at=float(data.get("created_at") or 0.0),
        targets={str(k): str(v) for k, v in targets.items()} if isinstance(targets, dict) else {},
        shards=tuple(str(u) for u in data.get("shards") or ()),
        mode_changed_at=None if changed is None else float(changed),
        unknown={k: v for k, v in data.items() if k not in _JOB_KEYS},
    )


def as_job_meta(
    meta: JobMeta | Mapping[str, Any] | None, where: str = "job meta"
) -> JobMeta | None:
    """``meta`` typed: a JobMeta as it is, a job node's mapping decoded, None as None."""
    if meta is None or isinstance(meta, JobMeta):
        return meta
    return decode_job_meta(meta, where)


# --------------------------------------------------------------------------- the ledger


@dataclass(frozen=True)
class Ledger:
    """A job's ledger: exact totals of everything it ever committed, in one bounded node
    (its layout and arithmetic: :mod:`txsink.ports.ledger`).

    ``key_prefix`` is never stored: a one-table view of a multi-table ledger
    (:func:`txsink.ports.ledger.table_view`) names the prefix of that table's keys.
    """

    seq: int = 0
    committed: int = 0
    rows: int = 0
    last_batch: int | None = None
    last_commit_at: float | None = None
    partitions: Mapping[str, int] = field(default_factory=dict)
    partition_seq: Mapping[str, int] = field(default_factory=dict)
    partial: tuple[str, ...] = ()
    evicted_partitions: int = 0
    evicted_rows: int = 0
    evicted_filter: str = ""
    shards: Mapping[str, int] = field(default_factory=dict)
    tables: Mapping[str, int] = field(default_factory=dict)
    evicted_tables: Mapping[str, int] = field(default_factory=dict)
    key_prefix: str = ""
    unknown: Mapping[str, Any] = field(default_factory=dict)


_LEDGER_KEYS = frozenset(
    {
        "seq",
        "committed",
        "rows",
        "last_batch",
        "last_commit_at",
        "partitions",
        "partition_seq",
        "partial",
        "evicted_partitions",
        "evicted_rows",
        "evicted_filter",
        "shards",
        "tables",
        "evicted_tables",
        "key_prefix",
        FORMAT_KEY,
    }
)


def encode_ledger(ledger: Ledger) -> dict[str, Any]:
    """The ledger node: format-0 keys (``shards``/``tables``/``evicted_tables`` if any)."""
    out: dict[str, Any] = {**ledger.unknown, FORMAT_KEY: FORMAT}
    out.update(
        seq=ledger.seq,
        committed=ledger.committed,
        rows=ledger.rows,
        last_batch=ledger.last_batch,
        last_commit_at=ledger.last_commit_at,
        partitions=dict(ledger.partitions),
        partition_seq=dict(ledger.partition_seq),
        partial=list(ledger.partial),
        evicted_partitions=ledger.evicted_partitions,
        evicted_rows=ledger.evicted_rows,
        evicted_filter=ledger.evicted_filter,
    )
    for key in ("tables", "shards", "evicted_tables"):
        if getattr(ledger, key):
            out[key] = dict(getattr(ledger, key))
    return out


def _counts(raw: Any) -> dict[str, int]:
    return {str(k): int(v) for k, v in dict(raw or {}).items()}


def decode_ledger(data: Mapping[str, Any] | None, where: str = "ledger") -> Ledger:
    """The ledger of a ledger node (the empty ledger when there is none). Ledgers written
    before ``partition_seq`` existed read with an empty one (every id at seq 0)."""
    if not data:
        return Ledger()
    check_format(data, where)
    last_batch, last_at = data.get("last_batch"), data.get("last_commit_at")
    return Ledger(
        seq=int(data.get("seq") or 0),
        committed=int(data.get("committed") or 0),
        rows=int(data.get("rows") or 0),
        last_batch=None if last_batch is None else int(last_batch),
        last_commit_at=None if last_at is None else float(last_at),
        partitions=_counts(data.get("partitions")),
        partition_seq=_counts(data.get("partition_seq")),
        partial=tuple(str(p) for p in data.get("partial") or ()),
        evicted_partitions=int(data.get("evicted_partitions") or 0),
        evicted_rows=int(data.get("evicted_rows") or 0),
        evicted_filter=str(data.get("evicted_filter") or ""),
        shards=_counts(data.get("shards")),
        tables=_counts(data.get("tables")),
        evicted_tables=_counts(data.get("evicted_tables")),
        key_prefix=str(data.get("key_prefix") or ""),
        unknown={k: v for k, v in data.items() if k not in _LEDGER_KEYS},
    )


def as_ledger(ledger: Ledger | Mapping[str, Any] | None) -> Ledger:
    """``ledger`` typed: a Ledger as it is, a ledger node's mapping decoded."""
    return ledger if isinstance(ledger, Ledger) else decode_ledger(ledger)


# --------------------------------------------------------------------------- small nodes


#: owner-node key: the seconds within which a writer in the middle of a commit promises
#: its next heartbeat (txsink.ops.liveness judges such a writer by it)
BEAT_KEY = "beat_s"
#: owner-node key: the longest one statement of the writer's publish may run without a
#: beat (its client's send_receive_timeout + connect_timeout): liveness allows it
WAIT_KEY = "wait_s"
#: owner states after a commit: a stream between batches; a batch write that is done
IDLE_STATE = "idle"
FINISHED_STATE = "finished"


@dataclass(frozen=True)
class OwnerInfo:
    """The owner node: who holds the job's epoch and when it last said so. ``state``
    (running, publishing, idle, finished, recovering, mode-change, ...) and the other
    keys are what the owner chose to report (``details``), among them the declared
    heartbeat interval (:data:`BEAT_KEY`, :attr:`beat_s`)."""

    epoch: int | None
    owner: str
    heartbeat: float | None
    state: str = ""
    details: Mapping[str, Any] = field(default_factory=dict)

    @property
    def beat_s(self) -> float | None:
        """The heartbeat interval the owner declared with its last beat (None: none)."""
        return _seconds(self.details.get(BEAT_KEY))

    @property
    def wait_s(self) -> float | None:
        """The longest statement wait the owner declared (None: none)."""
        return _seconds(self.details.get(WAIT_KEY))


def _seconds(raw: Any) -> float | None:
    try:
        return None if raw is None else float(raw)
    except (TypeError, ValueError):
        return None


def encode_owner(info: OwnerInfo) -> dict[str, Any]:
    out: dict[str, Any] = {**info.details, FORMAT_KEY: FORMAT}
    out.update(epoch=info.epoch, owner=info.owner, heartbeat=info.heartbeat)
    if info.state:
        out["state"] = info.state
    return out


def decode_owner(data: Mapping[str, Any] | None, where: str = "owner") -> OwnerInfo | None:
    if data is None:
        return None
    check_format(data, where)
    known = {"epoch", "owner", "heartbeat", "state", FORMAT_KEY}
    epoch, beat = data.get("epoch"), data.get("heartbeat")
    return OwnerInfo(
        epoch=None if epoch is None else int(epoch),
        owner=str(data.get("owner") or ""),
        heartbeat=None if beat is None else float(beat),
        state=str(data.get("state") or ""),
        details={k: v for k, v in data.items() if k not in known},
    )


def as_owner(owner: OwnerInfo | Mapping[str, Any] | None) -> OwnerInfo | None:
    """``owner`` typed: an OwnerInfo as it is, an owner node's mapping decoded."""
    return owner if owner is None or isinstance(owner, OwnerInfo) else decode_owner(owner)


def encode_epoch_node(number: int, owner: str, since: float) -> dict[str, Any]:
    """The epoch node (its Keeper node version is the fencing token, not stored)."""
    return {FORMAT_KEY: FORMAT, "epoch": number, "owner": owner, "since": since}


def decode_epoch_node(data: Mapping[str, Any], where: str = "epoch") -> tuple[int, str]:
    """(epoch number, owner) of an epoch node."""
    check_format(data, where)
    return int(data.get("epoch") or 0), str(data.get("owner") or "")


def encode_partition_state(state: PartitionState) -> dict[str, Any]:
    """A dedup-mode BEFORE/AFTER entry (keys: :mod:`txsink.protocol.dedup`'s). Never
    amended: every write replaces it whole (with a state
    :func:`~txsink.protocol.dedup.check_successor` allowed), so it carries no facts of a
    newer writer; a layout an older writer must not overwrite bumps :data:`FORMAT`."""
    return with_format(state.to_json())


def decode_partition_state(
    data: Mapping[str, Any] | None, where: str = "dedup entry"
) -> PartitionState | None:
    """The entry of a dedup node (None: no entry)."""
    if not data:
        return None
    return PartitionState.from_json(without_format(data, where))


def with_format(data: Mapping[str, Any]) -> dict[str, Any]:
    """``data`` (a node whose keys another module owns) stamped with the current format."""
    return {**data, FORMAT_KEY: FORMAT}


def without_format(data: Mapping[str, Any], where: str) -> dict[str, Any]:
    """``data`` checked (StateFormatTooNew) and without its format key."""
    check_format(data, where)
    return {k: v for k, v in data.items() if k != FORMAT_KEY}
