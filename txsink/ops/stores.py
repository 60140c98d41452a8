"""The stores an operator command opens for a job: its registry and a warehouse per
table (``txsink status``, ``recover``, ``verify``, ``mode``), and which jobs a command
names. Reads only."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from txsink.clickhouse.client import connect
from txsink.clickhouse.observe import DEFAULT_STAGING_DB
from txsink.clickhouse.warehouse import ClickHouseWarehouse
from txsink.errors import ConfigError
from txsink.ports.registry import Registry
from txsink.protocol.codec import JobMeta, as_job_meta

log = logging.getLogger(__name__)

# --------------------------------------------------------------------------- stores


class Stores:
    """The registry and ClickHouse client an operator command works with.

    Staging databases can differ per job (recorded in the job meta); one warehouse per
    database is made on demand (a warehouse holds no state).
    """

    def __init__(
        self,
        registry: Registry,
        client: Any,
        staging_database: str | None = None,
        connect_shard: Any = None,
    ) -> None:
        self.registry = registry
        self.client = client
        self.staging_database = staging_database
        self._warehouses: dict[Any, Any] = {}
        self._connect_shard = connect_shard  # url -> client, with the command's credentials
        self._shard_clients: dict[str, Any] = {}

    def warehouse(self, meta: JobMeta | Mapping[str, Any] | None = None) -> Any:
        """The warehouse of a job: ``--staging-database`` if given, else the job's own;
        for a sharded job (``shards`` in its meta) every shard behind one
        :class:`~txsink.clickhouse.shards.ShardedWarehouse`, connected with the
        command's credentials."""
        typed = as_job_meta(meta) or JobMeta()
        db = self.staging_database or typed.staging_database or DEFAULT_STAGING_DB
        shards = typed.shards
        key = (db, shards)
        if key not in self._warehouses:
            if shards:
                from txsink.clickhouse.shards import ShardedWarehouse

                self._warehouses[key] = ShardedWarehouse(
                    [ClickHouseWarehouse(self.shard_client(u), db) for u in shards]
                )
            else:
                self._warehouses[key] = ClickHouseWarehouse(self.client, db)
        return self._warehouses[key]

    def shard_client(self, url: str) -> Any:
        if url not in self._shard_clients:
            if self._connect_shard is None:
                raise ConfigError(f"this command cannot reach shard {url}: no credentials")
            self._shard_clients[url] = self._connect_shard(url)
        return self._shard_clients[url]

    def close(self) -> None:
        self.registry.close()
        for client in (self.client, *self._shard_clients.values()):
            close = getattr(client, "close", None)
            if close is not None:
                close()

    def __enter__(self) -> Stores:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_stores(
    url: str,
    keeper: str,
    *,
    user: str = "default",
    password: str = "",
    keeper_auth: str | None = None,
    keeper_root: str = "/txsink",
    staging_database: str | None = None,
    timeout: float = 15.0,
    state: str = "keeper",
    state_database: str = "txsink_state",
) -> Stores:
    """Connect to the state store (Keeper, or with ``state="clickhouse"`` the KeeperMap
    table on ``url``) and ClickHouse (both fail fast with a named error)."""
    from txsink.driver import state_registry

    registry = state_registry(
        state,
        keeper=keeper,
        root=keeper_root,
        state_database=state_database,
        connect=lambda: connect(url, user, password),
        auth=keeper_auth,
        timeout=timeout,
    )
    try:
        client = connect(url, user, password)
    except BaseException:
        registry.close()
        raise
    return Stores(
        registry, client, staging_database, connect_shard=lambda u: connect(u, user, password)
    )


def resolve_jobs(
    registry: Registry, job: str | None, root: str = "", *, where: str = ""
) -> list[str]:
    """``[job]`` if it exists, all jobs when ``job`` is None; ConfigError for a missing
    one (``where``: the store in words, for the message)."""
    jobs = registry.list_jobs()
    if job is None:
        return jobs
    if job not in jobs:
        known = ", ".join(jobs[:10]) + (f" and {len(jobs) - 10} more" if len(jobs) > 10 else "")
        store = where or f"Keeper{f' under {root}' if root else ''}"
        raise ConfigError(
            f"job {job!r} does not exist in the {store} (jobs there: {known or 'none'}); "
            "check --job, the store (--state, --keeper or --url) and --keeper-root; "
            "`txsink status` lists the jobs there"
        )
    return [job]
