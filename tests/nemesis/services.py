"""Failing the services under a running writer: kill and restart the embedded ClickHouse
endpoint or ZooKeeper (SIGKILL, same data directory, same port) and expire a Keeper
session on purpose.

Used by the nemesis tests (``tests/integration/nemesis/``) and by ``make chaos``
(``tests/nemesis/chaos.py``). Every action is logged on ``txsink.nemesis`` so a failing
run says which fault came when.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kazoo.client import KazooClient

from txsink.embedded import stack as embedded
from txsink.embedded.stack import StackInfo
from txsink.errors import UnavailableError

log = logging.getLogger("txsink.nemesis")


def _port(address: str) -> int:
    return int(address.rsplit(":", 1)[-1].split("/", maxsplit=1)[0])


@dataclass
class Services:
    """One embedded stack whose processes a test may kill and bring back."""

    info: StackInfo

    @property
    def root(self) -> Path:
        return Path(self.info.dir)

    def pid(self, name: str) -> int | None:
        record = embedded._read_pid(self.root, name)
        if record is None or not embedded._is_ours(self.root, name, record[0]):
            return None
        return record[0]

    def kill(self, name: str) -> int | None:
        """SIGKILL the ``clickhouse`` endpoint or ``zookeeper`` (no shutdown of any kind) and
        wait until it is gone; returns its pid (None if it was not running)."""
        pid = self.pid(name)
        if pid is None:
            return None
        log.warning("nemesis: kill -9 %s (pid %d)", name, pid)
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while embedded._is_ours(self.root, name, pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        return pid

    def restart(self, timeout: float = 90) -> StackInfo:
        """Start whatever is not running again, on the same ports and data directory, and
        wait until it answers."""
        deadline = time.monotonic() + 15
        while True:
            try:
                info = embedded.up(
                    self.root, _port(self.info.url), _port(self.info.keeper), timeout=timeout
                )
                break
            except UnavailableError as exc:
                # A client reconnecting to the dead port (kazoo retries every few ms) can
                # TCP self-connect when the port lies in the ephemeral range, holding it
                # for a moment: wait until it lets go.
                if "is taken" not in str(exc) or time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        log.warning("nemesis: stack answering again (%s, %s)", info.url, info.keeper)
        self.info = info
        return info

    def outage(self, name: str, seconds: float) -> threading.Thread:
        """Kill ``name`` now and restart it ``seconds`` later in the background."""
        self.kill(name)

        def bring_back() -> None:
            time.sleep(seconds)
            self.restart()

        thread = threading.Thread(target=bring_back, name=f"restart-{name}", daemon=True)
        thread.start()
        return thread


def expire_session(client: Any, hosts: str, timeout: float = 10) -> None:
    """Expire ``client``'s ZooKeeper session from outside, as kazoo's own test harness
    does: a second connection with the same session id and password, closed at once,
    makes the server end the session; the first client hears SessionExpired on its next
    request and kazoo opens a new session."""
    session_id, password = client.client_id
    other = KazooClient(hosts=hosts, client_id=(session_id, password), timeout=timeout)
    other.start(timeout=timeout)
    other.stop()
    other.close()
    log.warning("nemesis: expired Keeper session 0x%x", session_id)
