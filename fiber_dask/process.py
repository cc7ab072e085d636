"""``Process``: ``multiprocessing.Process`` as a real OS process on a Dask worker host.

This module is the stdlib's face of a process, as CPython's ``process.py`` is:
``Process`` (``start``, ``join``, ``terminate``, ``kill``, ``exitcode``,
``sentinel``, ``pid``, ...), ``current_process``, ``parent_process``,
``active_children`` and what happens to children at exit.  How a started
Process actually runs is its ``Popen``, as CPython's ``popen_*.py`` modules
are: :mod:`fiber_dask.launch.popen` submits a launcher task to Dask, which
starts the child on the task's worker host (:mod:`fiber_dask.launch.launcher`)
and relays its output, the parent's signals and its exit status.

* The Process object's state (target or an overridden ``run``, args, kwargs,
  name, daemon, authkey) travels over an authenticated connection and the
  child's stdin, never on a command line or through the scheduler.
* A Process is never started twice, even when Dask re-runs its task.
* The child dies with its launcher, and ends soon after its parent dies;
  a Process whose worker or host is lost ends with ``exitcode == -SIGKILL``
  and a human-readable :attr:`Process.reason`.
* A running Process does not hold a Dask task slot (as stdlib processes
  oversubscribe the CPUs); ``resources=`` stay reserved until it ends.
"""

from __future__ import annotations

import atexit
import os
from multiprocessing.process import (  # noqa: F401 - the stdlib module's names
    ORIGINAL_DIR,
    AuthenticationString,
    BaseProcess,
    WeakSet,
    _dangling,
    current_process,
    parent_process,
)
from typing import Any

from .launch.popen import Popen

__all__ = [
    "Process",
    "current_process",
    "parent_process",
    "active_children",
]

_children: set = set()  # started fiber Processes of this process, not yet reaped


def active_children() -> list:
    """Live fiber-dask Processes started by this process (stdlib semantics)."""
    _cleanup()
    return list(_children)


def _cleanup() -> None:
    for p in list(_children):
        popen = p._popen
        if popen is None or popen.poll() is not None:
            _children.discard(p)


class Process(BaseProcess):
    """A process running ``target(*args, **kwargs)`` on a Dask worker host.

    Same signature and behaviour as :class:`multiprocessing.Process`; the
    keyword-only arguments after ``daemon`` are fiber-dask's.

    Parameters
    ----------
    group, target, name, args, kwargs, daemon
        As in the stdlib.  ``target`` (or a subclass with its ``run``) and the
        arguments travel with cloudpickle: lambdas and closures work.
    resources : dict, optional
        Dask worker resources the process needs, e.g. ``{"GPU": 1}``; they stay
        reserved on its worker until it ends.
    client : distributed.Client, optional
        Run on this client's cluster.
    address : str, optional
        Attach to the scheduler at this address.

    Notes
    -----
    Differences from the stdlib:

    * ``pid`` (``ident``) blocks until the child is running on its worker
      (usually well under a second after ``start()``), or returns None if the
      process ended without starting.
    * ``sentinel`` is the read end of a local pipe that becomes readable when
      the process has ended (usable with ``multiprocessing.connection.wait``).
    * If the worker hosting the process dies (SIGKILL, out of memory, a lost
      host) the process is gone with it: ``exitcode`` becomes
      ``-signal.SIGKILL`` and :attr:`reason` says what happened.  It is never
      started again elsewhere.
    * The child's stdout and stderr are forwarded to this process's
      ``sys.stdout`` / ``sys.stderr`` (line-buffered in the child).
    * ``start()`` raises :class:`~fiber_dask.errors.ClusterConnectionError`
      if this process has lost its Dask scheduler and does not get it back
      within ``fiber.connect-timeout``; a Process whose scheduler is lost
      before it started ends with ``exitcode == -signal.SIGKILL`` and a
      :attr:`reason` that says so.  A running Process does not need the
      scheduler (it talks to its launcher directly) and goes on.
    """

    _start_method = None

    def __init__(
        self,
        group: None = None,
        target: Any = None,
        name: str | None = None,
        args: Any = (),
        kwargs: Any = None,
        *,
        daemon: bool | None = None,
        resources: dict | None = None,
        client: Any = None,
        address: str | None = None,
    ) -> None:
        super().__init__(group, target, name, args, kwargs or {}, daemon=daemon)
        self._resources = resources
        self._fiber_client = client
        self._fiber_address = address

    def start(self) -> None:
        """Start the process on a Dask worker; returns without waiting for it."""
        self._check_closed()
        assert self._popen is None, "cannot start a process twice"
        assert self._parent_pid == os.getpid(), (
            "can only start a process object created by current process"
        )
        config = current_process()._config
        # A fiber-dask pool slot process is daemonic, as a stdlib pool worker,
        # but its fiber Processes run elsewhere and never become orphans of it.
        assert not config.get("daemon") or config.get("fiber_slot"), (
            "daemonic processes are not allowed to have children"
        )
        _cleanup()
        resources = self._resources
        if resources is None:  # @fiber_dask.meta(...) on the target or run()
            from .meta import resources_of

            resources = resources_of(self._target) or resources_of(type(self).run)
        # Popen pickles the state first: an unpicklable target or argument
        # fails here, before any cluster is contacted, as with spawn.
        self._popen = Popen(
            type(self),
            self._child_state(),
            resources=resources,
            client=self._fiber_client,
            address=self._fiber_address,
        )
        self._sentinel = self._popen.sentinel
        # Avoid a refcycle if the target holds the process object (bpo-30775).
        del self._target, self._args, self._kwargs
        _children.add(self)

    def _child_state(self) -> dict:
        """The attributes the child's copy of this object gets: all but the
        parent's handles on it (the stdlib's spawn pickles the object before
        it has a ``_popen``; a Dask client stays with its process)."""
        state = dict(self.__dict__)
        for attr in ("_popen", "_fiber_client", "_sentinel"):
            state.pop(attr, None)
        return state

    @property
    def ident(self) -> int | None:
        """The child's pid on its worker host (waits until it is running)."""
        self._check_closed()
        if self is current_process():
            return os.getpid()
        if self._popen is None:
            return None
        return self._popen.wait_pid()

    pid = ident

    def interrupt(self) -> None:
        """Send SIGINT to the process, wherever it runs (Python 3.14's
        ``Process.interrupt()``, here on every Python).

        Its target gets ``KeyboardInterrupt`` in its main thread; uncaught, the
        process ends with ``exitcode == 1`` and the traceback on stderr, as a
        stdlib child does.  A process that has not started yet ends with
        ``exitcode == -signal.SIGINT``.
        """
        self._check_closed()
        self._popen.interrupt()

    @property
    def reason(self) -> str | None:
        """Why the process ended abnormally without an exit status of its own
        (its worker died, it was terminated before it started, the launch
        failed); None otherwise."""
        popen = getattr(self, "_popen", None)
        return popen.reason if popen is not None else None

    def close(self) -> None:
        super().close()
        _children.discard(self)


# ----------------------------------------------------------------- at exit


_DAEMON_GRACE = 5.0  # seconds a daemonic child gets after SIGTERM at exit


def _exit_function() -> None:
    """As the stdlib at exit: terminate daemonic children, join the others;
    but never without a deadline where the stdlib would hang.

    A daemonic child that ignores SIGTERM is killed after ``_DAEMON_GRACE``
    s.  A Process still waiting for its launcher while the client has lost
    its scheduler is given up after ``fiber.connect-timeout``.  A running
    non-daemonic child is waited for, as the stdlib does (its launcher's
    connection ends the wait if its worker or host dies).

    Registered after ``cluster.shutdown`` (``launch.popen``, imported above,
    imports ``cluster``), so it runs before the cluster fiber-dask started is
    closed.
    """
    children = active_children()
    for p in children:
        if p.daemon:
            try:
                p._popen.terminate()
            except Exception:  # noqa: BLE001 - best effort at exit
                pass
    for p in children:
        if p.daemon:
            try:
                if p._popen.wait(_DAEMON_GRACE) is None:
                    p._popen.kill()
            except Exception:  # noqa: BLE001
                pass
    for p in active_children():
        try:
            p._popen.wait_at_exit()
        except Exception:  # noqa: BLE001
            pass
    _cleanup()


atexit.register(_exit_function)
