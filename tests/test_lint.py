"""The tooling STYLE.md names, enforced by the suite: ruff's lint and formatter over the tree, mypy strict
on `schemas/`, `gateway/` and `backend/` (pyproject.toml holds their settings; `kernels/` is exempt)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=600
    )


@pytest.mark.parametrize("command", [("ruff", "check", "."), ("ruff", "format", "--check", ".")])
def test_ruff(command: tuple[str, ...]) -> None:
    done = _run(*command)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


def test_mypy_strict_on_schemas_gateway_and_backend() -> None:
    done = _run("mypy", "--strict", "schemas", "gateway", "backend")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


PACKAGES = ("schemas", "gateway", "backend", "kernels", "benchmarks")


def _modules() -> dict[str, Path]:
    """Every module of the product packages by dotted name (a package by its `__init__`)."""
    modules: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def _imported(name: str, modules: dict[str, Path]) -> str | None:
    """The deepest module of the tree that `name` names (`a.b.func` → `a.b`), or None."""
    parts = name.split(".")
    while parts:
        dotted = ".".join(parts)
        if dotted in modules:
            return dotted
        parts.pop()
    return None


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """module → the tree's modules it imports: every `import` statement anywhere in the file
    (module level, in functions, under `if TYPE_CHECKING`), read statically with `ast`."""
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        is_package = path.name == "__init__.py"
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    package = module.split(".")
                    package = package if is_package else package[:-1]
                    package = package[: len(package) - (node.level - 1)]
                    base = ".".join([*package, base] if base else package)
                names = [f"{base}.{alias.name}" for alias in node.names]
            for name in names:
                target = _imported(name, modules)
                if target is not None and target != module:
                    edges.add(target)
        graph[module] = edges
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (`a → b → … → a`) per strongly connected component of more than one module
    (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return [_cycle_in(set(c), graph) for c in components]


def _cycle_in(component: set[str], graph: dict[str, set[str]]) -> list[str]:
    """A shortest cycle through the component's first module (breadth-first)."""
    start = min(component)
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph[node] & component):
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [*reversed(path), start]
                if child not in came_from:
                    came_from[child] = node
                    following.append(child)
        frontier = following
    raise AssertionError(f"no cycle in the component {sorted(component)}")


def test_import_cycles_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}}
    assert import_cycles(graph) == [["a", "b", "c", "a"]]


def test_no_import_cycles() -> None:
    cycles = import_cycles(import_graph(_modules()))
    assert not cycles, "import cycles:\n" + "\n".join(" → ".join(c) for c in cycles)


TREE_BUDGET = (
    40 * 2**20
)  # the developers' guide: the tracked tree stays under 40 MiB (a device call carries it)


def test_the_tracked_tree_stays_under_its_budget() -> None:
    done = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, timeout=60)
    if done.returncode != 0:
        pytest.skip("not a git checkout")
    sizes = {
        name: (ROOT / name).stat().st_size
        for name in done.stdout.decode().split("\0")
        if (ROOT / name).is_file()
    }
    largest = sorted(sizes, key=sizes.__getitem__, reverse=True)[:5]
    assert sum(sizes.values()) < TREE_BUDGET, [(n, sizes[n]) for n in largest]
