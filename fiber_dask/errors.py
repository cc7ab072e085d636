"""fiber-dask's own errors, and the problems a :class:`ConfigError` lists.

Each error subclasses the stdlib class a caller already catches.  A leaf: this
module imports nothing of fiber_dask, so that every layer can raise these (the
configuration's :class:`ConfigError` too: the backends raise it, and the
configuration's validation reads the backends' registry).
"""

from __future__ import annotations

import concurrent.futures.process
import multiprocessing
from collections.abc import Sequence
from typing import Any, NamedTuple

__all__ = [
    "BrokenProcessPool",
    "ClusterCapacityError",
    "ClusterConnectionError",
    "ConfigError",
    "ManagerConnectionError",
    "PoolTerminatedError",
    "Problem",
    "RemoteTaskError",
    "RingError",
    "SoftTimeLimitExceeded",
    "TLSConnectionError",
    "TimeLimitExceeded",
    "WorkerLostError",
]


class WorkerLostError(multiprocessing.ProcessError):
    """A task's worker process died more often than the configured limit allows.

    A worker that dies (SIGKILL, out of memory, a lost host) costs a re-run of the
    work it held; a task that keeps killing the workers it lands on ends in this
    error instead of a hang.

    Beyond the stdlib (whose pool hangs, and whose executor's
    ``BrokenProcessPool`` does not say why), it says why the last process died:

    ``cause``
        ``"memory"`` (over its Dask worker's memory limit, or the kernel's OOM
        killer), ``"signal"`` (killed by a signal: a segfault, a SIGKILL from
        outside), ``"exit"`` (the process exited: ``os._exit``, a C library's
        ``exit()``), ``"host"`` (its Dask worker was lost: the host, its
        network or the worker process), ``"job"`` (the batch job holding the
        worker ended: ``scancel``, walltime), ``"scaled-down"`` (the cluster
        retired the worker), or None when it could not be learnt.
    ``signal``
        The :class:`signal.Signals` that killed it, or None.
    ``exitcode``
        Its exit code when it exited, or None.
    ``address``
        The Dask worker's address, or None.
    """

    #: The values ``cause`` takes (None aside).
    CAUSES = ("memory", "signal", "exit", "host", "job", "scaled-down")

    def __init__(
        self,
        *args: Any,
        cause: str | None = None,
        signal: int | None = None,
        exitcode: int | None = None,
        address: str | None = None,
    ) -> None:
        super().__init__(*args)
        # Plain attributes: BaseException pickles its __dict__ with its args.
        self.cause = cause
        self.signal = signal
        self.exitcode = exitcode
        self.address = address


class SoftTimeLimitExceeded(Exception):
    """Raised *inside* a pool task, in the thread running it, when the task
    runs past its soft time limit (``Pool(soft_time_limit=...)``,
    ``ProcessPoolExecutor(soft_time_limit=...)`` or
    ``fiber.pool.soft-time-limit``), as billiard and Celery raise theirs.

    The task may catch it to clean up, then return or raise; uncaught, its
    result raises it in the caller.  An ``Exception``, so ``except Exception``
    in a task catches it too (and ``Pool(retries=...)`` retries it).
    """


class TimeLimitExceeded(multiprocessing.TimeoutError):
    """A pool task ran past its hard time limit (``Pool(time_limit=...)``,
    ``ProcessPoolExecutor(time_limit=...)`` or ``fiber.pool.time-limit``).

    Its slot process was killed and replaced; the task is not run again (a
    worker lost for another reason re-runs its task).  The other tasks and the
    pool go on.  A ``multiprocessing.TimeoutError``, so code catching the
    stdlib's timeout catches it.
    """


class PoolTerminatedError(multiprocessing.ProcessError):
    """The pool was terminated before this result was computed.

    The stdlib leaves such results waiting forever; fiber-dask tells the caller.
    """


class RemoteTaskError(multiprocessing.ProcessError):
    """A task raised an exception that cannot be rebuilt in this process.

    Its class is not importable here, or it cannot be unpickled.  Carries what
    is known of it: ``type_name`` (``module.QualName``), ``message`` (its
    ``str()``) and ``traceback`` (the worker's formatted traceback text, also
    attached as ``__cause__`` as for every pool task failure).
    """

    def __init__(self, type_name: str, message: str, traceback: str = "") -> None:
        super().__init__(type_name, message, traceback)
        self.type_name = type_name
        self.message = message
        self.traceback = traceback

    def __str__(self) -> str:
        return (
            f"{self.type_name}: {self.message} (raised in a pool worker; the "
            "exception could not be rebuilt here, see the remote traceback)"
        )


class RingError(multiprocessing.ProcessError):
    """A member of a :class:`fiber_dask.experimental.Ring` failed, so the ring did.

    Raised by ``Ring.run()`` on the first member that raised, exited before its
    function returned, was killed or lost its host (the other members, which
    would otherwise wait in their collective forever, are stopped first), or
    when the ring did not form within its ``rendezvous_timeout``.  The message
    names the rank, its host and the cause; so do the attributes ``rank``,
    ``host``, ``exitcode`` (None if the process had not ended) and ``cause`` (a
    sentence).  A member's own exception, when it raised one, is
    ``__cause__``, with the member's traceback as its own ``__cause__`` (as for
    a Pool task).
    """

    def __init__(
        self,
        message: str,
        *,
        rank: int | None = None,
        host: str | None = None,
        exitcode: int | None = None,
        cause: str | None = None,
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.host = host
        self.exitcode = exitcode
        self.cause = cause


class ClusterCapacityError(OSError):
    """A pool asked for more slots than the cluster fiber-dask started can ever
    hold (``Pool(10**6)`` on the embedded cluster): more memory, processes or
    file descriptors than this machine gives.  Raised at once by ``Pool()``,
    where the stdlib's ``Pool`` fails with an ``OSError`` when it cannot fork;
    the message says which limit and what to change."""


class ClusterConnectionError(ConnectionError):
    """The Dask scheduler could not be reached or started."""


class TLSConnectionError(ConnectionError):
    """A direct connection failed for a TLS reason: one end uses TLS (its
    cluster does) and the other does not, or their certificates are not signed
    by the same authority.  The message says which end lacks what."""


class ManagerConnectionError(ConnectionError, EOFError):
    """A manager's server process is gone or unreachable.

    The stdlib raises ``EOFError`` or a ``ConnectionError`` here depending on the
    moment; this is both, so code written for either still catches it.
    """


class BrokenProcessPool(concurrent.futures.process.BrokenProcessPool):
    """A ``fiber_dask.futures.ProcessPoolExecutor`` call could not be completed.

    Raised where the stdlib's executor raises its ``BrokenProcessPool`` (this is a
    subclass, so ``except concurrent.futures.process.BrokenProcessPool`` catches
    it), with the reason as ``__cause__``: a call whose worker process died more
    often than ``fiber.pool.allowed-failures`` allows (:class:`WorkerLostError`;
    the other calls go on), an initializer that raised, or a pool terminated by
    ``fiber_dask.shutdown()`` (the executor is then unusable, as in the stdlib).
    """


class Problem(NamedTuple):
    """One thing wrong with the configuration, as a :class:`ConfigError` carries it.

    Collected by :func:`fiber_dask.config.validate`, one per offending key.
    """

    #: Dotted key, e.g. ``"fiber.local.n-workers"``.
    key: str
    #: The offending value.
    value: Any
    #: What is wrong, e.g. ``"unknown key; did you mean 'chunksize'?"``.
    reason: str
    #: What would be accepted.
    allowed: str
    #: Where the value came from (environment variable, file, code).
    source: str

    def __str__(self) -> str:
        return (
            f"{self.key} = {self.value!r}\n"
            f"    {self.reason}\n"
            f"    allowed: {self.allowed}\n"
            f"    from: {self.source}"
        )


class ConfigError(ValueError):
    """The ``fiber`` configuration is invalid.

    The message names every offending key, its value, what is allowed and where the
    value came from; the same information is available as :attr:`problems`.
    Also importable as ``fiber_dask.config.ConfigError``.
    """

    def __init__(self, message: str, problems: Sequence[Problem] = ()) -> None:
        super().__init__(message)
        #: The individual problems, most relevant first.
        self.problems: tuple[Problem, ...] = tuple(problems)
