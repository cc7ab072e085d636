"""Classes and functions for the manager tests, importable by name in every
process (a manager's registry travels to its server process by pickle)."""

from __future__ import annotations

import multiprocessing.managers as std_managers
import os
import time

import fiber_dask.managers as fiber_managers


class Counter:
    """A custom class whose instances live in a manager's server."""

    def __init__(self, start=0):
        self.value = start

    def add(self, n=1):
        self.value += n
        return self.value

    def get(self):
        return self.value

    def pid(self):
        return os.getpid()

    def fail(self, message):
        raise KeyError(message)

    def slow(self, delay, value):
        time.sleep(delay)
        return value

    def child(self):
        # With method_to_typeid {"child": "Counter"}, the server calls the
        # Counter typeid's callable on this result: a new Counter(value * 10).
        return self.value * 10

    def _private(self):
        return "hidden"


class StdlibCounterManager(std_managers.BaseManager):
    pass


class FiberCounterManager(fiber_managers.BaseManager):
    pass


class FiberAsyncCounterManager(fiber_managers.AsyncManager):
    pass


for _cls in (StdlibCounterManager, FiberCounterManager):
    _cls.register("Counter", Counter)
    _cls.register(
        "ChildCounter",
        Counter,
        exposed=("get", "child"),
        method_to_typeid={"child": "Counter"},
    )
FiberAsyncCounterManager.register("Counter", Counter)


def counter_manager(ctx_name, **kwargs):
    if ctx_name == "stdlib":
        return StdlibCounterManager(**kwargs)
    return FiberCounterManager(**kwargs)


def connector_class(ctx_name):
    """A manager class that only connects (the typeid without a callable)."""
    base = (
        std_managers.BaseManager if ctx_name == "stdlib" else fiber_managers.BaseManager
    )
    cls = type(f"Connect{ctx_name}", (base,), {})
    cls.register("Counter")
    return cls
