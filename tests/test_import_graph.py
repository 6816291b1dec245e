"""The import graph: `server` -> `handlers` -> `engine` -> `kernels`, no cycles inside a package.

Every module's imports are read with `ast` (nothing is imported). For the direction, module-level,
function-level (lazy) and `TYPE_CHECKING` imports all count; for cycles, every import that can
run (module-level and function-level), not those made only for type checking.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# A package may import the packages after it in this list, never those before it.
LAYERS = ("server", "handlers", "engine", "kernels")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for layer in LAYERS for p in sorted((ROOT / layer).rglob("*.py"))}


def resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The project module `name` refers to (itself, or the package it lies in), or None."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(tree: ast.AST, type_checking: bool = False):
    """(node, inside `if TYPE_CHECKING:`) for every import statement, at any depth."""
    for child in ast.iter_child_nodes(tree):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child, type_checking
        elif isinstance(child, ast.If) and _is_type_checking(child):
            for stmt in child.body:
                yield from _import_nodes(ast.Module(body=[stmt], type_ignores=[]), True)
            for stmt in child.orelse:
                yield from _import_nodes(ast.Module(body=[stmt], type_ignores=[]), type_checking)
        else:
            yield from _import_nodes(child, type_checking)


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> dict[str, bool]:
    """Project modules imported anywhere in the module (`from pkg import sub` names the
    submodule), each mapped to True when it is imported only for type checking."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: dict[str, bool] = {}
    for node, type_only in _import_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
        for target in targets:
            resolved = resolve(target, modules)
            if resolved is not None and resolved != name:
                found[resolved] = found.get(resolved, True) and type_only
    return found


def import_graph(runtime_only: bool = False) -> dict[str, set[str]]:
    """module -> the project modules it imports; `runtime_only` leaves out imports made only
    under `if TYPE_CHECKING:` (they never run, so they cannot make an import cycle)."""
    modules = all_modules()
    graph = {}
    for name, path in modules.items():
        deps = imports_of(name, path, modules)
        graph[name] = {dep for dep, type_only in deps.items() if not (runtime_only and type_only)}
    return graph


def layer_of(module: str) -> int:
    return LAYERS.index(module.split(".")[0])


def find_cycle(graph: dict[str, set[str]], nodes: set[str]) -> list[str] | None:
    """One cycle among `nodes` (edges leaving `nodes` ignored), as a list of modules, or None."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph[node] & nodes):
            if state.get(dep) == 1:
                return stack[stack.index(dep):] + [dep]
            if dep not in state and (cycle := visit(dep)) is not None:
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(nodes):
        if node not in state and (cycle := visit(node)) is not None:
            return cycle
    return None


def test_the_graph_is_read():
    graph = import_graph()
    # Spot checks that the parser sees module-level, lazy and package-relative imports.
    assert "engine.kv_cache.block" in graph["engine.kv_cache.block_pool"]
    assert "engine.model_runner" in graph["engine.engine_core"]
    assert "engine.engine_core" in graph["engine.core_process"]  # a function-level import
    assert "kernels.cpu_paged_attention" in graph["engine.attention.selector"]  # a lazy one
    # A type-only import is an edge for the direction, not for cycles.
    assert "engine.kv_offload.manager" in graph["engine.scheduler.scheduler"]
    assert "engine.kv_offload.manager" not in import_graph(runtime_only=True)["engine.scheduler.scheduler"]


def test_imports_go_one_way():
    """server -> handlers -> engine -> kernels: never back up the list."""
    upward = sorted(
        f"{module} imports {dep}"
        for module, deps in import_graph().items()
        for dep in deps
        if layer_of(dep) < layer_of(module)
    )
    assert upward == []


@pytest.mark.parametrize("package", LAYERS)
def test_no_cycles_inside_a_package(package):
    graph = import_graph(runtime_only=True)
    cycle = find_cycle(graph, {m for m in graph if m.split(".")[0] == package})
    assert cycle is None, " -> ".join(cycle)


def test_find_cycle_sees_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph, set(graph)) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}, {"a", "b"}) is None
