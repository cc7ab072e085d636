"""The cluster layer: config → one connected ``distributed.Client`` per process.

Resolution, first match wins:

1. an explicit ``client=`` or ``address=`` argument;
2. ``fiber.backend`` in the config (YAML, ``DASK_FIBER__BACKEND``);
3. ``fiber.address``, then Dask's own ``scheduler-address``
   (``DASK_SCHEDULER_ADDRESS``) → the ``address`` backend;
4. inside a Dask worker, or with a default ``distributed.Client`` already
   running: that client;
5. the long-lived local cluster of ``fiber-dask up``, if one runs
   (:mod:`fiber_dask.backends.upcluster`);
6. a new embedded ``LocalCluster`` (the ``local`` backend), started lazily on
   first use and closed at interpreter exit.

A cluster fiber-dask did not start is never shut down by it.
"""

from __future__ import annotations

import atexit
import threading
from typing import Any

from . import config, mainguard
from .backends import ClusterHandle, load_backend
from .backends.address import configured_address
from .backends.upcluster import running_handle

__all__ = ["init", "shutdown", "get_handle", "get_client", "task_slots"]

_handle: ClusterHandle | None = None
_attached: dict[str, ClusterHandle] = {}
_lock = threading.RLock()


def init(
    backend: str | None = None,
    *,
    address: str | None = None,
    client: Any = None,
) -> Any:
    """Bind this process to a cluster now instead of on first use.

    Parameters
    ----------
    backend : str, optional
        A backend name (``local``, ``address``, ...); default from ``fiber.backend``.
    address : str, optional
        Scheduler address to attach to (implies the ``address`` backend).
    client : distributed.Client, optional
        Use this client; fiber-dask will not close it.

    Returns
    -------
    distributed.Client

    Examples
    --------
    >>> import fiber_dask
    >>> client = fiber_dask.init()            # doctest: +SKIP
    >>> client = fiber_dask.init(address="tcp://10.0.0.5:8786")  # doctest: +SKIP
    """
    global _handle
    with _lock:
        if _handle is not None:
            shutdown()
        _handle = _resolve(backend, address, client)
        return _handle.client


def shutdown() -> None:
    """Close what fiber-dask opened: its client, and the cluster if it started it.

    Also runs at interpreter exit.  Attached clusters keep running.
    """
    global _handle
    from . import channel

    with _lock:
        handles = list(_attached.values())
        if _handle is not None:
            handles.append(_handle)
        _handle = None
        _attached.clear()
    from .pool import _terminate_all_pools

    _terminate_all_pools()
    for h in handles:
        try:
            h.close()
        except Exception:  # pragma: no cover - best effort at exit
            pass
    channel.close_servers()


atexit.register(shutdown)


def get_handle(*, client: Any = None, address: str | None = None) -> ClusterHandle:
    """The cluster handle for an object created with these options."""
    global _handle
    if client is not None:
        return _handle_for_client(client)
    if address is not None:
        with _lock:
            h = _attached.get(address)
            if h is None:
                h = _attached[address] = _resolve(None, address, None)
            return h
    with _lock:
        if _handle is None:
            _handle = _resolve(None, None, None)
        return _handle


def get_client(**kwargs: Any) -> Any:
    """The ``distributed.Client`` fiber-dask uses, connecting it if needed.

    The cluster is resolved as for a Pool (see the module docstring); also
    ``fiber_dask.get_client()``.

    Parameters
    ----------
    **kwargs
        ``client=`` or ``address=``, as for :func:`get_handle`.

    Returns
    -------
    distributed.Client

    Examples
    --------
    >>> import fiber_dask
    >>> fiber_dask.get_client().dashboard_link  # doctest: +SKIP
    'http://127.0.0.1:8787/status'
    """
    return get_handle(**kwargs).client


def _handle_for_client(client: Any) -> ClusterHandle:
    from .backends.base import route_host

    host = config.get("listen-host") or route_host(client.scheduler.address)
    return ClusterHandle(client, None, owned=False, backend="client", listen_host=host)


def _resolve(backend: str | None, address: str | None, client: Any) -> ClusterHandle:
    if client is not None:
        return _handle_for_client(client)
    config.validate()
    if address is not None:
        return load_backend("address")().start(address=address)
    backend = backend or config.get("backend")
    if backend:
        return load_backend(backend)().start()
    if configured_address()[0]:
        return load_backend("address")().start()
    existing = _existing_client()
    if existing is not None:
        return _handle_for_client(existing)
    up = running_handle()  # the long-lived cluster of `fiber-dask up`, if any
    if up is not None:
        return up
    _check_not_bootstrapping()
    mainguard.check()  # `fiber-dask run` of a script without a __main__ guard
    return load_backend("local")().start()


def _existing_client() -> Any:
    """A client already running in this process: a worker's, or the default one."""
    from distributed import get_client as dask_get_client
    from distributed import get_worker

    try:
        get_worker()
    except ValueError:
        pass
    else:
        return dask_get_client()
    try:
        from distributed import default_client

        return default_client()
    except ValueError:
        return None


def _check_not_bootstrapping() -> None:
    """Refuse to start a cluster while a spawned process imports ``__main__``.

    Dask starts its worker processes with the ``spawn`` method, which re-imports
    the main script; a script without ``if __name__ == "__main__":`` would start
    a cluster from every worker.  This is the stdlib's own check and message.
    """
    from multiprocessing import process

    if getattr(process.current_process(), "_inheriting", False):
        raise RuntimeError(
            "An attempt has been made to start a fiber-dask cluster before the "
            "current process has finished its bootstrapping phase.\n\n"
            "Dask starts worker processes by importing your main module; protect "
            "the entry point of the program with:\n\n"
            "    if __name__ == '__main__':\n        main()\n"
        )


def task_slots(handle: ClusterHandle | None = None) -> int:
    """How many tasks the cluster runs at once (sum of worker threads).

    For a cluster fiber-dask started, at least what it was sized for (an
    adaptive cluster's maximum, not the minimum it runs while idle); for a
    still-starting cluster with no workers yet, the configured size.
    """
    import os

    handle = handle or get_handle()
    info = handle.client.scheduler_info(n_workers=-1)
    slots = sum(w.get("nthreads", 0) for w in info.get("workers", {}).values())
    if handle.owned and handle.planned_slots:
        # An adaptive cluster's maximum, not the workers it happens to have now.
        return max(slots, handle.planned_slots)
    if slots:
        return slots
    if handle.owned and handle.cluster is not None:
        n = len(getattr(handle.cluster, "worker_spec", {})) * (
            config.get("local.threads-per-worker") or 1
        )
        if n:
            return n
    return (
        config.get("adaptive.maximum")
        or config.get("local.n-workers")
        or os.cpu_count()
        or 1
    )


def ensure_slots(handle: ClusterHandle, n: int) -> None:
    """Grow a non-adaptive cluster fiber-dask started so ``n`` tasks fit at once.

    ``Pool(processes=N)`` means N tasks run at once; where fiber-dask manages the
    cluster it provides the slots, as the stdlib starts N processes.  Attached
    clusters are never resized.
    """
    cluster = handle.cluster
    if not handle.owned or cluster is None or config.get("adaptive.enabled"):
        return
    if handle.grow is not None:
        handle.grow(n)
        return
    per_worker = config.get("local.threads-per-worker") or 1
    want = -(-n // per_worker)
    if len(cluster.worker_spec) < want:
        cluster.scale(want)
