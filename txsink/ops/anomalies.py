"""The rules ``txsink verify`` applies to a job's committed history (pure): the order of
consecutive committed batch xids (backward, overlap, gap) and PREPARED xids nobody
published; and the findings and result types the audit reports them in. See
:mod:`txsink.ops.verify` for the audit that gathers the records.

Retention prunes the oldest COMMITTED records, so only pairs inside the retained history
are checked; ad-hoc ``u...`` xids (batch saves without txn_version) have no order and are
exempt.
"""

from __future__ import annotations

import itertools
import logging
import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from txsink.protocol.states import XidRecord, XidState

log = logging.getLogger(__name__)

DEFAULT_STUCK_AFTER = 300.0
DEFAULT_RECENT = 20
_BATCH_XID = re.compile(r"^b(\d+)$")


@dataclass(frozen=True)
class Finding:
    """One anomaly or warning; ``xids``/``batches``/``partition`` name what is involved."""

    kind: str
    message: str
    xids: tuple[str, ...] = ()
    batches: tuple[int, ...] = ()
    partition: str | None = None

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["xids"], data["batches"] = list(self.xids), list(self.batches)
        return data


@dataclass
class VerifyResult:
    job: str
    target: str
    anomalies: list[Finding] = field(default_factory=list)
    warnings: list[Finding] = field(default_factory=list)
    checked: dict[str, Any] = field(default_factory=dict)

    @property
    def clean(self) -> bool:
        return not self.anomalies

    def to_json(self) -> dict[str, Any]:
        return {
            "job": self.job,
            "target": self.target,
            "clean": self.clean,
            "anomalies": [a.to_json() for a in self.anomalies],
            "warnings": [w.to_json() for w in self.warnings],
            # per-table checks as a list: a table's name is data, never a JSON key
            "checked": {
                **self.checked,
                **(
                    {"tables": [{"table": t, **c} for t, c in self.checked["tables"].items()]}
                    if "tables" in self.checked
                    else {}
                ),
            },
        }


# --------------------------------------------------------------------------- history


def _seq(record: XidRecord) -> int | None:
    return record.seq


def committed_history(records: Iterable[XidRecord]) -> list[XidRecord]:
    """COMMITTED records in commit order: by ``seq`` (commit time breaks ties and
    places records without a sequence, which only a hand-edited history has)."""
    done = [r for r in records if r.state is XidState.COMMITTED]
    return sorted(
        done,
        key=lambda r: (
            _seq(r) is None,
            _seq(r) or 0,
            r.committed_at or 0.0,
            r.xid,
        ),
    )


def batch_of(record: XidRecord) -> int | None:
    """The batch a batch-id xid claims (its recorded batch); None for ad-hoc xids."""
    m = _BATCH_XID.match(record.xid)
    if not m:
        return None
    return record.batch if record.batch is not None else int(m.group(1))


def _ref(record: XidRecord) -> str:
    seq = _seq(record)
    return f"xid {record.xid} (seq {seq if seq is not None else '?'})"


def detect_anomalies(records: Iterable[XidRecord], *, contiguous: bool = True) -> list[Finding]:
    """Backward, overlap and gap anomalies of a job's committed history (pure).

    ``contiguous``: batch ids are Spark micro-batch ids, which grow by one. Batch saves
    with ``txn_version`` (no streaming query id in the job meta) may skip versions, so
    gaps are not anomalies there.
    """
    history = committed_history(records)
    found: list[Finding] = []
    seqs: dict[int, list[XidRecord]] = {}
    for r in history:
        seq = _seq(r)
        if seq is not None:
            seqs.setdefault(seq, []).append(r)
    for seq, same in sorted(seqs.items()):
        if len(same) > 1:
            xids = tuple(r.xid for r in same)
            found.append(
                Finding(
                    "sequence",
                    f"sequence: commit seq {seq} was given to {len(same)} xids "
                    f"({', '.join(xids)}); "
                    "the ledger counted one commit for several records",
                    xids=xids,
                )
            )
    ordered = [(r, b) for r in history if (b := batch_of(r)) is not None]
    claims: dict[int, list[XidRecord]] = {}
    for r, b in ordered:
        claims.setdefault(b, []).append(r)
    for b, owners in sorted(claims.items()):
        if len(owners) > 1:
            found.append(
                Finding(
                    "overlap",
                    f"overlap: batch {b} was committed {len(owners)} times, by "
                    + ", ".join(_ref(r) for r in owners)
                    + ": its rows were published more than once",
                    xids=tuple(r.xid for r in owners),
                    batches=(b,),
                )
            )
    for (m, mb), (n, nb) in itertools.pairwise(ordered):
        if nb < mb:
            found.append(
                Finding(
                    "backward",
                    f"backward: batch {nb} ({_ref(n)}) was committed after batch {mb} ({_ref(m)})",
                    xids=(m.xid, n.xid),
                    batches=(mb, nb),
                )
            )
        elif nb > mb + 1 and contiguous:
            missing = f"{mb + 1}" if nb == mb + 2 else f"{mb + 1}..{nb - 1}"
            found.append(
                Finding(
                    "gap",
                    f"gap: batch(es) {missing} never committed between batch {mb} ({_ref(m)}) "
                    f"and batch {nb} ({_ref(n)})",
                    xids=(m.xid, n.xid),
                    batches=(mb, nb),
                )
            )
    return found


def stuck_prepared(
    records: Iterable[XidRecord], now: float, older_than: float = DEFAULT_STUCK_AFTER
) -> list[Finding]:
    """PREPARED xids older than ``older_than`` seconds: rows no one has published."""
    out = []
    for r in records:
        if r.state is XidState.PREPARED and now - r.created_at > older_than:
            out.append(
                Finding(
                    "stuck-prepared",
                    f"stuck-prepared: xid {r.xid} (batch {r.batch}, {r.rows} rows) of job {r.job} "
                    f"has been PREPARED for {now - r.created_at:.0f}s; run "
                    f"`txsink recover --job {r.job}`",
                    xids=(r.xid,),
                    batches=() if r.batch is None else (r.batch,),
                )
            )
    return out
