"""Driver-side validation before any row is written; resolves ``mode=auto``.

Checks, in order, each failing with one error that names the object and the remedy:
ClickHouse reachable and the target exists; the DataFrame schema fits the target
(:func:`txsink.clickhouse.chtypes.check_schema`); the mode is possible on this target
(MOVE PARTITION blockers, dedup-window requirements); Keeper reachable; the writer's
user may send the settings txsink sends (:mod:`txsink.spark.validate_settings`). Nothing is
written to the target by validation; the staging database is ensured, and Keeper's
``<keeper_root>/namespace`` node (the store's id) on first use. A missing target is
created first where ``create_table=if_missing`` (:func:`read_target`), then validated
as it is found: a racing writer may have created it with another schema.

Values: Spark marks most source columns nullable (Parquet, Kafka, JSON), so a nullable
DataFrame column bound for a non-Nullable ClickHouse column is accepted here, and every
batch is checked for actual nulls at write time instead, with the other checks types
alone cannot settle (negatives into unsigned types, ranges and precision of times):
the plan carries them (:func:`txsink.clickhouse.values.plan_rules`), the executors apply
them before a row is sent (:func:`txsink.spark.task.check_values`).

The mode is decided once per job and pinned (the rules and their table:
:mod:`txsink.protocol.job`): this module reads the target's blockers and the job's meta
and raises what the rules refuse, with the next step.

Results are cached per process for a short time: Spark asks for a writer on the driver
for every micro-batch. The commit re-checks what the cache could have missed (the tasks'
mode, new views: :mod:`txsink.committer`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

from pyspark.sql.types import StructType

from txsink.clickhouse.blockers import attach_blockers, dedup_blockers, dedup_notes
from txsink.clickhouse.chtypes import SparkField, check_schema, parse_ch_type, unwrap
from txsink.clickhouse.dedup_insert import view_tables
from txsink.clickhouse.error_map import ACCESS_DENIED, UNKNOWN_TABLE
from txsink.clickhouse.target_ddl import plan_create
from txsink.clickhouse.values import Check, Rule, plan_rules
from txsink.config import WriterConfig
from txsink.errors import (
    ConfigError,
    SchemaMismatch,
    UnavailableError,
)
from txsink.names import parse_url
from txsink.ports.warehouse import ColumnInfo, TargetInfo
from txsink.protocol import job as rules
from txsink.protocol.codec import JobMeta
from txsink.protocol.states import Mode
from txsink.protocol.visibility import (
    batch_refusal,
    grant_refusal,
)
from txsink.spark.messages import WritePlan
from txsink.spark.validate_settings import check_insert_settings

log = logging.getLogger(__name__)
CACHE_SECONDS = 30.0
_cache: dict[tuple[WriterConfig, str], tuple[float, WritePlan]] = {}
GRANT_CACHE_SECONDS = 600.0  # a GRANT (or REVOKE) is seen by auto this much later at most
_grant_cache: dict[tuple[str, str, str, str], tuple[float, str]] = {}


def not_nullable(columns: tuple[ColumnInfo, ...]) -> tuple[str, ...]:
    out = []
    for col in columns:
        _, nullable = unwrap(parse_ch_type(col.type))
        if not nullable:
            out.append(col.name)
    return tuple(out)


def value_rules(schema: StructType, infos: Sequence[TargetInfo]) -> tuple[Rule, ...]:
    """The value rules of writing ``schema`` into the target, on every shard (one rule
    once, whichever shards need it)."""
    fields = [SparkField(f.name, f.dataType.simpleString(), f.nullable) for f in schema.fields]
    rules: dict[Rule, None] = {}
    conversions: set[tuple[Rule, ...]] = set()
    for info in infos:
        zone = info.server_timezone or "UTC"
        mine = plan_rules(fields, info.columns, server_zone=zone)
        conversions.add(tuple(r for r in mine if r.check is Check.WALL_CLOCK))
        rules.update(dict.fromkeys(mine))
    if len(conversions) > 1:
        zones = sorted({i.server_timezone or "UTC" for i in infos})
        raise ConfigError(
            f"the shards of {infos[0].name} run in different time zones ({', '.join(zones)}): "
            "a timestamp_ntz column bound for a DateTime column without a zone would show "
            "another wall clock on each. Name the zone in the column's type "
            "(DateTime64(6, 'Europe/Berlin')) or write a timestamp. Nothing was written"
        )
    # conversions first: every check sees the values as they will be stored
    return tuple(sorted(rules, key=lambda r: r.check is not Check.WALL_CLOCK))


def choose_mode(
    config: WriterConfig,
    info: TargetInfo,
    view_tables: tuple[TargetInfo, ...] = (),
    pinned: str | None = None,
    why_not_shards: str = "",
) -> str:
    """The batch's mode, as :func:`txsink.protocol.job.resolve_mode` decides it from the
    target's blockers; ConfigError where it refuses; logs which and why (mode=auto).

    ``view_tables``: the tables the target's materialized views store into (dedup mode
    needs a dedup window there too). ``pinned``: the mode the job recorded at its first
    commit; it wins over ``auto`` and must still be possible on the target.
    ``why_not_shards``: why a Distributed target's shards cannot take attach mode
    (:func:`over_cluster`), said with its attach blockers.
    """
    pin = Mode(pinned) if pinned else None
    blockers = attach_blockers(info) + ([why_not_shards] if why_not_shards else [])
    problems: list[str] = []
    if pin is Mode.DEDUP or (pin is None and config.mode != "attach"):
        problems = dedup_blockers(info, min_window=config.dedup_min_window, view_tables=view_tables)
    if pin is None and config.mode != "attach":
        for note in dedup_notes(info):
            log.warning("job %s: %s", config.job, note)
    choice = rules.resolve_mode(config.job, config.table, config.mode, pin, blockers, problems)
    if choice.mode is None:
        raise ConfigError(choice.refusal)
    if pin is None and config.mode == "auto":
        if choice.fallback:
            log.warning(
                "job %s: mode=auto chose dedup for %s because %s",
                config.job, config.table, "; ".join(blockers),
            )  # fmt: skip
        else:
            log.info("job %s: mode=auto chose attach for %s", config.job, config.table)
    return choice.mode.value


def validate(config: WriterConfig, schema: StructType) -> WritePlan:
    """The write plan; the target inspection is cached, the job's pinned mode never is
    (an operator's `txsink mode` must take effect at the next batch).

    The cache ignores what changes from one save to the next without changing the
    target (``txn_version`` and ``run_id``: ``foreach_batch`` sets both per batch); the
    plan returned always carries the caller's own config."""
    key = (dataclasses.replace(config, txn_version=None, run_id=""), schema.json())
    hit = _cache.get(key)
    fresh = hit is not None and time.monotonic() - hit[0] < CACHE_SECONDS
    if hit is not None and fresh and read_pin(config)[0] in (None, hit[1].mode):
        # the cached plan's config may be the cluster a Distributed table names
        own = dataclasses.replace(
            hit[1].config, txn_version=config.txn_version, run_id=config.run_id
        )
        return dataclasses.replace(hit[1], config=own)
    plan = _validate(config, schema)
    _cache[key] = (time.monotonic(), plan)
    return plan


def read_pin(config: WriterConfig) -> tuple[str | None, str]:
    """(the job's pinned mode or None, the Keeper store's namespace); also proves Keeper
    reachable (UnavailableError names it otherwise)."""
    meta, namespace = read_job(config)
    return pinned_mode(meta, config.table), namespace


def read_job(config: WriterConfig) -> tuple[JobMeta | None, str]:
    """(the job's Keeper meta or None, the Keeper store's namespace)."""
    from txsink.driver import borrowed_registry

    with borrowed_registry(config) as registry:
        return registry.job_meta(config.job), registry.namespace()


def check_store(config: WriterConfig, warehouse: Any) -> None:
    """Refuse a new-looking job whose state lives in the other store (a job's store is
    fixed for its life: starting it afresh there would rewrite what it committed)."""
    from txsink.driver import job_in_other_store

    first = (getattr(warehouse, "shards", None) or [warehouse])[0]
    where = job_in_other_store(config, first.client)
    if where is not None:
        raise ConfigError(
            f"job {config.job} keeps its transaction state in {where}, but this writer names "
            f"state={config.state}: a job's state store is fixed for its life. Use the "
            "job's own store (option state), or a new job name for a new job. Nothing was "
            "written"
        )


def check_identity(config: WriterConfig, meta: JobMeta | None) -> None:
    """Refuse, before a task writes, a writer the job's first commit rules out (another
    target, another shard list: :func:`txsink.protocol.job.identity_refusal`): dedup-mode
    tasks insert into the target itself, so learning it at the commit would leave their
    rows visible and the batch refused."""
    stored = rules.JobFacts.of(meta)
    if stored is None or stored.targets is not None:
        return  # a transaction's tables are checked by txsink.transaction
    mine = rules.JobFacts(target=config.table, shards=tuple(config.shards), url=config.url)
    refusal = rules.identity_refusal(config.job, stored, mine)
    if refusal:
        raise ConfigError(f"{refusal}. Nothing was written")


def _validate(
    config: WriterConfig, schema: StructType, infos: list[TargetInfo] | None = None
) -> WritePlan:
    """The plan for ``config``; ``infos``: the target on each server, if already read."""
    from txsink.driver import borrowed_warehouse

    with borrowed_warehouse(config) as warehouse:
        if infos is None:
            infos = read_target(config, schema, warehouse)
        info = infos[0]
        why_not_shards = ""
        if info.engine == "Distributed" and not config.shards:
            over = over_cluster(config, schema, info, warehouse)
            if isinstance(over, WritePlan):
                return over
            why_not_shards = over
        strict = {c for i in infos for c in not_nullable(i.columns)}
        fields = [
            SparkField(f.name, f.dataType.simpleString(), f.nullable and f.name not in strict)
            for f in schema.fields
        ]
        notes: list[str] = []
        for url, shard_info in zip(config.shard_urls, infos, strict=True):
            problems = check_schema(
                fields, list(shard_info.columns), table=config.table, notes=notes
            )
            if problems:
                where = f" on shard {url}" if config.shards else ""
                raise SchemaMismatch(
                    f"the DataFrame does not fit {config.table}{where}; nothing was "
                    f"written:\n  - " + "\n  - ".join(problems)
                )
        for note in dict.fromkeys(notes):
            log.info("job %s: %s", config.job, note)
        values = value_rules(schema, infos)
        if config.shards:
            check_sharded(config, schema, infos)
        meta, namespace = read_job(config)
        if meta is None:
            check_store(config, warehouse)
        check_identity(config, meta)
        pinned = pinned_mode(meta, config.table)
        views: tuple[TargetInfo, ...] = ()
        if info.dependent_views and (pinned or config.mode) != "attach":
            views = view_tables(warehouse, info)
        mode = choose_mode(config, info, views, pinned, why_not_shards)
        config = dataclasses.replace(
            config, visibility=chosen_visibility(config, info, mode, warehouse)
        )
        check_insert_settings(config, warehouse, mode)
        if mode == "attach":
            warehouse.ensure_staging_db()
        else:  # every dedup block insert checks its batch's seal row there
            warehouse.ensure_seal_table()
    return WritePlan(
        config,
        mode,
        values,
        target_info=info if mode == "attach" else None,
        shard_infos=tuple(infos) if mode == "attach" and config.shards else (),
        namespace=namespace,
        written=tuple(schema.fieldNames()),
    )


def read_target(config: WriterConfig, schema: StructType, warehouse: Any) -> list[TargetInfo]:
    """The target on every server; where it is missing and ``create_table=if_missing``,
    created first (:func:`create_target`). Costs nothing while the table exists: the
    read that finds it missing is the one validation makes anyway."""

    def read() -> list[TargetInfo]:
        if config.shards:
            return list(warehouse.target_infos(config.table))
        return [warehouse.target_info(config.table)]

    try:
        return read()
    except ConfigError as exc:
        if exc.code != UNKNOWN_TABLE:
            raise
        if config.create_table != "if_missing":
            raise ConfigError(
                f"{exc}; or let the writer create it from the DataFrame's schema: "
                "create_table=if_missing with order_by (docs/options.md#creating-the-target)",
                code=exc.code,
            ) from None
    create_target(config, schema, warehouse)
    return read()


def create_target(config: WriterConfig, schema: StructType, warehouse: Any) -> None:
    """``CREATE TABLE IF NOT EXISTS`` the target from the DataFrame's schema, on every
    server of the job (:func:`txsink.clickhouse.target_ddl.plan_create`); the statement
    is logged. A table made for dedup mode (``mode=dedup``, or a job pinned to it) gets
    the dedup window dedup mode requires."""
    dedup = config.mode == "dedup" or (config.mode == "auto" and read_pin(config)[0] == "dedup")
    sql = plan_create(
        config.table,
        [(f.name, f.dataType.jsonValue(), f.nullable) for f in schema.fields],
        engine=config.engine,
        order_by=config.order_by,
        partition_by=config.partition_by,
        table_settings=config.table_settings,
        dedup_window=config.dedup_min_window if dedup else None,
    )
    log.info(
        "job %s: %s does not exist; creating it on %s (create_table=if_missing):\n%s",
        config.job, config.table, ", ".join(config.shard_urls), sql,
    )  # fmt: skip
    warehouse.create_target(config.table, sql)


def over_cluster(
    config: WriterConfig, schema: StructType, info: TargetInfo, warehouse: Any
) -> WritePlan | str:
    """The plan of a write into the ``Distributed`` table ``info`` as one sharded xid
    over its cluster's local tables (shards from ``system.clusters``, ``shard_by`` from
    its sharding key: :func:`txsink.clickhouse.shards.parse_distributed`). Where dedup
    mode through the Distributed table is asked (``mode=dedup``, a job pinned to dedup),
    "" instead; where ``mode=auto`` falls back to it because the cluster's *shape* rules
    attach out (a sharding key txsink cannot reproduce, weights, replicas without
    replicated local tables, an attach blocker on a local table), the reason, which
    :func:`choose_mode` adds to the attach blockers. Anything else (a shard
    that does not answer, a missing local table, a schema that does not fit, refused
    credentials) is raised as it is: a new job must not be pinned to dedup for good
    because of a passing problem."""
    from txsink.clickhouse.shards import cluster_urls, parse_distributed, replicas_per_shard
    from txsink.driver import borrowed_warehouse

    pinned = read_pin(config)[0]
    if "dedup" in (config.mode, pinned):
        return ""

    def no_cluster(reason: str) -> str:
        """Raise where attach was asked or pinned; else warn, and the reason: dedup mode
        (if :func:`~txsink.clickhouse.blockers.dedup_blockers` allows it)."""
        if "attach" in (config.mode, pinned):
            raise ConfigError(
                f"job {config.job}: {config.table} is a Distributed table; attach mode writes "
                f"one xid into its local tables on every shard, which is impossible here: "
                f"{reason}. Nothing was written"
            )
        log.warning(
            "job %s: %s is Distributed and its shards cannot take one attach-mode xid "
            "(%s); mode=auto inserts through it in dedup mode",
            config.job, config.table, reason,
        )  # fmt: skip
        return f"its shards cannot take attach mode: {reason}"

    try:
        target = parse_distributed(info)
    except ConfigError as exc:
        return no_cluster(str(exc))
    target = dataclasses.replace(target, cluster=warehouse.expand_macros(target.cluster))
    replicas = warehouse.cluster_replicas(target.cluster)
    url = parse_url(config.url)
    port = config.shard_http_port or url.port
    try:
        urls = cluster_urls(target, replicas, url.scheme, port)
    except ConfigError as exc:
        return no_cluster(str(exc))
    sharded = dataclasses.replace(
        config,
        url=urls[0],
        table=target.local_table,
        shards=urls,
        shard_by=target.shard_by,
        shard_http_port=None,
    )
    found = f"{config.table}'s cluster {target.cluster} (system.clusters on {config.url})"
    try:
        with borrowed_warehouse(sharded) as shards:
            infos = shards.target_infos(sharded.table)
        blockers = sorted({b for i in infos for b in attach_blockers(i)})
        several = sorted(k for k, n in replicas_per_shard(replicas).items() if n > 1)
        if several and not all(i.is_replicated for i in infos):
            blockers.append(
                f"shard(s) {', '.join(map(str, several))} of {found} list several replicas "
                f"but {sharded.table} is not a replicated table: the Distributed table writes "
                f"every replica itself, txsink would write only the first"
            )
        if blockers:
            return no_cluster("; ".join(blockers))
        plan = _validate(sharded, schema, infos)
    except UnavailableError as exc:
        raise UnavailableError(
            f"{exc}. The shard URLs {', '.join(urls)} were found from {found}: their hosts "
            f"must answer HTTP on port {port} from the driver and the executors (set "
            f"shard_http_port, or give shards= with each shard's URL, or use mode=dedup)",
            code=exc.code,
        ) from exc
    log.info(
        "job %s: %s is Distributed over cluster %s: one xid into %s on %s",
        config.job, config.table, target.cluster, target.local_table, ", ".join(urls),
    )  # fmt: skip
    return plan


def chosen_visibility(config: WriterConfig, info: TargetInfo, mode: str, warehouse: Any) -> str:
    """:func:`visibility_choice` without its reason."""
    return visibility_choice(config, info, mode, warehouse)[0]


def visibility_choice(
    config: WriterConfig, info: TargetInfo, mode: str, warehouse: Any
) -> tuple[str, str]:
    """(``partition`` or ``batch``, why ``auto`` chose partition or ""): the option as
    given, or with ``auto`` the one the
    target can honour (batch: attach mode, one non-replicated MergeTree server, a
    readable query log, the evidence of an ATTACH that outlives the target's merges, a
    profile that lets the ATTACH send its log settings, and a user the server lets run
    that ATTACH, which MOVE's grants do not cover: :func:`grant_problem`).
    An explicit ``batch`` it cannot honour is refused here, before anything is staged,
    not found missing after PREPARED. Asked once per validation (cached:
    :func:`validate`), never per task or per publish."""
    refusal = batch_refusal(config.table, info.engine, mode)
    if config.shards:  # an explicit batch was refused by check_sharded
        refusal = refusal or "visibility=batch cannot span shards"
    if config.visibility == "partition" or (config.visibility == "auto" and refusal):
        return "partition", refusal
    if refusal:
        raise ConfigError(f"job {config.job}: {refusal}. Nothing was written")
    try:
        why = grant_problem(config, info, warehouse)
        if not why:
            warehouse.attach_logged(config.table, f"txsink probe {config.job}", time.time())
            if config.visibility == "auto":  # and the settings its ATTACH sends are allowed
                batch = dataclasses.replace(config, visibility="batch")
                check_insert_settings(batch, warehouse, mode)
    except ConfigError as exc:
        if config.visibility == "batch":
            raise
        log.info(
            "job %s: visibility=auto chose partition for %s: %s", config.job, config.table, exc
        )
        return "partition", str(exc)
    if why:
        if config.visibility == "batch":
            raise ConfigError(f"job {config.job}: {why}. Nothing was written", code=ACCESS_DENIED)
        log.info(
            "job %s: visibility=auto chose partition for %s: %s", config.job, config.table, why
        )
        return "partition", why
    return "batch", ""


def grant_problem(config: WriterConfig, info: TargetInfo, warehouse: Any) -> str:
    """Why the writer's user may not run the statements of a batch publish into the
    target ("" when it may), as the server answers them (probes that change nothing):
    the ATTACH PARTITION ALL FROM (ALTER DELETE on the target, which MOVE does not
    need).

    Remembered per process for :data:`GRANT_CACHE_SECONDS`: each probe is a statement
    the server refuses (no such table, or not enough privileges), which it logs as an
    error; a stream revalidating every :data:`CACHE_SECONDS` would fill its error log."""
    user = config.user or "default"
    key = (config.url, user, config.table, config.staging_database)
    hit = _grant_cache.get(key)
    if hit is not None and time.monotonic() - hit[0] < GRANT_CACHE_SECONDS:
        return hit[1]
    why = ""
    denied = warehouse.attach_refusal(config.table)
    if denied:
        why = grant_refusal(config.table, user, config.staging_database, denied)
    _grant_cache[key] = (time.monotonic(), why)
    return why


INTEGER_TYPES = ("tinyint", "smallint", "int", "bigint")


def check_sharded(config: WriterConfig, schema: StructType, infos: list[TargetInfo]) -> None:
    """What a sharded job needs: attach mode (one xid publishes by MOVE on
    every shard), partition visibility (one ATTACH cannot span servers), a target on
    every shard that attach mode can publish into, an integer ``shard_by`` column."""
    if config.mode == "dedup":
        raise ConfigError(
            f"job {config.job}: mode=dedup is not offered with shards (each shard would need "
            f"its own deterministic blocks and window); use mode=attach. Nothing was written"
        )
    if config.visibility == "batch":
        raise ConfigError(
            f"job {config.job}: visibility=batch cannot span shards (one ATTACH PARTITION ALL "
            f"per server is not one step); use visibility=partition. Nothing was written"
        )
    for url, info in zip(config.shards, infos, strict=True):
        blockers = attach_blockers(info)
        if blockers:
            raise ConfigError(
                f"job {config.job}: {config.table} on shard {url} cannot take attach mode, "
                f"which a sharded job needs: {'; '.join(blockers)}. Nothing was written"
            )
    if config.shard_by:
        found = {f.name: f.dataType.simpleString() for f in schema.fields}
        kind = found.get(config.shard_by)
        if kind not in INTEGER_TYPES:
            raise ConfigError(
                f"job {config.job}: shard_by={config.shard_by!r} must name an integer column "
                f"of the DataFrame (the sharding key is intHash64 of it); "
                + ("there is no such column" if kind is None else f"it is {kind}")
                + ". Nothing was written"
            )


def pinned_mode(meta: JobMeta | Mapping[str, Any] | None, table: str | None = None) -> str | None:
    """The mode the job's Keeper meta pins for ``table`` (:func:`rules.pinned_mode`)."""
    pin = rules.pinned_mode(rules.JobFacts.of(meta), table)
    return pin.value if pin is not None else None
