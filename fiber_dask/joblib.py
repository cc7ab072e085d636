"""A joblib backend on fiber-dask's Pool engine: ``parallel_config(backend="fiber_dask")``.

Importing this module registers the backend with joblib (joblib 1.6 has no
plugin mechanism a package could use instead: its only lazily registered
backend, ``"dask"``, is hard-coded)::

    import joblib
    import fiber_dask.joblib  # noqa: F401  (registers "fiber_dask")

    with joblib.parallel_config(backend="fiber_dask"):
        scores = cross_val_score(estimator, X, y, n_jobs=-1)  # on the cluster

Batches of joblib calls run as calls of a
:class:`fiber_dask.futures.ProcessPoolExecutor`: over the direct channel to
long-running pool-worker loops, with no scheduler round trip per batch, and with
the Pool's worker-loss recovery.  ``n_jobs=-1`` (and the default, as with
joblib's ``"dask"`` backend) means the cluster's task slots,
``fiber_dask.cpu_count()``; ``n_jobs=-2`` one fewer, and so on.  ``n_jobs=1``
runs in the calling process, as joblib's ``"loky"`` backend does.

One executor per cluster is kept and reused by later ``Parallel`` calls
(joblib's loky backend reuses its executor the same way), so only the first
call pays for starting the pool; a call with another ``n_jobs`` replaces it.

Options, passed as ``parallel_config(backend="fiber_dask", client=..., ...)``:
``client``, ``address`` and ``resources`` mean what they mean for
:class:`fiber_dask.Pool`.  Unlike loky, arguments are not memory-mapped: large
arrays travel pickled with each batch.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import joblib
from joblib._parallel_backends import (
    AutoBatchingMixin,
    FallbackToBackend,
    ParallelBackendBase,
    SequentialBackend,
)

__all__ = ["FiberDaskBackend", "register"]

#: The name to give ``joblib.parallel_config(backend=...)``.
NAME = "fiber_dask"

_executors_lock = threading.Lock()
_executors: dict[tuple, Any] = {}


class FiberDaskBackend(AutoBatchingMixin, ParallelBackendBase):
    """joblib's backend interface over :class:`fiber_dask.futures.ProcessPoolExecutor`.

    Parameters
    ----------
    client : distributed.Client, optional
        Run on this client's cluster.
    address : str, optional
        Attach to the scheduler at this address.
    resources : dict, optional
        Dask worker resources each worker slot needs, e.g. ``{"GPU": 1}``.
    """

    supports_retrieve_callback = True
    supports_inner_max_num_threads = False
    # Choosing the cluster's backend means using the cluster: Parallel's n_jobs
    # default (None) becomes all of its slots, as with joblib's "dask" backend.
    default_n_jobs = -1

    def __init__(
        self,
        nesting_level: int | None = None,
        inner_max_num_threads: int | None = None,
        *,
        client: Any = None,
        address: str | None = None,
        resources: dict | None = None,
        **backend_kwargs: Any,
    ) -> None:
        super().__init__(
            nesting_level=nesting_level,
            inner_max_num_threads=inner_max_num_threads,
            **backend_kwargs,
        )
        self._options = {"client": client, "address": address, "resources": resources}
        self._executor: Any = None
        self._lock = threading.Lock()
        self._futures: set = set()  # this backend's batches not done yet

    def effective_n_jobs(self, n_jobs: int | None) -> int:
        """``n_jobs`` as a number of slots: negative counts back from the
        cluster's task slots (``-1``: all of them)."""
        if n_jobs == 0:
            raise ValueError("n_jobs == 0 in Parallel has no meaning")
        if n_jobs is None:
            return 1
        if n_jobs < 0:
            return max(self._cluster_slots() + 1 + n_jobs, 1)
        return n_jobs

    def _cluster_slots(self) -> int:
        from . import cluster

        handle = cluster.get_handle(
            client=self._options["client"], address=self._options["address"]
        )
        return cluster.task_slots(handle)

    def configure(
        self,
        n_jobs: int = 1,
        parallel: Any = None,
        prefer: str | None = None,
        require: str | None = None,
        **backend_kwargs: Any,
    ) -> int:
        """Bind the (shared) executor for ``n_jobs`` slots; returns ``n_jobs``."""
        n_jobs = self.effective_n_jobs(n_jobs)
        if n_jobs == 1:
            # As loky: one job runs in the caller, without shipping it.
            raise FallbackToBackend(SequentialBackend(nesting_level=self.nesting_level))
        self.parallel = parallel
        self._executor = _shared_executor(n_jobs, self._options)
        return n_jobs

    def submit(self, func: Callable, callback: Callable | None = None) -> Any:
        """Run one joblib batch; returns its :class:`concurrent.futures.Future`."""
        future = self._executor.submit(func)
        with self._lock:
            self._futures.add(future)
        future.add_done_callback(self._forget)
        if callback is not None:
            future.add_done_callback(callback)
        return future

    def _forget(self, future: Any) -> None:
        with self._lock:
            self._futures.discard(future)

    def retrieve_result_callback(self, future: Any) -> Any:
        """The batch's results (its exception, raised, if it failed)."""
        return future.result()

    def abort_everything(self, ensure_ready: bool = True) -> None:
        """A batch failed: cancel this call's batches not handed out yet.

        Batches already running finish on their own (their results are
        dropped).  The executor stays, for the next call: replacing it would
        hold twice the slots while the old one drains.
        """
        with self._lock:
            futures = list(self._futures)
            self._futures.clear()
        for future in futures:
            future.cancel()

    def terminate(self) -> None:
        """End of a ``Parallel`` call: keep the executor for the next one."""
        self._executor = None
        self.reset_batch_stats()

    def __reduce__(self):
        # Nested Parallel calls on a worker get a backend of their own (the
        # base class's choice); this one holds an executor and a lock.
        return FiberDaskBackend, ()


def _key(options: dict) -> tuple:
    resources = options["resources"]
    return (
        id(options["client"]) if options["client"] is not None else None,
        options["address"],
        tuple(sorted(resources.items())) if resources else None,
    )


def _shared_executor(n_jobs: int, options: dict) -> Any:
    """The one executor kept per cluster (and options), sized ``n_jobs``.

    One at a time: a pool holds its slots, so a second live executor would make
    fiber-dask grow its embedded cluster, and ``n_jobs=-1`` would then mean more
    slots on every call.  A call with another ``n_jobs`` replaces it.
    """
    from .futures import ProcessPoolExecutor

    key = _key(options)
    with _executors_lock:
        executor = _executors.get(key)
        if executor is not None and (
            executor._broken
            or executor._shutdown_thread
            or executor._max_workers != n_jobs
        ):
            executor.shutdown(wait=True)  # releases its slots first
            executor = None
        if executor is None:
            executor = ProcessPoolExecutor(n_jobs, **options)
            _executors[key] = executor
        return executor


def register() -> None:
    """Register the ``"fiber_dask"`` backend with joblib (done on import)."""
    joblib.register_parallel_backend(NAME, FiberDaskBackend)


register()
