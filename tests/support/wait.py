"""Waiting on conditions instead of fixed sleeps.

A test that sleeps "long enough" is slow on a quiet machine and flaky on a busy
one; a test that waits for the condition it needs is neither.  As CPython's
``test.support.sleeping_retry`` and distributed's ``utils_test.poll_for``:
poll a predicate until it holds, and on timeout fail saying what was awaited.
"""

from __future__ import annotations

import time
from typing import Any, Callable

__all__ = ["wait_until", "wait_for_file"]


def wait_until(
    predicate: Callable[[], Any],
    timeout: float = 30.0,
    what: str = "the condition",
    interval: float = 0.01,
) -> Any:
    """Poll ``predicate()`` until it returns a true value, and return that value.

    Raises ``AssertionError("timed out after Ns waiting for <what>")`` when it
    has not held within ``timeout`` seconds.  The poll interval grows from
    ``interval`` to 0.1 s so that a long wait does not spin.
    """
    deadline = time.monotonic() + timeout
    delay = interval
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(delay)
        delay = min(delay * 1.5, 0.1)


def wait_for_file(path: str, timeout: float = 30.0) -> str:
    """Wait until ``path`` exists (a started marker written by a task)."""
    import os

    return wait_until(lambda: os.path.exists(path) and path, timeout, f"file {path}")
