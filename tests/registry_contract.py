"""The Registry contract: invariants every :class:`txsink.ports.registry.Registry` keeps.

:class:`RegistryContract` holds the tests; a test module subclasses it (``TestX(RegistryContract)``)
and provides two fixtures:

- ``registry``: a fresh, empty registry (one driver);
- ``open_registry``: a callable returning another registry on the SAME store (a second
  driver, a recovery tool), closed by the fixture's owner.

``tests/unit/test_registry_contract.py`` runs them on ``MemoryRegistry``;
``tests/integration/test_registry_zookeeper.py`` runs the same cases on ``KazooRegistry``.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest

from txsink.errors import FencedError, KeeperRequestTooLarge, RetryableConflict
from txsink.ports.ledger import EMPTY_LEDGER
from txsink.ports.manifest_codec import KEEPER_MAX_REQUEST, unpack_record
from txsink.ports.registry import CREATE, BlobConflict, BlobPresent, Registry, XidExists
from txsink.protocol.codec import JobMeta, Ledger, encode_record
from txsink.protocol.ids import staging_name
from txsink.protocol.states import Cut, Epoch, Mode, StagedPart, XidRecord, XidState

JOB = "orders"
OpenRegistry = Callable[[], Registry]


def make_record(
    xid: str = "x-1",
    *,
    job: str = JOB,
    batch: int | None = 1,
    epoch: int = 1,
    parts: dict[str, int] | None = None,
    state: XidState = XidState.PREPARED,
) -> XidRecord:
    parts = {"202401": 3, "202402": 2} if parts is None else parts
    return XidRecord(
        job=job,
        xid=xid,
        batch=batch,
        state=state,
        epoch=epoch,
        mode=Mode.ATTACH,
        target="db.events",
        manifest=tuple(
            StagedPart(table=f"db._stage_{xid}", partition_id=pid, rows=rows, blocks=1)
            for pid, rows in parts.items()
        ),
        created_at=1000.0,
        unknown={"attempt": 0},  # a fact of a newer txsink: kept through every write
    )


def prepared(registry: Registry, epoch: Epoch, xid: str, batch: int = 1, **kw: Any) -> XidRecord:
    return registry.prepare(epoch, make_record(xid, job=epoch.job, batch=batch, **kw))


class RegistryContract:
    """Invariants of the coordination store; see the module docstring for the fixtures."""

    # -- jobs -------------------------------------------------------------------------

    def test_ensure_job_creates_once_and_returns_the_stored_meta(self, registry: Registry) -> None:
        first = registry.ensure_job(JOB, JobMeta(target="db.events", mode="attach"))
        again = registry.ensure_job(JOB, {"target": "db.other", "mode": "dedup"})
        assert first == again == JobMeta(target="db.events", mode="attach")
        assert registry.job_meta(JOB) == first

    def test_job_meta_keeps_keys_of_a_newer_writer_and_takes_a_mode_change(
        self, registry: Registry
    ) -> None:
        registry.ensure_job(JOB, {"target": "db.events", "mode": "attach", "tier": "gold"})
        stored = registry.job_meta(JOB)
        assert stored is not None and stored.unknown == {"tier": "gold"}
        registry.set_job_meta(JOB, replace(stored, mode="dedup", mode_changed_at=5.0))
        assert registry.job_meta(JOB) == replace(stored, mode="dedup", mode_changed_at=5.0)

    def test_unknown_job_has_no_meta_epoch_owner_or_xids(self, registry: Registry) -> None:
        assert registry.job_meta("nobody") is None
        assert registry.current_epoch("nobody") is None
        assert registry.owner("nobody") is None
        assert registry.get("nobody", "x-1") is None
        assert registry.list("nobody") == []
        assert registry.ledger("nobody") == EMPTY_LEDGER

    def test_sync_works_before_the_job_exists_and_changes_nothing(self, registry: Registry) -> None:
        registry.sync("nobody")  # a new run syncs before its first write
        assert registry.job_meta("nobody") is None and registry.list_jobs() == []
        registry.ensure_job(JOB, {"target": "db.events"})
        registry.sync(JOB)
        assert registry.job_meta(JOB) == JobMeta(target="db.events")

    def test_list_jobs_lists_ensured_jobs_sorted(self, registry: Registry) -> None:
        assert registry.list_jobs() == []
        for job in ("b-job", "a-job", "c-job"):
            registry.ensure_job(job, {"target": f"db.{job[0]}"})
        assert registry.list_jobs() == ["a-job", "b-job", "c-job"]

    def test_taking_an_epoch_does_not_make_a_listed_job(self, registry: Registry) -> None:
        registry.take_epoch("only-epoch", "driver-a")
        assert registry.list_jobs() == []
        assert registry.job_meta("only-epoch") is None
        assert registry.ensure_job("only-epoch", {"target": "t"}) == JobMeta(target="t")
        assert registry.list_jobs() == ["only-epoch"]

    def test_a_job_with_only_dedup_state_is_listed(self, registry: Registry) -> None:
        # a dedup job whose first batch stopped half-way: rows in the target, no meta yet
        registry.put_blob("half-job", "dedup/b0/p1", {"status": "BEFORE", "blocks": []})
        registry.put_blob("other", "notes", {"a": 1})
        assert registry.list_jobs() == ["half-job"]
        assert registry.job_meta("half-job") is None

    # -- epochs -----------------------------------------------------------------------

    def test_first_epoch_is_number_one(self, registry: Registry) -> None:
        epoch = registry.take_epoch(JOB, "driver-a")
        assert (epoch.job, epoch.number, epoch.owner) == (JOB, 1, "driver-a")
        assert registry.current_epoch(JOB) == epoch

    def test_takeover_increments_epoch_number(self, registry: Registry) -> None:
        first = registry.take_epoch(JOB, "driver-a")
        second = registry.take_epoch(JOB, "driver-b")
        third = registry.take_epoch(JOB, "driver-a")
        assert [first.number, second.number, third.number] == [1, 2, 3]
        assert len({first.token, second.token, third.token}) == 3
        assert registry.current_epoch(JOB) == third

    def test_epochs_of_different_jobs_are_independent(self, registry: Registry) -> None:
        a = registry.take_epoch("job-a", "d")
        registry.take_epoch("job-b", "d")
        registry.take_epoch("job-b", "d")
        assert registry.current_epoch("job-a") == a
        prepared(registry, a, "x-a")  # job-b's takeovers do not fence job-a

    # -- prepare ----------------------------------------------------------------------

    def test_prepare_stores_the_record_at_version_zero(self, registry: Registry) -> None:
        epoch = registry.take_epoch(JOB, "driver-a")
        record = make_record("x-1")
        stored = registry.prepare(epoch, record)
        assert stored.version == 0
        assert stored.state is XidState.PREPARED
        assert registry.get(JOB, "x-1") == stored
        assert encode_record(stored) == encode_record(record)

    def test_prepare_of_existing_xid_returns_the_existing_record(self, registry: Registry) -> None:
        epoch = registry.take_epoch(JOB, "driver-a")
        stored = prepared(registry, epoch, "x-1", parts={"p": 7})
        with pytest.raises(XidExists) as info:
            prepared(registry, epoch, "x-1", parts={"p": 99})
        assert info.value.existing == stored
        assert isinstance(info.value, RetryableConflict)
        assert registry.get(JOB, "x-1") == stored

    def test_prepare_of_a_committed_record_is_an_illegal_transition(
        self, registry: Registry
    ) -> None:
        epoch = registry.take_epoch(JOB, "driver-a")
        with pytest.raises(ValueError, match="illegal xid transition"):
            registry.prepare(epoch, make_record("x-1", state=XidState.COMMITTED))
        assert registry.get(JOB, "x-1") is None

    def test_stale_epoch_cannot_prepare(self, registry: Registry) -> None:
        old = registry.take_epoch(JOB, "driver-a")
        registry.take_epoch(JOB, "driver-b")
        with pytest.raises(FencedError) as info:
            prepared(registry, old, "x-1")
        message = str(info.value)
        assert JOB in message and "epoch 1" in message and "epoch 2" in message
        assert registry.get(JOB, "x-1") is None
        assert registry.list(JOB) == []

    def test_stale_epoch_is_fenced_before_its_transition_is_judged(
        self, registry: Registry
    ) -> None:
        old = registry.take_epoch(JOB, "driver-a")
        registry.take_epoch(JOB, "driver-b")
        with pytest.raises(FencedError):
            registry.prepare(old, make_record("x-1", state=XidState.COMMITTED))

    def test_stale_epoch_cannot_overwrite_an_existing_xid(self, registry: Registry) -> None:
        old = registry.take_epoch(JOB, "driver-a")
        stored = prepared(registry, old, "x-1")
        registry.take_epoch(JOB, "driver-b")
        with pytest.raises(FencedError):
            prepared(registry, old, "x-1")
        assert registry.get(JOB, "x-1") == stored

    # -- commit -----------------------------------------------------------------------

    def test_commit_updates_ledger_and_assigns_sequence(self, registry: Registry) -> None:
        epoch = registry.take_epoch(JOB, "driver-a")
        one = prepared(registry, epoch, "x-1", batch=1, parts={"a": 3, "b": 2})
        two = prepared(registry, epoch, "x-2", batch=2, parts={"a": 4})
        done_one = registry.commit(epoch, one, committed_at=2000.0)
        done_two = registry.commit(epoch, two, committed_at=3000.0)
        assert done_one.state is XidState.COMMITTED and done_one.committed_at == 2000.0
        assert [done_one.seq, done_two.seq] == [1, 2]
        assert done_one.unknown["attempt"] == 0  # unknown facts are kept, seq added
        assert done_one.version == one.version + 1
        assert registry.get(JOB, "x-1") == done_one
        assert registry.get(JOB, "x-2") == done_two
        assert registry.ledger(JOB) == Ledger(
            seq=2,
            committed=2,
            rows=9,
            last_batch=2,
            last_commit_at=3000.0,
            partitions={"a": 7, "b": 2},
            partition_seq={"a": 2, "b": 1},
        )

    def test_commit_with_stale_version_is_a_conflict(self, registry: Registry) -> None:
        epoch = registry.take_epoch(JOB, "driver-a")
        record = prepared(registry, epoch, "x-1")
        registry.commit(epoch, record, committed_at=2000.0)
        with pytest.raises(RetryableConflict):
            registry.commit(epoch, record, committed_at=2001.0)  # version 0 is gone
        assert registry.ledger(JOB).committed == 1

    def test_commit_of_a_missing_xid_is_a_conflict(self, registry: Registry) -> None:
        epoch = registry.take_epoch(JOB, "driver-a")
        with pytest.raises(RetryableConflict):
            registry.commit(epoch, replace(make_record("ghost"), version=0), committed_at=1.0)
        assert registry.ledger(JOB) == EMPTY_LEDGER

    def test_illegal_transition_is_rejected(self, registry: Registry) -> None:
        epoch = registry.take_epoch(JOB, "driver-a")
        record = prepared(registry, epoch, "x-1")
        done = registry.commit(epoch, record, committed_at=2000.0)
        with pytest.raises(ValueError, match="illegal xid transition"):
            registry.commit(epoch, done, committed_at=2001.0)  # COMMITTED -> COMMITTED
        assert registry.get(JOB, "x-1") == done
        assert registry.ledger(JOB).seq == 1

    def test_a_commit_writes_the_owners_resting_facts_in_the_same_transaction(
        self, registry: Registry
    ) -> None:
        epoch = registry.take_epoch(JOB, "driver-a")
        registry.heartbeat(epoch, {"state": "running"})
        one = prepared(registry, epoch, "x-1", batch=1)
        registry.commit(epoch, one, committed_at=2.0, beat={"state": "idle", "last_xid": "x-1"})
        owner = registry.owner(JOB)
        assert owner is not None and (owner.state, owner.details["last_xid"]) == ("idle", "x-1")
        # a job that never beat (no owner node yet) gets one from its commit
        other = registry.take_epoch("other-job", "driver-c")
        two = prepared(registry, other, "x-2", batch=2)
        registry.commit(other, two, committed_at=3.0, beat={"state": "finished"})
        owner = registry.owner("other-job")
        assert owner is not None and (owner.owner, owner.state) == ("driver-c", "finished")

    def test_a_commit_whose_ledger_moved_since_it_was_read_counts_once(
        self, registry: Registry, open_registry: OpenRegistry
    ) -> None:
        """The committer reads the ledger (its decisive read), another committer of the
        job moves it, then the first commits: the totals hold both, each once."""
        epoch = registry.take_epoch(JOB, "driver-a")
        one = prepared(registry, epoch, "x-1", batch=1, parts={"p": 1})
        two = prepared(registry, epoch, "x-2", batch=2, parts={"p": 2})
        assert registry.ledger(JOB).committed == 0  # read (and remembered) here
        registry.get(JOB, "x-1")
        open_registry().commit(epoch, two, committed_at=1.0)
        done = registry.commit(epoch, one, committed_at=2.0)
        ledger = registry.ledger(JOB)
        assert (ledger.committed, ledger.rows, done.seq) == (2, 3, 2), ledger

    def test_fence_passes_for_the_current_epoch_and_fails_a_superseded_one(
        self, registry: Registry, open_registry: OpenRegistry
    ) -> None:
        old = registry.take_epoch(JOB, "driver-a")
        registry.fence(old)
        new = open_registry().take_epoch(JOB, "driver-b")  # another session takes over
        with pytest.raises(FencedError, match="superseded by epoch 2"):
            registry.fence(old)
        registry.fence(new)

    def test_a_prepare_unless_a_blob_proves_it_absent_in_the_same_transaction(
        self, registry: Registry
    ) -> None:
        epoch = registry.take_epoch(JOB, "driver-a")
        # no blob, and not even its parent yet: prepared
        first = registry.prepare(epoch, make_record("x-1"), unless_blob="dedup/x-1")
        assert registry.get(JOB, "x-1") == first
        assert registry.get_blob(JOB, "dedup/x-1") is None  # the proof left nothing behind
        registry.put_blob(JOB, "dedup/x-2/p0", {"state": "BEFORE"})
        with pytest.raises(BlobPresent) as caught:
            registry.prepare(epoch, make_record("x-2"), unless_blob="dedup/x-2")
        assert caught.value.key == "dedup/x-2"
        assert registry.get(JOB, "x-2") is None  # nothing prepared
        assert registry.blob_children(JOB, "dedup/x-2") == ["p0"]
        # a blob of another xid is no obstacle
        assert registry.prepare(epoch, make_record("x-3"), unless_blob="dedup/x-3").version == 0
        # a node emptied by a clean-up (its children deleted, itself not yet) holds no state
        registry.put_blob(JOB, "dedup/x-4/p0", {"state": "BEFORE"})
        registry.delete_blobs(JOB, "dedup/x-4/p0")
        assert registry.prepare(epoch, make_record("x-4"), unless_blob="dedup/x-4").version == 0
        assert registry.blob_children(JOB, "dedup/x-4") == []

    def test_stale_epoch_cannot_commit_even_a_prepared_xid(self, registry: Registry) -> None:
        old = registry.take_epoch(JOB, "driver-a")
        record = prepared(registry, old, "x-1")
        registry.take_epoch(JOB, "driver-b")
        with pytest.raises(FencedError):
            registry.commit(old, record, committed_at=2000.0)
        assert registry.get(JOB, "x-1") == record
        assert registry.ledger(JOB) == EMPTY_LEDGER

    def test_amend_adds_facts_to_a_prepared_record_fenced_and_idempotent(
        self, registry: Registry
    ) -> None:
        epoch = registry.take_epoch(JOB, "a")
        rec = prepared(registry, epoch, "b1")
        facts = [Cut("s", "p", {"aa": 3})]
        amended = registry.amend(epoch, rec, facts)
        assert amended.version == rec.version + 1 and amended.cut("s", "p") == {"aa": 3}
        again = registry.amend(epoch, rec, facts)  # a re-run after a lost reply
        assert again.version == amended.version
        # facts of another partition, from a copy read before the first amend: both kept
        both = registry.amend(epoch, rec, [Cut("s", "q", {"bb": 1})])
        assert both.cut("s", "p") == {"aa": 3} and both.cut("s", "q") == {"bb": 1}
        stored = registry.get(JOB, "b1")
        assert stored is not None and stored.cut("s", "p") == {"aa": 3}
        assert stored.cut("s", "q") == {"bb": 1}
        assert stored.manifest == rec.manifest and stored.state is XidState.PREPARED
        newer = registry.take_epoch(JOB, "b")
        with pytest.raises(FencedError):
            registry.amend(epoch, stored, [Cut("s", "p", {"bb": 1})])
        done = registry.commit(newer, stored, 1.0)
        with pytest.raises(RetryableConflict):
            registry.amend(newer, done, [])

    def test_new_epoch_rolls_forward_an_xid_prepared_by_the_old_one(
        self, registry: Registry
    ) -> None:
        old = registry.take_epoch(JOB, "driver-a")
        prepared(registry, old, "x-1")
        new = registry.take_epoch(JOB, "recovery")
        record = registry.get(JOB, "x-1")
        assert record is not None
        done = registry.commit(new, record, committed_at=5.0)
        assert done.state is XidState.COMMITTED
        assert done.epoch == old.number  # the record keeps the epoch that prepared it

    # -- reads, delete, heartbeat, blobs -------------------------------------------------

    def test_get_and_list_report_node_versions(self, registry: Registry) -> None:
        epoch = registry.take_epoch(JOB, "driver-a")
        one = prepared(registry, epoch, "x-1")
        prepared(registry, epoch, "x-2", batch=2)
        registry.commit(epoch, one, committed_at=1.0)
        versions = {r.xid: (r.state, r.version) for r in registry.list(JOB)}
        assert versions == {
            "x-1": (XidState.COMMITTED, 1),
            "x-2": (XidState.PREPARED, 0),
        }

    def test_list_keeps_prepare_order(self, registry: Registry) -> None:
        epoch = registry.take_epoch(JOB, "driver-a")
        names = ["x-9", "x-1", "x-5", "x-3"]
        for batch, xid in enumerate(names):
            prepared(registry, epoch, xid, batch=batch)
        assert [r.xid for r in registry.list(JOB)] == names

    def test_delete_removes_only_the_named_xids_and_ignores_missing(
        self, registry: Registry
    ) -> None:
        epoch = registry.take_epoch(JOB, "driver-a")
        for i in range(4):
            prepared(registry, epoch, f"x-{i}", batch=i)
        registry.delete(epoch, ["x-0", "x-2", "never-was"])
        assert [r.xid for r in registry.list(JOB)] == ["x-1", "x-3"]
        registry.delete(epoch, [])
        assert len(registry.list(JOB)) == 2

    def test_delete_keeps_the_ledger(self, registry: Registry) -> None:
        epoch = registry.take_epoch(JOB, "driver-a")
        record = prepared(registry, epoch, "x-1")
        registry.commit(epoch, record, committed_at=1.0)
        before = registry.ledger(JOB)
        registry.delete(epoch, ["x-1"])
        assert registry.get(JOB, "x-1") is None
        assert registry.ledger(JOB) == before

    def test_stale_epoch_cannot_delete(self, registry: Registry) -> None:
        old = registry.take_epoch(JOB, "driver-a")
        record = prepared(registry, old, "x-1")
        registry.take_epoch(JOB, "driver-b")
        with pytest.raises(FencedError):
            registry.delete(old, ["x-1"])
        with pytest.raises(FencedError):
            registry.delete(old, [])
        assert registry.get(JOB, "x-1") == record

    def test_heartbeat_records_the_owner(self, registry: Registry) -> None:
        epoch = registry.take_epoch(JOB, "driver-a")
        registry.heartbeat(epoch, {"batch": 3})
        registry.heartbeat(epoch, {"batch": 4})
        owner = registry.owner(JOB)
        assert owner is not None
        assert (owner.epoch, owner.owner, owner.details["batch"]) == (1, "driver-a", 4)
        assert isinstance(owner.heartbeat, float)

    def test_stale_epoch_cannot_heartbeat(self, registry: Registry) -> None:
        old = registry.take_epoch(JOB, "driver-a")
        new = registry.take_epoch(JOB, "driver-b")
        registry.heartbeat(new, {})
        with pytest.raises(FencedError):
            registry.heartbeat(old, {"batch": 1})
        owner = registry.owner(JOB)
        assert owner is not None and owner.owner == "driver-b"

    def test_blobs_round_trip_under_nested_keys(self, registry: Registry) -> None:
        assert registry.get_blob(JOB, "dedup/x-1/p0") is None
        registry.put_blob(JOB, "dedup/x-1/p0", {"state": "BEFORE", "blocks": 2})
        registry.put_blob(JOB, "dedup/x-1/p1", {"state": "BEFORE"})
        registry.put_blob(JOB, "dedup/x-1/p0", {"state": "AFTER", "blocks": 2})
        assert registry.get_blob(JOB, "dedup/x-1/p0") == {"state": "AFTER", "blocks": 2}
        assert registry.get_blob(JOB, "dedup/x-1/p1") == {"state": "BEFORE"}
        assert registry.get_blob("other-job", "dedup/x-1/p0") is None

    def test_a_blob_is_created_once_by_compare_and_set(self, registry: Registry) -> None:
        key = "dedup/x-1/p0"
        assert registry.get_blob_versioned(JOB, key) is None
        v0 = registry.cas_blob(JOB, key, {"blocks": 1}, CREATE)
        assert registry.get_blob_versioned(JOB, key) == ({"blocks": 1}, v0)
        with pytest.raises(BlobConflict):
            registry.cas_blob(JOB, key, {"blocks": 0}, CREATE)
        assert registry.get_blob(JOB, key) == {"blocks": 1}

    def test_a_stale_version_cannot_overwrite_a_blob(self, registry: Registry) -> None:
        key = "dedup/x-1/p0"
        v0 = registry.cas_blob(JOB, key, {"blocks": 1}, CREATE)
        v1 = registry.cas_blob(JOB, key, {"blocks": 3}, v0)
        assert v1 != v0
        with pytest.raises(BlobConflict):
            registry.cas_blob(JOB, key, {"blocks": 2}, v0)  # a zombie's stale read
        assert issubclass(BlobConflict, RetryableConflict)
        assert registry.get_blob_versioned(JOB, key) == ({"blocks": 3}, v1)

    def test_compare_and_set_of_a_missing_blob_at_a_version_conflicts(
        self, registry: Registry
    ) -> None:
        with pytest.raises(BlobConflict):
            registry.cas_blob(JOB, "dedup/x-1/p0", {"blocks": 1}, 0)
        assert registry.get_blob(JOB, "dedup/x-1/p0") is None

    def test_a_deleted_blob_can_be_created_again(self, registry: Registry) -> None:
        registry.cas_blob(JOB, "dedup/x-1/p0", {"blocks": 1}, CREATE)
        registry.delete_blobs(JOB, "dedup/x-1")
        assert registry.get_blob_versioned(JOB, "dedup/x-1/p0") is None
        v = registry.cas_blob(JOB, "dedup/x-1/p0", {"blocks": 2}, CREATE)
        assert registry.get_blob_versioned(JOB, "dedup/x-1/p0") == ({"blocks": 2}, v)

    def test_put_blob_moves_the_version_a_cas_expects(self, registry: Registry) -> None:
        v0 = registry.cas_blob(JOB, "dedup/x-1/p0", {"blocks": 1}, CREATE)
        registry.put_blob(JOB, "dedup/x-1/p0", {"blocks": 1, "note": "unversioned"})
        with pytest.raises(BlobConflict):
            registry.cas_blob(JOB, "dedup/x-1/p0", {"blocks": 2}, v0)

    # -- several drivers ----------------------------------------------------------------

    def test_racing_blob_writers_exactly_one_wins_each_version(
        self, registry: Registry, open_registry: OpenRegistry
    ) -> None:
        drivers = [registry, open_registry()]
        barrier = threading.Barrier(len(drivers))
        won: dict[int, list[int]] = {0: [], 1: []}

        def run(i: int, reg: Registry) -> None:
            for round_ in range(5):
                barrier.wait(timeout=30)
                found = reg.get_blob_versioned(JOB, "dedup/x-1/p0")
                barrier.wait(timeout=30)  # both read the same version before either writes
                try:
                    reg.cas_blob(JOB, "dedup/x-1/p0", {"by": i}, found[1] if found else CREATE)
                    won[i].append(round_)
                except BlobConflict:
                    pass

        threads = [threading.Thread(target=run, args=(i, reg)) for i, reg in enumerate(drivers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert sorted(won[0] + won[1]) == list(range(5)), won

    def test_a_second_driver_sees_the_first_drivers_writes(
        self, registry: Registry, open_registry: OpenRegistry
    ) -> None:
        registry.ensure_job(JOB, {"target": "db.events"})
        epoch = registry.take_epoch(JOB, "driver-a")
        record = prepared(registry, epoch, "x-1")
        other = open_registry()
        assert other.job_meta(JOB) == JobMeta(target="db.events")
        assert other.current_epoch(JOB) == epoch
        assert other.get(JOB, "x-1") == record

    def test_racing_drivers_exactly_one_prepares(
        self, registry: Registry, open_registry: OpenRegistry
    ) -> None:
        drivers = [registry, open_registry()]
        barrier = threading.Barrier(len(drivers))
        outcomes: dict[str, object] = {}
        epochs: dict[str, Epoch] = {}

        def run(name: str, reg: Registry) -> None:
            epochs[name] = reg.take_epoch(JOB, name)
            barrier.wait(timeout=30)  # both epochs are taken before either prepares
            try:
                outcomes[name] = prepared(reg, epochs[name], "x-1")
            except FencedError as exc:
                outcomes[name] = exc

        threads = [
            threading.Thread(target=run, args=(f"driver-{i}", reg)) for i, reg in enumerate(drivers)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        winners = [n for n, o in outcomes.items() if isinstance(o, XidRecord)]
        losers = [n for n, o in outcomes.items() if isinstance(o, FencedError)]
        assert len(winners) == 1 and len(losers) == 1, outcomes
        assert epochs[winners[0]].number == 2  # the newest epoch wins
        current = registry.current_epoch(JOB)
        assert current is not None and current.owner == winners[0]
        assert registry.get(JOB, "x-1") == outcomes[winners[0]]

    def test_concurrent_commits_of_one_job_count_each_xid_once(
        self, registry: Registry, open_registry: OpenRegistry
    ) -> None:
        epoch = registry.take_epoch(JOB, "driver-a")
        records = [prepared(registry, epoch, f"x-{i}", batch=i, parts={"p": 1}) for i in range(6)]
        drivers = [registry, open_registry()]
        errors: list[BaseException] = []

        def run(reg: Registry, mine: list[XidRecord]) -> None:
            for rec in mine:
                try:
                    reg.commit(epoch, rec, committed_at=1.0)
                except RetryableConflict as exc:  # the ledger race must be retried inside
                    errors.append(exc)

        threads = [
            threading.Thread(target=run, args=(reg, records[i::2])) for i, reg in enumerate(drivers)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert errors == []
        committed = [r for r in registry.list(JOB) if r.state is XidState.COMMITTED]
        assert registry.ledger(JOB).committed == len(committed) == 6
        assert sorted(r.seq or 0 for r in committed) == list(range(1, len(committed) + 1))

    # -- bounded nodes: large manifests ------------------------------------------------

    def test_a_10000_entry_manifest_round_trips_through_chunk_nodes(
        self, registry: Registry, open_registry: OpenRegistry
    ) -> None:
        epoch = registry.take_epoch(JOB, "driver-a")
        record = big_record("b7", entries=10_000)
        stored = registry.prepare(epoch, record)
        assert stored.manifest == record.manifest and stored.version == 0
        chunks = chunk_names(registry)
        assert len(chunks) >= 2  # incompressible fingerprints: several bounded chunks
        other = open_registry()
        assert other.get(JOB, "b7") == stored
        assert other.list(JOB) == [stored]
        done = other.commit(epoch, stored, committed_at=5.0)
        assert done.manifest == record.manifest and done.state is XidState.COMMITTED
        assert registry.get(JOB, "b7") == done
        assert chunk_names(registry) == chunks  # a commit rewrites the record, not chunks
        assert registry.ledger(JOB).rows == record.rows

    def test_200_tasks_by_30_partitions_prepare_and_a_replay_finds_the_record(
        self, registry: Registry
    ) -> None:
        epoch = registry.take_epoch(JOB, "driver-a")
        record = grid_record("b3", tasks=200, partitions=30)
        stored = registry.prepare(epoch, record)
        with pytest.raises(XidExists) as info:
            registry.prepare(epoch, grid_record("b3", tasks=200, partitions=30))
        assert info.value.existing == stored
        assert registry.get(JOB, "b3") == stored
        assert len(stored.partition_rows()) == 30

    def test_deleting_a_chunked_record_deletes_its_chunks(self, registry: Registry) -> None:
        epoch = registry.take_epoch(JOB, "driver-a")
        small = prepared(registry, epoch, "x-small")
        registry.prepare(epoch, big_record("b1", entries=5_000))
        assert chunk_names(registry)
        registry.delete(epoch, ["b1"])
        assert chunk_names(registry) == []
        assert registry.get(JOB, "b1") is None
        assert registry.list(JOB) == [small]

    def test_orphan_chunks_are_never_read_as_a_record_and_are_swept(
        self, registry: Registry
    ) -> None:
        epoch = registry.take_epoch(JOB, "driver-a")
        # A prepare that wrote its chunks and then crashed (or lost its connection)
        # before the record was created leaves orphans.
        orphan: Any = registry
        orphan._stage_chunks(epoch, big_record("b1", entries=20_000))  # 3 chunks
        orphans = chunk_names(registry)
        assert orphans
        assert registry.get(JOB, "b1") is None and registry.list(JOB) == []
        # The re-run prepares with fresh chunks; the record references only those.
        stored = registry.prepare(epoch, big_record("b1", entries=20_000, seed=2))
        assert registry.get(JOB, "b1") == stored
        registry.delete(epoch, [])  # prune and recovery sweep orphans
        live = chunk_names(registry)
        assert live and not set(live) & set(orphans)
        assert registry.get(JOB, "b1") == stored

    def test_a_lone_chunk_lands_with_its_record_or_not_at_all(self, registry: Registry) -> None:
        epoch = registry.take_epoch(JOB, "driver-a")
        record = big_record("b1", entries=5_000)  # one chunk: the prepare's txn makes it
        stored = registry.prepare(epoch, record)
        assert registry.get(JOB, "b1") == stored and len(chunk_names(registry)) == 1
        with pytest.raises(XidExists):  # a replay finds it, and leaves no second chunk
            registry.prepare(epoch, big_record("b1", entries=5_000, seed=2))
        assert len(chunk_names(registry)) == 1
        registry.delete(epoch, [])
        assert registry.get(JOB, "b1") == stored

    def test_a_stale_epoch_neither_prepares_nor_leaves_chunks(self, registry: Registry) -> None:
        old = registry.take_epoch(JOB, "driver-a")
        registry.take_epoch(JOB, "driver-b")
        with pytest.raises(FencedError):
            registry.prepare(old, big_record("b1", entries=5_000))  # its lone chunk
        with pytest.raises(FencedError):
            registry.prepare(old, big_record("b2", entries=20_000))  # chunks written first
        assert registry.get(JOB, "b1") is None and registry.get(JOB, "b2") is None
        assert chunk_names(registry) == []

    def test_a_stale_epoch_cannot_sweep_chunks(self, registry: Registry) -> None:
        old = registry.take_epoch(JOB, "driver-a")
        new = registry.take_epoch(JOB, "driver-b")
        orphan: Any = registry
        orphan._stage_chunks(new, big_record("b1", entries=20_000))  # 3 chunks
        with pytest.raises(FencedError):
            registry.delete(old, [])
        assert chunk_names(registry)

    def test_manifests_written_before_the_compact_layout_still_read(
        self, registry: Registry
    ) -> None:
        epoch = registry.take_epoch(JOB, "driver-a")
        record = make_record("x-old", parts={"a": 1, "b": 2})
        stored = registry.prepare(epoch, record)
        assert unpack_record(encode_record(record), None, 0, "old node") == stored

    def test_a_request_over_the_keeper_limit_is_refused_before_it_is_sent(
        self, registry: Registry
    ) -> None:
        with pytest.raises(KeeperRequestTooLarge) as info:
            registry.put_blob(JOB, "dedup/b1/p0", {"fingerprints": ["f" * 64] * 20_000})
        assert str(KEEPER_MAX_REQUEST) in str(info.value)
        assert registry.get_blob(JOB, "dedup/b1/p0") is None
        registry.put_blob(JOB, "dedup/b1/p0", {"ok": True})  # the session is still fine


def chunk_names(registry: Registry) -> list[str]:
    names: list[str] = getattr(registry, "manifest_chunks")(JOB)  # noqa: B009 - not in Registry
    return names


def big_record(xid: str, *, entries: int, seed: int = 1) -> XidRecord:
    """One staging table per entry and an incompressible fingerprint: the worst case."""
    rnd = random.Random(seed)
    return replace(
        make_record(xid, batch=int(xid[1:]) if xid[1:].isdigit() else 1, parts={}),
        mode=Mode.DEDUP,
        manifest=tuple(
            StagedPart(
                table=f"txsink_staging.tx_{JOB}_{i:05d}_{rnd.getrandbits(64):016x}",
                partition_id=str(i % 97),
                rows=rnd.randrange(1, 10_000),
                blocks=rnd.randrange(0, 5),
                fingerprint=f"{rnd.getrandbits(128):032x}",
            )
            for i in range(entries)
        ),
    )


def grid_record(xid: str, *, tasks: int, partitions: int) -> XidRecord:
    """``tasks`` staging tables (one per Spark task attempt, named as executors name them)
    x ``partitions`` target partitions each."""
    return replace(
        make_record(xid, batch=int(xid[1:]), parts={}),
        manifest=tuple(
            StagedPart(
                table=staging_name(
                    "orders-enriched-eu-west", xid, "6c1e0f9d", t, 0, 100_000 + t
                ).table,
                partition_id=f"2024{p:04d}",
                rows=100 + p,
                blocks=1,
            )
            for t in range(tasks)
            for p in range(partitions)
        ),
    )


class TombstoneContract:
    """Roll-backs are decided on the xid node (ABORTED tombstones) and the namespace."""

    def test_a_prepare_that_lands_after_a_tombstone_never_adopts_its_tables(
        self, registry: Registry
    ) -> None:
        epoch = registry.take_epoch(JOB, "w1")
        late = make_record("b7", batch=7)
        stone = registry.abort(JOB, "b7", late.staging_tables, 5.0)
        assert stone.state is XidState.ABORTED
        assert stone.aborted_tables == set(late.staging_tables)
        with pytest.raises(XidExists) as info:
            registry.prepare(epoch, late)  # its reply was lost / its writer was paused
        assert info.value.existing.state is XidState.ABORTED
        assert registry.get(JOB, "b7").state is XidState.ABORTED  # type: ignore[union-attr]

    def test_a_tombstone_after_a_prepare_leaves_the_prepared_record_alone(
        self, registry: Registry
    ) -> None:
        epoch = registry.take_epoch(JOB, "w1")
        done = prepared(registry, epoch, "b3", batch=3)
        seen = registry.abort(JOB, "b3", done.staging_tables, 5.0)
        assert seen.state is XidState.PREPARED
        assert seen.manifest == done.manifest
        assert registry.get(JOB, "b3") == seen

    def test_a_replay_prepares_fresh_staging_over_a_tombstone(self, registry: Registry) -> None:
        epoch = registry.take_epoch(JOB, "w1")
        registry.abort(JOB, "b4", ["db._stage_old"], 5.0)
        fresh = registry.prepare(epoch, make_record("b4", batch=4))
        assert fresh.state is XidState.PREPARED
        assert fresh.aborted_tables == {"db._stage_old"}
        stored = registry.get(JOB, "b4")
        assert stored is not None and stored.version == fresh.version
        done = registry.commit(epoch, stored, 9.0)
        assert done.state is XidState.COMMITTED and registry.ledger(JOB).rows == 5

    def test_tombstones_only_grow_and_a_stale_epoch_still_cannot_prepare_over_one(
        self, registry: Registry
    ) -> None:
        old = registry.take_epoch(JOB, "w1")
        registry.take_epoch(JOB, "w2")
        registry.abort(JOB, "b5", ["t1"], 5.0)
        more = registry.abort(JOB, "b5", ["t2"], 6.0)
        again = registry.abort(JOB, "b5", ["t1"], 7.0)
        assert more.aborted_tables == again.aborted_tables == {"t1", "t2"}
        with pytest.raises(FencedError):
            registry.prepare(old, make_record("b5", batch=5))

    def test_the_namespace_is_one_per_store(
        self, registry: Registry, open_registry: OpenRegistry
    ) -> None:
        assert registry.namespace() == open_registry().namespace()

    def test_a_chunked_manifest_prepares_over_a_tombstone(self, registry: Registry) -> None:
        epoch = registry.take_epoch(JOB, "w1")
        registry.abort(JOB, "b9", ["db._stage_gone"], 1.0)
        record = big_record("b9", entries=5_000)
        stored = registry.prepare(epoch, record)
        assert stored.manifest == record.manifest and stored.state is XidState.PREPARED
        assert registry.get(JOB, "b9") == stored
        assert registry.commit(epoch, stored, 2.0).state is XidState.COMMITTED
