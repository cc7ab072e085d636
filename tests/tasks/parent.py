"""Targets for tests/test_process_parent.py: a child that starts a grandchild
which watches ``parent_process()`` (module-level: workers import them by name)."""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import time


def _context(kind: str):
    if kind == "fiber":
        import fiber_dask

        return fiber_dask.get_context()
    return multiprocessing.get_context("spawn")


def _log(path: str, line: str) -> None:
    with open(path, "a") as f:
        f.write(line + "\n")


def start_grandchild(path: str, kind: str, watch: bool) -> None:
    """The child: start a grandchild, then wait to be killed."""
    _log(path, f"child {os.getpid()}")
    target = report_parent if watch else ignore_parent
    _context(kind).Process(target=target, args=(path,)).start()
    time.sleep(300)


def report_parent(path: str) -> None:
    """The grandchild: say whether its parent is alive, then wait for its
    sentinel and say what ``parent_process()`` shows after."""
    parent = multiprocessing.parent_process()
    _log(path, f"grandchild {os.getpid()} {'alive' if parent.is_alive() else 'dead'}")
    ready = multiprocessing.connection.wait([parent.sentinel], timeout=120)
    state = "alive" if parent.is_alive() else "dead"
    _log(path, f"sentinel {'ready' if ready else 'timeout'} {state}")


def ignore_parent(path: str) -> None:
    """The grandchild: run on whatever happens to its parent."""
    _log(path, f"grandchild {os.getpid()} running")
    time.sleep(300)
