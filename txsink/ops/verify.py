"""The auditor behind ``txsink verify``: the committed history and the target, cross-checked.

In the spirit of eBay's Aggregator Runtime Verifier (ARV), which replays the metadata its
Block Aggregators committed and checks each consecutive pair. Here the metadata is the
xid records in Keeper, ordered by their commit sequence ``seq`` (the ledger's
counter, assigned in the same Keeper transaction as COMMITTED). For consecutive
committed batch xids ``M`` and ``M'`` (``b<n>``; ad-hoc ``u...`` xids of batch saves
without txn_version have no order and are exempt):

- **backward**: ``M'.batch < M.batch`` (a batch committed after a later one);
- **overlap**: two committed xids claim the same batch (``M'.batch == M.batch`` is the
  consecutive case): its rows were published twice;
- **gap**: ``M'.batch > M.batch + 1``: the batches in between were never committed
  (lost, or the history was edited).

Retention prunes the oldest COMMITTED records, so only pairs inside the retained
history are checked. Further checks: PREPARED xids older than a threshold (data nobody
has published), and **reconciliation**: per partition id, what the ledgers of every job
writing the target say was committed against the target's active rows in
``system.parts``. Equal when txsink is the only writer. Dedup-mode ledgers count Spark
partitions, not target partitions, so a target any dedup-mode job writes is reconciled
by total only. A ledger keeps per-partition totals only for its most recently written
partitions (:mod:`txsink.ports.ledger`); partitions it evicted, or that came back after
an eviction, cannot be reconciled one by one: they are reconciled together as one
``(evicted)`` bucket (with a ``ledger-evicted`` warning naming them), so the total always is.
A sharded job's own target is also reconciled shard by shard against the ledger's
per-shard totals (rows published on the wrong shard cancel out in the sum, not here).
A job that commits several tables in one xid (``txsink.transaction``) is reconciled table
by table: its ledger is cut per table (:func:`txsink.ports.ledger.table_view`) and each
PREPARED xid counts as in flight only for the tables its entries name.

Everything below :func:`verify` is pure and unit-tested without services.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterable, Mapping
from typing import Any

from txsink.driver import open_registry, open_warehouse
from txsink.names import split_table
from txsink.ops.anomalies import (
    DEFAULT_RECENT,
    DEFAULT_STUCK_AFTER,
    Finding,
    VerifyResult,
    batch_of,
    committed_history,
    detect_anomalies,
    stuck_prepared,
)
from txsink.ports.ledger import LEDGER_PARTITIONS, exact_partitions, maybe_evicted, table_view
from txsink.ports.registry import Registry
from txsink.protocol.codec import JobMeta, Ledger, as_job_meta, as_ledger
from txsink.protocol.ids import staging_prefix
from txsink.protocol.states import Mode, XidRecord, XidState

# Re-exported: the audit's result types and history rules live in txsink.ops.anomalies.
__all__ = [
    "EVICTED",
    "fold",
    "job_tables",
    "ledger_partition_rows",
    "reconcile",
    "verify",
    "verify_job",
]

log = logging.getLogger(__name__)

# Engines whose merges remove rows: the target may legitimately hold fewer than committed.
_MERGING_ENGINES = re.compile(
    r"^(Replacing|Summing|Aggregating|Collapsing|VersionedCollapsing|Graphite|Coalescing)"
    r"MergeTree$"
)

# --------------------------------------------------------------------------- reconciliation

EVICTED = "(evicted)"


def ledger_partition_rows(
    ledgers: Iterable[Ledger | Mapping[str, Any]], target_rows: Mapping[str, int]
) -> tuple[dict[str, int], set[str]]:
    """(committed rows per partition id, the ids folded into :data:`EVICTED`) (pure).

    A partition is reconciled by itself only when every ledger either counts all of its
    rows (in the window, not partial) or certainly never held it; all others, and every
    ledger's evicted total, go into one ``EVICTED`` bucket.
    """
    typed = [as_ledger(ledger) for ledger in ledgers]
    folded: set[str] = set()
    pids = set(target_rows)
    for ledger in typed:
        window = set(ledger.partitions)
        pids |= window
        folded |= window - set(exact_partitions(ledger))
    for ledger in typed:
        window = set(ledger.partitions)
        folded |= {p for p in pids - window if maybe_evicted(ledger, p)}
    rows: dict[str, int] = {}
    for ledger in typed:
        for pid, n in ledger.partitions.items():
            key = EVICTED if pid in folded else pid
            rows[key] = rows.get(key, 0) + n
        if ledger.evicted_rows or ledger.evicted_partitions:
            rows[EVICTED] = rows.get(EVICTED, 0) + ledger.evicted_rows
    return rows, folded


def fold(rows: Mapping[str, int], folded: set[str]) -> dict[str, int]:
    """``rows`` with the ids in ``folded`` summed under :data:`EVICTED`."""
    out: dict[str, int] = {}
    for pid, n in rows.items():
        key = EVICTED if pid in folded else pid
        out[key] = out.get(key, 0) + int(n)
    return out


def evicted_warning(target: str, writers: Mapping[str, Any], folded: set[str]) -> Finding:
    sample = ", ".join(sorted(folded)[:5]) + (", ..." if len(folded) > 5 else "")
    evictions = sum(as_ledger(w).evicted_partitions for w in writers.values())
    return Finding(
        "ledger-evicted",
        f"reconciliation of {len(folded)} partition(s) of {target} ({sample}) one by one is not "
        f"possible: the ledger of {', '.join(sorted(writers))} keeps per-partition totals of its "
        f"{LEDGER_PARTITIONS} most recently written partitions ({evictions} eviction(s) so far); "
        f"they are reconciled together as {EVICTED!r}",
    )


def reconcile(
    target: str,
    ledger_rows: Mapping[str, int],
    target_rows: Mapping[str, int],
    inflight: Mapping[str, int] | None = None,
    *,
    jobs: Iterable[str] = (),
    allow_other_writers: bool = False,
    engine_merges: bool = False,
    by_partition: bool = True,
) -> tuple[list[Finding], list[Finding]]:
    """(anomalies, warnings) of ledger totals vs target rows (pure).

    ``ledger_rows``/``target_rows``/``inflight`` map partition id to rows; with
    ``by_partition=False`` they are compared as totals (key ``"*"``). ``inflight`` is
    rows of PREPARED xids, which may already sit in the target before the ledger counts
    them. A surplus is another writer's (a warning with ``allow_other_writers``); a
    deficit is lost rows unless the engine's merges remove rows.
    """
    inflight = dict(inflight or {})
    who = ", ".join(sorted(jobs)) or "txsink"
    if not by_partition:
        ledger_rows = {"*": sum(ledger_rows.values())}
        target_rows = {"*": sum(target_rows.values())}
        inflight = {"*": sum(inflight.values())}
    anomalies: list[Finding] = []
    warnings: list[Finding] = []
    for pid in sorted(set(ledger_rows) | set(target_rows)):
        want, have = int(ledger_rows.get(pid, 0)), int(target_rows.get(pid, 0))
        if want == have:
            continue
        where = (
            f"{target} (total)"
            if pid == "*"
            else f"the partitions of {target} evicted from the ledger (together)"
            if pid == EVICTED
            else f"partition {pid} of {target}"
        )
        diff = have - want
        base = f"reconciliation: {where} has {have} rows, the ledger of {who} counts {want}"
        if diff > 0:
            if diff <= inflight.get(pid, 0):
                warnings.append(
                    Finding(
                        "in-flight",
                        f"{base}: {diff} rows of PREPARED xids are published but not yet "
                        "recorded (a commit in flight, or `txsink recover` will record it)",
                        partition=pid,
                    )
                )
            elif allow_other_writers:
                warnings.append(
                    Finding(
                        "other-writers",
                        f"{base}: {diff} rows were written by something other than txsink",
                        partition=pid,
                    )
                )
            else:
                anomalies.append(
                    Finding(
                        "reconciliation",
                        f"{base}: {diff} rows more than txsink committed (duplicates, or another "
                        "writer: pass --allow-other-writers if others write this table)",
                        partition=pid,
                    )
                )
        elif engine_merges:
            warnings.append(
                Finding(
                    "merged-away",
                    f"{base}: {-diff} rows fewer; the engine's merges remove rows, so the target "
                    "may hold fewer than committed",
                    partition=pid,
                )
            )
        else:
            anomalies.append(
                Finding(
                    "reconciliation",
                    f"{base}: {-diff} rows missing (lost rows, or removed by DROP PARTITION, "
                    "DELETE or TTL)",
                    partition=pid,
                )
            )
    return anomalies, warnings


# --------------------------------------------------------------------------- the audit


def verify(
    registry: Registry,
    warehouse: Any,
    job: str,
    *,
    target: str | None = None,
    now: float | None = None,
    stuck_after: float = DEFAULT_STUCK_AFTER,
    recent: int = DEFAULT_RECENT,
    allow_other_writers: bool = False,
) -> VerifyResult:
    """Audit one job: history anomalies, stuck PREPARED xids, reconciliation, leftovers."""
    now = time.time() if now is None else now
    meta = registry.job_meta(job) or JobMeta()
    explicit = bool(target)
    target = target or meta.target
    result = VerifyResult(job, target)
    records = registry.list(job)
    history = committed_history(records)
    # streaming jobs (and foreach_batch) record their query id; their batch ids are dense
    result.anomalies += detect_anomalies(records, contiguous=bool(meta.query_id))
    result.anomalies += stuck_prepared(records, now, stuck_after)
    seqs = [s for r in history if (s := r.seq) is not None]
    result.checked.update(
        committed_retained=len(history),
        seq_range=[min(seqs), max(seqs)] if seqs else None,
        prepared=sum(r.state is XidState.PREPARED for r in records),
        adhoc_exempt=sum(batch_of(r) is None for r in history),
    )

    # Reconciliation, per table, against every job under this root that writes it.
    tables = [target] if target else []
    if not explicit:
        tables = job_tables(meta) or tables
    for table in tables:
        checked = _reconcile_table(
            registry, warehouse, job, meta, records, table, result, allow_other_writers
        )
        if table == target:
            result.checked.update(checked)
        if len(tables) > 1:
            result.checked.setdefault("tables", {})[table] = checked

    # Staging of recently committed xids that still exists: publish finished, drop did not.
    newest = history[-recent:] if recent > 0 else []
    existing = (
        set(warehouse.list_staging(staging_prefix(job, registry.namespace()))) if newest else set()
    )
    for r in reversed(newest):
        left = [t for t in r.staging_tables if t in existing]
        if left:
            result.warnings.append(
                Finding(
                    "leftover-staging",
                    f"xid {r.xid} is COMMITTED but its staging {', '.join(left)} still exists in "
                    f"{getattr(warehouse, 'staging_db', 'the staging database')}; "
                    f"`txsink recover --job {job}` drops it",
                    xids=(r.xid,),
                    batches=() if r.batch is None else (r.batch,),
                )
            )
    result.checked["recent_checked"] = len(newest)
    return result


def job_tables(meta: JobMeta | Mapping[str, Any]) -> list[str]:
    """Every table a job writes: its ``targets`` (a multi-table job), else its target."""
    return (as_job_meta(meta) or JobMeta()).tables


def _reconcile_table(
    registry: Registry,
    warehouse: Any,
    job: str,
    meta: JobMeta,
    records: list[XidRecord],
    target: str,
    result: VerifyResult,
    allow_other_writers: bool,
) -> dict[str, Any]:
    """Reconcile ``target`` against the ledgers (cut to that table) of every job writing
    it; adds findings to ``result`` and returns what was checked."""
    writers: dict[str, Ledger] = {}
    dedup = False
    inflight: dict[str, int] = {}
    for name in registry.list_jobs():
        other = meta if name == job else (registry.job_meta(name) or JobMeta())
        if target not in other.tables:
            continue
        writers[name] = table_view(registry.ledger(name), target, other.target)
        dedup |= other.mode == Mode.DEDUP.value
        for r in records if name == job else registry.list(name):
            dedup |= r.mode is Mode.DEDUP
            if r.state is XidState.PREPARED:
                for pid, rows in r.partition_rows(target).items():
                    inflight[pid] = inflight.get(pid, 0) + rows
    engine = _engine(warehouse, target)
    target_rows = warehouse.partition_rows(target) if engine else {}
    ledger_rows, folded = ledger_partition_rows(writers.values(), target_rows)
    if folded and not dedup:
        result.warnings.append(evicted_warning(target, writers, folded))
    target_rows = fold(target_rows, folded) if engine else dict(ledger_rows)
    inflight = fold(inflight, folded)
    if not engine:
        result.anomalies.append(
            Finding(
                "reconciliation",
                f"reconciliation: target {target} of job {job} does not exist; the ledger of "
                f"{', '.join(sorted(writers)) or job} counts {sum(ledger_rows.values())} rows",
            )
        )
    anomalies, warnings = reconcile(
        target,
        ledger_rows,
        target_rows,
        inflight,
        jobs=writers,
        allow_other_writers=allow_other_writers,
        engine_merges=bool(_MERGING_ENGINES.match(engine)),
        by_partition=not dedup,
    )
    result.anomalies += anomalies
    result.warnings += warnings
    by_shard = _reconcile_shards(
        warehouse, job, meta, records, target, writers, result, allow_other_writers
    )
    return {
        **({"shards": by_shard} if by_shard else {}),
        "writers": sorted(writers),
        "reconciled_by": "total" if dedup else "partition",
        "partitions": len(set(ledger_rows) | set(target_rows)),
        "evicted_partitions": len(folded),
        "ledger_rows": sum(ledger_rows.values()),
        "target_rows": sum(target_rows.values()),
        "engine": engine,
    }


def _reconcile_shards(
    warehouse: Any,
    job: str,
    meta: JobMeta,
    records: list[XidRecord],
    target: str,
    writers: Mapping[str, Ledger | Mapping[str, Any]],
    result: VerifyResult,
    allow_other_writers: bool = False,
) -> list[dict[str, Any]]:
    """Each shard of a sharded job's own target against the ledger's rows for that shard
    (``Ledger.shards``): rows published on the wrong shard, or twice on one and lost on
    another, cancel out in the total but not here. Only when the job is the target's only
    writer and its ledger counted shards from its first commit (older ledgers did not)."""
    shards = list(meta.shards)
    if not shards or set(writers) != {job} or target != meta.target:
        return []
    if not warehouse.capabilities.per_shard_counts:
        return []
    ledger = as_ledger(writers[job])
    counted = dict(ledger.shards)
    if sum(counted.values()) != ledger.rows:
        result.warnings.append(
            Finding(
                "shards-not-counted",
                f"reconciliation per shard skipped for {target}: the ledger of {job} counts "
                "rows per shard only from commits made by this version",
            )
        )
        return []
    inflight: dict[str, int] = {}
    for r in records:
        if r.state is XidState.PREPARED:
            for key, n in r.shard_rows(target).items():
                inflight[key] = inflight.get(key, 0) + n
    merges = bool(_MERGING_ENGINES.match(_engine(warehouse, target)))
    checked = []
    for k, on_shard in enumerate(warehouse.partition_rows_by_shard(target)):
        have, want = sum(on_shard.values()), counted.get(str(k), 0)
        anomalies, warnings = reconcile(
            f"{target} on shard {k} ({shards[k]})",
            {"*": want},
            {"*": have},
            {"*": inflight.get(str(k), 0)},
            jobs=[job],
            allow_other_writers=allow_other_writers,
            engine_merges=merges,
            by_partition=False,
        )
        result.anomalies += anomalies
        result.warnings += warnings
        checked.append({"shard": k, "url": shards[k], "ledger_rows": want, "target_rows": have})
    return checked


def _engine(warehouse: Any, target: str) -> str:
    db, name = split_table(target)
    rows = warehouse.client.query_rows(
        "SELECT engine FROM system.tables WHERE database = {db:String} AND name = {t:String}",
        parameters={"db": db, "t": name},
        what=f"read the engine of {target}",
    )
    return str(rows[0][0]) if rows else ""


def verify_job(config: Any, **options: Any) -> VerifyResult:
    """Verify the job of a :class:`txsink.config.WriterConfig` (used by ``txsink demo``)."""
    registry = open_registry(config)
    try:
        warehouse = open_warehouse(config)
        try:
            # a multi-table job is verified table by table (its meta lists them)
            meta = registry.job_meta(config.job) or JobMeta()
            target = None if meta.targets else config.table
            return verify(registry, warehouse, config.job, target=target, **options)
        finally:
            getattr(warehouse, "close", warehouse.client.close)()
    finally:
        registry.close()
