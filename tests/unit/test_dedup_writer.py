"""The dedup writer over in-memory stores: pooled connections, borrowed and given back,
and every ClickHouse statement sent through the dedup_insert adapter."""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from txsink import driver
from txsink.config import WriterConfig
from txsink.errors import HalfVisibleBatch
from txsink.ports.registry_memory import MemoryRegistry
from txsink.protocol.ids import dedup_token, seal_tag, staging_prefix
from txsink.spark.dedup_write import write_dedup
from txsink.spark.messages import WritePlan
from txsink.spark.task import Task

OPTIONS = {"url": "http://h:8123", "keeper": "k:2181", "table": "db.t", "job": "j"}


class Client:
    """Answers the window query as for a target whose window cannot be observed."""

    def __init__(self) -> None:
        self.queries: list[str] = []

    def query_rows(self, sql: str, **_: Any) -> list[tuple[Any, ...]]:
        self.queries.append(sql)
        row = ("Distributed", "Distributed(c, db, t_local)", 0, 0, 1.0)
        # the first observation also carries the server's window defaults (none here)
        # and the target's column types
        return [(*row, [], [("id", "Int64")])] if "system.merge_tree_settings" in sql else [row]


class Warehouse:
    def __init__(self) -> None:
        self.client = Client()
        self.inserts: list[tuple[str, int, dict[str, Any]]] = []
        self.guards: list[Any] = []
        self.refuse: Exception | None = None  # what the server answers every insert

    def insert_blocks(self, table: str, batches: Any, **kw: Any) -> None:
        if self.refuse is not None:
            raise self.refuse
        rows = sum(b.num_rows for b in batches)
        self.inserts.append((table, rows, kw["settings"]))
        self.guards.append(kw["guard"])


@pytest.fixture
def stores(monkeypatch: pytest.MonkeyPatch) -> tuple[MemoryRegistry, Warehouse, list[str]]:
    registry, warehouse, loans = MemoryRegistry(), Warehouse(), []

    @contextlib.contextmanager
    def lend(name: str, obj: Any) -> Iterator[Any]:
        loans.append(f"lend {name}")
        yield obj
        loans.append(f"back {name}")

    monkeypatch.setattr(driver, "borrowed_registry", lambda _c: lend("keeper", registry))
    monkeypatch.setattr(driver, "borrowed_warehouse", lambda _c: lend("clickhouse", warehouse))
    return registry, warehouse, loans


def plan() -> WritePlan:
    return WritePlan(WriterConfig.from_options({**OPTIONS, "block_rows": "2"}), "dedup")


def rows(n: int) -> Iterator[pa.RecordBatch]:
    return iter(pa.table({"id": list(range(n))}).to_batches())


def task(attempt: int) -> Task:
    return Task("run", "b0", 0, 3, attempt, 100 + attempt, "q", 0.0)


def test_a_dedup_task_borrows_its_connections_from_the_pool_and_gives_them_back(
    stores: tuple[MemoryRegistry, Warehouse, list[str]],
) -> None:
    _, warehouse, loans = stores
    message = write_dedup(plan(), task(0), rows(5))
    assert (message.rows, message.extra["decision"], message.extra["mode"]) == (5, "NEW", "dedup")
    assert loans == ["lend keeper", "lend clickhouse", "back clickhouse", "back keeper"]
    tokens = [settings["insert_deduplication_token"] for _, _, settings in warehouse.inserts]
    assert tokens == [dedup_token("j", "b0", 3, i) for i in range(3)]
    assert [n for _, n, _ in warehouse.inserts] == [2, 2, 1]


def test_a_replayed_dedup_task_sends_nothing_and_an_empty_one_borrows_no_client(
    stores: tuple[MemoryRegistry, Warehouse, list[str]],
) -> None:
    _, warehouse, loans = stores
    write_dedup(plan(), task(0), rows(5))
    warehouse.inserts.clear()
    loans.clear()
    replay = write_dedup(plan(), task(1), rows(5))
    assert replay.extra["decision"] == "SAME" and warehouse.inserts == []
    loans.clear()
    other = Task("run", "b0", 0, 4, 0, 7, "q", 0.0)  # Spark partition 4: no rows
    assert write_dedup(plan(), other, iter(())).rows == 0
    assert loans == ["lend keeper", "back keeper"]


def test_a_failing_dedup_task_hands_its_error_to_the_pool_which_closes_not_lends(
    stores: tuple[MemoryRegistry, Warehouse, list[str]],
) -> None:
    _, _, loans = stores

    def dying() -> Iterator[pa.RecordBatch]:
        yield from rows(3)
        raise RuntimeError("executor lost")

    with pytest.raises(RuntimeError):
        write_dedup(plan(), task(0), dying())
    assert "back keeper" not in loans and "back clickhouse" not in loans


# ------------------------------------------------------- a batch stopped half-way fences


def _task(xid: str, batch: int | None, partition: int = 0) -> Task:
    return Task("run", xid, batch, partition, 0, 1, "q", 0.0)


def test_another_xid_stopped_half_way_fences_the_job_until_it_is_rerun(
    stores: tuple[MemoryRegistry, Warehouse, list[str]],
) -> None:
    registry, warehouse, _ = stores

    def failing() -> Iterator[pa.RecordBatch]:
        yield from rows(5)  # two blocks of two rows are sent, then the task dies
        raise RuntimeError("executor lost")

    with pytest.raises(RuntimeError):
        write_dedup(plan(), _task("b0", 0), failing())
    assert [n for _, n, _ in warehouse.inserts] == [2, 2]
    warehouse.inserts.clear()
    for other in (_task("b1", 1), _task("u0123456789ab", None)):
        with pytest.raises(HalfVisibleBatch, match="b0 of this job stopped half-way") as caught:
            write_dedup(plan(), other, rows(3))
        assert "2 to 4 row(s) from 1 Spark partition(s), 0 of them finished" in str(caught.value)
    assert warehouse.inserts == []  # nothing of another xid was sent
    write_dedup(plan(), _task("b0", 0, partition=1), rows(1))  # its own xid still writes
    write_dedup(plan(), _task("b0", 0), rows(5))  # the rerun resumes
    # once b0 is committed its leftover records no longer fence (a crash before cleanup)
    _commit(registry, "b0", 0)
    write_dedup(plan(), _task("b1", 1), rows(3))


def _commit(registry: MemoryRegistry, xid: str, batch: int) -> None:
    from txsink.protocol.states import Mode, XidRecord, XidState

    epoch = registry.take_epoch("j", "driver")
    record = XidRecord("j", xid, batch, XidState.PREPARED, epoch.number, Mode.DEDUP, "db.t")
    record = registry.prepare(epoch, record)
    registry.commit(epoch, record, 2.0)


def test_a_discarded_xid_is_never_written_again_and_fences_nothing(
    stores: tuple[MemoryRegistry, Warehouse, list[str]],
) -> None:
    registry, warehouse, _ = stores
    entry = {"status": "BEFORE", "blocks": [[0, 2, "b2:x"]], "rows": 2, "attempt": 0}
    registry.put_blob("j", "dedup/b0/p0", entry)
    registry.put_blob("j", "dedup/b0/discarded", {"by": "txsink-recover@h:1", "rows": 2})
    saving = dataclasses.replace(plan(), xid="b0", batch=0)  # a save with txn_version=0
    with pytest.raises(HalfVisibleBatch, match="discarded by the operator"):
        write_dedup(saving, _task("b0", 0, partition=5), rows(3))
    assert warehouse.inserts == []
    write_dedup(plan(), _task("b1", 1), rows(3))  # the discarded b0 fences nothing
    assert [n for _, n, _ in warehouse.inserts] == [2, 1]


# ------------------------------------------------------------------ entries via the codec

FIXTURES = Path(__file__).parents[1] / "fixtures" / "state_v0"


def _cell(registry: MemoryRegistry) -> Any:
    from txsink.errors import ContentChanged
    from txsink.spark.dedup_write import StateCell

    return StateCell(registry, "j", "dedup/b1/p0", ContentChanged)


def test_a_dedup_entry_of_a_newer_format_is_refused_not_decided_on_or_overwritten() -> None:
    """A newer release's entry may mean something this one cannot tell: deciding blocks
    from it (or rewriting it without its keys) could resend or skip blocks."""
    from txsink.protocol.codec import StateFormatTooNew

    entry = json.loads((FIXTURES / "dedup_before.json").read_text())
    registry = MemoryRegistry()
    registry.ensure_job("j", {"target": "db.t", "mode": "dedup"})
    registry.put_blob("j", "dedup/b1/p0", {**entry, "format": 2, "newer": True})
    with pytest.raises(StateFormatTooNew, match="dedup/b1/p0"):
        _cell(registry)
    assert registry.get_blob("j", "dedup/b1/p0")["newer"] is True  # left as it was


def test_a_dedup_entry_written_now_carries_the_format_and_a_v0_entry_still_reads() -> None:
    entry = json.loads((FIXTURES / "dedup_before.json").read_text())
    registry = MemoryRegistry()
    registry.ensure_job("j", {"target": "db.t", "mode": "dedup"})
    registry.put_blob("j", "dedup/b1/p0", entry)  # as the previous release wrote it
    cell = _cell(registry)
    assert cell.state is not None and cell.state.blocks  # read as before
    from txsink.protocol.dedup import Status

    done = dataclasses.replace(cell.state, status=Status.AFTER)
    assert cell.propose(done)
    assert registry.get_blob("j", "dedup/b1/p0")["format"] == 1


# ------------------------------------------------------------ fingerprints of sliced blocks


def test_a_block_digest_depends_on_its_rows_only_not_on_the_batch_it_was_cut_from() -> None:
    from txsink.spark.dedup_write import fingerprint

    def front(n: int, nulls: bool) -> pa.Table:  # the first two rows of an n-row batch
        s = [f"s{i}" if not (nulls and i == n - 1) else None for i in range(n)]
        return pa.table({"id": list(range(n)), "s": s}).slice(0, 2)

    two = [pa.record_batch({"id": [i], "s": [f"s{i}"]}) for i in range(2)]
    digests = {
        fingerprint(0, block).digest
        for block in (front(4, False), front(50, True), pa.Table.from_batches(two))
    }
    assert len(digests) == 1 and next(iter(digests)).startswith("b3:")


def test_a_partition_recorded_with_the_old_digest_still_replays_as_the_same(
    stores: tuple[MemoryRegistry, Warehouse, list[str]],
) -> None:
    from txsink.protocol import dedup
    from txsink.protocol.codec import encode_partition_state
    from txsink.spark.dedup_write import fingerprint

    registry, warehouse, _ = stores
    table = pa.table({"id": list(range(5))})
    blocks = [table.slice(0, 2), table.slice(2, 2), table.slice(4, 1)]
    old = [fingerprint(i, b, legacy=True) for i, b in enumerate(blocks)]
    assert old[0].digest.startswith("b2:") and old[0] != fingerprint(0, blocks[0])
    registry.put_blob("j", "dedup/b0/p3", encode_partition_state(dedup.after(old, 0, 1.0)))
    replay = write_dedup(plan(), task(1), rows(5))
    assert replay.extra["decision"] == "SAME" and warehouse.inserts == []


# ------------------------------------------- the fence's edges (an adversarial review's)


def _half_write(xid: str, batch: int | None, partition: int = 0) -> None:
    def failing() -> Iterator[pa.RecordBatch]:
        yield from rows(5)
        raise RuntimeError("executor lost")

    with pytest.raises(RuntimeError):
        write_dedup(plan(), _task(xid, batch, partition), failing())


def _ops_stores(registry: MemoryRegistry, warehouse: Any) -> Any:
    """What ``txsink recover`` hands :func:`discard_dedup`: the registry, a warehouse."""
    return type("S", (), {"registry": registry, "warehouse": lambda _self, _meta: warehouse})()


def test_a_discarded_streaming_batch_is_skipped_by_its_tasks_and_its_commit(
    stores: tuple[MemoryRegistry, Warehouse, list[str]],
) -> None:
    from txsink.ops.recovery import discard_dedup
    from txsink.ports.warehouse_memory import MemoryWarehouse
    from txsink.protocol.states import Mode
    from txsink.transactor import Transactor

    registry, warehouse, _ = stores
    _half_write("b7", 7)
    sealed = MemoryWarehouse()
    discard_dedup(_ops_stores(registry, sealed), "j", "b7")
    # sealed on the server too: a zombie task of b7 adds nothing the operator deletes
    assert sealed.seals == {seal_tag(staging_prefix("j", registry.namespace()), "b7")}
    warehouse.inserts.clear()
    message = write_dedup(plan(), _task("b7", 7), rows(5))  # Spark replays batch 7
    assert message.skipped and warehouse.inserts == []
    epoch = registry.take_epoch("j", "run-2")
    result = Transactor(registry, MemoryWarehouse(), "j").commit_batch(
        epoch, "b7", 7, "db.t", message.parts, Mode.DEDUP, streaming=True
    )
    assert result.action == "discarded" and registry.get("j", "b7") is None
    saving = dataclasses.replace(plan(), xid="b7", batch=7)  # a save with txn_version=7
    with pytest.raises(HalfVisibleBatch, match="discarded"):
        write_dedup(saving, _task("b7", 7), rows(5))


def test_a_discarded_saved_batch_is_refused_by_its_task_and_its_commit_with_one_error(
    stores: tuple[MemoryRegistry, Warehouse, list[str]],
) -> None:
    """One rule, one error: the task and the commit of a discarded batch refuse it with
    the same class and text, caught as a half-visible batch and as a configuration
    error (the class the commit raised before)."""
    from txsink.errors import ConfigError
    from txsink.ops.recovery import discard_dedup
    from txsink.ports.warehouse_memory import MemoryWarehouse
    from txsink.protocol.states import Mode
    from txsink.transactor import Transactor

    registry, warehouse, _ = stores
    _half_write("b7", 7)
    discard_dedup(_ops_stores(registry, MemoryWarehouse()), "j", "b7")
    warehouse.inserts.clear()
    saving = dataclasses.replace(plan(), xid="b7", batch=7)  # a save with txn_version=7
    with pytest.raises(HalfVisibleBatch) as by_task:
        write_dedup(saving, _task("b7", 7), rows(5))
    epoch = registry.take_epoch("j", "run-2")
    with pytest.raises(HalfVisibleBatch) as by_commit:
        Transactor(registry, MemoryWarehouse(), "j").commit_batch(
            epoch, "b7", 7, "db.t", (), Mode.DEDUP, streaming=False
        )
    assert type(by_task.value) is type(by_commit.value)
    assert isinstance(by_task.value, ConfigError)
    assert str(by_task.value) == str(by_commit.value)
    assert "discarded by the operator" in str(by_commit.value)
    assert warehouse.inserts == [] and registry.get("j", "b7") is None


def test_a_committed_plain_save_whose_cleanup_failed_never_reads_as_half_visible(
    stores: tuple[MemoryRegistry, Warehouse, list[str]],
) -> None:
    from txsink.dedup_state import open_dedup_batches
    from txsink.errors import UnavailableError
    from txsink.ports.warehouse_memory import MemoryWarehouse
    from txsink.transactor import Transactor

    registry, _, _ = stores
    write_dedup(plan(), _task("u0123456789ab", None), rows(5))
    _commit(registry, "u0123456789ab", None)
    transactor = Transactor(registry, MemoryWarehouse(), "j", retention=0)
    epoch = registry.take_epoch("j", "driver-2")
    real = registry.delete_blobs

    def lost(job: str, key: str) -> None:
        raise UnavailableError("connection loss")

    registry.delete_blobs = lost  # type: ignore[method-assign]
    assert transactor.prune(epoch) == []  # the record stays while its dedup state does
    registry.delete_blobs = real  # type: ignore[method-assign]
    assert open_dedup_batches(registry, "j") == []
    assert transactor.prune(epoch) == ["u0123456789ab"]
    assert registry.blob_children("j", "dedup") == []


def test_the_rerun_of_an_open_batch_writes_while_another_is_open(
    stores: tuple[MemoryRegistry, Warehouse, list[str]],
) -> None:
    registry, _, _ = stores
    _half_write("b0", 0)
    registry.put_blob("j", "dedup/b1/p0", registry.get_blob("j", "dedup/b0/p0") or {})
    write_dedup(plan(), _task("b0", 0), rows(5))
    write_dedup(plan(), _task("b1", 1), rows(5))
    with pytest.raises(HalfVisibleBatch):  # a third xid is still fenced
        write_dedup(plan(), _task("b2", 2), rows(5))


def test_a_rerun_over_fewer_partitions_is_not_committed(
    stores: tuple[MemoryRegistry, Warehouse, list[str]],
) -> None:
    from txsink.errors import ContentChanged
    from txsink.ports.warehouse_memory import MemoryWarehouse
    from txsink.protocol.states import Mode
    from txsink.transactor import Transactor

    registry, _, _ = stores
    _half_write("b0", 0, partition=0)
    _half_write("b0", 0, partition=1)  # p1 sent up to 4 rows
    message = write_dedup(plan(), _task("b0", 0, partition=0), rows(5))  # the rerun: p0 only
    epoch = registry.take_epoch("j", "driver")
    with pytest.raises(ContentChanged, match=r"Spark partition\(s\) 1 of it recorded"):
        Transactor(registry, MemoryWarehouse(), "j").commit_batch(
            epoch, "b0", 0, "db.t", message.parts, Mode.DEDUP, streaming=True
        )
    assert registry.get("j", "b0") is None and registry.blob_children("j", "dedup/b0")


def test_a_discard_of_the_wrong_xid_fences_nobody(
    stores: tuple[MemoryRegistry, Warehouse, list[str]],
) -> None:
    from txsink.errors import ConfigError
    from txsink.ops.recovery import discard_dedup

    registry, _, _ = stores
    writer = registry.take_epoch("j", "streaming-driver")
    with pytest.raises(ConfigError, match="nothing was changed"):
        discard_dedup(_ops_stores(registry, None), "j", "b99")
    current = registry.current_epoch("j")
    assert current is not None and current.number == writer.number


def test_each_block_reads_the_target_in_one_query_the_first_with_the_window_defaults(
    stores: tuple[MemoryRegistry, Warehouse, list[str]],
) -> None:
    _, warehouse, _ = stores
    write_dedup(plan(), task(0), rows(5))  # three blocks
    queries = warehouse.client.queries
    assert len(queries) == 3
    assert ["system.merge_tree_settings" in q for q in queries] == [True, False, False]


def test_a_replay_of_a_complete_partition_reads_nothing_of_the_target(
    stores: tuple[MemoryRegistry, Warehouse, list[str]],
) -> None:
    _, warehouse, _ = stores
    write_dedup(plan(), task(0), rows(5))
    warehouse.client.queries.clear()
    assert write_dedup(plan(), task(1), rows(5)).extra["decision"] == "SAME"
    assert warehouse.client.queries == []  # no counter read ahead for skipped blocks


def test_a_source_failing_after_some_blocks_fails_the_task_after_sending_them(
    stores: tuple[MemoryRegistry, Warehouse, list[str]],
) -> None:
    import threading

    _, warehouse, _ = stores

    def dying() -> Iterator[pa.RecordBatch]:
        yield from rows(4)  # two blocks of two rows, cut in the worker thread
        raise RuntimeError("executor lost")

    with pytest.raises(RuntimeError, match="executor lost"):
        write_dedup(plan(), task(0), dying())
    assert [n for _, n, _ in warehouse.inserts] == [2, 2]
    assert not [t for t in threading.enumerate() if t.name.startswith("txsink-dedup-hash")]


class _CountingClient:
    """A MergeTree target with window 100 whose block counter other writers move on."""

    def __init__(self) -> None:
        self.counter = 1000

    def query_rows(self, sql: str, **_: Any) -> list[tuple[Any, ...]]:
        settings = "MergeTree ORDER BY id SETTINGS non_replicated_deduplication_window = 100"
        row = ("MergeTree", settings, self.counter, self.counter, 1.0)
        return [(*row, [], [("id", "Int64")])] if "system.merge_tree_settings" in sql else [row]


def test_a_replayed_block_whose_token_left_the_window_while_it_was_hashed_is_refused(
    stores: tuple[MemoryRegistry, Warehouse, list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The counter is read after the block's fingerprint: other writers' parts added while
    a re-sent block is hashed count against its window. Read while it was hashed, the
    replay re-sent block 0 after 104 parts followed it in a window of 100 (its token was
    gone: a duplicate), found by the review of issue 29."""
    from txsink.errors import DedupWindowExceeded
    from txsink.spark import dedup_write

    _, warehouse, _ = stores
    client = warehouse.client = _CountingClient()  # type: ignore[assignment]
    inserted = warehouse.insert_blocks

    def insert(table: str, batches: Any, **kw: Any) -> None:
        client.counter += 1
        inserted(table, batches, **kw)

    monkeypatch.setattr(warehouse, "insert_blocks", insert)

    def dying() -> Iterator[pa.RecordBatch]:
        yield from pa.table({"id": [0, 1]}).to_batches()
        raise RuntimeError("executor lost")

    with pytest.raises(RuntimeError, match="executor lost"):
        write_dedup(plan(), task(0), dying())
    assert len(warehouse.inserts) == 1  # block 0 went out, then the task died
    client.counter += 84  # other writers' parts: 85 after block 0, inside the window
    hashing = dedup_write.fingerprint

    def slow(index: int, block: Any, *, legacy: bool = False) -> Any:
        fp = hashing(index, block, legacy=legacy)
        if index == 0:
            client.counter += 20  # ...and 20 more while block 0 is hashed: 105 > 100
        return fp

    monkeypatch.setattr(dedup_write, "fingerprint", slow)
    with pytest.raises(DedupWindowExceeded):
        write_dedup(plan(), task(1), rows(4))
    assert len(warehouse.inserts) == 1, "block 0 was sent again after its token left"


# ------------------------------------------------- attempts that outlive their batch


def _commit_by_another_attempt(registry: MemoryRegistry, warehouse: Warehouse) -> int:
    """Attempt 5 writes the batch and the driver commits it (deleting its dedup records);
    the inserts the warehouse has seen so far."""
    from txsink.ports.warehouse_memory import MemoryWarehouse
    from txsink.protocol.states import Mode
    from txsink.transactor import Transactor

    message = write_dedup(plan(), task(5), rows(5))
    epoch = registry.take_epoch("j", "driver")
    result = Transactor(registry, MemoryWarehouse(), "j").commit_batch(
        epoch, "b0", 0, "db.t", message.parts, Mode.DEDUP, streaming=True
    )
    assert result.action == "committed" and registry.blob_children("j", "dedup") == []
    return len(warehouse.inserts)


def test_an_attempt_whose_first_pull_straddles_the_commit_sends_nothing(
    stores: tuple[MemoryRegistry, Warehouse, list[str]],
) -> None:
    """A zombie (GC pause, partition, speculative loser) passed the replay check, then its
    batch was committed by another attempt while it pulled its first rows: it finds no
    record and must still send nothing (the target's window may have forgotten the
    tokens), leaving no record behind."""
    registry, warehouse, _ = stores
    seen: list[int] = []

    def straddling() -> Iterator[pa.RecordBatch]:
        seen.append(_commit_by_another_attempt(registry, warehouse))
        yield from rows(5)

    message = write_dedup(plan(), task(0), straddling())
    assert len(warehouse.inserts) == seen[0], "the zombie sent blocks of a committed batch"
    assert message.skipped and message.extra["outlived"]
    assert registry.blob_children("j", "dedup") == []


def test_an_attempt_resuming_from_a_record_deleted_under_it_sends_nothing(
    stores: tuple[MemoryRegistry, Warehouse, list[str]],
) -> None:
    """A stale read with no record write after it: the zombie read a dead attempt's
    BEFORE record (so it re-sends the recorded blocks without writing first); the batch
    is committed before its first insert."""
    registry, warehouse, _ = stores
    _half_write("b0", 0, partition=3)  # blocks 0 and 1 sent, 2 recorded BEFORE
    seen: list[int] = []
    observe = warehouse.client.query_rows

    def commit_meanwhile(sql: str, **kw: Any) -> list[tuple[Any, ...]]:
        if not seen:  # the first look at the target, after the zombie read the record
            seen.append(-1)
            seen[0] = _commit_by_another_attempt(registry, warehouse)
        return observe(sql, **kw)

    warehouse.client.query_rows = commit_meanwhile  # type: ignore[method-assign]
    message = write_dedup(plan(), task(0), rows(5))
    assert len(warehouse.inserts) == seen[0], "the zombie re-sent blocks of a committed batch"
    assert message.skipped


def test_a_seal_refusal_keeper_does_not_back_fails_the_task_instead_of_skipping_it(
    stores: tuple[MemoryRegistry, Warehouse, list[str]],
) -> None:
    """A seal row left by another life of the same xid name (the job's state lost and
    started again) must not turn a live batch's tasks into skipped ones: rows lost."""
    from txsink.errors import FencedError

    _registry, warehouse, _ = stores
    warehouse.refuse = FencedError("refused by the server: its batch was sealed")
    with pytest.raises(FencedError):
        write_dedup(plan(), _task("b0", 0), rows(3))
