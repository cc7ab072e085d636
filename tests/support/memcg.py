"""A memory cgroup of the test's own, so that the kernel's OOM killer can be
met for real: processes moved into it (and what they fork next) share its
limit, and the kernel kills the largest of them once they pass it.

Made beneath this process's own memory cgroup (cgroup v1's ``memory``
hierarchy, or v2 where the parent delegates the ``memory`` controller); needs
root.  :func:`unavailable` says why it cannot be made here, or None.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from typing import Iterator

import psutil

from .wait import wait_until

V1_ROOT = "/sys/fs/cgroup/memory"
V2_ROOT = "/sys/fs/cgroup"


def _own(pid: str = "self") -> tuple[str, str] | None:
    """``(version, directory)`` of ``pid``'s memory cgroup, or None."""
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    v2 = None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            directory = V1_ROOT + path.rstrip("/")
            if os.path.exists(os.path.join(directory, "memory.limit_in_bytes")):
                return "v1", directory
        elif controllers == "":
            v2 = V2_ROOT + path.rstrip("/")
    if v2 is not None:
        try:
            with open(os.path.join(v2, "cgroup.subtree_control")) as f:
                if "memory" in f.read().split():
                    return "v2", v2
        except OSError:
            pass
    return None


def unavailable() -> str | None:
    """Why a memory cgroup cannot be made here, or None."""
    if os.geteuid() != 0:
        return "needs root"
    own = _own()
    if own is None:
        return "no memory cgroup controller this process can nest under"
    probe = os.path.join(own[1], f"fiber-probe-{uuid.uuid4().hex[:8]}")
    try:
        os.mkdir(probe)
        os.rmdir(probe)
    except OSError as e:
        return f"cannot make a memory cgroup under {own[1]}: {e}"
    return None


class MemoryCgroup:
    def __init__(self, version: str, parent: str, limit: int) -> None:
        self.version, self.parent = version, parent
        self.path = os.path.join(parent, f"fiber-test-{uuid.uuid4().hex[:8]}")
        os.mkdir(self.path)
        name = "memory.limit_in_bytes" if version == "v1" else "memory.max"
        self._write(name, str(limit))
        # No swap beyond the limit, or a host with swap pages out instead of
        # killing (where the kernel has no swap accounting, there is no file).
        swap = ("memory.memsw.limit_in_bytes", str(limit)) if version == "v1" else (
            "memory.swap.max", "0"
        )
        if os.path.exists(os.path.join(self.path, swap[0])):
            self._write(*swap)

    def _write(self, name: str, value: str, directory: str | None = None) -> None:
        with open(os.path.join(directory or self.path, name), "w") as f:
            f.write(value)

    def add_tree(self, pid: int) -> None:
        """Move ``pid`` and its descendants in (what they fork next is born
        inside)."""
        try:
            procs = [psutil.Process(pid)]
            procs += procs[0].children(recursive=True)
        except psutil.NoSuchProcess:
            return
        for p in procs:
            try:
                self._write("cgroup.procs", str(p.pid))
            except OSError:  # it ended meanwhile
                pass

    def pids(self) -> list[int]:
        with open(os.path.join(self.path, "cgroup.procs")) as f:
            return [int(x) for x in f.read().split()]

    def oom_kills(self) -> int:
        name = "memory.oom_control" if self.version == "v1" else "memory.events"
        with open(os.path.join(self.path, name)) as f:
            for row in f:
                key, _, value = row.partition(" ")
                if key == "oom_kill":
                    return int(value)
        return 0

    def remove(self) -> None:
        """Move whatever is still inside back to the parent, and remove it."""

        def emptied() -> bool:
            for pid in self.pids():
                try:
                    self._write("cgroup.procs", str(pid), self.parent)
                except OSError:
                    pass
            return not self.pids()

        wait_until(emptied, 10, f"{self.path} to hold no process")
        os.rmdir(self.path)


@contextlib.contextmanager
def memory_cgroup(limit: int) -> Iterator[MemoryCgroup]:
    """A memory cgroup of ``limit`` bytes beneath this process's own."""
    own = _own()
    assert own is not None, unavailable()
    cg = MemoryCgroup(own[0], own[1], limit)
    try:
        yield cg
    finally:
        cg.remove()
