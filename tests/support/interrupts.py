"""SIGINT as a program started from a terminal has it, whatever the suite's.

A shell starts a background job (``python -m pytest ... &``, a CI runner's
detached step) with SIGINT *ignored*, and both an ``exec`` and Python keep it
so: a test that sends SIGINT to itself, or to a program it starts, would see
nothing happen.  A foreground terminal program, or a Jupyter kernel, has
Python's handler (KeyboardInterrupt).  These helpers give a test that, instead
of inheriting whatever the suite was started with.
"""

from __future__ import annotations

import contextlib
import signal
import sys
from typing import Iterator

__all__ = ["terminal_python", "python_sigint"]

# Put SIGINT's default disposition back, then become the real interpreter:
# Python installs its KeyboardInterrupt handler only over the default.
_EXEC_WITH_DEFAULT_SIGINT = (
    "import os, signal, sys; "
    "signal.signal(signal.SIGINT, signal.SIG_DFL); "
    "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])"
)


def terminal_python(*args: str) -> list[str]:
    """The argv running ``python *args`` with SIGINT as a terminal program
    has it (KeyboardInterrupt), not as this process has it."""
    return [sys.executable, "-c", _EXEC_WITH_DEFAULT_SIGINT, *args]


@contextlib.contextmanager
def python_sigint() -> Iterator[None]:
    """In this (main) thread, for the block: SIGINT raises KeyboardInterrupt."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)
