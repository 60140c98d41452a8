"""The txsink package has no import cycle: dependencies point one way (docs/architecture.md).

Every import statement counts, also those inside functions (a lazy import that closes a
cycle only hides it until the first call); imports under ``if TYPE_CHECKING:`` do not
(they never run).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import txsink

ROOT = Path(txsink.__file__).parent


def module_names() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _type_checking_only(tree: ast.AST) -> set[int]:
    """ids of the import nodes under ``if TYPE_CHECKING:``."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return skip


def import_graph() -> dict[str, set[str]]:
    """module -> the txsink modules it imports (a package import counts as its __init__)."""
    modules = module_names()

    def owner(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        skip = _type_checking_only(tree)
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, base] if base else up)
                # `from pkg import mod` imports the submodule; `from mod import name` the module
                names = [
                    f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                    for a in node.names
                ]
            for name in names:
                target = owner(name) if name.startswith("txsink") else None
                if target and target != module:
                    graph[module].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_package_has_no_import_cycle() -> None:
    graph = import_graph()
    assert len(graph) > 40 and graph["txsink.committer"] >= {"txsink.driver"}
    assert cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle_hidden_behind_a_third_module() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]


def test_the_spark_layer_and_the_protocol_stay_apart() -> None:
    """The protocol imports nothing of txsink outside itself but the error root (pure:
    the codec refuses a node with a ``TxSinkError``); the committer no Spark."""
    graph = import_graph()
    for module, targets in graph.items():
        if module.startswith("txsink.protocol"):
            outside = {t for t in targets if not t.startswith("txsink.protocol")}
            assert outside <= {"txsink.errors"}, (module, targets)
    assert not any(t.startswith("txsink.spark") for t in graph["txsink.committer"])


def test_executor_writers_do_not_import_the_driver_side_runner() -> None:
    """A task's writer reads the job's state through the ports (``txsink.dedup_state``
    for dedup's fence and discard mark), never through the driver's Transactor."""
    graph = import_graph()
    for writer in ("txsink.spark.attach_write", "txsink.spark.dedup_write"):
        runner = {"txsink.transactor", "txsink.publisher", "txsink.commit_runner"}
        assert not graph[writer] & runner, writer
    assert "txsink.dedup_state" in graph["txsink.commit_runner"]  # the runner reads the mark


LEAN = """
import sys

class Missing:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("chdb", "pyspark", "pandas"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, Missing())
import txsink, txsink.driver, txsink.committer, txsink.transactor, txsink.ops.recovery
from txsink.cli.main import main
assert main(["status", "--help"]) == 0
"""


def test_a_lean_install_imports_and_its_cli_runs_without_chdb_pyspark_or_pandas() -> None:
    """An operator's box or an executor image without the extras (docs/install.md)."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", LEAN], capture_output=True, text=True, check=False, timeout=60
    )
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_embedded_stack_without_chdb_names_the_extra_to_install(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import importlib.util

    from txsink.embedded import stack
    from txsink.errors import ConfigError

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "chdb" else real(name, *a)
    )
    with pytest.raises(ConfigError, match=r"pip install 'txsink\[embedded\]'"):
        stack.up(tmp_path)
