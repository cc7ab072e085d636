"""``Pool``: ``multiprocessing.pool.Pool`` on a Dask cluster.

How a call travels::

    caller thread            result thread (one per pool)        Dask worker process
    ─────────────            ────────────────────────────        ───────────────────
    apply_async/map/imap
      job → self._jobs
      _dispatch(): pick the   ◄─ ("R", ckey, ok, blob) ───────── pool-worker loop
      least-loaded loop,         _on_result: refill that loop,     (a long-running
      pickle chunk, send ─────────────────────────────────────►    Dask task, one
                                 then settle the job: callbacks,    per slot)
                                 event.set()
    Dask: places the loops (client.submit, pure=False), re-runs a loop whose worker
    died, scales the cluster.  Per task there is no scheduler round trip.

Each loop keeps a few chunks queued (``fiber.pool.prefetch`` worth of work,
learned from observed chunk times) so it never waits for the owner, and long
tasks are handed out one at a time so the tail stays balanced.

A loop whose connection drops (its worker died) has its in-flight chunks sent
again to the other loops; a chunk that has lost more workers than
``fiber.pool.allowed-failures`` fails with :class:`WorkerLostError` instead.
"""

from __future__ import annotations

import collections
import functools
import itertools
import logging
import socket
import threading
import time
import uuid
import warnings
import weakref
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

from . import channel, cluster, config
from .errors import PoolTerminatedError
from .poolengine import (
    CLOSE,
    INIT,
    RUN,
    TERMINATE,
    PoolEngine,
    _authkey,
    _live_pools,
    _on_connect,
    _result_thread,
    _send_quietly,
    _slots_in_use,
    _slots_lock,
    _terminate_all_pools,  # noqa: F401  (cluster.shutdown calls it from here)
)
from .results import (
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


class Pool(PoolEngine):
    """A process pool whose processes are Dask workers.

    Same signature and behaviour as :class:`multiprocessing.pool.Pool`; the
    keyword-only arguments after the stdlib ones are fiber-dask's.

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
    ) -> None:
        self._state = INIT
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
        self._slots = config.get("pool.slots")
        if maxtasksperchild is not None and self._slots == "thread":
            warnings.warn(
                "maxtasksperchild with fiber.pool.slots=thread: fiber-dask restarts the "
                "pool-worker loop (and runs the initializer again) after that many tasks, "
                "but the Dask worker process itself is reused, so memory a task leaked is "
                "not returned (fiber.pool.slots=process gives a fresh process).",
                RuntimeWarning,
                stacklevel=2,
            )
        config.validate()  # a typo'd or bad fiber.* value fails here, at first use
        # Pickled once, here: an unpicklable initializer fails in the caller.
        self._init_blob = (
            cloudpickle.dumps((initializer, tuple(initargs)))
            if initializer is not None
            else None
        )
        self._handle = cluster.get_handle(client=client, address=address)
        self._client = self._handle.client
        if processes is None:
            processes = cluster.task_slots(self._handle)
        self._processes = processes
        self._maxtasks = maxtasksperchild
        self._resources = resources
        self._retries = retries or 0
        self._prefetch = config.timedelta("pool.prefetch")
        allowed = config.get("pool.allowed-failures")
        if allowed is None:
            import dask

            allowed = dask.config.get("distributed.scheduler.allowed-failures")
        self._allowed_failures = int(allowed)
        self._max_in_flight = config.get("pool.max-in-flight") or max(16, 4 * processes)
        self._default_chunksize = config.get("pool.chunksize")

        self._lock = threading.RLock()
        self._jobs: collections.deque = (
            collections.deque()
        )  # jobs with chunks to produce
        self._retry: collections.deque = collections.deque()  # chunks whose worker died
        self._cache: set = set()  # unfinished jobs
        self._peers: dict[Any, Any] = {}  # connection -> poolengine._Peer
        self._ckeys = itertools.count()
        self._fids: collections.OrderedDict = collections.OrderedDict()
        self._fid_counter = itertools.count()
        self._loops: dict[str, Any] = {}
        self._loop_done: collections.deque = collections.deque()
        self._loop_failures = 0
        self._broken: BaseException | None = None
        self._draining = False
        self._stop_sent: float | None = None
        self._no_peers_since = time.monotonic()
        self._warned_waiting = False

        self._token = uuid.uuid4().hex[:12]
        self._service = f"pool-{self._token}"
        authkey = _authkey()
        self._server = channel.get_server(
            self._handle.listen_host or "127.0.0.1", authkey, self._handle.client
        )
        self._server.register(
            self._service, functools.partial(_on_connect, weakref.ref(self))
        )
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._slot_counter = itertools.count()
        with _slots_lock:
            key = id(self._handle)
            _slots_in_use[key] = _slots_in_use.get(key, 0) + processes
            needed = _slots_in_use[key]
            self._processes_counted = True
        cluster.ensure_slots(self._handle, needed)
        self._state = RUN
        _live_pools.add(self)
        try:
            self._submit_loops(processes)
        except BaseException:
            self._state = TERMINATE
            self._release()
            raise
        self._thread = threading.Thread(
            target=_result_thread,
            args=(weakref.ref(self),),
            name="fiber-pool-results",
            daemon=True,
        )
        self._thread.start()

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
        return self.apply_async(func, args, kwds).get()

    def apply_async(self, func, args=(), kwds=None, callback=None, error_callback=None):
        """Asynchronous :meth:`apply`: returns an :class:`AsyncResult`."""
        self._check_running()
        job = ApplyResult(self, func, args, kwds or {}, callback, error_callback)
        self._add_job(job)
        return job

    def map(self, func, iterable, chunksize=None):
        """Apply ``func`` to each item, in chunks; return the results in order."""
        return self._map_async(func, iterable, 0, chunksize).get()

    def starmap(self, func, iterable, chunksize=None):
        """Like :meth:`map`, with each item unpacked as arguments: ``func(*item)``."""
        return self._map_async(func, iterable, 1, chunksize).get()

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
        with self._lock:
            if self._state == RUN:
                self._state = CLOSE
        self._wake()

    def terminate(self) -> None:
        """Stop now: interrupt running tasks, fail unfinished results.

        Unlike the stdlib (whose pending results then wait forever), results not
        yet computed raise :class:`PoolTerminatedError` from ``get()``.
        """
        with self._lock:
            if self._state == TERMINATE:
                return
            self._state = TERMINATE
            jobs = list(self._cache)
            for peer in self._peers.values():
                _send_quietly(peer, b"K")
        self._release_slots()
        err = PoolTerminatedError(
            "the pool was terminated before this result was computed"
        )
        for job in jobs:
            job._fail(err)
        self._cancel_loops()
        self._wake()

    def join(self) -> None:
        """Wait for the loops to finish; call :meth:`close` or :meth:`terminate` first."""
        if self._state == RUN:
            raise ValueError("Pool is still running")
        if self._state not in (CLOSE, TERMINATE):
            raise ValueError("In unknown state")
        self._draining = True  # lift imap back-pressure: join waits for all work
        self._dispatch()
        if self._thread is not threading.current_thread():
            self._thread.join()

    def __enter__(self):
        self._check_running()
        return self

    def __exit__(self, exc_type, exc_val, exc_tb):
        self.terminate()

    def __del__(self, _warn=warnings.warn):
        if getattr(self, "_state", None) == RUN:
            _warn(
                f"unclosed running multiprocessing pool {self!r}",
                ResourceWarning,
                source=self,
            )
            # Let the loops go; the result thread exits when it sees us gone.
            for peer in list(getattr(self, "_peers", {}).values()):
                _send_quietly(peer, b"K")
            self._cancel_loops()
            self._release()

    # ----------------------------------------------------------------- job intake

    def _check_running(self) -> None:
        if self._state != RUN:
            raise ValueError("Pool not running")

    def _add_job(self, job) -> None:
        with self._lock:
            self._check_running()
            if self._broken is not None:
                job._fail(self._broken)
                return
            if job._finished:  # an empty map
                return
            self._cache.add(job)
            self._jobs.append(job)
            self._dispatch()

    def _map_async(
        self, func, iterable, mode, chunksize, callback=None, error_callback=None
    ):
        self._check_running()
        items = list(iterable)
        if chunksize is None:
            chunksize = self._default_chunksize
        if chunksize is None:
            chunksize, extra = divmod(len(items), self._processes * 4)
            if extra:
                chunksize += 1
        chunksize = max(int(chunksize), 1)
        job = MapResult(self, func, items, chunksize, mode, callback, error_callback)
        self._add_job(job)
        return job

    def _imap(self, cls, func, iterable, chunksize):
        self._check_running()
        if chunksize < 1:
            raise ValueError(f"Chunksize must be 1+, not {chunksize:n}")
        job = cls(self, func, iterable, chunksize, 0, self._max_in_flight)
        self._add_job(job)
        if chunksize == 1:
            return job
        return (item for item in job)  # as the stdlib: a generator when chunked

    def _job_finished(self, job) -> None:
        with self._lock:
            self._cache.discard(job)
            if not self._cache and self._state == CLOSE:
                self._wake()
