"""The one compare-and-set loop of the registries (pure: no kazoo).

Every write that reads a node, decides, and writes it back only if it did not move runs
as :func:`cas`: one *attempt* (read, decide, one conditional write) raises
:class:`CasRetry` when what it read moved before its write landed (kazoo's
``ForceRetryError`` pattern), and the loop reads and decides again. An attempt's write is
one request, so a lost race leaves nothing half-written; a loop that keeps losing is a
runaway peer or a bug and ends in :class:`~txsink.errors.RetryableConflict`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from txsink.errors import RetryableConflict

# A CAS loop that loses this often is not contention but a bug or a runaway peer.
MAX_CAS_ROUNDS = 50

R = TypeVar("R")


class CasRetry(Exception):
    """One compare-and-set attempt lost: what it read moved before its write landed."""


def cas(what: str, attempt: Callable[[], R], rounds: int = MAX_CAS_ROUNDS) -> R:
    """Run ``attempt`` until it lands; every :class:`CasRetry` starts it over from its
    read. Losing ``rounds`` times in a row: :class:`RetryableConflict` naming ``what``."""
    for _ in range(rounds):
        try:
            return attempt()
        except CasRetry:
            continue
    raise RetryableConflict(f"{what} keeps changing; retry")
