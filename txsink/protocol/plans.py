"""Pure decisions of a job's transactions: given what Keeper and ClickHouse show, what to do.

This module owns the batch decision (:func:`decide_batch`: prepare, roll forward, skip
or refuse), roll-back ownership (:func:`droppable`), recovery (:func:`plan_recovery`) and
pruning (:func:`plan_prune`). The publish plan itself lives in
:mod:`txsink.protocol.planner` and its operations in :mod:`txsink.protocol.ops`.

Re-observing after a crash and planning again is what makes every step idempotent: an
operation that already landed is simply not planned a second time.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

from txsink.protocol.ids import parse_staging, staging_prefix
from txsink.protocol.job import is_replay, unowned_batch_refusal
from txsink.protocol.states import XidRecord, XidState

__all__ = [
    "BatchAction",
    "BatchDecision",
    "RecoveryPlan",
    "decide_batch",
    "droppable",
    "plan_prune",
    "plan_recovery",
]


class BatchAction(enum.StrEnum):
    """What :func:`decide_batch` tells the runner to do with a finished batch."""

    PREPARE = "prepare"  # a new xid (or one rolled back before): prepare, then publish
    ROLL_FORWARD = "roll_forward_existing"  # already PREPARED: finish that record
    SKIP = "skip_committed"  # committed before (a replay): write nothing
    REFUSE = "refuse"  # nothing is prepared; the caller raises with the reason


@dataclass(frozen=True)
class BatchDecision:
    """What to do with a finished batch whose tasks staged ``incoming``.

    ``drop`` lists staging the batch brought that no record will ever need; the caller
    rolls it back (tombstone first, see :func:`droppable`). ``refuse``: nothing is
    prepared and the caller raises with ``reason`` (``retry``: a replay can succeed;
    otherwise it is a configuration mistake)."""

    action: BatchAction
    drop: tuple[str, ...] = ()
    reason: str = ""
    retry: bool = False


def decide_batch(
    existing: XidRecord | None,
    incoming: XidRecord,
    last_batch: int | None = None,
    *,
    streaming: bool = False,
    epoch: int | None = None,
    own_batches: bool = False,
    first_batch: int | None = None,
) -> BatchDecision:
    """Decide between preparing the new staging and honouring an earlier record.

    Spark replays a batch with the same id after a restart. Once an xid is PREPARED its
    manifest is the truth: a replay's fresh staging is dropped and the recorded manifest
    rolled forward (or, if COMMITTED, nothing is published again).

    ``last_batch`` is the highest batch id the job's ledger has committed. Batch ids are
    monotonic (Spark micro-batches; ``txn_version`` like Delta Lake's txnVersion), so a
    batch at or below it without a record was committed and then pruned by retention:
    a ``txn_version`` save is skipped, never published a second time. A *streaming* job
    (``streaming``) is stricter: Spark replays only its newest batch, so a batch below
    ``last_batch`` is a reset or foreign checkpoint, refused rather than skipped.

    ``epoch`` is the deciding writer's epoch number: a COMMITTED record that this very
    epoch both prepared and committed means the batch was written twice in one run (two
    saves under one job in one ``foreachBatch`` call): refused, never dropped silently.
    (A record this epoch only rolled forward at takeover was prepared by an older one.)

    An ABORTED tombstone lets the batch prepare afresh unless the new manifest names a
    table the tombstone rolled back.

    ``own_batches``: the batch ids come from a Spark checkpoint the job may share with
    an earlier job name or store (the Spark writers): a streaming job that has committed
    nothing refuses a first batch it cannot tell from a replay of one written there
    (:func:`~.job.unowned_batch_refusal`; ``first_batch``: the option that says where
    the job's own batches start).
    """
    batch = incoming.batch
    stray = tuple(
        t for t in incoming.staging_tables if existing is None or t not in existing.staging_tables
    )
    below = batch is not None and last_batch is not None and batch < last_batch
    if streaming and below:
        return BatchDecision(
            BatchAction.REFUSE,
            stray,
            f"batch {batch} of job {incoming.job} is below the job's last committed batch "
            f"{last_batch}. Spark replays only its newest batch, so this query's checkpoint "
            f"was reset or belongs to another query; nothing was written. Restore the "
            f"checkpoint, or write with a new job name",
        )
    if existing is None or existing.state is XidState.ABORTED:
        if is_replay(None, batch, last_batch):
            return BatchDecision(
                BatchAction.SKIP,
                stray,
                f"batch {batch} is not newer than the last committed batch {last_batch}",
            )
        refusal = unowned_batch_refusal(incoming.job, batch, last_batch, first_batch)
        if streaming and own_batches and refusal:
            return BatchDecision(BatchAction.REFUSE, stray, refusal)
        if existing is not None:
            clash = sorted(existing.aborted_tables & set(incoming.staging_tables))
            if clash:
                return BatchDecision(
                    BatchAction.REFUSE,
                    stray,
                    f"xid {incoming.xid}: staging {', '.join(clash)} was rolled back (ABORTED "
                    f"tombstone) while this commit was on its way; the batch must be written "
                    f"again (restart the query: Spark replays it)",
                    retry=True,
                )
            return BatchDecision(
                BatchAction.PREPARE, reason="xid rolled back before; preparing afresh"
            )
        return BatchDecision(BatchAction.PREPARE, reason="new xid")
    if existing.state is XidState.COMMITTED:
        if epoch is not None and existing.epoch == epoch == existing.committed_epoch:
            return BatchDecision(
                BatchAction.REFUSE,
                stray,
                f"xid {existing.xid} of job {existing.job} was already committed by this same "
                f"writer run (epoch {epoch}): the batch was saved twice under one job, e.g. two "
                f"saves in one foreachBatch call. The second save was NOT written. Write every "
                f"table of a batch inside one `txsink.transaction(...)`, or keep this job for "
                f"the first save and give the second its own job name, with option "
                f"first_batch={existing.batch} (its batches start at the replay of this one)",
            )
        return BatchDecision(BatchAction.SKIP, stray, f"xid {existing.xid} already committed")
    return BatchDecision(
        BatchAction.ROLL_FORWARD, stray, f"xid {existing.xid} already prepared; finishing it"
    )


def droppable(record: XidRecord | None, tables: Iterable[str]) -> tuple[str, ...]:
    """Which of ``tables`` may be dropped after a roll-back tombstone was attempted.

    ``record`` is the xid's record as the tombstone write left it. ABORTED: exactly the
    tables it names (they can never be prepared now). PREPARED or COMMITTED: a prepare
    won the race; its manifest is final, so every table it does not name is garbage and
    the ones it names are not ours to drop. None (the tombstone could not be written):
    nothing.
    """
    wanted = list(dict.fromkeys(tables))
    if record is None:
        return ()
    if record.state is XidState.ABORTED:
        return tuple(t for t in wanted if t in record.aborted_tables)
    mine = set(record.staging_tables)
    if record.state is XidState.PREPARED:  # its batch staging (visibility=batch) too
        mine |= {t for t in wanted if (n := parse_staging(t)) and n.batch and n.xid == record.xid}
    return tuple(t for t in wanted if t not in mine)


@dataclass(frozen=True)
class RecoveryPlan:
    roll_forward: tuple[XidRecord, ...] = ()
    roll_back: tuple[str, ...] = ()
    drop_committed: tuple[str, ...] = ()


def plan_recovery(
    job: str, records: Iterable[XidRecord], staging_tables: Iterable[str], namespace: str = ""
) -> RecoveryPlan:
    """Roll PREPARED xids forward; drop every staging table of ``job`` no PREPARED xid needs.

    Only tables whose name parses as this job's staging (in this ``namespace``) are ever
    considered, so nothing outside the job's own prefix can be touched. ``roll_back`` is
    dropped only behind an ABORTED tombstone (:func:`droppable`).
    """
    prefix = staging_prefix(job, namespace)
    records = list(records)
    prepared = tuple(
        sorted(
            (r for r in records if r.state is XidState.PREPARED),
            key=lambda r: (r.batch is None, r.batch or 0, r.created_at),
        )
    )
    needed = {t for r in prepared for t in r.staging_tables}
    committed_tables = {
        t for r in records if r.state is XidState.COMMITTED for t in r.staging_tables
    }
    mine = sorted(t for t in staging_tables if (n := parse_staging(t)) and n.prefix == prefix)
    # batch staging (visibility=batch) is named by its xid, not listed in the manifest
    by_state = {r.xid: r.state for r in records}
    for table in mine:
        name = parse_staging(table)
        if name is not None and name.batch:
            state = by_state.get(name.xid)
            if state is XidState.PREPARED:
                needed.add(table)
            elif state is XidState.COMMITTED:
                committed_tables.add(table)
    roll_back = tuple(t for t in mine if t not in needed and t not in committed_tables)
    leftover = tuple(t for t in mine if t in committed_tables and t not in needed)
    return RecoveryPlan(prepared, roll_back, leftover)


# An ABORTED tombstone outlives any prepare that can still be in flight (a Keeper request
# lives at most a session timeout; a paused writer is fenced by its epoch long before).
TOMBSTONE_SECONDS = 3600.0


def plan_prune(
    records: Iterable[XidRecord],
    keep: int,
    now: float | None = None,
    tombstone_seconds: float = TOMBSTONE_SECONDS,
) -> list[str]:
    """COMMITTED xids beyond the newest ``keep`` (by batch, then commit time), and
    ABORTED tombstones older than ``tombstone_seconds`` (when ``now`` is given)."""
    records = list(records)
    committed = sorted(
        (r for r in records if r.state is XidState.COMMITTED),
        key=lambda r: (r.committed_at or 0.0, r.batch if r.batch is not None else -1),
    )
    excess = len(committed) - max(keep, 0)
    doomed = [r.xid for r in committed[:excess]] if excess > 0 else []
    if now is not None:
        doomed += [
            r.xid
            for r in records
            if r.state is XidState.ABORTED and now - r.created_at > tombstone_seconds
        ]
    return doomed
