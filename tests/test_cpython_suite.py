"""A fast subset of CPython's own multiprocessing suite, run as tests/cpython/run.py
runs it (the whole suite is opt-in: ``python tests/cpython/run.py``).

The classes are run against the stdlib and, under ``fiber-dask run
--swap-multiprocessing``, against fiber-dask; every test the stdlib passes must
pass on fiber-dask.  They cover the swap of the ``test`` package itself (the
suite imports at all), Pipe ends with ``fileno()``/``wait()``-based polling, and
Structure-typed, raw and locked ctypes values.
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "cpython"))
import run as cpython_run  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

CLASSES = ["WithProcessesTestValue", "WithProcessesTestSharedCTypes"]


def test_fast_subset_passes_where_the_stdlib_passes(tmp_path):
    paths = {t: str(tmp_path / f"{t}.jsonl") for t in ("stdlib", "fiber")}
    for target, path in paths.items():
        cpython_run.run_target(target, CLASSES, 60, path)
    _, std = cpython_run._summary(paths["stdlib"])
    plan, ours = cpython_run._summary(paths["fiber"])
    assert sorted(plan) == sorted(CLASSES)
    passed_std = {k for k, r in std.items() if r["outcome"] == "pass"}
    assert len(passed_std) == 6, std  # the subset really ran (3 + 3 tests)
    missing = {
        f"{c}.{t}": ours.get((c, t), {}).get("detail")
        for c, t in sorted(passed_std)
        if ours.get((c, t), {}).get("outcome") != "pass"
    }
    assert missing == {}
