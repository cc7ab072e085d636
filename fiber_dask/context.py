"""The hub: a context object whose factories build fiber-dask objects.

As in ``multiprocessing.context``, the top-level namespace is the bound methods
of one default context, and each factory imports its module lazily so that
``import fiber_dask`` stays cheap and starts nothing.
"""

from __future__ import annotations

import multiprocessing
import warnings

# The stdlib module's names, re-exported.
from multiprocessing import (  # noqa: F401
    AuthenticationError,
    BufferTooShort,
    ProcessError,
    TimeoutError,  # noqa: A004 - the stdlib's name
)
from multiprocessing.context import (  # noqa: F401
    assert_spawning,
    get_spawning_popen,
    set_spawning_popen,
)
from typing import Any

from .process import Process


def _load(module: str, name: str) -> Any:
    """``fiber_dask.<module>.<name>``, imported whole even if Ctrl-C lands
    in the middle of that first import (:func:`fiber_dask.transparency.interrupts.deferred`)."""
    import importlib

    from .transparency.interrupts import deferred

    with deferred():
        return getattr(importlib.import_module(f"fiber_dask.{module}"), name)


__all__ = ["DaskContext", "get_context", "default_context"]

_Process = Process


class DaskContext:
    """A ``multiprocessing`` context whose objects live on a Dask cluster.

    Its start method is ``"spawn"``: every child is a fresh interpreter (on a
    Dask worker) that receives its target pickled, which is what code that asks
    ``get_start_method()`` needs to know.  There is one such context; the
    stdlib's other method names are accepted with a warning (see
    :meth:`set_start_method`).
    """

    _name = "spawn"

    # The class itself, as in the stdlib's contexts: users subclass it.
    Process = _Process

    ProcessError = multiprocessing.ProcessError
    BufferTooShort = multiprocessing.BufferTooShort
    TimeoutError = multiprocessing.TimeoutError
    AuthenticationError = multiprocessing.AuthenticationError

    def Pool(  # noqa: N802 - the stdlib's name
        self,
        processes: int | None = None,
        initializer: Any = None,
        initargs: Any = (),
        maxtasksperchild: int | None = None,
        **kwargs: Any,
    ) -> Any:
        """Returns a process pool object (see :class:`fiber_dask.pool.Pool`)."""
        Pool = _load("pool", "Pool")

        return Pool(
            processes, initializer, initargs, maxtasksperchild, context=self, **kwargs
        )

    def Queue(self, maxsize: int = 0) -> Any:  # noqa: N802
        """Returns a queue object usable from any process of the cluster."""
        Queue = _load("queues", "Queue")

        return Queue(maxsize, ctx=self)

    def JoinableQueue(self, maxsize: int = 0) -> Any:  # noqa: N802
        """Returns a joinable queue object usable from any process of the cluster."""
        JoinableQueue = _load("queues", "JoinableQueue")

        return JoinableQueue(maxsize, ctx=self)

    def SimpleQueue(self) -> Any:  # noqa: N802
        """Returns a simple queue object usable from any process of the cluster."""
        SimpleQueue = _load("queues", "SimpleQueue")

        return SimpleQueue(ctx=self)

    def Pipe(self, duplex: bool = True) -> Any:  # noqa: N802
        """Returns two connection objects connected by a pipe."""
        Pipe = _load("connection", "Pipe")

        return Pipe(duplex)

    def Lock(self) -> Any:  # noqa: N802
        """Returns a lock usable from any process of the cluster."""
        Lock = _load("synchronize", "Lock")

        return Lock(ctx=self)

    def RLock(self) -> Any:  # noqa: N802
        """Returns a recursive lock usable from any process of the cluster."""
        RLock = _load("synchronize", "RLock")

        return RLock(ctx=self)

    def Semaphore(self, value: int = 1) -> Any:  # noqa: N802
        """Returns a semaphore usable from any process of the cluster."""
        Semaphore = _load("synchronize", "Semaphore")

        return Semaphore(value, ctx=self)

    def BoundedSemaphore(self, value: int = 1) -> Any:  # noqa: N802
        """Returns a bounded semaphore usable from any process of the cluster."""
        BoundedSemaphore = _load("synchronize", "BoundedSemaphore")

        return BoundedSemaphore(value, ctx=self)

    def Condition(self, lock: Any = None) -> Any:  # noqa: N802
        """Returns a condition variable usable from any process of the cluster."""
        Condition = _load("synchronize", "Condition")

        return Condition(lock, ctx=self)

    def Barrier(
        self, parties: int, action: Any = None, timeout: float | None = None
    ) -> Any:  # noqa: N802
        """Returns a barrier usable from any process of the cluster."""
        Barrier = _load("synchronize", "Barrier")

        return Barrier(parties, action, timeout, ctx=self)

    def Value(self, typecode_or_type: Any, *args: Any, lock: Any = True) -> Any:  # noqa: N802
        """A ctypes value usable from any process of the cluster (not shared memory)."""
        Value = _load("sharedctypes", "Value")

        return Value(typecode_or_type, *args, lock=lock, ctx=self)

    def Array(
        self, typecode_or_type: Any, size_or_initializer: Any, *, lock: Any = True
    ) -> Any:  # noqa: N802
        """A ctypes array usable from any process of the cluster (not shared memory)."""
        Array = _load("sharedctypes", "Array")

        return Array(typecode_or_type, size_or_initializer, lock=lock, ctx=self)

    def RawValue(self, typecode_or_type: Any, *args: Any) -> Any:  # noqa: N802
        """A lock-less ctypes value usable from any process of the cluster."""
        RawValue = _load("sharedctypes", "RawValue")

        return RawValue(typecode_or_type, *args)

    def RawArray(self, typecode_or_type: Any, size_or_initializer: Any) -> Any:  # noqa: N802
        """A lock-less ctypes array usable from any process of the cluster."""
        RawArray = _load("sharedctypes", "RawArray")

        return RawArray(typecode_or_type, size_or_initializer)

    def Event(self) -> Any:  # noqa: N802
        """Returns an event usable from any process of the cluster."""
        Event = _load("synchronize", "Event")

        return Event(ctx=self)

    def Manager(self) -> Any:  # noqa: N802
        """Returns a started SyncManager whose objects every process of the
        cluster can use (see :mod:`fiber_dask.managers`)."""
        SyncManager = _load("managers", "SyncManager")

        m = SyncManager(ctx=self)
        m.start()
        return m

    def ThreadPool(self, processes=None, initializer=None, initargs=()):  # noqa: N802
        """The stdlib's ThreadPool: threads of this process, sharing its memory."""
        from multiprocessing.pool import ThreadPool

        return ThreadPool(processes, initializer, initargs)

    def cpu_count(self) -> int:
        """How many tasks the cluster runs at once (its worker threads).

        This is what ``Pool()`` uses by default, as the stdlib uses the
        machine's CPUs.  It binds to the cluster (starting the embedded one).
        """
        from . import cluster

        return cluster.task_slots()

    def get_context(self, method: str | None = None) -> DaskContext:
        """This context, whatever ``method`` names: children always start on
        Dask workers as fresh interpreters (``"spawn"``).  ``"fork"`` and
        ``"forkserver"`` warn that they are not used; an unknown method is a
        ``ValueError``, as in the stdlib."""
        _check_method(method)
        _warn_unused(method, "get_context")
        return self

    def get_start_method(self, allow_none: bool = False) -> str:
        """``"spawn"``: children are fresh interpreters on Dask workers."""
        return self._name

    def get_all_start_methods(self) -> list[str]:
        """The one start method fiber-dask has: ``["spawn"]``."""
        return [self._name]

    def set_start_method(self, method: str | None, force: bool = False) -> None:
        """Accepted so legacy scripts run: children always start on Dask workers.

        ``"spawn"`` (what happens; also its old name ``"dask"``), or None, is
        silent; ``"fork"`` and ``"forkserver"`` warn that they are not honoured;
        an unknown name is a ``ValueError``.  Like the stdlib, a second call
        without ``force=True`` is a ``RuntimeError``.
        """
        _check_method(method)
        if self._method_set and not force:
            raise RuntimeError("context has already been set")
        self._method_set = method is not None
        _warn_unused(method, "set_start_method")

    _method_set = False

    def freeze_support(self) -> None:
        """The stdlib's (a no-op except in frozen Windows executables)."""
        multiprocessing.freeze_support()

    def set_executable(self, executable: str) -> None:
        """Not used: children run the Python of their Dask worker; warns."""
        warnings.warn(
            "set_executable() is not used by fiber-dask: children run the Python "
            "interpreter of the Dask worker that hosts them.",
            RuntimeWarning,
            stacklevel=2,
        )

    def set_forkserver_preload(self, module_names: list[str]) -> None:
        """Not used (there is no forkserver); warns.  Like the stdlib's, a
        ``TypeError`` unless ``module_names`` is a list of strings."""
        if not all(type(name) is str for name in module_names):
            raise TypeError("module_names must be a list of strings")
        warnings.warn(
            "set_forkserver_preload() is not used by fiber-dask (there is no "
            "forkserver: children start on Dask workers).",
            RuntimeWarning,
            stacklevel=2,
        )

    def allow_connection_pickling(self) -> None:
        """Nothing to do: fiber-dask's Connections always pickle."""

    def log_to_stderr(self, level: int | None = None) -> Any:
        """The stdlib's multiprocessing logger, logging to stderr."""
        return multiprocessing.log_to_stderr(level)

    def get_logger(self) -> Any:
        """The stdlib's multiprocessing logger."""
        return multiprocessing.get_logger()

    @property
    def reducer(self) -> Any:
        """The stdlib's ``multiprocessing.reduction`` module."""
        from multiprocessing import reduction

        return reduction

    def current_process(self) -> Any:
        return multiprocessing.current_process()

    def active_children(self) -> list:
        """Live fiber-dask Processes started by this process."""
        active_children = _load("process", "active_children")

        return active_children()

    def parent_process(self) -> Any:
        return multiprocessing.parent_process()


default_context = DaskContext()

_METHODS = ("spawn", "dask", "fork", "forkserver")

# The stdlib's module names for its contexts and their Process classes: all of
# them are the one fiber-dask context (children are always spawned on workers).
BaseContext = DefaultContext = SpawnContext = DaskContext
ForkContext = ForkServerContext = DaskContext
SpawnProcess = ForkProcess = ForkServerProcess = Process


def _check_method(method: str | None) -> None:
    if method is not None and method not in _METHODS:
        raise ValueError(f"cannot find context for {method!r}")


def _warn_unused(method: str | None, caller: str) -> None:
    if method in ("fork", "forkserver"):
        warnings.warn(
            f"{caller}({method!r}): fiber-dask starts every child on a Dask worker "
            "as a fresh interpreter (the 'spawn' method); the start method "
            f"{method!r} is not used.",
            RuntimeWarning,
            stacklevel=3,
        )


def get_context(method: str | None = None) -> DaskContext:
    """The fiber-dask context (``method`` is accepted and ignored)."""
    return default_context.get_context(method)
