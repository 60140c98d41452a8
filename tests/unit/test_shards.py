"""Sharded jobs (issue 11), the pure parts: options, staging names that carry their shard,
routing of rows and of staging operations (the engine side is tests/integration/
test_shards.py)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from txsink.clickhouse.shards import (
    ShardedWarehouse,
    cluster_urls,
    int_hash64,
    parse_distributed,
    split_by_shard,
)
from txsink.config import WriterConfig
from txsink.errors import ConfigError
from txsink.ports.warehouse import ClusterReplica, TargetInfo, WarehouseCapabilities
from txsink.protocol.codec import JobMeta
from txsink.protocol.ids import parse_staging, shard_of, staging_name

BASE = {"keeper": "k:2181", "table": "db.t", "job": "j"}


def test_shards_option_parses_and_url_defaults_to_the_first_shard() -> None:
    c = WriterConfig.from_options({**BASE, "shards": "http://a:1, http://b:2/", "shard_by": "id"})
    assert c.shards == ("http://a:1", "http://b:2") and c.url == "http://a:1"
    assert c.shard_urls == c.shards and c.shard_by == "id"
    assert WriterConfig.from_options({**BASE, "url": "http://a:1"}).shard_urls == ("http://a:1",)
    assert WriterConfig.from_options(c.to_options()).shards == c.shards  # foreach_batch


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"shards": "http://a:1,http://a:1"}, "twice"),
        ({"shards": "a:1"}, "does not look like"),
        ({"shards": "http://u:p@a:1"}, "credentials"),
        ({"shards": "http://a:1", "url": "http://c:3"}, "not one of the shards"),
        ({"url": "http://a:1", "shard_by": "id"}, "needs 'shards'"),
    ],
)
def test_bad_shard_options_are_refused_with_the_reason(
    options: dict[str, str], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        WriterConfig.from_options({**BASE, **options})


def test_a_staging_name_carries_its_shard_and_old_names_are_shard_zero() -> None:
    sharded = staging_name("j", "b3", "abcdef01", 1, 0, 7, "ns", shard=2).table
    assert sharded.endswith("_t7_s2") and shard_of(sharded) == 2
    parsed = parse_staging(sharded)
    assert parsed is not None and parsed.shard == 2 and parsed.table == sharded
    plain = staging_name("j", "b3", "abcdef01", 1, 0, 7, "ns").table
    assert plain.endswith("_t7") and shard_of(plain) == 0
    assert parse_staging(plain).shard is None  # type: ignore[union-attr]


def test_int_hash64_is_clickhouses() -> None:
    # SELECT intHash64(toInt64(x)) on ClickHouse 26.9 (chdb), for these x
    values = np.array([0, 1, 42, -1, 2**63 - 1], dtype=np.int64)
    assert int_hash64(values).tolist() == [
        4761183170873013810,
        10577349846663553072,
        11490350930367293593,
        14600443904207254319,
        16054072765933828340,
    ]


def test_rows_are_split_without_loss_by_key_or_evenly() -> None:
    batch = pa.record_batch({"id": pa.array(range(1000), pa.int64()), "v": pa.array([1] * 1000)})
    by_key = split_by_shard(batch, 3, "id", 0)
    assert sum(b.num_rows for b in by_key.values()) == 1000
    ids = sorted(i for b in by_key.values() for i in b.column(0).to_pylist())
    assert ids == list(range(1000))
    even = split_by_shard(batch, 3, "", 5)
    assert sorted(b.num_rows for b in even.values()) == [333, 333, 334]
    with pytest.raises(ConfigError, match="integer"):
        split_by_shard(pa.record_batch({"id": pa.array(["x"])}), 3, "id", 0)
    with pytest.raises(ConfigError, match="null"):
        split_by_shard(pa.record_batch({"id": pa.array([1, None], pa.int64())}), 3, "id", 0)


class Shard:
    """Records what was asked of one shard's warehouse."""

    def __init__(self, k: int) -> None:
        self.k = k
        self.calls: list[tuple[str, Any]] = []
        self.staging_db = "txsink_staging"
        self.client = None

    def __getattr__(self, name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls.append((name, args))
            if name == "list_staging":
                return [f"t{self.k}"]
            if name in ("staging_view", "published_uuids", "partition_rows"):
                return {} if name != "published_uuids" else frozenset({f"u{self.k}"})
            if name == "settle":
                return self.k != 1
            return None

        return call


def test_staging_operations_go_to_the_shard_in_the_name_and_questions_to_every_shard() -> None:
    shards = [Shard(k) for k in range(3)]
    wh = ShardedWarehouse(shards)  # type: ignore[arg-type]
    on = [staging_name("j", "b1", "abcdef01", 0, 0, 9, "ns", shard=k).table for k in range(3)]
    wh.move_partitions(on[2], ["p1", "p2"], "db.t")
    assert [c[0] for c in shards[2].calls] == ["move_partitions"]
    assert not shards[0].calls and not shards[1].calls
    wh.drop_stagings([on[0], on[2]])
    assert ("drop_stagings", ([on[0]],)) in shards[0].calls
    assert ("drop_stagings", ([on[2]],)) in shards[2].calls
    assert wh.list_staging("tx_j") == ["t0", "t1", "t2"]
    assert wh.published_uuids("db.t", ["u1"]) == frozenset({"u0", "u1", "u2"})
    assert wh.settle(["x"]) is False  # one busy shard: not settled
    bad = staging_name("j", "b1", "abcdef01", 0, 0, 9, "ns", shard=5).table
    with pytest.raises(ConfigError, match="shard 5"):
        wh.staged_partitions(bad)
    with pytest.raises(ConfigError, match="dedup"):
        wh.insert_blocks("db.t", [], block_rows=1, block_bytes=1)


def _dist(engine_full: str) -> TargetInfo:
    return TargetInfo("shop", "orders", "Distributed", engine_full=engine_full)


@pytest.mark.parametrize(
    ("engine_full", "local", "shard_by", "key"),
    [
        ("Distributed('c', 'db', 'local', intHash64(id))", "db.local", "id", "intHash64(id)"),
        (
            "Distributed(c, db, local, intHash64( `cust` ))",
            "db.local",
            "cust",
            "intHash64( `cust` )",
        ),
        ("Distributed('c', currentDatabase(), 'l', rand())", "shop.l", "", "rand()"),
        (
            "Distributed('c', 'db', 'l', rand64()) SETTINGS fsync_after_insert = 0",
            "db.l",
            "",
            "rand64()",
        ),
        ("Distributed('c', 'db', 'l')", "db.l", "", ""),
    ],
)
def test_a_distributed_engine_names_its_local_table_and_routing(
    engine_full: str, local: str, shard_by: str, key: str
) -> None:
    target = parse_distributed(_dist(engine_full))
    assert (target.cluster, target.local_table, target.shard_by) == ("c", local, shard_by)
    assert target.sharding_key == key


@pytest.mark.parametrize(
    "key", ["id % 3", "cityHash64(name)", "intHash64(id + 1)", "intHash32(id)", "id"]
)
def test_a_sharding_key_txsink_cannot_route_like_clickhouse_is_refused(key: str) -> None:
    with pytest.raises(ConfigError, match="cannot reproduce"):
        parse_distributed(_dist(f"Distributed('c', 'db', 'l', {key})"))


def test_cluster_urls_take_each_shards_first_replica_whatever_server_was_asked() -> None:
    target = parse_distributed(_dist("Distributed('c', 'db', 'l', intHash64(id))"))
    rows = [
        ClusterReplica(2, 1, 2, "b2"),
        ClusterReplica(1, 1, 1, "a1"),
        ClusterReplica(2, 1, 1, "b1"),
        ClusterReplica(3, 1, 1, "::1"),
        ClusterReplica(1, 1, 2, "a2"),
    ]
    urls = cluster_urls(target, rows, "https", 8443)
    assert urls == ("https://a1:8443", "https://b1:8443", "https://[::1]:8443")
    assert cluster_urls(target, list(reversed(rows)), "https", 8443) == urls


@pytest.mark.parametrize(
    ("engine_full", "rows", "message"),
    [
        ("Distributed('c', 'db', 'l', intHash64(id))", [], "not in system.clusters"),
        (
            "Distributed('c', 'db', 'l', intHash64(id))",
            [ClusterReplica(1, 1, 1, "a"), ClusterReplica(2, 2, 1, "b")],
            "weights",
        ),
        (  # equal but not 1: ClickHouse picks from slots [0, 0, 1, 1], not key % 2
            "Distributed('c', 'db', 'l', intHash64(id))",
            [ClusterReplica(1, 2, 1, "a"), ClusterReplica(2, 2, 1, "b")],
            "weights",
        ),
        (
            "Distributed('c', 'db', 'l', intHash64(id))",
            [ClusterReplica(1, 1, 1, "h"), ClusterReplica(2, 1, 1, "h")],
            "several shards on one host",
        ),
        (
            "Distributed('c', 'db', 'l')",
            [ClusterReplica(1, 1, 1, "a"), ClusterReplica(2, 1, 1, "b")],
            "no sharding key",
        ),
    ],
)
def test_clusters_txsink_cannot_route_over_are_refused(
    engine_full: str, rows: list[ClusterReplica], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        cluster_urls(parse_distributed(_dist(engine_full)), rows, "http", 8123)
    one = [ClusterReplica(1, 1, 1, "a")]
    assert cluster_urls(parse_distributed(_dist("Distributed('c', 'db', 'l')")), one, "http", 1)


def test_shard_http_port_is_an_option_for_discovered_shards_only() -> None:
    c = WriterConfig.from_options({**BASE, "url": "http://a:1", "shard_http_port": "8123"})
    assert c.shard_http_port == 8123
    assert WriterConfig.from_options(c.to_options()).shard_http_port == 8123
    with pytest.raises(ConfigError, match="each URL carries its port"):
        WriterConfig.from_options({**BASE, "shards": "http://a:1", "shard_http_port": "8123"})


def test_per_shard_verify_honours_allow_other_writers() -> None:
    """A surplus on one shard is another writer's when the operator says so, as in the
    total; without the flag it stays an anomaly."""
    from txsink.ops import verify as vf

    class Client:
        def query_rows(self, *args: Any, **kwargs: Any) -> list[tuple[str]]:
            return [("MergeTree",)]

    class Sharded:
        client = Client()
        capabilities = WarehouseCapabilities(per_shard_counts=True)

        def partition_rows_by_shard(self, table: str) -> list[dict[str, int]]:
            return [{"p": 110}, {"p": 100}]

    meta = JobMeta(target="db.t", shards=("http://a:1", "http://b:1"))
    ledger = {"j": {"rows": 200, "shards": {"0": 100, "1": 100}}}
    for allowed, clean in ((True, True), (False, False)):
        result = vf.VerifyResult("j", "db.t")
        checked = vf._reconcile_shards(Sharded(), "j", meta, [], "db.t", ledger, result, allowed)
        assert result.clean is clean, [a.message for a in result.anomalies]
        assert [c["target_rows"] for c in checked] == [110, 100]


def test_a_writer_the_jobs_first_commit_rules_out_is_refused_before_it_writes() -> None:
    """Dedup-mode tasks insert into the target itself: another target or shard list must
    be refused at validation, not at the commit after the rows are visible."""
    from txsink.spark.validate import check_identity

    sharded = {"target": "shop.orders_local", "shards": ["http://a:1", "http://b:1"]}
    through_dist = WriterConfig.from_options({**BASE, "url": "http://a:1", "table": "shop.orders"})
    with pytest.raises(ConfigError, match=r"writes to shop\.orders_local, not shop\.orders"):
        check_identity(through_dist, sharded)
    local = WriterConfig.from_options(
        {**BASE, "shards": "http://a:1,http://b:1", "table": "shop.orders_local"}
    )
    check_identity(local, sharded)
    reordered = WriterConfig.from_options(
        {**BASE, "shards": "http://b:1,http://a:1", "table": "shop.orders_local"}
    )
    with pytest.raises(ConfigError, match="keeps its shard list"):
        check_identity(reordered, sharded)
    check_identity(through_dist, None)  # a new job
