"""Where a helper script is stuck: its threads' stacks, on request.

A script that a test drives (``support/crosshost_*.py``) calls
:func:`install` first; when the test gives up waiting for it,
:func:`request` has it print every thread's stack to its stderr (its log)
and returns them, for the failure's message: a hang seen once in CI then
says where it hung.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import time
from pathlib import Path

_MARK = b"most recent call first"


def install() -> None:
    """Dump all threads' stacks to stderr on SIGUSR1 (the script keeps running)."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)


def request(pid: int, log_path: Path, timeout: float = 5.0) -> str:
    """Ask the script ``pid`` for its stacks, wait (at most ``timeout`` s)
    until they are in ``log_path``, and return them ('' if it cannot answer)."""
    path = Path(log_path)
    try:
        start = path.stat().st_size
        os.kill(pid, signal.SIGUSR1)
    except OSError:
        return ""
    deadline = time.monotonic() + timeout
    seen = b""
    while time.monotonic() < deadline:
        try:
            with open(path, "rb") as f:
                f.seek(start)
                new = f.read()
        except OSError:
            break
        if _MARK in new and new == seen:
            break  # written, and no more since the last look
        seen = new
        time.sleep(0.05)
    return seen.decode(errors="replace") if _MARK in seen else ""
