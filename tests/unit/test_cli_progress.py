"""The CLI's progress bar without rich (the ``cli`` extra): executors never draw one, so
rich is not a core dependency, and a CLI installed without it still shows progress."""

from __future__ import annotations

import io
import sys

import pytest

from txsink.cli.output import Output


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("rich", [True, False])
def test_a_bar_on_a_terminal_draws_with_or_without_rich(
    rich: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    err = Tty()
    monkeypatch.setattr(sys, "stderr", err)
    if not rich:
        monkeypatch.setitem(sys.modules, "rich.console", None)  # import fails
    with Output(json_mode=False, command="verify").bar(3, "jobs") as advance:
        for job in ("a", "b", "c"):
            advance(job)
    text = err.getvalue()
    if not rich:
        assert "jobs: 1/3 a" in text and "jobs: 3/3 c" in text
        assert text.endswith("\r\x1b[K")  # the line is cleared at the end


def test_no_bar_on_a_pipe_or_in_json_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    for json_mode in (False, True):
        with Output(json_mode=json_mode, command="verify").bar(3, "jobs") as advance:
            advance("a")
    assert err.getvalue() == ""
