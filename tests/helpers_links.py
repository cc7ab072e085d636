"""Task functions for tests/test_pool_links.py, importable by name on the workers."""

from __future__ import annotations

import os
import threading
import time


def where(x: int) -> tuple[int, int, int]:
    """``x`` and the process and thread that ran it."""
    return x, os.getpid(), threading.get_ident()


def held_square(x: int, directory: str) -> int:
    """``x * x``.  Its first execution writes ``started-<x>`` (this pid) and
    waits for the file ``release``; every execution appends a line to
    ``runs-<x>``, so a test counts them."""
    path = os.path.join(directory, f"runs-{x}")
    with open(path, "a") as f:
        f.write(f"{os.getpid()}\n")
    with open(path) as f:
        first = len(f.readlines()) == 1
    if first:
        tmp = os.path.join(directory, f".started-{x}")
        with open(tmp, "w") as f:
            f.write(str(os.getpid()))
        os.replace(tmp, os.path.join(directory, f"started-{x}"))
        release = os.path.join(directory, "release")
        deadline = time.monotonic() + 60
        while not os.path.exists(release) and time.monotonic() < deadline:
            time.sleep(0.01)
    return x * x


def runs(directory: str, x: int) -> int:
    try:
        with open(os.path.join(directory, f"runs-{x}")) as f:
            return len(f.readlines())
    except FileNotFoundError:
        return 0


def perturb_in_place(task: tuple) -> float:
    """An ES-like task that changes the ``theta`` it was sent, in place."""
    theta, seed = task
    theta += seed
    return float(theta.sum())
