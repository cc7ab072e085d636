"""Who takes a terminal's Ctrl-C: the one policy for SIGINT in the processes
fiber-dask starts.

A terminal's Ctrl-C and Jupyter's "interrupt kernel" send SIGINT to the whole
process group: the program, and on the embedded cluster every process started
under it.  The stdlib's rule is the model: the program and the processes that
run its code (pool workers, ``Process`` children) get ``KeyboardInterrupt``;
its machinery (the forkserver, the resource tracker, a manager's server)
ignores it.  So here:

* **the cluster ignores it** (:func:`cluster_process`): the embedded cluster's
  Dask worker processes (:mod:`fiber_dask.backends.workerstart`, also the
  process they are forked from, from its first instruction on:
  :func:`held_for_child`)
  and the slot templates (:mod:`fiber_dask.engine.slotserver`).
  A Dask worker that took it closed itself and told its nanny to close too:
  the cluster was gone for good and the program's next map hung;
* **the program's code takes it** (:func:`program_process`): a slot process
  once it serves a pool (it ends as a stdlib pool worker does, and is
  replaced), a ``Process`` child before ``run()`` (its worker ignored SIGINT,
  and an exec passes that on).

Workers on other hosts are in no terminal's process group and never see it.

In the program itself, Ctrl-C raises where it lands, except in the middle of
an import fiber-dask makes on first use (its machinery, ``distributed``):
:func:`deferred` holds it until the import is whole.  An import cut half-way
leaves modules half-made that fail the next time (``NameError: name
'coroutines' is not defined`` from ``asyncio``, seen when a Ctrl-C landed in
the first ``Pool()``), so the program that caught the KeyboardInterrupt could
never make a Pool again.  A second Ctrl-C raises at once.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Iterator

__all__ = [
    "cluster_process",
    "deferred",
    "held_for_child",
    "program_process",
    "start_helper",
]

#: The signals a program's code handles in its main thread (a task's alarm,
#: a terminal's Ctrl-C, ``terminate_workers()``'s SIGTERM, a user's handler).
#: Sent to the process, the kernel hands each to any thread that does not
#: block it: the helper threads of a process that runs the program's code
#: block them (:func:`start_helper`), so they reach the main thread, as in
#: the stdlib's pool workers, which have no other thread.
MAIN_THREAD_SIGNALS = frozenset(
    getattr(signal, name)
    for name in (
        "SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGALRM", "SIGVTALRM",
        "SIGPROF", "SIGUSR1", "SIGUSR2", "SIGCHLD",
    )  # fmt: skip
    if hasattr(signal, name)
)


@contextlib.contextmanager
def _blocked(signals: frozenset | set) -> Iterator[None]:
    """``signals`` blocked in this thread for the block, then the mask it had."""
    if not hasattr(signal, "pthread_sigmask"):  # pragma: no cover - not POSIX
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def held_for_child() -> contextlib.AbstractContextManager[None]:
    """SIGINT blocked in this thread while it starts a cluster process.

    The child inherits the blocked mask through ``fork`` and ``exec``
    (``subprocess`` gives it the starting thread's mask), so a Ctrl-C is held
    from its first instruction until :func:`cluster_process` ignores SIGINT,
    which drops one held meanwhile, and unblocks it.  Ignoring it in the
    child's first line of code was too late: ``site`` runs before it (with a
    ``.pth`` file importing certifi, ~0.1 s), and a Ctrl-C there ended the
    worker fork server with "Fatal Python error: init_import_site".  A
    ``/bin/sh -c "trap '' INT; exec ..."`` in front still left the
    millisecond before its ``trap`` ran.  A Ctrl-C for this process meanwhile
    goes to one of its other threads, or waits for the block's end."""
    return _blocked({signal.SIGINT})


def start_helper(thread: threading.Thread) -> None:
    """Start ``thread``, a helper of a process that runs the program's code
    (a slot's link to its pool's owner, its time-limit watcher), with
    :data:`MAIN_THREAD_SIGNALS` blocked in it from its first instruction (a
    new thread takes its starter's mask): a signal sent to the process then
    goes to the main thread, which runs the task and its handlers.  Handed
    to a helper, it waited for the main thread's next bytecode, and a task
    blocked in C (``sleep``, I/O) saw its alarm or SIGTERM only when that
    call returned."""
    with _blocked(MAIN_THREAD_SIGNALS):
        thread.start()


def cluster_process() -> None:
    """This process is the cluster's: a terminal's Ctrl-C is not for it.  One
    held since it started (:func:`held_for_child`) is dropped."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def program_process() -> None:
    """This process runs the program's code: Ctrl-C raises KeyboardInterrupt
    in its main thread, as in the stdlib's pool workers and children."""
    signal.signal(signal.SIGINT, signal.default_int_handler)


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Hold a Ctrl-C that arrives in the block until its end, then raise it;
    a second one raises at once.  Only in the main thread while SIGINT has
    Python's own handler (a handler the program or IPython set is theirs)."""
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield
        return
    held: list[int] = []

    def hold(signum: int, frame: object) -> None:
        if held:
            raise KeyboardInterrupt
        held.append(signum)

    signal.signal(signal.SIGINT, hold)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if held:
        raise KeyboardInterrupt
