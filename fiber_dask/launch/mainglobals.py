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

:func:`keep_code_filenames` makes functions sent by value keep their source
file name: cloudpickle (3.x) names the code of every function it pickles by
value ``<dynamic-code>``, so a traceback printed by a child or a pool worker
said ``File "<dynamic-code>", line 12`` with no source line.  With the real
name, the traceback shows the file and line, and the source text too wherever
the file exists (always on the embedded cluster).
"""

from __future__ import annotations

import io
import pickle
import sys
import types
from typing import Any

__all__ = [
    "MainNamespace",
    "child_main",
    "dumps_for_child",
    "keep_code_filenames",
    "main_path",
]

_DYNAMIC = "<dynamic-code>"


def keep_code_filenames() -> None:
    """Make cloudpickle keep ``co_filename`` in the code it pickles by value.

    Installed once, by ``import fiber_dask``, in cloudpickle's own table of
    reducers (the code reducer is the one place that name is replaced); the
    rest of the pickled code object is cloudpickle's, unchanged.  If a future
    cloudpickle has no such table, functions keep travelling as they do there.
    """
    try:
        from cloudpickle import cloudpickle as cp

        table = cp.Pickler._dispatch_table
        original = table[types.CodeType]
    except (ImportError, AttributeError, KeyError):
        return
    if getattr(original, "_fiber_keeps_filenames", False):
        return

    def code_reduce(code: types.CodeType) -> Any:
        rv = original(code)
        try:
            make, args = rv
            i = args.index(_DYNAMIC)
        except ValueError:
            return rv
        if code.co_filename == _DYNAMIC:
            return rv
        return make, args[:i] + (code.co_filename,) + args[i + 1 :]

    code_reduce._fiber_keeps_filenames = True  # type: ignore[attr-defined]
    table[types.CodeType] = code_reduce


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


def main_path() -> str | None:
    """The main script's absolute path, as the stdlib's spawn preparation data
    carries it (``init_main_from_path``); None for an interactive session, a
    notebook, or ``python -m`` (a module, not a path)."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    spec = getattr(main, "__spec__", None)
    if not path or getattr(spec, "name", None) or not path.endswith(".py"):
        return None
    import os

    return os.path.abspath(path)


def child_main(cls: type, state: dict, path: str | None) -> None:
    """In a ``Process`` child: make ``__main__`` the namespace its ``__main__``
    functions (the target, a ``Process`` subclass's methods, sent by value)
    were defined in, as a stdlib child has its parent's script as ``__main__``.

    The stdlib's pickle finds a ``__main__`` function by name in
    ``sys.modules["__main__"]``: a child that passed one of them to a stdlib
    ``Pool`` failed (``attribute lookup sq on __main__ failed``), the child's
    ``__main__`` being fiber-dask's bootstrap.  The module made here answers
    every name from the functions' own globals (a module ``__getattr__``), so
    what pickle finds is the very object the code uses, and assignments to
    globals stay where the functions see them.  ``__file__`` is the parent's
    script where it exists on this host, so that a ``spawn`` or
    ``forkserver`` grandchild imports it, as the stdlib's do.
    """
    g = None
    target = state.get("_target")
    if _by_value_main_function(target):
        g = target.__globals__
    elif getattr(cls, "__module__", None) == "__main__":
        for value in vars(cls).values():
            if _by_value_main_function(value):
                g = value.__globals__
                break
    if g is None:
        return
    import os

    main = types.ModuleType("__mp_main__")

    def __getattr__(name: str) -> Any:  # noqa: N807 - PEP 562
        try:
            return g[name]
        except KeyError:
            raise AttributeError(
                f"module '__main__' has no attribute {name!r}"
            ) from None

    main.__getattr__ = __getattr__  # type: ignore[method-assign]
    if path and os.path.exists(path):
        main.__file__ = path
    sys.modules["__main__"] = sys.modules["__mp_main__"] = main


def dumps_for_child(obj: Any) -> bytes:
    """cloudpickle ``obj`` for a child process, with the stdlib's reducers.

    ``multiprocessing.reduction.ForkingPickler`` knows how to send objects that
    hold a file descriptor (``heap.BufferWrapper``'s arena, a socket, a stdlib
    ``Connection``) to a child; cloudpickle does not.  Types cloudpickle
    handles itself keep its reducers.  The descriptors travel through the
    stdlib's ``resource_sharer`` (a Unix socket): a child on another host gets
    a clear error when it unpickles them.
    """
    buf = io.BytesIO()
    _child_pickler()(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buf.getvalue()


_child_pickler_class: Any = None


def _child_pickler() -> Any:
    # Made once, on first use (cloudpickle is imported lazily).
    global _child_pickler_class
    if _child_pickler_class is None:
        from collections import ChainMap
        from multiprocessing.reduction import ForkingPickler

        import cloudpickle

        class ChildPickler(cloudpickle.Pickler):
            dispatch_table = ChainMap(
                cloudpickle.Pickler.dispatch_table,
                ForkingPickler._extra_reducers,  # the stdlib's registry
            )

        _child_pickler_class = ChildPickler
    return _child_pickler_class
