"""`txsink mode`: the operator's explicit change of a job's pinned mode.

A job's mode (attach or dedup) is decided once, at its first commit, and pinned in its
Keeper meta (:mod:`txsink.spark.validate`). Writers never switch it on their own: a batch
whose tasks wrote in one mode and were committed in the other is lost (attach staging
recorded as a dedup commit) or duplicated (dedup rows staged again). Changing it is safe
only between batches, so :func:`change_mode` refuses while

- the job's writer looks live (stop the query first, or ``force``),
- an xid is PREPARED (its publish plan belongs to the old mode: ``txsink recover`` first),
- a dedup batch is half-written (``dedup/<xid>`` state without a COMMITTED record: its
  rows are already in the target, and only a dedup replay can finish it exactly once),

It takes a new writer epoch *before* it looks, so no prepare or commit of an older writer
can land after the checks. Executors are not fenced by epochs: a dedup task still running
could insert rows after the change; that batch's commit is fenced, and its replay in
attach mode is refused because ``dedup/<xid>`` state exists (:mod:`txsink.transactor`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any

from txsink.dedup_state import open_dedup_batches
from txsink.errors import ConfigError, RecoveryAlarm, Refused
from txsink.ops.status import recover_owner, writer_is_live
from txsink.ops.stores import Stores
from txsink.protocol.dedup import xid_key as dedup_xid_key
from txsink.protocol.states import Mode, XidState

MODES = tuple(m.value for m in Mode)


@dataclass
class ModeChange:
    job: str
    old: str | None
    new: str
    changed: bool
    epoch: int | None = None

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def change_mode(
    stores: Stores, job: str, new: str, *, stale_after: float, force: bool = False
) -> ModeChange:
    """Pin ``job`` to mode ``new``; ConfigError (naming the next step) when unsafe now."""
    if new not in MODES:
        raise ConfigError(f"mode must be one of {', '.join(MODES)}, got {new!r}")
    wanted = Mode(new)
    registry = stores.registry
    meta = registry.job_meta(job)
    if meta is None:
        raise ConfigError(
            f"job {job!r} does not exist in Keeper; its mode is decided at its first commit"
        )
    old = meta.mode or None
    if meta.targets and wanted is not Mode.ATTACH:
        raise ConfigError(
            f"job {job} writes {', '.join(sorted(meta.targets))} with txsink.transaction, "
            f"which takes attach-mode tables only (dedup rows would be visible before the "
            f"transaction commits). Write the table that needs dedup mode with "
            f"txsink.foreach_batch under a new job name"
        )
    if meta.shards and wanted is not Mode.ATTACH:
        raise ConfigError(
            f"job {job} writes one xid across the shards {', '.join(meta.shards)} (its "
            f"target {meta.target} is a local table on each), which takes attach mode "
            f"only. To go on in dedup mode through a Distributed table, start a new job "
            f"(mode=dedup) after this one's last batch committed"
        )
    if old == new:
        return ModeChange(job, old, new, changed=False)
    owner = registry.owner(job)
    if writer_is_live(owner, time.time(), stale_after) and not force:
        raise Refused(
            f"job {job} has a live writer ({owner.owner if owner else None}); stop the streaming "
            f"query first (a batch in flight was written in mode {old}); pass --force only "
            f"once you know it has stopped (e.g. it just failed)"
        )
    # Fence first, then look: a writer that prepared or wrote dedup state between a
    # check and the epoch would otherwise slip through (its later writes are fenced).
    epoch = registry.take_epoch(job, recover_owner())
    registry.heartbeat(epoch, {"state": "mode-change", "mode": old})
    prepared = [r.xid for r in registry.list(job) if r.state is XidState.PREPARED]
    if prepared:
        raise RecoveryAlarm(
            f"job {job} has PREPARED xid(s) {', '.join(prepared)} staged in mode {old}; its "
            f"writer is fenced now (epoch {epoch.number}) and the mode is unchanged; run "
            f"`txsink recover --job {job}` first, then change the mode"
        )
    open_dedup = [b.xid for b in open_dedup_batches(registry, job)]
    if meta.pinned_mode is Mode.DEDUP and open_dedup:
        raise RecoveryAlarm(
            f"job {job} has half-written dedup batch(es) {', '.join(open_dedup)}: their rows "
            f"are partly in the target and only a dedup-mode replay finishes them exactly "
            f"once. Its writer is fenced now (epoch {epoch.number}) and the mode is "
            f"unchanged. Restart the query in dedup mode until that batch commits, stop it, "
            f"then change the mode"
        )
    registry.heartbeat(epoch, {"state": "mode-changed", "mode": new})
    for xid in open_dedup:  # attach -> dedup: stale state of batches never committed
        registry.delete_blobs(job, dedup_xid_key(xid))
    registry.set_job_meta(job, replace(meta, mode=new, mode_changed_at=time.time()))
    return ModeChange(job, old, new, changed=True, epoch=epoch.number)
