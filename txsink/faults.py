"""Fault points for chaos tests (contract: ``TXSINK_FAULT=<point>``).

When the environment variable names the point a process reaches, the process exits at
once with ``os._exit`` (no cleanup, no finally blocks, like ``kill -9``). Unset, a fault
point costs one dict lookup.

``TXSINK_FAULT`` may list several points separated by commas. ``TXSINK_FAULT_AFTER=N``
lets the first N arrivals pass (so a crash can land in a later batch), counted per
process unless ``TXSINK_FAULT_STATE=<file>`` names a counter file shared by processes.
"""

from __future__ import annotations

import os

POINTS = (
    "executor.mid_write",
    "driver.before_prepare",
    "driver.after_prepare",
    "driver.mid_commit",
    "driver.after_commit",
    "driver.after_record",
)
EXIT_CODE = 137
_counts: dict[str, int] = {}


def _arrivals(point: str) -> int:
    state = os.environ.get("TXSINK_FAULT_STATE")
    if not state:
        _counts[point] = _counts.get(point, 0) + 1
        return _counts[point]
    path = f"{state}.{point}"
    try:
        with open(path) as fh:
            n = int(fh.read() or 0) + 1
    except (OSError, ValueError):
        n = 1
    with open(path, "w") as fh:
        fh.write(str(n))
    return n


def fault_point(point: str) -> None:
    """Hard-exit the process here when ``TXSINK_FAULT`` names ``point``."""
    wanted = os.environ.get("TXSINK_FAULT")
    if not wanted or point not in wanted.split(","):
        return
    after = int(os.environ.get("TXSINK_FAULT_AFTER", "0"))
    if _arrivals(point) <= after:
        return
    os._exit(EXIT_CODE)
