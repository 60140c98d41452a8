"""``make test-matrix``: the built wheel, installed into fresh venvs, on every Python we claim.

For each Python version (default 3.11, 3.12, 3.13) this builds nothing from the source
tree at test time: it

1. builds one wheel (``python -m build --wheel``) from a copy of the repository's sources,
2. creates a fresh venv with that version's interpreter (``pythonX.Y`` on PATH, else
   ``$PYENV_ROOT/versions/X.Y.*``; a missing version is skipped with a message),
3. installs ``<wheel>[dev,connect]`` into it,
4. copies ``tests/`` (with ``docs/`` and ``pyproject.toml``, which tests and pytest's
   configuration read) into a directory that holds no ``txsink/``, checks that ``import
   txsink`` resolves inside the venv, and runs there, without ``PYTHONPATH``:
   the unit tests, one end-to-end streaming test (a ``foreach_batch`` driver crashed
   after PREPARE and restarted, from ``test_spark_crashes.py``) and the Spark Connect test,

then prints one row per version. Exit status 1 if any step failed (skips are not failures).
Logs of every step are kept under ``--work`` (default: a temporary directory, kept when a
step failed or with ``--keep``).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_VERSIONS = ("3.11", "3.12", "3.13")
STEPS: dict[str, list[str]] = {
    "unit": ["tests/unit"],
    "e2e streaming": [
        "tests/integration/test_spark_crashes.py",
        "-k",
        "test_foreach_batch_helper_crashed_after_prepare_is_exact",
    ],
    "spark connect": ["tests/integration/test_spark_connect.py"],
}
INSTALL_TIMEOUT = 1800
PROBE = "import sys, ssl, venv; print('%d.%d' % sys.version_info[:2], sys.executable)"
TEST_TIMEOUT = 1200


@dataclass
class Row:
    version: str
    interpreter: str = "-"
    cells: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0
    failed: bool = False


def find_interpreter(version: str) -> Path | None:
    """An interpreter of ``version`` that really runs (pyenv shims of inactive versions
    exist on PATH but exit with an error)."""
    candidates: list[Path] = []
    on_path = shutil.which(f"python{version}")
    if on_path:
        candidates.append(Path(on_path))
    pyenv_root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"))
    found = sorted(
        (pyenv_root / "versions").glob(f"{version}.*/bin/python{version}"),
        key=lambda p: [int(x) for x in re.findall(r"\d+", p.parents[1].name)],
        reverse=True,
    )
    candidates.extend(found)
    want = ".".join(version.split(".")[:2])
    for candidate in candidates:
        probe = subprocess.run(
            [str(candidate), "-c", PROBE],
            capture_output=True,
            text=True,
            check=False,
        )
        got, _, executable = probe.stdout.strip().partition(" ")
        if probe.returncode == 0 and got == want:
            return Path(executable)  # the real interpreter, not a pyenv shim
    return None


def clean_env(venv: Path) -> dict[str, str]:
    """The environment of the tests: the venv first, no source tree, no leftover txsink
    variables from the caller."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV") and not k.startswith("TXSINK_")
    }
    python = str(venv / "bin" / "python")
    env.update(
        VIRTUAL_ENV=str(venv),
        PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}",
        PYSPARK_PYTHON=python,
        PYSPARK_DRIVER_PYTHON=python,
    )
    return env


def run_logged(
    cmd: list[str], log: Path, *, cwd: Path, env: dict[str, str] | None = None, timeout: int
) -> tuple[int, str]:
    """Run ``cmd`` with its output in ``log``; (exit status, last output line)."""
    with log.open("w") as out:
        out.write(f"$ {' '.join(cmd)}\n")
        out.flush()
        try:
            code = subprocess.run(
                cmd,
                cwd=cwd,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                timeout=timeout,
                check=False,
            ).returncode
        except subprocess.TimeoutExpired:
            code = -1
    lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    last = lines[-1] if lines else ""
    if code == -1:
        last = f"timed out after {timeout} s"
    return code, last


def pytest_summary(last_line: str) -> str:
    """'12 passed, 1 skipped in 3.2s' out of pytest's last line."""
    match = re.search(r"=*\s*(.*?)\s*=*$", last_line)
    return match.group(1) if match else last_line


def build_wheel(work: Path) -> Path:
    """Build from a copy of the sources, so the work tree gets no build/ or egg-info."""
    src, dist = work / "src", work / "dist"
    if src.exists():
        shutil.rmtree(src)
    src.mkdir()
    shutil.copytree(REPO / "txsink", src / "txsink", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    code, last = run_logged(
        [sys.executable, "-m", "build", "--wheel", "--outdir", str(dist), str(src)],
        work / "build.log",
        cwd=src,
        timeout=INSTALL_TIMEOUT,
    )
    wheels = sorted(dist.glob("txsink-*.whl"))
    if code != 0 or not wheels:
        sys.exit(f"wheel build failed ({last}); log: {work / 'build.log'}")
    return wheels[-1]


def stage_tests(work: Path) -> Path:
    """A directory with tests/, docs/ and pyproject.toml, and no txsink/ package."""
    tree = work / "tests-copy"
    if tree.exists():
        shutil.rmtree(tree)
    tree.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", ".pytest_cache")
    shutil.copytree(REPO / "tests", tree / "tests", ignore=ignore)
    shutil.copytree(REPO / "docs", tree / "docs", ignore=ignore)
    shutil.copy2(REPO / "pyproject.toml", tree / "pyproject.toml")
    return tree


def run_version(version: str, wheel: Path, tree: Path, work: Path) -> Row:
    row = Row(version)
    started = time.monotonic()
    interpreter = find_interpreter(version)
    if interpreter is None:
        print(f"[{version}] skipped: no python{version} on PATH or under pyenv", flush=True)
        row.cells = {step: "skipped: no interpreter" for step in ("install", *STEPS)}
        return row
    row.interpreter = str(interpreter)
    venv = work / f"venv-{version}"
    logs = work / "logs"
    logs.mkdir(exist_ok=True)
    if venv.exists():
        shutil.rmtree(venv)
    print(
        f"[{version}] {interpreter}: fresh venv, installing {wheel.name}[dev,connect]", flush=True
    )
    code, last = run_logged(
        [str(interpreter), "-m", "venv", str(venv)],
        logs / f"{version}-venv.log",
        cwd=work,
        timeout=300,
    )
    if code == 0:
        code, last = run_logged(
            [str(venv / "bin" / "python"), "-m", "pip", "install", f"{wheel}[dev,connect]"],
            logs / f"{version}-install.log",
            cwd=work,
            timeout=INSTALL_TIMEOUT,
        )
    env = clean_env(venv)
    if code == 0:  # the tests must see the installed wheel, never the source tree
        probe = subprocess.run(
            [str(venv / "bin" / "python"), "-c", "import txsink; print(txsink.__file__)"],
            cwd=tree,
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
        where = probe.stdout.strip()
        if probe.returncode != 0 or not where.startswith(str(venv)):
            code, last = 1, f"txsink imported from {where or probe.stderr[-300:]!r}, not the venv"
    if code != 0:
        row.failed = True
        row.cells["install"] = f"FAIL: {last[:80]}"
        row.cells.update({step: "not run" for step in STEPS})
        row.seconds = time.monotonic() - started
        return row
    row.cells["install"] = "ok"
    for step, args in STEPS.items():
        print(f"[{version}] {step}", flush=True)
        log = logs / f"{version}-{step.replace(' ', '-')}.log"
        code, last = run_logged(
            [str(venv / "bin" / "python"), "-m", "pytest", *args, "-q", "-p", "no:cacheprovider"],
            log,
            cwd=tree,
            env=env,
            timeout=TEST_TIMEOUT,
        )
        summary = pytest_summary(last)
        passed = code == 0 and "passed" in summary
        row.cells[step] = ("pass: " if passed else "FAIL: ") + summary
        if not passed:
            row.failed = True
            print(f"[{version}] {step} failed, log: {log}", flush=True)
    row.seconds = time.monotonic() - started
    return row


def print_table(rows: list[Row]) -> None:
    headers = ["python", "interpreter", "install", *STEPS, "seconds"]
    table = [
        [r.version, r.interpreter, *(r.cells.get(h, "") for h in headers[2:-1]), f"{r.seconds:.0f}"]
        for r in rows
    ]
    widths = [max(len(h), *(len(t[i]) for t in table)) for i, h in enumerate(headers)]
    line = "| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)) + " |"
    print(line)
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for t in table:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(t, widths, strict=True)) + " |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="scripts/test_matrix.py", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--versions", default=",".join(DEFAULT_VERSIONS))
    parser.add_argument("--work", type=Path, help="work directory (default: a temporary one)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    args = parser.parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="txsink-matrix-"))
    work.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    wheel = build_wheel(work)
    print(f"wheel: {wheel}", flush=True)
    tree = stage_tests(work)
    rows = [run_version(v.strip(), wheel, tree, work) for v in args.versions.split(",") if v]
    print()
    print_table(rows)
    failed = any(r.failed for r in rows)
    print(f"\ntotal {time.monotonic() - started:.0f} s; logs in {work / 'logs'}")
    if not (failed or args.keep or args.work):
        shutil.rmtree(work, ignore_errors=True)
        print("(work directory removed; --keep keeps it)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
