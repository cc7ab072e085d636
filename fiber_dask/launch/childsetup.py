"""What a child process sets up before it runs the program's code: steps that
the layers above register, run by the layers that start children.

A Process child (:mod:`fiber_dask.launch.processchild`) and a slot process
(:mod:`fiber_dask.engine.slotserver`) are started by the launch and engine
layers, which must not import what users import: the swap
(:mod:`fiber_dask.swap`) imports the whole package to hand it out as
``multiprocessing``, so a call from below would close an import cycle through
every layer.  The package's root registers such steps when it is imported, and
every child imports it before anything of its own (importing
``fiber_dask.launch.processchild`` imports ``fiber_dask`` first)::

    fiber_dask/__init__ ──register(step, preload=)──► childsetup
    slot template, before it forks ──preload()──────► each step's preload
    Process child / slot process, before unpickling
      the program's objects ─────────prepare()──────► each step, in order
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import NamedTuple

__all__ = ["package_dir", "prepare", "preload", "pythonpath_with_package", "register"]


class _Step(NamedTuple):
    prepare: Callable[[], None]
    preload: Callable[[], None] | None


_steps: list[_Step] = []


def register(
    prepare: Callable[[], None], *, preload: Callable[[], None] | None = None
) -> None:
    """Run ``prepare()`` in every child before the program's code; ``preload()``
    (if given) in a slot template, so that the slots it forks find its imports
    done."""
    _steps.append(_Step(prepare, preload))


def preload() -> None:
    """What the registered steps import, paid once in a template."""
    for step in list(_steps):
        if step.preload is not None:
            step.preload()


def prepare() -> None:
    """Run the registered steps (the environment a child inherited is set)."""
    for step in list(_steps):
        step.prepare()


def package_dir() -> str:
    """The directory of this fiber_dask package (``.../fiber_dask``), found
    from the package itself rather than from this module's place in it, so a
    module that moves between subpackages does not change the answer."""
    root = sys.modules[__name__.partition(".")[0]]
    return os.path.dirname(os.path.abspath(root.__file__))


def pythonpath_with_package(env: dict[str, str]) -> str:
    """``env``'s ``PYTHONPATH`` with the directory that holds this fiber_dask
    appended, so a child started with ``env`` imports this very fiber_dask
    (its parent may have found it through ``sys.path``, not ``PYTHONPATH``).
    The package's parent, never the package directory itself: there
    ``fiber_dask/joblib.py`` would shadow the real ``joblib`` for every
    program in the child."""
    here = os.path.dirname(package_dir())
    return os.pathsep.join(p for p in (env.get("PYTHONPATH"), here) if p)
