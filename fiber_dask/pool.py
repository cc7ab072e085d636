"""``Pool``: ``multiprocessing.pool.Pool`` on a Dask cluster.

How a call travels::

    caller thread            result thread (one per pool,        pool-worker loop
                             in the pool's PoolEngine)           (a long-running
    ─────────────            ────────────────────────────        Dask task, one
    apply_async/map/imap                                          per slot)
      job → engine.submit
      _dispatch(): pick the   ◄─ Results([Result(ckey, ok, …)]) ─  serve(): run
      least-loaded loop per      _on_messages: refill the loops,   the chunks,
      chunk, send each loop      then settle the jobs: callbacks,  answer runs
      its chunks in one          event.set()                       of them
      Calls([Call(ckey, …), …]) ────────────────────────────────►
    Dask: places the loops (poolloops: one client.map, pure=False), re-runs a loop
    whose worker died, scales the cluster.  Per task there is no scheduler round trip.

The messages are :mod:`fiber_dask.engine.poolprotocol`'s (both ends use it); the
dispatcher is :class:`fiber_dask.engine.poolengine.PoolEngine`; the loops' Dask
tasks are kept running by :class:`fiber_dask.engine.poolloops.Loops`; the loop
is :mod:`fiber_dask.engine.poolworker`; jobs and results are
:mod:`fiber_dask.engine.poolresults`.

Each loop keeps a few chunks queued (``fiber.pool.prefetch`` worth of work,
learned from observed chunk times) so it never waits for the owner, and long
tasks are handed out one at a time so the tail stays balanced.

A loop whose connection drops (its worker died) has its chunks sent again to
the other loops: the one it was running item by item, so that only an item
running each time a worker died counts failures; an item that reaches
``fiber.pool.allowed-failures`` fails with :class:`WorkerLostError`.
"""

from __future__ import annotations

import logging
import warnings
from multiprocessing import TimeoutError  # noqa: F401  (re-exported as in stdlib)

# ThreadPool runs tasks in threads of the calling process, sharing its memory;
# code written for it may rely on that, so fiber-dask gives the stdlib's own.
from multiprocessing.pool import (  # noqa: F401
    MaybeEncodingError,
    RemoteTraceback,
    ThreadPool,  # noqa: F401
)
from typing import Any, Callable, Iterable

import cloudpickle

from . import cluster, config
from .engine import earlyslots, timelimits
from .engine.poolengine import CLOSE, INIT, RUN, TERMINATE, PoolEngine  # noqa: F401  (as the stdlib)
from .engine.poolresults import (
    ApplyResult,
    AsyncResult,
    IMapIterator,
    IMapUnorderedIterator,
    MapResult,
)

__all__ = [
    "Pool",
    "ThreadPool",
    "AsyncResult",
    "ApplyResult",
    "MapResult",
    "IMapIterator",
    "IMapUnorderedIterator",
    "MaybeEncodingError",
    "RemoteTraceback",
    "TimeoutError",
]

logger = logging.getLogger(__name__)


class Pool:
    """A process pool whose processes are Dask workers.

    Same signature and behaviour as :class:`multiprocessing.pool.Pool`; the
    keyword-only arguments after the stdlib ones are fiber-dask's.  The work is
    done by the :class:`~fiber_dask.engine.poolengine.PoolEngine` it holds
    (``_engine``); the pool inherits nothing from it, so what code sees on a
    pool (``dir``, ``hasattr``) is the stdlib pool's surface.

    Parameters
    ----------
    processes : int, optional
        How many tasks run at once.  Default: the cluster's task slots
        (``fiber_dask.cpu_count()``).  On the embedded cluster fiber-dask
        starts more worker processes if needed; elsewhere extra loops wait
        for free slots (or adaptive scaling).
    initializer, initargs
        ``initializer(*initargs)`` runs in each slot process, in its main
        thread, before its first task (again in a slot process that replaces
        one that ended or died).
    maxtasksperchild : int, optional
        After this many chunks a slot's process exits and a fresh one takes
        over (its initializer runs again), as in the stdlib.  With
        ``fiber.pool.slots: thread`` only the loop restarts and the Dask worker
        process is reused: see the warning it emits.
    context
        Accepted for compatibility and ignored.
    client : distributed.Client, optional
        Run on this client's cluster.
    address : str, optional
        Attach to the scheduler at this address.
    resources : dict, optional
        Dask worker resources each pool slot needs, e.g. ``{"GPU": 1}``.
    retries : int, optional
        Re-run a task that raises up to this many times before reporting it.
    time_limit : float or str, optional
        Hard time limit of each task, in seconds or as a duration (``"5m"``):
        a task still running then has its slot process killed and replaced,
        and its result raises :class:`~fiber_dask.errors.TimeLimitExceeded`
        (a ``multiprocessing.TimeoutError``); it is not run again, and the
        other tasks go on.  Default ``fiber.pool.time-limit`` (None: no
        limit).  Needs process slots (a thread cannot be killed).  Beyond the
        stdlib, as billiard's.
    soft_time_limit : float or str, optional
        Soft time limit of each task: :class:`~fiber_dask.errors.SoftTimeLimitExceeded`
        is raised inside the task, which may catch it to clean up.  Default
        ``fiber.pool.soft-time-limit``.  Set it below ``time_limit``.

    Examples
    --------
    >>> import fiber_dask as multiprocessing
    >>> with multiprocessing.Pool(4) as pool:           # doctest: +SKIP
    ...     pool.map(abs, [-1, -2, 3])
    [1, 2, 3]
    """

    _wrap_exception = True

    def __init__(
        self,
        processes: int | None = None,
        initializer: Callable | None = None,
        initargs: Iterable = (),
        maxtasksperchild: int | None = None,
        context: Any = None,
        *,
        client: Any = None,
        address: str | None = None,
        resources: dict | None = None,
        retries: int | None = None,
        time_limit: float | str | None = None,
        soft_time_limit: float | str | None = None,
    ) -> None:
        if processes is not None and processes < 1:
            raise ValueError("Number of processes must be at least 1")
        if initializer is not None and not callable(initializer):
            raise TypeError("initializer must be a callable")
        if maxtasksperchild is not None and (
            not isinstance(maxtasksperchild, int) or maxtasksperchild <= 0
        ):
            raise ValueError("maxtasksperchild must be a positive int or None")
        if retries is not None and (not isinstance(retries, int) or retries < 0):
            raise ValueError(
                f"retries must be a non-negative int or None, not {retries!r}"
            )
        slot_kind = config.get("pool.slots")
        if maxtasksperchild is not None and slot_kind == "thread":
            warnings.warn(
                "maxtasksperchild with fiber.pool.slots=thread: fiber-dask restarts the "
                "pool-worker loop (and runs the initializer again) after that many tasks, "
                "but the Dask worker process itself is reused, so memory a task leaked is "
                "not returned (fiber.pool.slots=process gives a fresh process).",
                RuntimeWarning,
                stacklevel=2,
            )
        config.validate()  # a typo'd or bad fiber.* value fails here, at first use
        soft, hard = timelimits.resolve(time_limit, soft_time_limit, slot_kind)
        if soft is not None and hard is not None and soft >= hard:
            warnings.warn(
                f"soft_time_limit ({soft:g}s) is not below time_limit ({hard:g}s): "
                "the task is killed before SoftTimeLimitExceeded could be raised in "
                "it. Set the soft limit (Pool(soft_time_limit=...), "
                "fiber.pool.soft-time-limit) below the hard one "
                "(Pool(time_limit=...), fiber.pool.time-limit).",
                RuntimeWarning,
                stacklevel=2,
            )
        # Pickled once, here: an unpicklable initializer fails in the caller.
        init_blob = (
            cloudpickle.dumps((initializer, tuple(initargs)))
            if initializer is not None
            else None
        )
        starting = None
        if client is None and address is None:
            # The first pool of a process with no cluster: its slots start
            # while the embedded cluster does (fiber_dask.engine.earlyslots).
            starting = earlyslots.start_cluster(processes, slot_kind, resources)
        if starting is not None:
            handle = starting
            if processes is None:
                processes = starting.planned_slots
        else:
            handle = cluster.get_handle(client=client, address=address)
            # A scheduler that was lost fails here, naming it, not in a loop later.
            cluster.check_connected(handle)
            if processes is None:
                processes = cluster.task_slots(handle)
        self._processes = processes
        self._engine = PoolEngine(
            handle,
            processes,
            init_blob=init_blob,
            maxtasks=maxtasksperchild,
            resources=resources,
            retries=retries or 0,
            slot_kind=slot_kind,
            soft_time_limit=soft,
            time_limit=hard,
        )
        self._engine.start()

    @property
    def _state(self) -> str:
        engine = self.__dict__.get("_engine")
        if engine is None:
            return INIT
        forced = self.__dict__.get("_forced_state")
        if forced is not None and forced[1] == engine.state:
            return forced[0]
        return engine.state

    @_state.setter
    def _state(self, value: str) -> None:
        # The stdlib's _state is a plain attribute that code (and CPython's own
        # tests) sets; here it is the engine's.  A value set here is what
        # _state reads until the engine's own state changes; the engine is not
        # touched (forcing RUN on a terminated pool does not revive it).
        engine = self.__dict__.get("_engine")
        self.__dict__["_forced_state"] = (
            value,
            INIT if engine is None else engine.state,
        )

    @property
    def _server(self) -> Any:
        """The channel server the loops connect back to (for tests and tools)."""
        return self._engine._server

    def _repopulate_pool(self) -> None:
        """Replace the slot processes that have ended (the stdlib's handler
        thread calls its own every 0.1 s).  The pool's result thread already
        starts a replacement as soon as a slot's loop ends; this wakes it so
        that it does so now."""
        self._engine._wake()

    @property
    def _pool(self) -> list:
        """One entry per slot, as the stdlib lists its worker processes (code
        reads ``len(pool._pool)`` and the entries' ``pid``/``is_alive()``)."""
        return self._engine.slots()

    # ------------------------------------------------------------------ public API

    def __repr__(self) -> str:
        cls = type(self)
        return (
            f"<{cls.__module__}.{cls.__qualname__} state={self._state} "
            f"pool_size={self._processes}>"
        )

    def __reduce__(self):
        raise NotImplementedError(
            "pool objects cannot be passed between processes or pickled"
        )

    def apply(
        self, func: Callable, args: Iterable = (), kwds: dict | None = None
    ) -> Any:
        """Call ``func(*args, **kwds)`` in a worker and return its result."""
        return self._wait(self.apply_async(func, args, kwds))

    def _wait(self, job: Any) -> Any:
        """The result of a blocking call's ``job``.  If the wait ends in an
        exception instead (Ctrl-C: KeyboardInterrupt), nobody can ever get
        the result, so the job is cancelled: its chunks not yet sent are
        dropped and those lost with an interrupted slot are not re-run (the
        stdlib runs them on in the background, ahead of the next map)."""
        try:
            return job.get()
        except BaseException as e:
            self._engine.cancel(job, e)
            raise

    def apply_async(self, func, args=(), kwds=None, callback=None, error_callback=None):
        """Asynchronous :meth:`apply`: returns an :class:`AsyncResult`."""
        self._check_running()
        job = ApplyResult(
            self._engine, func, args, kwds or {}, callback, error_callback
        )
        self._engine.submit(job)
        return job

    def map(self, func, iterable, chunksize=None):
        """Apply ``func`` to each item, in chunks; return the results in order.

        Without ``chunksize`` (and ``fiber.pool.chunksize`` unset) chunks are
        sized from the function's measured duration and the pool's slots
        (:func:`fiber_dask.engine.poolresults.measured_chunksize`; docs/scale.md);
        a given ``chunksize`` is used as the stdlib uses it.
        """
        return self._wait(self._map_async(func, iterable, 0, chunksize))

    def starmap(self, func, iterable, chunksize=None):
        """Like :meth:`map`, with each item unpacked as arguments: ``func(*item)``."""
        return self._wait(self._map_async(func, iterable, 1, chunksize))

    def map_async(
        self, func, iterable, chunksize=None, callback=None, error_callback=None
    ):
        """Asynchronous :meth:`map`: returns an :class:`AsyncResult`."""
        return self._map_async(func, iterable, 0, chunksize, callback, error_callback)

    def starmap_async(
        self, func, iterable, chunksize=None, callback=None, error_callback=None
    ):
        """Asynchronous :meth:`starmap`: returns an :class:`AsyncResult`."""
        return self._map_async(func, iterable, 1, chunksize, callback, error_callback)

    def imap(self, func, iterable, chunksize=1):
        """Lazy, ordered :meth:`map` over any iterable (read as work is needed)."""
        return self._imap(IMapIterator, func, iterable, chunksize)

    def imap_unordered(self, func, iterable, chunksize=1):
        """Like :meth:`imap`, yielding results as they complete."""
        return self._imap(IMapUnorderedIterator, func, iterable, chunksize)

    def close(self) -> None:
        """Accept no more work; loops stop once the submitted work is done."""
        self._engine.close()

    def terminate(self) -> None:
        """Stop now: interrupt running tasks, fail unfinished results.

        Unlike the stdlib (whose pending results then wait forever), results not
        yet computed raise :class:`PoolTerminatedError` from ``get()``.
        """
        self._engine.terminate()

    def join(self) -> None:
        """Wait for the loops to finish; call :meth:`close` or :meth:`terminate` first.

        After :meth:`terminate`, returns once the running tasks have really
        stopped (their loops hung up), or after a few seconds for a task that
        cannot be interrupted on a cluster fiber-dask did not start.
        """
        self._engine.join()

    def __enter__(self):
        self._check_running()
        return self

    def __exit__(self, exc_type, exc_val, exc_tb):
        self.terminate()

    def __del__(self, _warn=warnings.warn):
        engine = self.__dict__.get("_engine")
        if engine is not None and self._state == RUN:
            _warn(
                f"unclosed running multiprocessing pool {self!r}",
                ResourceWarning,
                source=self,
            )
        if engine is not None and engine.state == RUN:
            # Let the loops go, without waiting for anything: the engine's
            # result thread winds down by itself.
            engine.abandon()

    # ----------------------------------------------------------------- job intake

    def _check_running(self) -> None:
        if self._state != RUN:
            raise ValueError("Pool not running")

    def _map_async(
        self, func, iterable, mode, chunksize, callback=None, error_callback=None
    ):
        self._check_running()
        items = list(iterable)
        if chunksize is None:
            chunksize = self._engine.default_chunksize
        if chunksize is not None:
            chunksize = max(int(chunksize), 1)
        # None: sized chunk by chunk from measured task durations
        # (fiber_dask.engine.poolresults.measured_chunksize), not the stdlib's
        # len / (4 x processes), which at 1024 slots sends one item per chunk
        # of short tasks and swamps the owner.
        job = MapResult(
            self._engine, func, items, chunksize, mode, callback, error_callback
        )
        self._engine.submit(job)
        return job

    def _imap(self, cls, func, iterable, chunksize):
        self._check_running()
        if chunksize < 1:
            raise ValueError(f"Chunksize must be 1+, not {chunksize:n}")
        job = cls(
            self._engine, func, iterable, chunksize, 0, self._engine.max_in_flight
        )
        self._engine.submit(job)
        if chunksize == 1:
            return job
        return (item for item in job)  # as the stdlib: a generator when chunked
