"""Whether a process is still running, as a test means it."""

from __future__ import annotations

import psutil

__all__ = ["running"]


def running(pid: int) -> bool:
    """Whether ``pid`` runs: a SIGKILLed process its parent has not reaped
    yet is a zombie, which ``os.kill(pid, 0)`` still finds."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
