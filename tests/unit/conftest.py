"""Unit tests see no TXSINK_* variable they did not set themselves.

``make test`` runs the integration suite first in the same process, and its stack
fixture exports ``TXSINK_URL`` / ``TXSINK_KEEPER`` for the CLI and Spark subprocesses;
a unit test of defaults must not read them."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(autouse=True)
def _no_txsink_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in os.environ if n.startswith("TXSINK_")]:
        monkeypatch.delenv(name)
