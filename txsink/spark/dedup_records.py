"""The Keeper side of a dedup task (:mod:`txsink.spark.dedup_write`): its partition's
record, written compare-and-set, and the batch's seal, asked before every block sent.
Decisions are :mod:`txsink.protocol.dedup`'s and :mod:`txsink.protocol.job`'s; I/O goes
through the :class:`~txsink.ports.registry.Registry` port.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from txsink.errors import TxSinkError
from txsink.ports.registry import CREATE, BlobConflict
from txsink.protocol import dedup
from txsink.protocol import job as rules
from txsink.protocol.codec import decode_partition_state, encode_partition_state
from txsink.protocol.states import XidState
from txsink.spark.messages import TxCommitMessage, WritePlan
from txsink.spark.task import Task

log = logging.getLogger(__name__)


class StateCell:
    """One partition's Keeper record as this attempt last read it, written compare-and-set.

    Every write obeys :func:`txsink.protocol.dedup.check_successor` against the record
    read; a lost race (another attempt wrote first) re-reads and tells the caller to
    decide again, so no attempt can shrink or rewrite what another recorded.
    """

    def __init__(self, registry: Any, job: str, key: str, refused: Any) -> None:
        self.registry, self.job, self.key = registry, job, key
        self._refused = refused  # (detail) -> TxSinkError, raised on a refused write
        self.state: dedup.PartitionState | None = None
        self.version = CREATE
        self.refresh()

    def refresh(self) -> None:
        found = self.registry.get_blob_versioned(self.job, self.key)
        if found is None:
            self.state, self.version = None, CREATE
        else:
            where = f"jobs/{self.job}/{self.key}"
            self.state, self.version = decode_partition_state(found[0], where), found[1]

    def propose(self, new: dedup.PartitionState) -> bool:
        """Write ``new`` if the rule allows it; False if another attempt wrote first (the
        cell then holds its record: decide again)."""
        verdict, why = dedup.check_successor(self.state, new)
        if verdict is dedup.WriteVerdict.NOOP:
            return True
        if verdict is dedup.WriteVerdict.REFUSE:
            raise self._refused(why)
        try:
            node = encode_partition_state(new)
            self.version = self.registry.cas_blob(self.job, self.key, node, self.version)
        except BlobConflict:
            self.refresh()
            return False
        self.state = new
        return True


def sealed(plan: WritePlan, task: Task, registry: Any) -> bool:
    """Is ``task``'s batch prepared or committed (:func:`rules.is_sealed`)? Synced: the
    answer decides an insert that no fenced write re-checks."""
    job = plan.config.job
    registry.sync(job)
    record = registry.get(job, task.xid)
    last = None
    if record is None and task.batch is not None:
        last = registry.ledger(job).last_batch
    state = record.state if record is not None else None
    return rules.is_sealed(state, task.batch, None if last is None else int(last))


def outlived(plan: WritePlan, task: Task, registry: Any, blocks: Iterator[Any]) -> TxCommitMessage:
    """The end of an attempt that outlived its batch (:func:`sealed`): nothing more is
    sent; a record it wrote after the commit deleted the batch's is deleted again (a
    committed batch's records are the driver's to delete; best effort, as the driver's);
    the input is drained (Spark expects it consumed)."""
    job, xid = plan.config.job, task.xid
    registry.sync(job)
    record = registry.get(job, xid)
    if record is None or record.state is XidState.COMMITTED:
        try:
            registry.delete_blobs(job, dedup.xid_key(xid))
        except TxSinkError as exc:
            log.warning("job %s: could not delete dedup state of xid %s: %s", job, xid, exc)
    for _ in blocks:
        pass
    return task.message(plan, skipped=True, extra={"outlived": True})
