"""The child bootstrap of a fiber-dask ``Process``: ``python -c`` :data:`BOOT`.

Started by the launcher (``fiber_dask.launch.launcher.run_launcher``) inside a Dask
worker.  Protocol on stdin: an 8-byte big-endian length, then a pickled
``(authkey, blob)`` whose blob is the cloudpickled ``(Process subclass, state)``
(a bare ``(Process subclass, state)`` is accepted too); after that stdin stays
open and carries at most one byte, :data:`PARENT_LOST`: the launcher's
connection to the process that called ``start()`` dropped (that process died,
wherever it ran), so ``parent_process()`` turns dead here, as the stdlib's does
when its parent's end of the sentinel pipe closes.  Its EOF means the
launcher's worker process is gone, and the child kills itself so that no
orphan outlives its worker.  The payload carries the authkey, which is why it
never appears on the command line.

Exit status, stdout and stderr are the stdlib's: the object's own
``BaseProcess._bootstrap`` runs ``run()`` (0 on return, 1 and a traceback on
stderr for an uncaught exception, ``n`` for ``sys.exit(n)``).
"""

from __future__ import annotations

import os
import signal
import struct
import sys
import threading

_PR_SET_PDEATHSIG = 1

# Sent by the launcher on the child's stdin when the parent's connection drops.
PARENT_LOST = b"P"

#: The launcher runs ``python -c BOOT``, not ``python -m
#: fiber_dask.launch.processchild``: importing the package imports this module too
#: (through the launcher), and runpy then warns on the child's stderr, where
#: the stdlib's child prints nothing.
#:
#: Its first statement holds a SIGINT (``Process.interrupt()``, a terminal's
#: Ctrl-C) that arrives while the child starts, when its worker's disposition
#: (ignored) would have dropped it: :func:`main` acts on it once the target
#: may take SIGINT.
BOOT = (
    "import signal, sys; held = []; "
    "signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum)); "
    "from fiber_dask.launch.processchild import main; sys.exit(main(held))"
)


def _die_with_parent() -> None:
    """Ask the kernel for SIGKILL when the launcher dies (Linux only).

    Done here rather than in a ``preexec_fn``: the launcher runs in a
    multi-threaded Dask worker, where ``preexec_fn`` is not fork-safe.  The
    check of ``getppid`` afterwards closes the window before the ``prctl``.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except Exception:  # noqa: BLE001 - the stdin watchdog still guards
        pass
    expected = os.environ.pop("FIBER_DASK_LAUNCHER_PID", None)
    if expected and os.getppid() != int(expected):
        os._exit(1)  # the launcher is already gone


def _read_exact(fd: int, n: int) -> bytes:
    chunks = []
    while n:
        data = os.read(fd, min(n, 1 << 20))
        if not data:
            raise EOFError("the launcher closed the payload pipe")
        chunks.append(data)
        n -= len(data)
    return b"".join(chunks)


def _watchdog(fd: int, sentinel_w: int) -> None:
    """Block on stdin: :data:`PARENT_LOST` means the process that started us
    is gone; EOF (or an error) means the launcher died: die too.

    Either closes ``sentinel_w``, the write end of ``parent_process().sentinel``
    (this thread is its only closer, so it is closed exactly once).
    """
    sentinel_open = True
    try:
        while True:
            data = os.read(fd, 4096)
            if not data:
                break
            if PARENT_LOST in data and sentinel_open:
                sentinel_open = False
                os.close(sentinel_w)  # parent_process().is_alive() turns False
    except OSError:
        pass
    if sentinel_open:
        try:
            os.close(sentinel_w)
        except OSError:
            pass
    os.kill(os.getpid(), signal.SIGKILL)


def main(held: list | None = None) -> int:
    """The child's start; ``held``: the SIGINTs that arrived while it started."""
    _die_with_parent()
    # Keep the launcher's pipe on a private fd; the target gets /dev/null as
    # stdin, as with the stdlib (its bootstrap closes stdin).
    fd = os.dup(0)
    (size,) = struct.unpack("!Q", _read_exact(fd, 8))
    blob = _read_exact(fd, size)
    sentinel_r, sentinel_w = os.pipe()
    from fiber_dask.transparency import interrupts

    # Signals for the target (Process.interrupt()'s SIGINT, a user's
    # handler) go to the main thread, which runs it.
    interrupts.start_helper(
        threading.Thread(
            target=_watchdog, args=(fd, sentinel_w), name="fiber-watchdog", daemon=True
        )
    )
    # Output goes through pipes to the launcher: keep it flowing line by line.
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.reconfigure(line_buffering=True)
        except (AttributeError, ValueError):
            pass

    import multiprocessing
    import pickle
    from multiprocessing.process import AuthenticationString

    import cloudpickle  # noqa: F401  (unpickling cloudpickled objects needs it)

    from fiber_dask.launch import childsetup

    extend_sys_path(os.environ.get("FIBER_DASK_SYS_PATH"))
    from fiber_dask.transparency import resourcetracker

    resourcetracker.adopt()  # the launcher's worker's, as spawn_main does
    # Before the unpickling below imports the user's modules: the swap, under
    # `fiber-dask run --swap-multiprocessing` (registered by the package root).
    childsetup.prepare()

    try:
        # (authkey, inner): our authkey is the parent's before the objects that
        # fetch descriptors from it (the stdlib's resource_sharer) are unpickled.
        outer = pickle.loads(blob)
        if isinstance(outer[0], bytes):
            multiprocessing.current_process().authkey = outer[0]
            outer = pickle.loads(outer[1])
        cls, state = outer
    except BaseException:
        import traceback

        sys.stderr.write("fiber-dask: cannot load the process on this worker:\n")
        traceback.print_exc()
        sys.stderr.flush()
        return 1
    del blob
    log_level = state.pop("_fiber_log_level", None)
    if log_level is not None:  # as the stdlib's spawn.prepare() does
        from multiprocessing import util

        util.get_logger().setLevel(log_level)
    from fiber_dask.launch.mainglobals import child_main

    child_main(cls, state, state.pop("_fiber_main_path", None))
    proc = cls.__new__(cls)
    config = dict(state.pop("_config"))
    config["authkey"] = AuthenticationString(config["authkey"])
    proc.__dict__.update(state)
    proc._config = config
    proc._popen = None

    # As a stdlib child (its worker process may ignore SIGINT).
    interrupts.program_process()
    if held:
        # Interrupted before its target ran: end as SIGINT ends a process
        # without Python's handler (exitcode -SIGINT), quietly.
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    # The stdlib's own bootstrap: it makes ``proc`` the current process, sets
    # parent_process(), closes stdin, runs run() and maps its outcome to the
    # exit code exactly as multiprocessing does.
    return proc._bootstrap(parent_sentinel=sentinel_r)


def extend_sys_path(encoded: str | None) -> None:
    """Add the launcher's import path (as the stdlib's spawn does with its
    parent's), keeping this interpreter's own entries first."""
    if not encoded:
        return
    import json

    for entry in json.loads(encoded):
        if entry not in sys.path:
            sys.path.append(entry)


if __name__ == "__main__":
    sys.exit(main())
