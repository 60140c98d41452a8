"""``INSERT ... SELECT ... FROM input('<structure>') ... FORMAT X``: the body spooled to a file.

A ClickHouse server runs such an INSERT natively, ``input()`` reading the request body.
chdb cannot: its streaming insert refuses ``INSERT ... SELECT``, and no client feeds its
``input()``. So the endpoint writes the body chunk by chunk to a temporary file under its
data directory (never holding it in memory), runs the statement as a normal query with
``input('<structure>')`` replaced by ``file('<path>', '<X>', '<structure>')`` and without
its FORMAT clause (:meth:`~txsink.embedded.sqlscan.InputInsert.reading_file`), and answers
like an INSERT.

Invariants: the statement runs on the request's prepared connection, so the request's
settings (``insert_deduplication_token``, ...) apply; its text keeps everything but the
source and the FORMAT clause (a WHERE's literals show in ``system.processes`` while it
runs); engine errors keep their ClickHouse code; the file is removed whatever happens.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from pathlib import Path

from txsink.embedded.engine import Engine, EngineConn
from txsink.embedded.http_errors import HttpError
from txsink.embedded.responses import insert_summary
from txsink.embedded.sqlscan import InputInsert
from txsink.embedded.transfer import Body

CANNOT_WRITE_TO_FILE = 75  # CANNOT_WRITE_TO_FILE_DESCRIPTOR
GLOB_CHARS = frozenset("*?{}[]")  # file() reads these as a glob


def spool_dir(data_dir: Path | None) -> Path:
    """Where bodies are spooled: ``<data dir>/input``, else the system's temp directory."""
    return data_dir / "input" if data_dir is not None else Path(tempfile.gettempdir())


def run_input_insert(
    engine: Engine,
    ec: EngineConn,
    stmt: InputInsert,
    body: Body,
    binds: dict[str, str],
    directory: Path,
) -> dict[str, str]:
    """Spool ``body`` under ``directory``, run ``stmt`` reading it; the insert's summary."""
    where = str(directory.resolve())
    if GLOB_CHARS & set(where):
        raise HttpError(
            CANNOT_WRITE_TO_FILE,
            f"Cannot spool the body of an INSERT reading input() under {where}: file() would "
            "read the path as a glob; start the endpoint with a data directory without any "
            "of * ? { } [ ]",
        )
    try:
        os.makedirs(where, exist_ok=True)
        fd, path = tempfile.mkstemp(prefix="input-", suffix=f".{stmt.fmt.lower()}", dir=where)
    except OSError as exc:
        raise _spool_error(where, exc) from exc
    try:
        with os.fdopen(fd, "wb") as fh:
            for chunk in body.chunks():  # reading may fail (ClientGone): not a spool error
                try:
                    fh.write(chunk)
                except OSError as exc:
                    raise _spool_error(where, exc) from exc
        start = time.monotonic()
        result = engine.query(ec, stmt.reading_file(path), "TabSeparated", binds)
        elapsed = time.monotonic() - start
        return insert_summary(result.rows_written(), result.bytes_written(), elapsed)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _spool_error(where: str, exc: OSError) -> HttpError:
    return HttpError(
        CANNOT_WRITE_TO_FILE,
        f"Cannot spool the body of an INSERT reading input() under {where}: {exc}; free "
        "space there (or fix its permissions) and send the INSERT again",
    )
