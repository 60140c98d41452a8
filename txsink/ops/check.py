"""`txsink check`: what a server and a target table support, before the first write.

Owns the pre-flight report a new user (and the Cloud guide) starts from. It reads the
same facts and runs the same decisions as a writer's validation
(:func:`txsink.protocol.job.resolve_mode` over :mod:`txsink.clickhouse.blockers`,
:func:`~txsink.clickhouse.insert_settings.insert_settings_problems`,
:func:`~txsink.protocol.visibility.batch_refusal`), so its verdict is the writer's.

It never writes to the target. It does write, and removes again: one probe node in the
state store (timing one compare-and-set round trip) and, for attach mode, one probe
staging table in the staging database (the privileges attach mode needs).

A check is ``ok``, ``fail`` (a job cannot run until it is fixed) or ``note``
(information: what a choice costs). Exit 0 when nothing failed.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from txsink.config import WriterConfig
from txsink.errors import ConfigError, TxSinkError

OK, FAIL, NOTE = "ok", "fail", "note"


@dataclass(frozen=True)
class Check:
    name: str
    status: str
    detail: str


@dataclass(frozen=True)
class CheckReport:
    url: str
    table: str
    state: str
    mode: str | None
    checks: tuple[Check, ...]

    @property
    def can_run(self) -> bool:
        return not any(c.status == FAIL for c in self.checks)

    def to_json(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "table": self.table,
            "state": self.state,
            "mode": self.mode,
            "can_run": self.can_run,
            "checks": [asdict(c) for c in self.checks],
        }


def run_check(config: WriterConfig, clock: Callable[[], float] = time.perf_counter) -> CheckReport:
    """Every check for ``config``'s server, target and state store (see the module doc)."""
    from txsink.clickhouse.error_map import UNKNOWN_DATABASE, UNKNOWN_TABLE
    from txsink.driver import open_warehouse

    checks: list[Check] = []
    mode: str | None = None
    warehouse = open_warehouse(config)
    try:
        client = warehouse.client
        version = client.query_rows("SELECT version()")[0][0]
        checks.append(Check("server", OK, f"ClickHouse {version} at {client.url}"))
        try:
            info = warehouse.target_info(config.table)
        except TxSinkError as exc:
            db = config.table.split(".", 1)[0]
            missing_db = exc.code == UNKNOWN_DATABASE or (
                exc.code == UNKNOWN_TABLE
                and not client.query_rows(
                    "SELECT 1 FROM system.databases WHERE name = {d:String}",
                    parameters={"d": db},
                )
            )
            if missing_db:
                hint = (
                    f"; database {db} does not exist either: create it first (CREATE "
                    f"DATABASE {db}); create_table makes tables, not databases"
                )
            elif exc.code == UNKNOWN_TABLE:
                hint = (
                    "; a writer given create_table=if_missing (with order_by) creates it "
                    "from its DataFrame, then check it again"
                )
            else:
                hint = ""
            checks.append(Check("table", FAIL, f"{exc}{hint}"))
            info = None
        if info is not None:
            checks.append(Check("table", OK, f"{config.table}: {info.engine}"))
            mode = _mode(config, warehouse, info, checks)
            if mode is not None:
                _settings(config, client, mode, checks)
                if mode == "attach":
                    _staging_probe(config, warehouse, info, checks)
            checks.append(
                Check(
                    "privileges",
                    NOTE,
                    f"INSERT into {config.table} is not probed (a check never writes to the "
                    "target); the first batch fails before anything is visible without it",
                )
            )
        _state_store(config, clock, checks)
    finally:
        closer = getattr(warehouse, "close", None) or warehouse.client.close
        closer()
    return CheckReport(config.url, config.table, config.state, mode, tuple(checks))


def _mode(config: WriterConfig, warehouse: Any, info: Any, checks: list[Check]) -> str | None:
    from txsink.clickhouse.blockers import attach_blockers, dedup_blockers, dedup_window
    from txsink.clickhouse.dedup_insert import view_tables
    from txsink.protocol.job import resolve_mode
    from txsink.spark.validate import visibility_choice

    blockers = attach_blockers(info)
    views = view_tables(warehouse, info) if info.dependent_views else ()
    problems = dedup_blockers(info, min_window=config.dedup_min_window, view_tables=views)
    window = dedup_window(info)
    size = f"{window.setting}={window.parts} blocks" if window is not None else "none"
    if window is not None and window.seconds_setting:
        size += f", {window.seconds_setting}={window.seconds}"
    checks.append(
        Check(
            "dedup window",
            NOTE,
            size + (f"; dedup mode is not possible: {'; '.join(problems)}" if problems else ""),
        )
    )
    choice = resolve_mode(config.job, config.table, config.mode, None, blockers, problems)
    if choice.mode is None:
        checks.append(Check("mode", FAIL, choice.refusal))
        return None
    why = f" (attach is not possible: {'; '.join(blockers)})" if blockers else ""
    checks.append(Check("mode", OK, f"{choice.mode.value}{why}"))
    try:  # the writer's own choice, its probes included
        chosen, why = visibility_choice(config, info, choice.mode.value, warehouse)
    except ConfigError as exc:
        checks.append(Check("visibility", FAIL, str(exc)))
        return choice.mode.value
    if chosen == "batch":
        checks.append(Check("visibility", OK, "batch (readers see each batch whole, at once)"))
    else:
        because = f": {why}" if why and config.visibility == "auto" else ""
        checks.append(
            Check(
                "visibility",
                NOTE,
                f"partition (readers may see a batch's partitions one by one){because}",
            )
        )
    return choice.mode.value


def _settings(config: WriterConfig, client: Any, mode: str, checks: list[Check]) -> None:
    from txsink.clickhouse.insert_settings import (
        DEDUP_INSERT_SETTINGS,
        STAGING_INSERT_SETTINGS,
        after_prepare_settings,
        insert_settings_problems,
        statement_settings_problems,
    )

    wanted = STAGING_INSERT_SETTINGS if mode == "attach" else DEDUP_INSERT_SETTINGS
    later = after_prepare_settings(mode, config.visibility, config.state)
    names = [*wanted, "readonly", *(n for _, _, settings in later for n in settings)]
    effective = client.effective_settings(names)
    problems = insert_settings_problems(effective, wanted, user=config.user, mode=mode)
    problems += [  # the statements after a PREPARE (validation refuses the same)
        p
        for sender, fix, settings in later
        for p in statement_settings_problems(
            effective, settings, user=config.user, sender=sender, fix=fix
        )
    ]
    shown = ", ".join(f"{n}={v.value}" for n, v in sorted(effective.items()))
    if problems:
        checks.append(Check("insert settings", FAIL, "; ".join(problems)))
    else:
        checks.append(Check("insert settings", OK, f"user {config.user}: {shown}"))


def _staging_probe(config: WriterConfig, warehouse: Any, info: Any, checks: list[Check]) -> None:
    """Create and drop one staging table like the target (the DDL attach mode runs)."""
    from txsink.protocol.ids import batch_xid, run_tag, staging_name

    run = run_tag(uuid.uuid4().hex)
    name = staging_name(config.job, batch_xid(0), run, 0, 0, 0).table
    try:
        warehouse.ensure_staging_db()
        warehouse.create_staging(config.table, name, info)
    except TxSinkError as exc:
        checks.append(
            Check(
                "staging",
                FAIL,
                f"cannot create a staging table in {config.staging_database}: {exc}; grant "
                f"CREATE/DROP TABLE there and ALTER MOVE PARTITION on {config.table}",
            )
        )
        return
    finally:
        with contextlib.suppress(TxSinkError):
            warehouse.drop_stagings([name])
    checks.append(
        Check("staging", OK, f"created and dropped a staging table in {config.staging_database}")
    )


def _state_store(config: WriterConfig, clock: Callable[[], float], checks: list[Check]) -> None:
    if config.state == "clickhouse":
        _keepermap_probe(config, clock, checks)
        return
    from txsink.driver import open_registry

    try:
        registry = open_registry(config)
    except TxSinkError as exc:
        checks.append(Check("state store", FAIL, f"Keeper at {config.keeper}: {exc}"))
        return
    try:
        start = clock()
        registry.current_epoch(f"txsink-check-{uuid.uuid4().hex[:8]}")
        ms = (clock() - start) * 1000
    finally:
        registry.close()
    checks.append(Check("state store", OK, f"Keeper at {config.keeper}: a read takes {ms:.1f} ms"))


def _keepermap_probe(config: WriterConfig, clock: Callable[[], float], checks: list[Check]) -> None:
    """KeeperMap enabled, strict mode enforced (a stale write refused), one CAS timed."""
    from kazoo.exceptions import BadVersionError

    from txsink.driver import open_client
    from txsink.keeper.keepermap import KeeperMapNodes, Op

    where = f"{config.state_database}.nodes on {config.url}"
    try:
        nodes = KeeperMapNodes(open_client(config), config.state_database)
    except (ConfigError, TxSinkError) as exc:
        checks.append(Check("state store", FAIL, str(exc)))
        return
    path = f"/txsink-check/{uuid.uuid4().hex[:12]}"
    try:
        nodes.ensure_path_async("/txsink-check").get()
        nodes.commit_or_raise([Op("create", path, b"0")])
        start = clock()
        nodes.commit_or_raise([Op("set", path, b"1", version=0)])
        ms = (clock() - start) * 1000
        try:
            nodes.commit_or_raise([Op("set", path, b"2", version=0)])
            strict = False
        except BadVersionError:
            strict = True
        nodes.commit_or_raise([Op("delete", path)])
    except TxSinkError as exc:
        checks.append(Check("state store", FAIL, f"KeeperMap table {where}: {exc}"))
        return
    finally:
        nodes.close()
    if not strict:
        checks.append(
            Check(
                "state store",
                FAIL,
                f"KeeperMap table {where} took a write at a stale version: strict mode "
                "(keeper_map_strict_mode) is not in effect, so fencing would not hold",
            )
        )
        return
    checks.append(
        Check(
            "state store",
            OK,
            f"KeeperMap table {where}: strict mode enforced; one compare-and-set takes {ms:.1f} ms",
        )
    )
