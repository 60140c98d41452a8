"""``txsink recover``: show each job's recovery plan, confirm, carry it out, render the outcome.

Exit statuses: 0 clean afterwards (or nothing to do, or ``--dry-run``); 3 refused (a live
writer holds the job and no ``--force``, or no confirmation); 4 alarms remain, or a dedup
batch stopped half-way that only a rerun or ``--discard-dedup`` settles. The plan
and its execution are :mod:`txsink.ops`'; this module asks and renders.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict
from typing import Any

from txsink.cli.common import jobs_of, open_stores, store_name
from txsink.cli.output import Exit, Output, age, finding
from txsink.errors import ConfigError
from txsink.ops import recovery as rc
from txsink.ops.liveness import explain

EXIT_REFUSED = Exit.REFUSED
EXIT_ALARMS = Exit.OPERATOR


def _render_plan(v: rc.RecoveryPlanView, staging_db: str) -> list[str]:
    holder = (
        f"writer epoch {v.epoch} held by {v.owner}, heartbeat {age(v.heartbeat_age)}"
        f"{' (LIVE)' if v.live else ''}"
        if v.epoch is not None
        else "no writer epoch yet"
    )
    lines = [f"job {v.job}: {holder}"]
    p = v.plan
    lines += [
        f"  plan: roll forward  {x} (PREPARED, {v.roll_forward_rows.get(x, 0)} rows)"
        for x in p.rolled_forward
    ]
    lines += [
        f"  plan: roll back     {staging_db}.{t} (staged, no PREPARED xid references it)"
        for t in p.rolled_back
    ]
    lines += [
        f"  plan: drop leftover {staging_db}.{t} (its xid is COMMITTED)"
        for t in p.dropped_leftovers
    ]
    lines += [f"  expected alarm: {a}" for a in v.expected_alarms]
    lines += [
        (
            f"  in flight       dedup batch {b.xid}: {b.describe()} so far (the live writer's;"
            f" if it is stuck, it is a half-visible batch)"
            if v.live
            else f"  half-visible    dedup batch {b.xid}: {b.describe()} may be in the target; "
            f"recovery cannot finish it: rerun that batch, or delete its rows and run `txsink "
            f"recover --job {v.job} --discard-dedup {b.xid}` "
            f"(docs/modes.md#a-dedup-batch-stopped-half-way)"
        )
        for b in v.open_dedup
    ]
    if v.empty and not v.open_dedup:
        lines.append("  nothing to do")
    return lines


def run_recover(args: argparse.Namespace, out: Output) -> int:
    lines: list[str] = []
    entries: dict[str, dict[str, Any]] = {}
    code = 0
    if args.discard_dedup:
        return _discard(args, out)
    with open_stores(args) as stores:
        jobs = jobs_of(stores, args)
        views = [rc.plan_job_recovery(stores, j, stale_after=args.stale_after) for j in jobs]
        for v in views:
            db = stores.warehouse(stores.registry.job_meta(v.job)).staging_db
            lines += _render_plan(v, db)
            entries[v.job] = {**v.to_json(), "refused": None, "outcome": None}
        if not jobs:
            lines.append(f"no jobs in the {store_name(args)}")
        todo = [v for v in views if not v.empty]
        if args.dry_run:
            for v in todo:
                if v.live:
                    lines.append(
                        f"note: job {v.job} has a live writer ({v.owner}); recover would refuse "
                        "without --force"
                    )
            lines.append("dry run: nothing was changed")
            half = any(v.open_dedup and not v.live for v in views)
            return out.result(
                Exit.OK,
                "\n".join(lines),
                jobs=list(entries.values()),
                findings=_findings(views, entries),
                dry_run=True,
                clean=not todo and not half,
            )
        allowed = []
        for v in todo:
            if v.live and not args.force:
                why = _live_refusal(args, v)
                entries[v.job]["refused"] = why
                lines.append(why)
                code = EXIT_REFUSED
            else:
                allowed.append(v)
        if allowed and not args.yes:
            refusal = _confirm(args, out, allowed, lines)
            if refusal:
                for v in allowed:
                    entries[v.job]["refused"] = refusal
                lines.append(refusal)
                return out.result(
                    EXIT_REFUSED,
                    "\n".join(lines),
                    jobs=list(entries.values()),
                    findings=_findings(views, entries),
                    dry_run=False,
                    clean=False,
                )
        with out.bar(len(allowed), "recover") as advance:
            for v in allowed:
                outcome = rc.carry_out_recovery(stores, v.job, stale_after=args.stale_after)
                db = stores.warehouse(stores.registry.job_meta(v.job)).staging_db
                lines += _render_outcome(outcome, db)
                entries[v.job]["outcome"] = outcome.to_json()
                if not outcome.clean:
                    code = EXIT_ALARMS
                advance(v.job)
        if code == 0 and any(v.open_dedup and not v.live for v in views):
            code = EXIT_ALARMS  # named above; only a rerun or --discard-dedup settles it
    return out.result(
        code,
        "\n".join(lines),
        jobs=list(entries.values()),
        findings=_findings(views, entries),
        dry_run=False,
        clean=code == 0,
    )


def _findings(
    views: list[rc.RecoveryPlanView], entries: dict[str, dict[str, Any]]
) -> list[dict[str, Any]]:
    """What needs an operator after (or instead of) the recovery: refusals, alarms, and
    dedup batches stopped half-way."""
    found = []
    for v in views:
        entry = entries[v.job]
        if entry["refused"]:
            found.append(finding("refused", "warn", entry["refused"], v.job))
        outcome = entry["outcome"] or {}
        for alarm in (outcome.get("report") or {}).get("alarms", []):
            found.append(finding("lost-staging", "error", alarm, v.job))
        if not v.live:
            found += [
                finding(
                    "half-visible-dedup",
                    "error",
                    f"dedup batch {b.xid} stopped half-way: {b.describe()}; rerun it or "
                    f"--discard-dedup {b.xid}",
                    v.job,
                    xid=b.xid,
                )
                for b in v.open_dedup
            ]
    return found


def _live_refusal(args: argparse.Namespace, v: rc.RecoveryPlanView) -> str:
    return (
        f"refusing to recover job {v.job}: writer {v.owner} (epoch {v.epoch}) "
        f"heartbeat {v.heartbeat_age:.1f}s ago is fresher than "
        + (
            f"--stale-after {v.stale_after_s:g}s"
            if args.stale_after is not None
            else f"its stale threshold {v.stale_after_s:g}s (" + explain(v) + ")"
        )
        + ", so it may be mid-batch. Stop that query (or wait "
        "until its heartbeat is stale), or re-run with --force to fence it"
    )


def _discard(args: argparse.Namespace, out: Output) -> int:
    """``--discard-dedup XID``: give up one half-visible dedup batch (see
    :func:`txsink.ops.recovery.discard_dedup`)."""
    xid = args.discard_dedup
    if not args.job:
        raise ConfigError("--discard-dedup needs --job (the job whose batch to discard)")
    with open_stores(args) as stores:
        v = rc.plan_job_recovery(stores, args.job, stale_after=args.stale_after)
        lines = [
            f"job {v.job}: discard dedup batch {xid}: its partition records are kept and "
            f"marked discarded; the job then writes other batches again and {xid} is never "
            "written again. Rows of it still in the target stay there: delete them first"
        ]
        entry: dict[str, Any] = {"job": v.job, "discard": xid, "refused": None, "outcome": None}
        refusal = None
        if v.live and not args.force:
            refusal = _live_refusal(args, v)
        elif args.dry_run:
            lines.append("dry run: nothing was changed")
        elif not args.yes:
            refusal = _confirm(args, out, [v], lines)
        if refusal or args.dry_run:
            if refusal:
                lines.append(refusal)
            entry["refused"] = refusal
            return out.result(
                Exit.OK if args.dry_run else EXIT_REFUSED,
                "\n".join(lines),
                jobs=[entry],
                findings=[finding("refused", "warn", refusal, v.job)] if refusal else [],
                dry_run=args.dry_run,
                clean=False,
            )
        epoch, batch = rc.discard_dedup(stores, args.job, xid)
        lines.append(
            f"job {v.job}: took writer epoch {epoch}; discarded {xid} ({batch.describe()})"
        )
        entry["outcome"] = {"epoch": epoch, "discarded": asdict(batch)}
    return out.result(Exit.OK, "\n".join(lines), jobs=[entry], dry_run=False, clean=True)


def _confirm(
    args: argparse.Namespace, out: Output, allowed: list[rc.RecoveryPlanView], lines: list[str]
) -> str | None:
    """None when the operator confirmed; else why nothing will be done."""
    if out.json_mode:
        return "refusing to change anything: --json needs --yes (or --dry-run); nothing changed"
    if not sys.stdin.isatty():
        return (
            "refusing to change anything: stdin is not a terminal, so the plan cannot be "
            "confirmed; re-run with --yes to carry it out (or --dry-run to only show it)"
        )
    out.emit(None, "\n".join(lines))
    lines.clear()
    names = ", ".join(v.job for v in allowed)
    out.progress(
        f"Carry out this plan for {names}? Each job gets a new writer epoch, which fences "
        "its current writer. [y/N] "
    )
    answer = sys.stdin.readline().strip().lower()
    return None if answer in ("y", "yes") else "not confirmed; nothing was changed"


def _render_outcome(o: rc.RecoveryOutcome, staging_db: str) -> list[str]:
    r = o.report
    lines = [
        f"job {o.job}: took writer epoch {o.epoch} as {o.owner}; this fences "
        + (
            f"{o.fenced_owner} (epoch {o.fenced_epoch}): its next commit fails with FencedError, "
            "restart that query to resume the job"
            if o.fenced_owner
            else "no earlier writer"
        )
    ]
    stuck = set(o.remaining.plan.rolled_forward)
    lines += [f"  rolled forward  {x}" for x in r.rolled_forward if x not in stuck]
    lines += [f"  rolled back     {staging_db}.{t}" for t in r.rolled_back]
    lines += [f"  dropped         {staging_db}.{t}" for t in r.dropped_leftovers]
    if r.pruned:
        lines.append(f"  pruned {len(r.pruned)} old COMMITTED record(s)")
    lines += [f"  ALARM: {a}" for a in r.alarms]
    lines.append(
        f"job {o.job}: clean"
        if o.clean
        else f"job {o.job}: ALARMS REMAIN ({len(r.alarms)}); see docs/operations.md#lost-staging"
    )
    return lines
