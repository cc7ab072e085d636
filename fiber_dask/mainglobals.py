"""One ``__main__`` namespace per pool worker, as a spawned stdlib worker has.

A stdlib pool worker imports the main script once, so an initializer that sets
a global (``global _table; _table = ...``) is seen by every task function
after it.  On a Dask worker the script is usually not importable (another
host), so cloudpickle sends ``__main__`` functions by value, each pickle with
its own copy of the globals they use: the initializer's assignment would land
in a dict no task function reads.

:class:`MainNamespace` gives the functions a loop receives one shared globals
dict: the first function's, with later functions rebound to it.  Names it
already has keep their worker-side values (what the initializer or earlier
tasks set), like module state in a stdlib worker; names it lacks are added.
"""

from __future__ import annotations

import sys
import types
from typing import Any

__all__ = ["MainNamespace"]


class MainNamespace:
    def __init__(self) -> None:
        self.ns: dict | None = None

    def adopt(self, obj: Any) -> Any:
        """``obj``, or a copy of it whose globals are the shared namespace."""
        if not _by_value_main_function(obj):
            return obj
        g = obj.__globals__
        if self.ns is None:
            self.ns = g
            return obj
        if g is self.ns:
            return obj
        for name, value in g.items():
            if name not in self.ns:
                if isinstance(value, types.FunctionType) and value.__globals__ is g:
                    value = self._copy(value)
                self.ns[name] = value
        return self._copy(obj)

    def _copy(self, f: types.FunctionType) -> types.FunctionType:
        new = types.FunctionType(
            f.__code__, self.ns, f.__name__, f.__defaults__, f.__closure__
        )
        new.__kwdefaults__ = f.__kwdefaults__
        new.__qualname__ = f.__qualname__
        new.__module__ = f.__module__
        new.__doc__ = f.__doc__
        new.__dict__.update(f.__dict__)
        return new


def _by_value_main_function(obj: Any) -> bool:
    if not isinstance(obj, types.FunctionType) or obj.__module__ != "__main__":
        return False
    main = sys.modules.get("__main__")
    # A function whose globals are this process's real __main__ came by
    # reference (the worker imported the script): already shared.
    return main is None or obj.__globals__ is not vars(main)
