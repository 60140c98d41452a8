"""``make dist`` and docs/install.md's wheel recipe, end to end: the wheel and the sdist
are built from the tracked sources, the wheel installs into a fresh venv (its
dependencies from the package index), and what an executor gets is txsink and its core
dependencies, under 30 MB beyond pyarrow (issue 41: rich and pygments, the CLI's bars,
were 13 MB of it). The CLI runs there without rich."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
EXECUTOR_MB = 30  # beyond pyarrow (and the venv's own pip)
BESIDES = ("pyarrow", "pip", "_distutils_hack", "setuptools", "pkg_resources")


def run(*argv: str | Path, cwd: Path | None = None, timeout: float = 300) -> str:
    done = subprocess.run(
        [str(a) for a in argv],
        check=False,
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=timeout,
    )
    assert done.returncode == 0, f"{argv}: {done.stdout[-2000:]}{done.stderr[-3000:]}"
    return done.stdout


def megabytes(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20


def test_make_dist_builds_a_wheel_that_installs_and_runs_in_a_fresh_venv(tmp_path: Path) -> None:
    src = tmp_path / "src"
    for name in run("git", "ls-files", cwd=REPO).splitlines():
        if (REPO / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, src / name)
    if not (src / "Makefile").exists():
        pytest.fail("git ls-files listed no Makefile: not a checkout")
    dist = tmp_path / "dist"
    run(sys.executable, "-m", "build", "--wheel", "--sdist", "--outdir", dist, src)
    (wheel,) = dist.glob("txsink-*.whl")
    (sdist,) = dist.glob("txsink-*.tar.gz")
    names = zipfile.ZipFile(wheel).namelist()
    assert "txsink/py.typed" in names and "txsink/writer_options.py" in names
    assert not [n for n in names if n.startswith(("tests/", "benchmarks/"))]
    assert sdist.stat().st_size > 0

    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", venv)
    py = venv / "bin" / "python"
    run(py, "-m", "pip", "install", "-q", "--disable-pip-version-check", wheel, timeout=600)
    site = Path(run(py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").strip())
    extra = sum(megabytes(p) for p in site.iterdir() if not p.name.startswith(BESIDES))
    assert extra < EXECUTOR_MB, f"{extra:.1f} MB beyond pyarrow"
    assert not (site / "rich").exists() and not (site / "pygments").exists()

    out = tmp_path / "run"  # no txsink/ here: the import must come from the venv
    out.mkdir()
    where = run(py, "-c", "import txsink, txsink.spark.writer; print(txsink.__file__)", cwd=out)
    assert where.startswith(str(site))
    assert run(venv / "bin" / "txsink", "--version", cwd=out).startswith("txsink ")
    assert "common flags" in run(venv / "bin" / "txsink", "status", "--help", cwd=out)
