"""``concurrent.futures`` on a Dask cluster: ``ProcessPoolExecutor`` on the Pool engine.

``fiber_dask.futures`` is a drop-in for ``concurrent.futures``: the names a user
imports next to the executor (``as_completed``, ``wait``, ``Future``, ...) are the
stdlib's own objects, and :class:`ProcessPoolExecutor` keeps the stdlib's contract
while its worker processes are Dask workers.

How a call travels::

    caller thread                  pool result thread            pool-worker loop
    ─────────────                  ──────────────────            ────────────────
    submit(fn, *a, **k)
      Future (PENDING) ─► _pending
      _pump(): while fewer than
      `_limit` calls are handed
      out: set RUNNING, ──────────── Pool.apply_async ──────────► _Task(fn)(*a, **k)
      (a cancelled Future is                                      runs fn, pickles
      skipped here)                                               (ok, result/error)
                                   ◄───── callback(ok, blob) ───
                                   _pump() (refill first), then
                                   unpickle, set_result /
                                   set_exception: the Future's
                                   callbacks and waiters run

Calls wait on the owner's side in ``_pending`` and only about ``max_workers`` plus a
few are handed to the pool, as the stdlib bounds its call queue: a queued call can
still be cancelled (``Future.cancel()``, ``shutdown(cancel_futures=True)``), and
nothing queued is lost in a pool.  Per call there is no scheduler round trip: the
pool sends it to a long-running loop over the direct channel (see
:mod:`fiber_dask.pool`).

The task runs inside :class:`_Task`, which catches the task's exception and pickles
the outcome itself, so that the caller gets exactly what the stdlib gives: the
task's own exception with ``__cause__`` a ``concurrent.futures.process.
_RemoteTraceback`` holding the worker's traceback, and a result that cannot be
pickled fails its Future with the pickling error.

Python 3.14's additions are here on every Python: ``map(..., buffersize=)``
(:func:`_buffered_map`: bounded submission, an endless input works) and
``terminate_workers()`` / ``kill_workers()`` (the pool terminated, then
SIGTERM / SIGKILL to its slot processes through their Dask workers, before
its loops are told to stop: :meth:`ProcessPoolExecutor._force_shutdown`).

Worker loss: a loop whose worker process dies has its calls re-run by the pool; a
call that lost more workers than ``fiber.pool.allowed-failures`` fails with
:class:`~fiber_dask.errors.BrokenProcessPool` (cause: the pool's
:class:`~fiber_dask.errors.WorkerLostError`).  Where the stdlib breaks the whole
executor on any worker death, this one keeps running the other calls.
"""

from __future__ import annotations

import collections
import concurrent.futures
import itertools
import logging
import os
import pickle
import signal
import threading
import time
import traceback
import weakref
from concurrent.futures import (
    ALL_COMPLETED,
    FIRST_COMPLETED,
    FIRST_EXCEPTION,
    BrokenExecutor,
    CancelledError,
    Executor,
    Future,
    InvalidStateError,
    ThreadPoolExecutor,
    TimeoutError,
    as_completed,
    wait,
)
from concurrent.futures.process import _ExceptionWithTraceback, _RemoteTraceback
from multiprocessing.pool import RemoteTraceback as _PoolRemoteTraceback
from typing import Any, Callable, Iterable

from .errors import BrokenProcessPool, PoolTerminatedError, WorkerLostError

__all__ = [
    "FIRST_COMPLETED",
    "FIRST_EXCEPTION",
    "ALL_COMPLETED",
    "CancelledError",
    "TimeoutError",
    "BrokenExecutor",
    "BrokenProcessPool",
    "InvalidStateError",
    "Future",
    "Executor",
    "wait",
    "as_completed",
    "ProcessPoolExecutor",
    "ThreadPoolExecutor",
]

logger = logging.getLogger(__name__)

#: Calls handed to the pool beyond one per worker.  The stdlib queues one extra
#: (``EXTRA_QUEUED_CALLS``) in a pipe the workers read from directly; here a
#: result travels back to this process before the next call is handed out, so a
#: few more keep the loops busy while a result is on its way.  Handed-out calls
#: can no longer be cancelled: keep this small.
EXTRA_QUEUED_CALLS = 4

#: Seconds the interpreter waits at exit for calls an executor still has (the
#: stdlib waits for them without a limit); after that they are abandoned.
EXIT_WAIT = 60.0

_TASK_CACHE = 256

_global_shutdown = False
_live: weakref.WeakSet = weakref.WeakSet()


# ------------------------------------------------------------ the worker side


class _InitializerFailed(Exception):
    """The initializer raised in a worker; the message holds its traceback."""


_worker_state = threading.local()


def _main_namespace() -> Any:
    ns = getattr(_worker_state, "main", None)
    if ns is None:
        from .launch.mainglobals import MainNamespace

        ns = _worker_state.main = MainNamespace()
    return ns


def _initialize(initializer: Callable | None, initargs: tuple) -> None:
    """Runs first in every pool-worker loop (again when a loop is restarted).

    A fresh ``__main__`` namespace per loop: the initializer and the tasks that
    follow share globals as in a stdlib worker process, and a loop restarted by
    ``max_tasks_per_child`` starts from nothing, as a new process would.
    """
    from .launch.mainglobals import MainNamespace

    _worker_state.main = MainNamespace()
    if initializer is None:
        return
    try:
        _worker_state.main.adopt(initializer)(*initargs)
    except BaseException as e:  # noqa: BLE001 - as the stdlib, any exception
        raise _InitializerFailed(
            "".join(traceback.format_exception(type(e), e, e.__traceback__))
        ) from None


def _dumps(value: Any) -> bytes:
    # The stdlib pickles with pickle; cloudpickle also carries what only it can
    # (a lambda returned by a task), as fiber-dask's Pool does.
    try:
        return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:
        import cloudpickle

        return cloudpickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)


def _dumps_error(exc: BaseException) -> bytes:
    # Without the reducers other libraries register for exceptions: distributed
    # installs tblib's, which drops the arguments of exceptions with their own
    # __init__ (SystemExit(3) would arrive with code None).  The stdlib's
    # workers pickle with the exceptions' own __reduce__, and so do we.
    import copyreg
    import io

    buf = io.BytesIO()
    pickler = pickle.Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL)
    pickler.dispatch_table = {
        k: v
        for k, v in copyreg.dispatch_table.items()
        if not (isinstance(k, type) and issubclass(k, BaseException))
    }
    pickler.dump(_ExceptionWithTraceback(exc, exc.__traceback__))
    return buf.getvalue()


class _Chunked:
    """``map``'s task: call ``fn`` on each argument tuple of a chunk."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable) -> None:
        self.fn = fn

    def __reduce__(self):
        return _Chunked, (self.fn,)

    def __call__(self, chunk: list) -> list:
        fn = self.fn
        return [fn(*args) for args in chunk]


class _Task:
    """What the pool runs for one call: ``fn(*args, **kwargs)`` → ``(ok, blob)``.

    ``blob`` is the pickled result, or the pickled exception with its traceback
    (the stdlib's ``_ExceptionWithTraceback``).  Pickling here, inside the worker,
    is what lets a result that cannot be pickled fail just its own call with the
    pickling error, as the stdlib's does.  One ``_Task`` per function is kept by
    the executor, so the pool sends it to each loop once.
    """

    __slots__ = ("fn",)

    def __init__(self, fn: Callable) -> None:
        self.fn = fn

    def __reduce__(self):
        return _Task, (self.fn,)

    def __call__(self, *args: Any, **kwargs: Any) -> tuple[bool, bytes]:
        fn = self.fn
        ns = _main_namespace()
        if type(fn) is _Chunked:
            fn = _Chunked(ns.adopt(fn.fn))
        else:
            fn = ns.adopt(fn)
        try:
            result = fn(*args, **kwargs)
        except (Exception, SystemExit) as e:
            # SystemExit too: sys.exit() in a task fails its Future (the stdlib
            # catches BaseException), it must not end the loop.
            return False, _pickled_error(e)
        try:
            return True, _dumps(result)
        except Exception as e:
            return False, _pickled_error(e)


def _pickled_error(exc: BaseException) -> bytes:
    try:
        return _dumps_error(exc)
    except Exception as e:
        # The exception itself cannot be pickled: send why, as the stdlib does.
        return _dumps_error(e)


# ------------------------------------------------------------- the owner side


class _WorkItem:
    __slots__ = ("executor", "future", "fn", "args", "kwargs")

    def __init__(self, executor, future, fn, args, kwargs):
        self.executor = executor
        self.future = future
        self.fn = fn
        self.args = args
        self.kwargs = kwargs

    def on_result(self, value: tuple[bool, bytes]) -> None:
        self.executor._settle(self, value, None)

    def on_error(self, exc: BaseException) -> None:
        self.executor._settle(self, None, exc)


class ProcessPoolExecutor(concurrent.futures.ProcessPoolExecutor):
    """A ``concurrent.futures.ProcessPoolExecutor`` whose processes are Dask workers.

    Same signature and behaviour as the stdlib's; the keyword-only arguments after
    ``max_tasks_per_child`` are fiber-dask's.  It subclasses the stdlib's class so
    that code checking ``isinstance(executor, ProcessPoolExecutor)`` accepts it;
    every public method is its own (none of the stdlib's machinery runs).

    Parameters
    ----------
    max_workers : int, optional
        How many calls run at once.  Default: the cluster's task slots
        (``fiber_dask.cpu_count()``), as the stdlib uses the machine's CPUs.
    mp_context : optional
        Accepted for compatibility: ``None`` or ``fiber_dask.get_context()``.  A
        stdlib context is ignored with a ``RuntimeWarning`` (the processes are
        Dask workers whatever it says).
    initializer, initargs
        ``initializer(*initargs)`` runs in each worker before its first call
        (again when a worker is replaced).  If it raises, the executor is broken:
        pending and later calls fail with ``BrokenProcessPool``, as in the stdlib.
    max_tasks_per_child : int, optional
        After this many calls a worker's loop is replaced by a fresh one (its
        initializer runs again).
    client : distributed.Client, optional
        Run on this client's cluster.
    address : str, optional
        Attach to the scheduler at this address.
    resources : dict, optional
        Dask worker resources each worker slot needs, e.g. ``{"GPU": 1}``.
    time_limit, soft_time_limit : float or str, optional
        Per-call time limits, as :class:`fiber_dask.Pool`'s (beyond the
        stdlib): past ``soft_time_limit`` the call gets
        :class:`~fiber_dask.errors.SoftTimeLimitExceeded` raised inside it;
        past ``time_limit`` its worker process is killed and replaced and its
        future raises :class:`~fiber_dask.errors.TimeLimitExceeded`.  The
        executor stays usable (not broken).  Defaults: ``fiber.pool.time-limit``,
        ``fiber.pool.soft-time-limit``.

    Examples
    --------
    >>> from fiber_dask.futures import ProcessPoolExecutor, as_completed
    >>> with ProcessPoolExecutor(4) as ex:                        # doctest: +SKIP
    ...     futures = [ex.submit(pow, 2, n) for n in range(4)]
    ...     sorted(f.result() for f in as_completed(futures))
    [1, 2, 4, 8]
    """

    def __init__(
        self,
        max_workers: int | None = None,
        mp_context: Any = None,
        initializer: Callable | None = None,
        initargs: Iterable = (),
        *,
        max_tasks_per_child: int | None = None,
        client: Any = None,
        address: str | None = None,
        resources: dict | None = None,
        time_limit: float | str | None = None,
        soft_time_limit: float | str | None = None,
    ) -> None:
        if max_workers is not None and max_workers <= 0:
            raise ValueError("max_workers must be greater than 0")
        _check_context(mp_context)
        if initializer is not None and not callable(initializer):
            raise TypeError("initializer must be a callable")
        if max_tasks_per_child is not None:
            if not isinstance(max_tasks_per_child, int):
                raise TypeError("max_tasks_per_child must be an integer")
            if max_tasks_per_child <= 0:
                raise ValueError("max_tasks_per_child must be >= 1")
        self._mp_context = mp_context
        self._initializer = initializer
        self._initargs = initargs
        self._max_tasks_per_child = max_tasks_per_child

        self._shutdown_lock = threading.Lock()
        self._shutdown_thread = False
        self._broken: str | bool = False
        self._broken_cause: BaseException | None = None
        self._pending: collections.deque = collections.deque()
        self._handed = 0
        self._pumping = False
        self._idle = threading.Condition(self._shutdown_lock)
        self._tasks: collections.OrderedDict = collections.OrderedDict()
        self._pool_closed = False

        from .pool import Pool

        self._pool = Pool(
            max_workers,
            _initialize,
            (initializer, tuple(initargs)),
            max_tasks_per_child,
            client=client,
            address=address,
            resources=resources,
            time_limit=time_limit,
            soft_time_limit=soft_time_limit,
        )
        # Libraries read it (as they read a Pool's _processes).
        self._max_workers = self._pool._processes
        self._limit = self._max_workers + EXTRA_QUEUED_CALLS
        _live.add(self)

    def __repr__(self) -> str:
        cls = type(self)
        state = (
            "broken"
            if self._broken
            else "shutdown"
            if self._shutdown_thread
            else "running"
        )
        return (
            f"<{cls.__module__}.{cls.__qualname__} {state} "
            f"max_workers={self._max_workers}>"
        )

    # ---------------------------------------------------------------- public

    def submit(self, fn: Callable, /, *args: Any, **kwargs: Any) -> Future:
        """Schedule ``fn(*args, **kwargs)``; returns a :class:`concurrent.futures.Future`."""
        with self._shutdown_lock:
            if self._broken:
                raise BrokenProcessPool(self._broken) from self._broken_cause
            if self._shutdown_thread:
                raise RuntimeError("cannot schedule new futures after shutdown")
            if _global_shutdown:
                raise RuntimeError(
                    "cannot schedule new futures after interpreter shutdown"
                )
            f = Future()
            self._pending.append(_WorkItem(self, f, fn, args, kwargs))
        self._pump()
        return f

    submit.__doc__ = Executor.submit.__doc__

    def map(
        self,
        fn: Callable,
        *iterables: Iterable,
        timeout: float | None = None,
        chunksize: int = 1,
        buffersize: int | None = None,
    ):
        """Returns an iterator equivalent to ``map(fn, *iterables)``.

        As the stdlib's: the results come lazily and in order, ``TimeoutError``
        if the whole iterator is not ready within ``timeout`` seconds of this
        call, and the first call that raised raises when its result is reached.
        ``chunksize`` arguments travel per task.

        ``buffersize`` (Python 3.14's argument, here on every Python): at most
        that many tasks (chunks) are submitted and not yet yielded; the input
        is read one chunk further each time a result is taken, so an endless
        iterable (``itertools.count()``) works.  ``None`` (the default)
        submits everything at once, as before 3.14.
        """
        if chunksize < 1:
            raise ValueError("chunksize must be >= 1.")
        results = _buffered_map(
            self,
            _Chunked(fn),
            (_get_chunks(*iterables, chunksize=chunksize),),
            timeout,
            buffersize,
        )
        return _chain_from_iterable_of_lists(results)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Accept no more calls; with ``wait``, return once the calls are done.

        ``cancel_futures=True`` cancels the calls not handed to a worker yet.
        The workers are released once every remaining call has finished.
        """
        with self._shutdown_lock:
            self._shutdown_thread = True
            if cancel_futures:
                while self._pending:
                    self._pending.popleft().future.cancel()
            close_now = not self._pending and self._handed == 0
        if close_now:
            self._close_pool()
        if wait:
            with self._shutdown_lock:
                while self._pending or self._handed:
                    self._idle.wait()
            self._close_pool()
            self._pool.join()

    shutdown.__doc__ = Executor.shutdown.__doc__

    def terminate_workers(self) -> None:
        """Python 3.14's: shut down at once and end the workers with SIGTERM.

        As the stdlib's: ``shutdown(wait=False, cancel_futures=True)``, then
        each worker process still alive gets SIGTERM.  The executor is broken
        afterwards: the calls that were running fail with
        :class:`BrokenProcessPool`, ``submit`` raises it.  Here on every
        Python; a worker process is the slot process of the executor's pool on
        its Dask worker's host (with ``fiber.pool.slots: thread`` there is no
        process of its own to signal: the running calls are interrupted and
        the Dask workers stay).
        """
        self._force_shutdown(_TERMINATE)

    def kill_workers(self) -> None:
        """Python 3.14's: as :meth:`terminate_workers`, with SIGKILL."""
        self._force_shutdown(_KILL)

    def _force_shutdown(self, operation: str) -> None:
        if operation not in _FORCE_OPERATIONS:
            raise ValueError(f"Unsupported operation: {operation!r}")
        self.shutdown(wait=False, cancel_futures=True)
        self._break(
            f"The executor's worker processes were ended by {operation}_workers(); "
            "the process pool is not usable anymore.",
            PoolTerminatedError(f"{operation}_workers() was called"),
        )
        signum = signal.SIGTERM if operation == _TERMINATE else signal.SIGKILL
        engine = self._pool._engine
        # The pool is terminated first (it sends and re-runs nothing more, and
        # fails the calls that were running: BrokenProcessPool, as the
        # stdlib's executor fails them when it sees its workers die), then
        # its slot processes get the signal and up to _SIGNAL_GRACE s to end,
        # and only then are its loops told to stop: a process that survives
        # the signal (a handler that returns) is ended as the pool's
        # terminate() ends it, where the stdlib's would leave it running.
        try:
            engine.terminate(
                first=lambda processes: _end_slot_processes(engine, processes, signum)
            )
        except Exception:  # noqa: BLE001 - ended already (fiber_dask.shutdown())
            logger.debug("fiber-dask: terminating the pool failed", exc_info=True)

    def __del__(self) -> None:
        # Dropped without shutdown(): let the pool's loops go without blocking.
        if getattr(self, "_pool", None) is not None and not self._pool_closed:
            try:
                self._close_pool()
            except Exception:  # noqa: BLE001 - best effort at collection
                pass

    # --------------------------------------------------------------- internal

    def _task(self, fn: Callable) -> _Task:
        """The one ``_Task`` for ``fn`` (so the pool pickles it once per loop)."""
        entry = self._tasks.get(id(fn))
        if entry is not None and entry[0] is fn:
            return entry[1]
        task = _Task(fn)
        self._tasks[id(fn)] = (fn, task)  # holding fn keeps its id from reuse
        if len(self._tasks) > _TASK_CACHE:
            self._tasks.popitem(last=False)
        return task

    def _pump(self) -> None:
        """Hand pending calls to the pool while fewer than ``_limit`` are out.

        One thread at a time hands out (so calls go in submission order); a
        thread that finds another one doing it leaves its call to that one,
        which looks again under the lock before it stops.  The pool is called
        without our lock held: it may call back (a pickling error) from under
        its own lock, and holding ours there would invert the lock order.
        """
        with self._shutdown_lock:
            if self._pumping:
                return
            self._pumping = True
        try:
            while True:
                with self._shutdown_lock:
                    item = None
                    while self._pending and self._handed < self._limit:
                        candidate = self._pending.popleft()
                        if candidate.future.set_running_or_notify_cancel():
                            item = candidate
                            self._handed += 1
                            task = self._task(candidate.fn)
                            break
                    if item is None:
                        self._pumping = False
                        if not self._pending and not self._handed:
                            self._idle.notify_all()
                        return
                self._hand(item, task)
        except BaseException:
            with self._shutdown_lock:
                self._pumping = False
            raise

    def _hand(self, item: _WorkItem, task: _Task) -> None:
        try:
            self._pool.apply_async(
                task, item.args, item.kwargs, item.on_result, item.on_error
            )
        except ValueError as e:  # "Pool not running": terminated under us
            self._settle(item, None, PoolTerminatedError(str(e)))
        finally:
            item.args = item.kwargs = None

    def _settle(
        self,
        item: _WorkItem,
        value: tuple[bool, bytes] | None,
        error: BaseException | None,
    ) -> None:
        """A handed-out call is done (runs in the pool's result thread)."""
        with self._shutdown_lock:
            self._handed -= 1
        if error is not None:
            self._on_pool_error(item, error)
        self._pump()  # refill before settling: keep the workers busy
        future = item.future
        if error is None:
            ok, blob = value
            try:
                outcome = pickle.loads(blob)
            except Exception as e:
                # A result (or exception) class this process cannot load fails
                # this call only; the stdlib would break the whole executor.
                ok, outcome = False, e
            if ok:
                _set(future.set_result, outcome)
            else:
                _set(future.set_exception, outcome)
        elif not future.done():
            _set(future.set_exception, self._translate(error))
        self._maybe_finish()

    def _on_pool_error(self, item: _WorkItem, error: BaseException) -> None:
        """An error from the pool itself, not from the call: break if fatal."""
        if isinstance(error, _InitializerFailed):
            self._break(
                "A process in the process pool failed in its initializer; the "
                "process pool is not usable anymore. The initializer's "
                f"traceback:\n{error}",
                error,
            )
        elif isinstance(error, PoolTerminatedError):
            self._break(
                "The executor's pool was terminated (fiber_dask.shutdown() or "
                "interpreter exit); the process pool is not usable anymore.",
                error,
            )

    def _translate(self, error: BaseException) -> BaseException:
        if isinstance(error, WorkerLostError):
            exc = BrokenProcessPool(
                f"{error} (the stdlib raises BrokenProcessPool when a worker "
                "process dies; fiber-dask re-runs the call up to that limit)"
            )
            exc.__cause__ = error
            return exc
        if self._broken and isinstance(
            error, (_InitializerFailed, PoolTerminatedError)
        ):
            exc = BrokenProcessPool(self._broken)
            exc.__cause__ = error
            return exc
        cause = error.__cause__
        if isinstance(cause, _PoolRemoteTraceback):
            # Raised in a worker outside the call (its function or arguments
            # could not be loaded there): the stdlib's traceback class.
            error.__cause__ = _RemoteTraceback(cause.tb)
        return error

    def _break(self, message: str, cause: BaseException) -> None:
        """Fail everything pending, now and later, with ``BrokenProcessPool``."""
        with self._shutdown_lock:
            if self._broken:
                return
            self._broken = message
            self._broken_cause = cause
            pending = list(self._pending)
            self._pending.clear()
        for item in pending:
            if item.future.set_running_or_notify_cancel():
                exc = BrokenProcessPool(message)
                exc.__cause__ = cause
                _set(item.future.set_exception, exc)
        self._maybe_finish()

    def _maybe_finish(self) -> None:
        with self._shutdown_lock:
            idle = not self._pending and not self._handed
            if idle:
                self._idle.notify_all()
            close = idle and (self._shutdown_thread or self._broken)
        if close:
            self._close_pool()

    def _close_pool(self) -> None:
        with self._shutdown_lock:
            if self._pool_closed:
                return
            self._pool_closed = True
        _live.discard(self)
        try:
            self._pool.close()
        except Exception:  # noqa: BLE001 - a terminated pool is closed already
            pass

    def _outstanding(self) -> int:
        with self._shutdown_lock:
            return len(self._pending) + self._handed


#: The operations of ``_force_shutdown`` (Python 3.14's names and values).
_TERMINATE = "terminate"
_KILL = "kill"
_FORCE_OPERATIONS = frozenset({_TERMINATE, _KILL})


#: Seconds ``terminate_workers()`` waits for its signals to be delivered.
_SIGNAL_WAIT = 5.0
#: Seconds a signalled slot process gets to end (a SIGTERM handler to run)
#: before the pool's own terminate interrupts what it runs.
_SIGNAL_GRACE = 1.0


def _signal_process(pid: int, signum: int) -> bool:
    """Send ``signum`` to the slot process ``pid`` of this host; never to the
    process calling this (a thread slot's pid is its Dask worker's).  True
    if it was sent."""
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, signum)
    except (ProcessLookupError, PermissionError):
        return False  # it ended before the signal, as the stdlib's ProcessLookupError
    return True


def _signal_on_worker(pids: dict, signum: int, dask_worker: Any = None) -> list:
    """On each Dask worker (``client.run``): signal its host's slot processes;
    returns the pids signalled."""
    return [p for p in pids.get(dask_worker.address, ()) if _signal_process(p, signum)]


def _signal_processes(client: Any, processes: list, signum: int) -> set[int]:
    """Deliver ``signum`` to each ``(worker address, pid)`` slot process where
    it runs: through its Dask worker, which shares its host (an early slot,
    worker None, runs on this host).  Returns the pids signalled once
    delivered, or what was delivered after ``_SIGNAL_WAIT`` s."""
    sent: set[int] = set()
    remote: dict[str, list[int]] = {}
    for worker, pid in processes:
        if not isinstance(pid, int):
            continue
        if worker is None:
            if _signal_process(pid, signum):
                sent.add(pid)
        else:
            remote.setdefault(worker, []).append(pid)
    if not remote:
        return sent
    answers: dict = {}

    def run() -> None:
        try:
            answers.update(
                client.run(_signal_on_worker, remote, signum, workers=list(remote))
            )
        except Exception:  # noqa: BLE001 - a worker or the client is gone
            logger.debug("fiber-dask: signalling slot processes", exc_info=True)

    thread = threading.Thread(target=run, name="fiber-signal-slots", daemon=True)
    thread.start()
    thread.join(_SIGNAL_WAIT)
    for pids in list(answers.values()):
        sent.update(pids)
    return sent


def _end_slot_processes(engine: Any, processes: list, signum: int) -> None:
    """Signal the processes, then give them ``_SIGNAL_GRACE`` s to hang up
    (the pool's terminate then interrupts those still there)."""
    sent = _signal_processes(engine._client, processes, signum)
    deadline = time.monotonic() + _SIGNAL_GRACE
    while sent and time.monotonic() < deadline:
        with engine._lock:
            if not any(p.pid in sent for p in engine._peers.values()):
                return
        time.sleep(0.01)


def _check_buffersize(buffersize: Any) -> None:
    if buffersize is not None and not isinstance(buffersize, int):
        raise TypeError("buffersize must be an integer or None")
    if buffersize is not None and buffersize < 1:
        raise ValueError("buffersize must be None or > 0")


def _buffered_map(
    executor: Executor,
    fn: Callable,
    iterables: tuple,
    timeout: float | None,
    buffersize: int | None,
):
    """``Executor.map`` as Python 3.14 defines it, ``buffersize`` included.

    Without ``buffersize`` every call is submitted now.  With it, the first
    ``buffersize`` are, and each result taken submits the next input's call
    before it waits: at most ``buffersize`` calls are submitted and not yet
    yielded, and the input is read no further than that (an endless one
    works).  The executor is held weakly, so that the iterator does not keep
    it alive.
    """
    _check_buffersize(buffersize)
    end = None if timeout is None else time.monotonic() + timeout
    args = zip(*iterables)  # noqa: B905 - as map(): stops at the shortest
    if buffersize is None:
        fs = collections.deque(executor.submit(fn, *a) for a in args)
        more = None
    else:
        fs = collections.deque(
            executor.submit(fn, *a) for a in itertools.islice(args, buffersize)
        )
        more = args
    return _results(fs, more, weakref.ref(executor), fn, end)


def _results(fs: collections.deque, more: Any, executor_ref: Any, fn: Callable, end):
    try:
        while fs:
            if more is not None:
                executor = executor_ref()
                following = next(more, None) if executor is not None else None
                if following is not None:
                    fs.append(executor.submit(fn, *following))
                del executor
            left = None if end is None else end - time.monotonic()
            # Not holding the future once it is yielded (the stdlib's care).
            yield _result_or_cancel(fs.popleft(), left)
    finally:
        for future in fs:
            future.cancel()


def _result_or_cancel(future: Future, timeout: float | None):
    try:
        try:
            return future.result(timeout)
        finally:
            future.cancel()
    finally:
        del future


def _get_chunks(*iterables: Iterable, chunksize: int):
    """Argument tuples in chunks of ``chunksize`` (the stdlib's ``_get_chunks``)."""
    it = zip(*iterables)  # noqa: B905 - as map(): stops at the shortest
    while True:
        chunk = tuple(itertools.islice(it, chunksize))
        if not chunk:
            return
        yield chunk


def _chain_from_iterable_of_lists(iterable):
    """Flatten ``map``'s chunk results without keeping references to the items
    already yielded (as the stdlib's helper of the same name)."""
    for element in iterable:
        element.reverse()
        while element:
            yield element.pop()


def _set(setter: Callable, value: Any) -> None:
    try:
        setter(value)
    except InvalidStateError:  # settled already (e.g. broken meanwhile)
        pass


def _check_context(ctx: Any) -> None:
    if ctx is None:
        return
    from .context import DaskContext

    if isinstance(ctx, DaskContext):
        return
    import multiprocessing.context

    if isinstance(ctx, multiprocessing.context.BaseContext):
        import warnings

        warnings.warn(
            f"mp_context={ctx!r} is ignored: fiber-dask's executor runs its calls "
            "on Dask workers whatever the start method. Pass "
            "fiber_dask.get_context() or None to silence this warning.",
            RuntimeWarning,
            stacklevel=3,
        )
        return
    raise TypeError(
        f"mp_context must be None or a multiprocessing context such as "
        f"fiber_dask.get_context(), not {ctx!r}"
    )


def _python_exit() -> None:
    """At interpreter exit, as the stdlib: no new calls, and the calls already
    submitted finish first (up to ``EXIT_WAIT`` seconds, then abandoned)."""
    global _global_shutdown
    _global_shutdown = True
    deadline = time.monotonic() + EXIT_WAIT
    for executor in list(_live):
        with executor._shutdown_lock:
            while executor._pending or executor._handed:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                executor._idle.wait(min(left, 1.0))
            left_over = len(executor._pending) + executor._handed
        if left_over:
            logger.warning(
                "fiber-dask: %d call(s) of %r still unfinished %.0f s after "
                "interpreter exit began were abandoned",
                left_over,
                executor,
                EXIT_WAIT,
            )
        executor._close_pool()


try:
    # Before non-daemon threads are joined and before atexit (which shuts the
    # cluster down), as concurrent.futures.process registers its own.
    threading._register_atexit(_python_exit)
except (AttributeError, RuntimeError):  # pragma: no cover - at shutdown already
    pass


def __getattr__(name: str) -> Any:
    # The rest of concurrent.futures (its submodules, names added by newer
    # Pythons), so that this module can stand in for it in a swapped script.
    try:
        return getattr(concurrent.futures, name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None


def _process_view() -> Any:
    """``concurrent.futures.process`` as a swapped script sees it: the stdlib
    module's names, with this module's :class:`ProcessPoolExecutor`.  Its
    ``BrokenProcessPool`` stays the stdlib's, which catches ours (a subclass)."""
    import types
    from concurrent.futures import process as stdlib_process

    view = types.ModuleType(__name__ + ".process", stdlib_process.__doc__)
    for name, value in vars(stdlib_process).items():
        if not name.startswith("__"):
            setattr(view, name, value)
    view.ProcessPoolExecutor = ProcessPoolExecutor
    return view


#: ``concurrent.futures.process`` for a script run with ``--swap-multiprocessing``.
process = _process_view()
