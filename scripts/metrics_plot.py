"""Sample txsink's metrics over a run and plot the panels of docs/grafana/txsink-dashboard.json.

No Grafana renderer is at hand here, so this draws the dashboard's panels with matplotlib
from the same series, computed the way the dashboard's PromQL computes them:

    # every second, scrape the driver's endpoint (or read the textfile), one JSON line each
    python scripts/metrics_plot.py sample --url http://127.0.0.1:9464/metrics \
        --out samples.jsonl --interval 1 --duration 300
    python scripts/metrics_plot.py plot samples.jsonl --png docs/grafana/txsink-metrics.png

``sample`` keeps going when a scrape fails (the endpoint is down while Spark restarts
the job): such a tick is recorded as a gap. ``plot`` draws, per job: rows committed per
second (``rate``), batches committed / skipped / rolled forward and recoveries / fencing
events (running totals), commit latency p50 / p99 (``histogram_quantile`` over the bucket
increments of a sliding window) and the age of the last commit.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import urllib.request
from collections import defaultdict
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

Series = dict[str, list[tuple[float, float]]]  # key -> [(t, value)]


# ------------------------------------------------------------------------- sampling


def read_metrics(url: str | None, textfile: str | None) -> str:
    if url:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.read().decode()
    return Path(textfile or "").read_text()


def sample(args: argparse.Namespace) -> int:
    end = time.time() + args.duration
    with open(args.out, "a") as out:
        while time.time() < end:
            t = time.time()
            try:
                text = read_metrics(args.url, args.textfile)
                rows = [
                    [s.name, s.labels, s.value]
                    for fam in text_string_to_metric_families(text)
                    for s in fam.samples
                    if s.name.startswith("txsink_")
                ]
                out.write(json.dumps({"t": t, "samples": rows}) + "\n")
            except (OSError, ValueError) as exc:
                out.write(json.dumps({"t": t, "gap": str(exc)[:200]}) + "\n")
            out.flush()
            time.sleep(max(0.0, args.interval - (time.time() - t)))
    return 0


# ------------------------------------------------------------------------- series


def load(path: str, job: str | None) -> tuple[dict[str, Series], list[float], float]:
    """job -> series key (name, or name|le=bound) -> points; gap times; first time."""
    by_job: dict[str, Series] = defaultdict(lambda: defaultdict(list))
    gaps: list[float] = []
    t0 = math.inf
    for line in Path(path).read_text().splitlines():
        tick = json.loads(line)
        t0 = min(t0, tick["t"])
        if "gap" in tick:
            gaps.append(tick["t"])
            continue
        for name, labels, value in tick["samples"]:
            j = labels.get("job")
            if j is None or (job and j != job):
                continue
            key = f"{name}|le={labels['le']}" if "le" in labels else name
            by_job[j][key].append((tick["t"], float(value)))
    return by_job, gaps, t0


def increase(points: list[tuple[float, float]], t: float, window: float) -> float | None:
    """What the counter gained over (t - window, t], resets counted as in Prometheus."""
    inside = [(ts, v) for ts, v in points if t - window < ts <= t]
    if len(inside) < 2:
        return None
    total, prev = 0.0, inside[0][1]
    for _, v in inside[1:]:
        total += v - prev if v >= prev else v
        prev = v
    return total


def rate(points: list[tuple[float, float]], window: float) -> list[tuple[float, float]]:
    """Per-second increase over the samples inside each window (over the time they span,
    so a run's first seconds are not diluted by the window before it started)."""
    out = []
    for t, _ in points:
        inside = [ts for ts, _ in points if t - window < ts <= t]
        inc = increase(points, t, window)
        if inc is not None and inside[-1] > inside[0]:
            out.append((t, inc / (inside[-1] - inside[0])))
    return out


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """Prometheus' histogram_quantile over (upper bound, cumulative count) pairs."""
    buckets = sorted(buckets)
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    prev_bound, prev_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return prev_bound  # the highest finite bound, as Prometheus answers
            if count == prev_count:
                return bound
            return prev_bound + (bound - prev_bound) * (rank - prev_count) / (count - prev_count)
        prev_bound, prev_count = bound, count
    return None


def quantiles(series: Series, q: float, window: float) -> list[tuple[float, float]]:
    bucket_keys = [k for k in series if k.startswith("txsink_commit_seconds_bucket|le=")]
    times = sorted({t for k in bucket_keys for t, _ in series[k]})
    out = []
    for t in times:
        buckets = []
        for key in bucket_keys:
            inc = increase(series[key], t, window)
            if inc is not None:
                buckets.append((float(key.split("le=")[1]), inc))
        value = histogram_quantile(q, buckets)
        if value is not None:
            out.append((t, value))
    return out


# ------------------------------------------------------------------------- plotting


def plot(args: argparse.Namespace) -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_job, gaps, t0 = load(args.samples, args.job)
    if not by_job:
        sys.stderr.write(f"no txsink series in {args.samples}\n")
        return 1
    fig, axes = plt.subplots(3, 2, figsize=(13, 10), sharex=True)
    (ax_rows, ax_batches), (ax_p, ax_rec), (ax_age, ax_text) = axes

    def broken(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
        """NaN where the endpoint did not answer: no line drawn across a restart."""
        out: list[tuple[float, float]] = []
        for t, v in points:
            if out and t - out[-1][0] > 2.5 * args.interval:
                out.append((out[-1][0] + args.interval, math.nan))
            out.append((t, v))
        return out

    def xs(points: list[tuple[float, float]]) -> list[float]:
        return [t - t0 for t, _ in broken(points)]

    def ys(points: list[tuple[float, float]]) -> list[float]:
        return [v for _, v in broken(points)]

    for job, s in sorted(by_job.items()):
        tag = f" ({job})" if len(by_job) > 1 else ""
        r = rate(s["txsink_rows_committed_total"], args.window)
        ax_rows.plot(xs(r), ys(r), label=f"rows/s{tag}")
        for name, label in (
            ("txsink_batches_committed_total", "committed"),
            ("txsink_batches_skipped_total", "skipped (replays)"),
            ("txsink_batches_rolled_forward_total", "rolled forward"),
        ):
            ax_batches.step(xs(s[name]), ys(s[name]), where="post", label=f"{label}{tag}")
        for q in (0.5, 0.99):
            points = quantiles(s, q, args.window)
            ax_p.plot(xs(points), ys(points), marker=".", label=f"p{round(q * 100)}{tag}")
        for name, label in (
            ("txsink_recoveries_total", "recoveries (takeovers)"),
            ("txsink_fencing_events_total", "fencing events"),
        ):
            ax_rec.step(xs(s[name]), ys(s[name]), where="post", label=f"{label}{tag}")
        last = s["txsink_last_commit_timestamp_seconds"]
        age = [(t, t - v) for t, v in last]
        ax_age.plot(xs(age), ys(age), label=f"seconds since{tag}")
    titles = {
        ax_rows: f"rows committed per second (rate over {args.window:g} s)",
        ax_batches: "batches (running totals)",
        ax_p: f"commit latency, s (histogram_quantile over {args.window:g} s)",
        ax_rec: "recoveries and fencing events (running totals)",
        ax_age: "age of the last commit, s",
    }
    for ax, title in titles.items():
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
        for g in gaps:  # ticks where the endpoint did not answer (job restarting)
            ax.axvspan(g - t0 - args.interval / 2, g - t0 + args.interval / 2, color="0.9")
    for ax in (ax_age, ax_text):
        ax.set_xlabel("seconds since the first sample")
    ax_text.axis("off")
    ax_text.text(0, 0.95, args.note or "", va="top", fontsize=9, family="monospace", wrap=True)
    fig.suptitle(args.title or f"txsink metrics: {', '.join(sorted(by_job))}")
    fig.tight_layout()
    fig.savefig(args.png, dpi=90)
    print(f"wrote {args.png}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("sample", help="scrape the endpoint (or read a textfile) every interval")
    src = s.add_mutually_exclusive_group(required=True)
    src.add_argument("--url", help="http://host:port/metrics")
    src.add_argument("--textfile", help="a metrics_textfile path")
    s.add_argument("--out", required=True, help="JSON lines, appended")
    s.add_argument("--interval", type=float, default=1.0)
    s.add_argument("--duration", type=float, default=600.0)
    p = sub.add_parser("plot", help="draw the dashboard's panels from samples")
    p.add_argument("samples")
    p.add_argument("--png", required=True)
    p.add_argument("--job", help="only this job (default: every job in the samples)")
    p.add_argument("--window", type=float, default=15.0, help="rate/quantile window, seconds")
    p.add_argument("--interval", type=float, default=1.0, help="the sampling interval")
    p.add_argument("--title")
    p.add_argument("--note", help="text for the free panel (what the run did)")
    args = parser.parse_args(argv)
    return sample(args) if args.command == "sample" else plot(args)


if __name__ == "__main__":
    sys.exit(main())
