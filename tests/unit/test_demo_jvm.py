"""The job JVM's start-up options (txsink.demo.jvm): never a JVM that cannot start."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from txsink.demo import jvm


@pytest.mark.parametrize(
    ("text", "major"),
    [
        ('openjdk version "17.0.15" 2025-04-15', 17),
        ('java version "1.8.0_292"', 8),
        ('openjdk version "21" 2023-09-19', 21),
        ("no version here", 0),
    ],
)
def test_the_java_major_version_is_read_from_both_numbering_schemes(
    monkeypatch: pytest.MonkeyPatch, text: str, major: int
) -> None:
    class Done:
        stdout, stderr = "", text

    monkeypatch.setattr(jvm.subprocess, "run", lambda *a, **k: Done())
    assert jvm._java_version("java")[0] == major


def test_a_damaged_archive_is_never_handed_to_a_job(tmp_path: Path) -> None:
    java = jvm._java()
    if java is None:
        pytest.skip("no java: the probe needs a JVM")
    whole = tmp_path / "whole.jsa"
    jvm.subprocess.run([java, f"-XX:ArchiveClassesAtExit={whole}", "-version"], check=True)
    assert jvm._loads(java, whole)
    damaged = tmp_path / "damaged.jsa"  # what a disk filling up mid-write leaves
    damaged.write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])
    assert not jvm._loads(java, damaged)


def test_options_the_caller_chose_are_kept(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(jvm.JAVA_OPTIONS_ENV, "-Xmx1g")
    assert "kept" in jvm.enable(tmp_path)
    assert os.environ[jvm.JAVA_OPTIONS_ENV] == "-Xmx1g"
    assert list(tmp_path.iterdir()) == []  # nothing was made
