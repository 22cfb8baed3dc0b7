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


#: The layers, bottom to top (issue 25 item 1). A module imports its own layer and those below;
#: the orchestrator reaches into the worker layer only through the modules named below. The front
#: doors (issue 29) sit on the orchestrator: each holds a `Fleet` and turns another agent's requests
#: into its calls. `cli` and `dev` share the top: the CLI's `bench`/`fake-model`/`demo` run dev's
#: code, and a benchmark may measure a command's own renderer. Telemetry (issue 30) sits just above
#: `core`: both ends of a queue record their spans and metrics through it.
LAYERS = {"toolq.core": 0, "toolq.telemetry": 1, "toolq.workers": 2, "toolq.local": 3, "toolq.orchestrator": 4,
          "toolq.frontdoors": 5, "toolq.cli": 6, "toolq.dev": 6, "toolq.testing": 7, "toolq": 7}

#: What the orchestrator and the embedded stack use of the worker layer: the Celery app's
#: configuration (both ends of a queue build it), loading tool modules, running one call in
#: process (the in-memory transport), the stale pool cgroups an embedded stack clears, and the
#: Redis clients (both ends must follow a Sentinel-managed primary the same way), the workspace
#: store and the archive code (the orchestrator packs an upload and applies a turn's changes back).
WORKER_MODULES_ABOVE = {"toolq.workers.config", "toolq.workers.loader", "toolq.workers.execute",
                        "toolq.workers.isolation.limits", "toolq.workers.redis_clients",
                        "toolq.workers.store", "toolq.workers.environments.archive"}


def layer_of(module: str) -> str:
    return max((name for name in LAYERS if module == name or module.startswith(name + ".")), key=len)


def layer_breaches(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    breaches = set()
    for name, targets in graph.items():
        mine = layer_of(name)
        for target in targets:
            theirs = layer_of(target)
            if LAYERS[theirs] > LAYERS[mine]:
                breaches.add((name, target))
            elif theirs == "toolq.workers" and mine != theirs and LAYERS[mine] <= LAYERS["toolq.orchestrator"] \
                    and target not in WORKER_MODULES_ABOVE:
                breaches.add((name, target))
    return breaches


def test_every_import_goes_down_the_layers():
    assert layer_breaches(import_graph()) == set()


def test_the_layer_rule_catches_an_import_going_up():
    graph = {"toolq.core.keys": {"toolq.workers.app"}, "toolq.workers.app": {"toolq.orchestrator.barrier"},
             "toolq.orchestrator.barrier": {"toolq.workers.processes", "toolq.workers.config"},
             "toolq.local.embedded": {"toolq.cli.run"}, "toolq.cli.run": {"toolq.dev.bench"},
             "toolq.dev.bench": {"toolq.cli.view", "toolq.workers.processes"}}
    assert layer_breaches(graph) == {("toolq.core.keys", "toolq.workers.app"),
                                     ("toolq.workers.app", "toolq.orchestrator.barrier"),
                                     ("toolq.orchestrator.barrier", "toolq.workers.processes"),
                                     ("toolq.local.embedded", "toolq.cli.run")}


def test_every_package_of_toolq_has_a_layer():
    packages = {name.split(".")[1] for name in import_graph() if name.count(".") >= 1}
    assert {f"toolq.{p}" for p in packages} <= set(LAYERS), packages
