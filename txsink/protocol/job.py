"""Job-level rules: who may write a job, in which mode, and which batches are replays.

Pure: no I/O. The adapters (``txsink.committer``, ``txsink.spark.validate``, the Spark
writers) read the job's Keeper meta, its ledger or an xid record, hand the facts to a
function here and act on the answer (a refusal text becomes a ``ConfigError``); they
never decide themselves.

The functions read a job through :class:`JobView`, the few attributes they need. The
job meta is a JSON dict in Keeper today (:meth:`JobFacts.from_meta` reads it); a typed
meta dataclass with these attributes satisfies :class:`JobView` as it is.

**Identity.** A job keeps, for its whole life, what its first commit recorded: its
target table (a transaction job: its set of tables), its shard list in order, and the
streaming query that writes it once something is committed. A writer that differs is
refused before it writes (:func:`identity_refusal` at validation) and again at the
takeover of every run (:func:`takeover_refusal`).

**The pinned mode** (the job meta's ``mode``; a transaction job: ``targets[table]``)
and its transitions::

    (none) -> M     the first commit pins the mode its validation resolved
                    (M = attach | dedup; ``auto`` is never pinned).
    M      -> M     every later batch: ``mode=auto`` follows the pin, an explicit mode
                    must equal it, and the target must still allow M.
    M      -> M'    only the operator's ``txsink mode --job J --set M'``, between batches
                    (no PREPARED xid, no half-written dedup batch, no live writer).
                    A writer never moves the pin: a batch whose tasks wrote in one mode
                    and were committed in the other would be lost or duplicated.

How :func:`resolve_mode` decides a batch's mode (``asked`` is the ``mode`` option)::

    pinned  asked           attach blockers  dedup problems  result
    M       not auto, != M  -                -               refused: the job is pinned
    attach  auto | attach   none             -               attach
    attach  auto | attach   some             -               refused: `txsink mode --set dedup`
    dedup   auto | dedup    -                none            dedup
    dedup   auto | dedup    -                some            refused: fix the target
    none    attach          none             -               attach
    none    attach          some             -               refused: attach impossible
    none    dedup           -                none            dedup
    none    dedup           -                some            refused: dedup unsafe
    none    auto            none             -               attach
    none    auto            some             none            dedup
    none    auto            some             some            refused: neither

A batch is committed in one mode: every task reports the mode it wrote in and
:func:`written_mode_refusal` refuses a batch whose tasks disagree with the commit.

**Replays.** A batch is a replay, and writes nothing, when its xid is COMMITTED, or
when it has no record and is not newer than the ledger's last committed batch (batch
ids are monotonic; retention pruned its record): :func:`is_replay`. A task finding
its xid PREPARED in another mode is refused (:func:`task_replay`). A streaming job that
has committed nothing refuses a first micro-batch other than 0 (or the ``first_batch``
option): its checkpoint was written under another job name or store, and the batch may
be the replay of one committed there (:func:`unowned_batch_refusal`).

**Half-visible dedup batches.** In dedup mode blocks reach the target as they are
sent, so a batch that fails (a refused value, a lost task) may leave part of its rows
visible, recorded under ``dedup/<xid>``. Such an xid (:func:`is_open_dedup`: dedup
records, no PREPARED or COMMITTED record, not a pruned committed batch) fences the job:
a dedup task of any *other* xid refuses to send its first block
(:func:`open_dedup_refusal`), so no new ``txn_version``, plain save or reset
checkpoint can add those rows a second time. The ways out are a rerun of that batch
(it resumes and commits) or the operator's ``txsink recover --discard-dedup``, which
marks the xid so that it is never written again (:func:`discarded_batch`).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from txsink.protocol.codec import JobMeta, as_job_meta
from txsink.protocol.dedup import OpenBatch
from txsink.protocol.ids import xid_batch
from txsink.protocol.states import Mode, XidState

_MODES = frozenset(m.value for m in Mode)


class JobView(Protocol):
    """What the rules read of a job (its stored meta, or the meta a writer would store)."""

    @property
    def target(self) -> str: ...

    @property
    def shards(self) -> Sequence[str]: ...

    @property
    def url(self) -> str | None: ...

    @property
    def targets(self) -> Mapping[str, str] | None: ...

    @property
    def mode(self) -> str | None: ...

    @property
    def query_id(self) -> str: ...


@dataclass(frozen=True)
class JobFacts:
    """A :class:`JobView` over the job meta's JSON dict as stored today.

    ``targets``: a transaction job's tables and their pinned modes; None for a job of one
    table (``format("clickhouse_tx")``, ``foreach_batch``)."""

    target: str = ""
    shards: tuple[str, ...] = ()
    url: str | None = None
    targets: Mapping[str, str] | None = None
    mode: str | None = None
    query_id: str = ""

    @classmethod
    def from_meta(cls, meta: JobMeta | Mapping[str, Any]) -> JobFacts:
        """The facts of a stored job node (typed, or its JSON read through the codec)."""
        m = as_job_meta(meta) or JobMeta()
        return cls(
            target=m.target,
            shards=m.shards,
            url=m.url or None,
            targets=dict(m.targets) or None,
            mode=m.mode or None,
            query_id=m.query_id,
        )

    @classmethod
    def of(cls, meta: JobMeta | Mapping[str, Any] | None) -> JobFacts | None:
        """:meth:`from_meta`, or None for a job with no meta (it never committed)."""
        m = as_job_meta(meta)
        return None if m is None or m.blank else cls.from_meta(m)


# ------------------------------------------------------------------------- identity


def job_tables(stored: JobView) -> list[str]:
    """Every table the job writes, sorted: a transaction job's ``targets``, else its target."""
    return sorted(stored.targets) if stored.targets is not None else [stored.target]


def tables_refusal(job: str, stored: JobView | None, tables: Iterable[str]) -> str | None:
    """Why a transaction writing ``tables`` may not write ``job`` (None when it may).

    A job keeps the set of tables of its first commit: its ledger, ``verify`` and the
    pinned modes describe exactly those. A transaction may write any of them (tables it
    skips get no rows in that xid); a table outside the set is refused, and so is a
    transaction of several tables under a job a single-table writer created."""
    if stored is None:
        return None
    have = job_tables(stored)
    extra = [t for t in sorted(set(tables)) if t not in have]
    if not extra:
        return None
    return (
        f"job {job} writes {', '.join(have)}; this transaction also writes "
        f"{', '.join(extra)}. A job keeps the tables of its first commit (its ledger, "
        f"verify and pinned modes describe exactly those). Nothing was written; write "
        f"the new table set under a new job name"
    )


def primary_target(stored: JobView | None, tables: Iterable[str]) -> str:
    """The job's own table for a transaction writing ``tables``: the stored one, else
    (first commit) the first of ``tables`` in sorted order. Records use it as their
    ``target``, the ledger keys its partitions bare."""
    if stored is not None and stored.target:
        return stored.target
    return sorted(tables)[0]


def identity_refusal(job: str, stored: JobView | None, mine: JobView) -> str | None:
    """Why a writer whose meta would be ``mine`` must not write ``job`` as ``stored``
    records it: another target table, or another shard list (None when it may)."""
    if stored is None:
        return None
    if stored.target and stored.target != mine.target:
        return (
            f"job {job} writes to {stored.target}, not {mine.target}; a job keeps one "
            f"target for its whole life: choose a new job name"
        )
    if list(stored.shards) != list(mine.shards):
        return (
            f"job {job} writes the shards {list(stored.shards) or [stored.url]}, "
            f"this writer names {list(mine.shards) or [mine.url]}. A job keeps its "
            f"shard list, in order, for its whole life (staging tables and the records name "
            f"shards by their place in it). Give the same shards option, or a new job name"
        )
    return None


def takeover_refusal(
    job: str, stored: JobView | None, mine: JobView, committed: Callable[[], int]
) -> str | None:
    """Why a new run whose meta would be ``mine`` must not take ``job`` over (None when
    it may). ``committed``: how many xids the job's ledger counts as committed (asked
    only when the query ids differ: it costs the caller a Keeper read).

    Streaming xids are ``b<batchId>``: a new query (new checkpoint) writing under an old
    job name restarts at batch 0 and would find those batches "already committed", i.e.
    silently drop its data; the query id recorded with the job catches that.

    ``stored`` None: the job node records nothing yet (created blank), so nothing can
    be refused; the run's meta is what gets recorded."""
    if stored is None:
        return None
    known = stored.targets
    if known is not None and len(known) > 1 and not mine.targets:
        return (
            f"job {job} commits several tables in one transaction ({', '.join(sorted(known))}); "
            f"a single-table writer must not share its xids. Write with "
            f"`txsink.transaction(...)`, or use a new job name"
        )
    if mine.targets:
        refusal = tables_refusal(job, stored, mine.targets)
        if refusal:
            return refusal
    refusal = identity_refusal(job, stored, mine)
    if refusal:
        return refusal
    old, new = stored.query_id, mine.query_id
    if old and new and old != new and committed():
        return (
            f"job {job} was written by streaming query {old} and this is query {new} (a new "
            f"checkpoint?). Its batch ids would collide with committed ones and be skipped as "
            f"replays. Use a new job name, or keep the old checkpointLocation."
        )
    return None


# ------------------------------------------------------------------------- the mode


def pinned_mode(stored: JobView | None, table: str | None = None) -> Mode | None:
    """The mode ``stored`` pins for ``table`` (None for a job that never committed, or a
    table a transaction job's ``targets`` do not list)."""
    if stored is None:
        return None
    if table is not None and stored.targets is not None:
        mode = stored.targets.get(table)
    else:
        mode = stored.mode
    return Mode(mode) if mode in _MODES else None


@dataclass(frozen=True)
class ModeChoice:
    """:func:`resolve_mode`'s answer: the mode, or why none (``refusal``)."""

    mode: Mode | None
    refusal: str = ""
    fallback: bool = False  # mode=auto took dedup because attach is blocked


def resolve_mode(
    job: str,
    table: str,
    asked: str,
    pinned: Mode | None,
    attach_blockers: Sequence[str],
    dedup_problems: Sequence[str],
) -> ModeChoice:
    """The mode of a batch (the table in the module doc). ``asked``: the ``mode`` option
    (auto, attach or dedup); ``dedup_problems`` may be left empty where the table shows
    they are not read (an attach pin, ``mode=attach`` on an unpinned job)."""
    if pinned is not None:
        change = f"stop the query, run `txsink mode --job {job} --set <mode>`, and restart it"
        if asked not in ("auto", pinned.value):
            return ModeChoice(
                None,
                f"job {job} is pinned to mode {pinned.value} (decided at its first commit) "
                f"but mode={asked} was asked. Use mode=auto or mode={pinned.value}; to change "
                f"the job's mode, {change}",
            )
        if pinned is Mode.ATTACH and attach_blockers:
            return ModeChoice(
                None,
                f"job {job} is pinned to attach mode, but {table} no longer allows it: "
                f"{'; '.join(attach_blockers)}. Publishing by MOVE PARTITION would bypass what "
                f"was added (a materialized view would never see the rows). Nothing was "
                f"written. To go on in dedup mode, stop the query, run `txsink mode --job "
                f"{job} --set dedup`, and restart it",
            )
        if pinned is Mode.DEDUP and dedup_problems:
            return ModeChoice(
                None,
                f"job {job} is pinned to dedup mode, but dedup is unsafe for {table} now: "
                f"{'; '.join(dedup_problems)}. Nothing was written. Fix the target, or {change}",
            )
        return ModeChoice(pinned)
    if asked == Mode.ATTACH.value:
        if attach_blockers:
            return ModeChoice(
                None, f"mode=attach is impossible for {table}: {'; '.join(attach_blockers)}"
            )
        return ModeChoice(Mode.ATTACH)
    if asked == Mode.DEDUP.value:
        if dedup_problems:
            return ModeChoice(
                None, f"mode=dedup is unsafe for {table}: {'; '.join(dedup_problems)}"
            )
        return ModeChoice(Mode.DEDUP)
    if not attach_blockers:
        return ModeChoice(Mode.ATTACH)
    if dedup_problems:
        return ModeChoice(
            None,
            f"mode=auto: {table} can take neither attach ({'; '.join(attach_blockers)}) "
            f"nor dedup ({'; '.join(dedup_problems)})",
        )
    return ModeChoice(Mode.DEDUP, fallback=True)


def written_mode_refusal(
    job: str, xid: str, table: str, written: Iterable[str], resolved: str
) -> str | None:
    """Why a batch whose tasks wrote in the modes ``written`` must not be committed in
    mode ``resolved`` (the target or the pin changed under the batch); None when every
    task wrote in ``resolved``. Nothing is prepared then: abort rolls the staging back
    and a replay rewrites the batch in the job's mode."""
    modes = set(written)
    if not modes or modes == {resolved}:
        return None
    return (
        f"job {job}: the tasks of xid {xid} wrote in mode {'/'.join(sorted(modes))} but this "
        f"commit resolves mode {resolved} for {table} (the job's mode was changed while the "
        f"batch was in flight). Nothing was published; restart the query and the batch is "
        f"written again in mode {resolved}"
    )


# ------------------------------------------------------------------------- replays


def is_replay(state: XidState | None, batch: int | None, last_batch: int | None) -> bool:
    """Was this batch committed already? Its xid's record is COMMITTED, or it has no
    record (``state`` None) or only the tombstone of a rolled-back attempt (ABORTED, as
    :func:`~txsink.protocol.plans.decide_batch` reads it) and is not newer than the
    ledger's last committed batch ``last_batch`` (batch ids are monotonic: retention
    pruned its record)."""
    if state is not None and state is not XidState.ABORTED:
        return state is XidState.COMMITTED
    return batch is not None and last_batch is not None and batch <= last_batch


def unowned_batch_refusal(
    job: str, batch: int | None, last_batch: int | None, first_batch: int | None
) -> str | None:
    """Why a *streaming* batch with no record of its xid must not be written by a job
    whose ledger has committed nothing (``last_batch`` None); None: it may.

    Spark numbers a checkpoint's micro-batches from 0, so a job that sees batch N > 0
    first runs on a checkpoint another job name or state store wrote before. If that
    writer committed batch N and Spark did not record it (a crash between the two
    commits), Spark replays N, and a job with no record of it would write it twice. Only
    the operator knows the query stopped cleanly: ``first_batch`` (the option) says the
    job's own batches start there; a batch before it is refused too."""
    if batch is None or last_batch is not None:
        return None
    if first_batch is None and batch == 0:
        return None
    if first_batch is not None and batch >= first_batch:
        return None
    if first_batch is not None:
        return (
            f"micro-batch {batch} comes before job {job}'s first batch (first_batch="
            f"{first_batch}): it belongs to the checkpoint's earlier writer and may have been "
            f"committed there; nothing was written. Run the query on that job name and "
            f"state store, or from a new checkpoint location (docs/operations.md#new-store)"
        )
    return (
        f"job {job} has no record of any batch, but Spark hands it micro-batch {batch}: "
        f"the query's checkpoint was written before under another job name or state store, "
        f"and batch {batch} may be the replay of a batch committed there but not in the "
        f"checkpoint, which would be written twice; nothing was written. If the query was "
        f"stopped cleanly (its checkpoint's commits/ holds batch {batch - 1}), the batch is "
        f"new: set option first_batch={batch}. Otherwise run `txsink recover` on the old "
        f"job and store and go on there, or start from a new checkpoint location "
        f"(docs/operations.md#new-store)"
    )


class TaskVerdict(enum.StrEnum):
    WRITE = "write"
    SKIP = "skip"  # a committed (or discarded) batch: write nothing, report skipped
    REFUSE = "refuse"


@dataclass(frozen=True)
class TaskReplay:
    verdict: TaskVerdict
    reason: str = ""


def is_sealed(state: XidState | None, batch: int | None, last_batch: int | None) -> bool:
    """May a dedup task of this batch no longer send a block? Once its xid is PREPARED
    every task had reported and the batch's content is fixed; once it is committed
    (:func:`is_replay`) its partition records are deleted, so an attempt still running
    (a zombie after a GC pause, a speculative loser) would find none and send every
    block again under tokens the target's window may have forgotten. The dedup writer
    asks this, on a read taken after its own last record write, before every block it
    sends (docs/modes.md#attempts-that-outlive-their-batch)."""
    return state is XidState.PREPARED or is_replay(state, batch, last_batch)


def is_open_dedup(state: XidState | None, batch: int | None, last_batch: int | None) -> bool:
    """Do an xid's dedup records mean a batch stopped half-way? Not once it is PREPARED
    (every task finished; a roll-forward commits it) or committed (:func:`is_replay`:
    the records are leftovers of the cleanup); yes with no record or an ABORTED one newer
    than the ledger's last batch."""
    if state is XidState.PREPARED:
        return False
    return not is_replay(state, batch, last_batch)


def open_dedup_refusal(
    job: str, xid: str, table: str, open_batches: Sequence[OpenBatch]
) -> str | None:
    """Why a dedup task of ``xid`` must not send its first block: another xid of the
    job stopped half-way (``open_batches``, see :func:`is_open_dedup`); None if none."""
    others = [b for b in open_batches if b.xid != xid]
    if not others:
        return None
    b = others[0]
    batch = xid_batch(b.xid)
    rerun = (
        f"restart the streaming query from its checkpoint, or save again with txn_version={batch}"
        if batch is not None
        else "impossible for a save without txn_version (each save draws a new xid)"
    )
    more = f" (and {len(others) - 1} more)" if len(others) > 1 else ""
    return (
        f"job {job}: xid {xid} was not written into {table}: dedup-mode batch {b.xid}"
        f"{more} of this job stopped half-way and {b.describe()} may be in {table}, with "
        f"no record of which rows are there. Writing another batch now could insert them "
        f"a second time, so nothing of xid {xid} was written. Ways out: (1) rerun batch "
        f"{b.xid} until it commits ({rerun}) with the same rows in the same Spark "
        f"partitions, a refused value corrected in place: it resumes and commits exactly "
        f"once; (2) if it will never be rerun, delete its rows from {table} yourself, then "
        f"run `txsink recover --job {job} --discard-dedup {b.xid}`. See "
        f"docs/modes.md#a-dedup-batch-stopped-half-way"
    )


def dedup_coverage_refusal(
    job: str, xid: str, recorded: Iterable[str], reported: Iterable[str]
) -> str | None:
    """Why a dedup batch must not commit: Spark partitions with a record (``recorded``,
    their ids) that no task of this run reported rows for (``reported``): their rows
    may be in the target, and committing would drop the record of them."""
    missing = sorted(set(recorded) - set(reported), key=lambda p: (len(p), p))
    if not missing:
        return None
    return (
        f"job {job}: xid {xid} is not committed: Spark partition(s) {', '.join(missing)} "
        f"of it recorded blocks in an earlier attempt but sent nothing in this run (the "
        f"rerun has fewer partitions, or other rows in them). Their rows may be in the "
        f"target. Rerun the batch with its original partitioning "
        f"(docs/modes.md#a-dedup-batch-stopped-half-way)"
    )


def discarded_batch(
    job: str, xid: str, table: str, mark: Mapping[str, Any] | None, *, streaming: bool
) -> TaskReplay:
    """The one rule for a dedup xid the operator gave up (``recover --discard-dedup``;
    ``mark`` is its mark, None if not discarded), asked by its tasks and its commit. Its
    rows may have been deleted from the target, whose dedup window would drop a rerun's
    blocks as duplicates of them (rows lost, batch committed): it is never written
    again. A streaming query replays its last planned batch on every restart, so there
    it is skipped and the query moves on; anything else is refused (raised as
    :class:`~txsink.errors.DiscardedBatch`)."""
    if mark is None:
        return TaskReplay(TaskVerdict.WRITE)
    if streaming:
        return TaskReplay(
            TaskVerdict.SKIP, f"job {job}: xid {xid} was discarded by the operator; skipped"
        )
    return TaskReplay(
        TaskVerdict.REFUSE,
        f"job {job}: xid {xid} was discarded by the operator ({mark.get('by', '?')}, "
        f"{mark.get('rows', '?')} row(s) of it were in {table}); it is never written "
        f"again, because the target may still recognise its blocks and drop them as "
        f"duplicates. Nothing was written. Write this data as a new batch (a new "
        f"txn_version or a plain save; a streaming query: see "
        f"docs/modes.md#a-dedup-batch-stopped-half-way)",
    )


def task_replay(
    job: str,
    xid: str,
    task_mode: str,
    state: XidState | None,
    recorded_mode: str | None,
    batch: int | None,
    last_batch: int | None,
    *,
    streaming: bool = False,
    first_batch: int | None = None,
) -> TaskReplay:
    """What an executor task of ``xid`` does, given its record (``state``, the mode it
    was prepared in) and the ledger's ``last_batch``: write, skip the committed batch,
    or refuse a PREPARED xid of another mode (only recovery may finish it, in its mode)
    or a ``streaming`` batch the job cannot tell from a replay of another job's
    (:func:`unowned_batch_refusal`)."""
    if state is XidState.PREPARED and recorded_mode is not None and recorded_mode != task_mode:
        return TaskReplay(
            TaskVerdict.REFUSE,
            f"job {job}: xid {xid} is PREPARED in mode {recorded_mode} but this task "
            f"writes in mode {task_mode}; nothing was written. Run `txsink recover --job "
            f"{job}` to finish it in its own mode, then restart",
        )
    if is_replay(state, batch, last_batch):
        return TaskReplay(TaskVerdict.SKIP, f"xid {xid} is committed already")
    if streaming and state in (None, XidState.ABORTED):  # an earlier refusal's tombstone
        refusal = unowned_batch_refusal(job, batch, last_batch, first_batch)
        if refusal:
            return TaskReplay(TaskVerdict.REFUSE, refusal)
    return TaskReplay(TaskVerdict.WRITE)
