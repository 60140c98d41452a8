"""``txsink verify``: audit each job's committed history and render the findings.

Exit statuses: 0 clean; 1 anomalies, or no job found (a wrong root verifies nothing, and
says so). The audit is :func:`txsink.ops.verify.verify`.
"""

from __future__ import annotations

import argparse

from txsink.cli.common import open_stores
from txsink.cli.output import Output
from txsink.ops import anomalies as an
from txsink.ops import verify as vf
from txsink.ops.stores import resolve_jobs


def run_verify(args: argparse.Namespace, out: Output) -> int:
    with open_stores(args) as stores:
        jobs = resolve_jobs(stores.registry, args.job, args.keeper_root)
        results = [
            vf.verify(
                stores.registry,
                stores.warehouse(stores.registry.job_meta(job)),
                job,
                stuck_after=args.stuck_after,
                recent=args.recent,
                allow_other_writers=args.allow_other_writers,
            )
            for job in jobs
        ]
    if not results:  # a wrong --keeper-root (or --state) finds nothing: never "CLEAN"
        where = f"{args.keeper_root} ({'state=' + args.state})"
        message = (
            f"no jobs under {where}: nothing was verified; check --keeper-root, --state "
            "and --keeper (or --url for state=clickhouse)"
        )
        out.emit({"clean": False, "jobs": [], "finding": message}, f"verify: {message}")
        return 1
    clean = all(r.clean for r in results)
    payload = {"clean": clean, "jobs": [r.to_json() for r in results]}
    blocks = [_render_verify(r) for r in results]
    anomalies = sum(len(r.anomalies) for r in results)
    blocks.append("verify: CLEAN" if clean else f"verify: {anomalies} ANOMALIES")
    out.emit(payload, "\n\n".join(blocks))
    return 0 if clean else 1


def _render_verify(r: an.VerifyResult) -> str:
    c = r.checked
    lines = [
        f"job {r.job}  target {r.target}",
        f"  history: {c.get('committed_retained', 0)} committed xids retained "
        f"(seq {c.get('seq_range') or '-'}), {c.get('prepared', 0)} PREPARED, "
        f"{c.get('adhoc_exempt', 0)} ad-hoc exempt",
    ]
    per_table = c.get("tables") or ({r.target: c} if "ledger_rows" in c else {})
    for name, t in per_table.items():
        lines.append(
            f"  reconciliation of {name} by {t['reconciled_by']}: ledger {t['ledger_rows']:,} "
            f"rows ({', '.join(t['writers']) or '-'}) vs target {t['target_rows']:,} rows in "
            f"{t['partitions']} partition(s) [{t.get('engine') or 'missing'}]"
        )
    lines.append("  anomalies:" if r.anomalies else "  anomalies: none")
    for a in r.anomalies:
        who = f"  [xids {', '.join(a.xids)}]" if a.xids else ""
        lines.append(f"    {a.kind.upper()}: {a.message}{who}")
    for w in r.warnings:
        lines.append(f"  warning {w.kind}: {w.message}")
    return "\n".join(lines)
