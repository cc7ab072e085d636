"""The random generators fiber-dask and Dask draw from in a program's process:
private ones, so that the program's global ``random`` (and ``numpy.random``)
state is the program's alone.

A seeded program gets the same numbers under fiber-dask as under the stdlib's
``multiprocessing`` only if nothing else draws from its generators between its
own draws.  The stdlib's pools, queues and managers never do.  Dask does: the
embedded cluster's scheduler and nannies run in the program's process (in a
background thread), its comms size every message they write with
``dask.sizeof``, which samples lists, tuples and the keys and values of dicts
longer than 10 with ``random.sample``, and its connect and retry loops add
jitter with ``random``.  Measured on distributed 2026.8 with the embedded
cluster (issue 28): an idle ``Pool(2)`` drew twice a second (its statistics
report to the scheduler, a dict of more than 10 keys, sized as the rpc wrote
it), so a seeded genetic algorithm (deap) whose evaluations went through
``pool.map`` ran differently than under the stdlib; draws from a background
thread also race with the program's own.

What this module does
---------------------
* :data:`rng` is fiber-dask's own generator (a ``random.Random`` seeded from
  ``os.urandom``, reseeded in a forked child as the global one is), for its
  own jitter and choices (a channel's redial backoff, the worker a waiting
  ``Process`` is started beside).
* :func:`isolate_dask` rebinds, in each module of :data:`DASK_DRAWERS`, every
  module global that is the stdlib's ``random`` module (``import random``) or a
  function of its global generator (``from random import randint``) to the
  same thing on a private generator: a copy of the ``random`` module's
  namespace (classes and constants are the stdlib's own objects) whose
  functions are :data:`rng`'s bound methods.  Dask's code is unchanged; only
  the generator it draws from is.  A module whose globals are something else
  (a future Dask that seeds its own ``Random``) is left as it is, and a module
  that does not exist is skipped.  Modules already imported are rebound at
  once; the others as their import finishes (a finder first on
  ``sys.meta_path`` wraps their loader), so it does not matter whether the
  program, a backend or a third-party plugin imports ``distributed`` first,
  and the embedded cluster can keep importing it after its worker fork server
  has started (:mod:`fiber_dask.backends.workerstart`).

:func:`isolate_dask` runs where Dask's code is about to run on fiber-dask's
behalf in a process the program's code shares: before a cluster is resolved
or attached (:mod:`fiber_dask.cluster`: every backend, an existing client),
and in a Dask worker whose task thread runs a thread slot's tasks
(:mod:`fiber_dask.engine.slottask`).  Slot processes reseed both global generators
when they start, as a fresh stdlib worker starts with its own state
(:mod:`fiber_dask.engine.slotserver`); nothing draws there between tasks.

The modules, and why each (distributed and dask 2026.8)
-------------------------------------------------------
``dask.sizeof``
    ``random.sample`` in ``sizeof`` of a list/tuple (and a dict's keys and
    values) longer than 10: ``distributed.comm.utils.to_frames`` sizes every
    message a comm writes, in the client, the scheduler and the nannies.
``distributed.utils_comm``
    ``random.choice`` of the worker to gather a key from (client and
    scheduler ``gather``); ``random.random`` jitter of ``retry_operation``
    (the client's retried scheduler calls, ``distributed.comm.retry``).
``distributed.comm.core``
    ``random.uniform`` backoff of ``connect`` after a refused or timed-out
    attempt (a restarting worker, a scheduler not up yet).
``distributed.scheduler``
    ``random.sample`` in ``replicate``, ``random.shuffle`` in
    ``benchmark_hardware``: the embedded scheduler runs here.
``distributed.protocol.compression``
    ``from random import randint``: ``byte_sample`` of every payload over
    10 kB a comm writes when ``distributed.comm.compression`` is set.
``distributed.worker``
    ``random.random`` stagger of ``distributed.worker.lifetime`` and the
    ``benchmark_*`` handlers: a Dask worker in this process (thread slots run
    tasks in one).

Left alone, with the reason (see :data:`LEFT_ALONE`): what draws only when
the program asks for it, where the draws are the program's own (``dask.bag``,
``dask.datasets``, ``dask.array``/``dask.dataframe`` random functions, Dask's
chaos-testing plugin, ``tornado.ioloop``'s ``PeriodicCallback`` jitter, which
no Dask callback uses, ``jinja2``'s ``random`` filter and ``lipsum``, which no
Dask template uses, ``email.utils.make_msgid``);
``distributed.worker_state_machine`` only uses the ``random.Random`` class (a
generator of its own, seeded 0).

``numpy.random``: nothing fiber-dask runs draws from numpy's global generator
in the program's process.  Dask's one draw (``np.random.choice`` in
``dask.sizeof`` of a pandas object with an object column) runs only for a
pandas object inside a Dask message written here, and fiber-dask sends the
program's data over its own connections, never in Dask messages; a program
that sends pandas objects through a Dask client of its own draws as it would
without fiber-dask.  The tests check numpy's state alongside ``random``'s.

Alternatives weighed: saving and restoring the global state around Dask's
work cannot be done (the draws come from a background thread at any time, and
restoring would undo the program's draws made meanwhile); making the global
``random`` functions answer per thread would change the stdlib for everyone;
keeping the scheduler out of the program's process is a far larger change,
not made here.  Dask's maintainers could take a
``random.Random`` of their own in these modules (as
``distributed.worker_state_machine`` does); until then, this.

This module is a leaf: it imports nothing of fiber_dask.
"""

from __future__ import annotations

import importlib.abc
import logging
import os
import random
import sys
import threading
import types
from typing import Any

__all__ = ["rng", "isolate_dask", "is_private", "DASK_DRAWERS", "LEFT_ALONE"]

logger = logging.getLogger(__name__)

#: fiber-dask's own generator; also the one Dask's modules draw from here.
rng = random.Random()

if hasattr(os, "register_at_fork"):
    # As random's global generator does: two forked processes (slot processes
    # forked from one template) must not share a sequence of jitters.
    os.register_at_fork(after_in_child=rng.seed)

#: The Dask modules whose global ``random`` (or functions of it) are rebound
#: to :data:`rng` (the module docstring says why each).
DASK_DRAWERS = (
    "dask.sizeof",
    "distributed.utils_comm",
    "distributed.comm.core",
    "distributed.scheduler",
    "distributed.protocol.compression",
    "distributed.worker",
)

#: Modules of Dask and its dependencies that bind the global generator (as a
#: module global) but are left alone, with why: their draws are the program's
#: own doing, or no code of Dask's reaches them.
LEFT_ALONE = {
    "dask.bag.random": "random sampling the program asks a bag for",
    "dask.datasets": "seeds a random.Random of its own; data the program asks for",
    "dask.diagnostics.profile_visualize": "random.Random(42) of its own",
    "distributed.chaos": "the chaos-testing worker plugin, installed by a program",
    "distributed.worker_state_machine": "random.Random(0) of its own",
    "tornado.ioloop": "PeriodicCallback jitter; no Dask callback sets one",
    "jinja2.filters": "the random filter; no Dask template uses it",
    "jinja2.utils": "lipsum(); no Dask template uses it",
    "email.utils": "make_msgid(); Dask sends no mail",
    "urllib3.util.retry": "backoff jitter only when a program configures it",
}

#: The generator behind random.random() & co.
_GLOBAL = getattr(random, "_inst", None) or getattr(random.random, "__self__", None)

#: The names of ``random``'s functions: the public methods of its generator.
_METHODS = frozenset(
    name
    for name in dir(random.Random)
    if not name.startswith("_") and callable(getattr(random.Random, name))
)


def _private_namespace() -> types.ModuleType:
    """The ``random`` module's namespace with :data:`rng` behind its functions
    (taken from :data:`rng` by name, so a program that wrapped ``random.random``
    before fiber-dask was imported does not see Dask's draws either)."""
    ns = types.ModuleType(
        "random", "random's functions on fiber_dask.transparency.privaterandom.rng"
    )
    for name, value in vars(random).items():
        if name.startswith("__"):
            continue
        if name in _METHODS:
            value = getattr(rng, name)
        elif value is _GLOBAL:  # random._inst
            value = rng
        setattr(ns, name, value)
    return ns


_PRIVATE = _private_namespace()
_lock = threading.Lock()
_finder: _RebindOnImport | None = None


def is_private(value: Any) -> bool:
    """Whether ``value`` (a module global) draws from :data:`rng`, not the
    program's generator."""
    return value is _PRIVATE or getattr(value, "__self__", None) is rng


def _rebind(module: types.ModuleType) -> None:
    """Point ``module``'s globals that draw from the global generator at
    :data:`rng`; anything else is left as it is."""
    try:
        for name, value in list(vars(module).items()):
            if value is random:
                setattr(module, name, _PRIVATE)
            elif _GLOBAL is not None and getattr(value, "__self__", None) is _GLOBAL:
                method = getattr(rng, getattr(value, "__name__", ""), None)
                if method is not None:
                    setattr(module, name, method)
    except Exception:  # noqa: BLE001 - never break the program's import
        logger.debug("fiber-dask: could not rebind %s", module, exc_info=True)


def isolate_dask() -> None:
    """Make :data:`DASK_DRAWERS` draw from :data:`rng`, now for those imported
    and as they are imported for the others.  Idempotent and cheap to repeat.
    """
    global _finder
    if _finder is not None:
        return
    with _lock:
        if _finder is not None:
            return
        # First on the path, so that no import of a watched module slips past.
        finder = _RebindOnImport(frozenset(DASK_DRAWERS))
        sys.meta_path.insert(0, finder)
        _finder = finder
        for name in DASK_DRAWERS:
            module = sys.modules.get(name)
            if module is not None:
                _rebind(module)


class _RebindOnImport(importlib.abc.MetaPathFinder):
    """Finds a watched module with the finders after it and wraps its loader,
    so that :func:`_rebind` runs as soon as the module's code has run."""

    def __init__(self, names: frozenset[str]) -> None:
        self.names = names
        self._busy = threading.local()

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in self.names or getattr(self._busy, "name", None):
            return None
        self._busy.name = fullname  # the finders below may import (no recursion)
        try:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
            else:
                return None
        finally:
            self._busy.name = None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _RebindingLoader(spec.loader)
        return spec


class _RebindingLoader(importlib.abc.Loader):
    """The module's own loader, then :func:`_rebind`; the module keeps its own
    loader as ``__loader__`` (for ``inspect``, ``importlib.resources``,
    ``reload``)."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def create_module(self, spec: Any) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        module.__loader__ = self.loader
        if module.__spec__ is not None:
            module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        _rebind(module)
