"""The one compare-and-set loop: a lost race reads and decides again, a runaway loop ends
in a retryable conflict naming the node, any other error is not swallowed."""

from __future__ import annotations

import pytest

from txsink.errors import RetryableConflict
from txsink.ports.cas import CasRetry, cas


def test_a_lost_race_reads_and_decides_again_until_the_write_lands() -> None:
    reads: list[int] = []

    def attempt() -> str:
        reads.append(len(reads))
        if len(reads) < 3:
            raise CasRetry  # the node moved between our read and our write
        return "landed"

    assert cas("node /x", attempt) == "landed" and reads == [0, 1, 2]


def test_a_loop_that_keeps_losing_is_a_retryable_conflict_naming_the_node() -> None:
    def attempt() -> None:
        raise CasRetry

    with pytest.raises(RetryableConflict, match="node /jobs/j/ledger keeps changing"):
        cas("node /jobs/j/ledger", attempt, rounds=4)


def test_other_errors_are_not_retried() -> None:
    calls = []

    def attempt() -> None:
        calls.append(1)
        raise ValueError("illegal xid transition")

    with pytest.raises(ValueError, match="illegal"):
        cas("node /x", attempt)
    assert calls == [1]
