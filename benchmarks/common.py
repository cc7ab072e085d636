"""Task functions and small helpers shared by the benchmarks.

The task functions live in this importable module, not in the benchmark script, so
every engine ships them *by reference* (module + name), the way a real user's library
function travels: stdlib ``pickle`` under ``spawn``/``forkserver``, cloudpickle in Dask
and fiber-dask, Ray and IPyParallel all send ``benchmarks.common.busy`` as a name that
the worker imports. The benchmark puts the repository root on ``sys.path`` and on
``PYTHONPATH`` so that every worker process started on this machine can import it.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Iterable

#: Repository root (the parent of ``benchmarks/``).
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def busy(seconds: float) -> float:
    """Keep one CPU busy for ``seconds`` of wall-clock time and return ``seconds``.

    A busy-wait rather than ``time.sleep``: the point of the experiment is CPU-bound
    work competing with the framework's own processes for the same cores.
    """
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass
    return seconds


def noop(*args: object) -> None:
    """Do nothing; used for startup and round-trip latency measurements."""
    return None


def ensure_importable() -> None:
    """Make ``benchmarks.common`` importable here and in every child process.

    ``python benchmarks/overhead.py`` puts ``benchmarks/`` on ``sys.path``, not the
    repository root; children (forkserver, Dask nannies' spawned workers, Ray workers,
    IPyParallel engines) inherit ``PYTHONPATH`` from the environment.
    """
    if REPO_ROOT not in sys.path:
        sys.path.insert(0, REPO_ROOT)
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if REPO_ROOT not in parts:
        os.environ["PYTHONPATH"] = os.pathsep.join([REPO_ROOT, *parts])


def median(values: Iterable[float]) -> float:
    """Median of ``values``, ``nan`` when there are none."""
    values = list(values)
    return statistics.median(values) if values else float("nan")


def format_duration(seconds: float) -> str:
    """``0.001`` -> ``"1 ms"``, ``1.0`` -> ``"1 s"``."""
    if seconds >= 1:
        return f"{seconds:g} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:g} ms"
    return f"{seconds * 1e6:g} us"
