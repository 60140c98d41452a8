"""A three-member ZooKeeper ensemble on loopback whose members a test may kill, restart and
cut off from each other.

Owns the members' processes (started here, ended here by their own Popen handle, SIGKILL:
no shutdown of any kind) and one :class:`~tests.nemesis.proxy.FaultProxy` per directed
quorum link: member ``i`` dials member ``j``'s quorum port through ``proxy(i, j)``, so
blackholing the links between a follower and its leader cuts exactly that follower off
(its clients still reach it; it still serves their reads from its own, ageing copy of the
tree until it notices the silence, ``syncLimit`` ticks later, and drops to an election).
Election ports are direct: a cut-off follower still learns who leads, it just cannot
follow.

Used by ``tests/integration/nemesis/test_ensemble.py``. Every action is logged on
``txsink.nemesis``.
"""

from __future__ import annotations

import logging
import re
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.integration.conftest import free_port
from tests.nemesis.proxy import FaultProxy
from txsink.embedded import zookeeper

log = logging.getLogger("txsink.nemesis")

SIDS = (1, 2, 3)


@dataclass
class Member:
    sid: int
    client_port: int
    quorum_port: int
    election_port: int
    home: Path
    proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.client_port}"


@dataclass
class Ensemble:
    """Three ZooKeeper members under ``root``; call :meth:`start`, then :meth:`stop`."""

    root: Path
    members: dict[int, Member] = field(default_factory=dict)
    links: dict[tuple[int, int], FaultProxy] = field(default_factory=dict)
    cut_links: set[tuple[int, int]] = field(default_factory=set)

    def start(self, timeout: float = 60) -> Ensemble:
        zookeeper.check_installed()
        for sid in SIDS:
            self.members[sid] = Member(
                sid, free_port(), free_port(), free_port(), self.root / f"zk{sid}"
            )
        for i in SIDS:
            for j in SIDS:
                if i != j:
                    upstream = ("127.0.0.1", self.members[j].quorum_port)
                    self.links[(i, j)] = FaultProxy(upstream, name=f"zk{i}->zk{j}").start()
        for sid in SIDS:
            self.start_member(sid, wait=False)
        self.wait_serving(SIDS, timeout)
        log.info("nemesis: ensemble up, leader zk%d (%s)", self.leader(), self.hosts)
        return self

    def stop(self) -> None:
        for member in self.members.values():
            self._kill(member)
        for proxy in self.links.values():
            proxy.stop()

    def __enter__(self) -> Ensemble:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # -- addresses and roles ------------------------------------------------------------

    @property
    def hosts(self) -> str:
        """The connect string naming every member."""
        return ",".join(m.address for m in self.members.values())

    def mode(self, sid: int) -> str | None:
        return zookeeper.mode(self.members[sid].client_port)

    def leader(self, timeout: float = 30) -> int:
        """The sid of the member that leads now (waits for an election to end)."""
        deadline = time.monotonic() + timeout
        while True:
            for sid in SIDS:
                if self.mode(sid) == "leader":
                    return sid
            if time.monotonic() > deadline:
                raise TimeoutError(f"no ZooKeeper leader within {timeout:g}s")
            time.sleep(0.1)

    def followers(self) -> list[int]:
        lead = self.leader()
        return [sid for sid in SIDS if sid != lead]

    def serving(self, sid: int) -> bool:
        return self.mode(sid) in ("leader", "follower")

    def wait_serving(self, sids: tuple[int, ...] | list[int], timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not all(self.serving(sid) for sid in sids):
            if time.monotonic() > deadline:
                states = {sid: self.mode(sid) for sid in SIDS}
                raise TimeoutError(f"ZooKeeper members {list(sids)} not serving: {states}")
            time.sleep(0.1)

    def session_member(self, session_id: int) -> int | None:
        """The sid whose ``cons`` lists the session ``session_id`` (None: on none now)."""
        needle = re.compile(rf"sid=0x0*{session_id:x}\b")
        for sid, member in self.members.items():
            reply = zookeeper.four_letter(member.client_port, "cons") or ""
            if needle.search(reply):
                return sid
        return None

    # -- faults ---------------------------------------------------------------------------

    def start_member(self, sid: int, *, wait: bool = True, timeout: float = 60) -> None:
        """Start member ``sid`` (same ports, same data directory)."""
        member = self.members[sid]
        peers = {
            j: (
                m.quorum_port if j == sid else self.links[(sid, j)].port,
                m.election_port,
            )
            for j, m in self.members.items()
        }
        argv = zookeeper.peer_command(member.home, sid, member.client_port, peers)
        with open(member.home / "zookeeper.out", "ab") as out:
            member.proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=str(member.home),
                start_new_session=True,
                close_fds=True,
            )
        log.warning("nemesis: started zk%d (pid %d)", sid, member.proc.pid)
        if wait:
            self.wait_serving([sid], timeout)

    def kill(self, sid: int) -> None:
        """SIGKILL member ``sid`` and wait until it is gone."""
        log.warning("nemesis: kill -9 zk%d", sid)
        self._kill(self.members[sid])

    def _kill(self, member: Member) -> None:
        if member.proc is not None and member.proc.poll() is None:
            member.proc.kill()
            member.proc.wait(10)
        member.proc = None

    def cut(self, sid: int, peer: int) -> None:
        """Cut the quorum links between ``sid`` and ``peer``, both directions (bytes are
        swallowed, nothing is reset: each side notices only by its own timeout)."""
        log.warning("nemesis: cut quorum link zk%d <-> zk%d", sid, peer)
        for link in ((sid, peer), (peer, sid)):
            self.links[link].blackhole(True)
            self.cut_links.add(link)

    def heal(self) -> None:
        """Every cut link works again; its connections are reset, so both sides dial
        afresh (links that were never cut keep theirs)."""
        for link in sorted(self.cut_links):
            self.links[link].clear()
            self.links[link].reset_all()
        if self.cut_links:
            log.warning("nemesis: quorum links %s healed", sorted(self.cut_links))
        self.cut_links.clear()

    def wipe(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
