"""Whether a process is still running, as a test means it."""

from __future__ import annotations

import psutil

__all__ = ["running", "processes_with"]


def running(pid: int) -> bool:
    """Whether ``pid`` runs: a SIGKILLed process its parent has not reaped
    yet is a zombie, which ``os.kill(pid, 0)`` still finds."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def processes_with(variable: str, marker: str) -> list:
    """The processes whose environment has ``variable`` set to ``marker``:
    everything a program started with it (its children inherit it)."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get(variable) == marker:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return found
