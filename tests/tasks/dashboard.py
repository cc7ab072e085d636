"""Task functions for tests/test_dashboard.py, importable by name on the workers."""

from __future__ import annotations

import os
import time


def fail_on(x: int, bad: int) -> int:
    """``x``, or ``ValueError`` for the one item ``bad``."""
    if x == bad:
        raise ValueError(f"item {x} fails")
    return x


def hold(x: int, directory: str) -> int:
    """Write the started marker ``started-<x>``, then wait until the test
    creates ``release`` in ``directory`` (the test decides when it ends)."""
    with open(os.path.join(directory, f"started-{x}"), "w") as f:
        f.write(str(os.getpid()))
    release = os.path.join(directory, "release")
    deadline = time.monotonic() + 120
    while not os.path.exists(release) and time.monotonic() < deadline:
        time.sleep(0.01)
    return x
