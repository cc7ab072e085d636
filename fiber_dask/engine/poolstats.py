"""Pool statistics: what each pool's owner reports to the scheduler, both ends.

A pool's owner (its :class:`~fiber_dask.engine.poolengine.PoolEngine`, in the user's
process) is the only place that knows how a pool is doing: Dask sees each slot
as one long task.  This module is the one owner of how those numbers travel::

    owner process                                 scheduler
    ─────────────                                 ─────────
    PoolEngine ── hooks, under the engine's       PoolStore (a scheduler
    lock it already holds ──► PoolCounters        extension, installed by the
                                                  fiber_dask.dashboard plugin)
    reporter thread, every INTERVAL s:
      snapshot() of every live pool ── rpc ─────► fiber_pools_update(pools=[..])
      pool released ─────────────────── rpc ────► fiber_pools_remove(ids=[..])
                                                  fiber_pools() ─► document()
                                                  (fiber-dask info, the JSON
                                                  endpoint, the dashboard page)
    held locks (fiber_dask.comm.lockstats) ─ rpc ► fiber_locks_update(...)
    a pool waiting for slots
    (fiber_dask.engine.poolwait) ───────────── rpc ────► fiber_pools_slots(keys=[..])
                                                  ─► slots(): document() plus
                                                  which tasks hold each
                                                  worker's threads

* **Counting** (:class:`PoolCounters`) costs the engine no lock of its own:
  every hook runs where the engine already holds its lock (sending a chunk,
  settling a result, losing a loop), and the reporter takes that lock once per
  pool per interval to read the queue.
* **Reporting** is one background thread per process for all its pools; it
  sends only to a scheduler whose plugin announced itself in the scheduler's
  metadata (``METADATA_KEY``), so a scheduler without it sees one
  ``get_metadata`` call per client and nothing else.  Sends are bounded by
  ``SEND_TIMEOUT``; a failing send is dropped (the next interval sends again).
* **Who holds the slots**: a pool's loops are Dask tasks keyed
  :func:`loop_key` (``fiber-pool-<pool id>-<n>``), so the store can tell, from
  what the scheduler assigned to each worker, which pool holds which task
  slots (:meth:`PoolStore.slots`); a pool that waits for slots asks it once
  in a while (:mod:`fiber_dask.engine.poolwait`) to say who holds them.
* **Expiry**: the scheduler drops a pool when its owner says it was released,
  when the owner's client goes away, or when no report came for
  ``STALE_AFTER`` seconds (an owner that hangs or lost its connection).

What the numbers mean (per pool):

``done``
    items whose results came back from a slot.
``failed``
    items that raised (a chunk stops at its first failing item, which counts
    one), could not be pickled, or died with ``allowed-failures`` processes.
``queued``
    items accepted by the pool and not yet sent to a slot (an ``imap``'s input
    is counted once read, and it is read as slots take work).
``in_flight``
    items sent to slots whose results have not come back: each slot runs one
    chunk and keeps a few more queued there (``fiber.pool.prefetch``).
``reruns``
    items sent again because the process running them died (a lost worker,
    a killed slot process); items queued at that slot and known never to
    have started are sent elsewhere without counting.  When the dead slot had
    several chunks of one batch unanswered (a slot sends results in batches,
    so a finished chunk's result may not have left yet), which of them ran
    cannot be told, and each counts.
``rate``
    items done per second over the last ``WINDOW`` seconds.
``busy``
    per slot, the fraction of the last ``WINDOW`` seconds the slot had work
    (at least one chunk sent and not back), as seen from the owner.
``idle_timeout``
    seconds after which an idle slot of the pool gives its Dask slot back
    (``fiber.pool.idle-timeout``, :mod:`fiber_dask.engine.poolelastic`), or None
    when the pool keeps its slots until it is closed.
"""

from __future__ import annotations

import collections
import itertools
import logging
import os
import socket
import sys
import threading
import time
import weakref
from typing import Any

from .. import cluster
from ..comm import lockstats

__all__ = [
    "PoolCounters",
    "PoolStore",
    "snapshot",
    "watch",
    "unwatch",
    "fetch",
    "INTERVAL",
    "STALE_AFTER",
    "WINDOW",
    "METADATA_KEY",
    "VERSION",
    "loop_key",
    "loop_pool",
    "fetch_slots",
]

logger = logging.getLogger("fiber_dask.engine.poolstats")

#: Version of the report format; the scheduler rejects reports of another.
VERSION = 1
#: Seconds between two reports of a pool's owner.
INTERVAL = 1.0
#: Seconds the rate and the busy fractions are measured over.
WINDOW = 5.0
#: Seconds after its last report a pool is dropped from the scheduler.
STALE_AFTER = 10.0
#: Seconds one send to the scheduler may take before it is given up.
SEND_TIMEOUT = 5.0
#: The scheduler metadata key under which the plugin announces itself.
METADATA_KEY = ["fiber-dask", "pool-stats"]

_UPDATE, _REMOVE, _QUERY = "fiber_pools_update", "fiber_pools_remove", "fiber_pools"
_SLOTS = "fiber_pools_slots"
#: Every pool loop's Dask key starts so (see :func:`loop_key`).
_LOOP_PREFIX = "fiber-pool-"
#: Prefixes of other tasks :meth:`PoolStore.slots` names per worker, at most.
_PREFIXES = 5


def loop_key(pool_id: str, n: int) -> str:
    """The Dask key of loop ``n`` of the pool ``pool_id`` (its engine's token,
    the ``id`` of its report): the scheduler tells a pool's loops by it."""
    return f"{_LOOP_PREFIX}{pool_id}-{n}"


def loop_pool(key: Any) -> str | None:
    """The pool id of a loop's key (:func:`loop_key`), None for another key."""
    if not isinstance(key, str) or not key.startswith(_LOOP_PREFIX):
        return None
    pool_id, _, n = key[len(_LOOP_PREFIX) :].rpartition("-")
    return pool_id if pool_id and n.isdigit() else None


_numbers = itertools.count(1)


# ------------------------------------------------------------------ owner side


class _Slot:
    """Busy-time accounting of one connected loop (a peer of the engine)."""

    __slots__ = ("position", "since", "total")

    def __init__(self, position: int | None) -> None:
        self.position = position
        self.since: float | None = None  # had work since then
        self.total = 0.0  # seconds with work, closed periods


class PoolCounters:
    """A pool's counts, kept by its engine.

    Every method is called with the engine's lock held (where the engine
    already holds it), so nothing here takes a lock.

    Parameters
    ----------
    positions : dict
        The engine's loop number → slot position map (read, never written).
    """

    __slots__ = (
        "done",
        "failed",
        "reruns",
        "losses",
        "name",
        "started",
        "_positions",
        "_slots",
        "_base",
    )

    def __init__(self, positions: dict[int, int]) -> None:
        self.done = 0
        self.failed = 0
        self.reruns = 0
        self.losses = 0  # slot processes that died running an item
        self.name = f"Pool-{next(_numbers)}"
        self.started = time.time()
        self._positions = positions
        self._slots: dict[Any, _Slot] = {}  # peer -> its accounting
        self._base: dict[int, float] = collections.defaultdict(float)

    def _slot(self, peer: Any) -> _Slot:
        slot = self._slots.get(peer)
        if slot is None:
            slot = self._slots[peer] = _Slot(self._positions.get(peer.loop))
        return slot

    def sent(self, peer: Any) -> None:
        """A chunk went to ``peer``: its slot has work from now if it had none."""
        slot = self._slot(peer)
        if slot.since is None:
            slot.since = time.monotonic()

    def result(self, peer: Any, items: int, ok: bool) -> None:
        """A chunk of ``items`` came back from ``peer`` (``ok``: no exception)."""
        if ok:
            self.done += items
        else:
            self.failed += 1
        if not peer.inflight:
            slot = self._slots.get(peer)
            if slot is not None and slot.since is not None:
                slot.total += time.monotonic() - slot.since
                slot.since = None

    def lost(self, peer: Any) -> None:
        """``peer`` hung up (its loop ended, or its process died)."""
        slot = self._slots.pop(peer, None)
        if slot is None:
            return
        if slot.since is not None:
            slot.total += time.monotonic() - slot.since
        if slot.position is not None:
            self._base[slot.position] += slot.total

    def rerun(self, items: int, failed: int = 0) -> None:
        """After a loss: ``items`` that were running go again, ``failed``
        reached the failure limit."""
        self.reruns += items
        self.failed += failed
        self.losses += bool(items or failed)

    def busy_seconds(self, now: float) -> dict[int, float]:
        """Slot position → seconds it has had work since the pool started."""
        out = dict(self._base)
        for slot in self._slots.values():
            if slot.position is None:
                continue
            extra = now - slot.since if slot.since is not None else 0.0
            out[slot.position] = out.get(slot.position, 0.0) + slot.total + extra
        return out


def _unsent(job: Any) -> int:
    """Items of ``job`` not handed to the engine as chunks yet."""
    from .poolresults import IMapIterator, MapResult

    if isinstance(job, IMapIterator):
        return 0  # its input is read as slots take work
    if job._exhausted or job._finished:
        return 0
    if isinstance(job, MapResult):
        items = job._items
        if items is None:
            return 0
        return max(0, len(items) - job._chunk_index * job._chunksize)
    return 1  # apply_async


def _queued(engine: Any) -> int:
    """Items accepted by the pool and not yet sent to a slot (engine lock held)."""
    return sum(len(c.items) for c in engine._retry if not c.job._finished) + sum(
        _unsent(job) for job in engine._jobs
    )


def queued(engine: Any) -> int:
    """Items ``engine``'s pool has accepted and not yet sent to a slot (an
    ``imap``'s unread input not counted).  Takes the engine's lock once."""
    with engine._lock:
        return _queued(engine)


def snapshot(engine: Any, now: float | None = None) -> dict[str, Any]:
    """The pool's numbers now (raw totals; rates are the reporter's).

    Takes the engine's lock once.
    """
    stats: PoolCounters = engine._stats
    mono = time.monotonic() if now is None else now
    with engine._lock:
        queued = _queued(engine)
        in_flight = sum(
            len(c.items)
            for peer in engine._peers.values()
            for c in peer.inflight.values()
        )
        slots = []
        for position in range(engine.processes):
            peer = engine._peer_at.get(position)
            slots.append(
                {
                    "name": f"PoolWorker-{position + 1}",
                    "worker": None if peer is None else peer.worker,
                    "pid": None if peer is None else peer.pid,
                }
            )
        busy = stats.busy_seconds(mono)
        done, failed, reruns, losses = (
            stats.done,
            stats.failed,
            stats.reruns,
            stats.losses,
        )
        state = engine.state
    return {
        "id": engine._token,
        "name": stats.name,
        "state": state,
        "processes": engine.processes,
        "done": done,
        "failed": failed,
        "queued": queued,
        "in_flight": in_flight,
        "reruns": reruns,
        "worker_losses": losses,
        "slots": slots,
        "busy_seconds": busy,
        "started": stats.started,
        # Seconds after which an idle slot is given back (poolelastic), None
        # for never: what a pool waiting for these slots tells its user.
        "idle_timeout": None if engine._elastic is None else engine._elastic.timeout,
    }


class _History:
    """The recent raw snapshots of one pool, for rates over ``WINDOW``."""

    __slots__ = ("samples",)

    def __init__(self, started_mono: float) -> None:
        self.samples: collections.deque = collections.deque()
        self.samples.append((started_mono, 0, {}))

    def add(self, mono: float, snap: dict[str, Any]) -> dict[str, Any]:
        """Append ``snap`` and return the report made of it."""
        self.samples.append((mono, snap["done"], snap["busy_seconds"]))
        while len(self.samples) > 2 and mono - self.samples[1][0] >= WINDOW:
            self.samples.popleft()
        t0, done0, busy0 = self.samples[0]
        span = max(mono - t0, 1e-9)
        busy1 = snap["busy_seconds"]
        slots = []
        for position, slot in enumerate(snap["slots"]):
            delta = busy1.get(position, 0.0) - busy0.get(position, 0.0)
            slots.append({**slot, "busy": round(min(1.0, max(0.0, delta / span)), 3)})
        report = {k: v for k, v in snap.items() if k != "busy_seconds"}
        report["slots"] = slots
        report["rate"] = round((snap["done"] - done0) / span, 2)
        report["busy"] = (
            round(sum(s["busy"] for s in slots) / len(slots), 3) if slots else 0.0
        )
        return report


def _program() -> str:
    """What the owner runs, as ``ps`` would name it: the script, or the
    package of ``python -m package``."""
    argv0 = sys.argv[0] if sys.argv and sys.argv[0] else ""
    name = os.path.basename(argv0)
    if name == "__main__.py":
        return os.path.basename(os.path.dirname(argv0)) or name
    return name or "python"


def _owner() -> dict[str, Any]:
    return {"host": socket.gethostname(), "pid": os.getpid(), "program": _program()}


class _Reporter:
    """The process's one reporting thread, for all its pools."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.engines: weakref.WeakSet = weakref.WeakSet()
        self.history: dict[str, _History] = {}
        #: client -> pool ids released but not yet removed at the scheduler
        self.removed: dict[Any, set[str]] = {}
        #: client -> whether its scheduler takes reports (asked once)
        self.supported: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.thread: threading.Thread | None = None
        self.wake = threading.Event()
        self.stopped = False

    def watch(self, engine: Any) -> None:
        with self.lock:
            self.stopped = False
            self.engines.add(engine)
            self.history[engine._token] = _History(time.monotonic())
            self._ensure_thread()
        self.wake.set()  # report the new pool now, not an interval later

    def unwatch(self, engine: Any) -> None:
        with self.lock:
            self.engines.discard(engine)
            if self.history.pop(engine._token, None) is None:
                return
            self.removed.setdefault(engine._client, set()).add(engine._token)
            self._ensure_thread()
        self.wake.set()

    def stop(self) -> None:
        """At shutdown (a ``cluster.on_shutdown`` hook, after the pools have
        stopped): send nothing more.  The clients are about to close, and
        their scheduler drops their pools when they do.  Never blocks."""
        with self.lock:
            self.stopped = True
            self.engines = weakref.WeakSet()
            self.history.clear()
            self.removed.clear()
        self.wake.set()

    def _ensure_thread(self) -> None:
        if self.thread is None or not self.thread.is_alive():
            self.thread = threading.Thread(
                target=self._run, name="fiber-pool-stats", daemon=True
            )
            self.thread.start()

    def _run(self) -> None:
        while True:
            self.wake.wait(INTERVAL)
            self.wake.clear()
            with self.lock:
                engines = list(self.engines)
                removed, self.removed = self.removed, {}
                if self.stopped or (not engines and not removed):
                    self.thread = None
                    return
            try:
                self._report(engines, removed)
            except Exception:  # pragma: no cover - never let reporting hurt a pool
                logger.debug("fiber-dask: pool stats report failed", exc_info=True)

    def _report(self, engines: list[Any], removed: dict[Any, set[str]]) -> None:
        by_client: dict[Any, list[dict[str, Any]]] = {}
        owner = _owner()
        for engine in engines:
            history = self.history.get(engine._token)
            if history is None:
                continue
            mono = time.monotonic()
            try:
                snap = snapshot(engine, mono)
            except Exception:
                logger.debug("fiber-dask: no snapshot of a pool", exc_info=True)
                continue
            report = history.add(mono, snap)
            report.update(owner)
            by_client.setdefault(engine._client, []).append(report)
        for client, ids in removed.items():
            if self._supported(client):
                self._send(client, _REMOVE, ids=sorted(ids))
        for client, reports in by_client.items():
            if self._supported(client):
                self._send(
                    client,
                    _UPDATE,
                    pools=reports,
                    client_id=client.id,
                    interval=INTERVAL,
                    version=VERSION,
                )

    def _supported(self, client: Any) -> bool:
        if client.status != "running":
            return False
        known = self.supported.get(client)
        if known is None:
            try:
                meta = _call(client, "get_metadata", keys=METADATA_KEY, default=None)
            except Exception:
                return False  # ask again next time
            known = self.supported[client] = bool(meta)
            if not known:
                logger.debug(
                    "fiber-dask: the scheduler at %s has no pool-stats plugin; "
                    "pools are not reported to it",
                    client.scheduler.address,
                )
        return known

    def _send(self, client: Any, op: str, **msg: Any) -> None:
        try:
            _call(client, op, **msg)
        except Exception:
            logger.debug("fiber-dask: sending pool stats failed", exc_info=True)


def _call(client: Any, op: str, **msg: Any) -> Any:
    """One rpc to the client's scheduler, from any thread but its loop's,
    given up after ``SEND_TIMEOUT``."""
    from distributed.utils import sync

    return sync(
        client.loop,
        getattr(client.scheduler, op),
        callback_timeout=SEND_TIMEOUT,
        **msg,
    )


_reporter = _Reporter()
# Registered before the pools' own hook (poolengine imports this module first),
# so it runs after them: hooks run newest first.
cluster.on_shutdown(_reporter.stop)


def watch(engine: Any) -> None:
    """Report ``engine``'s pool from now on (called as the pool starts)."""
    _reporter.watch(engine)


def unwatch(engine: Any) -> None:
    """Stop reporting ``engine``'s pool and remove it at the scheduler (called
    when the pool releases what it holds).  Never blocks."""
    _reporter.unwatch(engine)


def fetch(client: Any) -> dict[str, Any] | None:
    """The scheduler's pool document (see :meth:`PoolStore.document`), or None
    when the scheduler has no pool-stats plugin (``fiber_dask.dashboard``).

    Parameters
    ----------
    client : distributed.Client
        A synchronous client of the scheduler.
    """
    meta = client.sync(client.scheduler.get_metadata, keys=METADATA_KEY, default=None)
    if not meta:
        return None
    return client.sync(getattr(client.scheduler, _QUERY))


async def fetch_slots(client: Any, keys: list[str]) -> dict[str, Any] | None:
    """The scheduler's :meth:`PoolStore.slots`, awaited on the client's event
    loop (the caller bounds it), or None when the scheduler has no pool-stats
    plugin.  A plugin of an older fiber-dask, which does not answer it, gives
    its :meth:`~PoolStore.document` with ``workers`` and ``states`` None.

    Parameters
    ----------
    client : distributed.Client
        A client of the scheduler (its ``scheduler`` rpc is awaited).
    keys : list of str
        Keys whose scheduler state to return (a waiting pool's loops).
    """
    meta = await client.scheduler.get_metadata(keys=METADATA_KEY, default=None)
    if not meta:
        return None
    if isinstance(meta, dict) and meta.get("slots"):
        return await getattr(client.scheduler, _SLOTS)(keys=list(keys))
    document = await getattr(client.scheduler, _QUERY)()
    return {**document, "workers": None, "states": None}


# -------------------------------------------------------------- scheduler side

_INT_FIELDS = (
    "done",
    "failed",
    "queued",
    "in_flight",
    "reruns",
    "worker_losses",
    "processes",
    "pid",
)
_FLOAT_FIELDS = ("rate", "busy", "started")
_STR_FIELDS = ("id", "name", "state", "host", "program")


def _clean(report: Any) -> dict[str, Any] | None:
    """A report with only the known fields, of the right types (the page
    renders what owners send; nothing else is kept)."""
    if not isinstance(report, dict) or not isinstance(report.get("id"), str):
        return None
    out: dict[str, Any] = {}
    try:
        for k in _STR_FIELDS:
            out[k] = str(report.get(k, ""))[:200]
        for k in _INT_FIELDS:
            out[k] = int(report.get(k) or 0)
        for k in _FLOAT_FIELDS:
            out[k] = float(report.get(k) or 0.0)
        slots = []
        for s in list(report.get("slots") or [])[:10000]:
            slots.append(
                {
                    "name": str(s.get("name", ""))[:100],
                    "worker": None if s.get("worker") is None else str(s["worker"]),
                    "pid": None if s.get("pid") is None else int(s["pid"]),
                    "busy": float(s.get("busy") or 0.0),
                }
            )
        out["slots"] = slots
        timeout = report.get("idle_timeout")  # None: never (or an older owner)
        out["idle_timeout"] = None if timeout is None else float(timeout)
    except (TypeError, ValueError, AttributeError):
        return None
    return out


class PoolStore:
    """The scheduler's view of the live pools: the latest report of each.

    Installed on a scheduler by :class:`fiber_dask.dashboard.PoolDashboard`
    (which also serves it over HTTP); :meth:`install` registers the rpc
    handlers and announces the store in the scheduler's metadata.
    """

    def __init__(self) -> None:
        self.pools: dict[str, dict[str, Any]] = {}
        self._received: dict[str, float] = {}
        self._client_of: dict[str, str] = {}
        self.scheduler: Any = None
        #: The dashboard page's path, once it is served (fiber_dask.dashboard).
        self.page: str | None = None
        #: The held locks the programs' processes report (comm.lockstats).
        self.locks = lockstats.LockStore()

    def install(self, scheduler: Any) -> None:
        """Register the handlers on ``scheduler`` and announce the store."""
        self.scheduler = scheduler
        scheduler.handlers[_UPDATE] = self.update
        scheduler.handlers[_REMOVE] = self.remove
        scheduler.handlers[_QUERY] = self.document
        scheduler.handlers[_SLOTS] = self.slots
        scheduler.handlers[lockstats.UPDATE] = self.locks.update
        scheduler.extensions["fiber-pools"] = self
        # "slots": this store answers fiber_pools_slots (fetch_slots asks);
        # "locks": it takes the held locks' reports (comm.lockstats asks).
        scheduler.set_metadata(
            keys=METADATA_KEY,
            value={"version": VERSION, "interval": INTERVAL, "slots": 1, "locks": 1},
        )

    def update(
        self,
        pools: list | None = None,
        client_id: str | None = None,
        interval: float | None = None,
        version: int | None = None,
    ) -> None:
        """Handler: an owner's reports of its live pools."""
        if version != VERSION:
            return
        now = time.monotonic()
        for report in pools or ():
            clean = _clean(report)
            if clean is None:
                continue
            pid = clean["id"]
            self.pools[pid] = clean
            self._received[pid] = now
            if client_id is not None:
                self._client_of[pid] = str(client_id)

    def remove(self, ids: list | None = None) -> None:
        """Handler: these pools were released by their owner."""
        for pid in ids or ():
            self._drop(str(pid))

    def drop_client(self, client: str) -> None:
        """The owner's client went away: its pools with it."""
        for pid in [p for p, c in self._client_of.items() if c == client]:
            self._drop(pid)
        self.locks.drop_client(client)

    def _drop(self, pid: str) -> None:
        self.pools.pop(pid, None)
        self._received.pop(pid, None)
        self._client_of.pop(pid, None)

    def expire(self) -> None:
        """Drop pools whose owner has not reported for ``STALE_AFTER`` s."""
        now = time.monotonic()
        for pid, t in list(self._received.items()):
            if now - t > STALE_AFTER:
                self._drop(pid)
        self.locks.expire()

    def document(self) -> dict[str, Any]:
        """Handler, and what the JSON endpoint serves: every live pool.

        ``{"version", "interval", "stale_after", "page", "pools": [...],
        "locks": [...]}`` (``page``: the dashboard page's path, None when not
        served), each pool with the fields of the module docstring plus
        ``id``, ``name``, ``state``, ``processes``, ``host``, ``pid``,
        ``program``, ``started`` (Unix time), ``age`` (seconds since its last
        report) and ``slots`` (``name``, ``worker``, ``pid``, ``busy``); each
        held lock as :meth:`fiber_dask.comm.lockstats.LockStore.document`
        lists it (``id``, ``kind``, ``site``, ``owner``, ``holders``, ...).
        """
        self.expire()
        now = time.monotonic()
        pools = []
        for pid, report in sorted(
            self.pools.items(), key=lambda kv: (kv[1]["started"], kv[0])
        ):
            pools.append({**report, "age": round(now - self._received[pid], 2)})
        return {
            "version": VERSION,
            "interval": INTERVAL,
            "stale_after": STALE_AFTER,
            "page": self.page,
            "pools": pools,
            "locks": self.locks.document(),
        }

    def slots(self, keys: list | None = None) -> dict[str, Any]:
        """Handler: the :meth:`document`, plus the cluster's task slots and
        what holds them, as the scheduler sees them now.

        ``workers``: one dict per worker: ``address``, ``nthreads``,
        ``running`` (it takes tasks: not paused, not closing), ``resources``,
        ``loops`` (``[key, executing]`` for each pool loop assigned to it, a
        :func:`loop_key`; ``executing``: its last heartbeat said the task
        runs, None if the scheduler does not keep that), ``tasks`` and
        ``tasks_executing`` (the other tasks assigned to it, and how many of
        them run) and ``prefixes`` (those tasks' key prefixes, counted, the
        most common first).  A task that seceded (``long_running``: a
        fiber-dask Process's launcher) holds no thread and is left out.
        ``states``: the scheduler's state of each of ``keys``.
        """
        scheduler = self.scheduler
        workers = []
        for address, ws in list(scheduler.workers.items()):
            # The keys the worker's last heartbeat said it executes: assigned
            # tasks beyond the worker's threads wait there, and these are the
            # ones that hold the threads.
            heard = getattr(ws, "executing", None)
            seceded = ws.long_running
            loops = []
            tasks = executing = 0
            prefixes: collections.Counter = collections.Counter()
            for ts in ws.processing:
                if ts in seceded:
                    continue
                runs = None if heard is None else ts in heard
                if loop_pool(ts.key) is not None:
                    loops.append([ts.key, runs])
                else:
                    tasks += 1
                    executing += bool(runs)
                    prefixes[ts.prefix.name] += 1
            workers.append(
                {
                    "address": address,
                    "nthreads": ws.nthreads,
                    "running": ws.status.name == "running",
                    "resources": dict(ws.resources),
                    "loops": loops,
                    "tasks": tasks,
                    "tasks_executing": None if heard is None else executing,
                    "prefixes": dict(prefixes.most_common(_PREFIXES)),
                }
            )
        states = {}
        for key in keys or ():
            ts = scheduler.tasks.get(key)
            states[str(key)] = "forgotten" if ts is None else ts.state
        return {**self.document(), "workers": workers, "states": states}
