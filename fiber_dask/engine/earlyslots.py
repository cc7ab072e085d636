"""The first pool's early slots: its tasks run while the embedded cluster starts.

A program's first ``Pool()`` on the embedded cluster used to wait for the whole
cluster: the owner's import of distributed (~0.4 s), the scheduler, the worker
processes and their registration, then the loops' Dask tasks; only then did a
slot process start.  The first result came after ~0.5 s on a quiet 2-core
machine, as long as plain Dask's whole start.  None of that is needed to run a
task: a process with the slot code, a connection to the owner, a chunk.

So the first pool starts its slots beside the cluster's start::

    owner                          worker fork server             early template
    ─────                          ──────────────────             ──────────────
    Pool(): the pool's service,
      start_cluster() ───────────► starts: imports the main
      (the cluster's start, on a     module, fiber_dask, the
       thread: import distributed,   slot code ── fork ─────────► (a slot template
       LocalCluster, Client) ◄─┐   then distributed, then           as a Dask worker
    EarlySlots: Fork × N ──────┼─────────── request pipe ──────►   forks its own)
                               │                                   fork × N ─► slot
      ◄──── connect, HMAC, Attach, chunks, results ─────────────────────────── processes
                               │
    cluster up ────────────────┘  the loops' Dask tasks are submitted as for
    a Dask loop attaches at        any pool; each early loop whose position a
    position p ──────────────────► Dask loop takes is told STOP: it finishes the
                                   chunks it holds and ends; the last one out
                                   closes the template's request pipe

* **The same slots, sooner.**  An early slot process is forked from a template
  that is itself forked from the worker fork server as soon as the server has
  imported the main module (as ``__mp_main__``), fiber_dask and the slot code:
  the state a Dask worker's template has (:func:`fiber_dask.engine.slots.
  start_early`), so a task sees the same modules and main-module state in an
  early slot as in the slots that follow.  It runs :func:`~fiber_dask.engine.
  poolworker.serve_slot` like any slot; the owner numbers early loops from the
  same counter as the Dask loops and files each at a slot position.
* **Then the cluster's.**  Once the cluster is up the pool submits its loops as
  usual, and hands each position over as its Dask loop attaches: what an early
  loop holds finishes there (nothing is re-run), nothing new is sent to it.
  A position's initializer then runs twice (early, then Dask's slot), as a
  stdlib pool runs it again in a worker that replaces one.
* **Failures.**  An early slot that dies costs a re-run, as any slot does (its
  chunks go to the others); it is not replaced: the position waits for its
  Dask loop.  A cluster that fails to start breaks the pool with that error
  (what ``Pool()`` raised before).  A program that exits while the cluster is
  still importing distributed gives the start up
  (:meth:`fiber_dask.cluster.Starting.give_up`) instead of waiting for it.
* **Nested objects.**  The scheduler's port is picked before it starts, so a
  task in an early slot that makes a Pool, Process or Queue attaches to the
  cluster being started (the client waits for it), not to a new one.

Only where that is the whole story (:func:`start_cluster` decides, the one
owner of the policy): the first pool of a process with no cluster, on the
embedded cluster, with process slots, no ``resources=``, no more slots than the
cluster is sized for, no adaptive scaling, no TLS, worker processes forked from
the server (``fiber.local.worker-start: forkserver``), and
``fiber.local.early-slots`` on (the default).  Otherwise ``Pool()`` waits for
the cluster as before.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from multiprocessing.pool import CLOSE, TERMINATE  # the pool's states are the stdlib's
from typing import Any

from .. import cluster, config
from ..backends import workerstart
from ..comm.ports import PortReservation
from ..launch.launcher import child_env
from ..transparency import interrupts
from . import poolprotocol as proto
from . import slotmemory
from .slots import EARLY_ENV, SlotSpec, Template

__all__ = ["start_cluster", "EarlySlots"]

logger = logging.getLogger("fiber_dask.pool")


def start_cluster(
    processes: int | None, slot_kind: str, resources: dict | None
) -> cluster.Starting | None:
    """Start the embedded cluster in the background, with an early slot
    template forked on the way, if this pool may run on early slots (see the
    module docstring); else None, and nothing was started."""
    if not config.get("local.early-slots"):
        return None
    if slot_kind != "process" or resources or config.get("adaptive.enabled"):
        return None
    from .poolelastic import idle_timeout

    if idle_timeout() is not None:
        return None  # idle slots given back: the elastic policy's, Dask loops
    import dask

    if dask.config.get("distributed.comm.require-encryption", None):
        return None
    if not cluster.would_start_embedded():
        return None
    if not workerstart.available():
        return None
    n_workers = config.get("local.n-workers") or os.cpu_count() or 1
    planned = n_workers * config.get("local.threads-per-worker")
    if processes is not None and processes > planned:
        return None  # the cluster grows first (cluster.ensure_slots)
    # A Ctrl-C is held to the end: a fork server started but not handed to
    # the start (which stops it if the program exits first) would be lost.
    with interrupts.deferred():
        early = workerstart.EarlyTemplate(numpy="numpy" in sys.modules)
        server = workerstart.start(early)
        if server is None:
            early.discard()
            return None
        port = PortReservation("127.0.0.1")  # released once the scheduler listens
        try:
            starting = cluster.start_embedded(planned, port, server)
        except BaseException:
            port.release()
            raise
        if starting is None:  # pragma: no cover - another thread bound one first
            port.release()
            server.stop()
            early.discard()
            return None
        starting.early_template = early
        return starting


class EarlySlots:
    """A pool's early slots: the template, the loops forked from it, the
    positions they hold, and their hand-over to the cluster's loops.

    Everything here runs on the engine's result thread or under its lock,
    but :meth:`start` (in ``PoolEngine.start``).
    """

    def __init__(self, engine: Any, starting: cluster.Starting) -> None:
        self.engine = engine
        self.starting = starting
        self.template: Template | None = None
        #: loop number -> slot position, for the early loops not yet gone.
        self.position: dict[int, int] = {}
        #: loop number -> its slot process as the template reports it.
        self.forks: dict[int, Any] = {}
        #: The memory limit the early slot processes count against (slotmemory).
        self.limits: tuple | None = None
        #: Every early loop's number, gone or not.
        self.numbers: set[int] = set()
        self.attached: set[int] = set()
        #: loop number -> the peer now serving it (a maxtasksperchild
        #: successor may attach before its predecessor's Gone is read).
        self.current: dict[int, Any] = {}
        #: The cluster was taken in (:meth:`take_cluster`), or its start failed.
        self.adopted = False
        #: Positions not yet handed to a Dask loop, once the cluster is up.
        self.waiting: set[int] = set()
        #: The pool claimed its slots on the cluster (set as it came up).
        self.claimed = False

    def start(self) -> None:
        """Ask the template for one slot process per position."""
        e = self.engine
        early = self.starting.early_template
        self.template = Template.over_pipes(early.request_w, early.report_r)
        env = child_env(None, self.starting.scheduler_address)
        env.pop("FIBER_DASK_LAUNCHER_PID", None)
        env.pop(EARLY_ENV, None)
        # What a Dask worker's slot process has on top: its nanny's variables
        # (OMP_NUM_THREADS=1, ...) and the host its nested objects listen on.
        for key, value in workerstart.worker_env().items():
            env.setdefault(key, value)
        env["DASK_FIBER__LISTEN_HOST"] = self.starting.listen_host
        # Each counts against the memory limit of the worker it stands for.
        self.limits = slotmemory.early_limits()
        for position in range(e.processes):
            n = next(e._loops.numbers)
            self.position[n] = position
            self.numbers.add(n)
            spec = SlotSpec(
                e._server.address,
                e._server.authkey,
                e._service,
                n,
                e._init_blob,
                e._maxtasks,
                None,
                env,
            )
            self.forks[n] = self.template.fork(spec, self.limits)
            if e._maxtasks is not None:
                threading.Thread(
                    target=self._keep,
                    args=(n, spec),
                    name="fiber-early-slot",
                    daemon=True,
                ).start()
        self.starting.add_ready_hook(self._cluster_up)
        self.starting.add_done_callback(e._wake)

    def _keep(self, n: int, spec: SlotSpec) -> None:
        """What a keeper does for its slot (:func:`fiber_dask.engine.slots.keep`),
        for early loop ``n`` with ``maxtasksperchild``: a slot process that
        retired and that the template did not restart itself is forked again,
        until the cluster is up (its position then goes to a Dask loop)."""
        while True:
            fork = self.forks[n]
            fork.done.wait()
            template = self.template
            if (
                fork.reason not in (proto.Reason.RECYCLED, proto.Reason.EXPIRED)
                or self.adopted
                or template is None
            ):
                self.engine._wake()
                return
            self.forks[n] = template.fork(spec, self.limits)

    def _cluster_up(self, handle: Any) -> None:
        """On the starting thread, before anything else gets the cluster: the
        pool takes its handle and claims its slots (a pool made meanwhile
        counts them as in use)."""
        self.claimed = self.engine._adopt_handle(handle)

    def attach(self, peer: Any) -> int | None:
        """``peer`` attached: if it is an early loop, its position (else None)."""
        n = peer.loop
        position = self.position.get(n)
        self.starting.go()  # they serve: the cluster's start may take the CPU
        if position is not None:
            self.attached.add(n)
            self.current[n] = peer
            self.engine._loops.recycled.discard(n)  # a successor is in
        return position

    def is_early(self, loop: int) -> bool:
        return loop in self.position

    def owns(self, loop: int) -> bool:
        """Loop ``loop`` is an early one (gone or not)."""
        return loop in self.numbers

    def handing_over(self) -> bool:
        """The cluster is up: early loops only finish what they hold."""
        return self.adopted

    def starting_at(self, position: int) -> bool:
        """An early loop for ``position`` was asked for and has not attached."""
        return not self.adopted and any(
            pos == position and n not in self.attached
            for n, pos in self.position.items()
        )

    def take_cluster(self) -> bool:
        """On the result thread, each turn: once the cluster is up, give the
        engine its handle, stop the early loops (each after the chunks it
        holds) and give each position to a Dask loop once its early loop is
        gone, so that no more than ``processes`` slot processes run at once,
        as with the stdlib.  True once the cluster is the engine's (its loop
        maintenance runs from then on)."""
        e = self.engine
        if not self.adopted:
            if not self.starting.done():
                return False
            self.adopted = True
            try:
                self.starting.result()
            except BaseException as exc:  # noqa: BLE001 - the pool's error now
                e._break(
                    exc
                    if isinstance(exc, Exception)
                    else RuntimeError(f"the embedded cluster did not start: {exc!r}")
                )
                self._stop_all()
                return False
            if self.claimed:
                e._started_on_cluster()
                self.waiting = set(range(e.processes))
            self._stop_all()
        if self.waiting:
            self._hand_over()
        return True

    def _hand_over(self) -> None:
        """Submit a Dask loop for each waiting position whose early loop is gone."""
        e = self.engine
        alive: set[int] = set()
        for n, position in list(self.position.items()):
            if n in self.attached or not self.forks[n].done.is_set():
                alive.add(position)
            else:  # its slot process ended before it attached
                self._forget(n)
        ready = sorted(p for p in self.waiting if p not in alive)
        if not ready:
            return
        self.waiting.difference_update(ready)
        with e._lock:
            if e.state == TERMINATE or e._released or e.broken is not None:
                self.waiting.clear()
                return
            if e.state == CLOSE and not e._cache:
                self.waiting.clear()  # no work left for them
                return
        try:
            e._loops.submit(ready)
        except Exception as exc:
            e._break(exc)

    def retire(self, peer: Any) -> None:
        """``peer`` (an early loop) ends after the chunks it holds (engine
        lock held)."""
        if peer.retiring:
            return
        peer.retiring = True
        self.engine._file(peer)
        peer.link.send([(peer.loop, proto.STOP)])

    def gone(self, peer: Any) -> None:
        """``peer`` left (or was lost): if it served an early loop, that loop
        is gone; once none is left, let the template go (its stdin's EOF ends
        it).  A loop whose process ``maxtasksperchild`` retired is not gone:
        the template forks a successor, which attaches as the same loop
        (before or after this)."""
        self._forget(peer.loop, peer)

    def _forget(self, loop: int, peer: Any = None) -> None:
        if peer is not None:
            if self.current.get(loop) is not peer:
                return  # its successor serves the loop already
            if loop in self.engine._loops.recycled and self.template is not None:
                self.attached.discard(loop)
                del self.current[loop]
                return
        if self.position.pop(loop, None) is None:
            return
        self.current.pop(loop, None)
        self.attached.discard(loop)
        self.engine._wake()  # its position may go to a Dask loop now
        if not self.position:
            self.close()

    def _stop_all(self) -> None:
        """Stop every early loop that attached (each after what it holds);
        those still starting are stopped as they attach."""
        e = self.engine
        with e._lock:
            for peer in list(e._peers.values()):
                if self.is_early(peer.loop):
                    self.retire(peer)

    def close(self) -> None:
        template, self.template = self.template, None
        if template is not None:
            template.close()
