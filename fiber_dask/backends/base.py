"""The backend interface and the handle the cluster layer keeps."""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

from .. import config
from ..errors import ClusterConnectionError

__all__ = ["Backend", "ClusterHandle", "connect", "last_event"]


@dataclass
class ClusterHandle:
    """A connected client and what fiber-dask knows about where it came from.

    ``owned`` is True only for clusters fiber-dask started itself: those, and
    only those, are shut down by :func:`fiber_dask.shutdown`.
    """

    client: Any
    cluster: Any = None
    owned: bool = False
    backend: str = "address"
    #: The interface this process's endpoints listen on for this cluster
    #: (:func:`fiber_dask.backends.address.listen_host`); the cluster layer
    #: fills it in if a backend leaves it None.
    listen_host: str | None = None
    #: Task slots the backend sized the cluster for (its fixed size, or the
    #: adaptive maximum), known before any worker has joined; None if unknown.
    planned_slots: int | None = None
    #: For owned clusters of a fixed size: called with the number of task slots
    #: needed at once, grows the cluster if it is smaller (and raises
    #: ``planned_slots`` to match).
    grow: Callable[[int], None] | None = None
    #: For batch-job clusters (dask-jobqueue): lists the jobs, one dict each
    #: (``name``, ``id``, ``state``, ``workers``), for ``fiber-dask info``.
    jobs: Callable[[], list[dict[str, Any]]] | None = None
    #: Called, in order, once :meth:`close` has closed the cluster (each must
    #: return within a deadline of its own), e.g. to reap a helper process.
    after_close: list[Callable[[], None]] = field(default_factory=list)

    def close(self, timeout: float | None = None) -> None:
        """Close what fiber-dask opened; ``timeout`` bounds each close (at
        exit nothing may wait without a deadline, also for a lost scheduler)."""
        kw = {} if timeout is None else {"timeout": timeout}
        if self.owned:
            try:
                self.client.close(**kw)
            finally:
                try:
                    if self.cluster is not None:
                        _close_workers_first(self.cluster, timeout)
                        try:
                            self.cluster.close(**kw)
                        except TypeError:  # a cluster class without timeout=
                            self.cluster.close()
                finally:
                    for fn in self.after_close:
                        fn()
        # A client we attached to a cluster we did not start is left open for
        # its owner; a client we created ourselves is closed without touching
        # the scheduler.
        elif getattr(self.client, "_fiber_created", False):
            self.client.close(**kw)


def _close_workers_first(cluster: Any, timeout: float | None) -> None:
    """Stop a ``LocalCluster``'s workers while its scheduler still runs.

    Closing the cluster at once closes the scheduler first, and a worker whose
    heartbeat is in flight then logs a traceback on its way out (noise on
    the stderr of every script that exits)."""
    import time

    from distributed import LocalCluster

    if not isinstance(cluster, LocalCluster) or not cluster.workers:
        return
    deadline = time.monotonic() + (timeout or 10) / 2
    try:
        cluster.scale(0)
        while cluster.workers and time.monotonic() < deadline:
            time.sleep(0.02)
    except Exception:  # the cluster is closed next in any case
        pass


class Backend(abc.ABC):
    """Base class of a backend: subclasses set ``name`` and implement ``start``.

    What the cluster layer needs from a cluster is in the handle ``start``
    returns, not read from the backend's config by the cluster layer: its
    listen host (decide it with :func:`fiber_dask.backends.address.listen_host`),
    and for a cluster the backend started (``owned``) the task slots it is sized
    for (``planned_slots``) and, unless it scales adaptively, a ``grow`` hook
    that ``Pool(processes=N)`` calls so that N tasks fit at once.
    """

    name: ClassVar[str] = ""

    @abc.abstractmethod
    def start(self, *, address: str | None = None) -> ClusterHandle:
        """Start or attach to a cluster and return a connected handle."""


def connect(target: Any, failure: Callable[[float, Exception], str]) -> Any:
    """A ``distributed.Client`` of ``target`` (an address or a cluster), made by us.

    Waits at most ``fiber.connect-timeout``; a connection that fails raises
    ``ClusterConnectionError(failure(timeout, error))``.  The client is marked as
    fiber-dask's own, so that :meth:`ClusterHandle.close` closes it.
    """
    from ..transparency.interrupts import deferred

    with deferred():  # a first import of distributed is made whole
        from distributed import Client

    timeout = config.timedelta("connect-timeout")
    try:
        client = Client(target, set_as_default=False, timeout=timeout)
    except (OSError, TimeoutError) as e:
        raise ClusterConnectionError(failure(timeout, e)) from e
    client._fiber_created = True
    return client


#: The scheduler plugin that shows pools on the dashboard (its page, its JSON).
DASHBOARD_PRELOAD = "fiber_dask.dashboard"


def scheduler_preloads(configured: str | list[str] | None = None) -> list[str]:
    """The scheduler preloads of a cluster fiber-dask starts: ``configured``
    (as distributed's ``Scheduler(preload=)``: None means the
    ``distributed.scheduler.preload`` config) plus :data:`DASHBOARD_PRELOAD`.

    Named, not imported: a backend starts the scheduler; the dashboard module
    (above the cluster layer) is imported by the scheduler, not by the backend.
    """
    if configured is None:
        import dask

        configured = dask.config.get("distributed.scheduler.preload", None) or []
    configured = [configured] if isinstance(configured, str) else list(configured)
    extra = [] if DASHBOARD_PRELOAD in configured else [DASHBOARD_PRELOAD]
    return [*configured, *extra]


def last_event(events: Any, *actions: str) -> dict | None:
    """The last of a worker's scheduler events (what
    ``scheduler.events(topic=address)`` returns: ``(time, msg)`` pairs) whose
    ``msg`` is a dict with one of ``actions`` (``"remove-worker"``,
    ``"worker-status-change"``), or None.  The one reader of that record for
    the pool's causes, its drain and the batch jobs' watcher."""
    for _, msg in reversed(list(events or ())):
        if isinstance(msg, dict) and msg.get("action") in actions:
            return msg
    return None
