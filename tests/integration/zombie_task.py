"""One Spark task attempt in a process of its own, run through the executor entry
(:func:`txsink.spark.writer.write_partition`) with a stand-in TaskContext, for the tests
that freeze an attempt the way a GC pause or a network partition freezes an executor.

    python -m tests.integration.zombie_task PLAN PARTITION ATTEMPT BATCH FIRST COUNT [MODE]

``PLAN`` is a pickled :class:`~txsink.spark.messages.WritePlan` (as Spark ships it to
executors); the rows are ``id`` FIRST..FIRST+COUNT-1 in batches of one row. With MODE
``freeze`` the process stops itself (SIGSTOP) when the writer pulls its first batch: the
test sees it stopped (``waitpid(WUNTRACED)``), does what it wants meanwhile and thaws
it (SIGCONT). With ``freeze-send`` it stops right before its first block insert is sent
(every check made, the seal's included). The commit message is printed as JSON (and
pickled to ``PLAN.<ATTEMPT>.msg`` for the test to commit); an error as ``{"error": ...}``.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import sys
from collections.abc import Iterator
from typing import Any

import pyarrow as pa
from pyspark import TaskContext

from txsink.errors import TxSinkError
from txsink.spark.messages import BATCH_ID_PROPERTY, RUN_ID_PROPERTY
from txsink.spark.writer import write_partition

RUN_ID = "zombie-run"


class Ctx:
    """The TaskContext calls the executor path makes."""

    def __init__(self, partition: int, attempt: int, batch: int) -> None:
        self.partition, self.attempt, self.batch = partition, attempt, batch

    def partitionId(self) -> int:
        return self.partition

    def attemptNumber(self) -> int:
        return self.attempt

    def taskAttemptId(self) -> int:
        return 1000 * self.partition + self.attempt

    def getLocalProperty(self, key: str) -> str | None:
        return {BATCH_ID_PROPERTY: str(self.batch), RUN_ID_PROPERTY: RUN_ID}.get(key)


def source(first: int, count: int, freeze: bool) -> Iterator[Any]:
    for i in range(first, first + count):
        if freeze and i == first:
            os.kill(os.getpid(), signal.SIGSTOP)  # frozen here until the test's SIGCONT
        yield pa.RecordBatch.from_pydict({"id": pa.array([i], pa.int64())})


def freeze_before_first_send() -> None:
    """Stop the process when its first block insert into a target is about to be sent:
    after every check the attempt makes (its batch's seal included), before the request."""
    from txsink.clickhouse.warehouse import ClickHouseWarehouse

    send = ClickHouseWarehouse.insert_blocks
    frozen = []

    def insert_blocks(self: Any, table: str, *args: Any, **kwargs: Any) -> Any:
        if "." in table and not frozen:
            frozen.append(table)
            os.kill(os.getpid(), signal.SIGSTOP)  # frozen here until the test's SIGCONT
        return send(self, table, *args, **kwargs)

    ClickHouseWarehouse.insert_blocks = insert_blocks  # type: ignore[method-assign]


def main(argv: list[str]) -> None:
    with open(argv[0], "rb") as fh:
        plan = pickle.load(fh)
    partition, attempt, batch, first, count = (int(a) for a in argv[1:6])
    freeze = argv[6:] == ["freeze"]
    if argv[6:] == ["freeze-send"]:
        freeze_before_first_send()
    ctx = Ctx(partition, attempt, batch)
    TaskContext.get = classmethod(lambda _cls: ctx)  # type: ignore[method-assign,assignment]
    try:
        message = write_partition(plan, source(first, count, freeze))
    except TxSinkError as exc:
        sys.stdout.write(json.dumps({"error": f"{type(exc).__name__}: {exc}"}) + "\n")
        return
    with open(f"{argv[0]}.{attempt}.msg", "wb") as fh:  # for the test's driver-side commit
        pickle.dump(message, fh)
    out = {
        "rows": message.rows,
        "skipped": message.skipped,
        "staging": list(message.staging),
        "extra": message.extra,
    }
    sys.stdout.write(json.dumps(out) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
