"""``txsink verify``: audit each job's committed history and render the findings.

Exit statuses: 0 clean; 1 anomalies, or no job found (a wrong root verifies nothing, and
says so); the jobs with anomalies are listed first and named in the last line. The
audit is :func:`txsink.ops.verify.verify`.
"""

from __future__ import annotations

import argparse

from txsink.cli.common import jobs_of, open_stores, store_name
from txsink.cli.output import Exit, Output, finding
from txsink.ops import anomalies as an
from txsink.ops import verify as vf


def run_verify(args: argparse.Namespace, out: Output) -> int:
    with open_stores(args) as stores:
        jobs = jobs_of(stores, args)
        results = []
        with out.bar(len(jobs), "verify") as advance:
            for job in jobs:
                results.append(
                    vf.verify(
                        stores.registry,
                        stores.warehouse(stores.registry.job_meta(job)),
                        job,
                        stuck_after=args.stuck_after,
                        recent=args.recent,
                        allow_other_writers=args.allow_other_writers,
                    )
                )
                advance(job)
    found = [
        finding(a.kind, "error", a.message, r.job, xids=list(a.xids))
        for r in results
        for a in r.anomalies
    ] + [finding(w.kind, "warn", w.message, r.job) for r in results for w in r.warnings]
    if not results:  # a wrong --keeper-root (or --state) finds nothing: never "CLEAN"
        message = (
            f"no jobs in the {store_name(args)}: nothing was verified; check --keeper-root, "
            "--state and --keeper (or --url for state=clickhouse)"
        )
        found.append(finding("no-jobs", "error", message))
        return out.result(Exit.FINDINGS, f"verify: {message}", findings=found, clean=False)
    clean = all(r.clean for r in results)
    # anomalies first: with many jobs, the one that needs attention is not buried
    ordered = sorted(results, key=lambda r: (r.clean, r.job))
    blocks = [_render_verify(r) for r in ordered]
    anomalies = sum(len(r.anomalies) for r in results)
    blocks.append(
        "verify: CLEAN"
        if clean
        else f"verify: {anomalies} ANOMALIES in " + ", ".join(r.job for r in ordered if not r.clean)
    )
    return out.result(
        Exit.OK if clean else Exit.FINDINGS,
        "\n\n".join(blocks),
        jobs=[r.to_json() for r in ordered],
        findings=found,
        clean=clean,
    )


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
