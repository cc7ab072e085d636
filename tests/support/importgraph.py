"""The import graph of a package, read from its source: every ``import`` and
``from ... import`` (at module level and inside functions, ``TYPE_CHECKING``
blocks included) and every ``importlib.import_module("literal")``."""

from __future__ import annotations

import ast
import os
from collections.abc import Iterator

__all__ = ["cycles", "graph", "modules"]


def modules(package_dir: str) -> dict[str, str]:
    """Dotted module name -> file, for every ``.py`` under ``package_dir``."""
    base = os.path.dirname(os.path.abspath(package_dir))
    found: dict[str, str] = {}
    for dirpath, dirnames, filenames in os.walk(package_dir):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        for name in filenames:
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                dotted = os.path.relpath(path, base)[:-3].replace(os.sep, ".")
                found[dotted.removesuffix(".__init__")] = path
    return found


def _targets(mods: dict[str, str], module: str, node: ast.AST) -> Iterator[str]:
    names: list[str] = []
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            package = module
            if not mods[module].endswith("__init__.py"):
                package = module.rpartition(".")[0]
            for _ in range(node.level - 1):
                package = package.rpartition(".")[0]
            base = package + ("." + base if base else "")
        # ``from pkg import sub`` imports the submodule; ``from mod import name``
        # the module
        names = [
            f"{base}.{alias.name}" if f"{base}.{alias.name}" in mods else base
            for alias in node.names
        ]
    elif (
        isinstance(node, ast.Call)
        and getattr(node.func, "attr", getattr(node.func, "id", None))
        == "import_module"
        and node.args
        and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, str)
    ):
        names = [node.args[0].value]
    for name in names:
        # a name inside a module: the module
        while name and name not in mods and "." in name:
            name = name.rpartition(".")[0]
        if name in mods and name != module:
            yield name


def graph(package_dir: str) -> dict[str, set[str]]:
    """Module -> the package's modules it imports."""
    mods = modules(package_dir)
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for module, path in mods.items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            edges[module].update(_targets(mods, module, node))
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found
