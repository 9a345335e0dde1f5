"""The package's structure: the layer order of docs/architecture.md holds, there is no
import circle, and importing registers or starts nothing (``rt.init()`` wires the layers)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

SRC = Path(__file__).resolve().parents[3] / "src" / "ringtrain"

# docs/architecture.md's layers, top to bottom: a module may import its own layer, the layers
# above it, and the leaves; never a layer below it.
LAYERS = ["launch", "runtime", "collectives", "sync", "optimizer", "data", "observe",
          "checkpoint", "parallel", "elastic", "facades"]
_LAYER_OF = {
    "launch": "launch", "runtime": "runtime", "collectives": "collectives", "agreement": "collectives",
    "sync": "sync", "optimizer": "optimizer", "fusion": "optimizer", "lowcomm": "optimizer",
    "replicate": "optimizer", "schedule": "optimizer", "data": "data", "observe": "observe",
    "checkpoint": "checkpoint", "elastic": "elastic",
    "parallel": "parallel",
    "horovod": "facades", "keras": "facades",
}
# Imported by anything: they import no other layer.
LEAVES = {"errors", "settings", "env", "events", "sockets", "compression", "pipeline_bubble", "signing", "inflight",
          "argparsing", "cpus", "addresses", "assignment", "sever", "peer_failure", "processes", "claims"}
# Not layers: the composition root (sets the hooks) and the tools built on everything.
TOOLS = {"wiring", "cli", "plan", "__init__"}


def _module_name(path: Path) -> str:
    rel = path.relative_to(SRC.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    """Every ringtrain module this file imports (also inside functions), outside
    ``if TYPE_CHECKING:`` blocks."""
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("ringtrain"))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            if base.startswith("ringtrain"):
                found.add(base)
                found.update(f"{base}.{a.name}" for a in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in SRC.rglob("*.py")}
    return {name: {m for m in _imports(path) if m in files and m != name} for name, path in files.items()}


def _top(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_no_module_imports_a_layer_below_its_own() -> None:
    wrong = []
    for module, deps in _graph().items():
        top = _top(module)
        if top in TOOLS:
            continue
        assert top in LEAVES or top in _LAYER_OF, f"{module}: put it in a layer in this test"
        for dep in deps:
            dtop = _top(dep)
            if dtop in LEAVES or dtop == "__init__" or (
                    dtop == "wiring" and _LAYER_OF.get(top) in ("elastic", "facades")):
                # (rt.elastic.run and a facade's init() are rt.init(): entry points above
                # the layers they wire may use the composition root)
                continue
            if top in LEAVES:
                wrong.append(f"leaf {module} imports {dep}")
            elif dtop in TOOLS:
                wrong.append(f"{module} imports the tool {dep}")
            elif LAYERS.index(_LAYER_OF[dtop]) > LAYERS.index(_LAYER_OF[top]):
                wrong.append(f"{module} ({_LAYER_OF[top]}) imports {dep} ({_LAYER_OF[dtop]}), a layer below")
    assert wrong == []


def test_no_import_circle() -> None:
    graph = _graph()
    # A package's __init__ re-exporting its own modules is not a circle of concerns.
    for name in graph:
        graph[name] = {d for d in graph[name] if not (name + ".").startswith(d + ".")}
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def walk(node: str, stack: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                cycles.append(stack[stack.index(dep):] + [dep] if dep in stack else [node, dep])
            elif dep not in state:
                walk(dep, stack + [dep])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            walk(name, [name])
    assert cycles == []


# Tools that start jobs (they may use the launcher); everything else runs in a worker.
_JOB_STARTERS = {"ringtrain.cli", "ringtrain.observe.doctor"}


def test_no_worker_side_module_imports_the_launcher() -> None:
    """The world, the collectives, the optimizer, sync/, data/, checkpoints, the worker
    side of elastic, the facades: what a worker and ringrun share are leaves
    (addresses, assignment, sever, sockets, cpus, processes), never ringtrain.launch."""
    wrong = [f"{module} imports {dep}" for module, deps in _graph().items()
             if _top(module) not in ("launch", "plan") and module not in _JOB_STARTERS
             for dep in deps if dep == "ringtrain.launch" or dep.startswith("ringtrain.launch.")]
    assert wrong == []


def test_the_world_is_held_by_one_object() -> None:
    """runtime/ keeps the process's world in Membership, not in module globals."""
    for path in (SRC / "runtime").glob("*.py"):
        globals_ = [n.lineno for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Global)]
        assert globals_ == [], f"{path.name}: 'global' statements at lines {globals_}"


def test_no_two_classes_share_a_name() -> None:
    """A name says which class it is (there were two Host, two Slot, two Handle)."""
    where: dict[str, list[str]] = {}
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                where.setdefault(node.name, []).append(_module_name(path))
    assert {name: mods for name, mods in where.items() if len(mods) > 1} == {}


def _script_graph(folders: list[Path]) -> dict[Path, set[Path]]:
    """Imports between the scripts of ``folders`` (benchmarks, tests, examples): by file
    name within a folder, by dotted path below tests/."""
    tests = SRC.parents[1] / "tests"
    files = [p for folder in folders for p in folder.rglob("*.py")]
    by_name: dict[str, list[Path]] = {}
    for p in files:
        by_name.setdefault(p.stem, []).append(p)
        if tests in p.parents:
            by_name.setdefault(".".join(p.relative_to(tests).with_suffix("").parts), []).append(p)
    graph: dict[Path, set[Path]] = {}
    for p in files:
        names: set[str] = set()
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.add(node.module)
                names.update(f"{node.module}.{a.name}" for a in node.names)
        graph[p] = {q for name in names for q in by_name.get(name, [])
                    if q != p and (q.parent == p.parent or "." in name)}
    return graph


def _cycles(graph: dict[Any, set[Any]]) -> list[list[Any]]:
    state: dict[Any, int] = {}
    cycles: list[list[Any]] = []

    def walk(node: Any, stack: list[Any]) -> None:
        state[node] = 1
        for dep in sorted(graph[node], key=str):
            if state.get(dep) == 1:
                cycles.append(stack[stack.index(dep):] + [dep] if dep in stack else [node, dep])
            elif dep not in state:
                walk(dep, stack + [dep])
        state[node] = 2

    for name in sorted(graph, key=str):
        if name not in state:
            walk(name, [name])
    return cycles


def test_no_import_circle_among_benchmarks_tests_and_examples() -> None:
    root = SRC.parents[1]
    assert _cycles(_script_graph([root / "benchmarks", root / "tests", root / "examples"])) == []


def test_each_strategy_name_is_declared_once() -> None:
    declared = {}
    for path in (SRC / "sync").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if (isinstance(item, ast.Assign) and [ast.unparse(t) for t in item.targets] == ["name"]
                            and isinstance(item.value, ast.Constant) and item.value.value):
                        assert item.value.value not in declared, f"{item.value.value} declared twice"
                        declared[item.value.value] = node.name
    assert declared == {"native": "Native", "ring": "Ring", "ps": "ParameterServer"}
    literals = [p for p in SRC.rglob("*.py")
                if any(f'"{name}": ' in p.read_text() for name in ("ring", "ps"))]
    assert literals == [], f"strategy names listed outside the table: {literals}"


def test_exports_and_type_checking_imports_agree() -> None:
    import ringtrain

    tree = ast.parse((SRC / "__init__.py").read_text())
    typed: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for stmt in node.body:
                assert isinstance(stmt, ast.ImportFrom)
                for alias in stmt.names:
                    typed[alias.name] = (f"{stmt.module}.{alias.name}" if stmt.module != "ringtrain"
                                         else f"ringtrain.{alias.name}")
    exported = {name: f"{mod}.{attr}" if attr else mod for name, (mod, attr) in ringtrain._EXPORTS.items()}
    assert typed == exported


def _fresh(code: str, **env: str) -> str:
    import os

    full = {k: v for k, v in os.environ.items() if not k.startswith(("RINGTRAIN_", "RANK", "WORLD_SIZE"))}
    full.update(env)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=full)
    assert res.returncode == 0, res.stderr
    return res.stdout.strip()


_STEP = """
import torch, ringtrain as rt
from ringtrain import events
print(events.active(), end=' ')
rt.data, rt.DistributedOptimizer, rt.observe, rt.sync  # touching the API starts nothing
print(events.active(), end=' ')
rt.init()
print(events.active(), end=' ')
m = torch.nn.Linear(2, 1)
opt = rt.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), named_parameters=m.named_parameters())
m(torch.ones(1, 2)).sum().backward(); opt.step()
print(events.active(), rt.observe.current() is not None)
rt.shutdown()
"""


@pytest.mark.timeout(120)
def test_import_starts_nothing_and_init_starts_observation_by_default() -> None:
    assert _fresh(_STEP, RINGTRAIN_PROGRESS="0") == "False False True True True"


@pytest.mark.timeout(120)
def test_the_observe_setting_turns_the_event_bus_off() -> None:
    assert _fresh(_STEP, RINGTRAIN_OBSERVE="0") == "False False False False False"
