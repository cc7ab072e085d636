"""Module-level task functions for the executor conformance suite (tests/test_futures.py).

Importable by name in any worker: the stdlib oracle's forkserver children pickle
functions by reference.  Tasks that must wait for the test block on a file the
test creates (never on a timer), and tasks that must prove how often they ran
append a line to a log file.
"""

from __future__ import annotations

import os
import signal
import sys
import time

_COUNT = 0


def block_until(path, value=None, timeout=60.0):
    """Return ``value`` once ``path`` exists (the test creates it)."""
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.01)
    return value


def reset_count():
    """An initializer: start this worker's task count from zero."""
    global _COUNT
    _COUNT = 0


def count_tasks(_=None):
    """How many tasks this worker ran since its initializer (this one included)."""
    global _COUNT
    _COUNT += 1
    return _COUNT


def fail_init():
    raise RuntimeError("initializer failed on purpose")


def exit_task(code):
    sys.exit(code)


def kill_self(_=None):
    os.kill(os.getpid(), signal.SIGKILL)


def record_then_wait(directory, x):
    """Log this execution, say it started (with the pid running it), then wait
    for the test's go-ahead and return ``x * x``."""
    with open(os.path.join(directory, "executions.log"), "a") as f:
        f.write(f"{x}\n")
    started = os.path.join(directory, f"started-{x}-{os.getpid()}")
    open(started, "w").close()
    block_until(os.path.join(directory, "go"))
    return x * x


def sphere(x):
    """nevergrad's objective: a shifted sphere."""
    return float(sum((v - 0.5) ** 2 for v in x))


def getppid_chain(_=None):
    """This process's pid and its ancestors' (to show where a task ran)."""
    import psutil

    me = psutil.Process()
    return [me.pid] + [p.pid for p in me.parents()]


def rendezvous(directory, n, timeout=60.0):
    """Return once ``n`` tasks are in here at the same time (so ``n`` workers
    are up and running); each leaves a file named after its pid."""
    open(os.path.join(directory, f"here-{os.getpid()}"), "w").close()
    deadline = time.monotonic() + timeout
    while len([f for f in os.listdir(directory) if f.startswith("here-")]) < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only some of {n} tasks arrived")
        time.sleep(0.01)
    return os.getpid()


def trap_then_wait(directory, x):
    """Say it started (with its pid) and wait, polling, for the test's file;
    a SIGTERM leaves ``sigterm-<pid>`` and ends the process with status 0; a
    ``finally`` that runs (an interrupt, not a signal's death) leaves
    ``finally-<pid>``."""
    pid = os.getpid()

    def on_sigterm(signum, frame):
        open(os.path.join(directory, f"sigterm-{pid}"), "w").close()
        os._exit(0)

    signal.signal(signal.SIGTERM, on_sigterm)
    open(os.path.join(directory, f"started-{x}-{pid}"), "w").close()
    try:
        # Short sleeps: a handler runs between them whichever thread of the
        # process the kernel gave the signal to.
        block_until(os.path.join(directory, "go"))
    finally:
        open(os.path.join(directory, f"finally-{pid}"), "w").close()
    return x
