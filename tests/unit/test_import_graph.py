"""No import circle in orchestrator/, actors/ or policies/ (docs/architecture.md), counting
imports under TYPE_CHECKING and inside functions: a module that names a type of another which
imports it back is a circle too, only one Python happens not to trip on."""
from __future__ import annotations

import ast
import os

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGES = ("orchestrator", "actors", "policies")


def modules() -> dict[str, str]:
    """Dotted module name -> file, for every module of the packages (a package is its __init__)."""
    out = {}
    for pkg in PACKAGES:
        for folder, _, files in os.walk(os.path.join(REPO, pkg)):
            for f in files:
                if f.endswith(".py"):
                    name = os.path.relpath(os.path.join(folder, f), REPO)[:-3].replace(os.sep, ".")
                    out[name.removesuffix(".__init__")] = os.path.join(folder, f)
    return out


def import_graph(mods: dict[str, str]) -> dict[str, set[str]]:
    """Each module -> the modules of the packages it imports anywhere in its text."""
    def resolve(name: str):
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for mod, path in mods.items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
        package = mod if path.endswith("__init__.py") else mod.rpartition(".")[0]
        deps = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                deps.update(resolve(a.name) for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                deps.update(resolve(f"{base}.{a.name}") if f"{base}.{a.name}" in mods else resolve(base)
                            for a in node.names)
        graph[mod] = {d for d in deps if d is not None and d != mod}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected parts of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, edges = work[-1]
            w = next(edges, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                part = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    part.append(w)
                    if w == v:
                        break
                if len(part) > 1:
                    found.append(sorted(part))
    return found


def test_the_finder_sees_a_circle_through_a_type_only_import():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_module_imports_one_that_imports_it_back():
    graph = import_graph(modules())
    assert "orchestrator.control.context" in graph and graph["orchestrator.control.running"]  # it read the tree
    assert circles(graph) == []
