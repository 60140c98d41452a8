"""Job-level rules (txsink.protocol.job): one test row per row of its tables."""

from __future__ import annotations

import re

import pytest

from txsink.committer import epoch_for_run
from txsink.config import WriterConfig
from txsink.driver import job_handle
from txsink.errors import ConfigError
from txsink.ports.registry_memory import MemoryRegistry
from txsink.ports.warehouse_memory import MemoryWarehouse
from txsink.protocol import job as rules
from txsink.protocol.job import JobFacts, TaskVerdict
from txsink.protocol.states import Mode, XidState

J, T = "j", "db.t"
A, D = Mode.ATTACH, Mode.DEDUP
BLOCKED, UNSAFE = ["a view reads db.t"], ["no dedup window"]

# ---------------------------------------------------------------- resolve_mode's table

# pinned, asked, attach blockers, dedup problems -> mode (None: refused, with `match`)
MODE_TABLE = [
    (A, "dedup", [], [], None, "pinned to mode attach"),
    (D, "attach", [], [], None, "pinned to mode dedup"),
    (A, "auto", [], [], A, ""),
    (A, "attach", [], [], A, ""),
    (A, "auto", BLOCKED, [], None, r"pinned to attach mode.*--set dedup"),
    (D, "auto", BLOCKED, [], D, ""),
    (D, "dedup", [], [], D, ""),
    (D, "auto", [], UNSAFE, None, r"pinned to dedup mode.*unsafe.*no dedup window"),
    (None, "attach", [], UNSAFE, A, ""),
    (None, "attach", BLOCKED, [], None, "mode=attach is impossible"),
    (None, "dedup", BLOCKED, [], D, ""),
    (None, "dedup", [], UNSAFE, None, "mode=dedup is unsafe"),
    (None, "auto", [], UNSAFE, A, ""),
    (None, "auto", BLOCKED, [], D, ""),
    (None, "auto", BLOCKED, UNSAFE, None, "can take neither attach"),
]


@pytest.mark.parametrize(("pinned", "asked", "blockers", "problems", "want", "match"), MODE_TABLE)
def test_every_row_of_the_mode_table(
    pinned: Mode | None,
    asked: str,
    blockers: list[str],
    problems: list[str],
    want: Mode | None,
    match: str,
) -> None:
    choice = rules.resolve_mode(J, T, asked, pinned, blockers, problems)
    assert choice.mode is want
    if want is None:
        assert choice.refusal
        assert re.search(match, choice.refusal), choice.refusal
    else:
        assert choice.refusal == ""


def test_auto_falls_back_to_dedup_only_where_attach_is_blocked_and_says_so() -> None:
    assert rules.resolve_mode(J, T, "auto", None, BLOCKED, []).fallback
    assert not rules.resolve_mode(J, T, "auto", None, [], []).fallback
    assert not rules.resolve_mode(J, T, "auto", D, BLOCKED, []).fallback


# ---------------------------------------------------------------- the pin's transitions


def test_a_job_that_never_committed_has_no_pin_and_auto_is_never_a_pin() -> None:
    assert rules.pinned_mode(None) is None
    assert rules.pinned_mode(JobFacts.of({})) is None
    assert rules.pinned_mode(JobFacts(mode="auto")) is None
    assert rules.pinned_mode(JobFacts(mode="attach")) is A
    assert rules.pinned_mode(JobFacts(mode="dedup"), T) is D


def test_a_transaction_job_pins_a_mode_per_table() -> None:
    job = JobFacts.from_meta({"mode": "attach", "targets": {T: "attach", "db.u": "dedup"}})
    assert rules.pinned_mode(job, T) is A
    assert rules.pinned_mode(job, "db.u") is D
    assert rules.pinned_mode(job, "db.other") is None
    assert rules.pinned_mode(job) is A  # the job's own mode


def _handle(registry: MemoryRegistry) -> object:
    config = WriterConfig.from_options(
        {"url": "http://h:8123", "keeper": "k:2181", "table": T, "job": J}
    )
    return job_handle(config, registry, MemoryWarehouse())


def test_the_first_commit_pins_the_mode_and_a_takeover_never_moves_it() -> None:
    registry = MemoryRegistry()
    epoch_for_run(_handle(registry), "run-1", "attach")  # type: ignore[arg-type]
    assert rules.pinned_mode(JobFacts.of(registry.job_meta(J))) is A  # (none) -> attach
    epoch_for_run(_handle(registry), "run-2", "dedup")  # type: ignore[arg-type]
    assert rules.pinned_mode(JobFacts.of(registry.job_meta(J))) is A  # attach -> attach


def test_the_tasks_of_a_batch_are_committed_only_in_the_mode_they_wrote_in() -> None:
    assert rules.written_mode_refusal(J, "b1", T, [], "dedup") is None  # every task skipped
    assert rules.written_mode_refusal(J, "b1", T, ["dedup", "dedup"], "dedup") is None
    refusal = rules.written_mode_refusal(J, "b1", T, ["attach"], "dedup")
    assert refusal and "wrote in mode attach" in refusal and "resolves mode dedup" in refusal
    refusal = rules.written_mode_refusal(J, "b1", T, ["attach", "dedup"], "dedup")
    assert refusal and "attach/dedup" in refusal


# ---------------------------------------------------------------- identity


def test_a_job_keeps_its_target_and_its_shard_list_in_order() -> None:
    stored = JobFacts(target=T, shards=("http://a:1", "http://b:1"))
    assert rules.identity_refusal(J, None, JobFacts(target="db.x")) is None  # a new job
    assert rules.identity_refusal(J, stored, JobFacts(target=T, shards=stored.shards)) is None
    other = rules.identity_refusal(J, stored, JobFacts(target="db.x", shards=stored.shards))
    assert other and "writes to db.t, not db.x" in other
    swapped = rules.identity_refusal(J, stored, JobFacts(target=T, shards=stored.shards[::-1]))
    assert swapped and "keeps its shard list" in swapped
    one = JobFacts(target=T, url="http://h:1")
    sharded = rules.identity_refusal(J, one, JobFacts(target=T, shards=("http://h:1",)))
    assert sharded and "['http://h:1']" in sharded  # a job of one server names its url


def test_a_takeover_refuses_a_single_table_writer_on_a_transaction_job() -> None:
    stored = JobFacts(target=T, targets={T: "attach", "db.u": "attach"})
    refusal = rules.takeover_refusal(J, stored, JobFacts(target=T), lambda: 0)
    assert refusal and "several tables in one transaction" in refusal
    mine = JobFacts(target=T, targets={"db.u": "attach"})
    assert rules.takeover_refusal(J, stored, mine, lambda: 0) is None  # a subset
    more = JobFacts(target=T, targets={T: "attach", "db.new": "attach"})
    refusal = rules.takeover_refusal(J, stored, more, lambda: 0)
    assert refusal and "also writes db.new" in refusal


def test_a_new_streaming_query_may_take_over_a_job_only_before_anything_committed() -> None:
    stored = JobFacts(target=T, query_id="q1")
    asked: list[int] = []

    def committed(n: int):  # type: ignore[no-untyped-def]
        return lambda: asked.append(n) or n

    assert (
        rules.takeover_refusal(J, stored, JobFacts(target=T, query_id="q1"), committed(3)) is None
    )
    assert asked == []  # the same query: the ledger is not read
    assert rules.takeover_refusal(J, stored, JobFacts(target=T), committed(3)) is None
    assert (
        rules.takeover_refusal(J, stored, JobFacts(target=T, query_id="q2"), committed(0)) is None
    )
    refusal = rules.takeover_refusal(J, stored, JobFacts(target=T, query_id="q2"), committed(1))
    assert refusal and "streaming query q1" in refusal


def test_the_tables_of_a_transaction_job_and_its_own_table() -> None:
    assert rules.tables_refusal(J, None, ["db.any"]) is None
    single = JobFacts(target=T, mode="attach")
    assert rules.tables_refusal(J, single, [T]) is None
    refusal = rules.tables_refusal(J, single, [T, "db.u"])
    assert refusal and "also writes db.u" in refusal
    assert rules.primary_target(None, ["db.z", "db.b"]) == "db.b"
    assert rules.primary_target(single, ["db.b"]) == T


def test_the_job_meta_json_of_today_reads_as_job_facts() -> None:
    meta = {
        "job": J, "target": T, "mode": "dedup", "url": "http://h:8123",
        "staging_database": "txsink_staging", "query_id": "q", "created_at": 1.0,
        "shards": ["http://a:1"], "targets": {T: "attach"},
    }  # fmt: skip
    facts = JobFacts.from_meta(meta)
    assert facts == JobFacts(T, ("http://a:1",), "http://h:8123", {T: "attach"}, "dedup", "q")
    assert JobFacts.from_meta({"target": T, "targets": ["not", "a", "dict"]}).targets is None


# ---------------------------------------------------------------- replays

# state, recorded mode, task mode, batch, last committed batch -> verdict
REPLAY_TABLE = [
    (XidState.COMMITTED, "attach", "attach", 5, None, TaskVerdict.SKIP),
    (XidState.COMMITTED, "attach", "attach", 5, 9, TaskVerdict.SKIP),
    (XidState.PREPARED, "attach", "attach", 5, 4, TaskVerdict.WRITE),
    (XidState.PREPARED, "attach", "dedup", 5, 4, TaskVerdict.REFUSE),
    (XidState.ABORTED, "attach", "attach", 5, 4, TaskVerdict.WRITE),
    # the tombstone of an attach replay the commit skipped (its record pruned, its
    # staging rolled back): the ledger decides, as the commit's decide_batch does, so a
    # dedup task after `txsink mode --set dedup` does not write a committed batch again
    (XidState.ABORTED, "attach", "dedup", 3, 5, TaskVerdict.SKIP),
    (None, None, "attach", 5, 5, TaskVerdict.SKIP),  # pruned by retention
    (None, None, "attach", 3, 5, TaskVerdict.SKIP),
    (None, None, "attach", 6, 5, TaskVerdict.WRITE),
    (None, None, "attach", 6, None, TaskVerdict.WRITE),  # nothing committed yet
    (None, None, "attach", None, 5, TaskVerdict.WRITE),  # a save without txn_version
]


@pytest.mark.parametrize(("state", "recorded", "task", "batch", "last", "want"), REPLAY_TABLE)
def test_every_row_of_the_replay_table(
    state: XidState | None,
    recorded: str | None,
    task: str,
    batch: int | None,
    last: int | None,
    want: TaskVerdict,
) -> None:
    decision = rules.task_replay(J, "b5", task, state, recorded, batch, last)
    assert decision.verdict is want
    assert rules.is_replay(state, batch, last) is (want is TaskVerdict.SKIP)
    if want is TaskVerdict.REFUSE:
        assert "txsink recover --job j" in decision.reason


def test_a_refusal_of_the_rules_is_raised_as_a_config_error_by_the_committer() -> None:
    registry = MemoryRegistry()
    registry.ensure_job(J, {"job": J, "target": "db.other", "mode": "attach"})
    with pytest.raises(ConfigError, match=r"writes to db\.other, not db\.t"):
        epoch_for_run(_handle(registry), "run-1", "attach")  # type: ignore[arg-type]


@pytest.mark.parametrize("shards", [(), ("http://h:8123", "http://b:8123")])
def test_a_job_node_created_blank_refuses_no_writer_at_takeover(shards) -> None:
    """A job node that records nothing (``Transactor.begin()`` without meta) identifies
    no target, shard list or tables: validation lets any writer through, and the takeover
    must agree (a refusal there comes after dedup-mode rows are already visible)."""
    registry = MemoryRegistry()
    registry.ensure_job(J, {})
    assert rules.takeover_refusal(J, JobFacts.of(registry.job_meta(J)), JobFacts(target=T,
        shards=shards), lambda: 0) is None  # fmt: skip
    options = {"url": "http://h:8123", "keeper": "k:2181", "table": T, "job": J}
    if shards:
        options |= {"shards": ",".join(shards), "shard_by": "id"}
    handle = job_handle(WriterConfig.from_options(options), registry, MemoryWarehouse())
    epoch_for_run(handle, "run-1", "attach")  # type: ignore[arg-type]


# ------------------------------------------------------- dedup batches stopped half-way

C, P, AB = XidState.COMMITTED, XidState.PREPARED, XidState.ABORTED


@pytest.mark.parametrize(
    ("state", "batch", "last", "is_open"),
    [
        (None, 7, None, True),  # never prepared: stopped half-way (or in flight)
        (AB, 10, 9, True),  # Spark aborted the save: its blocks stay
        (AB, 7, 9, False),  # a tombstone not newer than the ledger: the commit skips it
        (None, None, 9, True),  # a save without txn_version
        (P, 7, None, False),  # every task finished: a roll-forward commits it
        (C, 7, None, False),  # committed: the records are cleanup leftovers
        (None, 7, 7, False),  # committed and pruned (batch ids are monotonic)
        (None, 8, 7, True),
    ],
)
def test_which_dedup_records_mean_a_batch_stopped_half_way(
    state: XidState | None, batch: int | None, last: int | None, is_open: bool
) -> None:
    assert rules.is_open_dedup(state, batch, last) is is_open


@pytest.mark.parametrize(
    ("state", "batch", "last", "sealed"),
    [
        (None, 7, None, False),  # in flight: its tasks send
        (None, 7, 6, False),
        (AB, 10, 9, False),  # a tombstone: the rerun sends
        (AB, 7, 9, True),  # a tombstone not newer than the ledger: committed before
        (None, None, 9, False),  # a save without txn_version, not prepared
        (P, 7, None, True),  # every task reported: the content is fixed
        (C, 7, None, True),  # committed: its records are deleted, nothing is sent again
        (None, 7, 7, True),  # committed and pruned
    ],
)
def test_which_batches_a_dedup_task_may_no_longer_send_a_block_of(
    state: XidState | None, batch: int | None, last: int | None, sealed: bool
) -> None:
    assert rules.is_sealed(state, batch, last) is sealed


def test_a_batch_stopped_half_way_fences_every_other_xid_and_names_both_ways_out() -> None:
    from txsink.protocol.dedup import BlockFingerprint as F
    from txsink.protocol.dedup import OpenBatch, after, before, open_batch

    half = open_batch(
        "b5", [after([F(0, 10, "x")], 0, 1.0), before([F(0, 10, "y"), F(1, 4, "z")], 0, 1.0)]
    )
    assert half == OpenBatch("b5", partitions=2, finished=1, rows_at_least=20, rows_at_most=24)
    assert rules.open_dedup_refusal(J, "b5", T, [half]) is None  # its own rerun writes
    assert rules.open_dedup_refusal(J, "b6", T, []) is None
    why = rules.open_dedup_refusal(J, "b6", T, [half]) or ""
    assert "xid b6 was not written into db.t" in why and "20 to 24 row(s)" in why
    assert "txn_version=5" in why and "--discard-dedup b5" in why
    adhoc = rules.open_dedup_refusal(J, "b6", T, [OpenBatch("u12", 1, 1, 3, 3)]) or ""
    assert "impossible for a save without txn_version" in adhoc and "3 row(s)" in adhoc
    mark = {"by": "txsink-recover@h:1", "rows": 24}
    gone = rules.discarded_batch(J, "b5", T, mark, streaming=False)
    assert gone.verdict is rules.TaskVerdict.REFUSE
    assert "discarded by the operator (txsink-recover@h:1, 24 row(s)" in gone.reason
    skip = rules.discarded_batch(J, "b5", T, mark, streaming=True)
    assert skip.verdict is rules.TaskVerdict.SKIP
    assert rules.discarded_batch(J, "b5", T, None, streaming=False).verdict.value == "write"


def test_a_takeover_counts_one_recovery_and_the_runs_next_commits_none(monkeypatch) -> None:
    """The committer knows a commit took the job over from the takeover itself (no
    extra read of the epoch before it): one recovery counted per run, not per batch."""
    import txsink.metrics
    from txsink import committer
    from txsink.spark.messages import TxCommitMessage, WritePlan

    counted: list[dict[str, int]] = []
    monkeypatch.setattr(txsink.metrics, "count", lambda _cfg, **c: counted.append(c))
    registry = MemoryRegistry()
    handle = _handle(registry)
    plan = WritePlan(handle.config, "attach")  # type: ignore[attr-defined]
    reads: list[int] = []
    current_epoch = registry.current_epoch

    def counting(job: str) -> object:
        reads[-1] += 1
        return current_epoch(job)

    monkeypatch.setattr(registry, "current_epoch", counting)
    for run, batch in (("run-1", 0), ("run-1", 1), ("run-2", 2), ("run-2", 3)):
        reads.append(0)
        msg = TxCommitMessage(run, f"b{batch}", batch, extra={"mode": "attach"})
        committer._commit_writes(  # type: ignore[arg-type]
            handle, [(plan, [msg])], f"b{batch}", batch, Mode.ATTACH, True, None
        )
    assert [c for c in counted if "recoveries" in c] == [{"recoveries": 1}] * 2
    assert reads[1] == reads[3] == 1, reads  # a run's later commit reads its epoch once
    assert registry.current_epoch(J).owner == "run-2"  # type: ignore[union-attr]
