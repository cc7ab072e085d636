"""``fiber-dask run script.py [args...]``: run a script as ``python script.py`` would.

The script runs in this process as the module ``__main__`` (``sys.argv``, ``sys.path[0]``,
``__file__`` and the exit status as with ``python script.py``), against the cluster the
config and options choose.  The embedded cluster starts when the script first needs
it, and ``multiprocessing``'s spawn method (which Dask uses for its worker processes)
finds the script through ``sys.modules["__main__"].__file__`` and re-imports it in each
worker as ``__mp_main__``: code under ``if __name__ == "__main__":`` does not run
there, as with the stdlib.

With ``--swap-multiprocessing`` (or ``fiber.run.swap-multiprocessing: true``) the
script's own ``multiprocessing`` is fiber_dask (and its ``concurrent.futures.
ProcessPoolExecutor`` fiber_dask's); see :mod:`fiber_dask.swap`.
"""

from __future__ import annotations

import atexit
import builtins
import contextlib
import importlib.machinery
import io
import os
import sys
import types
from typing import Any

import click

from ..launch import mainguard
from ._common import (
    CONTEXT_SETTINGS,
    CLIError,
    apply_config,
    cluster_options,
    config_option,
)


@click.command(
    context_settings={**CONTEXT_SETTINGS, "allow_interspersed_args": False},
    short_help="Run a Python script on the cluster.",
)
@config_option
@cluster_options
@click.option(
    "--swap-multiprocessing/--no-swap-multiprocessing",
    "swap_mp",
    default=None,
    help=(
        "Give the script (and the modules in its directory) fiber_dask where they "
        "import multiprocessing, and fiber_dask's ProcessPoolExecutor where they "
        "import concurrent.futures, so an unmodified program runs on the "
        "cluster; libraries keep the stdlib's. "
        "Default: fiber.run.swap-multiprocessing (false)."
    ),
)
@click.option(
    "-m",
    "as_module",
    is_flag=True,
    help="SCRIPT is a module name: run it as `python -m SCRIPT` would.",
)
@click.argument("script", metavar="SCRIPT")
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def run(
    config_files: tuple[str, ...],
    backend: str | None,
    address: str | None,
    swap_mp: bool | None,
    as_module: bool,
    script: str,
    args: tuple[str, ...],
) -> None:
    """Run SCRIPT with ARGS as `python SCRIPT ARGS` would, on the cluster.

    SCRIPT is a file, `-` for the script on standard input (as `python -`), or
    with -m a module (as `python -m`).  The script's exit status is the
    command's.  Options go before SCRIPT; everything after it is passed to the
    script (use `--` before SCRIPT if its name starts with '-').

    \b
    Examples:
      fiber-dask run train.py --epochs 3
      fiber-dask run -m mypackage.train --epochs 3
      cat job.py | fiber-dask run - --epochs 3
      fiber-dask run --config adapters/kubernetes.yaml train.py
      fiber-dask run --address tcp://10.0.0.5:8786 --swap-multiprocessing legacy.py
    """
    if not as_module and script != "-":
        # As click.Path(exists=True) would say it: a usage error (status 2).
        ctx = click.get_current_context()
        param = next(p for p in ctx.command.params if p.name == "script")
        script = click.Path(exists=True, dir_okay=False).convert(script, param, ctx)
    loaded = apply_config(config_files, backend=backend, address=address)
    run_config = loaded.fiber.get("run", {})
    if swap_mp is None:
        swap_mp = bool(run_config.get("swap-multiprocessing"))
    if swap_mp and (as_module or script == "-"):
        what = "-m MODULE" if as_module else "a script from stdin"
        raise CLIError(
            f"--swap-multiprocessing does not support {what} yet: the workers "
            "re-import the script from its file to swap its imports. Save it to a "
            "file and run `fiber-dask run --swap-multiprocessing FILE`."
        )

    if as_module:
        code, module, source = _module(script)
        sys.argv = [module.__file__ or script, *args]
        if sys.path and not getattr(sys.flags, "safe_path", False):
            sys.path[0] = os.getcwd()  # as python -m
    elif script == "-":
        code, module, source = _stdin()
        sys.argv = ["-", *args]
        if sys.path and not getattr(sys.flags, "safe_path", False):
            sys.path[0] = ""  # as python -
    else:
        path = os.path.abspath(script)
        source = _read(path)
        code = _compile(source, path)
        module = _main_module(path)
        sys.argv = [script, *args]
        # python puts the script's directory first on sys.path where it put the
        # console script's (unless -P / PYTHONSAFEPATH asked for neither).
        if sys.path and not getattr(sys.flags, "safe_path", False):
            sys.path[0] = os.path.dirname(os.path.realpath(path))

    # Workers of the embedded cluster import the script (not one from stdin, which
    # has no file): without a main guard that must not start the cluster.
    guard = contextlib.nullcontext()
    if script != "-" and not mainguard.has_main_guard(source):
        guard = mainguard.unguarded(code.co_filename)
    with guard:
        if swap_mp:
            _start_swap(module, module.__file__, run_config.get("swap-modules", []))
        else:
            sys.modules["__main__"] = module
        _execute(code, module)


def _read(path: str) -> bytes:
    try:
        with io.open_code(path) as f:
            return f.read()
    except OSError as e:
        raise CLIError(f"cannot read {path}: {e.strerror or e}") from None


def _stdin() -> tuple[types.CodeType, types.ModuleType, bytes]:
    """The script on standard input, as ``python -`` runs it.

    Unlike python, ``__file__`` is not set: multiprocessing's spawn method would
    make every worker process of the embedded cluster import a file named
    ``<stdin>``, which does not exist.  Without it the workers import no main
    module, and the script's functions travel by value (cloudpickle).
    """
    source = sys.stdin.buffer.read()
    module = types.ModuleType("__main__")
    module.__loader__ = None  # type: ignore[assignment]
    module.__package__ = None
    module.__spec__ = None
    module.__builtins__ = builtins  # type: ignore[attr-defined]
    return _compile(source, "<stdin>"), module, source


def _module(name: str) -> tuple[types.CodeType, types.ModuleType, bytes]:
    """The module ``name`` (a package: its ``__main__``), as ``python -m`` finds it.

    Its ``__spec__`` names the module, so spawned workers import it by name (as
    ``__mp_main__``), as with ``python -m`` and the stdlib's spawn method.
    """
    import runpy

    sys.path.insert(0, os.getcwd())  # python -m finds modules in the cwd
    try:
        mod_name, spec, code = runpy._get_module_details(name)  # type: ignore[attr-defined]
    except ImportError as e:
        # python -m's own words: "No module named ...", "... is a package and
        # cannot be directly executed", "Relative module names not supported".
        raise CLIError(str(e)) from None
    except Exception as e:  # noqa: BLE001 - runpy's _Error, or the import's error
        if type(e).__name__ == "_Error":
            raise CLIError(str(e)) from None
        raise
    finally:
        sys.path.pop(0)
    module = types.ModuleType("__main__")
    module.__file__ = spec.origin
    module.__cached__ = spec.cached  # type: ignore[attr-defined]
    module.__loader__ = spec.loader
    module.__package__ = spec.parent
    module.__spec__ = spec
    module.__builtins__ = builtins  # type: ignore[attr-defined]
    try:
        source = spec.loader.get_source(mod_name) or b""
    except Exception:  # noqa: BLE001 - no source (a .pyc): assume a guard
        source = b"if __name__ == '__main__': pass"
    return code, module, source if isinstance(source, bytes) else source.encode()


def _compile(source: bytes, path: str) -> types.CodeType:
    try:
        return compile(source, path, "exec", dont_inherit=True)
    except (SyntaxError, ValueError) as e:
        # As python prints it: file, line, caret; no frames of ours.
        import traceback

        traceback.print_exception(type(e), e, None)
        sys.exit(1)


def _main_module(path: str) -> types.ModuleType:
    """A fresh ``__main__`` with the attributes ``python path`` gives it."""
    module = types.ModuleType("__main__")
    module.__file__ = path
    module.__cached__ = None  # type: ignore[attr-defined]
    module.__loader__ = importlib.machinery.SourceFileLoader("__main__", path)
    module.__package__ = None
    module.__spec__ = None
    module.__builtins__ = builtins  # type: ignore[attr-defined]
    return module


def _start_swap(module: types.ModuleType, path: str, extra: list[str]) -> None:
    """Swap multiprocessing here and on the workers, then bind the cluster.

    The cluster is bound before the script runs so that the worker plugin is in
    place before any task can import a user module on a worker.
    """
    from .. import swap
    from ..errors import ClusterConnectionError, ConfigError

    spec = swap.Spec.for_script(path, extra)
    os.environ[swap.MAIN_ENV_VAR] = spec.script
    swap.activate(spec)
    # Spawned children (the embedded cluster's workers) import the stand-in main
    # first; it installs the swap and then re-imports the script as __mp_main__.
    module.__spec__ = importlib.machinery.ModuleSpec(
        "fiber_dask._swapmain", None, origin=path
    )
    sys.modules["__main__"] = module

    from .. import cluster

    try:
        handle = cluster.get_handle()
    except ClusterConnectionError as e:
        raise CLIError(str(e)) from None
    except (ConfigError, OSError, TimeoutError) as e:
        raise CLIError(f"cannot start or reach the cluster: {e}") from None
    except mainguard.MainGuardError as e:
        raise CLIError(str(e)) from None
    except RuntimeError as e:
        # Typically a worker process that failed while importing the script.
        raise CLIError(
            f"cannot start the cluster: {e} The worker processes' own errors are "
            "above. Worker processes import the script, as multiprocessing's spawn "
            "method does: code at its top level that starts work must be under "
            "`if __name__ == '__main__':`."
        ) from None
    plugin = swap.worker_plugin(spec)
    handle.client.register_plugin(plugin, name=plugin.name)
    if not handle.owned:
        # A cluster we attached to outlives us: take the plugin off its workers.
        atexit.register(_unregister, handle.client, plugin.name)


def _unregister(client: Any, name: str) -> None:
    try:
        if client.status == "running":
            client.unregister_worker_plugin(name)
    except Exception:  # noqa: BLE001 - best effort at exit
        pass


def _exec(code: types.CodeType, namespace: dict[str, Any]) -> None:
    exec(code, namespace)


def _execute(code: types.CodeType, module: types.ModuleType) -> None:
    """Run the script; an uncaught exception is printed as python prints it."""
    try:
        _exec(code, module.__dict__)
    except SystemExit:
        raise
    except mainguard.MainGuardError as e:
        raise CLIError(str(e)) from None
    except BaseException as e:  # noqa: BLE001 - everything python would print
        tb = e.__traceback__
        while tb is not None and tb.tb_frame.f_code is not _exec.__code__:
            tb = tb.tb_next
        tb = tb.tb_next if tb is not None else e.__traceback__
        sys.excepthook(type(e), e.with_traceback(tb), tb)
        sys.exit(130 if isinstance(e, KeyboardInterrupt) else 1)
