"""The package's layout: what stands at the top, the layers beneath, and which
way their imports go (README, Development: "Layout").

* At the top: what users import (the stdlib-shaped modules, ``futures``,
  ``joblib``, ``cluster``, ``config``, ...).  Internal machinery lives in the
  layer packages, so a module added at the top is a decision, made here.
* The swap maps ``multiprocessing.<name>`` onto ``fiber_dask.<name>`` whenever
  that exists: a top-level name equal to one of the stdlib's submodules is a
  mirror of it, so only the mirrors may carry one.
* No import cycle, counting imports inside functions; the layers beneath never
  import the faces users import (they are imported by them).
"""

from __future__ import annotations

import multiprocessing
import os
import pkgutil

from support import importgraph
from support.mirrors import SUBMODULES

import fiber_dask

PACKAGE_DIR = os.path.dirname(fiber_dask.__file__)

#: The stdlib's submodules fiber_dask mirrors (swap hands these out).
MIRRORS = set(SUBMODULES)
#: What users import, besides the mirrors.
FACES = MIRRORS | {"futures", "joblib", "swap", "_swapmain"}
TOP_LEVEL = FACES | {
    "__init__",
    "cluster",
    "config",
    "configdoc",
    "configschema",
    "dashboard",
    "errors",
    "meta",
}
#: The layers beneath, and the command line (which, like the faces, is a top).
LAYERS = {"backends", "comm", "engine", "launch", "transparency"}
#: ``experimental`` is a face too, of what goes beyond the stdlib's API and
#: may still change (Fiber's ``fiber.experimental``: the Ring); it is built
#: on the faces (Process, Pipe), so it is no layer beneath them.
PACKAGES = LAYERS | {"cli", "experimental"}


def _top_level() -> tuple[set[str], set[str]]:
    modules, packages = set(), set()
    for entry in os.scandir(PACKAGE_DIR):
        if entry.is_file() and entry.name.endswith(".py"):
            modules.add(entry.name[:-3])
        elif entry.is_dir() and os.path.exists(os.path.join(entry.path, "__init__.py")):
            packages.add(entry.name)
    return modules, packages


def test_the_top_level_holds_what_users_import():
    modules, packages = _top_level()
    assert modules == TOP_LEVEL, (
        f"fiber_dask/ holds {sorted(modules - TOP_LEVEL)} that this test does not "
        f"know, and lacks {sorted(TOP_LEVEL - modules)}: internal machinery "
        f"goes into one of the layer packages {sorted(LAYERS)}"
    )
    assert len(modules) <= 22
    assert packages == PACKAGES


def test_only_mirrors_carry_a_stdlib_submodule_name():
    stdlib = {m.name for m in pkgutil.iter_modules(multiprocessing.__path__)}
    modules, packages = _top_level()
    assert modules & stdlib == MIRRORS
    # a package named like one would be handed out as the stdlib's submodule
    assert not packages & stdlib


def test_no_import_cycle_counting_imports_inside_functions():
    cycles = importgraph.cycles(importgraph.graph(PACKAGE_DIR))
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_the_layers_beneath_never_import_the_faces():
    edges = importgraph.graph(PACKAGE_DIR)
    faces = {"fiber_dask"} | {f"fiber_dask.{name}" for name in FACES}
    upward = sorted(
        f"{module} -> {target}"
        for module, targets in edges.items()
        if module.split(".")[1:2] and module.split(".")[1] in LAYERS
        for target in targets & faces
    )
    assert not upward, upward


def test_the_graph_sees_imports_inside_functions():
    # What the two tests above rely on: a function-level import is an edge.
    edges = importgraph.graph(PACKAGE_DIR)
    assert "fiber_dask.launch.childsetup" in edges["fiber_dask.launch.processchild"]
    assert "fiber_dask.swap" in edges["fiber_dask"]
