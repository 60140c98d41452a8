"""The Warehouse contract: invariants every :class:`txsink.ports.warehouse.Warehouse` keeps.

:class:`WarehouseContract` holds the tests; a test module subclasses it and provides one
fixture, ``harness`` (a :class:`Harness`: the warehouse plus the few things a test does
around it that the port does not offer: creating a target, forcing a merge).

- ``tests/unit/test_warehouse_contract.py``: the in-memory twin (``MemoryWarehouse``),
  with full capabilities and with the capabilities of a sharded warehouse;
- ``tests/integration/test_warehouse_contract.py``: ``ClickHouseWarehouse`` on the
  embedded server and ``ShardedWarehouse`` on two embedded servers.

A case that needs a capability the warehouse lacks is skipped with a reason naming the
capability; :meth:`WarehouseContract.test_a_missing_capability_raises_naming_it` checks
that the lacking warehouse refuses it with
:class:`~txsink.ports.warehouse.WarehouseCapabilityMissing`.
"""

from __future__ import annotations

import time
from typing import Protocol

import pyarrow as pa
import pytest

from txsink.errors import ConfigError, RetryableConflict, TxSinkError
from txsink.ports.warehouse import Warehouse, WarehouseCapabilityMissing
from txsink.protocol.ids import batch_claim_name, batch_staging_name, run_tag, staging_name

JOB = "wh-contract"
JAN, FEB, MAR = "202401", "202402", "202403"
BLOCK = {"block_rows": 1000, "block_bytes": 1 << 20}


class Harness(Protocol):
    """A warehouse under test and what the tests do around it."""

    wh: Warehouse

    def target(self, name: str, *, dedup_window: int = 0) -> str:
        """Create target ``<db>.<name>`` (``p UInt32`` partition key, ``id UInt64``) on
        every server of the warehouse; returns ``db.name``."""
        ...

    def staging(self, task: int, xid: str = "b1") -> str:
        """A staging table name for task ``task`` (on a shard of the warehouse's)."""
        ...

    def merge(self, target: str, partition_id: str) -> None:
        """Make the server merge the parts of one target partition into one."""
        ...


def rows(ids: range, pid: str) -> pa.RecordBatch:
    return pa.record_batch(
        {
            "p": pa.array([int(pid)] * len(ids), pa.uint32()),
            "id": pa.array(list(ids), pa.uint64()),
        }
    )


def staged(h: Harness, target: str, task: int, *blocks: pa.RecordBatch, xid: str = "b1") -> str:
    """Create a staging table of ``target`` and insert ``blocks`` (one insert block each)."""
    name = h.staging(task, xid)
    h.wh.create_staging(target, name)
    for block in blocks:
        h.wh.insert_blocks(name, [block], **BLOCK)
    return name


def evidence(h: Harness, staging: str) -> dict[str, tuple[str, ...]]:
    return {pid: ids for pid, (_, ids) in h.wh.staged_partitions(staging, True).items()}


def need(h: Harness, capability: str) -> None:
    if not getattr(h.wh.capabilities, capability):
        pytest.skip(f"the warehouse lacks capability {capability!r}")


class WarehouseContract:
    """Every invariant of the port; subclass and provide the ``harness`` fixture."""

    # ------------------------------------------------------------------ staging

    def test_a_missing_staging_table_is_none_and_an_empty_one_has_no_partitions(
        self, harness: Harness
    ) -> None:
        target = harness.target("t")
        name = harness.staging(1)
        assert harness.wh.staging_view([name]) == {name: None}
        harness.wh.create_staging(target, name)
        assert harness.wh.staging_view([name]) == {name: {}}
        assert harness.wh.list_staging(_prefix(name)) == [name]

    def test_staged_rows_are_every_row_sent_per_partition(self, harness: Harness) -> None:
        target = harness.target("t")
        name = staged(harness, target, 1, rows(range(5), JAN), rows(range(5, 8), FEB))
        staged(harness, target, 1, rows(range(3), JAN), xid="b0")  # another table
        assert harness.wh.staging_view([name]) == {name: {JAN: 5, FEB: 3}}
        sizes = harness.wh.staging_sizes(_prefix(name))
        assert sizes[name]["rows"] == 8

    def test_the_staged_parts_of_many_tables_are_each_tables_own(self, harness: Harness) -> None:
        target = harness.target("t")
        full = staged(harness, target, 1, rows(range(5), JAN), rows(range(5, 8), FEB))
        empty, missing = harness.staging(2), harness.staging(3)
        harness.wh.create_staging(target, empty)
        read = harness.wh.staged_partitions_of([full, empty, missing])
        assert read == {full: harness.wh.staged_partitions(full), empty: {}, missing: None}
        assert {pid: n for pid, (n, _) in (read[full] or {}).items()} == {JAN: 5, FEB: 3}

    def test_the_commit_look_reads_the_staged_parts_and_lists_one_xids_staging(
        self, harness: Harness
    ) -> None:
        """The commit's one read: what staged_partitions_of reads, the bytes per
        partition id, and every staging table of the xid, asked for or not (a losing
        attempt's); another xid's (b10 shares b1's first characters) is not listed."""
        target = harness.target("t")
        full = staged(harness, target, 1, rows(range(5), JAN), rows(range(5, 8), FEB))
        loser = staged(harness, target, 2, rows(range(2), JAN))
        other = staged(harness, target, 1, rows(range(3), JAN), xid="b10")
        missing = harness.staging(3)
        listing = f"{_prefix(full)}__b1__"
        look = harness.wh.commit_look([full, missing], views_of=target, listing=listing)
        assert look.staged == harness.wh.staged_partitions_of([full, missing])
        assert set(look.sizes) == {JAN, FEB} and all(n > 0 for n in look.sizes.values())
        assert look.views == ()
        assert loser in look.listed and full in look.listed and other not in look.listed
        assert harness.wh.commit_look([], listing=listing).listed == look.listed

    def test_every_staged_part_has_its_own_evidence_id(self, harness: Harness) -> None:
        target = harness.target("t")
        name = staged(harness, target, 1, rows(range(4), JAN), rows(range(4, 10), JAN))
        part_rows = harness.wh.staged_part_rows(name)
        assert sorted(part_rows[JAN].values()) == [4, 6]
        total, ids = harness.wh.staged_partitions(name, every_part=True)[JAN]
        assert total == 10 and sorted(ids) == sorted(part_rows[JAN])
        assert len(set(ids)) == 2 and all(len(i) == 16 and i != "0" * 16 for i in ids)
        # the manifest keeps the largest parts' ids first
        assert harness.wh.staged_partitions(name)[JAN][1][0] == max(
            part_rows[JAN], key=part_rows[JAN].__getitem__
        )

    def test_tables_txsink_did_not_name_are_never_touched(self, harness: Harness) -> None:
        target = harness.target("t")
        for act in (
            lambda: harness.wh.create_staging(target, "not_txsink"),
            lambda: harness.wh.drop_stagings(["not_txsink"]),
            lambda: harness.wh.move_partition("not_txsink", JAN, target),
        ):
            with pytest.raises(ConfigError, match="not a txsink staging table"):
                act()

    def test_dropping_staging_is_idempotent_and_lists_only_the_jobs_tables(
        self, harness: Harness
    ) -> None:
        target = harness.target("t")
        a = staged(harness, target, 1, rows(range(2), JAN))
        b = staged(harness, target, 2, rows(range(2), JAN))
        assert harness.wh.list_staging(_prefix(a)) == sorted([a, b])
        assert harness.wh.list_staging("another-job") == []
        harness.wh.drop_stagings([a])
        harness.wh.drop_stagings([a])
        assert harness.wh.staging_view([a, b]) == {a: None, b: {JAN: 2}}
        harness.wh.drop_staging(b)
        assert harness.wh.list_staging(_prefix(a)) == []

    def test_a_drop_that_does_not_wait_frees_the_names_at_once(self, harness: Harness) -> None:
        """``wait=False`` (the batch publish's DROP after COMMITTED): the tables are gone
        from every listing and view when the call returns, and the name can be staged
        again at once (the server deletes the data later)."""
        target = harness.target("t")
        a = staged(harness, target, 1, rows(range(2), JAN))
        harness.wh.drop_stagings([a], wait=False)
        harness.wh.drop_stagings([a], wait=False)
        assert harness.wh.staging_view([a]) == {a: None}
        assert harness.wh.list_staging(_prefix(a)) == []
        harness.wh.create_staging(target, a)
        assert harness.wh.staging_view([a]) == {a: {}}

    def test_staging_of_a_missing_target_is_refused(self, harness: Harness) -> None:
        db = harness.target("t").split(".", 1)[0]
        with pytest.raises(ConfigError):
            harness.wh.create_staging(f"{db}.nope", harness.staging(3))

    # ------------------------------------------------------------------ publish

    def test_move_publishes_a_partition_whose_parts_keep_their_uuids(
        self, harness: Harness
    ) -> None:
        target = harness.target("t")
        name = staged(harness, target, 1, rows(range(3), JAN), rows(range(3, 5), FEB))
        ids = evidence(harness, name)
        harness.wh.move_partition(name, JAN, target)
        assert harness.wh.staging_view([name]) == {name: {FEB: 2}}
        assert harness.wh.partition_rows(target) == {JAN: 3}
        assert harness.wh.published_uuids(target, ids[JAN]) == frozenset(ids[JAN])
        assert harness.wh.published_uuids(target, ids[FEB]) == frozenset()

    def test_a_repeated_move_moves_nothing(self, harness: Harness) -> None:
        target = harness.target("t")
        name = staged(harness, target, 1, rows(range(3), JAN), rows(range(3, 5), FEB))
        harness.wh.move_partitions(name, [JAN, FEB, MAR], target)
        harness.wh.move_partitions(name, [JAN, FEB, MAR], target)
        harness.wh.move_partition(name, JAN, target)
        assert harness.wh.partition_rows(target) == {JAN: 3, FEB: 2}
        assert harness.wh.staging_view([name]) == {name: {}}

    def test_a_bad_partition_id_moves_nothing_at_all(self, harness: Harness) -> None:
        target = harness.target("t")
        name = staged(harness, target, 1, rows(range(3), JAN))
        with pytest.raises(ConfigError, match="not a ClickHouse partition id"):
            harness.wh.move_partitions(name, [JAN, "x'; DROP"], target)
        assert harness.wh.partition_rows(target) == {}

    def test_a_merge_in_the_target_keeps_the_moved_uuids_findable(self, harness: Harness) -> None:
        target = harness.target("t")
        a = staged(harness, target, 1, rows(range(3), JAN))
        b = staged(harness, target, 2, rows(range(3, 7), JAN))
        ids = evidence(harness, a)[JAN] + evidence(harness, b)[JAN]
        harness.wh.move_partition(a, JAN, target)
        harness.wh.move_partition(b, JAN, target)
        harness.merge(target, JAN)
        assert harness.wh.partition_rows(target) == {JAN: 7}
        # the replaced parts are outdated, not gone, until the cleanup thread runs
        assert harness.wh.published_uuids(target, ids) == frozenset(ids)

    def test_drop_parts_drops_exactly_the_parts_named_by_evidence(self, harness: Harness) -> None:
        target = harness.target("t")
        name = staged(harness, target, 1, rows(range(4), JAN), rows(range(4, 6), JAN))
        part_rows = harness.wh.staged_part_rows(name)[JAN]
        small = min(part_rows, key=part_rows.__getitem__)
        harness.wh.drop_parts(name, JAN, [small])
        harness.wh.drop_parts(name, JAN, [small])  # a repeat after a lost reply
        harness.wh.drop_parts(name, JAN, [])
        assert harness.wh.staging_view([name]) == {name: {JAN: 4}}

    def test_settle_is_true_on_a_quiet_server(self, harness: Harness) -> None:
        target = harness.target("t")
        name = staged(harness, target, 1, rows(range(2), JAN))
        assert harness.wh.settle([_prefix(name)])
        assert harness.wh.settle([])

    def test_target_info_names_the_table_and_its_partition_key(self, harness: Harness) -> None:
        target = harness.target("t")
        info = harness.wh.target_info(target)
        assert info.name == target and info.partition_key == "p" and info.is_merge_tree
        assert [i.name for i in harness.wh.target_infos(target)] == [target] * len(
            harness.wh.target_infos(target)
        )
        assert harness.wh.dependent_views(target) == ()
        with pytest.raises(ConfigError):
            harness.wh.target_info(target + "_missing")

    # ------------------------------------------------------------------ batch visibility

    def test_attach_all_copies_every_part_with_its_uuid_and_logs_its_tag(
        self, harness: Harness
    ) -> None:
        need(harness, "batch_visibility")
        target = harness.target("t")
        task = staged(harness, target, 1, rows(range(3), JAN), rows(range(3, 5), FEB))
        batch = batch_staging_name(_prefix(task), "b1", target)
        harness.wh.create_batch_staging(batch, task, target)
        harness.wh.create_batch_staging(batch, task, target)  # kept, never replaced
        ids = evidence(harness, task)
        harness.wh.consolidate(task, JAN, batch)
        harness.wh.consolidate(task, FEB, batch)
        harness.wh.consolidate(task, FEB, batch)  # idempotent like a MOVE
        assert harness.wh.staging_view([task, batch]) == {task: {}, batch: {JAN: 3, FEB: 2}}
        claimed = batch_claim_name(batch, "a1b2c3d4e5")
        harness.wh.claim_staging(batch, claimed)
        with pytest.raises(RetryableConflict):
            harness.wh.claim_staging(batch, batch_claim_name(batch, "ffffffff00"))
        harness.wh.attach_all(claimed, target, tag="txsink contract b1")
        assert harness.wh.partition_rows(target) == {JAN: 3, FEB: 2}
        every = ids[JAN] + ids[FEB]
        assert harness.wh.published_uuids(target, every) == frozenset(every)
        assert harness.wh.staging_view([claimed]) == {claimed: {JAN: 3, FEB: 2}}  # a copy
        if harness.wh.capabilities.query_log:
            since = time.time() - 60  # the prepare's time: the log is searched from the day before
            assert harness.wh.attach_logged(target, "txsink contract b1", since)
            assert not harness.wh.attach_logged(target, "txsink contract b2", since)

    def test_a_copy_into_batch_staging_keeps_every_task_part_and_a_gather_makes_one_per_partition(
        self, harness: Harness
    ) -> None:
        """One statement copies every (task staging, partition) into the batch staging:
        task staging keeps its rows, the copies keep their UUIDs (a copy made twice shows
        each twice); a gather of every task's rows into another batch staging leaves one
        new part per partition, rows unchanged, task staging whole; the sizes read with
        the staged parts are per partition id."""
        need(harness, "batch_visibility")
        target = harness.target("t")
        one = staged(harness, target, 1, rows(range(3), JAN), rows(range(3, 5), FEB))
        two = staged(harness, target, 2, rows(range(5, 9), JAN))
        look = harness.wh.commit_look([one, two])
        assert look.staged == harness.wh.staged_partitions_of([one, two])
        assert set(look.sizes) == {JAN, FEB} and all(n > 0 for n in look.sizes.values())
        assert (look.views, look.listed) == ((), ())  # not asked for
        batch = batch_staging_name(_prefix(one), "b1", target)
        harness.wh.create_batch_staging(batch, one)
        harness.wh.copy_into_batch(batch, [(one, ""), (two, JAN)])  # "": every partition
        view = harness.wh.staging_view([one, two, batch])
        assert view == {one: {JAN: 3, FEB: 2}, two: {JAN: 4}, batch: {JAN: 7, FEB: 2}}
        copied = harness.wh.staged_partitions(batch, every_part=True)
        mine = {
            **{u: 1 for u in evidence(harness, one)[JAN]},
            **{u: 1 for u in evidence(harness, two)[JAN]},
        }
        assert sorted(copied[JAN][1]) == sorted(mine)
        harness.wh.copy_into_batch(batch, [(two, JAN)])  # copies again: never repeated blindly
        assert harness.wh.staging_view([batch])[batch] == {JAN: 11, FEB: 2}
        gathered = batch_staging_name(_prefix(one), "b2", target)
        harness.wh.create_batch_staging(gathered, "", target)
        columns = harness.wh.commit_look([], views_of=target).columns
        assert columns  # the target's stored columns, in order
        harness.wh.gather_into_batch(gathered, [one, two], columns, 9)
        merged = harness.wh.staged_partitions(gathered, every_part=True)
        assert {p: (n, len(u)) for p, (n, u) in merged.items()} == {JAN: (7, 1), FEB: (2, 1)}
        assert not set(merged[JAN][1]) & set(mine)  # new parts, not copies
        assert harness.wh.staging_view([one, two]) == {one: {JAN: 3, FEB: 2}, two: {JAN: 4}}
        with pytest.raises(RetryableConflict):  # rows written other than the manifest's
            harness.wh.gather_into_batch(gathered, [two], columns, 5)
        shape = harness.wh.commit_look([], views_of=target).shape
        assert shape is not None  # a plain target: created and filled in one statement
        made = batch_staging_name(_prefix(one), "b3", target)
        harness.wh.gather_into_batch(made, [one, two], columns, 9, create=shape)
        merged = harness.wh.staged_partitions(made, every_part=True)
        assert {p: (n, len(u)) for p, (n, u) in merged.items()} == {JAN: (7, 1), FEB: (2, 1)}
        with pytest.raises(TxSinkError):  # made already: never made twice
            harness.wh.gather_into_batch(made, [one, two], columns, 9, create=shape)
        assert harness.wh.staging_view([made])[made] == {JAN: 7, FEB: 2}

    def test_the_attach_probe_lets_a_writer_with_the_grants_through_and_changes_nothing(
        self, harness: Harness
    ) -> None:
        """``attach_refusal`` asks the server about the ATTACH ``attach_all`` sends (the
        harness's user holds every grant): "" here; the target gains nothing, staging
        keeps what it had and gains no table; a missing target is a ConfigError."""
        need(harness, "batch_visibility")
        target = harness.target("t")
        task = staged(harness, target, 1, rows(range(3), JAN))
        before = harness.wh.list_staging(_prefix(task))
        assert harness.wh.attach_refusal(target) == ""
        assert harness.wh.partition_rows(target) == {}
        assert harness.wh.list_staging(_prefix(task)) == before
        assert harness.wh.staging_view([task]) == {task: {JAN: 3}}
        with pytest.raises(ConfigError):
            harness.wh.attach_refusal(f"{target}_missing")

    # ------------------------------------------------------------------ other capabilities

    def test_direct_inserts_with_a_token_are_deduplicated_by_the_target(
        self, harness: Harness
    ) -> None:
        need(harness, "direct_insert")
        target = harness.target("t", dedup_window=100)

        def tokens(i: int) -> dict[str, str]:
            return {"insert_deduplication_token": f"contract:{i}"}

        batches = [rows(range(3), JAN), rows(range(3, 5), FEB)]
        for _ in range(2):  # a replay of the same blocks
            stats = harness.wh.insert_blocks(
                target, batches, block_rows=3, block_bytes=1 << 20, settings=tokens
            )
            assert (stats.rows, stats.blocks) == (5, 2)
        assert harness.wh.partition_rows(target) == {JAN: 3, FEB: 2}

    def test_rows_per_shard_add_up_to_the_table(self, harness: Harness) -> None:
        need(harness, "per_shard_counts")
        target = harness.target("t")
        for task in range(4):
            name = staged(harness, target, task, rows(range(10 * task, 10 * task + 3), JAN))
            harness.wh.move_partition(name, JAN, target)
        by_shard = harness.wh.partition_rows_by_shard(target)
        assert sum(s.get(JAN, 0) for s in by_shard) == harness.wh.partition_rows(target)[JAN]
        assert harness.wh.partition_rows(target) == {JAN: 12}

    def test_a_missing_capability_raises_naming_it(self, harness: Harness) -> None:
        caps = harness.wh.capabilities
        target = harness.target("t")
        name = staged(harness, target, 1, rows(range(2), JAN))
        batch = batch_staging_name(_prefix(name), "b1", target)
        checks = {
            "batch_visibility": lambda: harness.wh.create_batch_staging(batch, name, target),
            "query_log": lambda: harness.wh.attach_logged(target, "t", 0.0),
            "direct_insert": lambda: harness.wh.insert_blocks(target, [], **BLOCK),
            "per_shard_counts": lambda: harness.wh.partition_rows_by_shard(target),
            "clusters": lambda: harness.wh.cluster_replicas("c"),
        }
        lacking = [c for c in checks if not getattr(caps, c)]
        if not lacking:
            pytest.skip("the warehouse has every capability")
        for capability in lacking:
            with pytest.raises(WarehouseCapabilityMissing, match=capability) as info:
                checks[capability]()
            assert info.value.capability == capability


def _prefix(staging: str) -> str:
    """The job prefix of a staging name (what ``list_staging`` takes)."""
    return staging.split("__", 1)[0]


def contract_staging_name(task: int, xid: str = "b1", shard: int | None = None) -> str:
    return staging_name(JOB, xid, run_tag("contract"), 0, 0, task, shard=shard).table
