"""``make test-matrix``: the built wheel, installed into fresh venvs, on every Python and
every Spark we claim.

It builds one wheel (``python -m build --wheel``) from a copy of the repository's
sources, then runs *lanes*, each in a fresh venv:

- **Python lanes** (3.11, 3.12, 3.13): ``<wheel>[dev,connect,embedded]``; the unit tests,
  one end-to-end streaming test (a ``foreach_batch`` driver crashed after PREPARE and
  restarted) and the Spark Connect test.
- **Spark lanes** (pyspark 3.5 latest patch, 4.0 latest patch, the newest 4.x; Python
  3.11): pyspark is installed *first*, as a cluster provides it, then
  ``<wheel>[dev,embedded]``; the lane fails if installing the wheel changed pyspark's
  version. Then the unit tests, the ``foreach_batch`` crash test, the
  ``txsink.transaction`` tests and ``test_spark_versions.py`` (``format("clickhouse_tx")``
  works, or is refused naming the version). The 3.5 lane also pins every core
  dependency to its floor in pyproject.toml, so the floors are tested.

Tests run from a directory that holds no ``txsink/`` (``import txsink`` must resolve
inside the venv) and without ``PYTHONPATH``. One row per lane; exit status 1 if any
step failed (a lane whose interpreter is missing is skipped, and says so). Logs of every
step are kept under ``--work`` (default: a temporary directory, kept when a step failed
or with ``--keep``).
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
E2E_FOREACH = [
    "tests/integration/test_spark_crashes.py",
    "-k",
    "test_foreach_batch_helper_crashed_after_prepare_is_exact",
]
STEPS: dict[str, list[str]] = {
    "unit": ["tests/unit"],
    "e2e streaming": E2E_FOREACH,
    "spark connect": ["tests/integration/test_spark_connect.py"],
}
SPARK_STEPS: dict[str, list[str]] = {
    "unit": ["tests/unit"],
    "e2e foreach_batch": E2E_FOREACH,
    "e2e transaction": ["tests/integration/test_multi_table.py"],
    "format": ["tests/integration/test_spark_versions.py"],
}
# the floors of pyproject.toml's core dependencies, installed in the oldest Spark lane
FLOORS = ["clickhouse-connect==0.8.18", "kazoo==2.9.0", "tenacity==8.2.0", "pyarrow==16.1.0"]


@dataclass(frozen=True)
class Lane:
    name: str
    python: str
    extras: str
    steps: dict[str, list[str]]
    first: tuple[str, ...] = ()  # installed before the wheel: the cluster's pyspark
    pins: tuple[str, ...] = ()  # installed with the wheel (dependency floors)


def python_lane(version: str) -> Lane:
    return Lane(f"python {version}", version, "dev,connect,embedded", STEPS)


SPARK_LANES = (
    Lane("spark 3.5", "3.11", "dev,embedded", SPARK_STEPS,
         ("pyspark==3.5.9", "pandas>=2,<3"), tuple(FLOORS)),
    Lane("spark 4.0", "3.11", "dev,embedded", SPARK_STEPS, ("pyspark==4.0.5", "pandas>=2,<3")),
    Lane("spark 4.x", "3.11", "dev,embedded", SPARK_STEPS, ("pyspark>=4.1,<5", "pandas>=2,<3")),
)  # fmt: skip
INSTALL_TIMEOUT = 1800
PROBE = "import sys, ssl, venv; print('%d.%d' % sys.version_info[:2], sys.executable)"
TEST_TIMEOUT = 1200


@dataclass
class Row:
    lane: str
    interpreter: str = "-"
    pyspark: str = "-"
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


def summary_line(log: Path) -> str:
    """pytest's own summary line (log lines of background threads may come after it)."""
    pattern = re.compile(r"\b\d+ (passed|failed|errors?|skipped|deselected)\b.* in [0-9.]+s")
    lines = log.read_text(errors="replace").splitlines()
    return next((ln for ln in reversed(lines) if pattern.search(ln)), "")


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


def in_venv(venv: Path, env: dict[str, str], cwd: Path, code: str) -> tuple[int, str, str]:
    """Run a Python snippet in the venv: (exit status, stdout stripped, stderr)."""
    probe = subprocess.run(
        [str(venv / "bin" / "python"), "-c", code],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    return probe.returncode, probe.stdout.strip(), probe.stderr


def pyspark_version(venv: Path, env: dict[str, str], cwd: Path) -> str:
    code, out, _ = in_venv(venv, env, cwd, "import pyspark; print(pyspark.__version__)")
    return out if code == 0 else "none"


def run_lane(lane: Lane, wheel: Path, tree: Path, work: Path) -> Row:
    row = Row(lane.name)
    started = time.monotonic()
    tag = lane.name.replace(" ", "-")
    interpreter = find_interpreter(lane.python)
    if interpreter is None:
        print(f"[{lane.name}] skipped: no python{lane.python} on PATH or under pyenv", flush=True)
        row.cells = {step: "skipped: no interpreter" for step in ("install", *lane.steps)}
        return row
    row.interpreter = str(interpreter)
    venv = work / f"venv-{tag}"
    logs = work / "logs"
    logs.mkdir(exist_ok=True)
    if venv.exists():
        shutil.rmtree(venv)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install"]
    print(f"[{lane.name}] {interpreter}: fresh venv", flush=True)
    code, last = run_logged(
        [str(interpreter), "-m", "venv", str(venv)], logs / f"{tag}-venv.log", cwd=work, timeout=300
    )
    env = clean_env(venv)
    before = ""
    if code == 0 and lane.first:
        print(f"[{lane.name}] the cluster's Spark first: {' '.join(lane.first)}", flush=True)
        code, last = run_logged(
            [*pip, *lane.first], logs / f"{tag}-spark.log", cwd=work, timeout=INSTALL_TIMEOUT
        )
        before = pyspark_version(venv, env, work)
    if code == 0:
        print(f"[{lane.name}] installing {wheel.name}[{lane.extras}]", flush=True)
        code, last = run_logged(
            [*pip, f"{wheel}[{lane.extras}]", *lane.pins],
            logs / f"{tag}-install.log",
            cwd=work,
            timeout=INSTALL_TIMEOUT,
        )
    if code == 0 and before:
        after = pyspark_version(venv, env, work)
        row.pyspark = after
        if after != before:
            code, last = 1, f"installing the wheel changed pyspark {before} -> {after}"
    elif code == 0:
        row.pyspark = pyspark_version(venv, env, work)
    if code == 0:  # the tests must see the installed wheel, never the source tree
        status, where, err = in_venv(venv, env, tree, "import txsink; print(txsink.__file__)")
        if status != 0 or not where.startswith(str(venv)):
            code, last = 1, f"txsink imported from {where or err[-300:]!r}, not the venv"
    if code != 0:
        row.failed = True
        row.cells["install"] = f"FAIL: {last[:80]}"
        row.cells.update({step: "not run" for step in lane.steps})
        row.seconds = time.monotonic() - started
        return row
    row.cells["install"] = "ok"
    for step, args in lane.steps.items():
        print(f"[{lane.name}] {step}", flush=True)
        log = logs / f"{tag}-{step.replace(' ', '-')}.log"
        code, last = run_logged(
            [str(venv / "bin" / "python"), "-m", "pytest", *args, "-q", "-p", "no:cacheprovider"],
            log,
            cwd=tree,
            env=env,
            timeout=TEST_TIMEOUT,
        )
        summary = pytest_summary(summary_line(log) or last)
        passed = code == 0 and "passed" in summary
        row.cells[step] = ("pass: " if passed else "FAIL: ") + summary
        if not passed:
            row.failed = True
            print(f"[{lane.name}] {step} failed, log: {log}", flush=True)
    row.seconds = time.monotonic() - started
    return row


def print_table(rows: list[Row]) -> None:
    steps = list(dict.fromkeys(k for r in rows for k in r.cells if k != "install"))
    headers = ["lane", "pyspark", "install", *steps, "seconds"]
    table = [
        [r.lane, r.pyspark, r.cells.get("install", ""), *(r.cells.get(h, "-") for h in steps),
         f"{r.seconds:.0f}"]
        for r in rows
    ]  # fmt: skip
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
    parser.add_argument(
        "--versions", default=",".join(DEFAULT_VERSIONS), help="Python lanes ('' for none)"
    )
    parser.add_argument(
        "--spark",
        default=",".join(lane.name.split()[1] for lane in SPARK_LANES),
        help="Spark lanes by version: 3.5,4.0,4.x ('' for none)",
    )
    parser.add_argument("--work", type=Path, help="work directory (default: a temporary one)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    args = parser.parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="txsink-matrix-"))
    work.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    wheel = build_wheel(work)
    print(f"wheel: {wheel}", flush=True)
    tree = stage_tests(work)
    lanes = [python_lane(v.strip()) for v in args.versions.split(",") if v.strip()]
    wanted = {v.strip() for v in args.spark.split(",") if v.strip()}
    lanes += [lane for lane in SPARK_LANES if lane.name.split()[1] in wanted]
    rows = [run_lane(lane, wheel, tree, work) for lane in lanes]
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
