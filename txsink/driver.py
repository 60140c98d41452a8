"""Opening a job on the driver: clients from a config, and the writer epoch of a run.

A Spark streaming query runs its driver-side ``commit`` in a fresh Python worker for
every micro-batch, so nothing survives in memory between batches. What identifies one
query *run* is Spark's run id (the ``spark.jobGroup.id`` executors see, carried to the
commit in the task messages). The first commit of a run takes a new writer epoch in
Keeper, which fences every older run, and recovers the job; later commits of the same
run find their run id as the epoch's owner and go straight on. A run that was once
superseded can never take the job back (``runs/<run id>`` remembers it).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from txsink.config import WriterConfig
from txsink.credentials import split_url
from txsink.errors import ConfigError, FencedError
from txsink.keeper.registry import Registry
from txsink.protocol.codec import JobMeta, as_job_meta
from txsink.protocol.states import Epoch
from txsink.transactor import Transactor

log = logging.getLogger(__name__)


def open_registry(config: WriterConfig) -> Registry:
    from txsink.keeper.kazoo_registry import KazooRegistry

    return KazooRegistry.from_options(
        config.keeper,
        config.keeper_root,
        config.keeper_auth or None,
        config.keeper_timeout,
        config.keeper_retry_s,
    )


def open_client(config: WriterConfig, url: str | None = None, **settings: Any) -> Any:
    """A client of ``url`` (default: the job's ``url``) with the job's credentials."""
    from txsink.clickhouse.client import RetryPolicy, connect

    return connect(
        url or config.url,
        config.user,
        config.password,
        connect_timeout=config.connect_timeout,
        send_receive_timeout=config.send_receive_timeout,
        verify=config.verify,
        ca_cert=config.ca_cert or None,
        compress=None if config.compress == "none" else config.compress,
        settings=settings or None,
        retry=RetryPolicy(attempts=config.retry_attempts, max_wait=config.retry_max_wait),
    )


def open_warehouse(config: WriterConfig, client: Any | None = None) -> Any:
    """The job's warehouse: one server, or every shard behind one ShardedWarehouse."""
    from txsink.clickhouse.warehouse import ClickHouseWarehouse

    if config.shards and client is None:
        from txsink.clickhouse.shards import ShardedWarehouse

        opened: list[Any] = []
        try:
            for url in config.shards:
                client = open_client(config, url)
                opened.append(ClickHouseWarehouse(client, config.staging_database))
        except BaseException:
            for warehouse in opened:
                warehouse.client.close()
            raise
        return ShardedWarehouse(opened)
    return ClickHouseWarehouse(client or open_client(config), config.staging_database)


@dataclass
class JobHandle:
    """The driver's view of one job for one commit: stores plus the transaction runner."""

    config: WriterConfig
    registry: Registry
    warehouse: Any
    transactor: Transactor

    def close(self) -> None:
        self.registry.close()
        close = getattr(self.warehouse, "close", None) or getattr(
            getattr(self.warehouse, "client", None), "close", None
        )
        if close:
            close()


def open_job(config: WriterConfig) -> JobHandle:
    registry = open_registry(config)
    try:
        warehouse = open_warehouse(config)
    except BaseException:
        registry.close()
        raise
    return job_handle(config, registry, warehouse)


def job_handle(config: WriterConfig, registry: Registry, warehouse: Any) -> JobHandle:
    """The handle of ``config``'s job over these stores (its Transactor included)."""
    transactor = Transactor(
        registry,
        warehouse,
        config.job,
        retention=config.retention,
        publish_retry_s=config.publish_retry_s,
    )
    return JobHandle(config, registry, warehouse, transactor)


# ------------------------------------------------------------------ reuse of connections
# Spark reuses its Python workers between tasks and between micro-batches: executors, the
# driver-side worker that plans a write and the one that runs commits. A Keeper session
# (~10 ms) and a ClickHouse handshake (~20-50 ms) opened for one task or commit can serve
# the next, which is most of the fixed cost of a small micro-batch. Rules:
# - a borrowed object is the borrower's alone until it is given back;
# - one whose user raised is closed, never lent again (its state is unknown);
# - a Keeper session is lent only while connected (kazoo reconnects by itself; a
#   session that is down is closed and a new one opened, with the usual errors);
# - a forked child starts with an empty pool: it must not touch its parent's sockets.
# Correctness never depends on a session's identity: fencing is by epoch tokens in the
# data, not by ephemeral nodes.

_MAX_IDLE = 4  # idle objects kept per connection identity


class _Pool:
    def __init__(self) -> None:
        self.idle: dict[tuple[Any, ...], list[Any]] = {}
        self.lock = threading.Lock()

    def reset(self) -> None:
        """In a forked child: forget the parent's objects (never used, never closed here;
        the lock may have been held by a thread the child does not have)."""
        self.idle = {}
        self.lock = threading.Lock()


_pool = _Pool()
os.register_at_fork(after_in_child=_pool.reset)


def _close_quietly(obj: Any) -> None:
    close = getattr(obj, "close", None)
    if close is not None:
        with contextlib.suppress(Exception):
            close()


@atexit.register
def close_pooled() -> None:
    """Close every idle pooled connection (also at interpreter exit)."""
    with _pool.lock:
        doomed = [obj for objs in _pool.idle.values() for obj in objs]
        _pool.idle.clear()
    for obj in doomed:
        _close_quietly(obj)


def _registry_key(config: WriterConfig) -> tuple[Any, ...]:
    return (
        "keeper",
        config.keeper,
        config.keeper_root,
        config.keeper_auth,
        config.keeper_timeout,
        config.keeper_retry_s,
    )


def _client_key(config: WriterConfig, url: str | None = None) -> tuple[Any, ...]:
    return (
        "clickhouse",
        url or config.url,
        config.user,
        config.password,
        config.connect_timeout,
        config.send_receive_timeout,
        config.verify,
        config.ca_cert,
        config.compress,
        config.retry_attempts,
        config.retry_max_wait,
    )


@contextlib.contextmanager
def _borrowed(
    key: tuple[Any, ...], usable: Callable[[Any], bool], opener: Callable[[], Any]
) -> Iterator[Any]:
    found = None
    stale: list[Any] = []
    with _pool.lock:
        idle = _pool.idle.get(key, [])
        while idle:
            candidate = idle.pop()
            if usable(candidate):
                found = candidate
                break
            stale.append(candidate)
    for obj in stale:
        _close_quietly(obj)
    obj = found if found is not None else opener()
    lender = os.getpid()
    try:
        yield obj
    except BaseException:
        if os.getpid() == lender:
            _close_quietly(obj)
        raise
    if os.getpid() != lender:  # forked during the loan: the parent's sockets, not ours
        return
    with _pool.lock:
        idle = _pool.idle.setdefault(key, [])
        if len(idle) < _MAX_IDLE:
            idle.append(obj)
            return
    _close_quietly(obj)


def borrowed_registry(config: WriterConfig) -> contextlib.AbstractContextManager[Registry]:
    """A Keeper registry for ``config`` from this process's pool (or a new one)."""

    def usable(registry: Any) -> bool:
        return bool(getattr(registry, "reusable", lambda: False)())

    return _borrowed(_registry_key(config), usable, lambda: open_registry(config))


def borrowed_warehouse(config: WriterConfig) -> contextlib.AbstractContextManager[Any]:
    """A ClickHouse warehouse for ``config`` whose client comes from this process's pool."""

    from txsink.clickhouse.warehouse import ClickHouseWarehouse

    def one(url: str) -> contextlib.AbstractContextManager[Any]:
        return _borrowed(_client_key(config, url), lambda _: True, lambda: open_client(config, url))

    @contextlib.contextmanager
    def lend() -> Iterator[Any]:
        if not config.shards:
            with one(config.url) as client:
                yield open_warehouse(config, client)
            return
        from txsink.clickhouse.shards import ShardedWarehouse

        with contextlib.ExitStack() as stack:
            clients = [stack.enter_context(one(url)) for url in config.shards]
            yield ShardedWarehouse(
                [ClickHouseWarehouse(c, config.staging_database) for c in clients]
            )

    return lend()


@contextlib.contextmanager
def borrowed_job(config: WriterConfig) -> Iterator[JobHandle]:
    """:func:`open_job` on pooled connections; nothing to close."""
    with borrowed_registry(config) as registry, borrowed_warehouse(config) as warehouse:
        yield job_handle(config, registry, warehouse)


def job_meta(
    config: WriterConfig,
    mode: str,
    query_id: str = "",
    targets: dict[str, str] | None = None,
) -> JobMeta:
    """The job node's data. Keeper nodes are world-readable (even under ``keeper_auth``),
    so it holds no credential: the url without userinfo, no user, no password.

    ``targets`` (a :func:`txsink.transaction` job): every table the job writes and its
    pinned mode; ``target`` stays the job's own table (``config.table``)."""
    return JobMeta(
        job=config.job,
        target=config.table,
        mode=mode,
        url=split_url(config.url).url,
        staging_database=config.staging_database,
        query_id=query_id,
        created_at=time.time(),
        targets=dict(sorted((targets or {}).items())),
        shards=tuple(config.shards),
    )


def primary_target(stored: JobMeta | Mapping[str, Any] | None, tables: Iterable[str]) -> str:
    """The job's own table for a transaction writing ``tables``: the stored one, else
    (first commit) the first of ``tables`` in sorted order. Records use it as their
    ``target``, the ledger keys its partitions bare (:func:`ledger_key`)."""
    meta = as_job_meta(stored)
    if meta and meta.target:
        return meta.target
    return sorted(tables)[0]


def check_tables(
    job: str, stored: JobMeta | Mapping[str, Any] | None, tables: Iterable[str]
) -> None:
    """Refuse a transaction whose tables a job cannot take (pure).

    A job keeps the set of tables of its first commit: its ledger, ``verify`` and the
    pinned modes describe exactly those. A transaction may write any of them (tables it
    skips get no rows in that xid); a table outside the set is refused, and so is a
    transaction of several tables under a job that a single-table writer
    (``format("clickhouse_tx")``, ``foreach_batch``) created."""
    wanted = sorted(set(tables))
    meta = as_job_meta(stored)
    if not meta or meta.blank:
        return
    have = sorted(meta.targets) if meta.targets else [meta.target]
    extra = [t for t in wanted if t not in have]
    if extra:
        raise ConfigError(
            f"job {job} writes {', '.join(have)}; this transaction also writes "
            f"{', '.join(extra)}. A job keeps the tables of its first commit (its ledger, "
            f"verify and pinned modes describe exactly those). Nothing was written; write "
            f"the new table set under a new job name"
        )


def identity_refusal(
    job: str, stored: JobMeta | Mapping[str, Any], meta: JobMeta | Mapping[str, Any]
) -> str | None:
    """Why a writer whose job meta would be ``meta`` must not write job ``job`` as
    ``stored`` (its Keeper meta) records it: another target table, or another shard list
    (None when it may). Checked before any row is written (validation) and again at the
    takeover of every run (:func:`check_job_identity`)."""
    old, new = as_job_meta(stored) or JobMeta(), as_job_meta(meta) or JobMeta()
    if old.target and old.target != new.target:
        return (
            f"job {job} writes to {old.target}, not {new.target}; a job keeps one "
            f"target for its whole life: choose a new job name"
        )
    if not old.blank and old.shards != new.shards:
        return (
            f"job {job} writes the shards {list(old.shards) or [old.url]}, "
            f"this writer names {list(new.shards) or [new.url]}. A job keeps its "
            f"shard list, in order, for its whole life (staging tables and the records name "
            f"shards by their place in it). Give the same shards option, or a new job name"
        )
    return None


def check_job_identity(handle: JobHandle, meta: JobMeta) -> None:
    """Refuse a writer that would reuse a job's xids for a different query or table.

    Streaming xids are ``b<batchId>``: a new query (new checkpoint) writing under an old
    job name restarts at batch 0 and would find those batches "already committed", i.e.
    silently drop its data. The streaming query id (stable across restarts of one
    checkpoint) recorded with the job catches that.
    """
    job = handle.config.job
    stored = handle.registry.ensure_job(job, meta)
    known = stored.targets
    if len(known) > 1 and not meta.targets:
        raise ConfigError(
            f"job {job} commits several tables in one transaction ({', '.join(sorted(known))}); "
            f"a single-table writer must not share its xids. Write with "
            f"`txsink.transaction(...)`, or use a new job name"
        )
    if meta.targets:
        check_tables(job, stored, meta.targets)
    refusal = identity_refusal(job, stored, meta)
    if refusal:
        raise ConfigError(refusal)
    old, new = stored.query_id, meta.query_id
    if old and new and old != new and handle.registry.ledger(job).committed:
        raise ConfigError(
            f"job {job} was written by streaming query {old} and this is query {new} (a new "
            f"checkpoint?). Its batch ids would collide with committed ones and be skipped as "
            f"replays. Use a new job name, or keep the old checkpointLocation."
        )


def epoch_for_run(
    handle: JobHandle,
    run_id: str,
    mode: str,
    keep: Iterable[str] = (),
    query_id: str = "",
    targets: dict[str, str] | None = None,
) -> Epoch:
    """The epoch of ``run_id``: the current one if the run owns the job, else a takeover.

    ``keep`` lists staging tables of the batch being committed: the takeover's recovery
    must not roll them back.
    """
    registry, job = handle.registry, handle.config.job
    # Synced: a new Python worker's session may sit on a server that has not seen this
    # run take the job yet, and would make the run take it over again from itself.
    registry.sync(job)
    current = registry.current_epoch(job)
    if current is not None and current.owner == run_id:
        return current
    if registry.get_blob(job, f"runs/{run_id}") is not None:
        raise FencedError(
            f"job {job}: run {run_id} was superseded by run {current.owner if current else '?'} "
            f"(epoch {current.number if current else '?'}); this query must stop. Two queries "
            f"must not write with the same job name."
        )
    meta = job_meta(handle.config, mode, query_id, targets)
    check_job_identity(handle, meta)
    registry.put_blob(job, f"runs/{run_id}", {"started_at": time.time()})
    epoch = handle.transactor.begin(run_id, meta=meta, keep=set(keep))
    if current is not None:
        log.warning(
            "job %s: run %s took over from %s (epoch %d -> %d)",
            job,
            run_id,
            current.owner,
            current.number,
            epoch.number,
        )
    return epoch
