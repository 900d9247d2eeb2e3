"""The backend's package layout, read statically: the backend never imports the gateway (what both
need lives in `schemas/`, DESIGN §1), the engine never imports quantization, and no module of
`backend/` imports itself back, directly or round a loop of others.

Every import counts, wherever it sits (module top, function body, `if TYPE_CHECKING:`), because a
function-local import that only breaks a cycle at run time still leaves the cycle in the design. An
import of `a.b.c` also runs `a/__init__.py` and `a/b/__init__.py`, so it counts as theirs too
(except the packages the importing module sits in: those are already running).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def backend_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted((ROOT / "backend").rglob("*.py"))}


def imported_names(path: Path) -> set[str]:
    """Every dotted name an import in `path` refers to (`from a import b` gives `a` and `a.b`)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: relative import"
            assert node.module is not None
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def import_graph() -> dict[str, set[str]]:
    """module → the backend modules it imports (with the packages above each)."""
    modules = backend_modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        own_packages = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
        deps: set[str] = set()
        for imported in imported_names(path):
            parts = imported.split(".")
            above = {".".join(parts[:i]) for i in range(1, len(parts))} - own_packages  # already running
            deps.update(m for m in (above | {imported}) if m in modules)
        graph[name] = deps - {name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None (depth-first search, white/grey/black)."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                return [*stack[stack.index(dep) :], dep]
            if dep not in state and (cycle := visit(dep)) is not None:
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)) is not None:
            return cycle
    return None


def test_the_scan_sees_a_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None
    graph = import_graph()
    assert "backend.engine.scheduler" in graph["backend.engine.engine"]
    assert "backend.models" in graph["backend.models.loader"]  # a package's __init__ runs first


def test_no_import_cycles_in_backend() -> None:
    assert find_cycle(import_graph()) is None


def test_engine_never_imports_quant() -> None:
    engine = [p for name, p in backend_modules().items() if name.startswith("backend.engine")]
    assert len(engine) > 10
    offenders = {
        module_name(p): sorted(n for n in imported_names(p) if n.startswith("backend.quant")) for p in engine
    }
    assert {m: names for m, names in offenders.items() if names} == {}


def test_the_scan_sees_an_import_inside_a_function(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from gateway.supervisor import Supervisor\n    import gateway.app\n")
    assert {"gateway.supervisor", "gateway.app"} <= imported_names(module)


def test_backend_never_imports_gateway() -> None:
    modules = backend_modules()
    assert "backend.server.app" in modules and "backend.server.rank_group" in modules
    offenders = {
        name: sorted(n for n in imported_names(p) if n == "gateway" or n.startswith("gateway."))
        for name, p in modules.items()
    }
    assert {m: names for m, names in offenders.items() if names} == {}
