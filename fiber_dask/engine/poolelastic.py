"""Elastic pools: the policy that gives idle pool slots back and asks for them again.

A pool slot is a long-running Dask task (a *loop*, see :mod:`fiber_dask.engine.poolworker`)
that holds a worker's task slot for as long as the pool lives.  Dask's adaptive
scaling never retires a worker that runs a task (``Scheduler.workers_to_close``
keeps every worker with something processing, and ``adaptive_target`` counts
running tasks as load), so an open pool, even idle, used to hold every worker it
asked for: a notebook that keeps a pool open held its 50 pods all day.

Under this policy (``fiber.pool.idle-timeout``, by default on for clusters
fiber-dask scales adaptively, see :func:`idle_timeout`), one :class:`Elastic` per
pool, driven by the pool's result thread::

    slot idle for idle-timeout          the pool has queued work again
    (no chunk in flight, no result      (a chunk waits and no loop has room)
     since, nothing waiting)
             │                                      │
             ▼                                      ▼
    give_back: the slot is marked       re-request: one new loop per waiting
    retiring (no chunk is sent to it),  chunk, up to the pool's size, at the
    sent STOP; its loop ends cleanly    free slot positions; Dask places them
    ("stopped"), its Dask task ends,    on the workers there are and queues the
    the slot claim shrinks by one       rest, which adaptive scaling counts as
             │                          load: new workers join and take them
             ▼                                      │
    the ended loop is forgotten: not    each new loop runs the initializer, then
    a worker loss, not replaced, no     serves chunks as any other; the slot
    chunk re-run (it held none)         claim grows by one
             │
             ▼
    the worker has nothing processing → workers_to_close offers it → adaptive
    (local: Adaptive, Kubernetes: the operator's DaskAutoscaler) retires it

What stays as it was: results of ``map``/``imap``/``apply_async`` are the jobs'
(a given-back slot held no chunk, so nothing is re-run or reordered);
``maxtasksperchild`` recycles loops as before (a retiring loop is never given
back a second time); ``close()``/``join()`` wait for the queued work, asking for
slots if none are left; ``terminate()`` releases the loops still waiting to
start.  A pool with zero slots and queued work asks for slots at once; it never
waits for a slot that is not coming.

Using the workers that join needs one more step: Dask places a loop at once on
the least busy worker even when all its threads are taken, and work stealing
does not move it to a worker that joins later (:meth:`Elastic._place` says
why), so loops asked for while only the minimum of workers runs would wait
there while the new workers idle.  While some loop has not connected, the
policy looks once a second (two scheduler calls) for loops that surely wait
behind this pool's own loops and resubmits them, which puts them on a worker
with a free thread.

The pool's loops (:meth:`fiber_dask.engine.poolloops.Loops.maintain`, on
every turn of the engine's result thread) call :meth:`Elastic.tick` and, before
they would replace an ended loop, :meth:`Elastic.loop_ended`; the engine calls
:meth:`Elastic.wanted` when a chunk found no loop with room.  All three run
under the engine's lock or on its result thread; this module only reads and
changes the engine's state (and its loops', ``engine._loops``) through them.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from .. import config
from .poolprotocol import STOP
from .poolresults import IMapIterator, MapResult

__all__ = ["Elastic", "idle_timeout"]

logger = logging.getLogger("fiber_dask.pool")

#: ``fiber.pool.idle-timeout: null`` on a cluster fiber-dask scales adaptively.
ADAPTIVE_DEFAULT = 30.0

#: Seconds between two scans of the slots for idle ones (at most; shorter for a
#: short idle-timeout), so that a pool of 1000 slots does not scan them on
#: every message its result thread handles.
_SCAN_EVERY = 0.25
#: Seconds between two looks at where waiting loops were placed (two scheduler
#: calls; only while some loop has not connected yet).
_PLACE_EVERY = 1.0


def idle_timeout(handle: Any = None) -> float | None:
    """Seconds after which an idle slot is given back, or None for never.

    ``fiber.pool.idle-timeout``: a duration gives slots back after it on any
    cluster; ``false`` never does; ``null`` (the default) gives them back after
    :data:`ADAPTIVE_DEFAULT` seconds when fiber-dask scales the cluster
    adaptively (``fiber.adaptive.enabled`` on a cluster it started) and never
    otherwise, which is how pools behaved before.
    """
    value = config.get("pool.idle-timeout")
    if value is False:
        return None
    if value is None:
        owned = True if handle is None else bool(getattr(handle, "owned", False))
        if config.get("adaptive.enabled") and owned:
            return ADAPTIVE_DEFAULT
        return None
    return config.timedelta("pool.idle-timeout")


class Elastic:
    """The give-back / re-request policy of one :class:`~fiber_dask.engine.poolengine.PoolEngine`.

    Parameters
    ----------
    engine : PoolEngine
        The pool whose slots this policy manages.
    timeout : float
        Seconds a slot stays idle before it is given back.
    """

    def __init__(self, engine: Any, timeout: float) -> None:
        self.engine = engine
        self.timeout = timeout
        #: Loop numbers told to stop because they were idle; their ending is
        #: not a loss and they are not replaced.
        self.stopping: set[int] = set()
        #: Slots given back and loops asked for again, since the pool started.
        self.given_back = 0
        self.requested = 0
        #: Loops moved off a worker where they waited behind the pool's own
        #: loops (see :meth:`_place`).
        self.moved = 0
        self._scan = min(_SCAN_EVERY, max(timeout / 4, 0.01))
        self._next_scan = 0.0
        self._next_place = 0.0

    @classmethod
    def for_engine(cls, engine: Any) -> Elastic | None:
        """The policy for ``engine``, or None when its slots are never given back."""
        timeout = idle_timeout(engine._handle)
        return None if timeout is None else cls(engine, timeout)

    # -------------------------------------------------------------- hooks

    def loop_ended(self, n: int) -> bool:
        """Loop ``n``'s Dask task ended: True if it was given back (the engine
        then forgets it instead of starting another)."""
        if n in self.stopping:
            self.stopping.discard(n)
            return True
        return False

    def wanted(self) -> None:
        """A chunk found no loop with room (engine lock held): wake the result
        thread if some slot positions are free, so it asks for them now rather
        than at its next timeout."""
        e = self.engine
        if len(e._loops.position) < e.processes:
            e._wake()

    def tick(self) -> None:
        """One turn of the result thread: ask for slots if work waits for
        them, give back slots idle for :attr:`timeout`, move loops that wait
        behind the pool's own loops to workers with a free thread."""
        self._tick()
        now = time.monotonic()
        if now >= self._next_place:
            self._next_place = now + _PLACE_EVERY
            self._place()

    def _tick(self) -> None:
        e = self.engine
        with e._lock:
            if e.state not in ("RUN", "CLOSE") or e._stop_sent is not None:
                return
            if e._released or e.broken is not None:
                return
            if e._retry:
                self._request()
                return
            now = time.monotonic()
            if now < self._next_scan:
                return
            self._next_scan = now + self._scan
            if e.state == "CLOSE" and not e._cache:
                return  # every loop is about to be told to stop anyway
            for peer in list(e._peers.values()):
                if (
                    not peer.inflight
                    and not peer.retiring
                    and not peer.broken
                    and now - peer.last_active >= self.timeout
                ):
                    self._give_back(peer)

    # ---------------------------------------------------------- the policy

    def _give_back(self, peer: Any) -> None:
        e = self.engine
        # Retiring first: under the lock, so no chunk is sent to it from now
        # on, and its hang-up is then not counted as a loss.
        peer.retiring = True
        e._file(peer)
        e.signal([peer], STOP)  # already gone: the result thread sees it
        if peer.loop in e._loops.position:
            self.stopping.add(peer.loop)
            claim = e._loops.claim
            if claim is not None:
                claim.resize(claim.n - 1)
        self.given_back += 1
        logger.info(
            "fiber-dask: a pool slot (%s, pid %s) was idle for %gs "
            "(fiber.pool.idle-timeout); giving its Dask slot back",
            peer.worker,
            peer.pid,
            self.timeout,
        )

    def _request(self) -> None:
        """Work waits: start loops at the free slot positions, one per waiting
        chunk, up to the pool's size."""
        e = self.engine
        taken = set(e._loops.position.values())
        free = [p for p in range(e.processes) if p not in taken]
        if not free:
            return
        want = min(len(free), self._demand(len(free)))
        loops = e._loops
        loops.submit(free[:want])  # one graph update for all of them
        if loops.claim is not None:
            loops.claim.resize(loops.claim.n + want)
        self.requested += want
        logger.info(
            "fiber-dask: the pool has queued work; asking for %d slot(s) again", want
        )

    def _place(self) -> None:
        """Move loops that wait on a worker all of whose threads run this
        pool's own live loops, to workers that have a free thread.

        Dask places a loop at once on the least busy worker, also one whose
        threads are all taken (a pool's few loops are not "root-ish" tasks,
        which the scheduler would keep queued), and work stealing moves a
        waiting task only when the victim's estimated work exceeds the
        thief's by one and a half times that task's estimate
        (``distributed.stealing.WorkStealing.balance``), which a worker with
        one running and one waiting loop does not reach.  On an adaptive
        cluster that is the normal case (slots asked for again while only the
        minimum of workers runs): on emulated Kubernetes the new worker
        joined and idled while both loops sat on the old one.  Only a loop that surely waits
        is moved (its worker's threads are all held by connected loops of
        this pool), so it never held a chunk; it is released and a new loop
        is submitted at its slot position, which the scheduler places on the
        least busy worker.
        """
        e = self.engine
        loops = e._loops
        with e._lock:
            if e.state not in ("RUN", "CLOSE") or e._stop_sent is not None:
                return
            waiting = {
                fut.key: n
                for n, fut in loops.futures.items()
                if n not in loops.connected and fut.status == "pending"
            }
            if not waiting:
                return
            live: dict[str, int] = {}
            for peer in e._peers.values():
                if not peer.retiring and peer.worker:
                    live[peer.worker] = live.get(peer.worker, 0) + 1
        client = e._client
        try:
            processing = client.sync(client.scheduler.processing, callback_timeout=2)
            nthreads = client.sync(client.scheduler.ncores, callback_timeout=2)
        except Exception:  # noqa: BLE001 - a slow or lost scheduler: next time
            return
        free = sum(
            max(0, nthreads.get(w, 0) - len(keys)) for w, keys in processing.items()
        )
        if not free:
            return
        stuck = []
        for w, keys in processing.items():
            threads = nthreads.get(w, 0)
            if len(keys) > threads and live.get(w, 0) >= threads:
                stuck.extend(waiting[k] for k in keys if k in waiting)
        with e._lock:
            if e.state not in ("RUN", "CLOSE") or e._stop_sent is not None:
                return
            positions = []
            for n in stuck[:free]:
                if n in loops.connected or n not in loops.futures:
                    continue
                fut = loops.futures.pop(n)
                positions.append(loops.position.pop(n))
                fut.release()
            loops.submit(positions)
            self.moved += len(positions)
        if stuck:
            logger.info(
                "fiber-dask: %d pool loop(s) waited behind the pool's own loops; "
                "moved to workers with a free thread",
                min(len(stuck), free),
            )

    def _demand(self, cap: int) -> int:
        """Chunks waiting for a loop (at least 1; ``cap`` once it is known to be
        at least that many, or unknown: an ``imap`` of an iterator)."""
        e = self.engine
        n = len(e._retry)
        for job in e._jobs:
            if n >= cap:
                break
            if job._finished or job._exhausted:
                continue
            if isinstance(job, MapResult):
                if job._items is not None:
                    size = job._chunksize
                    n += -(-(len(job._items) - job._chunk_index * size) // size)
            elif isinstance(job, IMapIterator):
                return cap
            else:
                n += 1  # an apply_async: one chunk
        return max(1, min(n, cap))
