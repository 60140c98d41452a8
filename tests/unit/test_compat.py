"""Pure schema and mode checks (chtypes, blockers): type table, decimals, nullability."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from txsink.clickhouse.blockers import attach_blockers, check_move_compat, dedup_blockers
from txsink.clickhouse.chtypes import (
    SparkField,
    check_schema,
    parse_ch_type,
    parse_spark_type,
    unwrap,
)
from txsink.clickhouse.replicated_ddl import staging_engine_clause, staging_keeper_path
from txsink.clickhouse.sqltext import called_functions, split_top_level
from txsink.clickhouse.values import Check, plan_rules
from txsink.ports.warehouse import ColumnInfo, CommitLook, TargetInfo

T = "db.events"


def fits(spark: str, ch: str, *, nullable: bool = False) -> list[str]:
    return check_schema([SparkField("c", spark, nullable)], [ColumnInfo("c", ch)], table=T)


def notes_of(spark: str, ch: str) -> list[str]:
    notes: list[str] = []
    assert check_schema([SparkField("c", spark, False)], [ColumnInfo("c", ch)], notes=notes) == []
    return notes


COMPATIBLE = [
    ("bigint", "Float64"),  # beyond 2^53: refused value by value
    ("bigint", "Decimal(38, 0)"),
    ("int", "Decimal(9, 2)"),  # beyond 7 integer digits: refused value by value
    ("interval day", "Int64"),
    ("interval day to second", "Int64"),
    ("variant", "JSON"),
    ("decimal(20,0)", "UInt64"),
    ("decimal(38,0)", "Int128"),
    ("string", "IPv4"),
    ("string", "IPv6"),
    ("string", "Bool"),
    ("string", "JSON"),
    ("bigint", "Int64"),
    ("bigint", "Int128"),
    ("bigint", "UInt64"),
    ("int", "Int32"),
    ("int", "Int64"),
    ("smallint", "Int16"),
    ("tinyint", "Int8"),
    ("tinyint", "Int64"),
    ("boolean", "Bool"),
    ("boolean", "UInt8"),
    ("float", "Float32"),
    ("float", "Float64"),
    ("double", "Float64"),
    ("string", "String"),
    ("string", "LowCardinality(String)"),
    ("string", "FixedString(16)"),
    ("string", "UUID"),
    ("string", "Enum8('a' = 1, 'b' = 2)"),
    ("binary", "String"),
    ("timestamp", "DateTime64(6, 'UTC')"),
    ("timestamp", "DateTime64(3)"),
    ("timestamp", "DateTime('Europe/Berlin')"),
    ("timestamp_ntz", "DateTime64(6)"),
    ("date", "Date"),
    ("date", "Date32"),
    ("decimal(10,2)", "Decimal(10, 2)"),
    ("decimal(10,2)", "Decimal(12, 4)"),
    ("decimal(10,2)", "Decimal64(4)"),
    ("array<int>", "Array(Int32)"),
    ("array<string>", "Array(LowCardinality(Nullable(String)))"),
    ("map<string,int>", "Map(String, Int64)"),
    ("map<string,array<bigint>>", "Map(LowCardinality(String), Array(Int64))"),
    ("struct<a:int,b:string>", "Tuple(a Int32, b String)"),
    ("struct<a:int,b:string>", "Tuple(Int32, String)"),
]

INCOMPATIBLE = [
    ("bigint", "Int32"),
    ("bigint", "String"),
    ("int", "UInt16"),
    ("double", "Float32"),
    ("double", "Decimal(18, 4)"),
    ("string", "Int64"),
    ("string", "Date"),
    ("timestamp", "Date"),
    ("timestamp", "String"),
    ("date", "DateTime"),
    ("boolean", "String"),
    ("decimal(10,2)", "Decimal(10, 1)"),
    ("decimal(10,2)", "Decimal(11, 4)"),
    ("decimal(10,2)", "Float64"),
    ("decimal(10,2)", "Int64"),
    ("array<int>", "Array(Int16)"),
    ("array<int>", "Int32"),
    ("map<string,int>", "Map(Int32, Int32)"),
    ("struct<a:int,b:string>", "Tuple(a Int32)"),
    ("struct<a:int,b:string>", "Tuple(x Int32, b String)"),
    ("interval year to month", "Int32"),
    ("interval day to second", "UInt64"),
    ("variant", "String"),
    ("array<variant>", "Array(JSON)"),
]


@pytest.mark.parametrize(("spark", "ch"), COMPATIBLE)
def test_compatible_types_pass(spark: str, ch: str) -> None:
    assert fits(spark, ch) == []


@pytest.mark.parametrize(("spark", "ch"), INCOMPATIBLE)
def test_incompatible_types_name_table_column_and_both_types(spark: str, ch: str) -> None:
    errors = fits(spark, ch)
    assert len(errors) == 1
    assert "column c of db.events" in errors[0]
    assert ch in errors[0] and spark in errors[0]


@pytest.mark.parametrize(
    ("spark", "ch", "checks"),
    [
        ("bigint", "UInt64", {Check.RANGE}),
        ("timestamp", "DateTime", {Check.RANGE, Check.WHOLE}),
        ("timestamp", "DateTime64(3)", {Check.RANGE, Check.WHOLE}),
        ("timestamp_ntz", "DateTime64(6, 'Asia/Tokyo')", {Check.RANGE, Check.WALL_CLOCK}),
        ("string", "FixedString(4)", {Check.EXACT_BYTES}),
        ("date", "Date", {Check.RANGE}),
    ],
)
def test_types_that_fit_only_for_some_values_get_value_rules_not_notes(
    spark: str, ch: str, checks: set[Check]
) -> None:
    assert fits(spark, ch) == [] and notes_of(spark, ch) == []
    rules = plan_rules([SparkField("c", spark, False)], [ColumnInfo("c", ch)])
    assert {r.check for r in rules} == {Check.NOT_NULL, *checks}


@given(
    p=st.integers(1, 38),
    s_frac=st.integers(0, 38),
    cp=st.integers(1, 76),
    cs_frac=st.integers(0, 76),
)
def test_decimal_fits_exactly_when_integer_and_fraction_digits_both_fit(
    p: int, s_frac: int, cp: int, cs_frac: int
) -> None:
    s = min(s_frac, p)
    cs = min(cs_frac, cp)
    ok = cp - cs >= p - s and cs >= s
    assert (fits(f"decimal({p},{s})", f"Decimal({cp}, {cs})") == []) is ok


@given(width=st.sampled_from([32, 64, 128, 256]), s=st.integers(0, 9))
def test_decimal_aliases_use_their_max_precision(width: int, s: int) -> None:
    max_p = {32: 9, 64: 18, 128: 38, 256: 76}[width]
    ok = max_p - s >= 5 - 2 and s >= 2
    assert (fits("decimal(5,2)", f"Decimal{width}({s})") == []) is ok


def test_nullable_spark_column_into_non_nullable_target_is_an_error_with_remedy() -> None:
    errors = fits("bigint", "Int64", nullable=True)
    assert len(errors) == 1
    assert "column c of db.events" in errors[0]
    assert "Nullable(Int64)" in errors[0] and "fill nulls" in errors[0]


@pytest.mark.parametrize(
    "ch", ["Nullable(Int64)", "LowCardinality(Nullable(String))", "Nullable(Decimal(18, 2))"]
)
def test_nullable_spark_column_into_nullable_target_is_fine(ch: str) -> None:
    spark = "string" if "String" in ch else "decimal(10,2)" if "Decimal" in ch else "bigint"
    assert fits(spark, ch, nullable=True) == []


def test_nullable_array_into_array_is_noted_not_refused() -> None:
    notes: list[str] = []
    cols = [ColumnInfo("a", "Array(Int32)")]
    assert check_schema([SparkField("a", "array<int>", True)], cols, notes=notes) == []
    assert any("empty" in n for n in notes)


def test_missing_and_extra_columns_are_named() -> None:
    cols = [
        ColumnInfo("id", "Int64"),
        ColumnInfo("payload", "String"),
        ColumnInfo("ts", "DateTime", "DEFAULT"),
        ColumnInfo("m", "String", "MATERIALIZED"),
        ColumnInfo("opt", "Nullable(String)"),
    ]
    errors = check_schema(
        [SparkField("id", "bigint", False), SparkField("Extra", "int", False)], cols, table=T
    )
    assert len(errors) == 2
    assert any("Extra" in e and "does not exist in db.events" in e for e in errors)
    assert any("payload" in e and "no default" in e for e in errors)


def test_case_mismatch_suggests_the_real_name() -> None:
    errors = check_schema([SparkField("ID", "bigint", False)], [ColumnInfo("id", "Int64")])
    assert any("did you mean id" in e for e in errors)


def test_writing_a_materialized_column_is_refused() -> None:
    cols = [ColumnInfo("m", "String", "MATERIALIZED")]
    errors = check_schema([SparkField("m", "string", False)], cols, table=T)
    assert len(errors) == 1 and "MATERIALIZED" in errors[0]


def test_type_parsers_handle_nesting_and_quotes() -> None:
    t = parse_ch_type("Map(LowCardinality(String), Tuple(a Nullable(Int32), `b c` String))")
    assert t.name == "Map" and len(t.args) == 2
    assert unwrap(t.arg_type(0)) == (parse_ch_type("String"), False)
    assert unwrap(parse_ch_type("LowCardinality(Nullable(String))"))[1] is True
    assert split_top_level("'a,b' = 1, 'c' = 2") == ["'a,b' = 1", "'c' = 2"]
    assert parse_ch_type("Enum8('a,b' = 1, 'c' = 2)").args == ("'a,b' = 1", "'c' = 2")
    s = parse_spark_type("struct<a:map<string,int>,b:array<decimal(10,2)>>")
    assert s.fields == (("a", "map<string,int>"), ("b", "array<decimal(10,2)>"))


# --------------------------------------------------------------------------- blockers


def info(engine: str = "MergeTree", **kw: object) -> TargetInfo:
    base: dict[str, object] = {
        "database": "db",
        "table": "events",
        "engine": engine,
        "sorting_key": "id",
        "primary_key": "id",
        "storage_policy": "default",
        "columns": (ColumnInfo("id", "Int64"),),
        "settings": {"non_replicated_deduplication_window": "0"},
    }
    base.update(kw)
    return TargetInfo(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "engine", ["MergeTree", "ReplacingMergeTree", "SummingMergeTree", "AggregatingMergeTree"]
)
def test_plain_merge_tree_family_without_partition_key_has_no_blockers(engine: str) -> None:
    assert attach_blockers(info(engine, partition_key="")) == []


@pytest.mark.parametrize(
    ("engine", "word"),
    [
        ("Distributed", "Distributed"),
        ("Memory", "Memory"),
        ("Log", "Log"),
        ("View", "View"),
        ("MaterializedView", "MaterializedView"),
        ("ReplicatedMergeTree", "system.replicas"),  # not listed: no Keeper path known
        ("SharedMergeTree", "SharedMergeTree"),
    ],
)
def test_each_blocker_names_table_and_remedy(engine: str, word: str) -> None:
    blockers = attach_blockers(info(engine))
    assert blockers, engine
    assert all("db.events" in b and "mode=dedup" in b for b in blockers)
    assert any(word in b for b in blockers)


def test_a_target_on_an_auxiliary_zookeeper_is_refused_in_attach_mode() -> None:
    aux = info("ReplicatedMergeTree", zookeeper_path="zk2:/clickhouse/t", replica_name="r1")
    blockers = attach_blockers(aux)
    assert len(blockers) == 1 and "auxiliary ZooKeeper 'zk2'" in blockers[0]
    own = info("ReplicatedMergeTree", zookeeper_path="/clickhouse/t", replica_name="r1")
    assert attach_blockers(own) == []


def test_dependent_materialized_views_block_attach_and_are_named() -> None:
    blockers = attach_blockers(info(dependent_views=("db.mv_counts", "other.mv")))
    assert len(blockers) == 1
    assert "db.mv_counts" in blockers[0] and "other.mv" in blockers[0]
    assert "mode=dedup" in blockers[0]


def test_blockers_accumulate() -> None:
    assert len(attach_blockers(info("ReplicatedMergeTree", dependent_views=("db.mv",)))) == 2


REPLICATED_FULL = (
    "ReplicatedReplacingMergeTree('/clickhouse/tables/{shard}/db/events', '{replica}', ver) "
    "PARTITION BY toYYYYMM(day) ORDER BY (id, 'a TTL b') TTL day + toIntervalYear(1) "
    "SETTINGS index_granularity = 8192, parts_to_throw_insert = 500, "
    "deduplicate_merge_projection_mode = 'drop', storage_policy = 'x SETTINGS y'"
)


def replicated(**kw: object) -> TargetInfo:
    fields: dict[str, object] = {
        "engine_full": REPLICATED_FULL,
        "zookeeper_path": "/clickhouse/tables/01/db/events",
        "replica_name": "r1",
    }
    fields.update(kw)
    engine = str(fields.pop("engine", "ReplicatedReplacingMergeTree"))
    return info(engine, **fields)


def test_a_listed_replicated_target_can_be_published_by_move() -> None:
    assert attach_blockers(replicated()) == []


def test_staging_keeper_path_is_a_sibling_of_the_target_path_never_inside_it() -> None:
    path = staging_keeper_path(replicated(), "txsink_staging", "j__b1__r0_p0_a0_t1")
    assert path == (
        "/clickhouse/tables/01/db/events_txsink_staging/txsink_staging/j__b1__r0_p0_a0_t1"
    )
    assert not path.startswith("/clickhouse/tables/01/db/events/")


def test_staging_engine_replaces_path_and_replica_keeps_keys_and_extra_arguments() -> None:
    clause = staging_engine_clause(replicated(), "/p/s'1", {"parts_to_throw_insert": 10**9, "a": 1})
    assert clause.startswith(
        "ENGINE = ReplicatedReplacingMergeTree('/p/s\\'1', 'r1', ver) "
        "PARTITION BY toYYYYMM(day) ORDER BY (id, 'a TTL b') SETTINGS "
    )
    settings = clause.split(") SETTINGS ", 1)[1]
    assert "toIntervalYear" not in clause  # the table TTL is left out, the literal kept
    assert settings.split(", ") == [
        "index_granularity = 8192",
        "deduplicate_merge_projection_mode = 'drop'",  # needed by projections on Replacing
        "storage_policy = 'x SETTINGS y'",
        "parts_to_throw_insert = 1000000000",  # staging's own value wins
        "a = 1",
    ]


def test_staging_engine_without_settings_or_ttl() -> None:
    target = replicated(
        engine="ReplicatedMergeTree",
        engine_full="ReplicatedMergeTree('/t', '{replica}') ORDER BY id",
    )
    assert staging_engine_clause(target, "/s", {"x": 1}) == (
        "ENGINE = ReplicatedMergeTree('/s', 'r1') ORDER BY id SETTINGS x = 1"
    )


def test_staging_engine_refuses_a_non_replicated_target() -> None:
    with pytest.raises(ValueError):
        staging_engine_clause(info(), "/s", {})


def test_dedup_needs_a_dedup_window() -> None:
    (msg,) = dedup_blockers(info(), min_window=100)
    assert "non_replicated_deduplication_window=0" in msg and "MODIFY SETTING" in msg
    ok = info(settings={"non_replicated_deduplication_window": "1000"})
    assert dedup_blockers(ok, min_window=100) == []
    rep = info("ReplicatedMergeTree", settings={"replicated_deduplication_window": "1000"})
    assert dedup_blockers(rep, min_window=100) == []
    assert dedup_blockers(info("Memory"))


def _dist(key: str, functions: dict[str, bool | None], shards: int | None = 3) -> TargetInfo:
    tail = f", {key}" if key else ""
    return TargetInfo(
        "db", "d", "Distributed", engine_full=f"Distributed('c', 'db', 'local'{tail})",
        key_functions=functions, shard_count=shards,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("key", "functions", "shards"),
    [
        ("cityHash64(id)", {"cityHash64": True}, 3),
        ("intHash64(id)", {"intHash64": True}, None),
        ("id % 3", {}, 3),  # an operator, no call
        ("", {}, 1),  # one shard needs no key
        ("if(id IN (1, 2), 1, 0)", {"if": True}, 3),
    ],
)
def test_dedup_through_a_distributed_table_with_a_deterministic_split_is_allowed(
    key: str, functions: dict[str, bool | None], shards: int | None
) -> None:
    assert dedup_blockers(_dist(key, functions, shards)) == []


@pytest.mark.parametrize(
    ("key", "functions", "shards", "named"),
    [
        ("rand()", {"rand": False}, 3, "rand()"),
        ("rand64() % 3", {"rand64": False}, 3, "rand64()"),
        (
            "cityHash64(toString(now()))",
            {"cityHash64": True, "now": False, "toString": True},
            3,
            "now()",
        ),
        ("randConstant()", {"randConstant": False}, 3, "randConstant()"),
        ("neighbor(id, 1)", {"neighbor": None}, 3, "neighbor()"),  # the server cannot tell
        ("cityHash64(id)", {}, 3, "cityHash64()"),  # never observed: not vouched for
        ("", {}, 3, "without a sharding key over 3 shards"),
        ("", {}, None, "without a sharding key over a cluster txsink does not find"),
    ],
)
def test_dedup_through_a_distributed_table_a_replay_could_split_otherwise_is_refused(
    key: str, functions: dict[str, bool | None], shards: int | None, named: str
) -> None:
    (msg,) = dedup_blockers(_dist(key, functions, shards))
    assert named in msg and "db.d" in msg
    assert "cityHash64(<key column>)" in msg and "shards=" in msg  # the two fixes


def test_called_functions_are_calls_outside_quotes_not_operators() -> None:
    assert called_functions("cityHash64(toString(id)) % 3") == ("cityHash64", "toString")
    assert called_functions("if(id IN (1, 2), dictGet('d', 'rand()', id), x.f(1))") == (
        "if",
        "dictGet",
    )


def test_move_compat_reports_first_difference_and_accepts_equal() -> None:
    target = info(partition_key="toYYYYMM(d)", skip_indices=("ix TYPE minmax GRANULARITY 1 ON id",))
    same = TargetInfo(**{**target.__dict__, "database": "txsink_staging", "table": "s"})
    assert check_move_compat(same, target) is None
    no_index = TargetInfo(**{**same.__dict__, "skip_indices": ()})
    msg = check_move_compat(no_index, target)
    assert msg and "skip indices" in msg and "txsink_staging.s" in msg and "db.events" in msg
    other_key = TargetInfo(**{**same.__dict__, "partition_key": "toYear(d)"})
    assert "partition key" in (check_move_compat(other_key, target) or "")


def test_tune_combines_shards_summed_stages_and_summed_commits() -> None:
    from txsink.ops.tune import combine_shards
    from txsink.ops.tune_model import Sample, TuneResult

    def result(stage: float, commit: float, delay: int) -> TuneResult:
        samples = [Sample(i, 1, 10, stage, commit, 0.01, commit - 0.01) for i in (1, 2)]
        return TuneResult("db.t", "db.s", "tune-x", 0.1, samples, delay, 3000, 4, 0.1, 2, 60)

    combined = combine_shards(
        ["http://a", "http://b"], [result(0.2, 0.05, 900), result(0.1, 0.07, 1000)]
    )
    assert [round(s.stage_seconds, 3) for s in combined.samples] == [0.3, 0.3]
    assert [round(s.commit_seconds, 3) for s in combined.samples] == [0.12, 0.12]
    assert combined.parts_to_delay_insert == 900 and [s["url"] for s in combined.shards] == [
        "http://a",
        "http://b",
    ]


def _replicated(order: str, zk: str, replica: str, policy: str = "default") -> TargetInfo:
    engine_full = (
        f"ReplicatedMergeTree('{zk}', '{replica}') PARTITION BY d ORDER BY {order} "
        f"SETTINGS storage_policy = '{policy}', index_granularity = 8192"
    )
    return TargetInfo(
        "db", "t", "ReplicatedMergeTree", engine_full=engine_full, partition_key="d",
        sorting_key=order, primary_key="id", storage_policy=policy,
        zookeeper_path=zk, replica_name=replica,
    )  # fmt: skip


class _RecordingClient:
    url = "http://ch1:8123"

    def __init__(self) -> None:
        self.sql: list[str] = []
        self.facts: dict[str, float] = {}

    def command(self, sql: str, **kwargs: object) -> None:
        self.sql.append(sql)


def _warehouse_seeing(live: TargetInfo) -> tuple[Any, _RecordingClient]:
    """A ClickHouseWarehouse whose server holds ``live`` as db.t; the staging it reads back
    is what the last CREATE asked for."""
    import dataclasses
    import re

    from txsink.clickhouse.warehouse import ClickHouseWarehouse

    client = _RecordingClient()
    wh = ClickHouseWarehouse(client, "txsink_staging")  # type: ignore[arg-type]

    def target_info(name: str, staging: bool = False) -> TargetInfo:
        if name == "db.t":
            return live
        create = client.sql[-1]
        order = re.search(r"ORDER BY (.*?) SETTINGS", create)
        policy = re.search(r"storage_policy = '(\w+)'", create)
        assert order and policy, create
        return dataclasses.replace(
            live, database="txsink_staging", table=name.split(".")[1],
            sorting_key=order.group(1), storage_policy=policy.group(1),
            engine_full=create.split("ENGINE = ", 1)[1],
        )  # fmt: skip

    wh.target_info = target_info  # type: ignore[method-assign]
    wh._protect = lambda *_, **__: None  # type: ignore[method-assign]
    return wh, client


def _staging_table() -> str:
    from txsink.protocol.ids import run_tag, staging_name

    return staging_name("job", "b1", run_tag("run"), 0, 0, 7, "ns").table


def test_replicated_staging_is_built_from_the_target_as_this_server_has_it_now() -> None:
    """The plan's view is from when the stream started: an ALTER since (order key, storage
    policy) must not give staging that cannot be moved (found only after PREPARED)."""
    live = _replicated("id, k", "/clickhouse/tables/02/db/t", "r1", "tiered")
    stale = _replicated("id", "/clickhouse/tables/02/db/t", "r1", "default")
    wh, client = _warehouse_seeing(live)
    name = _staging_table()
    wh.create_staging("db.t", name, stale)
    create = client.sql[-1]
    assert "ORDER BY id, k" in create and "storage_policy = 'tiered'" in create, create
    assert f"'/clickhouse/tables/02/db/t_txsink_staging/txsink_staging/{name}', 'r1'" in create


def test_a_url_that_reaches_another_replica_is_refused_before_staging_is_created() -> None:
    live = _replicated("id", "/clickhouse/tables/01/db/t", "r2")
    validated = _replicated("id", "/clickhouse/tables/01/db/t", "r1")
    wh, client = _warehouse_seeing(live)
    from txsink.errors import ConfigError

    with pytest.raises(ConfigError, match=r"reached replica 'r2'.*load balancer"):
        wh.create_staging("db.t", _staging_table(), validated)
    assert client.sql == []


def test_the_driver_refuses_to_prepare_staging_it_cannot_see_on_a_replicated_target() -> None:
    """Tasks that staged on another replica (a load-balanced URL) are caught before the
    commit point, not by a MOVE that finds nothing after PREPARED; a table that holds
    other than what its task sent is refused too (the read-back the tasks made before)."""
    from types import SimpleNamespace

    from txsink.committer import staged_parts
    from txsink.config import WriterConfig
    from txsink.errors import ConfigError, TxSinkError
    from txsink.spark.messages import TxCommitMessage, WritePlan

    class Seen:
        staging_db = "txsink_staging"

        def __init__(self, present: set[str], rows: int = 1) -> None:
            self.present, self.rows = present, rows
            self.reads = 0

        def staged_partitions_of(
            self, names: list[str]
        ) -> dict[str, dict[str, tuple[int, tuple[str, ...]]] | None]:
            self.reads += 1
            return {n: ({"p": (self.rows, ("u",))} if n in self.present else None) for n in names}

        def commit_look(self, names: list[str], **_: Any) -> CommitLook:
            return CommitLook(self.staged_partitions_of(names))

    config = WriterConfig.from_options(
        {"url": "http://lb:8123", "keeper": "k:2181", "table": "db.t", "job": "j"}
    )
    plan = WritePlan(config, "attach", target_info=_replicated("id", "/p", "r1"))
    msgs = [
        TxCommitMessage("run", "b1", 1, staging=("s1",), inserted=(("s1", 1),)),
        TxCommitMessage("run", "b1", 1, staging=("s2",), inserted=(("s2", 1),)),
    ]
    both = Seen({"s1", "s2"})
    parts, _ = staged_parts(SimpleNamespace(warehouse=both), plan, msgs, "b1")
    assert [(p.table, p.partition_id, p.rows) for p in parts] == [("s1", "p", 1), ("s2", "p", 1)]
    assert both.reads == 1  # every task's table in one statement
    with pytest.raises(ConfigError, match=r"s2 .*more than one server"):
        staged_parts(SimpleNamespace(warehouse=Seen({"s1"})), plan, msgs, "b1")
    plain = WritePlan(config, "attach", target_info=TargetInfo("db", "t", "MergeTree"))
    with pytest.raises(TxSinkError, match=r"s2 holds 0 rows after its task inserted 1"):
        staged_parts(SimpleNamespace(warehouse=Seen({"s1"})), plain, msgs, "b1")
    with pytest.raises(TxSinkError, match=r"s1 holds 2 rows after its task inserted 1"):
        staged_parts(SimpleNamespace(warehouse=Seen({"s1", "s2"}, rows=2)), plain, msgs, "b1")


@pytest.mark.parametrize(
    ("spark", "ch"),
    [
        ("bigint", "SimpleAggregateFunction(sum, UInt64)"),
        ("bigint", "SimpleAggregateFunction(max, Int64)"),
        ("double", "SimpleAggregateFunction(sum, Float64)"),
        ("string", "SimpleAggregateFunction(anyLast, LowCardinality(String))"),
        ("array<bigint>", "SimpleAggregateFunction(groupArrayArray, Array(Int64))"),
        ("decimal(10,2)", "SimpleAggregateFunction(sum, Decimal(18, 2))"),
    ],
)
def test_a_simple_aggregate_function_column_takes_values_of_its_inner_type(
    spark: str, ch: str
) -> None:
    assert fits(spark, ch) == []


def test_a_simple_aggregate_function_column_checks_its_inner_type_and_nullability() -> None:
    assert unwrap(parse_ch_type("SimpleAggregateFunction(sum, UInt64)")) == (
        parse_ch_type("UInt64"),
        False,
    )
    assert unwrap(parse_ch_type("SimpleAggregateFunction(anyLast, Nullable(String))"))[1]
    assert fits("string", "SimpleAggregateFunction(sum, UInt64)") != []
    assert fits("bigint", "SimpleAggregateFunction(sum, Int32)") != []
    # a nullable Spark column into a non-Nullable inner type is refused like a plain column
    errors = fits("bigint", "SimpleAggregateFunction(sum, Int64)", nullable=True)
    assert len(errors) == 1 and "not Nullable" in errors[0]
    assert fits("bigint", "SimpleAggregateFunction(anyLast, Nullable(Int64))", nullable=True) == []


class _DatabasesClient(_RecordingClient):
    """Answers the staging database lookup: ``present`` or not."""

    def __init__(self, present: bool) -> None:
        super().__init__()
        self.present = present

    def query_rows(self, sql: str, **kwargs: object) -> list[tuple[int]]:
        self.sql.append(sql)
        return [(int(self.present),)]


@pytest.mark.parametrize("present", [True, False])
def test_an_existing_staging_database_is_not_created_again(present: bool) -> None:
    """ClickHouse asks for the CREATE DATABASE grant even when IF NOT EXISTS finds the
    database: a writer granted only what it does inside it must never send the CREATE."""
    from txsink.clickhouse.warehouse import ClickHouseWarehouse

    client = _DatabasesClient(present)
    ClickHouseWarehouse(client, "txsink_staging").ensure_staging_db()  # type: ignore[arg-type]
    creates = [s for s in client.sql if s.startswith("CREATE DATABASE")]
    assert len(creates) == (0 if present else 1), client.sql
