"""Publishing staged rows on a ClickHouse server: MOVE PARTITION (partition visibility),
consolidation, claim and ATTACH PARTITION ALL (batch visibility), dropping parts a cut
MOVE already published, catching staging up with columns the target gained.

Owned by the ClickHouse adapter (:class:`Publisher`, a base of
:class:`~txsink.clickhouse.warehouse.ClickHouseWarehouse`). Invariants:

- ``move_partition(s)`` and ``consolidate`` are idempotent: moving a partition id the
  staging table no longer holds moves nothing and does not fail; statements are never
  retried blindly (a repeat sent while the first still runs could copy parts twice);
- ``attach_all`` copies, so the caller claims (``RENAME``) and re-observes first;
- when the target gained columns after staging was created, staging gets the same
  columns first; nothing else is repaired (:func:`~.blockers.plan_column_catch_up`).
"""

from __future__ import annotations

import contextlib
import logging
import re
import uuid
from collections.abc import Callable, Sequence

from txsink.clickhouse.blockers import AddColumn, plan_column_catch_up
from txsink.clickhouse.error_map import ACCESS_DENIED, UNKNOWN_DATABASE, UNKNOWN_TABLE
from txsink.clickhouse.insert_settings import (
    ATTACH_LOG_SETTINGS,
    CREATE_GATHER_SETTINGS,
    GATHER_SETTINGS,
    OPTIONAL_INSERT_SETTINGS,
)
from txsink.clickhouse.observe import MAX_COMMANDS, PARTITION_ID_RE
from txsink.clickhouse.staging import Stager
from txsink.errors import (
    ConfigError,
    RecoveryAlarm,
    RetryableConflict,
    TxSinkError,
    UnavailableError,
)
from txsink.names import qualified, quote_ident, quote_literal, split_table
from txsink.protocol.ops import BatchShape
from txsink.protocol.visibility import ATTACH_ALL_UNSUPPORTED

log = logging.getLogger(__name__)
# copy commands per statement: ~120 bytes each, far below max_query_size (256 KiB)
MAX_COPIES = 1000
READONLY = 164  # a readonly profile refuses every ALTER
# what a server answers a statement it does not have: SYNTAX_ERROR, NOT_IMPLEMENTED,
# SUPPORT_IS_DISABLED ("Only support DROP/DETACH PARTITION ALL currently", before 24.9)
UNKNOWN_STATEMENT = (62, 48, 344)
_DENIED_RE = re.compile(r"(?:Not enough privileges|Cannot execute query in readonly mode).*")


class Publisher(Stager):
    """The publish statements of :class:`~txsink.clickhouse.warehouse.ClickHouseWarehouse`."""

    def drop_parts(self, staging: str, partition_id: str, evidence: Sequence[str]) -> None:
        """Drop the active parts of one staging partition whose evidence ids are
        ``evidence`` (parts a cut MOVE already put in the target). Looked up by UUID at
        the moment of the drop: a part gone already (a repeat after a lost reply) is
        simply not dropped again."""
        fq = self._staging(staging, "drop parts of")
        wanted = sorted(set(evidence))
        if not wanted:
            return
        names = self.client.query_rows(
            "SELECT name FROM system.parts WHERE active AND database = {db:String} "
            "AND table = {t:String} AND partition_id = {p:String} AND "
            "substring(replaceAll(toString(uuid), '-', ''), 1, {n:UInt8}) IN {ids:Array(String)}",
            parameters={"db": self.staging_db, "t": staging, "p": partition_id,
                        "ids": wanted, "n": len(wanted[0])},
            what=f"find the parts of {fq} already in the target",
        )  # fmt: skip
        for at in range(0, len(names), MAX_COMMANDS):
            commands = ", ".join(
                f"DROP PART {quote_literal(str(r[0]))}" for r in names[at : at + MAX_COMMANDS]
            )
            self.client.command(
                f"ALTER TABLE {fq} {commands}",
                idempotent=False,
                table=f"{self.staging_db}.{staging}",
                what=f"drop from {fq} the parts already in the target",
            )

    def consolidate(self, staging: str, partition_id: str, batch_staging: str) -> None:
        """MOVE one task staging partition into the batch staging table (readers of the
        target see neither). Idempotent like :meth:`move_partition`."""
        self._staging(batch_staging, "move partitions into")
        self.move_partition(staging, partition_id, f"{self.staging_db}.{batch_staging}")

    def copy_into_batch(self, batch_staging: str, sources: Sequence[tuple[str, str]]) -> None:
        """Copy every ``(task staging, partition id)`` of ``sources`` into the batch
        staging: ``ALTER TABLE batch ATTACH PARTITION ID 'p' FROM s, ...`` (partition id
        ``""``: ``ATTACH PARTITION ALL FROM s``), one statement per ``MAX_COPIES``
        commands (hard links; part UUIDs kept). Each command is
        atomic, the statement is not, and a repeat copies twice: never retried here. A
        task staging table older than an ``ADD COLUMN`` on the target gets the batch
        staging's new columns first, and the failure is raised as a conflict: the publish
        re-observes, and builds a batch staging the copy did not finish again (from the
        target, when a task staged after an ``ADD COLUMN`` is newer than it)."""
        fq = self._staging(batch_staging, "copy into")
        for table, pid in sources:
            self._staging(table, "copy from")
            if pid and not PARTITION_ID_RE.match(pid):
                raise ConfigError(
                    f"partition id {pid!r} of staging {table} is not a ClickHouse partition "
                    "id; the manifest is corrupt: run `txsink verify`"
                )
        for at in range(0, len(sources), MAX_COPIES):
            chunk = sources[at : at + MAX_COPIES]
            commands = ", ".join(
                f"ATTACH PARTITION {f'ID {quote_literal(pid)}' if pid else 'ALL'} "
                f"FROM {qualified(self.staging_db, table)}"
                for table, pid in chunk
            )
            try:
                self.client.command(
                    f"ALTER TABLE {fq} {commands}",
                    idempotent=False,
                    table=f"{self.staging_db}.{batch_staging}",
                    what=f"copy {len(chunk)} task staging partition(s) into {fq}",
                )
            except TxSinkError as exc:
                if exc.code not in (36, 122):  # not a structure refusal
                    raise
                for table in sorted({t for t, _ in chunk}):
                    # one older than the batch staging gains its columns; one alike, or
                    # newer (the batch staging was made like an older task's staging:
                    # the publish makes it again from the target), is left as it is
                    with contextlib.suppress(TxSinkError):
                        self._catch_up_columns(table, f"{self.staging_db}.{batch_staging}", exc)
                raise RetryableConflict(
                    f"copying into {fq}: a task staging table was older than the target "
                    f"({exc}); its columns were caught up, re-observing"
                ) from exc

    def gather_into_batch(
        self,
        batch_staging: str,
        tables: Sequence[str],
        columns: Sequence[str],
        rows: int,
        *,
        create: BatchShape | None = None,
    ) -> None:
        """``INSERT INTO batch (c1, ...) SELECT * FROM (SELECT c1, ... FROM s1 UNION ALL
        SELECT c1, ... FROM s2 ...) WHERE <guard> = 0``: the guard is a scalar subquery the
        server evaluates before it reads a row: every table, the batch staging included,
        stores exactly ``columns`` in that order, with the same types and kinds in each
        (``system.columns``), else it throws and nothing is written; so no value is ever
        converted, and MATERIALIZED values are written as staging holds them
        (:data:`GATHER_SETTINGS`). With ``create``: ``CREATE TABLE batch <create.ddl> AS
        SELECT ...``, the table made by the same statement (26.9 fills an internal
        table and renames it at the end: a refused statement leaves no table under the
        name; a server killed during the fill leaves that internal ``_tmp_replace_*``
        table behind, swept by :meth:`drop_leftover_fills`); the guard then wants every
        task staging table to show exactly ``create.layout``, the columns the new table
        is made with (:data:`CREATE_GATHER_SETTINGS`: read as the target's were). One part per
        partition while the batch fits one insert block. Never retried blindly (a
        repeat writes the rows again). Any refusal, or a count of rows written other
        than ``rows`` (a profile's ``limit`` or overflow mode ``break`` would cut the
        SELECT short), is a RetryableConflict: the publish re-observes, drops this batch
        staging (not what the manifest says) and builds it again by copies, which catch
        older staging up with the target's columns."""
        fq = self._staging(batch_staging, "gather into")
        sources = [self._staging(t, "gather from") for t in tables]
        cols = ", ".join(quote_ident(c) for c in columns)
        union = " UNION ALL ".join(f"SELECT {cols} FROM {s}" for s in sources)
        message = "'txsink: the staging tables of this batch store different columns'"
        shown = (
            "FROM (SELECT arraySort(groupArray((position, name, type, default_kind))) AS sig, "
            "arrayMap(c -> c.2, arrayFilter(c -> c.4 NOT IN ('ALIAS', 'EPHEMERAL'), sig)) "
            "AS stored FROM system.columns WHERE database = {db:String} "
            "AND table IN {names:Array(String)} GROUP BY table)"
        )
        parameters: dict[str, object] = {"cols": list(columns), "db": self.staging_db}
        if create is None:
            names = [batch_staging, *tables]
            guard = (
                "(SELECT throwIf(count() != {n:UInt64} OR uniqExact(sig) != 1 OR any(stored) "
                f"!= {{cols:Array(String)}}, {message}) {shown})"
            )
            statement = f"INSERT INTO {fq} ({cols}) SELECT * FROM ({union}) WHERE {guard} = 0"
            what = f"gather task staging into {fq} ({len(sources)} table(s))"
        else:
            names = list(tables)
            guard = (
                "(SELECT throwIf(count() != {n:UInt64} OR countIf(arrayMap(c -> c.2, sig) != "
                "{ln:Array(String)} OR arrayMap(c -> c.3, sig) != {lt:Array(String)} OR "
                "arrayMap(c -> c.4, sig) != {lk:Array(String)} OR stored != "
                f"{{cols:Array(String)}}) != 0, {message}) {shown})"
            )
            parameters.update(
                ln=[c[0] for c in create.layout],
                lt=[c[1] for c in create.layout],
                lk=[c[2] for c in create.layout],
            )
            statement = (
                f"CREATE TABLE {fq} {create.ddl} AS SELECT * FROM ({union}) WHERE {guard} = 0"
            )
            what = f"create gathered batch staging {fq} ({len(sources)} table(s))"
        parameters.update(n=len(names), names=names)
        try:
            done = self.client.command(
                statement,
                parameters=parameters,
                settings=self.client.known(
                    GATHER_SETTINGS if create is None else CREATE_GATHER_SETTINGS,
                    OPTIONAL_INSERT_SETTINGS,
                ),
                idempotent=False,
                table=f"{self.staging_db}.{batch_staging}",
                what=what,
            )
        except (UnavailableError, RetryableConflict):
            raise  # outcome unknown, or busy: re-observed as it is
        except TxSinkError as exc:
            raise RetryableConflict(
                f"gathering into {fq} was refused ({exc}); re-observing: the batch is "
                f"copied instead"
            ) from exc
        summary = getattr(done, "summary", None) or {}
        if "written_rows" in summary and int(summary["written_rows"]) != rows:
            raise RetryableConflict(
                f"gathering into {fq} wrote {summary['written_rows']} rows, the manifest "
                f"says {rows}; re-observing: the batch is copied instead"
            )

    def attach_all(self, staging: str, target: str, tag: str = "") -> None:
        """``ATTACH PARTITION ALL FROM`` the batch staging: every part in one commit.

        Not idempotent (it copies) and never retried blindly: the caller claimed the
        batch staging and re-observed (part UUIDs in the target, ``tag`` in the query
        log) before. ``tag`` goes into ``system.query_log`` as the statement's
        ``log_comment``, whatever the user's profile says about logging."""
        fq = self._staging(staging, "attach from")
        db, name = split_table(target)
        logged = {**ATTACH_LOG_SETTINGS, "log_comment": tag}

        def attach(note: str = "") -> None:
            self.client.command(
                f"ALTER TABLE {qualified(db, name)} ATTACH PARTITION ALL FROM {fq}",
                settings=logged if tag else None,
                idempotent=False,
                table=target,
                what=f"ATTACH PARTITION ALL FROM {fq} into {target}{note}",
            )

        try:
            attach()
        except TxSinkError as exc:
            if exc.code not in (36, 122):  # a definite structure refusal: nothing attached
                raise
            self._catch_up_columns(staging, target, exc)
            attach(" (after adding the target's new columns to batch staging)")

    def attach_refusal(self, target: str) -> str:
        """Why this user may not run :meth:`attach_all` into ``target`` (the server's
        words), or "" when it may: the server's answer to that statement from a source
        that does not exist (``ALTER TABLE target ATTACH PARTITION ALL FROM
        <staging_db>.txsink_probe_<random>``; it asks ALTER DELETE and INSERT on the
        target, SELECT on the source). See :meth:`_refusal`."""
        db, name = split_table(target)
        return self._refusal(
            lambda source: f"ALTER TABLE {qualified(db, name)} ATTACH PARTITION ALL FROM {source}",
            f"ATTACH PARTITION ALL FROM {self.staging_db} into {target}",
            unsupported=ATTACH_ALL_UNSUPPORTED,
        )

    def _refusal(self, statement: Callable[[str], str], what: str, unsupported: str = "") -> str:
        """The server's refusal of ``statement(<a staging table that does not exist>)``,
        or "". ClickHouse checks every privilege of a statement before it looks up a
        table (``InterpreterAlterQuery``, ``InterpreterOptimizeQuery``), so a user without
        them is refused (ACCESS_DENIED, or READONLY for a readonly profile) however roles
        or wildcard grants give them, and one with them is told the table (or the staging
        database, not created yet) does not exist. Nothing is created, nothing is
        changed, nothing is left to clean up; one round trip. The table's name is random:
        no table of that name exists. A server that does not know the statement (a
        syntax or "not supported" error) answers ``unsupported`` and its words, when
        given."""
        probe = f"txsink_probe_{uuid.uuid4().hex}"
        try:
            self.client.command(
                statement(qualified(self.staging_db, probe)),
                what=f"probe whether this user may run {what}",
            )
        except TxSinkError as exc:
            text = str(exc)
            if exc.code in (ACCESS_DENIED, READONLY):
                found = _DENIED_RE.search(text)
                return found.group(0) if found else text
            if unsupported and exc.code in UNKNOWN_STATEMENT:
                return f"{unsupported}: {text}"
            if (exc.code == UNKNOWN_TABLE and probe in text) or (
                exc.code == UNKNOWN_DATABASE and self.staging_db in text
            ):
                return ""  # the privileges passed; the table (or its database) is missing
            raise
        return ""

    def claim_staging(self, staging: str, claimed: str) -> None:
        """``RENAME TABLE staging TO claimed``: atomic, so of several finishers renaming
        one batch staging table exactly one holds it afterwards; the others find it gone
        (RetryableConflict: re-observe)."""
        src = self._staging(staging, "claim")
        dst = self._staging(claimed, "claim")
        try:
            self.client.command(
                f"RENAME TABLE {src} TO {dst}",
                idempotent=False,
                table=f"{self.staging_db}.{staging}",
                what=f"claim batch staging {src} as {dst}",
            )
        except TxSinkError as exc:
            if exc.code not in (60, 81):  # UNKNOWN_TABLE / UNKNOWN_DATABASE: taken already
                raise
            raise RetryableConflict(
                f"batch staging {src} was claimed by another finisher of its xid; re-observing"
            ) from exc

    def move_partition(self, staging: str, partition_id: str, target: str) -> None:
        """Publish one staged partition. Idempotent: once moved, a repeat moves nothing."""
        self.move_partitions(staging, [partition_id], target)

    def move_partitions(self, staging: str, partition_ids: Sequence[str], target: str) -> None:
        """Publish staged partitions of one staging table, in ALTERs of up to
        ``MAX_COMMANDS`` MOVE commands (one round trip for most tasks: each command is
        atomic per partition, not the statement). Idempotent: a partition already moved
        moves nothing, so a repeat moves only what is left. Every id is checked before the
        first statement: a bad one must not stop the publish half-way."""
        for partition_id in partition_ids:
            if not PARTITION_ID_RE.match(partition_id):
                raise ConfigError(
                    f"partition id {partition_id!r} of staging {staging} is not a ClickHouse "
                    "partition id; the manifest is corrupt: run `txsink verify`"
                )
        for at in range(0, len(partition_ids), MAX_COMMANDS):
            self._move(staging, partition_ids[at : at + MAX_COMMANDS], target)

    def _move(self, staging: str, partition_ids: Sequence[str], target: str) -> None:
        fq = self._staging(staging, "move partitions out of")
        if not partition_ids:
            return
        db, name = split_table(target)
        dest = qualified(db, name)
        commands = ", ".join(
            f"MOVE PARTITION ID {quote_literal(p)} TO TABLE {dest}" for p in partition_ids
        )
        shown = partition_ids[0] if len(partition_ids) == 1 else f"s {', '.join(partition_ids)}"

        def move(note: str = "") -> None:
            # Not retried blindly: a repeat sent while the first MOVE still runs on the
            # server could copy the same parts twice. An ambiguous failure surfaces, and
            # the resumed publish re-observes (staging rows, part UUIDs in the target).
            self.client.command(
                f"ALTER TABLE {fq} {commands}",
                idempotent=False,
                table=f"{self.staging_db}.{staging}",
                what=f"MOVE PARTITION ID{shown} of {self.staging_db}.{staging} "
                f"TO TABLE {target}{note}",
            )

        try:
            move()
        except TxSinkError as exc:
            if exc.code not in (36, 122):  # BAD_ARGUMENTS / INCOMPATIBLE_COLUMNS: structure
                raise
            self._catch_up_columns(staging, target, exc)
            move(" (after adding the target's new columns to staging)")

    def _catch_up_columns(self, staging: str, target: str, exc: TxSinkError) -> None:
        """The target was altered after the batch was staged: add the columns it gained to
        staging, or raise RecoveryAlarm naming the difference and the next step."""
        fq = qualified(self.staging_db, staging)
        mine = self.target_info(f"{self.staging_db}.{staging}")
        theirs = self.target_info(target)
        additions, problem = plan_column_catch_up(mine, theirs)
        if problem:
            raise RecoveryAlarm(problem, code=exc.code) from exc
        if not additions:
            raise ConfigError(
                f"MOVE PARTITION from staging {self.staging_db}.{staging} into {target} "
                f"failed ({exc}) although their structures look alike; run `txsink verify` "
                f"and see docs/operations.md#target-altered",
                code=exc.code,
            ) from exc
        clauses = ", ".join(add_column_clause(a) for a in additions)
        log.warning(
            "target %s gained column(s) %s after staging %s was created; adding them to "
            "staging before the MOVE",
            target, ", ".join(a.column.name for a in additions), staging,
        )  # fmt: skip
        self.client.command(
            f"ALTER TABLE {fq} {clauses}",
            idempotent=True,  # IF NOT EXISTS: a repeat after a lost reply is a no-op
            table=f"{self.staging_db}.{staging}",
            what=f"add the target's new columns to staging {self.staging_db}.{staging}",
        )


def add_column_clause(add: AddColumn) -> str:
    """``ADD COLUMN IF NOT EXISTS `c` T [DEFAULT e] [CODEC(...)] AFTER `x``` (or FIRST)."""
    col = add.column
    sql = f"ADD COLUMN IF NOT EXISTS {quote_ident(col.name)} {col.type}"
    if col.default_kind in ("DEFAULT", "MATERIALIZED", "ALIAS", "EPHEMERAL"):
        sql += f" {col.default_kind}"
        if col.default_expression:
            sql += f" {col.default_expression}"
    if col.codec:
        sql += f" {col.codec}"
    return sql + (f" AFTER {quote_ident(add.after)}" if add.after else " FIRST")
