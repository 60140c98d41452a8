"""The one error hierarchy of txsink.

Every error raised to a user derives from :class:`TxSinkError`. Messages name the object
(table, column, xid, Keeper path) and the next step. Adapters map kazoo and ClickHouse
errors here and keep the server's error code in ``code``.

- :class:`ConfigError`: a bad option or an incompatible target; nothing was written.
- :class:`SchemaMismatch`: the DataFrame does not fit the target; nothing was written.
- :class:`RetryableConflict`: a transient condition (CAS lost, server busy); safe to retry.
- :class:`FencedError`: a newer writer epoch owns the job; this writer must stop.
- :class:`CommitOutcomeUnknown`: a commit step may or may not have landed. Never abort
  automatically: run ``txsink recover`` which inspects and finishes it.
- :class:`RecoveryAlarm`: recovery found a state it must not repair automatically.
- :class:`ContentChanged`: dedup mode saw a replayed batch whose content differs.
- :class:`HalfVisibleBatch`: dedup mode refused a batch because another batch of the job
  stopped half-way (some of its rows are in the target); nothing was written.
- :class:`DiscardedBatch`: a batch the operator gave up (``recover --discard-dedup``) is
  never written again; nothing was written. Both a :class:`HalfVisibleBatch` and a
  :class:`ConfigError` (its ``txn_version`` names a batch that may not be written).
- :class:`DedupWindowExceeded`: dedup mode refused a block the target's dedup window may
  no longer recognise (or may not hold until a replay).
- :class:`UnavailableError`: ClickHouse or Keeper cannot be reached.
- :class:`Refused`: an operator command refused to act (a live writer holds the job);
  nothing was done.
- :class:`KeeperRequestTooLarge`: a Keeper write would exceed the server's request limit;
  it was not sent (``code`` holds the estimated size).
"""

from __future__ import annotations


class TxSinkError(Exception):
    """Root of all txsink errors."""

    def __init__(self, message: str, *, code: int | None = None) -> None:
        super().__init__(message)
        self.code = code


class ConfigError(TxSinkError):
    """A bad option value, a missing option, or a target txsink cannot write to."""


class SchemaMismatch(ConfigError):
    """The DataFrame schema does not match the target table."""


class RetryableConflict(TxSinkError):
    """A transient conflict; the same step may simply be retried."""


class FencedError(TxSinkError):
    """A newer writer epoch owns the job: this (zombie) writer must not prepare or commit."""


class CommitOutcomeUnknown(TxSinkError):
    """A commit step failed in a way that does not tell whether it landed."""


class RecoveryAlarm(TxSinkError):
    """Recovery found a state that needs an operator (for example lost staging)."""


class ContentChanged(TxSinkError):
    """A replayed dedup-mode batch differs from what was recorded for it."""


class HalfVisibleBatch(TxSinkError):
    """Dedup mode: another batch of the job stopped half-way, part of its rows visible;
    no other batch is written until it is rerun or discarded by the operator."""


class DiscardedBatch(HalfVisibleBatch, ConfigError):
    """Dedup mode: the batch was discarded by the operator (``txsink recover
    --discard-dedup``) and is never written again; raised by its tasks and its commit
    (:func:`txsink.protocol.job.discarded_batch`)."""


class UnavailableError(TxSinkError):
    """ClickHouse or Keeper is unreachable or its session expired."""


class Refused(TxSinkError):
    """An operator command refused to act, for example because a live writer holds the
    job; nothing was done (``txsink`` exits 3)."""


class KeeperRequestTooLarge(TxSinkError):
    """A Keeper request would exceed ZooKeeper's ``jute.maxbuffer``; nothing was sent."""


class DedupWindowExceeded(TxSinkError):
    """Dedup mode: a block might not be recognised by the target's dedup window any more
    (parts inserted since the partition's first block, or time); nothing was sent."""
