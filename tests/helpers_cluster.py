"""Clusters for tests that need one of their own (not the session's embedded one)."""

from __future__ import annotations

from distributed import LocalCluster


def loopback_cluster(n_workers: int) -> LocalCluster:
    """A LocalCluster of worker processes, one thread each, on 127.0.0.1 only."""
    return LocalCluster(
        n_workers=n_workers,
        threads_per_worker=1,
        processes=True,
        dashboard_address=None,
        host="127.0.0.1",
    )


def runs_under(pid: int, worker_pids) -> bool:
    """Whether process ``pid`` is one of ``worker_pids`` or runs beneath one:
    a pool task runs in a slot process forked from its Dask worker's template
    process (``fiber.pool.slots: process``), or in the worker itself (thread)."""
    import psutil

    try:
        chain = [pid] + [p.pid for p in psutil.Process(pid).parents()]
    except psutil.NoSuchProcess:
        return False
    return any(p in set(worker_pids) for p in chain)
