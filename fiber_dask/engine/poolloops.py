"""The pool's loops as Dask tasks: one per slot position, kept running.

A pool's work runs in *loops* (:mod:`fiber_dask.engine.poolworker`), each a
long-running Dask task (:func:`fiber_dask.engine.slottask.run_pool_worker`)
that holds one of the cluster's task slots and connects back to the pool's
owner.  :class:`Loops` is the owner's side of that fleet: the slots claimed
from the cluster, the loops' Dask futures and slot positions, why a loop's
task ended and whether another takes its place, and giving it all back.

:class:`~fiber_dask.engine.poolengine.PoolEngine` holds one (``_loops``) and
does the rest: it dispatches chunks to the loops that are connected and
settles their results; it never touches a loop's Dask future.  How the two
meet::

    PoolEngine (poolengine)              Loops (this module)           Dask
    ───────────────────────              ───────────────────           ────
    start() ───────────────────────────► claim_slots()
                                         submit(positions): one ──────► the loop
                                           client.map, pure=False,      tasks,
                                           keyed poolstats.loop_key     placed
    _on_attach: loop n said Attach ────► attached(n): its position
    a Result with last=True ───────────► recycled.add(n): maxtasksperchild
                                         _watch, on the client's   ◄─── a loop's
                                           loop: done.append(n),        task
                                           wake the result thread       ended
    result thread, every turn ─────────► maintain(): each ended loop
                                           forgotten (given back), replaced
                                           (one client.map for all), or the
                                           pool broken (engine._break);
                                           Elastic.tick; poolwait says who
                                           holds the slots work waits for
    _should_continue, exit ────────────► running(), starting()
    terminate(), _release() ───────────► release_claim(), release()

Everything here runs on the engine's result thread or under the engine's lock
(``start()`` aside, before the result thread exists), but :func:`_watch`'s
callback, which runs on the client's event loop and only appends to a deque
and wakes the result thread.  The give-back / ask-again policy
(:mod:`fiber_dask.engine.poolelastic`) changes the claim, the futures and the
positions through this object too.
"""

from __future__ import annotations

import collections
import functools
import itertools
import logging
import time
import weakref
from multiprocessing.pool import TERMINATE  # the pool's states are the stdlib's
from typing import Any

from .. import cluster, config
from ..errors import ClusterConnectionError, WorkerLostError
from . import poolprotocol as proto
from . import poolstats
from .poolwait import Waiting
from .slottask import run_pool_worker

__all__ = ["Loops", "TERMINATE_GRACE"]

logger = logging.getLogger("fiber_dask.pool")

#: Seconds a running task gets to stop after terminate() (the loops are told).
TERMINATE_GRACE = 1.0
#: Ended loops whose Dask future is held for its result (Loops.ended), at
#: most, and for how many seconds (longer than poolcause.WAIT).
_ENDED_KEPT = 64
_ENDED_FOR = 10.0


class Loops:
    """The loops of one pool, as Dask tasks: one per slot position.

    Parameters
    ----------
    engine : PoolEngine
        The pool whose loops these are (its cluster handle, channel service,
        loop arguments, state and lock).
    live : weakref.WeakSet
        This process's live engines (``poolengine._live``), for
        :class:`~fiber_dask.engine.poolwait.Waiting`.
    """

    def __init__(self, engine: Any, live: Any) -> None:
        self.engine = engine
        self.futures: dict[int, Any] = {}  # loop number -> its Dask future
        self.position: dict[int, int] = {}  # loop number -> slot position
        self.connected: set[int] = set()  # loop numbers that ever connected
        self.recycled: set[int] = set()  # loops maxtasksperchild ended
        #: Loops told to drain (their worker closes, engine.pooldrain): their
        #: end is no failure, and another takes the slot.
        self.drained: set[int] = set()
        #: Loops whose task ended, for the result thread (filled by _watch).
        self.done: collections.deque = collections.deque()
        #: loop number -> (when, its Dask future) of the connected loops that
        #: ended lately, held so that their result (a keeper's Death) can
        #: still be read (poolcause).
        self.ended: collections.OrderedDict = collections.OrderedDict()
        self.failures = 0  # loops ended before connecting, since one connected
        self.numbers = itertools.count()  # numbers the loops, never reused
        self.claim: cluster.SlotClaim | None = None
        #: Says who holds the slots when work waits with no loop running.
        self.waiting = Waiting(engine, live)
        self._no_peers_since = time.monotonic()
        self._warned_waiting = False

    # ----------------------------------------------------------- the slots

    def claim_slots(self) -> None:
        """Claim the pool's slots from the cluster; refuses, at once, a pool
        the cluster can never start (:func:`fiber_dask.cluster.claim_slots`)."""
        e = self.engine
        self.claim = cluster.claim_slots(e._handle, e.processes)

    def release_claim(self) -> None:
        claim, self.claim = self.claim, None
        if claim is not None:
            claim.release()

    # ------------------------------------------------------------ the tasks

    def submit(self, positions: Any) -> None:
        """Submit one loop task per slot position, all in one ``client.map``.

        One graph update for all of them: the scheduler handles a submit in
        about as long as a map of many (an ``update-graph`` each), so a
        1024-slot pool submitted task by task had its last loops reach the
        scheduler tens of seconds after the first (issue 15).
        """
        positions = list(positions)
        if not positions:
            return
        e = self.engine
        numbers = [next(self.numbers) for _ in positions]
        loop = functools.partial(
            run_pool_worker,
            e._server.address,
            e._server.authkey,
            e._service,
        )
        k = len(numbers)
        futs = e._client.map(
            loop,
            numbers,
            [e._init_blob] * k,
            [e._maxtasks] * k,
            # Thread slots: on a cluster we started, a task that ignores
            # terminate() for TERMINATE_GRACE ends its worker process (the
            # nanny starts another).  Slot processes end only themselves
            # (fiber_dask.engine.slots.TERMINATE_GRACE), on any cluster.
            [TERMINATE_GRACE if e._handle.owned else None] * k,
            [e._slot_kind] * k,  # process | thread (fiber_dask.engine.slots)
            [e._relay] * k,  # process slots: through the relay (slotrelay.wanted)
            # Keyed so the scheduler can tell whose slots these are (poolstats).
            key=[poolstats.loop_key(e._token, n) for n in numbers],
            pure=False,
            resources=e._resources,
        )
        ref = weakref.ref(self)
        for n, position, fut in zip(numbers, positions, futs, strict=True):
            self.futures[n] = fut
            self.position[n] = position
            _watch(e._client, fut, ref, n)

    def attached(self, n: int) -> int | None:
        """Loop ``n`` connected (engine lock held): its slot position, or None
        for a loop no longer kept (given back, moved, or of a slot since
        replaced)."""
        self.failures = 0
        self.drained.discard(n)  # this run of it is another
        position = self.position.get(n)
        if position is not None:
            self.connected.add(n)
        return position

    def starting_at(self, position: int) -> bool:
        """A loop was submitted for slot ``position`` and has not connected."""
        return any(
            pos == position and n not in self.connected
            for n, pos in list(self.position.items())
        )

    def running(self) -> bool:
        """A connected loop's Dask task has not ended yet (after it hung up,
        a moment before the worker reports it finished)."""
        client = self.engine._client
        if client is None or client.status != "running":  # None: not up yet
            return False
        return any(
            f.status == "pending"
            for n, f in list(self.futures.items())
            if n in self.connected
        )

    def starting(self) -> bool:
        """A loop's Dask task is pending and has not connected yet."""
        client = self.engine._client
        if client is None or client.status != "running":  # None: not up yet
            return False
        return any(
            f.status == "pending"
            for n, f in list(self.futures.items())
            if n not in self.connected
        )

    def release(self, only_unconnected: bool = False) -> None:
        """Let Dask forget loop tasks (non-blocking: a released future sends
        its release from the client's event loop).  A connected loop ends by
        itself on STOP/TERMINATE; releasing one that never connected keeps it
        from starting."""
        if not only_unconnected:
            self.ended.clear()  # their results are of no use any more
        for n, fut in list(self.futures.items()):
            if only_unconnected and n in self.connected:
                continue
            try:
                fut.release()
            except Exception:  # the client may be closing at exit
                pass

    # ---------------------------------------------------------- maintenance

    def maintain(self) -> None:
        """Replace loops that ended while work remains; fail if none can start.

        One turn of the engine's result thread: each loop whose task ended
        is forgotten (given back by the elastic policy, or the pool is
        stopping), replaced (all replacements in one ``client.map``), or, if
        loops keep failing before they connect or the scheduler is lost, the
        pool is broken.  Then, while work waits with no loop connected, says
        who holds the slots it waits for.
        """
        e = self.engine
        client = e._client
        replace: list[int] = []  # slot positions, submitted together below
        # A held result keeps its worker from retiring (its data would be
        # lost): hold an ended loop's future only while a cause may be asked.
        while self.ended and (
            len(self.ended) > _ENDED_KEPT
            or next(iter(self.ended.values()))[0] < time.monotonic() - _ENDED_FOR
        ):
            self.ended.popitem(last=False)
        while self.done:
            if client.status == "connecting" and e.state != TERMINATE:
                break  # the client is reconnecting: replace the loops after that
            n = self.done.popleft()
            fut = self.futures.pop(n, None)
            position = self.position.pop(n, None)
            recycled = n in self.recycled
            self.recycled.discard(n)
            drained = n in self.drained
            self.drained.discard(n)
            if fut is None or position is None:
                continue
            if e._elastic is not None and e._elastic.loop_ended(n):
                continue  # given back while idle: not a loss, not replaced
            if n in self.connected and not recycled:
                self.ended[n] = (time.monotonic(), fut)
            if e.state == TERMINATE or e._stop_sent is not None or e.broken:
                continue
            if client.status != "running":
                e._break(self._lost_scheduler())
                continue
            if recycled:
                reason = proto.Reason.RECYCLED
            elif drained:
                reason = proto.Reason.DRAINED
            else:
                reason = self._reason(fut, n)
            if reason == proto.Reason.INIT_FAILED:
                continue
            if reason not in proto.Reason.NORMAL:
                self.failures += 1
                logger.info(
                    "fiber-dask: pool loop ended (%s); starting another", reason
                )
            if self.failures > 3 + 2 * e.processes:
                address = e._server.address
                e._break(
                    WorkerLostError(
                        f"pool-worker loops keep failing before they connect (last: "
                        f"{reason}). Check that the workers can import fiber_dask and "
                        f"reach {address[0]}:{address[1]} (fiber.listen-host)."
                    )
                )
                continue
            replace.append(position)
        if replace and not e.broken:
            try:
                self.submit(replace)
            except Exception as exc:
                e._break(self._lost_scheduler(exc))
        if e._elastic is not None:
            e._elastic.tick()
        if e._peers or not e._cache:
            self._no_peers_since = time.monotonic()
            self._warned_waiting = False
            self.waiting.reset()
            return
        waited = time.monotonic() - self._no_peers_since
        if client.status not in ("running", "connecting"):
            e._break(self._lost_scheduler())
            return
        # Within seconds: are the slots all held, by whom (poolwait; it looks
        # off this thread and says so once per wait).
        self.waiting.tick(waited)
        if not self._warned_waiting and not self.waiting.warned and waited > 60:
            self._warned_waiting = True
            logger.warning(
                "fiber-dask: a pool has had work waiting for 60 s but no pool worker is "
                "running; the cluster at %s may have no free task slots or workers.",
                e._address,
            )

    def _reason(self, fut: Any, n: int) -> str:
        """Why a loop's task ended.  Only asked of loops that never connected
        (those that did told us over the channel), with a short timeout."""
        if fut.status == "finished":
            if n in self.connected:
                return proto.Reason.TERMINATED
            try:
                return fut.result(timeout=2)
            except Exception as e:
                return repr(e)
        if fut.status == "error":
            try:
                return repr(fut.exception(timeout=2))
            except Exception as e:
                return repr(e)
        return fut.status

    def _lost_scheduler(self, cause: BaseException | None = None) -> Exception:
        e = self.engine
        timeout = config.timedelta("connect-timeout")
        return ClusterConnectionError(
            f"the pool lost its Dask scheduler at {e._address} (client "
            f"{e._client.status}; it gave up reconnecting within "
            f"fiber.connect-timeout={timeout:g}s){': ' + repr(cause) if cause else ''}"
            ". Work still running on connected workers completes; new work needs "
            "the scheduler back: restart it and create a new Pool."
        )


def _watch(client: Any, fut: Any, ref: Any, n: int) -> None:
    """Tell the loops' owner when a loop's task ends, from the client's event
    loop (``ref``: a weak reference to the :class:`Loops`).

    Not ``Future.add_done_callback``: that hands the callback to a thread pool,
    which refuses work once the interpreter is shutting down (and printed a
    traceback per loop at exit).
    """

    async def watch() -> None:
        try:
            while fut.status == "pending":
                await fut._state.wait()
        except Exception:
            return
        loops = ref()
        if loops is not None:
            loops.done.append(n)
            loops.engine._wake()

    try:
        client.loop.add_callback(watch)
    except Exception:  # pragma: no cover - a client closing under us
        pass
