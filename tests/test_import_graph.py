"""The floor plan holds: every module of the packages is parsed with `ast`, its imports (at module
level, inside functions and under TYPE_CHECKING alike) resolved to modules; the module graph has no
cycle, no room (folder) imports a room above it in the declared layer map, the rooms' graph has no
cycle, and the two services never import each other."""
from __future__ import annotations

import ast
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("common", "launch", "offline", "scheduler_service", "worker_service")
# Rooms from the top floor down; a room imports only rooms on its own floor or below. A room is a
# folder (all its modules) or a module of its own; floors hold peers.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("launch",),
    ("offline",),
    ("scheduler_service.api", "worker_service.api"),
    ("scheduler_service.observe",),
    ("scheduler_service.lanes", "worker_service.runtime"),
    # structured output: the core holds its states through a protocol; --deterministic's kernels
    ("scheduler_service.constraints", "worker_service.invariant"),
    ("scheduler_service.core", "worker_service.loader"),
    ("worker_service.models",),
    ("worker_service.layers", "worker_service.attention", "worker_service.sampling"),
    ("worker_service.parallel",),
    ("common", "common.client"),
    ("common.security",),
    ("common.net",),
    ("common.contract", "common.formats", "common.gc_pauses", "common.gen_protos", "scheduler_service",
     "worker_service"),
    ("common.generated",),
)
INDEPENDENT = ("scheduler_service", "worker_service")  # the two services never import each other


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


def room_of(module: str) -> str:
    """The longest declared room that holds module (a package's own __init__ is its parent's room)."""
    rooms = {room for floor in LAYERS for room in floor}
    parts = module.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in rooms:
            return ".".join(parts[:end])
    raise AssertionError(f"{module} lies in no room of LAYERS: add its folder to the layer map")


def layering_violations(graph: dict[str, set[str]]) -> list[str]:
    floor_of = {room: index for index, floor in enumerate(LAYERS) for room in floor}
    violations = []
    for module, targets in sorted(graph.items()):
        for target in sorted(targets):
            source_room, target_room = room_of(module), room_of(target)
            if floor_of[target_room] < floor_of[source_room]:
                violations.append(f"{module} imports {target}: {source_room} sits below {target_room}")
            services = {module.partition(".")[0], target.partition(".")[0]}
            if services == set(INDEPENDENT):
                violations.append(f"{module} imports {target}: the two services never import each other")
    return violations


def room_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    rooms: dict[str, set[str]] = {room_of(module): set() for module in graph}
    for module, targets in graph.items():
        rooms[room_of(module)].update(room_of(target) for target in targets)
    return {room: targets - {room} for room, targets in rooms.items()}


def test_layering_is_checked_on_a_bad_import() -> None:
    graph = {"common.contract.config": {"scheduler_service.core.sequence"}, "scheduler_service.core.sequence": set()}
    assert layering_violations(graph) == ["common.contract.config imports scheduler_service.core.sequence: "
                                          "common.contract sits below scheduler_service.core"]
    assert layering_violations({"scheduler_service.api.x": {"worker_service.api.y"}, "worker_service.api.y": set()}) \
        == ["scheduler_service.api.x imports worker_service.api.y: the two services never import each other"]


def test_no_room_imports_a_room_above_it_and_rooms_form_no_circle() -> None:
    graph = import_graph()
    assert {room_of(module) for module in graph} == {room for floor in LAYERS for room in floor}
    violations = layering_violations(graph)
    assert not violations, "imports against the layer map:\n" + "\n".join(violations)
    cycles = find_cycles(room_graph(graph))
    assert not cycles, "room circles:\n" + "\n".join(" -> ".join(cycle) for cycle in cycles)
