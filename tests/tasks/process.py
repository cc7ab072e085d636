"""Module-level targets and Process subclasses for ``test_process.py``.

Stdlib children (forkserver) import targets by name, so they live here, in a
module on ``sys.path`` / ``PYTHONPATH`` (see ``conftest.py``).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
import time

from fiber_dask.process import Process as FiberProcess


def write_info(path):
    """Write what the child sees of itself and its parent."""
    parent = multiprocessing.parent_process()
    info = {
        "pid": os.getpid(),
        "ppid": os.getppid(),
        "name": multiprocessing.current_process().name,
        "parent_pid": parent.pid if parent is not None else None,
        "parent_name": parent.name if parent is not None else None,
        "daemon": multiprocessing.current_process().daemon,
    }
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(info, f)
    os.replace(tmp, path)


def touch(path):
    with open(path, "w") as f:
        f.write(str(os.getpid()))


def raise_error(message):
    raise ValueError(message)


def exit_with(code):
    sys.exit(code)


def spin(path=None):
    if path is not None:
        touch(path)
    while True:
        pass


def sleep_then_touch(delay, path):
    time.sleep(delay)
    touch(path)


def say(text):
    print(text)
    print(text.upper(), file=sys.stderr)


def square(x):
    return x * x


def nested_pool(path):
    """A child that uses the cluster itself: a fiber Pool on the same scheduler."""
    import fiber_dask

    with fiber_dask.Pool(2) as pool:
        result = pool.map(square, range(10))
    with open(path, "w") as f:
        json.dump(
            {"result": result, "scheduler": os.environ.get("DASK_SCHEDULER_ADDRESS")},
            f,
        )


def nested_process(path):
    """A child that starts a fiber Process of its own."""
    p = FiberProcess(target=touch, args=(path,))
    p.start()
    p.join()
    sys.exit(p.exitcode)


class _RunMixin:
    """A subclass overriding run(): writes its name and argument to a file."""

    def __init__(self, path, value):
        super().__init__()
        self.path = path
        self.value = value

    def run(self):
        with open(self.path, "w") as f:
            f.write(f"{multiprocessing.current_process().name}:{self.value}")


class StdlibRunner(_RunMixin, multiprocessing.get_context("forkserver").Process):
    pass


class FiberRunner(_RunMixin, FiberProcess):
    pass


def hold_lock(lock, started, release):
    """Take ``lock`` (any fiber-dask lock or Condition), say so, hold it until
    ``release`` is set."""
    lock.acquire()
    started.set()
    release.wait(60)
    lock.release()


def ask_holder(lock, queue):
    """Put who holds ``lock`` (asked from this process) on ``queue``."""
    queue.put(lock.holder())


def helper_thread_masks(_=None):
    """{thread name: whether it blocks SIGINT, SIGTERM and SIGALRM} for every
    thread of this process but the main one (a pool task or a Process)."""
    import signal
    import threading

    wanted = {signal.SIGINT, signal.SIGTERM, signal.SIGALRM}
    names = {t.native_id: t.name for t in threading.enumerate()}
    masks = {}
    for tid in os.listdir("/proc/self/task"):
        if int(tid) == os.getpid():
            continue
        try:
            with open(f"/proc/self/task/{tid}/status") as f:
                status = dict(line.split(":", 1) for line in f)
        except OSError:
            continue  # ended meanwhile
        blocked = int(status["SigBlk"], 16)
        masks[names.get(int(tid), tid)] = all(blocked & (1 << (s - 1)) for s in wanted)
    return masks


def write_helper_thread_masks(path):
    """:func:`helper_thread_masks`, as JSON to ``path`` (a Process target)."""
    with open(path, "w") as f:
        json.dump(helper_thread_masks(), f)
