"""The engine's modules import each other without a circle: the paths it builds never import it.

Every import counts, at module level, inside functions and under ``TYPE_CHECKING`` alike: a path
that needs the engine's type to be written needs the engine.
"""

from __future__ import annotations

import ast
import pathlib
from typing import Dict, List, Set

ENGINE = pathlib.Path(__file__).resolve().parents[2] / "engine"


def import_graph(package: pathlib.Path, dotted: str = "kvtier.engine") -> Dict[str, Set[str]]:
    """Module name -> the sibling modules it imports (relative or through ``dotted``)."""
    modules = {path.stem for path in package.glob("*.py")}
    graph: Dict[str, Set[str]] = {}
    for path in sorted(package.glob("*.py")):
        found: Set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                if node.level == 1:
                    base = node.module or ""
                elif node.level == 0 and (node.module or "").startswith(dotted):
                    base = node.module[len(dotted):].lstrip(".")
                else:
                    continue
                if base:
                    found.add(base.split(".")[0])
                else:  # from . import x
                    found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith(dotted + "."):
                        found.add(alias.name[len(dotted) + 1:].split(".")[0])
        graph[path.stem] = {name for name in found if name in modules and name != path.stem}
    return graph


def cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """One circle per strongly connected part of the graph that has more than one module."""
    found: List[List[str]] = []
    done: Set[str] = set()

    def walk(node: str, path: List[str]) -> None:
        if node in path:
            found.append(path[path.index(node):] + [node])
            return
        if node in done:
            return
        for nxt in sorted(graph.get(node, ())):
            walk(nxt, path + [node])
        done.add(node)

    for start in sorted(graph):
        walk(start, [])
    return found


def test_the_engine_package_has_no_import_cycle():
    graph = import_graph(ENGINE)
    assert {"engine", "host_book", "storing", "loading", "spill"} <= set(graph)
    assert cycles(graph) == []


def test_the_paths_the_engine_builds_never_import_it():
    graph = import_graph(ENGINE)
    importers = sorted(name for name, imported in graph.items() if "engine" in imported and name != "__init__")
    assert importers == []


def test_the_cycle_finder_names_a_circle():
    assert cycles({"engine": {"storing"}, "storing": {"engine"}, "records": set()}) == [["engine", "storing", "engine"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
