"""No circle between kvtier's modules: the import graph, read from the source, has no cycle.

The graph is built with ``ast`` from every ``.py`` file of the layer folders, named as they install
(``engine/storing.py`` is ``kvtier.engine.storing``). Every import counts wherever it stands: at
module level, inside a function (the usual way to hide a circle from the interpreter) and under
``if TYPE_CHECKING:`` (a module that names its builder's type still knows its builder). An edge
goes to the module imported: ``from kvtier.engine.records import X`` to ``kvtier.engine.records``,
``from kvtier.engine import config`` to ``kvtier.engine.config``, ``from kvtier.engine import X``
(a name) to the package ``kvtier.engine`` itself. Importing a package's submodule also runs the
package's ``__init__``; that is left out, as every import-cycle checker does, since otherwise
every package re-exporting its inner modules would be a circle with each of them.

The direction between folders (tools -> integrations -> engine -> tiers -> policy -> errors) is
checked in test_public_surface.py; with it, a cycle can only lie inside one folder, and each
folder is checked here on its own.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
LAYERS = ("errors", "policy", "tiers", "engine", "integrations", "tools")


def module_files(root: pathlib.Path, layers=LAYERS, top: str = "kvtier") -> dict[str, pathlib.Path]:
    """Module name -> source file, for every ``.py`` under each layer folder of ``root``."""
    modules: dict[str, pathlib.Path] = {}
    for layer in layers:
        for path in sorted((root / layer).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join([top, *parts])] = path
    return modules


def import_graph(modules: dict[str, pathlib.Path]) -> dict[str, set[str]]:
    """Module -> the modules of ``modules`` it imports (anywhere in its body)."""
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[: len(base) - (node.level - 1)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                for alias in node.names:
                    submodule = f"{source}.{alias.name}"
                    targets.append(submodule if submodule in modules else source)
            for target in targets:
                if target in modules and target != name:
                    graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted, plus one
    circle through it so a reader sees the path."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(start: str) -> None:
        # Iterative, so a deep import chain cannot hit the recursion limit.
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            advanced = False
            for successor in successors:
                if successor not in index:
                    index[successor] = low[successor] = len(index)
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(sorted(graph[successor]))))
                    advanced = True
                    break
                if successor in on_stack:
                    low[node] = min(low[node], index[successor])
            if advanced:
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
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

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(components)


def circle_through(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """One path ``a -> ... -> a`` inside ``component`` (breadth first from its first module)."""
    members = set(component)
    start = component[0]
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for successor in sorted(graph[node] & members):
                if successor == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [*reversed(path), start]
                if successor not in previous:
                    previous[successor] = node
                    following.append(successor)
        frontier = following
    raise AssertionError(f"{component} is no cycle")


def describe(graph: dict[str, set[str]], found: list[list[str]]) -> str:
    return "\n".join(
        f"{', '.join(c)}; one circle: " + " -> ".join(circle_through(graph, c)) for c in found
    )


# ------------------------------------------------------------------------------- the real tree

GRAPH = import_graph(module_files(ROOT))


@pytest.mark.parametrize("layer", LAYERS)
def test_no_import_cycle_inside_the_folder(layer):
    prefix = f"kvtier.{layer}"
    inside = {
        name: {target for target in targets if target == prefix or target.startswith(prefix + ".")}
        for name, targets in GRAPH.items()
        if name == prefix or name.startswith(prefix + ".")
    }
    found = cycles(inside)
    assert found == [], f"import cycles inside {layer}/:\n{describe(inside, found)}"


def test_the_graph_sees_the_tree():
    """The reader is not vacuous: known edges of each kind are in the graph."""
    assert "kvtier.engine.engine" in GRAPH and len(GRAPH) > 100
    assert "kvtier.engine.config" in GRAPH["kvtier.engine.engine"]  # a module-level from-import
    assert "kvtier.errors" in GRAPH["kvtier.tiers.chain"]  # a name from a package's __init__


# ------------------------------------------------------------------- the reader on a tiny tree

def graph_of(root: pathlib.Path, files: dict[str, str]) -> dict[str, set[str]]:
    """Write ``files`` (relative path -> text) under ``root`` and return the graph of its ``lay`` layer."""
    for relative, text in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return import_graph(module_files(root, layers=("lay",)))


def test_a_function_level_import_closing_a_circle_is_found(tmp_path):
    graph = graph_of(tmp_path, {
        "lay/__init__.py": "",
        "lay/a.py": "from kvtier.lay.b import helper\n",
        "lay/b.py": "def helper():\n    from kvtier.lay import a\n    return a\n",
        "lay/c.py": "import kvtier.lay.a\n",
    })
    assert graph == {
        "kvtier.lay": set(),
        "kvtier.lay.a": {"kvtier.lay.b"},
        "kvtier.lay.b": {"kvtier.lay.a"},
        "kvtier.lay.c": {"kvtier.lay.a"},
    }
    found = cycles(graph)
    assert found == [["kvtier.lay.a", "kvtier.lay.b"]]
    assert describe(graph, found) == "kvtier.lay.a, kvtier.lay.b; one circle: kvtier.lay.a -> kvtier.lay.b -> kvtier.lay.a"


def test_relative_and_type_checking_imports_count_and_a_package_name_goes_to_its_init(tmp_path):
    graph = graph_of(tmp_path, {
        "lay/__init__.py": "from .x import X\n",
        "lay/x.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .sub.y import Y\nX = 1\n",
        "lay/sub/__init__.py": "",
        "lay/sub/y.py": "from .. import X\nfrom ..x import X as X2\nY = 2\n",
    })
    assert graph["kvtier.lay"] == {"kvtier.lay.x"}
    assert graph["kvtier.lay.x"] == {"kvtier.lay.sub.y"}
    assert graph["kvtier.lay.sub.y"] == {"kvtier.lay", "kvtier.lay.x"}
    assert cycles(graph) == [["kvtier.lay", "kvtier.lay.sub.y", "kvtier.lay.x"]]


def test_a_tree_without_circles_has_none(tmp_path):
    graph = graph_of(tmp_path, {
        "lay/a.py": "import os\nfrom kvtier.lay import b\n",
        "lay/b.py": "from kvtier.other import thing\n",
    })
    assert graph == {"kvtier.lay.a": {"kvtier.lay.b"}, "kvtier.lay.b": set()}
    assert cycles(graph) == []
