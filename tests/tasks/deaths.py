"""Task functions for tests/test_worker_loss_cause.py: each ends its process a
different way, as real tasks do, and logs each execution first (one line per
run in ``runs-<x>``, see :mod:`tasks.poolcore`) so a test counts the re-runs."""

from __future__ import annotations

import os
import time

from tasks.poolcore import _log, mark_started


def segfault(directory, x=0):
    """Read address 0 in C: SIGSEGV."""
    import ctypes

    _log(directory, x)
    ctypes.string_at(0)


def exit3(directory, x=0):
    """End the process with exit code 3, skipping Python's cleanup."""
    _log(directory, x)
    os._exit(3)


def wait_to_be_killed(directory, x=0):
    """Write the started marker (this pid), then wait to be killed by the test."""
    _log(directory, x)
    mark_started(directory, x)
    time.sleep(120)
    return "not killed"


def allocate(directory, x=0, total=1_000_000_000, step=50_000_000):
    """Allocate and touch ``total`` bytes, ``step`` at a time (RSS grows as it
    goes, as a real task's does); returns what it held if nobody stopped it."""
    _log(directory, x)
    held = []
    while len(held) * step < total:
        held.append(b"\x01" * step)  # written: resident, not a lazy zero page
        time.sleep(0.01)
    return sum(len(b) for b in held)


def square(x):
    return x * x
