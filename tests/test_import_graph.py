"""The import graph of the three packages: no cycle between files, imports only go
rollout -> weight_sync -> inference. Every import counts, also those inside functions or under
`if TYPE_CHECKING:`."""

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


def test_no_cycles_and_imports_follow_the_layers():
    graph = import_graph(ROOT)
    assert len(graph) > 30 and "inference.engine" in graph
    assert layering_violations(graph) == []
    assert cycles(graph) == []


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
