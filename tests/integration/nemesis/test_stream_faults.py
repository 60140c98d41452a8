"""A real Spark stream into ClickHouse while the nemesis breaks what it talks to (issue
16): lost replies of every protocol statement (staging CREATE, INSERT, MOVE, DROP, the
Keeper prepare and commit), ClickHouse and ZooKeeper killed with SIGKILL and restarted,
connections reset, a Keeper session expired by a black hole, real TOO_MANY_PARTS
back-pressure, executors' Python workers killed. The job talks only to fault-injecting
proxies; a supervisor restarts it when it dies, as production would.

Each test asserts ``count() == uniqExact(id) == produced`` (and the view's totals in
dedup mode), and that every fault of its list really happened: a fault whose trigger
never came would make the test pass without testing anything.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tests.nemesis import chaos
from tests.nemesis.services import Services

ATTACH = [
    "lost-reply-create-staging",
    "lost-reply-insert",
    "lost-reply-keeper-prepare",
    "lost-reply-keeper-commit",
    "lost-reply-drop-staging",
    "lost-reply-fill",
    "lost-reply-attach",
    "zookeeper-kill",
    "executor-worker-kill",
    "clickhouse-connection-reset",
    "keeper-session-expiry",
]
DEDUP = [
    "executor-worker-kill",
    "zookeeper-connection-reset",
    "lost-reply-insert",
    "lost-reply-keeper-dedup-state",
    "lost-reply-keeper-commit",
    "too-many-parts",
    "clickhouse-kill",
    "zookeeper-kill",
]


# state=clickhouse: the transaction state in KeeperMap, reached through the ClickHouse
# proxy like the rows: lost replies of its prepare and commit statements, and ClickHouse
# killed (the state store with it). This run publishes with visibility=partition (what
# replicated targets and shards use), so the faults of the MOVE (a lost reply, a server
# crash between two parts of one partition) run here; the run above has the default
# publish (visibility=batch: the copy and the ATTACH). The path is the same for both
# stores.
STATE_IN_CLICKHOUSE = [
    "lost-reply-state-prepare",
    "lost-reply-state-commit",
    "clickhouse-kill",
    "lost-reply-move",
    "clickhouse-crash-inside-move",
]


@pytest.mark.parametrize(
    ("mode", "faults", "state", "visibility"),
    [
        ("attach", ATTACH, "keeper", ""),
        pytest.param("dedup", DEDUP, "keeper", "", marks=pytest.mark.slow),
        ("attach", STATE_IN_CLICKHOUSE, "clickhouse", "partition"),
    ],
)
def test_a_stream_under_the_nemesis_ends_exact_and_every_fault_happened(
    nemesis: Services, tmp_path: Path, mode: str, faults: list[str], state: str, visibility: str
) -> None:
    arena = chaos.open_arena(nemesis, tmp_path, mode, state, visibility)
    try:
        verdict = chaos.play(
            arena,
            chaos.scripted(faults),
            random.Random(16),
            files_per_round=8,
            pause=(0.5, 1.5),
        )
    finally:
        arena.close()
    log = arena.job_log.read_text(errors="replace")[-4000:] if arena.job_log.exists() else ""
    print(verdict.table())
    assert verdict.exact, f"{verdict.table()}\n{log}"
    missed = [f.kind for f in verdict.faults if not f.fired]
    assert [f.kind for f in verdict.faults] == faults
    assert not missed, f"faults that never happened: {missed}\n{verdict.table()}"
