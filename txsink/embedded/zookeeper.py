"""A real ZooKeeper server for the embedded stack (Debian's ``zookeeper`` package, Java 17).

Owns the ZooKeeper configuration under ``<stack dir>/zookeeper/``: ``zoo.cfg`` (loopback
only, no admin server, unlimited client connections, ``srvr``/``ruok``/``stat`` four-letter
words), ``log4j.properties`` writing ``zookeeper.log`` there, and the data directory.
:func:`command` gives the argv that runs the standalone server in the foreground; the
stack module starts and stops it. :func:`ruok` asks a running server whether it serves.

:func:`peer_command` gives the argv of one member of a small quorum on loopback (tests:
``tests/nemesis/ensemble.py`` starts three): its own ``zoo.cfg`` and ``myid``, short ticks
so an election takes about a second, a small heap. Every member may name the others'
quorum ports differently (a test puts a fault-injecting proxy on each link); the
election ports are always the real ones. :func:`mode` reads a member's role.
"""

from __future__ import annotations

import shutil
import socket
from collections.abc import Mapping
from pathlib import Path

from txsink.errors import ConfigError

ZOOKEEPER_JAR = Path("/usr/share/java/zookeeper.jar")
# slf4j binding + log4j so ZooKeeper's own log lands in our log4j.properties' file.
LOGGING_JARS = (Path("/usr/share/java/slf4j-log4j12.jar"), Path("/usr/share/java/log4j-1.2.jar"))
MAIN_CLASS = "org.apache.zookeeper.server.ZooKeeperServerMain"
PEER_MAIN_CLASS = "org.apache.zookeeper.server.quorum.QuorumPeerMain"
INSTALL_HINT = "run `make setup` or `apt-get install zookeeper`"
HEAP = "-Xmx256m"
PEER_HEAP = "-Xmx128m"
# Quorum timing of an ensemble member: a follower that hears nothing from its leader for
# SYNC_LIMIT ticks (2 s) gives up on it and starts an election; the session timeouts
# clients may ask for span 2 s .. 30 s.
PEER_TICK_MS = 500
PEER_INIT_LIMIT = 10
PEER_SYNC_LIMIT = 4

LOG4J = """\
log4j.rootLogger=INFO, FILE
log4j.appender.FILE=org.apache.log4j.RollingFileAppender
log4j.appender.FILE.File={log}
log4j.appender.FILE.MaxFileSize=10MB
log4j.appender.FILE.MaxBackupIndex=3
log4j.appender.FILE.layout=org.apache.log4j.PatternLayout
log4j.appender.FILE.layout.ConversionPattern=%d{{ISO8601}} %-5p [%t] %c{{1}}: %m%n
"""


def java_binary() -> str:
    """The java executable, or ConfigError naming the fix."""
    java = shutil.which("java")
    if java is None:
        raise ConfigError(
            "java not found: the embedded ZooKeeper needs Java 17 "
            f"(apt-get install openjdk-17-jre-headless), then {INSTALL_HINT}"
        )
    return java


def check_installed() -> None:
    """Raise ConfigError when java or the ZooKeeper jar is missing."""
    java_binary()
    if not ZOOKEEPER_JAR.is_file():
        raise ConfigError(f"ZooKeeper is not installed ({ZOOKEEPER_JAR} missing): {INSTALL_HINT}")


def write_config(home: Path, port: int) -> Path:
    """Write zoo.cfg and log4j.properties under ``home``; returns the zoo.cfg path."""
    data = home / "data"
    data.mkdir(parents=True, exist_ok=True)
    cfg = home / "zoo.cfg"
    cfg.write_text(
        "\n".join(
            [
                "tickTime=2000",
                "initLimit=10",
                "syncLimit=5",
                f"dataDir={data}",
                f"clientPort={port}",
                "clientPortAddress=127.0.0.1",
                "maxClientCnxns=0",
                "admin.enableServer=false",
                "4lw.commands.whitelist=srvr,ruok,stat",
                "autopurge.snapRetainCount=3",
                "autopurge.purgeInterval=1",
                # session timeouts clients may ask for: 4s .. 60s
                "minSessionTimeout=4000",
                "maxSessionTimeout=60000",
                "",
            ]
        )
    )
    (home / "log4j.properties").write_text(LOG4J.format(log=home / "zookeeper.log"))
    return cfg


def command(home: Path, port: int) -> list[str]:
    """The argv running a standalone ZooKeeper on 127.0.0.1:``port`` with state in ``home``."""
    check_installed()
    return _java(home, HEAP, MAIN_CLASS, write_config(home, port))


def _java(home: Path, heap: str, main_class: str, cfg: Path) -> list[str]:
    classpath = [str(home), str(ZOOKEEPER_JAR)] + [str(j) for j in LOGGING_JARS if j.is_file()]
    return [
        java_binary(),
        heap,
        "-XX:+UseSerialGC",
        "-Dzookeeper.log.dir=" + str(home),
        "-Dlog4j.configuration=file:" + str(home / "log4j.properties"),
        "-Dzookeeper.admin.enableServer=false",
        "-cp",
        ":".join(classpath),
        main_class,
        str(cfg),
    ]


def write_peer_config(
    home: Path, sid: int, client_port: int, peers: Mapping[int, tuple[int, int]]
) -> Path:
    """zoo.cfg, ``myid`` and log4j.properties of ensemble member ``sid`` under ``home``.

    ``peers``: sid -> (quorum port, election port) as THIS member should dial them (its
    own entry is what it listens on)."""
    if sid not in peers:
        raise ConfigError(f"ZooKeeper ensemble member {sid} is not among its peers {sorted(peers)}")
    data = home / "data"
    data.mkdir(parents=True, exist_ok=True)
    (data / "myid").write_text(f"{sid}\n")
    servers = [
        f"server.{n}=127.0.0.1:{quorum}:{election}"
        for n, (quorum, election) in sorted(peers.items())
    ]
    cfg = home / "zoo.cfg"
    cfg.write_text(
        "\n".join(
            [
                f"tickTime={PEER_TICK_MS}",
                f"initLimit={PEER_INIT_LIMIT}",
                f"syncLimit={PEER_SYNC_LIMIT}",
                f"dataDir={data}",
                f"clientPort={client_port}",
                "clientPortAddress=127.0.0.1",
                "maxClientCnxns=0",
                "admin.enableServer=false",
                "4lw.commands.whitelist=srvr,ruok,stat,cons,mntr",
                "minSessionTimeout=2000",
                "maxSessionTimeout=30000",
                "reconfigEnabled=false",
                "standaloneEnabled=false",
                # a dead peer's election port refuses at once on loopback; don't wait 5 s
                "cnxTimeout=1000",
                *servers,
                "",
            ]
        )
    )
    (home / "log4j.properties").write_text(LOG4J.format(log=home / "zookeeper.log"))
    return cfg


def peer_command(
    home: Path, sid: int, client_port: int, peers: Mapping[int, tuple[int, int]]
) -> list[str]:
    """The argv running ensemble member ``sid`` (see :func:`write_peer_config`)."""
    check_installed()
    return _java(home, PEER_HEAP, PEER_MAIN_CLASS, write_peer_config(home, sid, client_port, peers))


def four_letter(port: int, word: str, timeout: float = 1.0) -> str | None:
    """Send a four-letter word to 127.0.0.1:``port``; the reply, or None when unreachable."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
            sock.sendall(word.encode())
            chunks = []
            while chunk := sock.recv(4096):
                chunks.append(chunk)
            return b"".join(chunks).decode(errors="replace")
    except OSError:
        return None


def mode(port: int, timeout: float = 1.0) -> str | None:
    """``leader``, ``follower`` or ``standalone`` for a server on ``port`` that serves;
    None when it is down or not serving (an ensemble member without a quorum)."""
    reply = four_letter(port, "srvr", timeout) or ""
    for line in reply.splitlines():
        if line.startswith("Mode:"):
            return line.split(":", 1)[1].strip()
    return None


def ruok(port: int, timeout: float = 1.0) -> bool:
    """True when a ZooKeeper on ``port`` answers and serves requests."""
    if four_letter(port, "ruok", timeout) != "imok":
        return False
    reply = four_letter(port, "srvr", timeout) or ""
    return "Mode:" in reply
