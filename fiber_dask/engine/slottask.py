"""The Dask task that holds a pool slot: :func:`run_pool_worker`.

The pool's owner submits one per slot (:meth:`fiber_dask.engine.poolloops.Loops.submit`).
With ``fiber.pool.slots: process`` (the default) the task is a *keeper* of a
slot process that runs the loop (:func:`fiber_dask.engine.slots.keep`); with
``thread`` the task's own thread runs it (:func:`fiber_dask.engine.poolworker.serve_slot`).
Its own module, so that neither the loop (:mod:`fiber_dask.engine.poolworker`, run in
slot processes) nor the template (:mod:`fiber_dask.engine.slotserver`) depends on the
keeper that starts them.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

from ..transparency import privaterandom
from .pooldrain import CLOSING
from .poolprotocol import Reason
from .poolworker import serve_slot
from .slots import keep

__all__ = ["run_pool_worker"]


def run_pool_worker(
    address: tuple[str, int],
    authkey: bytes,
    service: str,
    slot: int,
    init_blob: bytes | None,
    maxtasks: int | None,
    kill_after: float | None = None,
    slots: str | None = None,
    relay: bool = False,
) -> str:
    """Body of one pool-slot Dask task.  Returns why it ended.

    ``kill_after``: seconds after a terminate (or the owner's loss) at which a
    task that has not stopped ends this process; None never does.
    ``slots``: ``"process"`` (the task is a *keeper*: it holds the Dask slot
    while a slot process of its own runs the loop, see :mod:`fiber_dask.engine.slots`)
    or ``"thread"`` (this Dask task thread runs the loop); None reads
    ``fiber.pool.slots``.  ``relay``: a slot process reaches the owner through
    this worker process's relay (:mod:`fiber_dask.engine.slotrelay`) rather
    than a connection of its own.
    """
    try:
        from distributed import get_worker

        worker = get_worker()
    except (ImportError, ValueError):
        worker = None
    status = getattr(getattr(worker, "status", None), "name", None)
    if status in CLOSING:
        # Started on a worker that is closing (it was queued there): leave at
        # once, the pool starts another loop elsewhere (engine.pooldrain).
        return Reason.DRAINED
    if slots is None:
        from .. import config

        slots = config.get("pool.slots")
    if slots == "process":
        return keep(address, authkey, service, slot, init_blob, maxtasks, worker, relay)
    # The program's tasks run in this process, beside the worker's event loop,
    # whose draws must not move their random state.
    privaterandom.isolate_dask()
    with _unprofiled(worker):
        return serve_slot(
            address,
            authkey,
            service,
            slot,
            init_blob,
            maxtasks,
            kill_after,
            getattr(worker, "address", None),
        )


@contextlib.contextmanager
def _unprofiled(worker: Any) -> Iterator[None]:
    """Keep this thread out of the Dask worker's sampling profiler while it
    serves a slot.

    The profiler (``distributed.worker.profile``, every 10 ms) walks the stack
    of every thread running a task, in the worker's event loop: with a
    hundred thread slots per worker that is a hundred stacks every 10 ms,
    holding the GIL the slots' handshakes and tasks need (issue 15).  Slot
    processes never run in the worker, so this is for thread slots only.
    The worker removes the entry itself when the task ends: it is put back
    first.
    """
    threads = getattr(worker, "active_threads", None)
    lock = getattr(worker, "active_threads_lock", None)
    ident = threading.get_ident()
    if not isinstance(threads, dict) or lock is None:
        yield
        return
    with lock:
        key = threads.pop(ident, None)
    try:
        yield
    finally:
        if key is not None:
            with lock:
                threads[ident] = key
