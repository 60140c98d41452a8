"""A fault of the development stack: the ClickHouse server crashing *inside* a MOVE.

ClickHouse moves a partition's parts into the destination one by one and removes them
from the source after the last, so a server crash in between leaves some of the parts in
both tables (docs/operations.md#evidence-of-publish). chdb runs a MOVE in-process in a
fraction of a millisecond, so a kill from outside almost never lands inside one. For the
chaos and nemesis tests the endpoint makes that state itself: when the file
:data:`CRASH_FLAG` exists in its data directory, the next ``ALTER TABLE s MOVE PARTITION
ID 'p' TO TABLE t`` whose partition has at least two parts copies the first half of them
(with their UUIDs, as a MOVE's renames keep them) into ``t``, leaves ``s`` as it was, and
the process exits at once (status 137, no cleanup, like ``kill -9``). Nothing happens
while the file is absent; it is removed when the crash fires, and a line saying what was
cut goes to :data:`CRASH_LOG` beside it.
"""

from __future__ import annotations

import os
import re
import uuid
from pathlib import Path
from typing import Any

CRASH_FLAG = "crash-inside-next-move"
CRASH_LOG = "crash-inside-move.log"
_MOVE_RE = re.compile(
    r"ALTER\s+TABLE\s+(\S+)\s+MOVE\s+PARTITION\s+ID\s+'([0-9A-Za-z_-]+)'\s+TO\s+TABLE\s+([^\s,]+)",
    re.IGNORECASE,
)


def cut_move_if_armed(engine: Any, ec: Any, sql: str, data_dir: Path) -> None:
    """Crash inside ``sql`` if it is a MOVE PARTITION and the crash is armed (see module)."""
    flag = data_dir / CRASH_FLAG
    if not flag.exists():
        return
    found = _MOVE_RE.search(sql)
    if found is None:
        return
    source, partition, dest = found.groups()
    scratch = f"default.txsink_cut_{uuid.uuid4().hex[:8]}"
    run = engine.text
    run(ec, f"CREATE TABLE {scratch} AS {source}")
    run(ec, f"ALTER TABLE {scratch} ATTACH PARTITION ID '{partition}' FROM {source}")
    names = run(
        ec,
        "SELECT name FROM system.parts WHERE active AND database = 'default' "
        f"AND table = '{scratch.split('.', 1)[1]}' ORDER BY name",
    ).split()
    if len(names) < 2:  # one part cannot be cut: this MOVE runs as usual, still armed
        run(ec, f"DROP TABLE {scratch} SYNC")
        return
    keep = len(names) // 2
    drops = ", ".join(f"DROP PART '{name}'" for name in names[keep:])
    run(ec, f"ALTER TABLE {scratch} {drops}")
    run(ec, f"ALTER TABLE {dest} ATTACH PARTITION ID '{partition}' FROM {scratch}")
    run(ec, f"DROP TABLE {scratch} SYNC")
    flag.unlink(missing_ok=True)
    with open(data_dir / CRASH_LOG, "a", encoding="utf-8") as log:
        log.write(f"{keep} of {len(names)} parts of partition {partition} of {source}\n")
    os._exit(137)
