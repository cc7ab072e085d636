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

from collections.abc import Callable
from typing import NamedTuple

__all__ = ["prepare", "preload", "register"]


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
