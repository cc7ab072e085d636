"""The module-level names legacy scripts call before any pool or process."""

from __future__ import annotations

import importlib
import inspect
import multiprocessing
import os
import subprocess
import sys
import textwrap
import types
import warnings

import pytest
from support.mirrors import SUBMODULES

import fiber_dask

pytestmark = pytest.mark.timeout(60)


def test_every_stdlib_public_name_exists():
    assert sorted(set(multiprocessing.__all__) - set(dir(fiber_dask))) == []


# Public names of a stdlib submodule that fiber_dask's does not have, and why.
# Anything missing that is not listed here fails the test.
NOT_PROVIDED = {
    "synchronize": {
        # CPython internals: the POSIX-semaphore base class of the stdlib's locks
        # (fiber-dask's live in their owner process and are served over TCP).
        "SemLock": "CPython internals",
    },
    "pool": {
        # The stdlib pool worker's own loop and its helpers; the Pool core
        # (fiber_dask.pool) is being rewritten and decides which it keeps.
        "ExceptionWithTraceback": "pool: being fixed in the Pool core",
        "rebuild_exc": "pool: being fixed in the Pool core",
        "job_counter": "CPython internals (a global job counter)",
        "mapstar": "CPython internals (the stdlib worker's task helpers)",
        "starmapstar": "CPython internals (the stdlib worker's task helpers)",
        "worker": "CPython internals (the stdlib worker process's loop)",
    },
}


def stdlib_public_names(module: types.ModuleType) -> set[str]:
    """What a stdlib submodule offers: ``__all__``, the classes and functions it
    defines, and its constants (names imported from elsewhere do not count)."""
    names = set(getattr(module, "__all__", ()))
    for name, obj in vars(module).items():
        if name.startswith("_") or isinstance(obj, types.ModuleType):
            continue
        if inspect.isclass(obj) or inspect.isfunction(obj):
            if obj.__module__ == module.__name__:
                names.add(name)
        elif not callable(obj):
            names.add(name)
    return names


@pytest.mark.parametrize("sub", SUBMODULES)
def test_every_stdlib_submodule_name_exists(sub):
    std = importlib.import_module(f"multiprocessing.{sub}")
    ours = importlib.import_module(f"fiber_dask.{sub}")
    expected = stdlib_public_names(std) - set(NOT_PROVIDED.get(sub, {}))
    assert sorted(n for n in expected if not hasattr(ours, n)) == []
    # The exclusions stay true: a name that appears is removed from the list.
    assert [n for n in NOT_PROVIDED.get(sub, {}) if hasattr(ours, n)] == []


def test_connection_names_are_the_stdlibs_socket_half():
    from multiprocessing import connection as std

    from fiber_dask import connection

    for name in ("Listener", "Client", "deliver_challenge", "answer_challenge"):
        assert getattr(connection, name) is getattr(std, name)
    assert connection.families == std.families
    assert connection.wait is not std.wait  # ours also waits on fiber-dask ends


def test_start_methods_are_accepted_and_explained():
    ctx = fiber_dask.DaskContext()  # a fresh one: the start method is per context
    # Children are fresh interpreters that receive their target pickled.
    assert ctx.get_start_method() == "spawn"
    assert ctx.get_all_start_methods() == ["spawn"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ctx.set_start_method("spawn")  # silent: it is what happens
    with pytest.raises(RuntimeError, match="already been set"):
        ctx.set_start_method("spawn")
    with pytest.warns(RuntimeWarning, match="'fork' is not used"):
        ctx.set_start_method("fork", force=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ctx.set_start_method("dask", force=True)  # the old name, still accepted
    with pytest.raises(ValueError, match="cannot find context"):
        ctx.set_start_method("teleport", force=True)
    with pytest.warns(RuntimeWarning, match="'forkserver' is not used"):
        assert fiber_dask.get_context("forkserver") is fiber_dask.get_context()
    assert fiber_dask.get_context("spawn").get_start_method() == "spawn"
    with pytest.raises(ValueError):
        fiber_dask.get_context("teleport")


def test_helpers_behave_like_the_stdlib():
    fiber_dask.freeze_support()
    fiber_dask.allow_connection_pickling()
    assert fiber_dask.get_logger() is multiprocessing.get_logger()
    assert fiber_dask.reducer is multiprocessing.reducer
    with pytest.warns(RuntimeWarning):
        fiber_dask.set_executable(sys.executable)
    with pytest.warns(RuntimeWarning):
        fiber_dask.set_forkserver_preload(["json"])


def test_star_import_gives_the_stdlib_names(tmp_path):
    script = tmp_path / "star.py"
    script.write_text(
        textwrap.dedent("""
        from fiber_dask import *
        import multiprocessing
        missing = [n for n in multiprocessing.__all__ if n not in globals()]
        print(missing)
    """)
    )
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=60,
        env=dict(os.environ),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
