"""Opening a job: clients from a config, pooled per process, and the job's meta.

Used on the driver (validation, the committer: :mod:`txsink.committer`, which also owns
the writer epoch of a run) and on executors (the writers borrow pooled connections).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from txsink.config import WriterConfig
from txsink.credentials import split_url
from txsink.ports.registry import Registry
from txsink.protocol.codec import JobMeta
from txsink.transactor import Transactor

log = logging.getLogger(__name__)


def state_registry(
    state: str,
    *,
    keeper: str,
    root: str,
    state_database: str,
    connect: Callable[[], Any],
    auth: str | None = None,
    timeout: float = 15.0,
    retry_s: float = 30.0,
) -> Registry:
    """The one place a coordination store is chosen (writers, the CLI, ops callers):
    Keeper at ``keeper``, or with ``state="clickhouse"`` the KeeperMap table of
    ``state_database`` on the server ``connect()`` opens (closing the registry closes
    that client)."""
    root = "/" + root.strip("/")
    if state == "clickhouse":
        from txsink.keeper.keepermap import keepermap_registry

        registry: Registry = keepermap_registry(
            connect(), state_database, root, timeout=timeout, retry_s=retry_s
        )
        return registry
    from txsink.keeper.kazoo_registry import KazooRegistry

    return KazooRegistry(keeper, root, auth=auth or None, timeout=timeout, retry_s=retry_s)


def open_registry(config: WriterConfig) -> Registry:
    """The job's coordination store: Keeper, or KeeperMap tables (``state=clickhouse``)."""
    return state_registry(
        config.state,
        keeper=config.keeper,
        root=config.keeper_root,
        state_database=config.state_database,
        connect=lambda: open_client(config),
        auth=config.keeper_auth or None,
        timeout=config.keeper_timeout,
        retry_s=config.keeper_retry_s,
    )


def job_in_other_store(config: WriterConfig, client: Any) -> str | None:
    """Where ``config.job`` keeps its state if not in the store ``config`` names: a job's
    store is fixed for its life, so a writer naming the other one must be refused before
    it starts the job afresh there. Looked up only where the other store is at hand:
    the KeeperMap table on ``client``'s server (read, never created), or the ``keeper``
    given beside ``state=clickhouse`` (skipped when it does not answer within 2 s)."""
    from txsink.keeper.kazoo_base import check_name

    key = f"{config.keeper_root.rstrip('/')}/jobs/{check_name('job', config.job)}"
    if config.state == "keeper":
        found = client.query_rows(
            "SELECT count() FROM system.tables WHERE database = {db:String} AND name = 'nodes' "
            "AND engine = 'KeeperMap'",
            parameters={"db": config.state_database},
        )
        if not found or not found[0][0]:
            return None
        from txsink.names import quote_ident

        rows = client.query_rows(
            f"SELECT count() FROM {quote_ident(config.state_database)}.nodes "
            "WHERE key = {k:String} AND pending = ''",
            parameters={"k": key},
        )
        return f"ClickHouse (state=clickhouse, {config.state_database})" if rows[0][0] else None
    if not config.keeper or not _answers(config.keeper):
        return None
    from txsink.errors import UnavailableError
    from txsink.keeper.kazoo_registry import KazooRegistry

    try:
        other = KazooRegistry(config.keeper, config.keeper_root, auth=config.keeper_auth or None,
                              timeout=2.0, retry_s=0)  # fmt: skip
    except UnavailableError:
        return None
    try:
        return f"Keeper at {config.keeper} (state=keeper)" if other.job_meta(config.job) else None
    finally:
        other.close()


def _answers(keeper: str) -> bool:
    """Whether any host of a Keeper connect string accepts a TCP connection (a refused
    one fails at once, where a Keeper session would retry until its timeout)."""
    import socket

    for hostport in keeper.split("/", 1)[0].split(","):
        host, _, port = hostport.strip().rpartition(":")
        try:
            with socket.create_connection((host or hostport, int(port or 2181)), timeout=1):
                return True
        except (OSError, ValueError):
            continue
    return False


def open_client(config: WriterConfig, url: str | None = None, **settings: Any) -> Any:
    """A client of ``url`` (default: the job's ``url``) with the job's credentials."""
    from txsink.clickhouse.client import connect
    from txsink.clickhouse.retry import RetryPolicy

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
        # a publish statement may run this long without a beat (txsink.ops.liveness)
        statement_s=config.send_receive_timeout + config.connect_timeout,
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
    if config.state == "clickhouse":
        return ("keepermap", config.state_database, config.keeper_root, *_client_key(config))
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
