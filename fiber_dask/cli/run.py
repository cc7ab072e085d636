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
import importlib.machinery
import io
import os
import sys
import types
from typing import Any

import click

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
@click.argument("script", type=click.Path(exists=True, dir_okay=False))
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def run(
    config_files: tuple[str, ...],
    backend: str | None,
    address: str | None,
    swap_mp: bool | None,
    script: str,
    args: tuple[str, ...],
) -> None:
    """Run SCRIPT with ARGS as `python SCRIPT ARGS` would, on the cluster.

    The script's exit status is the command's.  Options go before SCRIPT; everything
    after it is passed to the script (use `--` before SCRIPT if its name starts
    with '-').

    \b
    Examples:
      fiber-dask run train.py --epochs 3
      fiber-dask run --config adapters/kubernetes.yaml train.py
      fiber-dask run --address tcp://10.0.0.5:8786 --swap-multiprocessing legacy.py
    """
    loaded = apply_config(config_files, backend=backend, address=address)
    run_config = loaded.fiber.get("run", {})
    if swap_mp is None:
        swap_mp = bool(run_config.get("swap-multiprocessing"))
    path = os.path.abspath(script)
    code = _compile(path)
    module = _main_module(path)

    sys.argv = [script, *args]
    # python puts the script's directory first on sys.path where it put the console
    # script's (unless -P / PYTHONSAFEPATH asked for neither).
    if sys.path and not getattr(sys.flags, "safe_path", False):
        sys.path[0] = os.path.dirname(os.path.realpath(path))

    if swap_mp:
        _start_swap(module, path, run_config.get("swap-modules", []))
    else:
        sys.modules["__main__"] = module
    _execute(code, module)


def _compile(path: str) -> types.CodeType:
    try:
        with io.open_code(path) as f:
            source = f.read()
    except OSError as e:
        raise CLIError(f"cannot read {path}: {e.strerror or e}") from None
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
    from ..config import ConfigError
    from ..errors import ClusterConnectionError

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
    except BaseException as e:  # noqa: BLE001 - everything python would print
        tb = e.__traceback__
        while tb is not None and tb.tb_frame.f_code is not _exec.__code__:
            tb = tb.tb_next
        tb = tb.tb_next if tb is not None else e.__traceback__
        sys.excepthook(type(e), e.with_traceback(tb), tb)
        sys.exit(130 if isinstance(e, KeyboardInterrupt) else 1)
