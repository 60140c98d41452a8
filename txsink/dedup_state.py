"""A job's dedup state in the coordination store, read through the
:class:`~txsink.ports.registry.Registry` port: the batches stopped half-way that fence
the job (:func:`open_dedup_batches`) and the operator's mark on a batch given up
(:func:`discarded`). The rules are :mod:`txsink.protocol.job`'s; the dedup task
(:mod:`txsink.spark.dedup_write`), the driver's commit (:mod:`txsink.transactor`),
``status``, ``recover`` and ``mode`` read the state here, the same way.
"""

from __future__ import annotations

from typing import Any

from txsink.ports.registry import Registry
from txsink.protocol import job as rules
from txsink.protocol.codec import decode_partition_state
from txsink.protocol.dedup import OpenBatch, open_batch
from txsink.protocol.dedup import xid_key as dedup_xid_key
from txsink.protocol.ids import xid_batch

DISCARDED = "discarded"  # dedup/<xid>/discarded: the operator gave the xid up (recover)


def open_dedup_batches(registry: Registry, job: str, *, skip: str = "") -> list[OpenBatch]:
    """The job's dedup batches stopped half-way (:func:`rules.is_open_dedup`), each summed
    up from its partition records; ``skip`` names an xid not to consider (the caller's
    own), a discarded xid is not one. One Keeper listing when there is none, which is
    the common case."""
    found: list[OpenBatch] = []
    last: int | None = None
    for xid in registry.blob_children(job, "dedup"):
        if xid == skip:
            continue
        record = registry.get(job, xid)
        if record is None and last is None:
            ledger_last = registry.ledger(job).last_batch
            last = None if ledger_last is None else int(ledger_last)
        if not rules.is_open_dedup(record.state if record else None, xid_batch(xid), last):
            continue
        key = dedup_xid_key(xid)
        names = registry.blob_children(job, key)
        if DISCARDED in names:
            continue
        states = []
        for name in names:
            blob = registry.get_blob(job, f"{key}/{name}")
            state = decode_partition_state(blob, f"jobs/{job}/{key}/{name}") if blob else None
            if state is not None:
                states.append(state)
        if states:
            found.append(open_batch(xid, states))
    return found


def discarded(registry: Registry, job: str, xid: str) -> dict[str, Any] | None:
    """The operator's mark on a dedup xid given up with ``recover --discard-dedup``."""
    return registry.get_blob(job, f"{dedup_xid_key(xid)}/{DISCARDED}")
