"""Why a pool's worker died: the cause a ``WorkerLostError`` carries.

The owner sees a loop's loss as its link dropping (:mod:`fiber_dask.engine.
poolengine`), before anyone knows why.  The why comes after, from one of:

* **its keeper** (process slots): the Dask task that held the slot process
  returns a :class:`~fiber_dask.engine.poolprotocol.Death` once the template
  reaped it — its signal or exit code, or "memory" when
  :mod:`fiber_dask.engine.slotmemory` ended it over its worker's limit (or the
  kernel's OOM killer did).  The owner reads it from the task's Dask future
  (:meth:`fiber_dask.engine.poolloops.Loops.maintain`), tens of milliseconds
  after the loss;
* **the early slot's fork** (the first pool's early slots): the owner holds
  their template's reports itself;
* **the link itself**: a link that dropped because its host stopped
  answering (its keep-alive, set by ``fiber.peer-timeout``, timed out: no
  end-of-file came) is ``"host"`` at once — the keeper cannot tell;
* **the scheduler**, when the whole Dask worker went (a lost host or network,
  a retired worker, a thread slot's worker process): its ``remove-worker``
  event for that worker, whose ``stimulus_id`` says why: a missed heartbeat
  (``check-worker-ttl``) or a dropped connection (``handle-worker-cleanup``)
  is ``"host"``, a retirement (``retire-workers``) ``"scaled-down"``; a
  worker of a batch cluster (dask-jobqueue) whose job the batch system no
  longer runs is ``"job"`` (:func:`job_ended`).

Only the item that fails (its losses past ``fiber.pool.allowed-failures``)
waits for its cause, at most :data:`WAIT` seconds; then it fails with what is
known (``cause=None`` if nothing is).  A re-run never waits.  Everything here
runs on the engine's result thread.
"""

from __future__ import annotations

import time
from typing import Any

from ..backends.base import last_event
from . import poolprotocol as proto

__all__ = ["Causes", "WAIT"]

#: Seconds a failing item waits for its loop's cause.
WAIT = 5.0
#: Seconds after which the scheduler is asked whether the worker went.
_ASK_AFTER = 1.0


class Causes:
    """The failing items of one pool that wait for their loop's cause."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        #: [chunk, peer, since, asked]
        self.waiting: list[list] = []
        #: loop number -> its Death, from its keeper's Dask future.
        self.deaths: dict[int, proto.Death] = {}

    def add(self, chunk: Any, peer: Any) -> None:
        self.waiting.append([chunk, peer, time.monotonic(), False])

    def ready(self) -> list[tuple[Any, Any, proto.Death | None]]:
        """``(chunk, peer, death)`` of the items whose cause is known now or
        that waited long enough."""
        out = []
        now = time.monotonic()
        for w in list(self.waiting):
            chunk, peer, since, asked = w
            death = self._keeper(peer) or self._early(peer)
            if death is None and peer.link.silent and not asked:
                # Its host stopped answering: no keeper will tell; the
                # scheduler may know more (a job that ended, a retirement).
                w[3] = True
                death = self._scheduler(peer) or _silent(peer)
            if death is None and now - since > _ASK_AFTER and not asked:
                w[3] = True
                death = self._scheduler(peer)
            if death is None and now - since > WAIT:
                death = self._scheduler(peer) or self._job(peer, None)
                if death is None:
                    out.append((chunk, peer, None))
                    self.waiting.remove(w)
                    continue
            if death is not None:
                # A batch job that ended says more than how its processes
                # died (scancel's SIGTERM, the walltime's SIGKILL).
                death = self._job(peer, death) or death
                if death.address is None:
                    death.address = peer.worker
                out.append((chunk, peer, death))
                self.waiting.remove(w)
        if not self.waiting:
            self.deaths.clear()
        return out

    def _keeper(self, peer: Any) -> proto.Death | None:
        """What ``peer``'s keeper returned, once its Dask task ended."""
        loop = peer.loop
        if loop not in self.deaths:
            fut = self.engine._loops.ended.get(loop, (None, None))[1]
            if fut is None or fut.status != "finished":
                return None
            try:
                result = fut.result(timeout=2)
            except Exception:  # noqa: BLE001 - no word from it
                result = None
            self.deaths[loop] = result if isinstance(result, proto.Death) else None
        return self.deaths[loop]

    def _early(self, peer: Any) -> proto.Death | None:
        early = self.engine._early
        fork = early.forks.get(peer.loop) if early is not None else None
        if fork is None or not fork.done.is_set() or fork.code is None:
            return None
        from .slotmemory import death

        return death(fork, peer.worker)

    def _job(self, peer: Any, death: proto.Death | None) -> proto.Death | None:
        """``"job"`` when ``peer``'s worker went with its batch job."""
        cluster = getattr(self.engine._handle, "cluster", None)
        if death is not None and death.cause == "job":
            return death
        ended = job_ended(cluster, peer.worker) if peer.worker else None
        if ended is None:
            return None
        job_id, state = ended
        how = ""
        if death is not None and death.cause in ("signal", "exit", "memory"):
            how = f"; its slot process was {death}"  # e.g. killed by SIGTERM
        return proto.Death(
            "job", death and death.signal, death and death.exitcode, peer.worker,
            peer.pid,
            detail=f"its Dask worker {peer.worker} went with its batch job "
            f"{job_id}, which the batch system lists as {state}{how}",
        )  # fmt: skip

    def _scheduler(self, peer: Any) -> proto.Death | None:
        """The scheduler's word on ``peer``'s Dask worker, if it removed it."""
        worker = peer.worker
        client = self.engine._client
        if not worker or client is None or client.status != "running":
            return None
        try:
            events = client.sync(
                client.scheduler.events, topic=worker, callback_timeout=2
            )
        except Exception:  # noqa: BLE001 - no word: the cause stays unknown
            return None
        removal = last_event(events, "remove-worker")
        if removal is None:
            return None
        return _removed(worker, str(removal.get("stimulus_id") or ""))


def _silent(peer: Any) -> proto.Death:
    from ..comm.channel import peer_timeout

    return proto.Death(
        "host", address=peer.worker, pid=peer.pid,
        detail=f"its host stopped answering for fiber.peer-timeout="
        f"{peer_timeout():g}s (pid {peer.pid}): the host or its network is gone",
    )  # fmt: skip


def _removed(worker: str, stimulus: str) -> proto.Death:
    """The :class:`~fiber_dask.engine.poolprotocol.Death` of a worker the
    scheduler removed for ``stimulus`` (a batch job that ended is for
    :meth:`Causes._job` to tell)."""
    if stimulus.startswith("retire-workers"):
        return proto.Death(
            "scaled-down", address=worker,
            detail=f"its Dask worker {worker} was retired by the cluster "
            "(scaled down)",
        )  # fmt: skip
    if stimulus.startswith("check-worker-ttl"):
        how = (
            "missed its heartbeats (distributed.scheduler.worker-ttl): its host "
            "or network is gone"
        )
    elif stimulus.startswith("handle-worker-cleanup"):
        how = (
            "dropped its connection to the scheduler: its host, network or "
            "process is gone"
        )
    elif stimulus.startswith("nanny-close"):
        # Thread slots: the task ended the Dask worker process itself.
        how = (
            "process ended and its nanny unregistered it (the nanny's log has "
            "its exit status)"
        )
    else:
        head, _, tail = stimulus.rpartition("-")
        reason = head if tail.replace(".", "").isdigit() else stimulus
        how = f"was removed by the scheduler ({reason or 'no reason given'})"
    return proto.Death("host", address=worker, detail=f"its Dask worker {worker} {how}")


def job_ended(cluster: Any, worker: str) -> tuple[str, str] | None:
    """``(job id, state)`` when ``worker`` belonged to a batch job that the
    batch system no longer runs (a dask-jobqueue cluster this process
    started), else None."""
    if cluster is None or not hasattr(cluster, "_fiber_batch"):
        return None
    from ..backends import jobwatch

    return jobwatch.worker_job_ended(cluster, worker)
