"""POSIX named semaphores a dead stand-in machine left in this one's /dev/shm.

The stdlib's locks, queues and pools (and Dask's nanny, which uses them) make
named semaphores, ``/dev/shm/sem.mp-*``; the creator's resource tracker
unlinks them when it ends.  The test harness plays whole machines on this one
(network-namespace hosts, Kubernetes "pods"), and kills them with SIGKILL as a
machine dies: their trackers die too, and their semaphores stay behind. On a
real machine its /dev/shm goes with it; here the harness that played the
machine clears what it left: a semaphore made since ``snapshot()`` that no
living process has open (sem_open maps the file, so ``/proc/PID/maps`` lists
the inode of every semaphore a process holds; glibc makes it under a
temporary name, so the inode is what matches, not the name).
"""

from __future__ import annotations

import contextlib
import os

__all__ = ["orphans", "remove_orphans", "snapshot"]

SHM = "/dev/shm"
PREFIX = "sem.mp-"


def snapshot() -> set[str]:
    """The stdlib's named semaphores that exist now."""
    try:
        return {n for n in os.listdir(SHM) if n.startswith(PREFIX)}
    except OSError:
        return set()


def _held() -> set[int]:
    """Inodes of /dev/shm files some living process has mapped."""
    dev = os.stat(SHM).st_dev
    held: set[int] = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        with contextlib.suppress(OSError):
            with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as f:
                for line in f:
                    fields = line.split(None, 5)
                    if len(fields) == 6 and fields[5].startswith(SHM + "/"):
                        major, minor = (int(x, 16) for x in fields[3].split(":"))
                        if os.makedev(major, minor) == dev:
                            held.add(int(fields[4]))
    return held


def orphans(since: set[str]) -> list[str]:
    """Semaphores made after ``since`` was taken that no process holds."""
    new = snapshot() - since
    if not new:
        return []
    held = _held()
    found = []
    for name in new:
        with contextlib.suppress(FileNotFoundError):
            if os.stat(os.path.join(SHM, name)).st_ino not in held:
                found.append(name)
    return sorted(found)


def remove_orphans(since: set[str]) -> list[str]:
    """Unlink :func:`orphans` (what a dead machine's tracker would have)."""
    gone = orphans(since)
    for name in gone:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(SHM, name))
    return gone
