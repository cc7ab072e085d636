"""Task functions for tests/test_pool_links.py, importable by name on the workers."""

from __future__ import annotations

import os
import threading
import time

from tasks.poolcore import _log, mark_started


def where(x: int) -> tuple[int, int, int]:
    """``x`` and the process and thread that ran it."""
    return x, os.getpid(), threading.get_ident()


def held_square(x: int, directory: str) -> int:
    """``x * x``.  Every execution is logged (``tasks.poolcore.executions``
    counts them); the first writes ``started-<x>`` (this pid) and waits for
    the file ``release``."""
    if _log(directory, x) == 0:
        mark_started(directory, x)
        release = os.path.join(directory, "release")
        deadline = time.monotonic() + 60
        while not os.path.exists(release) and time.monotonic() < deadline:
            time.sleep(0.01)
    return x * x


def perturb_in_place(task: tuple) -> float:
    """An ES-like task that changes the ``theta`` it was sent, in place."""
    theta, seed = task
    theta += seed
    return float(theta.sum())
