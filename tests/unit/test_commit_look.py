"""The commit's one read before the prepare (issue 39): the staged parts, the target's
views and the xid's staging tables come from one warehouse call; a losing attempt's
staging found there is dropped once the batch is committed, and a view that appeared
since validation refuses the batch before anything is prepared. Memory twins."""

from __future__ import annotations

from typing import Any

import pytest

from txsink import committer
from txsink.config import WriterConfig
from txsink.driver import job_handle
from txsink.errors import ConfigError, TxSinkError
from txsink.ports.registry_memory import MemoryRegistry
from txsink.ports.warehouse_memory import MemoryWarehouse
from txsink.protocol.ids import run_tag, staging_name
from txsink.protocol.states import Mode, XidState
from txsink.protocol.visibility import parts_per_partition
from txsink.spark.messages import TxCommitMessage, WritePlan

JOB, TABLE = "orders", "db.t"


def setup() -> tuple[Any, MemoryRegistry, MemoryWarehouse, WritePlan]:
    registry, wh = MemoryRegistry(), MemoryWarehouse()
    config = WriterConfig.from_options(
        {"url": "http://h:8123", "keeper": "k:2181", "table": TABLE, "job": JOB}
    )
    handle = job_handle(config, registry, wh)
    committer.epoch_for_run(handle, "run-1", "attach")  # the run's takeover, done
    return handle, registry, wh, WritePlan(config, "attach")


def task(handle: Any, wh: MemoryWarehouse, attempt: int, ids: list[int], xid: str = "b1") -> str:
    name = staging_name(
        JOB, xid, run_tag("run-1"), 0, attempt, 10 + attempt, handle.transactor.namespace
    ).table
    wh.stage(name, {"202401": ids})
    return name


def message(table: str, rows: int, batch: int = 1) -> TxCommitMessage:
    return TxCommitMessage(
        "run-1", f"b{batch}", batch, staging=(table,), inserted=((table, rows),),
        extra={"mode": "attach"},
    )  # fmt: skip


def test_a_losing_attempts_staging_is_listed_by_the_one_read_and_dropped_after_commit() -> None:
    handle, registry, wh, plan = setup()
    won = task(handle, wh, 0, [1, 2, 3])
    lost = task(handle, wh, 1, [1, 2, 3])  # a speculative copy whose result Spark dropped
    wh.fail_next("list_staging")  # the commit lists nothing apart from its one read
    wh.fail_next("dependent_views")
    out = committer._commit_writes(  # type: ignore[arg-type]
        handle, [(plan, [message(won, 3)])], "b1", 1, Mode.ATTACH, False, None
    )
    assert out["action"] == "committed"
    assert wh.target_ids(TABLE) == [1, 2, 3]  # the winner's rows, once
    assert lost not in wh.staging and won not in wh.staging
    record = registry.get(JOB, "b1")
    assert record is not None and record.state is XidState.COMMITTED
    assert record.staging_tables == (won,)


def test_a_view_that_appeared_since_validation_refuses_the_batch_before_its_prepare() -> None:
    handle, registry, wh, plan = setup()
    won = task(handle, wh, 0, [1, 2])
    wh.views[TABLE] = ("db.mv",)
    with pytest.raises(ConfigError, match=r"db\.mv now read from db\.t.*Nothing was published"):
        committer._commit_writes(  # type: ignore[arg-type]
            handle, [(plan, [message(won, 2)])], "b1", 1, Mode.ATTACH, False, None
        )
    assert registry.get(JOB, "b1") is None  # nothing prepared
    assert wh.target_ids(TABLE) == [] and won in wh.staging


def test_a_failed_stray_drop_never_reports_a_committed_batch_failed(monkeypatch) -> None:
    """A save without txn_version that a caller sees failed is run again: the sweep after
    COMMITTED must not turn the commit into a failure."""
    from txsink.errors import UnavailableError

    handle, _, wh, plan = setup()
    won = task(handle, wh, 0, [1, 2])
    lost = task(handle, wh, 1, [1, 2])

    def down(*_: Any) -> list[str]:
        raise UnavailableError("Keeper unreachable (injected)")

    monkeypatch.setattr(handle.transactor, "roll_back", down)
    out = committer._commit_writes(  # type: ignore[arg-type]
        handle, [(plan, [message(won, 2)])], "b1", 1, Mode.ATTACH, False, None
    )
    assert out["action"] == "committed" and wh.target_ids(TABLE) == [1, 2]
    assert lost in wh.staging  # left for the next takeover or `txsink recover`


def test_a_late_losing_attempt_of_the_previous_batch_is_dropped_by_the_next_commit() -> None:
    """A zombie attempt of batch 0 that made its staging after batch 0's commit read is
    dropped once batch 1 commits; another xid's staging is not the stream's to drop."""
    handle, _, wh, plan = setup()
    first = task(handle, wh, 0, [1], xid="b0")
    committer._commit_writes(  # type: ignore[arg-type]
        handle, [(plan, [message(first, 1, batch=0)])], "b0", 0, Mode.ATTACH, True, None
    )
    late = task(handle, wh, 1, [1], xid="b0")  # after batch 0's read
    other = task(handle, wh, 0, [7], xid="u-other")
    second = task(handle, wh, 0, [2])
    committer._commit_writes(  # type: ignore[arg-type]
        handle, [(plan, [message(second, 1)])], "b1", 1, Mode.ATTACH, True, None
    )
    assert wh.target_ids(TABLE) == [1, 2]
    assert late not in wh.staging and other in wh.staging


def test_parts_per_partition_counts_every_tasks_parts_and_an_unknown_as_several() -> None:
    """What spares the OPTIMIZE of a batch whose partitions have one part each (a task per
    partition value): parts counted over every task's staging; an entry without evidence
    ids is counted as several, so that it is merged rather than guessed single."""
    from txsink.protocol.states import StagedPart

    found = [
        StagedPart("s0", "202401", 3, uuids=("a",)),
        StagedPart("s1", "202401", 2, uuids=("b", "c")),
        StagedPart("s1", "202402", 5, uuids=("d",)),
        StagedPart("s2", "202403", 1),
    ]
    assert parts_per_partition(found) == {"202401": 3, "202402": 1, "202403": 2}


def test_the_read_checks_the_columns_the_values_were_checked_for_and_refuses_the_unfit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What a task no longer reads back: the commit asks for the DataFrame's columns only
    (not one it never writes), never for a sharded job's (each shard has its own), and a
    staging found unfit refuses the batch before anything is prepared."""
    import dataclasses

    from txsink.ports.warehouse import ColumnInfo, TargetInfo

    handle, registry, wh, plan = setup()
    cols = (ColumnInfo("id", "Int64"), ColumnInfo("note", "String"), ColumnInfo("v", "UInt8"))
    info = TargetInfo("db", "t", "MergeTree", columns=cols)
    plan = dataclasses.replace(plan, target_info=info, written=("id", "v"))
    won = task(handle, wh, 0, [1, 2])
    asked: list[Any] = []
    real = wh.commit_look

    def look(tables: Any, **kwargs: Any) -> Any:
        asked.append(kwargs.get("validated"))
        out = real(tables, **kwargs)
        return (
            dataclasses.replace(out, unfit={won: "its columns differ"}) if len(asked) > 1 else out
        )

    monkeypatch.setattr(wh, "commit_look", look)
    committer.staged_parts(handle, plan, [message(won, 2)], "b1")
    assert asked == [(("id", "Int64"), ("v", "UInt8"))]
    with pytest.raises(TxSinkError, match=f"{won} cannot be published: its columns differ"):
        committer._commit_writes(  # type: ignore[arg-type]
            handle, [(plan, [message(won, 2)])], "b1", 1, Mode.ATTACH, False, None
        )
    assert registry.get(JOB, "b1") is None and wh.target_ids(TABLE) == []
    sharded = dataclasses.replace(
        plan, config=dataclasses.replace(plan.config, shards=("http://a:8123", "http://b:8123"))
    )
    asked.clear()
    monkeypatch.setattr(wh, "commit_look", lambda tables, **kw: asked.append(kw) or real(tables))
    committer.staged_parts(handle, sharded, [message(won, 2)], "b1")
    assert asked[0]["validated"] is None
