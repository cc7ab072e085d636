"""Why a pool waits: who holds the task slots its loops wait for.

A pool's slots are long Dask tasks (its loops, :mod:`fiber_dask.engine.slottask`).
On a cluster programs share (``fiber-dask up``, an address), another
program's open pool holds its slots for as long as it lives, idle or not,
unless ``fiber.pool.idle-timeout`` gives idle ones back
(:mod:`fiber_dask.engine.poolelastic`); a new pool's loops then wait behind it and
its ``map`` does not start.  Dask cannot say why: to the scheduler each of
those slots is one running task.

:class:`Waiting`, one per pool and driven by the pool's result thread, looks
once work has waited :data:`HELD_AFTER` seconds with no loop of the pool
running, and again every :data:`HELD_AFTER` seconds while that lasts::

    result thread (never blocks)      the client's event loop (one look at a
    ────────────────────────────      time, given up after LOOK_TIMEOUT)
    tick(waited) ── add_callback ───► poolstats.fetch_slots: the tasks on each
                                      worker's threads and every pool's report,
                                      one rpc (without the pools plugin:
                                      processing + ncores_running, no names)
                                             │
                                      diagnose(): is every task slot the pool
                                      could use held, some by other pools?
                                             │ yes
                                      one WARNING per wait: this pool and the
                                      items waiting, all M slots of the cluster
                                      at ADDRESS, held by whom (each pool's name,
                                      program, pid, host, its slots, idle or
                                      busy, its idle-timeout; other tasks), and
                                      how to free them

What is *not* said, because the pool is not stuck behind someone (it would be
noise on a normal start): a loop of the pool runs (starting its slot process,
or its initializer); some thread the pool could use is free (Dask is still
placing the loops), or no worker has joined yet; a cluster fiber-dask started
still grows for the pool (the embedded cluster starting a worker for a second
pool, an adaptive one below its maximum: its planned slots exceed the threads
running); the loops need resources no worker has; only non-pool tasks hold the
threads (they end by themselves).  Those waits keep the pool's 60 s warning.
When only this process's own pools hold the slots and all of them are busy,
the wait is the program's own doing and ends when it closes them: said at
INFO; if they go idle while this pool still waits, the WARNING follows.

The look is not made on the result thread: a scheduler round trip there would
hold up every result of the pool.  It is made on the client's event loop, as
coroutines, bounded by :data:`LOOK_TIMEOUT`; what the engine's state says is
read on the result thread before (under its lock, once) and checked again,
without the lock, before anything is logged.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import socket
from dataclasses import dataclass, field
from typing import Any

from . import poolstats

__all__ = ["Waiting", "Held", "diagnose", "describe", "HELD_AFTER", "LOOK_TIMEOUT"]

logger = logging.getLogger("fiber_dask.pool")

#: Seconds work waits with no loop of the pool running before the pool looks
#: whether the cluster's slots are all held (and again this often while that
#: lasts).  A normal start connects the loops well within it (under a second
#: on an idle machine, a few on a loaded one); not a config key, as nothing
#: changes but how soon a stuck pool is explained.
HELD_AFTER = 4.0
#: Seconds one look (its scheduler round trips) may take before it is given up.
LOOK_TIMEOUT = 5.0

#: Scheduler states of a loop that waits for a thread (not for resources no
#: worker has, ``no-worker``, nor gone).
_WAITING_STATES = frozenset({"queued", "processing", "waiting"})


@dataclass
class Held:
    """What :func:`diagnose` found: all ``threads`` task slots the pool could
    use are held, ``pools`` (pool id → slots its loops hold) and ``tasks``
    (slots other tasks hold, their key prefixes in ``prefixes``)."""

    threads: int = 0
    pools: collections.Counter = field(default_factory=collections.Counter)
    tasks: int = 0
    prefixes: collections.Counter = field(default_factory=collections.Counter)


def _fits(have: dict | None, need: dict | None) -> bool:
    if not need:
        return True
    return have is not None and all(have.get(r, 0) >= n for r, n in need.items())


def diagnose(
    view: dict[str, Any],
    pool_id: str,
    resources: dict | None = None,
    planned: int | None = None,
) -> Held | None:
    """Whether every task slot pool ``pool_id`` could use is held, and some by
    other pools' loops; None if not (or it cannot be told).

    Parameters
    ----------
    view : dict
        ``workers`` (and ``states`` of the pool's waiting loops) as
        :meth:`fiber_dask.engine.poolstats.PoolStore.slots` gives them.
    pool_id : str
        The waiting pool's id (its loops' keys are ``loop_key(pool_id, n)``).
    resources : dict, optional
        The Dask resources each of its loops needs.
    planned : int, optional
        The task slots a cluster fiber-dask started is sized for (growing, or
        scaling adaptively): more than the threads running means workers are
        still to come.
    """
    workers = view.get("workers")
    if not workers:
        return None  # no worker has joined yet (or they cannot be told)
    states = view.get("states") or {}
    if states and not any(s in _WAITING_STATES for s in states.values()):
        return None  # no loop waits for a thread: resources missing, or gone
    running = [w for w in workers if w["running"]]
    if planned and planned > sum(w["nthreads"] for w in running):
        return None  # the cluster is still growing for its pools
    if resources and any(w.get("resources") is None for w in running):
        return None  # which workers have the resources cannot be told
    usable = [w for w in running if _fits(w.get("resources"), resources)]
    held = Held(threads=sum(w["nthreads"] for w in usable))
    if not held.threads:
        return None
    for w in usable:
        n = w["nthreads"]
        others = []
        for key, runs in w["loops"]:
            if poolstats.loop_pool(key) == pool_id:
                if runs:
                    return None  # a loop of this pool runs: it is starting
            else:
                others.append((key, runs))
        if len(others) + w["tasks"] < n:
            return None  # a free thread: the loop is being placed
        # The tasks holding the threads: those the worker's last heartbeat
        # said run first (assigned tasks beyond its threads wait there), pool
        # loops before other tasks (they hold for long).
        executing = min(w.get("tasks_executing") or 0, n)
        ranked = sorted(
            [(not runs, 0, key) for key, runs in others]
            + [(False, 1, "")] * executing
            + [(True, 1, "")] * min(w["tasks"] - executing, n)
        )[:n]
        for _, kind, key in ranked:
            if kind == 0:
                held.pools[poolstats.loop_pool(key)] += 1
            else:
                held.tasks += 1
        held.prefixes.update(w.get("prefixes") or {})
    return held if held.pools else None  # tasks alone end by themselves


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'s' * (n != 1)}"


def _holder(
    pool_id: str,
    slots: int,
    reports: dict[str, dict[str, Any]] | None,
    own: dict[str, tuple[str, str, bool, float | None]],
) -> tuple[str, str, bool]:
    """One pool holding ``slots`` slots, said: ``(text, kind, warn)``.

    ``kind``: ``"keeps"`` (it keeps idle slots until closed, or it cannot be
    told), ``"timed"`` (its idle slots are given back after its
    idle-timeout) or ``"closing"`` (freed once its work is done); ``warn``:
    it is not one of this process's busy or closing pools.
    """
    held = _plural(slots, "slot")
    if pool_id in own:
        name, state, busy, timeout = own[pool_id]
        who = f"{name} of this process (pid {os.getpid()} on {socket.gethostname()})"
        closing = state != "RUN"
        idle = not busy and not closing
        doing = "busy" if busy else "idle (no work queued or running)"
    elif reports is not None and pool_id in reports:
        r = reports[pool_id]
        who = f"{r['name']} of {r['program']} (pid {r['pid']} on {r['host']})"
        closing = r["state"] not in ("RUN", "")
        idle = not r["queued"] and not r["in_flight"] and not closing
        doing = (
            "idle (nothing queued or in flight)"
            if idle
            else f"busy ({r['queued']} queued, {r['in_flight']} in flight)"
        )
        timeout = r.get("idle_timeout")
    else:
        why = (
            "the scheduler has no fiber-dask pools plugin (start it with "
            "`--preload fiber_dask.dashboard`)"
            if reports is None
            else "it has not reported to the scheduler"
        )
        tasks = poolstats.loop_key(pool_id, 0)[:-1] + "*"  # as Dask shows them
        who = f"the fiber-dask pool {pool_id} (tasks {tasks})"
        return f"{who}: {held} (its owner is not known: {why})", "keeps", True
    warn = pool_id not in own or idle
    if closing:
        # close()d or terminate()d: its slots are freed once its work is done
        # (or its tasks have stopped), whatever its idle-timeout.
        return f"{who}: {held}, closing (freed once its work is done)", "closing", warn
    if timeout is None:
        where = "" if pool_id in own else " there"
        given = f"fiber.pool.idle-timeout is not set{where}: it keeps them until closed"
        return f"{who}: {held}, {doing}, {given}", "keeps", warn
    given = f"gives idle slots back after {timeout:g}s (fiber.pool.idle-timeout)"
    return f"{who}: {held}, {doing}, {given}", "timed", warn


def describe(
    held: Held,
    pools: list[dict[str, Any]] | None,
    *,
    name: str,
    items: int,
    address: str,
    own: dict[str, tuple[str, str, bool, float | None]],
    resources: dict | None = None,
) -> tuple[int, str]:
    """The log level and message for ``held``.

    ``pools``: the scheduler's pool reports (None without its plugin);
    ``own``: this process's other pools, id → ``(name, state, busy,
    idle_timeout)`` (``busy``: it has unfinished work); ``name`` and
    ``items``: the waiting pool's name and items waiting.  WARNING when
    another process's pool, or an idle pool of this one, holds slots; INFO
    when only this process's busy or closing pools do.
    """
    reports = None if pools is None else {p["id"]: p for p in pools}
    holders, kinds, level = [], set(), logging.INFO
    for pool_id, slots in held.pools.most_common():
        text, kind, warn = _holder(pool_id, slots, reports, own)
        holders.append(text)
        kinds.add(kind)
        if warn:
            level = logging.WARNING
    if held.tasks:
        named = ", ".join(held.prefixes) or "unnamed"
        holders.append(f"{_plural(held.tasks, 'other task')} ({named})")
    those, they = (
        ("that pool", "it runs")
        if len(held.pools) == 1
        else ("those pools", "they run")
    )
    if "keeps" in kinds:
        fix = (
            f"To free them, close {those} (pool.close() or terminate(), or the end "
            f"of its `with` block), or set fiber.pool.idle-timeout where {they} "
            "(for example DASK_FIBER__POOL__IDLE_TIMEOUT=30s) so that idle slots "
            "are given back"
        )
    elif "timed" in kinds:
        fix = (
            "Idle slots are given back after fiber.pool.idle-timeout; close "
            f"{those} to free them at once"
        )
    else:
        fix = f"They are freed as {those} finish closing"
    if held.tasks:
        fix += "; the other tasks free theirs when they end"
    what = "task slots" + (f" with the resources {resources}" if resources else "")
    waiting = _plural(items, "item") if items else "work"
    text = (
        f"fiber-dask: {name} of this process has {waiting} waiting and none of "
        f"its slots is running: all {held.threads} {what} of the cluster at {address} are "
        f"held, by {'; '.join(holders)}. {fix}; or add workers to the cluster."
    )
    return level, text


async def _plain_view(client: Any) -> dict[str, Any]:
    """What a scheduler without the pools plugin tells: each running worker's
    threads and the keys assigned to it (which of them run, and which seceded,
    it does not say)."""
    from dask.utils import key_split

    processing = await client.scheduler.processing()
    threads = await client.scheduler.ncores_running()
    workers = []
    for address, n in threads.items():
        keys = processing.get(address) or []
        tasks = [k for k in keys if poolstats.loop_pool(k) is None]
        prefixes = collections.Counter(key_split(k) for k in tasks)
        workers.append(
            {
                "address": address,
                "nthreads": n,
                "running": True,
                "resources": None,
                "loops": [[k, None] for k in keys if poolstats.loop_pool(k)],
                "tasks": len(tasks),
                "tasks_executing": None,
                "prefixes": dict(prefixes.most_common(5)),
            }
        )
    return {"pools": None, "workers": workers, "states": None}


class Waiting:
    """Says, once per wait, who holds the task slots a pool waits for.

    Parameters
    ----------
    engine : PoolEngine
        The pool; its result thread calls :meth:`tick` while work waits with
        no loop running and :meth:`reset` otherwise.
    live : weakref.WeakSet
        This process's live engines (``poolengine._live``): its own pools.
    """

    def __init__(self, engine: Any, live: Any) -> None:
        self.engine = engine
        self._live = live
        #: A WARNING was logged in this wait (the engine then skips its 60 s one).
        self.warned = False
        self._told = False  # the INFO (this process's busy pools) was logged
        self._looking = False  # a look is in flight on the client's loop
        self._due = HELD_AFTER  # seconds waited at which the next look starts
        self._wait = 0  # numbers the waits: a late answer of an old one is dropped
        self._dirty = False

    def reset(self) -> None:
        """No work waits, or a loop runs: the wait (if any) is over.  Called
        on every turn of the result thread: cheap when nothing changed."""
        if self._dirty:
            self._dirty = False
            self._wait += 1
            self.warned = self._told = False
            self._due = HELD_AFTER

    def tick(self, waited: float) -> None:
        """Work has waited ``waited`` seconds with no loop running: start a
        look on the client's event loop if one is due.  Never blocks."""
        if self.warned or self._looking or waited < self._due:
            return
        e = self.engine
        client = e._client
        if client.status != "running":
            return
        self._dirty = True
        self._due = waited + HELD_AFTER  # the next look, if this one says nothing
        with e._lock:
            loops = e._loops
            keys = [f.key for n, f in loops.futures.items() if n not in loops.connected]
            items = poolstats._queued(e)
        own = {}
        for other in list(self._live):
            if other is not e:
                elastic = other._elastic
                own[other._token] = (
                    other._stats.name,
                    other.state,
                    bool(other._cache),
                    None if elastic is None else elastic.timeout,
                )
        self._looking = True
        try:
            client.loop.add_callback(self._look, self._wait, keys, items, own)
        except Exception:  # pragma: no cover - a client closing under us
            self._looking = False

    async def _look(self, wait: int, keys: list, items: int, own: dict) -> None:
        e = self.engine
        try:
            view = await asyncio.wait_for(self._view(keys), LOOK_TIMEOUT)
            handle = e._handle
            planned = handle.planned_slots if handle.owned else None
            held = diagnose(view, e._token, e._resources, planned)
            # The wait may have ended while the scheduler answered.
            if held is None or wait != self._wait or e._peers or not e._cache:
                return
            level, text = describe(
                held,
                view.get("pools"),
                name=e._stats.name,
                items=items,
                address=e._address,
                own=own,
                resources=e._resources,
            )
            if level >= logging.WARNING:
                self.warned = True
            elif self._told:
                return
            self._told = True
            logger.log(level, text)
        except Exception:  # a slow or lost scheduler: the 60 s warning stays
            logger.debug(
                "fiber-dask: could not tell who holds the slots", exc_info=True
            )
        finally:
            self._looking = False

    async def _view(self, keys: list) -> dict[str, Any]:
        client = self.engine._client
        view = await poolstats.fetch_slots(client, keys)
        if view is None or view.get("workers") is None:
            plain = await _plain_view(client)
            plain["pools"] = None if view is None else view.get("pools")
            view = plain
        return view
