"""Slot processes' memory, counted against their Dask worker's limit; why one died.

A Dask worker's nanny ends the worker process when its RSS passes
``distributed.worker.memory.terminate`` (0.95) x the worker's
``memory_limit`` (``distributed.worker_memory.NannyMemoryManager``), but it
measures that one process: a task in a slot process
(:mod:`fiber_dask.engine.slots`) escaped the limit, and a task that allocated
3 GB under a 1 GB limit ran to completion.  Here the keepers' Dask worker
process watches its slot processes as the nanny watches it: every
``distributed.worker.memory.monitor-interval`` (100 ms) a thread adds the
worker's RSS (what the nanny counts) and each slot process's proportional set
size (PSS: forked slots share the template's pages, which RSS would count once
per slot; estimated between exact readings, see :func:`_run`), and when the
sum passes the same fraction of the same limit it SIGKILLs the biggest slot
process, as the nanny kills its worker, and marks it so that its keeper
reports ``cause="memory"`` with the sizes.

A slot process SIGKILLed by the kernel's OOM killer (a cgroup or the host
out of memory) is told apart by its memory cgroup's ``oom_kill`` counter
(cgroup v2 ``memory.events``, v1 ``memory.oom_control``), read as the slot
starts and again when it died by SIGKILL: a count that grew in between says
the OOM killer (of that cgroup: a process beside it killed in the same window
is counted too, so it says "probably").  Where no counter is readable (not
Linux, no cgroup mounted) a SIGKILL stays ``cause="signal"``.

:func:`death` turns what the keeper knows (exit status, these marks) into the
:class:`~fiber_dask.engine.poolprotocol.Death` it returns to the pool's owner.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import Any

from .poolprotocol import Death

__all__ = ["watch", "unwatch", "oom_kills", "death"]

logger = logging.getLogger(__name__)

#: Seconds between exact readings of every slot process's PSS (see _run);
#: every turn once the estimate passes _NEAR of the threshold.
EXACT_EVERY = 2.0
_NEAR = 0.8
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

_lock = threading.Lock()
_watched: dict[int, Any] = {}  # pid -> its keeper's _Fork
_monitor: threading.Thread | None = None


def limits_of(worker: Any) -> tuple | None:
    """``(memory_limit, terminate fraction, interval, own)`` for the slot
    processes of Dask ``worker`` (``own``: its RSS counts too), or None when
    it has no limit or ``distributed.worker.memory.terminate`` is off."""
    try:
        limit = worker.memory_manager.memory_limit
    except AttributeError:  # not a Dask worker
        return None
    return _limits(limit, own=True)


def early_limits() -> tuple | None:
    """The limits for the first pool's early slots (:mod:`fiber_dask.engine.
    earlyslots`), watched from the owner: each stands for a worker of the
    embedded cluster, and counts alone against that worker's
    ``fiber.local.memory-limit`` (distributed's ``"auto"``: this host's
    memory shared by its cores)."""
    import dask.utils

    from .. import config

    value = config.get("local.memory-limit")
    try:
        if value == "auto":
            import psutil

            cores = os.cpu_count() or 1
            threads = config.get("local.threads-per-worker") or 1
            limit = psutil.virtual_memory().total * min(1.0, threads / cores)
        elif isinstance(value, str):
            limit = dask.utils.parse_bytes(value)
        elif isinstance(value, float) and value <= 1:
            import psutil

            limit = psutil.virtual_memory().total * value
        else:
            limit = value
    except (ValueError, TypeError):
        return None
    return _limits(limit, own=False)


def _limits(limit: Any, own: bool) -> tuple | None:
    from .. import config
    from dask.utils import parse_timedelta

    try:
        fraction = config.distributed_setting("distributed.worker.memory.terminate")
        interval = parse_timedelta(
            config.distributed_setting("distributed.worker.memory.monitor-interval")
        )
    except (KeyError, ValueError, TypeError):
        return None
    if not limit or not fraction:
        return None
    return int(limit), float(fraction), float(interval or 0.1), own


def watch(fork: Any, limits: tuple) -> None:
    """Count ``fork``'s slot process (it has started: ``fork.pid``) against
    ``limits`` (:func:`limits_of`, :func:`early_limits`), from now until
    :func:`unwatch`."""
    fork.oom_file = _oom_file(fork.pid)
    fork.oom_kills = _oom_count(fork.oom_file)
    global _monitor
    with _lock:
        _watched[fork.pid] = fork
        if _monitor is None:
            _monitor = threading.Thread(
                target=_run, args=limits, name="fiber-slot-memory", daemon=True
            )
            _monitor.start()


def unwatch(fork: Any) -> None:
    with _lock:
        if _watched.get(fork.pid) is fork:
            del _watched[fork.pid]


def _run(limit: int, fraction: float, interval: float, own: bool) -> None:
    """The monitor thread: ends once no slot process is watched.  A process
    has one kind of slot processes (a worker's, or an owner's early ones),
    so the first one's limits are its limits.

    A slot process's PSS costs a walk of its memory map (``smaps_rollup``,
    ~200 us of CPU), its RSS a counter (``statm``, ~8 us): 128 slots read
    every 100 ms took a quarter of a core per worker process.  So each turn
    estimates each slot's PSS from its last exact one (:data:`EXACT_EVERY`
    seconds old at most) plus what its RSS grew by since (a task's new pages
    are its own: they add to both), and reads every PSS exactly only when
    that estimate passes :data:`_NEAR` of the threshold: then every turn,
    and nothing is ended on an estimate.  A page shared with the template
    that a slot writes to (copy-on-write) adds to its PSS and not its RSS:
    counted at the next exact reading, at most 2 s later, or at once near
    the limit."""
    global _monitor
    import psutil

    me = psutil.Process()
    threshold = int(limit * fraction)
    event = threading.Event()
    exact: dict[int, tuple[int, int]] = {}  # pid -> (pss, rss) when read
    exact_at = 0.0
    while True:
        with _lock:
            forks = list(_watched.items())
            if not forks:
                _monitor = None
                return
        used = 0
        if own:
            try:
                used = me.memory_info().rss
            except Exception:  # noqa: BLE001
                pass
        now = time.monotonic()
        fresh = now - exact_at >= EXACT_EVERY
        if fresh:
            exact = _read_exact(forks)
            exact_at = now
        estimate = used
        for pid, _ in forks:
            if pid not in exact:  # new since the last exact reading
                exact[pid] = _exact(pid)
            pss, rss = exact[pid]
            estimate += pss if fresh else pss + max(0, _rss(pid) - rss)
        if estimate > threshold * _NEAR:
            # Near the limit: every turn reads exactly, and decides on that
            # (copy-on-write growth, which the estimate misses, may be what
            # makes up the rest).
            if not fresh:
                exact = _read_exact(forks)
                exact_at = now
            sizes = [(exact[pid][0], pid, fork) for pid, fork in forks]
            used += sum(size for size, _, _ in sizes)
            if used > threshold:
                size, pid, fork = max(sizes, key=lambda s: s[0])
                with _lock:
                    mine = _watched.pop(pid, None) is fork
                if mine and fork.code is None:
                    fork.memory = (used, threshold, size, limit, fraction)
                    logger.warning(
                        "fiber-dask: a slot process (pid %d, %s) took its worker "
                        "over its memory limit (%s used, %s allowed): ending it",
                        pid, _size(size), _size(used), _size(threshold),
                    )  # fmt: skip
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except OSError:
                        pass
        event.wait(interval)


def _read_exact(forks: list) -> dict[int, tuple[int, int]]:
    return {pid: _exact(pid) for pid, _ in forks}


def _exact(pid: int) -> tuple[int, int]:
    """``(pss, rss)`` of ``pid`` now, the base its later estimates start from."""
    return _pss(pid), _rss(pid)


def _rss(pid: int) -> int:
    """Bytes of ``pid``'s resident set (``statm``: a counter, no walk); 0 when
    it is gone or cannot be read."""
    try:
        with open(f"/proc/{pid}/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        pass
    try:
        import psutil

        return psutil.Process(pid).memory_info().rss  # no /proc: not Linux
    except Exception:  # noqa: BLE001 - gone
        return 0


def _pss(pid: int) -> int:
    """Bytes of ``pid``'s proportional set size (its RSS where that cannot be
    read); 0 when it is gone."""
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
            for line in f:
                if line.startswith(b"Pss:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return _rss(pid)


def oom_kills(pid: int | None) -> int | None:
    """The OOM-kill count of ``pid``'s memory cgroup, or None if unreadable."""
    return _oom_count(_oom_file(pid))


def _oom_file(pid: int | None) -> str | None:
    """The file of ``pid``'s memory cgroup that counts its OOM kills."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # cgroup v2
            name = f"/sys/fs/cgroup{path.rstrip('/')}/memory.events"
        elif "memory" in controllers.split(","):  # v1
            name = f"/sys/fs/cgroup/memory{path.rstrip('/')}/memory.oom_control"
        else:
            continue
        if _oom_count(name) is not None:
            return name
    return None


def _oom_count(name: str | None) -> int | None:
    if name is None:
        return None
    try:
        with open(name) as f:
            for row in f:
                key, _, value = row.partition(" ")
                if key == "oom_kill":
                    return int(value)
    except (OSError, ValueError):
        pass
    return None


def death(fork: Any, address: str | None) -> Death:
    """Why ``fork``'s slot process died, from its exit status and marks."""
    code = fork.code
    memory = getattr(fork, "memory", None)
    sig = -code if code is not None and code < 0 else None
    exitcode = code if code is not None and code >= 0 else None
    if memory is not None:
        used, threshold, size, limit, fraction = memory
        return Death(
            "memory", sig, exitcode, address, fork.pid,
            used=used, limit=limit, fraction=fraction, size=size,
        )  # fmt: skip
    if sig == signal.SIGKILL:
        before = getattr(fork, "oom_kills", None)
        after = _oom_count(getattr(fork, "oom_file", None))
        if before is not None and after is not None and after > before:
            return Death("memory", sig, None, address, fork.pid, oom_killer=True)
    if sig is not None:
        return Death("signal", sig, None, address, fork.pid)
    return Death("exit", None, exitcode, address, fork.pid)


def _size(n: int) -> str:
    return f"{n / 2**20:.0f} MiB"
