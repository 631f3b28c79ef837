"""The import graph of la_compiler (with passes/ and kernels/, which the package maps beneath it): no cycle,
function-level imports included; the kernel registry and selection table at the bottom, the families
registered from ``kernels/__init__.py`` only, the kernels and the IR below the passes, the policy and the hand-off.
The graph is read from the source (``ast``), so an import inside a function counts as much as one at the top: none
can hide a cycle."""
from __future__ import annotations

import ast
import subprocess
from pathlib import Path

ROOT = Path(__file__).parents[2]
PACKAGE_DIRS = {"la_compiler": ROOT / "la_compiler", "la_compiler.passes": ROOT / "passes",
                "la_compiler.kernels": ROOT / "kernels"}
FAMILIES = ("chunk", "recurrent", "decode", "reference", "fla")


def project_modules() -> dict[str, Path]:
    modules = {}
    for package, directory in PACKAGE_DIRS.items():
        for path in directory.rglob("*.py"):
            parts = path.relative_to(directory).with_suffix("").parts
            modules[".".join((package, *(parts[:-1] if parts[-1] == "__init__" else parts)))] = path
    return modules


def _type_checking_only(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Project modules ``name`` imports: named ones, and the packages above them that Python imports first
    (except ``name``'s own, which are already being imported)."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()

    def target(dotted: str) -> str | None:
        while dotted and dotted not in modules:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    def add(dotted: str) -> None:
        module = target(dotted)
        if module is None:
            return
        if module != name:
            found.add(module)
        parent = module.rpartition(".")[0]
        while parent:
            if parent != name and not name.startswith(parent + "."):
                found.add(parent)
            parent = parent.rpartition(".")[0]

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if _type_checking_only(child):
                continue
            if isinstance(child, ast.Import):
                for alias in child.names:
                    add(alias.name)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    parts = name.split(".") if is_package else name.split(".")[:-1]
                    parts = parts[: len(parts) - (child.level - 1)]
                    base = ".".join(parts + ([base] if base else []))
                for alias in child.names:
                    add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return found


def import_graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def walk(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := walk(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := walk(node)):
            return cycle
    return None


def test_the_graph_covers_the_tree():
    graph = import_graph()
    assert {"la_compiler.backend", "la_compiler.passes.pipeline", "la_compiler.kernels.registry",
            "la_compiler.kernels.chunk.fwd", "la_compiler.kernels.common.qdq"} <= set(graph)
    # the reader sees function-level imports: the CLI imports the registry inside its commands
    assert "la_compiler.kernels.registry" in graph["la_compiler.cli"]


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_find_cycle_finds_one():
    """The checker itself: a cycle through a function-level import is reported."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_registry_and_selection_import_no_family():
    graph = import_graph()
    families = tuple(f"la_compiler.kernels.{family}" for family in FAMILIES)
    bottom = [name for name in graph if name in ("la_compiler.kernels.registry", "la_compiler.kernels.selection")
              or name.startswith("la_compiler.kernels.common")]
    for name in bottom:
        upward = sorted(t for t in graph[name] if t.startswith(families))
        assert not upward, f"{name} imports kernel families {upward}"


def test_families_are_registered_from_the_kernels_package():
    """kernels/__init__.py imports each family's variant module; those modules register themselves."""
    graph = import_graph()
    registering = {name for name, path in project_modules().items() if "register_variant(" in path.read_text()
                   and name != "la_compiler.kernels.registry"}
    assert registering, "no module registers a variant"
    assert registering <= graph["la_compiler.kernels"]
    assert {name.split(".")[2] for name in registering} == set(FAMILIES)


def test_tracked_text_speaks_of_the_project_only():
    """Project text speaks of the project: no tracked file names the periods of work behind it."""
    out = subprocess.run(["git", "grep", "-il", "sess" + "ion"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode in (0, 1), out.stderr
    assert out.stdout.split() == []


def test_kernels_and_ir_import_nothing_above_them():
    """The kernels and the IR sit below the passes, the policy and the hand-off: the FLA frontend imports the
    ``laqat::`` ops of ``kernels/fla/``, never the other way round."""
    graph = import_graph()
    above = ("la_compiler.passes", "la_compiler.policy", "la_compiler.hand_off", "la_compiler.backend")
    for name, targets in graph.items():
        if name.startswith(("la_compiler.kernels", "la_compiler.ir")):
            upward = sorted(t for t in targets if t.startswith(above))
            assert not upward, f"{name} imports {upward}"
