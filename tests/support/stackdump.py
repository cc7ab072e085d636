"""Where a helper script is stuck: its threads' stacks, on request.

A script that a test drives (``support/crosshost_*.py``) calls
:func:`install` first; when the test gives up waiting for it,
:func:`request` has it print every thread's stack to its stderr (its log,
which the failure shows), so a hang seen once in CI says where it hung.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import time
from pathlib import Path

_MARK = "most recent call first"


def install() -> None:
    """Dump all threads' stacks to stderr on SIGUSR1 (the script keeps running)."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)


def request(pid: int, log_path: Path, timeout: float = 5.0) -> None:
    """Ask the script ``pid`` for its stacks and wait (at most ``timeout``
    s) until they are in ``log_path``; no error if it cannot answer."""
    try:
        before = Path(log_path).read_text(errors="replace").count(_MARK)
        os.kill(pid, signal.SIGUSR1)
    except OSError:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if Path(log_path).read_text(errors="replace").count(_MARK) > before:
                return  # one signal handler writes them all, at once
        except OSError:
            return
        time.sleep(0.05)
