"""Task functions for tests/test_pool_core.py, importable by name on the workers.

The kill tests coordinate through files: a task appends one line per
execution to a log (so a test can count executions and prove a re-run), and a
task chosen to be killed writes a "started" marker holding its pid, then waits
to be killed (it is SIGKILLed by the test, never on a timer).
"""

from __future__ import annotations

import os
import time


def base(x, k=0):
    return x * 1000 + k


def keep(x):
    return -x


def _log(directory: str, x: int) -> int:
    """Append one line for this execution of item ``x``; return how many
    executions of ``x`` there were before this one."""
    path = os.path.join(directory, f"runs-{x}")
    with open(path, "a") as f:
        f.write(f"{os.getpid()}\n")
    with open(path) as f:
        return len(f.readlines()) - 1


def mark_started(directory: str, x: int) -> None:
    """Write the started marker ``started-<x>`` holding this pid, at once."""
    tmp = os.path.join(directory, f".started-{x}")
    with open(tmp, "w") as f:
        f.write(str(os.getpid()))
    os.replace(tmp, os.path.join(directory, f"started-{x}"))


def counted_square(x, directory, victims=()):
    """``x * x``; on the first execution of an item in ``victims``, write the
    started marker ``started-<x>`` (with this pid) and wait to be killed."""
    before = _log(directory, x)
    if x in victims and before == 0:
        mark_started(directory, x)
        time.sleep(120)
    return x * x


def counted_until_told(x, directory):
    """Count this execution, write the started marker ``started-<x>`` (with
    this pid), then wait for the file ``go-<x>`` (at most 60 s); ``x``."""
    _log(directory, x)
    mark_started(directory, x)
    go = os.path.join(directory, f"go-{x}")
    deadline = time.monotonic() + 60
    while not os.path.exists(go) and time.monotonic() < deadline:
        time.sleep(0.01)
    return x


def executions(directory: str, x: int) -> int:
    try:
        with open(os.path.join(directory, f"runs-{x}")) as f:
            return len(f.readlines())
    except FileNotFoundError:
        return 0


def kill_self_on_7(x):
    if x == 7:
        import signal

        os.kill(os.getpid(), signal.SIGKILL)
    return x


class NeedsArgs(Exception):
    """An exception whose ``__init__`` takes other arguments than its ``args``."""

    def __init__(self, a, b):
        super().__init__(f"{a}{b}")
        self.a, self.b = a, b


def raise_needs_args(a, b):
    raise NeedsArgs(a, b)


def raise_from_worker_only_module(directory):
    """Raise an exception whose class lives in a module only this worker
    process can import (the owner cannot rebuild it)."""
    import importlib
    import sys

    path = os.path.join(directory, "worker_only_errors.py")
    with open(path, "w") as f:
        f.write(
            "class WorkerOnlyError(Exception):\n"
            "    def __init__(self, a, b):\n"
            "        super().__init__(f'{a}-{b}')\n"
        )
    sys.path.insert(0, directory)
    try:
        mod = importlib.import_module("worker_only_errors")
    finally:
        sys.path.remove(directory)
    raise mod.WorkerOnlyError("left", "right")


def spin_then_linger(directory):
    """Spin in Python (so terminate() interrupts it); on the way out, linger
    1 s before writing ``ended``: join() must wait for that."""
    with open(os.path.join(directory, "started"), "w") as f:
        f.write(str(os.getpid()))
    try:
        while True:
            pass
    finally:
        time.sleep(1.0)
        with open(os.path.join(directory, "ended"), "w") as f:
            f.write("1")


def marked_sleep(path, delay, value=None):
    """Write the started marker ``path``, then sleep ``delay`` seconds."""
    with open(path, "a") as f:
        f.write(f"{os.getpid()}\n")
    time.sleep(delay)
    return delay if value is None else value


def marked_spin(path):
    """Write the started marker ``path``, then spin in Python forever."""
    with open(path, "w") as f:
        f.write(str(os.getpid()))
    while True:
        pass
