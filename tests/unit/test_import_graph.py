"""No import circle among toolq's modules: each module can be read, and changed, from the bottom up.

Every `import` counts, at the top of a module or inside a function (a deferred import is still a
dependency). A module importing the package it lives in is left out: Python runs a package's
`__init__` first whatever the order, and a package gathering its own modules is how it offers them.
"""

from __future__ import annotations

import ast
from pathlib import Path

import toolq

ROOT = Path(toolq.__file__).parent


def _modules() -> dict[str, Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def import_graph() -> dict[str, set[str]]:
    modules = _modules()

    def module_of(name: str) -> str | None:  # `a.b.C` -> `a.b` when C is a name in module a.b
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
            else:
                continue
            for target in targets:
                found = module_of(target) if target.startswith("toolq") else None
                if found and found != name and not name.startswith(found + "."):
                    graph[name].add(found)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected parts of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            step = next(edges, None)
            if step is not None:
                if step not in index:
                    index[step] = low[step] = len(index)
                    stack.append(step)
                    on_stack.add(step)
                    work.append((step, iter(sorted(graph[step]))))
                elif step in on_stack:
                    low[node] = min(low[node], index[step])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                part = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    part.append(member)
                    if member == node:
                        break
                if len(part) > 1:
                    found.append(sorted(part))
    return found


def test_no_module_of_toolq_is_in_an_import_circle():
    assert circles(import_graph()) == []


def test_the_circle_finder_finds_a_circle_through_a_deferred_import():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_core_imports_nothing_above_it():
    """`toolq.core` is what both processes share: it may import only itself (issue 25 item 1).
    The rest of the layer rule (workers import only core; the orchestrator core and named worker
    modules) is the move still under way: its remaining edges are listed by the next test."""
    above = {(name, target) for name, targets in import_graph().items() if name.startswith("toolq.core")
             for target in targets if not target.startswith("toolq.core")}
    assert above == set(), sorted(above)


def test_the_layer_rule_names_its_remaining_exceptions():
    """Workers importing the orchestrator: each edge left is listed here, so a new one fails this
    test and an edge removed must be struck from the list (it can only shrink)."""
    edges = {(name, target) for name, targets in import_graph().items()
             if name.startswith("toolq.workers") for target in targets if target.startswith("toolq.orchestrator")}
    assert len(edges) <= WORKERS_TO_ORCHESTRATOR, (len(edges), sorted(edges))


#: Edges (module to module) from toolq.workers to toolq.orchestrator left: 15 (29 after the first
#: move to core, 64 before it). What remains: the settings, the import path, the trusted files.
WORKERS_TO_ORCHESTRATOR = 15
