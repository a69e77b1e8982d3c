"""No import circles among the project's modules: every module of the packages is parsed with `ast`,
its imports (at module level, inside functions and under TYPE_CHECKING alike) resolved to modules,
and the graph must have no cycle."""
from __future__ import annotations

import ast
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("common", "scheduler_service", "worker_service", "offline")


def module_files() -> dict[str, Path]:
    """Module name -> file, for every module of PACKAGES that exists."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((REPO_ROOT / package).rglob("*.py")):
            parts = path.relative_to(REPO_ROOT).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def imported_modules(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules that module `name` imports anywhere in its body."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            # `from pkg import mod` imports the module pkg.mod; `from mod import name` imports mod.
            targets.update(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                           for alias in node.names)
    return {_known_module(target, modules) for target in targets} - {None, name}


def _known_module(target: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of a dotted name that is a project module (None outside the project)."""
    while target and target not in modules:
        target = target.rpartition(".")[0]
    return target or None


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (a list of modules, first repeated at the end) per strongly connected component."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(node: str) -> None:  # Tarjan's algorithm; the graph is small enough for recursion
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in sorted(graph[node]):
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component: set[str] = set()
            while node not in component:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
            if len(component) > 1:
                components.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [_cycle_in(component, graph) for component in components]


def _cycle_in(component: set[str], graph: dict[str, set[str]]) -> list[str]:
    """A shortest cycle through the component's first module (breadth-first search back to it)."""
    start = min(component)
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for successor in sorted(graph[node] & component):
                if successor == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if successor not in parents:
                    parents[successor] = node
                    following.append(successor)
        frontier = following
    raise AssertionError(f"no cycle in component {sorted(component)}")


def import_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports."""
    modules = module_files()
    return {name: imported_modules(name, path, modules) for name, path in modules.items()}


def test_find_cycles_reports_a_circle() -> None:
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_imports_resolve_relative_and_function_level_forms(tmp_path: Path) -> None:
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    source = ("from . import b\nfrom .b import name\nfrom ..top import thing\n"
              "def f():\n    import pkg.sub.c\n    from pkg.sub import d\n")
    (tmp_path / "pkg" / "sub" / "a.py").write_text(source)
    modules = {name: tmp_path / "x.py" for name in ("pkg", "pkg.top", "pkg.sub", "pkg.sub.b", "pkg.sub.c", "pkg.sub.d")}
    assert imported_modules("pkg.sub.a", tmp_path / "pkg" / "sub" / "a.py", modules) == {
        "pkg.sub.b", "pkg.top", "pkg.sub.c", "pkg.sub.d"}


def test_no_import_cycles() -> None:
    graph = import_graph()
    assert "worker_service.runtime.model_runner" in graph and graph["worker_service.runtime.model_runner"]
    cycles = find_cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(cycle) for cycle in cycles)
