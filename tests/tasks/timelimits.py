"""Task functions for tests/test_time_limits.py, importable by name on the workers.

Each execution of an item appends a line to ``runs-<x>`` in the test's
directory (so a test counts executions: a task past its hard limit runs
exactly once), and a task that is to be stopped by a limit writes its
``started-<x>`` marker first.
"""

from __future__ import annotations

import os
import time

from fiber_dask.errors import SoftTimeLimitExceeded

from .poolcore import _log, executions, mark_started  # noqa: F401  (re-exported)


def pid(_=None) -> int:
    return os.getpid()


def square(x: int) -> int:
    return x * x


def sleep_counted(x: int, directory: str, seconds: float) -> int:
    """Count this execution, mark it started, sleep ``seconds``; ``x``."""
    _log(directory, x)
    mark_started(directory, x)
    time.sleep(seconds)
    return x


def spin_counted(x: int, directory: str, seconds: float) -> int:
    """As :func:`sleep_counted`, but busy in Python code (never releases the
    GIL for long, never in a system call)."""
    _log(directory, x)
    mark_started(directory, x)
    end = time.monotonic() + seconds
    n = 0
    while time.monotonic() < end:
        n += 1
    return x


def sleep_then_clean_up(x: int, directory: str, seconds: float) -> str:
    """Sleep ``seconds``; on ``SoftTimeLimitExceeded`` clean up (write the
    ``cleaned-<x>`` marker) and return what the caller gets."""
    _log(directory, x)
    try:
        time.sleep(seconds)
    except SoftTimeLimitExceeded as e:
        with open(os.path.join(directory, f"cleaned-{x}"), "w") as f:
            f.write(str(e))
        return f"cleaned up {x}"
    return f"finished {x}"


def spin_then_clean_up(x: int, directory: str, seconds: float) -> str:
    """As :func:`sleep_then_clean_up`, busy in Python code."""
    _log(directory, x)
    end = time.monotonic() + seconds
    try:
        while time.monotonic() < end:
            pass
    except SoftTimeLimitExceeded as e:
        with open(os.path.join(directory, f"cleaned-{x}"), "w") as f:
            f.write(str(e))
        return f"cleaned up {x}"
    return f"finished {x}"


def mixed(x: int, directory: str, slow: tuple, seconds: float) -> int:
    """``x * x`` at once, but items in ``slow`` sleep ``seconds`` first."""
    _log(directory, x)
    if x in slow:
        mark_started(directory, x)
        time.sleep(seconds)
    return x * x


def ignore_soft(x: int, directory: str, seconds: float) -> int:
    """Count, mark started, then sleep ``seconds`` whatever soft limits say
    (each ``SoftTimeLimitExceeded`` is noted in ``soft-<x>`` and ignored)."""
    _log(directory, x)
    mark_started(directory, x)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            time.sleep(max(0.0, end - time.monotonic()))
        except SoftTimeLimitExceeded:
            with open(os.path.join(directory, f"soft-{x}"), "a") as f:
                f.write("soft\n")
    return x


def hold_the_gil(x: int, directory: str) -> bool:
    """Count, mark started, then run a regular expression that backtracks
    for minutes in C code without releasing the GIL (no Python code runs in
    this process meanwhile: no signal handler, no other thread)."""
    import re

    _log(directory, x)
    mark_started(directory, x)
    return re.match(r"(a+)+$", "a" * 40 + "b") is not None


def quick(x: int, seconds: float = 0.0) -> int:
    if seconds:
        time.sleep(seconds)
    return x * x
