"""The module-level names legacy scripts call before any pool or process."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import textwrap
import warnings

import pytest

import fiber_dask

pytestmark = pytest.mark.timeout(60)


def test_every_stdlib_public_name_exists():
    assert sorted(set(multiprocessing.__all__) - set(dir(fiber_dask))) == []


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
