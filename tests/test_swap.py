"""fiber_dask.swap: who gets fiber_dask for ``multiprocessing`` and
``concurrent.futures`` (the script and its user modules), who keeps the stdlib
(everyone else), ``fiber.run.swap-modules``, and undoing it.

Most tests run the import statements in this process with the globals of the
module that would run them (the script, a user module, a library): the swap
decides by those globals, as it does in ``fiber-dask run``.  The last ones run
scripts end to end.
"""

from __future__ import annotations

import builtins
import concurrent.futures
import importlib
import json
import multiprocessing
import multiprocessing.pool
import os
import subprocess
import sys
import types

import pytest

import fiber_dask
import fiber_dask.futures
import fiber_dask.pool
from fiber_dask import swap

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def script(tmp_path):
    """A script with a user module and a user package beside it."""
    (tmp_path / "helper.py").write_text("")
    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "__init__.py").write_text("")
    path = tmp_path / "legacy.py"
    path.write_text("")
    return path


@pytest.fixture
def swapped(monkeypatch):
    """``activate(spec)``, every spec undone at the end (also on failure)."""
    monkeypatch.delenv(swap.ENV_VAR, raising=False)
    keys = []

    def activate(spec):
        keys.append(spec.key)
        swap.activate(spec)
        return spec

    yield activate
    for key in keys:
        swap.deactivate(key)
    assert builtins.__import__ is not swap._swap_import


def run_as(module_globals: dict, source: str) -> dict:
    """Run ``source`` as the module with ``module_globals`` would; its names."""
    namespace = dict(module_globals)
    exec(source, namespace)  # noqa: S102 - the import statements under test
    return namespace


def script_globals(path) -> dict:
    return {"__name__": "__main__", "__file__": str(path)}


MULTIPROCESSING_IMPORTS = """
import multiprocessing
import multiprocessing as mp
from multiprocessing import Pool, Queue
import multiprocessing.pool
from multiprocessing.pool import ThreadPool
from multiprocessing import dummy
"""


def test_the_script_and_its_modules_get_fiber_dask_libraries_the_stdlib(
    script, swapped
):
    swapped(swap.Spec.for_script(str(script)))
    for importer in (
        script_globals(script),
        {"__name__": "__mp_main__", "__file__": str(script)},  # a spawned child
        {"__name__": "helper"},
        {"__name__": "mypkg.sub"},
    ):
        got = run_as(importer, MULTIPROCESSING_IMPORTS)
        assert got["multiprocessing"] is fiber_dask, importer
        assert got["mp"] is fiber_dask
        assert got["Pool"] is fiber_dask.Pool and got["Queue"] is fiber_dask.Queue
        assert got["ThreadPool"] is fiber_dask.pool.ThreadPool
        # A submodule fiber_dask does not replace is the stdlib's own.
        assert got["dummy"] is importlib.import_module("multiprocessing.dummy")
    for importer in (
        {"__name__": "distributed.nanny"},
        {"__name__": "__main__", "__file__": str(script.parent / "other.py")},
        {"__name__": "helperx"},
    ):
        got = run_as(importer, MULTIPROCESSING_IMPORTS)
        assert got["multiprocessing"] is multiprocessing, importer
        assert got["Pool"] is multiprocessing.Pool
        assert got["ThreadPool"] is multiprocessing.pool.ThreadPool
    assert sys.modules["multiprocessing"] is multiprocessing  # shared, untouched
    with pytest.raises(ModuleNotFoundError, match="multiprocessing.nosuch"):
        run_as(script_globals(script), "import multiprocessing.nosuch")


FUTURES_IMPORTS = """
import concurrent.futures
import concurrent.futures as cf
from concurrent import futures
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor, wait
from concurrent.futures.process import ProcessPoolExecutor as PPE
"""


def test_concurrent_futures_gives_fiber_dasks_executor_to_the_script_only(
    script, swapped
):
    swapped(swap.Spec.for_script(str(script)))
    got = run_as(script_globals(script), FUTURES_IMPORTS)
    ours = fiber_dask.futures.ProcessPoolExecutor
    assert got["ProcessPoolExecutor"] is ours and got["PPE"] is ours
    assert got["cf"] is fiber_dask.futures and got["futures"] is fiber_dask.futures
    assert got["concurrent"].futures.ProcessPoolExecutor is ours
    # Every other name is the stdlib's own object.
    assert got["ThreadPoolExecutor"] is concurrent.futures.ThreadPoolExecutor
    assert got["wait"] is concurrent.futures.wait
    assert issubclass(ours, concurrent.futures.ProcessPoolExecutor)
    library = run_as({"__name__": "somelib"}, FUTURES_IMPORTS)
    assert library["ProcessPoolExecutor"] is concurrent.futures.ProcessPoolExecutor
    assert library["cf"] is concurrent.futures


def test_user_modules_are_the_scripts_directory_plus_swap_modules(script, swapped):
    (script.parent / "yaml.py").write_text("")  # shadowed: dask loaded the real one
    (script.parent / "__pycache__").mkdir()
    (script.parent / "not-a-name.py").write_text("")
    (script.parent / "multiprocessing.py").write_text("")
    spec = swap.Spec.for_script(str(script), extra_modules=["ourlib"])
    assert spec.modules == {"helper", "mypkg", "legacy", "ourlib"}
    swapped(spec)
    # fiber.run.swap-modules names code that lives elsewhere (an editable
    # install of the user's own package): swapped, and its submodules too.
    assert (
        run_as({"__name__": "ourlib.tasks"}, MULTIPROCESSING_IMPORTS)["multiprocessing"]
        is fiber_dask
    )
    # The spec travels to child processes in the environment.
    (exported,) = json.loads(os.environ[swap.ENV_VAR])
    assert swap.Spec.from_json(exported) == spec


def test_deactivate_unswaps_and_the_last_one_removes_the_wrapper(script, swapped):
    original = builtins.__import__
    first = swapped(swap.Spec.for_script(str(script)))
    second = swapped(swap.Spec(first.script, frozenset({"other"})))
    assert builtins.__import__ is swap._swap_import
    swap.deactivate(first.key)
    # The other spec is still in force, for its own importers only.
    assert (
        run_as({"__name__": "other"}, "import multiprocessing")["multiprocessing"]
        is fiber_dask
    )
    assert (
        run_as({"__name__": "helper"}, "import multiprocessing")["multiprocessing"]
        is multiprocessing
    )
    swap.deactivate(second.key)
    assert builtins.__import__ is original
    assert swap.ENV_VAR not in os.environ and swap.active() == []
    got = run_as(script_globals(script), MULTIPROCESSING_IMPORTS + FUTURES_IMPORTS)
    assert got["multiprocessing"] is multiprocessing
    assert got["ProcessPoolExecutor"] is concurrent.futures.ProcessPoolExecutor


def test_a_wrapper_installed_over_the_swap_stays_in_place(script, swapped):
    spec = swapped(swap.Spec.for_script(str(script)))
    below = builtins.__import__
    seen = []

    def theirs(name, *args, **kwargs):
        seen.append(name)
        return below(name, *args, **kwargs)

    builtins.__import__ = theirs
    try:
        swap.deactivate(spec.key)
        assert builtins.__import__ is theirs  # not torn out from under them
        got = run_as(script_globals(script), "import multiprocessing")
        assert got["multiprocessing"] is multiprocessing  # ours passes through
        assert "multiprocessing" in seen
    finally:
        builtins.__import__ = swap._original_import  # the real one, under both


def test_install_from_environ_activates_what_a_parent_exported(
    script, swapped, monkeypatch
):
    spec = swap.Spec.for_script(str(script))
    monkeypatch.setenv(swap.ENV_VAR, json.dumps([spec.to_json()]))
    swap.install_from_environ()
    try:
        assert swap.active() == [spec]
        got = run_as(script_globals(script), "import multiprocessing")
        assert got["multiprocessing"] is fiber_dask
    finally:
        swap.deactivate(spec.key)
    monkeypatch.setenv(swap.ENV_VAR, "{not json")
    swap.install_from_environ()  # a parent's garbage is not this process's error
    assert swap.active() == []


def test_modules_imported_before_the_swap_are_rebound(tmp_path, swapped):
    """A user module that imported concurrent.futures before the swap."""
    import concurrent as real_concurrent

    module = types.ModuleType("fiberswaptarget")
    module.concurrent = real_concurrent
    module.cf = concurrent.futures
    module.PPE = concurrent.futures.ProcessPoolExecutor
    module.TPE = concurrent.futures.ThreadPoolExecutor
    module.wait = concurrent.futures.wait
    sys.modules["fiberswaptarget"] = module
    try:
        swapped(swap.Spec(str(tmp_path / "script.py"), frozenset({"fiberswaptarget"})))
        assert module.PPE is fiber_dask.futures.ProcessPoolExecutor
        assert module.cf is fiber_dask.futures
        assert module.concurrent.futures is fiber_dask.futures
        assert module.concurrent.futures.thread is concurrent.futures.thread
        assert module.TPE is concurrent.futures.ThreadPoolExecutor
        assert module.wait is concurrent.futures.wait
        # Everyone else keeps the stdlib's.
        assert concurrent.futures.ProcessPoolExecutor.__module__ == (
            "concurrent.futures.process"
        )
    finally:
        del sys.modules["fiberswaptarget"]


# ------------------------------------------------------------- end to end


def test_every_stdlib_submodule_imports_under_the_swap(tmp_path):
    # `from multiprocessing.X import Y` for each public Y, in a script run with
    # the swap active, resolves to fiber_dask (or the stdlib's own X).
    from test_module_surface import NOT_PROVIDED, SUBMODULES, stdlib_public_names

    lines = ["import multiprocessing, fiber_dask"]
    for sub in SUBMODULES:
        std = importlib.import_module(f"multiprocessing.{sub}")
        names = sorted(stdlib_public_names(std) - set(NOT_PROVIDED.get(sub, {})))
        lines.append(f"from multiprocessing.{sub} import {', '.join(names)}")
        lines.append(f"import multiprocessing.{sub} as m; assert m.__name__ == "
                     f"'fiber_dask.{sub}', m")  # fmt: skip
    lines.append("print('ok')")
    script = tmp_path / "imports.py"
    script.write_text("\n".join(lines) + "\n")
    out = subprocess.run(
        [sys.executable, "-c",
         "import sys; from fiber_dask import swap; "
         "swap.activate(swap.Spec.for_script(sys.argv[1])); "
         "import runpy; runpy.run_path(sys.argv[1], run_name='__main__')",
         str(script)],
        capture_output=True, text=True, timeout=60, env=dict(os.environ),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


SWAP_HELPER = """\
import concurrent.futures


def kind():
    return concurrent.futures.ProcessPoolExecutor.__module__
"""

SWAP_LIBRARY = """\
from concurrent.futures import ProcessPoolExecutor
KIND = ProcessPoolExecutor.__module__
"""

SWAP_SCRIPT = """\
import concurrent.futures
import concurrent.futures as cf
import json
from concurrent import futures
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool

import helper


def square(x):
    return x * x


def out(*values):
    print("@@" + json.dumps(list(values)), flush=True)


if __name__ == "__main__":
    import swaplib
    out("kinds", ProcessPoolExecutor.__module__, cf.ProcessPoolExecutor.__module__,
        futures.ProcessPoolExecutor.__module__,
        concurrent.futures.ProcessPoolExecutor.__module__, helper.kind())
    out("library", swaplib.KIND, BrokenProcessPool.__module__)
    with ProcessPoolExecutor(2) as ex:
        fs = [ex.submit(square, i) for i in range(5)]
        out("results", sorted(f.result() for f in as_completed(fs)),
            list(ex.map(square, range(3))))
"""


def test_run_swap_gives_the_script_fiber_dasks_executor(tmp_path):
    from test_cli import base_env, cli, marked, write

    write(tmp_path / "app" / "helper.py", SWAP_HELPER)
    write(tmp_path / "site" / "swaplib.py", SWAP_LIBRARY)
    script = write(tmp_path / "app" / "legacy_futures.py", SWAP_SCRIPT)
    paths = [str(tmp_path / "site"), os.environ.get("PYTHONPATH", "")]
    env = base_env(PYTHONPATH=os.pathsep.join(p for p in paths if p))
    result = cli("run", "--swap-multiprocessing", script, env=env, cwd=script.parent)
    assert result.returncode == 0, result.stderr
    got = {e[0]: e[1:] for e in marked(result.stdout)}
    assert got["kinds"] == ["fiber_dask.futures"] * 5
    assert got["library"] == ["concurrent.futures.process"] * 2
    assert got["results"] == [[0, 1, 4, 9, 16], [0, 1, 4]]
    # Without the swap, the same script is the stdlib's.
    plain = cli("run", script, env=env, cwd=script.parent)
    assert plain.returncode == 0, plain.stderr
    kinds = {e[0]: e[1:] for e in marked(plain.stdout)}["kinds"]
    assert kinds == ["concurrent.futures.process"] * 5
