"""Clusters for tests that need one of their own (not the session's embedded one)."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator

from distributed import Client, LocalCluster

from fiber_dask.comm.ports import PortReservation


def loopback_cluster(n_workers: int, **kwargs) -> LocalCluster:
    """A LocalCluster of worker processes, one thread each, on 127.0.0.1 only
    (``kwargs``: more of LocalCluster's, e.g. ``memory_limit``)."""
    return LocalCluster(
        n_workers=n_workers,
        threads_per_worker=1,
        processes=True,
        dashboard_address=None,
        host="127.0.0.1",
        **kwargs,
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


@contextlib.contextmanager
def command_line_cluster(
    env: dict, nthreads: int = 2
) -> Iterator[tuple[str, subprocess.Popen, subprocess.Popen]]:
    """A cluster started as users start one by hand: ``dask scheduler`` and
    one ``dask worker`` (with its nanny) on 127.0.0.1, in ``env``.  Yields
    ``(address, scheduler, worker)`` once the worker has joined; stops both
    at the end (killed if they have not exited 30 s after SIGTERM, or
    already killed by the test)."""
    # Held until the scheduler listens there (it binds it all the same:
    # fiber_dask.comm.ports), so that no other socket takes it first.
    reserved = PortReservation("127.0.0.1")
    port = reserved.port
    address = f"tcp://127.0.0.1:{port}"
    quiet = subprocess.DEVNULL
    scheduler = subprocess.Popen(
        [sys.executable, "-m", "distributed.cli.dask_scheduler", "--host",
         "127.0.0.1", "--port", str(port), "--no-dashboard"],
        env=env, stdout=quiet, stderr=quiet,
    )  # fmt: skip
    worker = subprocess.Popen(
        [sys.executable, "-m", "distributed.cli.dask_worker", address,
         "--nthreads", str(nthreads), "--nworkers", "1", "--no-dashboard",
         "--host", "127.0.0.1"],
        env=env, stdout=quiet, stderr=quiet,
    )  # fmt: skip
    try:
        with Client(address, timeout=60, set_as_default=False) as c:
            reserved.release()  # the scheduler listens there
            c.wait_for_workers(1, timeout=60)
        yield address, scheduler, worker
    finally:
        reserved.release()
        for p in (worker, scheduler):
            p.terminate()
        for p in (worker, scheduler):
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
