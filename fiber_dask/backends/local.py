"""The embedded default: a LocalCluster of worker processes on this machine."""

from __future__ import annotations

import contextlib
import os
from typing import Any

from .. import config
from .address import listen_host
from .base import Backend, ClusterHandle

__all__ = ["LocalBackend", "StartAbandoned"]


class StartAbandoned(Exception):
    """The embedded cluster's start was given up before the cluster was made
    (the program exited while it started in the background)."""


#: Dask timers the embedded cluster runs less often, as (key, Dask's default,
#: ours): only while the key is at Dask's default, so a value the user set
#: is kept.  They fire in every Dask server on the same cores as the pool's
#: tasks, and take the GIL from the pool's threads in the process they run in.
_TIMERS = (
    # The event-loop health check (a warning once a loop is blocked past
    # distributed.admin.tick.limit, 3 s) wakes the scheduler, each nanny and
    # each worker: 0.09 of a core for an idle 2-worker cluster at 20 ms, 0.04
    # at 200 ms (benchmarks/RESULTS.md, issue 12).
    ("distributed.admin.tick.interval", "20ms", "200ms"),
    # Every Dask server keeps a SystemMonitor (CPU, memory, open descriptors,
    # for the dashboard); the scheduler and the nannies all run in this
    # process, so each counts *our* descriptors, one per pool slot: with a
    # 1024-slot pool open, 9 monitors listing 1,000+ descriptors twice a
    # second took ~25 % of a core (issue 15).
    ("distributed.admin.system-monitor.interval", "500ms", "2s"),
    # Each worker's sampling profiler fires on its event loop even with no
    # task to sample (pool slots keep out of it: fiber_dask.engine.slottask): 8 idle
    # workers took 0.21 of a core at 10 ms, 0.04-0.06 at 100 ms (0.05 with
    # the profiler off; issue 15).  The dashboard's profile page still works,
    # at a tenth of the samples.
    ("distributed.worker.profile.interval", "10ms", "100ms"),
)


def _slower_timers() -> dict[str, str]:
    """The :data:`_TIMERS` settings to apply (those still at Dask's default)."""
    import dask

    return {
        key: ours for key, default, ours in _TIMERS if dask.config.get(key) == default
    }


class LocalBackend(Backend):
    """Start a ``distributed.LocalCluster`` of worker *processes*, one thread each.

    Like ``multiprocessing``, each task slot is its own OS process.  The
    scheduler and the fiber-dask channel listen on 127.0.0.1 only.
    """

    name = "local"

    def __init__(
        self,
        *,
        fork_server: Any = None,
        scheduler_port: int = 0,
        entering: Any = None,
    ) -> None:
        #: A worker fork server already started (the first pool's early slots
        #: start from it: fiber_dask.engine.earlyslots), the scheduler's port
        #: (0: a free one), and a callable asked, once distributed is
        #: imported, whether to go on and start the cluster (False: the start
        #: was given up, at the program's exit).
        self._fork_server = fork_server
        self._scheduler_port = scheduler_port
        self._entering = entering

    def start(self, *, address: str | None = None) -> ClusterHandle:
        # First, before distributed is imported here: the process the worker
        # processes are forked from imports it on the other core meanwhile
        # (fiber_dask.backends.workerstart; None = spawn them, Dask's way).
        from . import workerstart

        fork_server = self._fork_server or workerstart.start()
        try:
            return self._start(fork_server)
        except BaseException:
            if fork_server is not None:
                fork_server.stop()
            raise

    def _start(self, fork_server: Any) -> ClusterHandle:
        from ..transparency.interrupts import deferred

        with deferred():  # a first import of distributed is made whole
            from distributed import Client, LocalCluster

        if self._entering is not None and not self._entering():
            raise StartAbandoned("the embedded cluster's start was given up")

        n_workers = config.get("local.n-workers") or os.cpu_count() or 1
        threads = config.get("local.threads-per-worker")
        adaptive = config.get("adaptive.enabled")
        maximum = config.get("adaptive.maximum") or n_workers
        import dask

        extra = {}
        timers = _slower_timers()
        if timers:
            extra["config"] = timers  # the worker processes (and adaptive ones)
        early = contextlib.nullcontext()
        if config.get("pool.slots") == "process":
            # Each worker starts its pool-slot template process as it starts
            # (fiber_dask.engine.slots.dask_setup), while the cluster comes up, so the
            # first Pool slot does not wait ~0.5 s for an interpreter.
            preload = list(dask.config.get("distributed.worker.preload") or [])
            extra["preload"] = [*preload, "fiber_dask.engine.slots"]
            # Earlier still where the workers import fiber_dask with the main
            # module (fiber_dask.engine.slots.early_templates).
            from ..engine.slots import early_templates

            early = early_templates()
        # The scheduler reports the pools on its dashboard (fiber_dask.dashboard).
        from .. import dashboard
        from .base import scheduler_preloads

        show_dashboard = config.get("local.dashboard-address") is not None
        extra["scheduler_kwargs"] = {"preload": scheduler_preloads()}
        if show_dashboard:
            # Built by the first request for a page, not before the workers start.
            extra["scheduler_kwargs"] = dashboard.defer(extra["scheduler_kwargs"])
        # Always our nanny: its worker processes ignore a terminal's SIGINT
        # (workerstart._Process), forked by the server or started Dask's way.
        from .workerstart import nanny_class

        extra["worker_class"] = nanny_class(fork_server)
        with early, dask.config.set(timers):  # the scheduler and nannies
            cluster = LocalCluster(
                n_workers=0 if adaptive else n_workers,
                threads_per_worker=threads,
                processes=True,
                memory_limit=config.get("local.memory-limit"),
                dashboard_address=config.get("local.dashboard-address"),
                host="127.0.0.1",
                scheduler_port=self._scheduler_port,
                **extra,
            )
        try:
            if adaptive:
                cluster.adapt(
                    minimum=config.get("adaptive.minimum"),
                    maximum=maximum,
                    target_duration=config.get("adaptive.target-duration"),
                    interval=config.get("adaptive.interval"),
                    wait_count=config.get("adaptive.wait-count"),
                )
            client = Client(cluster, set_as_default=False)
            if extra["scheduler_kwargs"].get("dashboard") is False:
                dashboard.connect_on_request(cluster.scheduler)
        except BaseException:
            cluster.close()
            raise
        host = listen_host(cluster.scheduler_address)  # 127.0.0.1 unless configured
        # Pool() sizes itself for what the cluster is started with, or what
        # adaptive scaling may start, not for the workers already running.
        handle = ClusterHandle(
            client,
            cluster,
            owned=True,
            backend=self.name,
            listen_host=host,
            planned_slots=(maximum if adaptive else n_workers) * threads,
        )
        if fork_server is not None:
            handle.after_close.append(fork_server.stop)
        if not adaptive:
            handle.grow = _Grower(handle, cluster, threads)
        return handle


class _Grower:
    """``Pool(processes=N)`` on the fixed-size embedded cluster: add worker
    processes (never remove any) so that N tasks run at once, as the stdlib
    starts N processes."""

    def __init__(self, handle: ClusterHandle, cluster: Any, threads: int) -> None:
        self.handle, self.cluster, self.threads = handle, cluster, threads

    def __call__(self, slots: int) -> None:
        want = -(-slots // self.threads)
        have = len(self.cluster.worker_spec)
        if have < want:
            _check_capacity(want - have, slots, self.threads)
            self.cluster.scale(want)
            self.handle.planned_slots = want * self.threads


#: What one more embedded worker process costs this machine, with its slot
#: template (measured: a forked worker 19 MB of its own memory (USS), its
#: template 6 MB; 3-4 descriptors in the owner), and what each process slot
#: adds (a forked slot process: 1-5 MB; one connection to the owner).  Only
#: used to refuse pools that can never start, so they err on the low side.
_WORKER_BYTES = 20 * 2**20
_SLOT_BYTES = 1 * 2**20
_WORKER_FDS = 3
_SLOT_FDS = 1


def _check_capacity(new_workers: int, slots: int, threads: int) -> None:
    """Raise :class:`~fiber_dask.errors.ClusterCapacityError` if ``new_workers``
    more worker processes (for a pool of ``slots`` in all) cannot start here.

    ``Pool(10**6)`` used to start scaling at once and return after 42 s with
    the owner at 3.4 GB, and then never run a task; the stdlib fails with an
    OSError when it cannot fork.
    """
    import resource

    import psutil

    from ..errors import ClusterCapacityError

    process_slots = slots if config.get("pool.slots") == "process" else 0
    fix = (
        "Ask for fewer processes, give each worker process more slots "
        "(fiber.local.threads-per-worker), or attach to a bigger cluster "
        "(fiber.backend, scheduler-address)."
    )
    need = new_workers * _WORKER_BYTES + process_slots * _SLOT_BYTES
    available = psutil.virtual_memory().available
    if need > available:
        raise ClusterCapacityError(
            f"{slots} pool slots at once (this pool's and those in use) need "
            f"{new_workers} more worker processes on this machine (about {need / 2**30:.1f} GiB), more than its "
            f"{available / 2**30:.1f} GiB of available memory. {fix}"
        )
    procs = new_workers * 2 + process_slots  # worker, template; slot processes
    soft = resource.getrlimit(resource.RLIMIT_NPROC)[0]
    if soft != resource.RLIM_INFINITY and procs > soft:
        raise ClusterCapacityError(
            f"{slots} pool slots at once need {procs} more processes on this "
            f"machine, more than its limit of {soft} (ulimit -u). {fix}"
        )
    fds = new_workers * _WORKER_FDS + process_slots * _SLOT_FDS
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft != resource.RLIM_INFINITY and fds + psutil.Process().num_fds() > soft:
        raise ClusterCapacityError(
            f"{slots} pool slots at once need {fds} more file descriptors in "
            f"this process, beyond its limit of {soft} (ulimit -n). {fix}"
        )
