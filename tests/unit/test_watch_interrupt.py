"""Ctrl-C ends `txsink status --watch` even when a library on the way swallows the
KeyboardInterrupt (a retry loop that catches BaseException and goes on): the SIGINT
also arms a timer that ends the process (seen in CI once: a watch still running 30 s
after its Ctrl-C, its Keeper client closing under it)."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from txsink.cli import ops_cmd


def test_a_swallowed_interrupt_still_ends_the_watch(monkeypatch: pytest.MonkeyPatch) -> None:
    left = threading.Event()
    monkeypatch.setattr(ops_cmd, "WATCH_CLOSE_S", 0.0)
    monkeypatch.setattr(ops_cmd, "_leave", lambda out: left.set())
    before = signal.getsignal(signal.SIGINT)
    try:
        ops_cmd._leave_after_interrupt(out=None)  # type: ignore[arg-type]
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)  # the handler raises here
        except KeyboardInterrupt:
            pass  # swallowed, as a library might: the watch would go on
        assert left.wait(5), "the interrupt armed no exit"
        assert signal.getsignal(signal.SIGINT) is before  # a second Ctrl-C: the default's
    finally:
        signal.signal(signal.SIGINT, before)
