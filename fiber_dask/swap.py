"""``fiber-dask run --swap-multiprocessing``: a legacy script's ``multiprocessing``
(and ``concurrent.futures.ProcessPoolExecutor``) is fiber_dask's.

An unmodified script (and the modules next to it) that says ``import multiprocessing``,
``import multiprocessing as mp``, ``from multiprocessing import Pool, Queue``,
``import multiprocessing.pool`` or ``from multiprocessing.pool import ThreadPool``
gets :mod:`fiber_dask` and its submodules, while dask, distributed, the stdlib and
every other library keep the real ``multiprocessing`` (distributed starts its worker
processes with it; they must stay real OS processes).

How: one ``builtins.__import__`` wrapper, deciding by *who imports*
-------------------------------------------------------------------
``sys.modules["multiprocessing"]`` cannot be replaced: it is shared by everyone.  What
differs between the user's ``import multiprocessing`` and distributed's is the module
the ``import`` statement runs in, and that module's globals are an argument of
``__import__``.  So the wrapper answers with fiber_dask when

* the importing module is the script itself: ``__name__`` is ``__main__`` (or
  ``__mp_main__``, the name a spawned child re-imports it under) and ``__file__`` is the
  script's path (functions of the script shipped by value with cloudpickle keep both
  in their globals, so this also holds for them on a worker), or
* the importing module's top-level name is a *user module*: one of the modules and
  packages in the script's directory (``helper.py``, ``mypkg/``), as found when the run
  starts, plus ``fiber.run.swap-modules`` from the config.  Names of modules already
  imported from somewhere else (a ``yaml.py`` next to the script cannot shadow the
  ``yaml`` that dask already loaded) and ``multiprocessing``/``fiber_dask`` are left out.

Every other importer goes straight to the original ``__import__``; the check costs a
string comparison for imports of anything but ``multiprocessing``.

Deciding by module *name* rather than by file location is what makes this hold on
workers: a worker imports ``helper`` from wherever the code is installed there (an
image's site-packages, an uploaded file), and a rule such as "not under site-packages"
would both miss that and catch editable installs of libraries.  The alternatives
considered and rejected: replacing ``sys.modules["multiprocessing"]`` (breaks
distributed's nanny); a meta-path loader that rewrites the user's source (does not
reach the script's functions shipped by value, and changes code the user debugs).

What ``multiprocessing.X`` resolves to
--------------------------------------
* ``multiprocessing`` → the :mod:`fiber_dask` package itself.
* ``multiprocessing.X`` for a submodule the stdlib has: ``fiber_dask.X`` if fiber_dask has
  it (``pool``, ``queues``, ``connection``, ``synchronize``, ``sharedctypes``,
  ``context``, ``process``, ``managers``), else the stdlib's ``multiprocessing.X``
  (``dummy``, ``shared_memory``, ``util``, ...), which is then also bound as the attribute
  ``fiber_dask.X`` so that ``import multiprocessing.dummy`` followed by
  ``multiprocessing.dummy.Pool`` works as usual.  Deeper names
  (``multiprocessing.dummy.connection``) follow their parent.
* a name the stdlib does not have: the stdlib's own ``ModuleNotFoundError``.

``concurrent.futures``
----------------------
The same importers get :class:`fiber_dask.futures.ProcessPoolExecutor` where they
import the stdlib's: ``from concurrent.futures import ProcessPoolExecutor``,
``import concurrent.futures [as cf]``, ``from concurrent import futures`` and
``from concurrent.futures.process import ProcessPoolExecutor`` answer with
:mod:`fiber_dask.futures` (every other name in it is the stdlib's own object:
``as_completed``, ``Future``, ``ThreadPoolExecutor``, ...) or a stand-in
``concurrent`` package whose ``futures`` is that module.  The real import runs
first, so the stdlib's modules are loaded as usual for everyone else.

User modules imported *before* the swap took effect in a process (a worker of a
long-lived cluster that imported ``helper`` for an earlier run, a module named in
``fiber.run.swap-modules`` that was already loaded) have their module-level names
that are bound to the stdlib's ``concurrent``, ``concurrent.futures``,
``concurrent.futures.process`` or ``ProcessPoolExecutor`` rebound when the swap
is activated: exactly what the import statement would have bound.

Where it is installed
---------------------
* the ``fiber-dask run`` process, before the script runs (:func:`activate`);
* worker processes the embedded cluster spawns: they inherit :data:`ENV_VAR` and the
  run makes ``__main__.__spec__`` name :mod:`fiber_dask._swapmain`, so ``multiprocessing``
  spawn starts each child by importing that stand-in, which installs the wrapper and
  then re-imports the script as ``__mp_main__`` as spawn would.  The wrapper is thus in
  place *before* the re-import runs the script's top-level ``import helper``;
* any worker, including those of an existing cluster or a Kubernetes one, and workers
  added later by adaptive scaling: a worker plugin (:func:`worker_plugin`) registered
  for the run; it also sets :data:`ENV_VAR` in the worker;
* children of ``fiber_dask.Process`` (:mod:`fiber_dask.launch.processchild`): they
  inherit :data:`ENV_VAR` from their worker and call :func:`install_from_environ`
  before loading the process object.

Limits
------
* ``importlib.import_module("multiprocessing")`` does not go through ``__import__``
  and returns the stdlib module.
* A user module that a worker had already imported before the run (a long-lived
  shared cluster) keeps the ``multiprocessing`` binding it got then (its
  ``concurrent.futures`` names are rebound, see above).
* User code outside the script's directory (an editable install of the user's own
  package) is only swapped when named in ``fiber.run.swap-modules``.
* ``concurrent.futures``: what was *derived* from the stdlib's executor before the
  swap keeps it (a subclass of ``ProcessPoolExecutor``, a default argument, an
  executor already created, a name bound inside a function or class); so do
  libraries that create their own executor (they are not user modules), and
  ``importlib.import_module("concurrent.futures")``.  ``isinstance(x,
  concurrent.futures.ProcessPoolExecutor)`` holds for fiber-dask's executor (it
  subclasses the stdlib's).
* Names that fiber_dask's submodules lack are not filled in from the stdlib's (a
  name missing would raise ``ImportError`` naming ``fiber_dask.<module>``); every
  public name of the stdlib's submodules exists in fiber_dask's, except the few
  internals tests/test_module_surface.py lists with their reasons.
"""

from __future__ import annotations

import builtins
import importlib
import importlib.util
import json
import os
import sys
import threading
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "ENV_VAR",
    "MAIN_ENV_VAR",
    "Spec",
    "activate",
    "active",
    "deactivate",
    "install_from_environ",
    "user_modules",
    "worker_plugin",
]

#: JSON list of the active specs, inherited by child processes.
ENV_VAR = "FIBER_DASK_SWAP"
#: The script a spawned child re-imports as ``__mp_main__`` (see fiber_dask._swapmain).
MAIN_ENV_VAR = "FIBER_DASK_SWAP_MAIN"

_NAME = "multiprocessing"
_ALWAYS_LIBRARY = frozenset(
    {"multiprocessing", "fiber_dask", "__main__", "__mp_main__"}
)


@dataclass(frozen=True)
class Spec:
    """Which importers get fiber_dask: the script and the user modules' names."""

    #: Absolute, normalised path of the script.
    script: str
    #: Top-level names of user modules.
    modules: frozenset[str] = field(default_factory=frozenset)
    #: Identifies one run (one worker plugin) on a shared cluster.
    key: str = field(default_factory=lambda: uuid.uuid4().hex[:12])

    @classmethod
    def for_script(cls, script: str, extra_modules: Iterable[str] = ()) -> Spec:
        """The spec for running ``script``: its directory's modules plus ``extra``."""
        path = _normpath(script)
        names = user_modules(os.path.dirname(path)) | set(extra_modules)
        return cls(path, frozenset(names - _ALWAYS_LIBRARY))

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "script": self.script, "modules": sorted(self.modules)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Spec:
        return cls(str(data["script"]), frozenset(data["modules"]), str(data["key"]))


def user_modules(directory: str) -> set[str]:
    """Top-level names importable from ``directory``: ``*.py`` files and packages.

    Directories count as (namespace) packages.  A name already imported from another
    place is left out: the module next to the script cannot be the one Python uses.
    """
    directory = _normpath(directory)
    names: set[str] = set()
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return names
    for entry in entries:
        name = entry.name
        try:
            if entry.is_file() and name.endswith(".py"):
                name = name[:-3]
            elif not entry.is_dir() or name == "__pycache__":
                continue
        except OSError:
            continue
        if name.isidentifier():
            names.add(name)
    for name in list(names):
        module = sys.modules.get(name)
        if module is not None and not _is_inside(module, directory):
            names.discard(name)
    return names


def _is_inside(module: Any, directory: str) -> bool:
    locations = [getattr(module, "__file__", None)]
    locations += list(getattr(module, "__path__", None) or [])
    prefix = directory.rstrip(os.sep) + os.sep
    return any(
        isinstance(p, str) and _normpath(p).startswith(prefix) for p in locations
    )


def _normpath(path: str) -> str:
    return os.path.normpath(os.path.abspath(path))


# ------------------------------------------------------------------- the wrapper

_lock = threading.RLock()
_active: dict[str, Spec] = {}
_original_import: Any = builtins.__import__
_stdlib_submodules: frozenset[str] | None = None


def active() -> list[Spec]:
    """The specs in force in this process."""
    return list(_active.values())


def activate(spec: Spec) -> None:
    """Give the importers ``spec`` describes fiber_dask from now on, in this process.

    Installs the ``__import__`` wrapper (once) and exports the active specs in
    :data:`ENV_VAR` for child processes.
    """
    global _original_import
    with _lock:
        _active[spec.key] = spec
        if builtins.__import__ is not _swap_import:
            _original_import = builtins.__import__
            builtins.__import__ = _swap_import
        _export()
        _rebind_user_modules()


def deactivate(key: str) -> None:
    """Undo :func:`activate` for the spec ``key``; the last one removes the wrapper.

    If someone wrapped ``__import__`` after us, ours stays below theirs as a
    pass-through.
    """
    with _lock:
        _active.pop(key, None)
        if not _active and builtins.__import__ is _swap_import:
            builtins.__import__ = _original_import
        _export()


def install_from_environ() -> None:
    """Activate the specs a parent process exported in :data:`ENV_VAR` (if any)."""
    raw = os.environ.get(ENV_VAR)
    if not raw:
        return
    try:
        specs = [Spec.from_json(d) for d in json.loads(raw)]
    except (ValueError, TypeError, KeyError):
        return  # not ours to complain about: run as the parent would without swap
    for spec in specs:
        activate(spec)


def _export() -> None:
    if _active:
        os.environ[ENV_VAR] = json.dumps([s.to_json() for s in _active.values()])
    else:
        os.environ.pop(ENV_VAR, None)


def _swap_import(
    name: str,
    globals: Mapping[str, Any] | None = None,  # noqa: A002 - __import__'s signature
    locals: Mapping[str, Any] | None = None,  # noqa: A002
    fromlist: Any = (),
    level: int = 0,
) -> Any:
    if (
        level == 0
        and name.startswith(_NAME)
        and (len(name) == len(_NAME) or name[len(_NAME)] == ".")
        and _active
    ):
        if globals is None:  # an explicit __import__("multiprocessing") call
            globals = sys._getframe(1).f_globals
        if _is_user(globals):
            return _import_swapped(name, globals, locals, fromlist)
    elif (
        level == 0
        and name.startswith(_CF_TOP)
        and (len(name) == len(_CF_TOP) or name[len(_CF_TOP)] == ".")
        and _active
    ):
        if globals is None:
            globals = sys._getframe(1).f_globals
        if _is_user(globals):
            return _import_swapped_futures(name, globals, locals, fromlist)
    return _original_import(name, globals, locals, fromlist, level)


def _is_user(g: Mapping[str, Any]) -> bool:
    try:
        name = g.get("__name__")
    except AttributeError:
        return False
    if not isinstance(name, str):
        return False
    if name in ("__main__", "__mp_main__"):
        file = g.get("__file__")
        if not isinstance(file, str):
            return False
        file = _normpath(file)
        return any(spec.script == file for spec in list(_active.values()))
    top = name.partition(".")[0]
    return any(top in spec.modules for spec in list(_active.values()))


def _import_swapped(name: str, g: Any, loc: Any, fromlist: Any) -> Any:
    # The package: Python imports it before any of its submodules, this one
    # included, so it is there (and the package root, which registers the
    # swap for children, is not imported back from below it).
    top = sys.modules[__package__]
    parts = name.split(".")
    module = top
    if len(parts) > 1:
        sub = _submodule(top, parts[1])
        if sub is None:
            # Not a submodule of the stdlib's multiprocessing either: its own error.
            return _original_import(name, g, loc, fromlist, 0)
        module = sub
        if len(parts) > 2:
            # Deeper names follow their parent (only the stdlib has subpackages).
            prefix = sub.__name__
            module = importlib.import_module(".".join([prefix, *parts[2:]]))
    if not fromlist:
        return top
    if module is top:
        for item in fromlist:
            if isinstance(item, str) and item != "*" and not hasattr(top, item):
                _submodule(top, item)
    elif module.__name__.startswith(_NAME + "."):
        # A stdlib (sub)package: let the real import load its fromlist submodules.
        _original_import(module.__name__, None, None, fromlist, 0)
    return module


def _submodule(top: Any, sub: str) -> Any:
    """``fiber_dask.<sub>`` if it exists, else stdlib ``multiprocessing.<sub>``.

    None if the stdlib has no such submodule either.
    """
    global _stdlib_submodules
    if _stdlib_submodules is None:
        import multiprocessing
        import pkgutil

        _stdlib_submodules = frozenset(
            m.name for m in pkgutil.iter_modules(multiprocessing.__path__)
        )
    if sub not in _stdlib_submodules:
        return None
    ours = "fiber_dask." + sub
    if ours in sys.modules or importlib.util.find_spec(ours) is not None:
        return importlib.import_module(ours)
    module = importlib.import_module(_NAME + "." + sub)
    if not hasattr(top, sub):
        setattr(top, sub, module)
    return module


# ------------------------------------------------------------ concurrent.futures

_CF_TOP = "concurrent"
_concurrent_view: Any = None


def _futures_views() -> tuple[Any, Any]:
    """The stand-ins a user module gets: a ``concurrent`` package whose
    ``futures`` is :mod:`fiber_dask.futures` (other names fall through to the
    real package), and :mod:`fiber_dask.futures` itself."""
    global _concurrent_view
    futures = importlib.import_module("fiber_dask.futures")
    if _concurrent_view is None:
        import types

        real = importlib.import_module(_CF_TOP)

        class ConcurrentView(types.ModuleType):
            def __getattr__(self, name: str) -> Any:
                return getattr(real, name)

        view = ConcurrentView(_CF_TOP, real.__doc__)
        view.futures = futures  # type: ignore[attr-defined]
        view.__path__ = list(getattr(real, "__path__", []))  # type: ignore[attr-defined]
        _concurrent_view = view
    return _concurrent_view, futures


def _import_swapped_futures(name: str, g: Any, loc: Any, fromlist: Any) -> Any:
    """``import concurrent.futures`` & co. in a user module: the real import
    runs first (same errors, same side effects), then the names that lead to
    ``ProcessPoolExecutor`` are answered with fiber-dask's."""
    real = _original_import(name, g, loc, fromlist, 0)
    parts = name.split(".")
    if len(parts) > 1 and parts[1] != "futures":
        return real  # another concurrent.* package: not ours to change
    top, futures = _futures_views()
    if not fromlist:
        return top  # `import concurrent.futures[.x]` binds the top package
    if len(parts) == 1:
        return top  # `from concurrent import futures`
    if len(parts) == 2:
        return futures  # `from concurrent.futures import ProcessPoolExecutor`
    if parts[2:] == ["process"]:
        return futures.process  # `from concurrent.futures.process import ...`
    return real  # thread, _base: unchanged


def _rebind_user_modules() -> None:
    """Give user modules imported *before* the swap fiber-dask's executor.

    Only module-level names bound to the stdlib's ``concurrent``,
    ``concurrent.futures``, ``concurrent.futures.process`` or
    ``ProcessPoolExecutor`` themselves are rebound: those are what an import
    statement would have bound had the swap been in place.  Anything derived
    from them (a subclass, a default argument, an executor already created, a
    name inside a function or class) keeps the stdlib's; see the module's
    limits.
    """
    cf = sys.modules.get("concurrent.futures")
    if cf is None or not _active:
        return
    import concurrent.futures.process as stdlib_process

    top, futures = _futures_views()
    replace = {
        id(sys.modules[_CF_TOP]): top,
        id(cf): futures,
        id(stdlib_process): futures.process,
        id(stdlib_process.ProcessPoolExecutor): futures.ProcessPoolExecutor,
    }
    for modname, module in list(sys.modules.items()):
        top_name = modname.partition(".")[0]
        if top_name in _ALWAYS_LIBRARY or not any(
            top_name in spec.modules for spec in list(_active.values())
        ):
            continue
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for key, value in list(namespace.items()):
            new = replace.get(id(value))
            if new is not None and not key.startswith("__"):
                namespace[key] = new


# ---------------------------------------------------------------- worker plugin


def worker_plugin(spec: Spec) -> Any:
    """A ``distributed.WorkerPlugin`` that activates ``spec`` in every worker.

    Register it with ``client.register_plugin(plugin, name=plugin.name)``; the
    scheduler also hands it to workers that join later.  Unregistering it (or the
    worker closing) deactivates the spec again.
    """
    return _plugin_class()(spec.to_json())


_plugin_cls: Any = None


def _plugin_class() -> Any:
    # distributed is imported only when a plugin is wanted: the stand-in main and
    # fiber_dask.launch.processchild import this module and should stay light.
    global _plugin_cls
    if _plugin_cls is None:
        from distributed.diagnostics.plugin import WorkerPlugin

        class SwapPlugin(WorkerPlugin):
            """Activates one ``fiber-dask run --swap-multiprocessing`` in a worker."""

            idempotent = True

            def __init__(self, spec: Mapping[str, Any]) -> None:
                self.spec = dict(spec)
                self.name = f"fiber-dask-swap-{self.spec['key']}"

            def setup(self, worker: Any) -> None:
                activate(Spec.from_json(self.spec))

            def teardown(self, worker: Any) -> None:
                deactivate(self.spec["key"])

        SwapPlugin.__module__ = __name__
        SwapPlugin.__qualname__ = "SwapPlugin"
        _plugin_cls = SwapPlugin
    return _plugin_cls


def __getattr__(name: str) -> Any:
    # ``fiber_dask.swap.SwapPlugin`` for pickle, created on first use.
    if name == "SwapPlugin":
        return _plugin_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
