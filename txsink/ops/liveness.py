"""Is a job's writer alive? Judged by the heartbeat the writer declares, else by its
own commit cadence (pure).

A writer heartbeats its owner node at takeover, between the statements of a publish
that runs longer than its beat, while a publish waits, and after every commit. It is
judged (docs/operations.md#liveness says the same, with a table):

- **Inside a commit** (a declared beat: ``running``, ``publishing``; or a PREPARED xid
  of its epoch newer than its last beat): by the longest of 3 x its declared beat
  (``beat_s``, 5 s), 3 x its cadence, and the longest statement it may wait on without
  a beat plus the floor (``wait_s`` + 30 s: its client's send_receive_timeout +
  connect_timeout, 310 s by default; an ATTACH may wait ``lock_acquire_timeout``).
- **Between batches** (state ``idle``; a batch write's ``finished`` alike): by its
  *cadence*, the median gap between the ``committed_at`` times of its most recent
  COMMITTED xids (the median shrugs off a restart's long gap and a catch-up's burst).
- **A run at work**: while the owner is ``finished`` (or recovery's mark, or none),
  staging no xid record references, written after the owner's last beat and less than
  :data:`STALE_CAP` ago (the next ``save()``'s tasks stage before it takes the job),
  makes the writer live whatever its beat.

::

    stale_after = clamp(CADENCE_FACTOR x (declared beat or cadence), STALE_FLOOR, STALE_CAP)
                  (inside a commit at least wait_s + STALE_FLOOR)

- ``CADENCE_FACTOR`` = 3: three intervals may pass before a writer reads dead;
- ``STALE_FLOOR`` = 30 s: below that, a short GC pause, a slow MOVE or clock skew between
  the writer's host and the operator's would make a live writer read dead;
- ``STALE_CAP`` = 600 s: a slow idle job never blocks ``txsink recover`` for more than ten
  minutes, however slow its cadence.

An idle writer with fewer than two commits has no cadence: it gets the cap. An explicit
``stale_after`` (``--stale-after``) wins over everything. The owner
``txsink-recover@...`` (the mark recovery leaves) is never a live writer.

Reading dead wrongly costs the batch in flight, not committed data: ``txsink recover``
fences the writer with a new epoch and rolls back its unprepared staging; its next
prepare or commit fails with FencedError.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from txsink.protocol.codec import FINISHED_STATE, IDLE_STATE, OwnerInfo, as_owner

CADENCE_FACTOR = 3.0
STALE_FLOOR = 30.0
STALE_CAP = 600.0
#: the longest one statement of a publish may run, for a writer that does not declare
#: it (:data:`~txsink.protocol.codec.WAIT_KEY`): the default send_receive_timeout (300 s)
#: and connect_timeout (10 s) of the ClickHouse client
DEFAULT_WAIT_S = 310.0
CADENCE_SAMPLE = 20  # gaps between the most recent commits that the median is taken over
RECOVER_OWNER_PREFIX = "txsink-recover@"

# The owner node, typed or as its mapping (tests and older callers).
OwnerLike = OwnerInfo | Mapping[str, Any] | None


@dataclass(frozen=True)
class Liveness:
    """The verdict and how it was reached (all rendered by ``txsink status``)."""

    live: bool
    heartbeat_age: float | None  # seconds; None: no heartbeat yet
    cadence_s: float | None  # median seconds between recent commits; None: < 2 commits
    stale_after_s: float
    # "flag" | "declared" | "cadence" | "no-cadence" | "finished" | "publishing" | "staging"
    stale_after_source: str
    beat_s: float | None = None  # the heartbeat interval the writer declared, if busy

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def commit_cadence(
    committed_at: Iterable[float | None], sample: int = CADENCE_SAMPLE
) -> float | None:
    """Median gap between the ``sample + 1`` most recent commit times; None below two."""
    times = sorted(float(t) for t in committed_at if t is not None)[-(sample + 1) :]
    if len(times) < 2:
        return None
    return float(statistics.median(b - a for a, b in itertools.pairwise(times)))


def stale_threshold(
    cadence: float | None,
    *,
    factor: float = CADENCE_FACTOR,
    floor: float | None = None,
    cap: float = STALE_CAP,
) -> float:
    """``clamp(factor x cadence, floor, cap)``; the cap when there is no cadence
    (``floor``: :data:`STALE_FLOOR` as it is when called)."""
    floor = STALE_FLOOR if floor is None else floor
    if cadence is None:
        return cap
    return min(cap, max(floor, factor * cadence))


class Verdict(Protocol):
    """What :func:`explain` reads of a verdict: a :class:`Liveness`, or a view that
    carries its fields (``txsink status``'s JobStatus, ``recover``'s plan view)."""

    @property
    def stale_after_source(self) -> str: ...
    @property
    def cadence_s(self) -> float | None: ...
    @property
    def beat_s(self) -> float | None: ...


def explain(v: Verdict) -> str:
    """Where a verdict's stale threshold came from, in words."""
    if v.stale_after_source == "flag":
        return "--stale-after"
    if v.stale_after_source == "finished":
        return "its batch write finished; " + (
            f"{CADENCE_FACTOR:g} x its {v.cadence_s:g}s commit cadence, within "
            f"[{STALE_FLOOR:g}, {STALE_CAP:g}]s"
            if v.cadence_s is not None
            else "no commit cadence yet: the cap"
        )
    if v.stale_after_source == "declared":
        return (
            f"{CADENCE_FACTOR:g} x the {v.beat_s:g}s heartbeat it declared inside a commit, "
            f"within [{STALE_FLOOR:g}, {STALE_CAP:g}]s"
        )
    if v.stale_after_source == "publishing":
        return (
            "inside a commit: the longest statement it may wait on without a beat "
            f"(send_receive_timeout + connect_timeout, as it declared) + {STALE_FLOOR:g}s"
        )
    if v.stale_after_source == "staging":
        return (
            f"a run is writing staging no xid references yet (its last write less than "
            f"{STALE_CAP:g}s ago, after the owner's last heartbeat)"
        )
    if v.cadence_s is None:
        return "no commit cadence yet: the cap"
    return (
        f"{CADENCE_FACTOR:g} x its {v.cadence_s:g}s commit cadence, within "
        f"[{STALE_FLOOR:g}, {STALE_CAP:g}]s"
    )


def heartbeat_age(owner: OwnerLike, now: float) -> float | None:
    info = as_owner(owner)
    if info is None or info.heartbeat is None:
        return None
    return max(0.0, now - info.heartbeat)


def is_recover_owner(owner: OwnerLike) -> bool:
    info = as_owner(owner)
    return info is not None and info.owner.startswith(RECOVER_OWNER_PREFIX)


def declared_beat(owner: OwnerLike) -> float | None:
    """The heartbeat interval a writer inside a commit declared (None: idle, finished,
    or a writer that declares none)."""
    info = as_owner(owner)
    if info is None or info.state in (IDLE_STATE, FINISHED_STATE):
        return None
    beat = info.beat_s
    return beat if beat is not None and beat > 0 else None


def is_finished(owner: OwnerLike) -> bool:
    info = as_owner(owner)
    return info is not None and info.state == FINISHED_STATE


def declared_wait(owner: OwnerLike) -> float:
    """The longest one statement of the writer's publish may run without a beat, as it
    declared (:data:`WAIT_KEY`); :data:`DEFAULT_WAIT_S` for a writer that declares none."""
    info = as_owner(owner)
    wait = None if info is None else info.wait_s
    return wait if wait is not None and wait > 0 else DEFAULT_WAIT_S


def judge(
    owner: OwnerLike,
    committed_at: Iterable[float | None],
    now: float,
    stale_after: float | None = None,
    *,
    prepared_at: float | None = None,
    staged_at: float | None = None,
) -> Liveness:
    """Whether the job's writer may be mid-batch, from its heartbeat, the beat it
    declared and its commit times. ``stale_after`` given (not None) is used as is.

    ``prepared_at``: when the newest PREPARED xid of the owner's epoch was prepared
    (None: none), the sign of a commit under way even when the owner still rests as
    after the last one. ``staged_at``: the newest write to staging no xid record
    references (a run that has not prepared yet: a batch save's tasks, a stream's next
    micro-batch; None: none, or not known). It speaks only where no writer's beat does:
    the owner finished its batch write (the next ``save()`` stages before it takes the
    job), recovery holds the job, or nobody does.

    - A writer inside a commit (a declared beat, or a PREPARED xid of its epoch newer
      than its last beat) is judged by the longer of its declared beat, its cadence
      and the longest statement it may wait on plus the floor (``wait_s + 30 s``): a
      publish beats between its statements, never during one (an ATTACH may wait
      ``lock_acquire_timeout``, 120 s by default; the client gives up on a reply after
      ``send_receive_timeout``, which the writer declares).
    - A finished batch write is judged like an idle stream (``txsink status`` still
      names the writer ``finished``).
    - Staging written after the last beat and less than :data:`STALE_CAP` ago, while
      the owner is finished, recovery's mark or none, is a run at work: the writer
      reads live whatever its last beat (source ``staging``). A stream's own next
      micro-batch is its cadence's to judge."""
    cadence = commit_cadence(committed_at)
    beat = declared_beat(owner)
    info = as_owner(owner)
    last = None if info is None else info.heartbeat
    committing = prepared_at is not None and (last is None or prepared_at >= last)
    if stale_after is not None:
        threshold, source = float(stale_after), "flag"
    elif beat is not None or committing:  # the longest of its promises (ties: first)
        promises = [] if beat is None else [(stale_threshold(beat), "declared")]
        if cadence is not None or beat is None:
            promises.append((stale_threshold(cadence), "cadence" if cadence else "no-cadence"))
        promises.append((declared_wait(owner) + STALE_FLOOR, "publishing"))
        threshold, source = max(promises, key=lambda p: p[0])
    elif is_finished(owner):  # the next write of the job may already be staging
        threshold, source = stale_threshold(cadence), "finished"
    else:
        threshold = stale_threshold(cadence)
        source = "cadence" if cadence is not None else "no-cadence"
    age = heartbeat_age(owner, now)
    if committing and prepared_at is not None and age is not None:
        age = min(age, max(0.0, now - prepared_at))  # alive when it prepared
    live = age is not None and not is_recover_owner(owner) and age < threshold
    if (
        not live
        and stale_after is None
        and (info is None or is_finished(info) or is_recover_owner(info))
        and staged_at is not None
        and (last is None or staged_at > last)
        and now - staged_at < STALE_CAP
    ):
        live, source, threshold = True, "staging", STALE_CAP
        age = max(0.0, now - staged_at) if age is None else age
    return Liveness(
        live=live,
        heartbeat_age=None if age is None else round(age, 1),
        cadence_s=None if cadence is None else round(cadence, 3),
        stale_after_s=round(threshold, 3),
        stale_after_source=source,
        beat_s=beat,
    )
