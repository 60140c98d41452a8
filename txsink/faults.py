"""Fault points for chaos tests (contract: ``TXSINK_FAULT=<point>``).

When the environment variable names the point a process reaches, the process exits at
once with ``os._exit`` (no cleanup, no finally blocks, like ``kill -9``). Unset, a fault
point costs one dict lookup.

``TXSINK_FAULT`` may list several points separated by commas. ``TXSINK_FAULT_AFTER=N``
lets the first N arrivals pass (so a crash can land in a later batch) and
``TXSINK_FAULT_TIMES=K`` crashes only K times after that (so a retried task can
succeed). Arrivals are counted per process unless ``TXSINK_FAULT_STATE=<file>`` names a
counter file shared by processes (Spark runs writers in several Python workers).

``TXSINK_PAUSE=<point>:<seconds>[:<n>][,...]`` makes every arrival at a point sleep that
long instead (only the n-th arrival, when ``n`` is given, counted like the faults'
arrivals): tests widen a window so that something outside the process (a ``kill -9`` of
an executor JVM, a server restart, a speculative copy of one slow task) lands inside it.
Unset, it costs one lookup too.
"""

from __future__ import annotations

import fcntl
import os
import time

POINTS = (
    "executor.mid_write",
    "driver.before_prepare",
    "driver.after_prepare",
    "driver.mid_commit",
    "driver.after_commit",
    "driver.after_record",
)
# Points only some paths reach (a job that does not use the feature never hits them):
# between two tx.write calls of txsink.transaction; after each statement of the batch
# staging of visibility=batch (created; filled: every task partition copied or gathered),
# around its one ATTACH PARTITION ALL (claimed but not attached; attached, staging not
# yet dropped); after a dedup xid's seal row. POINTS + FEATURE_POINTS name every point
# the package has (a unit test checks).
FEATURE_POINTS = (
    "driver.between_writes",
    "driver.after_batch_create",
    "driver.after_copy",
    "driver.before_attach",
    "driver.after_attach",
    "driver.after_seal",
)
EXIT_CODE = 137
_counts: dict[str, int] = {}


def _arrivals(point: str) -> int:
    state = os.environ.get("TXSINK_FAULT_STATE")
    if not state:
        _counts[point] = _counts.get(point, 0) + 1
        return _counts[point]
    with open(f"{state}.{point}", "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)  # several Spark workers count the same point
        fh.seek(0)
        try:
            n = int(fh.read() or 0) + 1
        except ValueError:
            n = 1
        fh.seek(0)
        fh.truncate()
        fh.write(str(n))
        fh.flush()
    return n


def fault_point(point: str) -> None:
    """Hard-exit the process here when ``TXSINK_FAULT`` names ``point`` (sleep here when
    ``TXSINK_PAUSE`` does). An arrival is counted once, before any sleep, and the pauses'
    ``n`` and the faults' ``AFTER``/``TIMES`` read the same count: "the first arrival
    sleeps, the second dies" holds however the arrivals interleave."""
    pauses = [
        (float(seconds or 1), int(nth) if nth else None)
        for item in os.environ.get("TXSINK_PAUSE", "").split(",")
        if item
        for name, _, rest in [item.partition(":")]
        if name == point
        for seconds, _, nth in [rest.partition(":")]
    ]
    wanted = os.environ.get("TXSINK_FAULT")
    faulty = bool(wanted) and point in (wanted or "").split(",")
    if not (faulty or pauses):
        return
    counted = faulty or any(nth is not None for _, nth in pauses)
    n = _arrivals(point) if counted else 0
    for seconds, nth in pauses:
        if nth is None or nth == n:
            time.sleep(seconds)
    if not faulty:
        return
    after = int(os.environ.get("TXSINK_FAULT_AFTER", "0"))
    times = int(os.environ.get("TXSINK_FAULT_TIMES", "0")) or None
    if n <= after or (times is not None and n > after + times):
        return
    os._exit(EXIT_CODE)
