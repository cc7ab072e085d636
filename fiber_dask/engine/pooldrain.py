"""Draining: a pool's slots leave a Dask worker that closes; nothing lost or run twice.

A Dask worker closes gracefully at the end of its lifetime
(``distributed.worker.lifetime.duration``, which dask-jobqueue sets from the
walltime with ``--lifetime``), when adaptive scaling or the Kubernetes
operator retires it, or when it is told to close.  A pool's loops are
long-running Dask tasks there (:mod:`fiber_dask.engine.slottask`): left
alone they held the worker open until the pool closed (Dask's close waits up
to 30 s for running tasks, then ends the process and whatever it ran), and on
a batch system the job was killed at its walltime with its chunks.  Here::

    scheduler: worker W ─ status ─► closing_gracefully / closing
         │   (an event on the topic W, which this process subscribed to when
         │    the first loop attached from W: _subscribe)
         ▼
    Drain.tick (the pool's result thread): each loop on W is marked
    retiring (no chunk is sent to it from now on) and sent DRAIN
         │
         ▼
    the loop (poolworker._serve) finishes the chunk it runs, answers what it
    ran, starts nothing else and leaves: Gone(DRAINED); its Dask task ends,
    so W can close
         │
         ▼
    the owner (PoolEngine._peer_lost → Drain.left): every chunk the loop held
    and did not answer never started: they go to other loops as they are,
    no failure counted, nothing run twice.  Another loop takes the slot:
    Dask re-runs the loop's task elsewhere when it removes W while the task
    runs, or the task ends ("drained") and Loops.maintain submits another.

    fiber.pool.drain-timeout after DRAIN, a loop still running its chunk is
    sent TERMINATE: the chunk is interrupted and runs again elsewhere
    (counted in ``cut`` and the pool's re-runs), before Dask's own close
    would end the process anyway.

A loop that attaches from a worker already known to be closing is drained at
once, and a keeper that starts on one returns at once
(:func:`fiber_dask.engine.slottask.run_pool_worker`).  The subscription is
looked up once more shortly after it is made (the scheduler keeps a topic's
events), for a worker that began closing before it was in place.

One :class:`Drain` per pool engine; the subscriptions are this process's
(one per client and worker address, whatever the number of pools), and their
handler runs on the client's event loop, where it only records the worker and
wakes the pools' result threads.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
import weakref
from typing import Any

from .. import config
from ..backends.base import last_event
from . import poolprotocol as proto

__all__ = ["Drain", "CLOSING"]

logger = logging.getLogger("fiber_dask.pool")

#: Dask worker statuses after which its pool loops drain.
CLOSING = frozenset({"closing_gracefully", "closing", "closed"})
#: Seconds after subscribing to a worker's events at which its past events
#: are looked up (the subscription travels on the client's batched stream).
_CHECK_AFTER = 0.2
#: Closing workers remembered (addresses; a restarted worker has a new one).
_REMEMBER = 4096

_lock = threading.Lock()
#: Worker addresses the scheduler said are closing (or were removed).
_closing: collections.OrderedDict[str, None] = collections.OrderedDict()
#: Client -> the worker addresses whose events it is subscribed to.
_subscribed: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
#: The pools' drains, told about every worker that starts closing.
_drains: weakref.WeakSet = weakref.WeakSet()


class Drain:
    """The draining of one :class:`~fiber_dask.engine.poolengine.PoolEngine`'s loops.

    Parameters
    ----------
    engine : PoolEngine
        The pool whose loops drain.
    """

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        #: ``fiber.pool.drain-timeout``: seconds a draining loop gets to
        #: finish the chunk it runs.
        self.timeout = config.timedelta("pool.drain-timeout")
        #: Addresses of workers that started closing, from the client's loop.
        self._pending: collections.deque[str] = collections.deque()
        self._deadlines: dict[Any, float] = {}  # draining peer -> its deadline
        #: Loops told to drain, those that left having finished their chunk,
        #: those cut at the drain timeout (or by their worker's end) while
        #: running one, and the chunks the loops handed back unstarted.
        self.started = 0
        self.drained = 0
        self.cut = 0
        self.handed_back = 0
        with _lock:
            _drains.add(self)

    # ------------------------------------------------------------- hooks

    def attached(self, peer: Any) -> None:
        """``peer`` attached (engine lock held): watch its worker; drain it
        at once if that worker is closing already."""
        worker = peer.worker
        if not worker:
            return  # an early slot, or a loop outside Dask
        client = self.engine._client
        if client is not None:
            _subscribe(client, worker)
        with _lock:
            closing = worker in _closing
        if closing:
            self._start(peer, time.monotonic())

    def closing(self, worker: str) -> None:
        """``worker`` started closing (on the client's event loop)."""
        self._pending.append(worker)
        self.engine._wake()

    def tick(self) -> None:
        """One turn of the result thread: drain the loops of workers that
        started closing; cut those past the drain timeout."""
        e = self.engine
        if self._pending:
            workers = set()
            while self._pending:
                workers.add(self._pending.popleft())
            now = time.monotonic()
            with e._lock:
                for peer in list(e._peers.values()):
                    if peer.worker in workers:
                        self._start(peer, now)
        if not self._deadlines:
            return
        now = time.monotonic()
        late = [p for p, t in self._deadlines.items() if now >= t]
        if not late:
            return
        with e._lock:
            for peer in late:
                del self._deadlines[peer]
                if e._peers.get(peer.key) is not peer or e.state == "TERMINATE":
                    continue
                logger.warning(
                    "fiber-dask: a pool slot (%s, pid %s) did not finish its chunk "
                    "within fiber.pool.drain-timeout=%gs of its Dask worker starting "
                    "to close; interrupting it: its chunk runs again elsewhere",
                    peer.worker,
                    peer.pid,
                    self.timeout,
                )
                e.signal([peer], proto.TERMINATE)

    def left(self, peer: Any, ran: list, never: list) -> int:
        """Draining ``peer`` is gone (engine lock held; ``ran``/``never``: its
        unanswered chunks, :func:`~fiber_dask.engine.poolprotocol.lost_chunks`,
        which go back to the pool uncounted).  Returns the items that were
        running there and run again (0 when it left having drained)."""
        self._deadlines.pop(peer, None)
        handed = len(ran) + len(never)
        if peer.drained:
            # It answered every chunk it ran before it said Gone: those
            # left unanswered never started.
            self.drained += 1
            self.handed_back += handed
            if handed:
                logger.info(
                    "fiber-dask: a pool slot (%s, pid %s) left its closing Dask "
                    "worker; %d chunk(s) it had not started go to other slots",
                    peer.worker,
                    peer.pid,
                    handed,
                )
            return 0
        self.cut += 1
        self.handed_back += len(never)
        items = sum(len(c.items) for c in ran)
        if handed:
            logger.warning(
                "fiber-dask: a pool slot (%s, pid %s) ended while its Dask worker "
                "closed, before it finished its chunk; re-running %d chunk(s)",
                peer.worker,
                peer.pid,
                handed,
            )
        return items

    # -------------------------------------------------------------- inner

    def _start(self, peer: Any, now: float) -> None:
        """Tell ``peer`` to drain (engine lock held), once."""
        e = self.engine
        if peer.draining is not None or peer.broken:
            return
        if e.state == "TERMINATE" or e._released:
            return
        peer.retiring = True  # first, under the lock: no chunk is sent to it
        peer.draining = now + self.timeout
        e._file(peer)
        e._loops.drained.add(peer.loop)
        e.signal([peer], proto.DRAIN)
        self._deadlines[peer] = peer.draining
        self.started += 1
        logger.info(
            "fiber-dask: Dask worker %s is closing; its pool slot (pid %s) finishes "
            "the chunk it runs and leaves (fiber.pool.drain-timeout=%gs)",
            peer.worker,
            peer.pid,
            self.timeout,
        )


# ----------------------------------------------------- worker events


def _subscribe(client: Any, worker: str) -> None:
    """Subscribe ``client`` to ``worker``'s events, once per process."""
    with _lock:
        try:
            done = _subscribed.setdefault(client, set())
        except TypeError:  # pragma: no cover - not weak-referenceable
            return
        if worker in done:
            return
        done.add(worker)
    try:
        client.subscribe_topic(worker, _handler(client, worker))
        client.loop.add_callback(_look_back, client, worker)
    except Exception:  # noqa: BLE001 - a closing client: nothing to drain for
        logger.debug("fiber-dask: cannot watch worker %s", worker, exc_info=True)


def _handler(client: Any, worker: str) -> Any:
    ref = weakref.ref(client)

    def handle(event: Any) -> None:
        _, msg = event
        _on_event(ref(), worker, msg)

    return handle


async def _look_back(client: Any, worker: str) -> None:
    """The events the scheduler logged for ``worker`` before the
    subscription was in place: the last status they name counts."""
    await asyncio.sleep(_CHECK_AFTER)
    if client.status != "running":
        return
    try:
        events = await client.scheduler.events(topic=worker)
    except Exception:  # noqa: BLE001 - a slow or lost scheduler: events still come
        return
    last = last_event(events, "worker-status-change", "remove-worker")
    if last is not None:
        _on_event(client, worker, last)


def _on_event(client: Any, worker: str, msg: Any) -> None:
    """An event of ``worker`` (on the client's event loop)."""
    if not isinstance(msg, dict):
        return
    action = msg.get("action")
    if action == "worker-status-change":
        status = msg.get("status")
        if status == "running":  # a retirement given up: it works on
            with _lock:
                _closing.pop(worker, None)
            return
        if status not in CLOSING:
            return
    elif action == "remove-worker":
        # Gone from the scheduler: its tasks run elsewhere now; no more
        # events will come for it.
        if client is not None:
            try:
                client.unsubscribe_topic(worker)
            except Exception:  # noqa: BLE001 - a closing client
                pass
    else:
        return
    with _lock:
        fresh = worker not in _closing
        _closing[worker] = None
        while len(_closing) > _REMEMBER:
            _closing.popitem(last=False)
        drains = list(_drains) if fresh else []
    for drain in drains:
        drain.closing(worker)
