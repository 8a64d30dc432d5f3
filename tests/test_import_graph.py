"""The import graph of the three packages: no cycle between files, none between folders, imports
only go rollout -> weight_sync -> inference. Every import counts, also those inside functions or
under `if TYPE_CHECKING:`."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ("inference", "weight_sync", "rollout")  # a package may import only those before it


def module_files(root: Path) -> dict[str, Path]:
    files = {}
    for package in LAYERS:
        for path in (root / package).rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            files[name] = path
    return files


def imported_names(module: str, path: Path) -> set[str]:
    """Every module name an import statement in `path` may refer to (relative ones resolved)."""
    is_package = path.name == "__init__.py"
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base if is_package else base[:-1]
                base = base[: len(base) - node.level + 1]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            names.add(prefix)
            names.update(f"{prefix}.{alias.name}" for alias in node.names)  # `from pkg import module`
    return names


def import_graph(root: Path) -> dict[str, set[str]]:
    files = module_files(root)
    graph = {}
    for module, path in files.items():
        targets = set()
        for name in imported_names(module, path):
            while name and name not in files:  # `pkg.module.attr` -> `pkg.module`
                name = name.rpartition(".")[0]
            if name and name != module:
                targets.add(name)
        graph[module] = targets
    return graph


def layering_violations(graph: dict[str, set[str]]) -> list[str]:
    rank = {package: i for i, package in enumerate(LAYERS)}
    return sorted(f"{a} imports {b}" for a, targets in graph.items() for b in targets
                  if rank[b.split(".")[0]] > rank[a.split(".")[0]])


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Cycles between files. A package's `__init__` re-exporting its own submodules is not an
    edge of a cycle (Python loads the submodule first), so those edges are left out."""

    def edges(a: str) -> set[str]:
        return {b for b in graph[a] if not b.startswith(a + ".")}

    found, state, stack = [], {}, []

    def visit(node: str) -> None:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(edges(node)):
            if state.get(nxt) == "open":
                found.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return found


def package_names(root: Path, graph: dict[str, set[str]]) -> set[str]:
    """The modules of `graph` that are packages (a folder with an `__init__.py`)."""
    return {name for name in graph if (root / name.replace(".", "/") / "__init__.py").is_file()}


def _node_in(prefix: str, module: str, packages: set[str]) -> str:
    """The node standing for `module` inside the package named by `prefix`: itself or its subfolder."""
    child = prefix + module[len(prefix):].split(".")[0]
    return f"{child}/" if child in packages else child


def folder_cycles(graph: dict[str, set[str]], packages: set[str]) -> list[tuple[str, list[str]]]:
    """Cycles between folders, as (package, cycle), looked for inside every package at every depth
    (and between the top-level packages).

    Inside a package P the nodes are P's own modules, one node each, and P's subpackages, each
    folded into one node (`name/`) with everything below it, its `__init__` included; an import
    between two modules of P's tree is an edge between their nodes. So a subfolder may import a
    module of its parent and the parent's other modules may import the subfolder, as long as no
    loop closes: `engine.py -> core/ -> config.py` is fine, `core/ -> engine.py -> core/` is a
    loop, and so is `a/ -> b/ -> a/` with no cycle between their files. A folder loop whose path
    leaves P's tree shows up in the package where its ends are different nodes. Imports of P's own
    `__init__` from inside P (`from inference import native`) are left out: they name the package
    to reach a module in it."""
    found = []
    for scope in sorted(packages | {""}):
        prefix = f"{scope}." if scope else ""
        folded: dict[str, set[str]] = {}
        for a, targets in graph.items():
            if not a.startswith(prefix):
                continue
            for b in targets:
                na, nb = _node_in(prefix, a, packages), _node_in(prefix, b, packages)
                if b.startswith(prefix) and na != nb:
                    folded.setdefault(na, set()).add(nb)
                    folded.setdefault(nb, set())
        found += [(scope, cycle) for cycle in cycles(folded)]
    return found


def test_no_cycles_and_imports_follow_the_layers():
    graph = import_graph(ROOT)
    assert len(graph) > 30 and "inference.engine" in graph
    assert layering_violations(graph) == []
    assert cycles(graph) == []
    packages = package_names(ROOT, graph)
    assert {"inference.models.moe", "inference.sampling", "rollout"} <= packages
    assert folder_cycles(graph, packages) == []


def test_the_checker_catches_a_cycle_and_an_upward_import(tmp_path):
    for package in LAYERS:
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "inference" / "a.py").write_text("def f():\n    from inference import b\n")
    (tmp_path / "inference" / "b.py").write_text("from typing import TYPE_CHECKING\n"
                                                 "if TYPE_CHECKING:\n    from .a import f\n")
    (tmp_path / "weight_sync" / "w.py").write_text("import rollout.r\n")
    (tmp_path / "rollout" / "r.py").write_text("from inference.a import f\n")
    graph = import_graph(tmp_path)
    assert layering_violations(graph) == ["weight_sync.w imports rollout.r"]
    assert cycles(graph) == [["inference.a", "inference.b", "inference.a"]]


def test_the_checker_catches_folder_loops_without_file_cycles(tmp_path):
    files = {
        # allowed: a parent's module above a subfolder and another below it, at two depths
        "engine.py": "from inference.core.c import step\n",
        "core/c.py": "from inference.config import Config\n",
        "config.py": "Config = object\n",
        "models/loading.py": "from inference.models.moe.k import load\n",
        "models/layers.py": "def norm(): ...\n",
        "models/moe/k.py": "from inference.models.layers import norm\n",
        # planted: two sibling folders inside models/ importing each other (different files)
        "models/dense/u.py": "from inference.models.par.v import f\n",
        "models/par/v.py": "def f(): ...\n",
        "models/par/w.py": "def g():\n    from inference.models.dense import z\n",
        "models/dense/z.py": "",
        # planted: m/ -> top.py -> n/ -> m/, again without a cycle between files
        "m/p.py": "import inference.top\n",
        "top.py": "from inference.n.q import h\n",
        "n/q.py": "def h(): ...\n",
        "n/r.py": "from inference.m.s import i\n",
        "m/s.py": "def i(): ...\n",
    }
    for package in LAYERS:
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    for name, text in files.items():
        path = tmp_path / "inference" / name
        for folder in path.relative_to(tmp_path).parents[:-2]:
            (tmp_path / folder).mkdir(exist_ok=True)
            (tmp_path / folder / "__init__.py").touch()
        path.write_text(text)
    graph = import_graph(tmp_path)
    assert cycles(graph) == [] and layering_violations(graph) == []
    assert folder_cycles(graph, package_names(tmp_path, graph)) == [
        ("inference", ["inference.m/", "inference.top", "inference.n/", "inference.m/"]),
        ("inference.models", ["inference.models.dense/", "inference.models.par/", "inference.models.dense/"]),
    ]
