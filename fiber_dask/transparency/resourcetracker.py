"""Which ``multiprocessing`` resource tracker the processes fiber-dask starts on
a worker host use: slot processes (through their template) and the children of
a ``Process``.

The stdlib starts one resource tracker per program, on first use, and every
process of the program shares it: a child inherits the tracker's pipe (forked,
or handed over by spawn and the forkserver), so each ``SemLock`` and
``SharedMemory`` any of them creates is registered in one place, and what is
still registered when the last of them has exited is unlinked then, with a
``leaked ... objects`` warning.

**The rule: a process fiber-dask starts on a worker host shares its Dask worker
process's tracker**, as a stdlib child shares its parent's.

* On the embedded cluster that tracker *is* the program's own: a nanny hands
  its worker its tracker's pipe (spawn and ``backends/workerstart``'s fork
  server both do), and the nannies run in the program's process.  A segment a
  task creates and never unlinks is then unlinked, with the stdlib's warning on
  the program's stderr, when the program's processes have all exited: the
  stdlib's behaviour exactly.
* Elsewhere (``dask worker`` started on the command line, a Kubernetes pod) it
  is the tracker of the worker's nanny, or the worker's own, started on first
  use, when it has no nanny.  The program's is on another host in general, so
  it cannot be the program's.  What tasks leak then lives until that worker
  stops.
* Not one per slot process: attaching to a segment registers it too (always
  before Python 3.13, by default from 3.13), so a tracker of the slot's own
  would unlink, when the slot process exits (``maxtasksperchild``, the pool's
  end), a segment the program or another slot still uses.  Sharing the tracker
  is how the stdlib avoids that (a tracker counts a name once however many
  processes register it).  It would also cost an interpreter start in every
  slot process that makes a lock.

How the pipe gets there: a child started as a fresh interpreter gets it with
``pass_fds`` and :data:`ENV` naming its number (:func:`for_child`, then
:func:`adopt` in the child, as the stdlib's ``spawn_main`` does); a process
forked from the worker (the slot template, :func:`fiber_dask.engine.slots.start_early`)
keeps the descriptor :func:`share` returned open across the descriptors it
closes, and slot processes, forked from the template, inherit it.

Python 3.10 to 3.13 all keep the pipe's write end in
``resource_tracker._resource_tracker._fd`` (``_pid`` is set only in the
process that started the tracker), and ``ensure_running()`` probes ``_fd`` and
``os.close``s it when the probe fails.  So a process must never keep an
``_fd`` naming a descriptor it does not have: a closed one is ``EBADF`` at the
first ``Lock()``, a number reused by another file would get the probes written
into it.  Everything here either hands over an open pipe or leaves ``_fd``
None (a tracker is then started on first use, as in a fresh program).
"""

from __future__ import annotations

import os
import stat
import sys
from collections.abc import MutableMapping

# At import, not in the functions: the slot template's starter thread calls
# them while the main thread may still be importing fiber_dask (its
# start_early), and an import there would wait for that one.
from multiprocessing import resource_tracker

__all__ = ["ENV", "share", "for_child", "adopt"]

#: Names the inherited descriptor of the tracker's pipe in a child's
#: environment (taken out of it by :func:`adopt`).
ENV = "FIBER_DASK_TRACKER_FD"


def _tracker() -> resource_tracker.ResourceTracker:
    return resource_tracker._resource_tracker


def _is_pipe(fd: int) -> bool:
    try:
        return stat.S_ISFIFO(os.fstat(fd).st_mode)
    except OSError:
        return False


def share() -> int | None:
    """In a Dask worker process (or any process about to start a child): the
    descriptor of this process's tracker pipe, for a child to share; the
    tracker is started now if this process has none.  None where there is no
    tracker to share (Windows, or it cannot start: the child then starts its
    own on first use)."""
    if sys.platform == "win32":
        return None
    tracker = _tracker()
    fd = tracker._fd
    if fd is not None and not _is_pipe(fd):
        # A number left by a process that closed the descriptor under it (the
        # bug this module fixes): not ours to close, and no tracker to probe.
        tracker._fd = tracker._pid = None
    try:
        return tracker.getfd()
    except Exception:  # noqa: BLE001 - the child starts its own, as a program would
        return None


def for_child(env: MutableMapping[str, str]) -> tuple[int, ...]:
    """Before starting a fresh interpreter that should share this process's
    tracker: set :data:`ENV` in its ``env`` and return the ``pass_fds`` to
    give it (empty when there is none to share)."""
    fd = share()
    if fd is None:
        env.pop(ENV, None)
        return ()
    env[ENV] = str(fd)
    return (fd,)


def adopt(environ: MutableMapping[str, str] = os.environ) -> None:
    """In a child started with :func:`for_child`'s environment, first thing:
    use the tracker whose pipe it inherited (as ``spawn_main`` does with its
    parent's); without one, a tracker is started on first use."""
    fd = environ.pop(ENV, None)
    if fd is None:
        return
    try:
        number = int(fd)
    except ValueError:
        return
    if _is_pipe(number):
        _tracker()._fd = number
