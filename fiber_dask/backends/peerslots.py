"""Slot claims of processes attached to a cluster another process manages.

A Pool sizes the cluster fiber-dask started for it (``cluster.ensure_slots``),
as the stdlib starts N processes for ``Pool(N)``.  A Pool created in a process
that is only *attached* to that cluster — a ``Manager()`` server
(``manager.Pool()``), a ``Process`` child — used to count for nothing: on the
embedded cluster of 2 single-thread workers, a manager's ``Pool(4)`` ran 2 loops
and the next pool waited forever for a free slot.

Such a process tells the cluster's owner: the embedded cluster's scheduler runs
in the owner's process, so :func:`tell_owner` runs :func:`_peer_claim` there
(``Client.run_on_scheduler``), which adds the peer's claim to the owner's own
and grows the cluster as for a local pool.  A released claim is withdrawn; the
claims of a peer process that has ended are dropped (the embedded cluster is on
one host, so the owner can tell).  On any other scheduler (one fiber-dask did
not start, a remote one) :func:`_peer_claim` answers False and the process
stops asking.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import weakref
from typing import Any, Callable

logger = logging.getLogger(__name__)

#: Seconds a claim waits for the owner's answer (a Pool() is not held up longer).
_ASK_TIMEOUT = 5.0

_lock = threading.Lock()
_peer_slots: dict[tuple[int, int], int] = {}  # (pid, claim id) -> slots, in the owner
_not_an_owner: set[int] = set()  # id(handle) whose scheduler said no, in peers
_claim_numbers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_numbers = itertools.count()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


#: The owner side, handed in by :mod:`fiber_dask.cluster` (the layer that owns
#: cluster sizing; this module does not import it): ``owns(dask_scheduler)``
#: is whether this process started that scheduler's cluster, ``grow(peers)``
#: sizes it for its own pools plus ``peers`` slots.
_owner_side: tuple[Callable[[Any], bool], Callable[[int], None]] | None = None


def serve_owner_side(owns: Callable[[Any], bool], grow: Callable[[int], None]) -> None:
    """Called once by :mod:`fiber_dask.cluster`; see :data:`_owner_side`."""
    global _owner_side
    _owner_side = (owns, grow)


def _peer_claim(key: tuple[int, int], n: int, dask_scheduler: Any = None) -> bool:
    """In the owner (on the scheduler's event loop): record ``n`` slots for
    ``key`` (0 withdraws it) and grow the cluster for all claims at once.
    False if this process does not own the cluster of ``dask_scheduler``."""
    if _owner_side is None:
        return False
    owns, grow = _owner_side
    if not owns(dask_scheduler):
        return False
    with _lock:
        if n:
            _peer_slots[tuple(key)] = n
        else:
            _peer_slots.pop(tuple(key), None)
        for k in [k for k in _peer_slots if not _alive(k[0])]:
            del _peer_slots[k]
        peers = sum(_peer_slots.values())
    if n:
        grow(peers)  # non-blocking: SpecCluster.scale only schedules the workers
    return True


def peer_slots() -> int:
    """Slots attached processes claim on this process's cluster (in the owner)."""
    with _lock:
        return sum(_peer_slots.values())


def tell_owner(handle: Any, claim: Any, n: int) -> None:
    """From an attached process: claim ``n`` slots of ``claim`` with the
    cluster's owner (0: release them).  A release does not wait for the answer
    (it may run in ``__del__`` or at exit)."""
    if handle.owned or id(handle) in _not_an_owner:
        return
    with _lock:
        number = _claim_numbers.setdefault(claim, next(_numbers))
    key = (os.getpid(), number)
    client = handle.client
    if getattr(client, "status", None) != "running":
        return
    if not n:
        threading.Thread(
            target=_ask, args=(handle, key, 0), name="fiber-slot-release", daemon=True
        ).start()
        return
    _ask(handle, key, n)


def _ask(handle: Any, key: tuple[int, int], n: int) -> None:
    client = handle.client
    try:
        ok = client.sync(
            client._run_on_scheduler,
            _peer_claim,
            key,
            n,
            callback_timeout=_ASK_TIMEOUT,
        )
    except Exception as e:  # a scheduler without fiber_dask, a timeout, closing
        logger.debug("fiber-dask: cannot tell the cluster's owner of a claim: %r", e)
        ok = False
    if not ok and n:
        _not_an_owner.add(id(handle))
