"""Run ``make test``'s tests as two pytest processes at once: the ones that start Spark
(marker ``spark``: local sessions, job processes, the cluster, the nemesis) and all the
others. The Spark half waits on JVMs and on faults most of the time, so the other half
fills the second core; the wall time is about the Spark half's.

    python scripts/pytest_pair.py [pytest arguments for both halves...]

Each half's lines are printed as they come, prefixed with its name; the exit status is
the first non-zero one of the two (0 when both passed). Ctrl-C stops both.
"""

from __future__ import annotations

import subprocess
import sys
import threading

HALVES = {
    "spark": "not slow and spark",
    "other": "not slow and not spark",
}


def main(argv: list[str]) -> int:
    procs: dict[str, subprocess.Popen[bytes]] = {}
    threads = []
    for name, marks in HALVES.items():
        cmd = [sys.executable, "-m", "pytest", "tests", "-q", "-p", "no:cacheprovider",
               "-m", marks, *argv]  # fmt: skip
        procs[name] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        threads.append(threading.Thread(target=relay, args=(name, procs[name]), daemon=True))
    for t in threads:
        t.start()
    try:
        codes = {name: p.wait() for name, p in procs.items()}
    except KeyboardInterrupt:
        for p in procs.values():
            p.terminate()
        return 130
    for t in threads:
        t.join()
    for name, code in codes.items():
        print(f"[{name}] pytest exited {code}", flush=True)
    return next((c for c in codes.values() if c), 0)


def relay(name: str, proc: subprocess.Popen[bytes]) -> None:
    assert proc.stdout is not None
    for raw in proc.stdout:
        sys.stdout.write(f"[{name}] {raw.decode(errors='replace')}")
        sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
