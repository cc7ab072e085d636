"""Functions the tests of tests/test_cpython_suite.py run in workers and
children (importable by name, as stdlib workers need)."""

from __future__ import annotations

import os


def record_pid(path: str) -> None:
    """A Pool initializer: append this process's pid to ``path``."""
    with open(path, "a") as f:
        f.write(f"{os.getpid()}\n")


def square(x: int) -> int:
    return x * x


def attach_and_write(name: str, data: bytes) -> None:
    """Attach to the shared-memory segment ``name``, write ``data``, exit."""
    from multiprocessing import shared_memory

    shm = shared_memory.SharedMemory(name)
    shm.buf[: len(data)] = data
    shm.close()


def tracker_shared(conn, parent_pid: int | None) -> None:
    """Send whether this child uses a live resource tracker it did not start."""
    from multiprocessing.resource_tracker import _resource_tracker

    _resource_tracker.ensure_running()
    conn.send(
        _resource_tracker._pid in (None, parent_pid)
        and _resource_tracker._check_alive()
    )


def wait_at(barrier) -> int:
    """A Pool task: wait until as many tasks as the barrier's parties run at once."""
    return barrier.wait(timeout=90)
