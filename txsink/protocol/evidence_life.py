"""How long the evidence of a publish survives, and when a resumed publish can no longer
trust what it does not see (docs/operations.md#late-restart).

A resumed publish reads "not in the target" as "not published": the part UUIDs a MOVE or
an ATTACH put in the target, and the ATTACH's line in ``system.query_log``. Absence only
proves something while that evidence cannot have been erased since the PREPARE:

- part UUIDs: a merge in the target replaces the parts; the replaced ones stay visible
  (outdated) for ``old_parts_lifetime`` seconds, and a server that loads the table (a
  restart) drops them at once. A MOVE cut between parts needs a server crash, so with no
  restart since the PREPARE there is no cut to repair; with one, the cut parts reached
  the target after the PREPARE, so none of them can have been merged *and* cleaned up
  before the record is ``old_parts_lifetime`` old (one restart; a second restart after
  a merge drops them sooner: the window left, in the docs);
- the query log: its TTL deletes the ATTACH's line (an ``event_date`` TTL may do so a
  day early).

Owned here: :class:`EvidenceLife` (what the Warehouse reads, with the record's age the
runner adds) and the two verdicts. Pure; the clocks are the preparing and the resuming
writer's (:data:`CLOCK_SKEW_S` apart at most), the durations the server's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from txsink.protocol.ops import Alarm, AttachAll, Operation, Publish

# How far two writers' clocks (the one that stamped created_at, the one that reads its
# age) may disagree; every comparison leans the safe way by this much.
CLOCK_SKEW_S = 2.0


@dataclass(frozen=True)
class EvidenceLife:
    """What decides whether evidence of a publish may have been erased.

    ``uptime_s``: seconds since the server (the one holding the target) started;
    ``parts_lifetime_s``: the target's effective ``old_parts_lifetime``;
    ``query_log_ttl_s``: the least time a ``system.query_log`` line survives (None: no
    TTL; 0: a TTL txsink cannot read); ``age_s``: the record's age (since its
    ``created_at``), filled in by the runner."""

    uptime_s: float
    parts_lifetime_s: float
    query_log_ttl_s: float | None = None
    age_s: float = 0.0

    @property
    def restarted_since_prepare(self) -> bool:
        """The server may have started after the PREPARE (leaning towards yes)."""
        return self.uptime_s < self.age_s + CLOCK_SKEW_S

    @property
    def parts_may_be_gone(self) -> bool:
        """Parts a cut MOVE or an ATTACH put in the target after the PREPARE may have been
        merged away and cleaned up by now."""
        return self.age_s + CLOCK_SKEW_S >= self.parts_lifetime_s

    def describe(self) -> str:
        ttl = "no TTL" if self.query_log_ttl_s is None else f"TTL {self.query_log_ttl_s:g}s"
        return (
            f"record {self.age_s:.0f}s old, server up {self.uptime_s:.0f}s, "
            f"old_parts_lifetime {self.parts_lifetime_s:g}s, query_log {ttl}"
        )


def cut_evidence_lost(life: EvidenceLife) -> str | None:
    """Why a resumed ``visibility=partition`` publish cannot trust that staged parts it
    does not find in the target were never moved there (a MOVE cut by a server crash,
    its moved parts merged away since), or None when that evidence is intact."""
    if not life.restarted_since_prepare or not life.parts_may_be_gone:
        return None
    return (
        f"ClickHouse restarted after the PREPARE and the record is older than the "
        f"target's old_parts_lifetime ({life.describe()}): parts a MOVE cut by that "
        f"restart may have been merged away in the target, so moving what is staged "
        f"could publish rows twice"
    )


def attach_evidence_lost(life: EvidenceLife) -> str | None:
    """Why a resumed ``visibility=batch`` publish cannot trust that an ATTACH it does not
    see (no part UUIDs in the target, no line in the query log) never ran, or None.

    The attached parts prove it until merged away and cleaned up; the query log line
    until its TTL deletes it, or never if the server crashed before flushing it (a
    restart since the PREPARE counts as such a crash)."""
    if not life.restarted_since_prepare and not life.parts_may_be_gone:
        return None  # the attached parts would show, outdated or not
    if life.restarted_since_prepare and life.parts_may_be_gone:
        return (
            f"ClickHouse restarted after the PREPARE and the record is older than the "
            f"target's old_parts_lifetime ({life.describe()}): an ATTACH's parts may have "
            f"been merged away and its query_log line lost with the restart (the log is "
            f"flushed every few seconds), so nothing can prove an earlier ATTACH of this "
            f"batch did not land"
        )
    if life.query_log_ttl_s is None or life.age_s + CLOCK_SKEW_S < life.query_log_ttl_s:
        return None  # the query log would show it
    return (
        f"system.query_log keeps lines for less than the record's age and the target's "
        f"parts may have been merged away since ({life.describe()}): nothing can prove "
        f"an earlier ATTACH of this batch did not land"
    )


def moving_targets(ops: Sequence[Operation]) -> tuple[str, ...]:
    """Targets a plan moves staged rows (a MOVE, the rest of a cut one) or attaches a
    batch into: where a resumed publish must know that what it does not see never
    landed."""
    return tuple(dict.fromkeys(op.target for op in ops if isinstance(op, (Publish, AttachAll))))


def guard_late_publish(
    xid: str, job: str, ops: Sequence[Operation], lives: Mapping[str, EvidenceLife]
) -> list[Operation]:
    """``ops`` unchanged, or a single Alarm when a move or an attach of it goes into a
    target whose evidence of an earlier one may have been erased (``lives`` per target,
    read for every target :func:`moving_targets` names)."""
    for op in ops:
        if isinstance(op, Publish) and op.target in lives:
            why = cut_evidence_lost(lives[op.target])
            what = f"partition {op.partition_id} of staging table {op.staging} still holds rows"
        elif isinstance(op, AttachAll) and op.target in lives:
            why = attach_evidence_lost(lives[op.target])
            what = f"batch staging {op.batch_staging} is not seen attached"
        else:
            continue
        if why is not None:
            return [
                Alarm(
                    xid,
                    f"xid {xid}: {what} for {op.target}, but {why}. Nothing was moved or "
                    f"attached: check the target (docs/operations.md#late-restart), then "
                    f"`txsink recover --job {job} --yes`",
                )
            ]
    return list(ops)
