"""Why a target cannot take attach or dedup mode, and whether staging can be moved into it.

Owned by the ClickHouse adapter; pure (no I/O): :mod:`txsink.clickhouse.warehouse`
observes the server into :class:`~txsink.ports.warehouse.TargetInfo` records and the
functions here decide. Invariants:

- every message names the table and, where there is one, the column, and says what to do;
- an empty list means "no problem found", never "not checked";
- :func:`attach_blockers` lists *every* reason ``MOVE PARTITION`` cannot publish into a
  target, so the driver can pick ``mode=dedup`` with one explanation;
- :func:`plan_column_catch_up` repairs only columns a target gained after staging was
  created; any other difference is reported, never guessed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from txsink.clickhouse.replicated_ddl import split_engine
from txsink.clickhouse.sqltext import called_functions
from txsink.ports.warehouse import WINDOW_SECONDS_KEY, ColumnInfo, TargetInfo
from txsink.protocol.dedup_window import Window

VIEW_ENGINES = frozenset({"View", "MaterializedView", "LiveView", "WindowView"})


def dedup_window(info: TargetInfo) -> Window | None:
    """The window dedup mode checks every block against (see :mod:`txsink.protocol.dedup`);
    None where txsink cannot observe it (not a MergeTree: a Distributed target's shards)."""
    if not info.is_merge_tree:
        return None
    seconds = info.dedup_window_seconds
    return Window(
        parts=info.dedup_window,
        setting=info.dedup_window_setting,
        seconds=seconds,
        seconds_setting=WINDOW_SECONDS_KEY if seconds is not None else None,
    )


# --------------------------------------------------------------------------- blockers


def attach_blockers(info: TargetInfo) -> list[str]:
    """Every reason ``ALTER TABLE staging MOVE PARTITION ... TO TABLE target`` cannot be used.

    A target without a partition key is fine: all its rows live in partition id ``all``.
    """
    t = info.name
    remedy = "use mode=dedup (direct inserts with insert_deduplication_token)"
    out: list[str] = []
    if info.engine in VIEW_ENGINES:
        out.append(
            f"target {t} is a {info.engine}, not a table: write to the table it reads "
            f"from or stores into, or {remedy}"
        )
    elif info.engine == "Distributed":
        out.append(
            f"target {t} is a Distributed table: partitions can only be moved on each "
            f"shard's local table; point table= at the local MergeTree table or {remedy}"
        )
    elif not info.is_merge_tree:
        out.append(
            f"target {t} uses engine {info.engine}, which has no partitions to move "
            f"(MergeTree family only); {remedy}"
        )
    if info.engine.startswith("Shared"):
        out.append(
            f"target {t} uses {info.engine} (ClickHouse Cloud): txsink creates its staging "
            f"tables per replica, which SharedMergeTree has no notion of; {remedy}"
        )
    elif info.is_replicated and info.zookeeper_path and not info.zookeeper_path.startswith("/"):
        out.append(
            f"target {t} is replicated through the auxiliary ZooKeeper "
            f"{info.zookeeper_path.split(':', 1)[0]!r} ({info.zookeeper_path}); txsink's "
            f"staging for such tables is not built or tested yet; {remedy}"
        )
    elif info.is_replicated and not (info.zookeeper_path and info.replica_name):
        out.append(
            f"target {t} uses {info.engine} but system.replicas does not list it on this "
            f"server, so txsink cannot give its staging a Keeper path of its own: check the "
            f"server's <zookeeper> configuration, or {remedy}"
        )
    if info.dependent_views:
        views = ", ".join(info.dependent_views)
        out.append(
            f"target {t} feeds materialized view(s) {views}: MOVE PARTITION does not fire "
            f"them, so they would miss the rows; {remedy}"
        )
    return out


def dedup_blockers(
    info: TargetInfo, *, min_window: int = 1, view_tables: Sequence[TargetInfo] = ()
) -> list[str]:
    """Every reason ``mode=dedup`` (direct inserts with ``insert_deduplication_token``) is
    unsafe for this target.

    A replay of a batch interrupted mid-insert is only exactly-once if the target
    deduplicates blocks by token within a window of at least ``min_window`` inserts.
    ``view_tables`` are the tables the target's materialized views store into: txsink
    sends ``deduplicate_blocks_in_dependent_materialized_views=1`` with every block, but
    ClickHouse (26.9, docs/reliability.md) deduplicates a view's block only in a view table that
    has a dedup window itself; with none, a replayed block is dropped from the target and
    counted again in the view. A Distributed target is blocked only where a replay could
    split a block over the shards differently (:func:`distributed_blockers`):
    deduplication happens in the shards' local tables, which must have the window set
    (txsink cannot see them from here; see :func:`dedup_notes`).
    """
    t = info.name
    if info.engine in ("View", "LiveView", "WindowView"):
        return [f"target {t} is a {info.engine} and cannot be inserted into; write to its source"]
    if info.engine == "MaterializedView":
        return [
            f"target {t} is a materialized view; write to the table it reads from (or its "
            "TO table) instead"
        ]
    if info.engine == "Distributed":
        return distributed_blockers(info)
    if not info.is_merge_tree:
        return [
            f"target {t} uses engine {info.engine}, which does not deduplicate inserts: a "
            "batch interrupted mid-insert would be duplicated on replay; use a MergeTree "
            "table"
        ]
    out = (
        [_window_blocker(f"target {t}", info, min_window)] if info.dedup_window < min_window else []
    )
    for view in view_tables:
        if not view.is_merge_tree:
            out.append(
                f"{view.name}, fed by a materialized view of {t}, uses engine {view.engine}, "
                "which does not deduplicate: a replayed block would be counted twice there; "
                "store the view into a MergeTree table"
            )
        elif view.dedup_window < min_window:
            out.append(
                _window_blocker(
                    f"{view.name} (fed by a materialized view of {t})", view, min_window
                )
                + ": without it a replayed block is deduplicated in the target but counted "
                "again in the view"
            )
    return out


def distributed_blockers(info: TargetInfo) -> list[str]:
    """Why dedup mode through the ``Distributed`` table ``info`` could write a row twice.

    The table splits every block over its shards by its sharding key, and each shard
    deduplicates its own sub-block by the block's token. A replay is exact only if it
    splits each block as the first attempt did: the key must call only functions the
    server marks deterministic (``rand()``, ``now()``, ``generateUUIDv4()``,
    ``rowNumberInBlock()``, ``dictGet()``... are not; one the server cannot vouch for
    counts as not), and a table without a key must have one shard (ClickHouse refuses
    the inserts otherwise, or, with ``insert_distributed_one_random_shard``, picks a
    shard per block at random). Otherwise a shard that saw the token drops rows it never
    got and another one stores rows it already has."""
    t = info.name
    fix = (
        f"give {t} a deterministic sharding key, e.g. cityHash64(<key column>) (a "
        "Distributed table holds no rows: recreate it with the key), or let txsink write "
        "each shard itself: option shards= (the shard URLs) with table= the local table, "
        "in attach mode"
    )
    try:
        _, args, _ = split_engine(info.engine_full)
    except ValueError:
        args = []
    if len(args) < 3:
        return [
            f"target {t} is Distributed, but txsink cannot read its sharding key from "
            f"{info.engine_full!r}, so it cannot tell whether a replayed block reaches the "
            f"shards that saw it; {fix}"
        ]
    key = args[3].strip() if len(args) > 3 else ""
    if not key:
        if info.shard_count == 1:
            return []
        over = (
            f"{info.shard_count} shards"
            if info.shard_count
            else "a cluster txsink does not find in system.clusters"
        )
        return [
            f"target {t} is Distributed without a sharding key over {over}: a replayed "
            f"block could go to another shard than the first attempt's, which does not "
            f"know its token; {fix}"
        ]
    unsafe = [f for f in called_functions(key) if info.key_functions.get(f) is not True]
    if unsafe:
        calls = ", ".join(f"{f}()" for f in unsafe)
        return [
            f"target {t} is Distributed with sharding key {key}, which calls {calls}: not "
            f"deterministic (system.functions), so a replayed batch is split over the "
            f"shards differently and each shard deduplicates only the rows it saw, "
            f"duplicating some rows and dropping others; {fix}"
        ]
    return []


def _window_blocker(what: str, info: TargetInfo, min_window: int) -> str:
    key = (
        "replicated_deduplication_window"
        if info.is_replicated
        else "non_replicated_deduplication_window"
    )
    return (
        f"{what} has {key}={info.dedup_window} (< {min_window}): a replayed block "
        f"would not be deduplicated; run ALTER TABLE {info.name} MODIFY SETTING "
        f"{key} = {max(min_window, 100)}"
    )


def dedup_notes(info: TargetInfo) -> list[str]:
    """What dedup mode relies on but cannot check (logged as warnings, not refused)."""
    if info.is_merge_tree:
        window = dedup_window(info)
        if window is None or window.seconds is None:
            return []
        return [
            f"target {info.name} is replicated: ClickHouse forgets its dedup tokens after "
            f"{WINDOW_SECONDS_KEY}={window.seconds:.0f} s, so a batch interrupted mid-insert "
            f"must be replayed within that time (minus a margin) of its first insert, or the "
            "replay is refused with DedupWindowExceeded"
        ]
    if info.engine != "Distributed":
        return []
    return [
        f"target {info.name} is Distributed: txsink inserts with insert_distributed_sync=1 "
        "(distributed_foreground_insert) so a block is on the shards when acknowledged; "
        "every shard's local table must be a MergeTree with a dedup window "
        "(non_replicated_/replicated_deduplication_window); txsink does not check the "
        "shards' windows (parts and seconds). Do not change the cluster's shards or "
        "weights while a batch may be replayed: the replay would be split differently"
    ]


def check_move_compat(staging: TargetInfo, target: TargetInfo) -> str | None:
    """The first difference that would make MOVE PARTITION fail or publish incomplete parts.

    ClickHouse 26.9 itself rejects different columns, keys and extra staging indices, but
    accepts a staging *without* the target's indices/projections (the moved parts then
    lack them) and a different engine: this check is stricter and demands equality.
    """
    pairs: list[tuple[str, object, object]] = [
        ("engine", staging.engine, target.engine),
        ("columns", _col_sig(staging), _col_sig(target)),
        ("partition key", staging.partition_key, target.partition_key),
        ("sorting key", staging.sorting_key, target.sorting_key),
        ("primary key", staging.primary_key, target.primary_key),
        ("sampling key", staging.sampling_key, target.sampling_key),
        ("storage policy", staging.storage_policy, target.storage_policy),
        ("skip indices", staging.skip_indices, target.skip_indices),
        ("projections", staging.projections, target.projections),
    ]
    for what, mine, theirs in pairs:
        if mine != theirs:
            return (
                f"staging table {staging.name} differs from target {target.name} in its "
                f"{what} ({mine!r} vs {theirs!r}); drop the staging table and retry, or "
                f"use mode=dedup"
            )
    return None


def _col_sig(info: TargetInfo) -> tuple[tuple[str, str], ...]:
    return tuple((c.name, c.type) for c in info.columns)


@dataclass(frozen=True)
class AddColumn:
    """One column staging lacks: add ``column`` after ``after`` (None: FIRST)."""

    column: ColumnInfo
    after: str | None


def plan_column_catch_up(
    staging: TargetInfo, target: TargetInfo
) -> tuple[list[AddColumn], str | None]:
    """How to bring a staging table in line with a target altered after it was created.

    Only one change is repaired: the target *gained* columns (``ALTER TABLE ... ADD
    COLUMN``, at any position). Staged parts lack them and the target computes their
    DEFAULT (or MATERIALIZED/ALIAS expression) on read, exactly as for its own older
    parts. Returns ``(additions, None)``, or ``([], problem)`` for every other
    difference: a column dropped or renamed in the target (staged values would be
    lost: refused, the operator decides), a changed type, order or key, another engine.
    """
    t = target.name
    have = {c.name: c for c in staging.columns}
    want = {c.name: c for c in target.columns}
    gone = [c.name for c in staging.columns if c.name not in want]
    if gone:
        return [], (
            f"target {t} no longer has column(s) {', '.join(gone)} that staging table "
            f"{staging.name} holds (dropped or renamed after the batch was staged); txsink "
            f"does not drop staged values: add the column(s) back to {t} (ALTER TABLE {t} "
            f"ADD COLUMN ...), run `txsink recover`, then drop them again "
            f"(docs/operations.md#target-altered)"
        )
    retyped = [
        f"{n} ({have[n].type} -> {want[n].type})" for n in have if have[n].type != want[n].type
    ]
    if retyped:
        return [], (
            f"column type(s) of target {t} changed after the batch was staged in "
            f"{staging.name}: {', '.join(retyped)}; restore the old type(s) on {t}, run "
            f"`txsink recover`, then change them again (docs/operations.md#target-altered)"
        )
    order = [c.name for c in target.columns if c.name in have]
    if order != [c.name for c in staging.columns]:
        return [], (
            f"the columns of target {t} were reordered after the batch was staged in "
            f"{staging.name}; restore the order, run `txsink recover` "
            f"(docs/operations.md#target-altered)"
        )
    additions: list[AddColumn] = []
    prev: str | None = None
    for col in target.columns:
        if col.name not in have:
            additions.append(AddColumn(col, prev))
        prev = col.name
    caught_up = TargetInfo(
        database=staging.database,
        table=staging.table,
        engine=staging.engine,
        partition_key=staging.partition_key,
        sorting_key=staging.sorting_key,
        primary_key=staging.primary_key,
        sampling_key=staging.sampling_key,
        storage_policy=staging.storage_policy,
        columns=target.columns,
        skip_indices=staging.skip_indices,
        projections=staging.projections,
    )
    problem = check_move_compat(caught_up, target)
    if problem:
        return [], (
            f"{problem.split('; ')[0]}: target {t} was altered after the batch was staged; "
            f"only added columns are repaired automatically: restore the target, run "
            f"`txsink recover` (docs/operations.md#target-altered)"
        )
    return additions, None
