"""Lock, RLock, Semaphore, BoundedSemaphore and Event that work across the cluster.

Like a Queue, each lives in the process that created it (see ``objserver``);
other processes acquire and release it over the authenticated channel.  Beyond
the stdlib: what a process holds when it dies (its connection drops) cannot
deadlock everyone else.  An ``RLock`` of a dead holder is released at once (no
other process could release it).  A ``Lock`` or semaphore unit stays held, as in
the stdlib, so that it can still be handed off (a child acquires, the parent
releases), until some process waits for it (a blocking ``acquire``): a dead
holder's unit then goes to that waiter.

A ``Condition`` lives with its lock (its own ``RLock``, or the ``Lock`` or
``RLock`` it was given): waits and notifies go to that lock's owner.
"""

from __future__ import annotations

import os
import socket
import threading
import uuid
from multiprocessing import synchronize as _std_synchronize
from typing import Any

from .comm import lockstats
from .comm.lockstats import LockHolder
from .comm.objserver import ServedObject, get_object_server, keep_until_unused, resolve

__all__ = [
    "Lock",
    "RLock",
    "Semaphore",
    "BoundedSemaphore",
    "Event",
    "Condition",
    "Barrier",
    "LockHolder",
]

# The stdlib module's constants (its SemLock kinds and the semaphore limit).
RECURSIVE_MUTEX, SEMAPHORE = range(2)
SEM_VALUE_MAX = _std_synchronize.SEM_VALUE_MAX

_OWNER = "owner"  # session key of acquisitions made in the owning process


_HOST = socket.gethostname()


def _me() -> tuple:
    """Who holds an RLock: this thread of this process on this host."""
    return (_HOST, os.getpid(), threading.get_ident())


def _my_name() -> str:
    """The acquirer's process name, for :meth:`Semaphore.holders`."""
    from multiprocessing import current_process

    return current_process().name


class SemaphoreState(ServedObject):
    """A counting semaphore; ``maxvalue`` bounds releases, ``recursive`` makes
    it an RLock (owner-reentrant)."""

    def __init__(
        self,
        value: int,
        maxvalue: int | None,
        recursive: bool,
        kind: str = "Semaphore",
        site: str = "?",
    ) -> None:
        self.value = value
        self.maxvalue = maxvalue
        self.recursive = recursive
        self.kind = kind  # the class that made it, where held locks are listed
        self.site = site  # file:line of the user's code that made it
        self.oid = "?"  # its object id, once served
        self.conditions = 0  # Conditions made on it in this process
        self.cond = threading.Condition()
        # Who holds it (lockstats: lock.holders(), fiber-dask info).
        self.holders = lockstats.Holders()
        self.owner: tuple | None = None  # RLock: (host pid, thread) holding it
        self.count = 0  # RLock recursion depth
        self.holder: tuple | None = None  # Lock: who took it last (Condition)
        self.held: dict[Any, int] = {}  # session -> acquisitions not released
        # Units held by processes that died (see the module docstring), and how
        # many acquirers are waiting now.
        self.orphans = 0
        self.waiting = 0
        # Conditions built on this lock: condition id -> waiters' tickets
        self.waiters: dict[str, list[list[bool]]] = {}
        self.cond_counts: dict[str, list[int]] = {}  # cid -> [sleeping, woken]

    def acquire(
        self,
        block: bool,
        timeout: float | None,
        who: tuple,
        name: str | None = None,
        sid: Any = _OWNER,
    ) -> bool:
        with self.cond:
            if self.recursive and self.owner == who:
                self.count += 1
                return True
            if not block:
                timeout = 0
            if timeout is not None and timeout < 0:
                timeout = 0
            blocking = timeout is None or timeout > 0
            if self.value <= 0 and self.orphans and blocking:
                self.orphans -= 1  # a dead holder's unit goes to a waiter
                self.value += 1
                self.holders.drop_dead()
            self.waiting += blocking
            try:
                if not self.cond.wait_for(lambda: self.value > 0, timeout):
                    return False
            finally:
                self.waiting -= blocking
            self.value -= 1
            if self.recursive:
                self.owner, self.count = who, 1
            self.holder = who
            self.held[sid] = self.held.get(sid, 0) + 1
            first = not self.holders.entries
            self.holders.add(who, name, sid)
        if first:
            lockstats.held()  # outside self.cond: the reporter takes it after its own
        return True

    def release(self, who: tuple, sid: Any = _OWNER) -> None:
        with self.cond:
            if self.recursive:
                if self.owner != who:
                    raise AssertionError(
                        "attempt to release recursive lock not owned by thread"
                    )
                self.count -= 1
                if self.count:
                    return
                self.owner = None
                self.holders.drop(who=who)
            elif self.maxvalue is not None and self.value >= self.maxvalue:
                raise ValueError("semaphore or lock released too many times")
            else:
                self.holders.drop(session=sid)
            if not self._forget(sid) and self.orphans:
                self.orphans -= 1  # the hand-off of a unit its dead holder took
            self.holder = None
            self.value += 1
            # notify_all: a Condition shares this mutex with its waiters, whose
            # predicates differ; one notify could wake the wrong thread.
            self.cond.notify_all()

    def _forget(self, sid: Any) -> bool:
        # A Lock may be released by another process than the one that took
        # it: count the release against the releaser's acquisitions, or
        # else against anyone's living.  False: nobody living held it.
        if self.held.get(sid):
            key = sid
        else:
            key = next((k for k, n in self.held.items() if n), None)
        if key is not None:
            self.held[key] -= 1
        return key is not None

    def get_value(self) -> int:
        with self.cond:
            return self.value

    def get_maxvalue(self) -> int | None:
        return self.maxvalue

    def _held_by(self, who: tuple) -> bool:
        if self.recursive:
            return self.owner == who
        return self.value == 0 and self.holder == who

    def cond_wait(
        self,
        cid: str,
        timeout: float | None,
        who: tuple,
        name: str | None = None,
        sid: Any = _OWNER,
    ) -> bool:
        """Condition.wait on this lock: release it entirely (whatever its
        recursion depth), wait for a notify or the timeout, take it back."""
        try:
            return self._cond_wait(cid, timeout, who, name, sid)
        finally:
            lockstats.held()  # held again (outside self.cond, as in acquire)

    def _cond_wait(
        self, cid: str, timeout: float | None, who: tuple, name: Any, sid: Any
    ) -> bool:
        with self.cond:
            if not self._held_by(who):
                raise AssertionError("must acquire() condition before using wait()")
            count = self.count
            ticket = [False]
            self.waiters.setdefault(cid, []).append(ticket)
            counts = self.cond_counts.setdefault(cid, [0, 0])
            counts[0] += 1  # sleeping
            self.owner, self.count, self.holder = None, 0, None
            self._forget(sid)
            self.holders.drop(session=sid, who=who)
            self.value += 1
            self.cond.notify_all()
            notified = False
            try:
                notified = self.cond.wait_for(lambda: ticket[0], timeout)
            finally:
                # Also when interrupted (KeyboardInterrupt in the owner): the
                # caller leaves wait() holding the lock, as threading's does.
                if not ticket[0] and ticket in self.waiters.get(cid, ()):
                    self.waiters[cid].remove(ticket)
                counts[1] += 1  # woken
                self.cond.wait_for(lambda: self.value > 0)
                self.value -= 1
                if self.recursive:
                    self.owner, self.count = who, count
                self.holder = who
                self.held[sid] = self.held.get(sid, 0) + 1
                self.holders.add(who, name, sid)
            return notified

    def cond_info(self, cid: str) -> tuple[int, int, int]:
        """(waits begun, waits ended, notified waiters not yet woken) of a
        Condition: the stdlib's ``_sleeping_count``, ``_woken_count`` and
        ``_wait_semaphore`` values."""
        with self.cond:
            sleeping, woken = self.cond_counts.get(cid, (0, 0))
            waiting = len(self.waiters.get(cid, ()))
            return sleeping, woken, max(sleeping - woken - waiting, 0)

    def cond_notify(self, cid: str, n: int, who: tuple) -> None:
        with self.cond:
            if not self._held_by(who):
                raise AssertionError("lock is not owned")
            tickets = self.waiters.get(cid, [])
            for ticket in tickets[:n]:
                ticket[0] = True
            del tickets[:n]
            self.cond.notify_all()

    def is_mine(self, who: tuple) -> bool:
        with self.cond:
            return self.owner == who

    def get_holders(self) -> list[tuple]:
        """Who holds it now, the longest first: :class:`LockHolder` fields."""
        with self.cond:
            return self.holders.listed()

    def is_held(self) -> bool:
        with self.cond:
            return bool(self.holders.entries)

    def report(self) -> dict | None:
        """What lockstats sends to the scheduler while it is held, else None."""
        with self.cond:
            if not self.holders.entries:
                return None
            holders = self.holders.listed()
            waiting = self.waiting
            value = self.value
        kind = self.kind
        if self.conditions and kind in ("Lock", "RLock"):
            kind = f"Condition ({kind})"
        return {
            "id": self.oid,
            "kind": kind,
            "site": self.site,
            "value": value,
            "waiting": waiting,
            "holders": [
                lockstats.holder_dict(h) for h in holders[: lockstats.MAX_LISTED]
            ],
        }

    def serve(self, op: str, args: tuple, session: dict) -> Any:
        sid = session.setdefault("id", object())
        if op == "acquire":
            return self.acquire(*args, sid=sid)
        if op == "release":
            return self.release(*args, sid)
        if op == "cond_wait":
            return self.cond_wait(*args, sid=sid)
        if op in (
            "get_value",
            "is_mine",
            "cond_notify",
            "cond_info",
            "get_maxvalue",
            "get_holders",
        ):
            return getattr(self, op)(*args)
        raise ValueError(f"unknown semaphore operation {op!r}")

    def disconnected(self, session: dict) -> None:
        sid = session.get("id")
        with self.cond:
            n = self.held.pop(sid, 0)
            if n <= 0:
                return
            self.holders.gone(sid, release=self.recursive)
            if self.recursive:
                # Nobody else may release an RLock: free it now.
                self.owner, self.count, self.holder = None, 0, None
                self.value += n
                self.cond.notify_all()
                return
            # Kept for a hand-off; given to a waiter instead of a deadlock.
            self.orphans += n
            if self.waiting:
                given = min(self.waiting, self.orphans)
                self.orphans -= given
                self.value += given
                for _ in range(given):
                    self.holders.drop_dead()
                self.cond.notify_all()


class ServedHandle:
    """Common handle code: the state object itself in its owner, a Remote to
    it elsewhere.  ``_call(op, ...)`` is ``state.op(...)`` either way."""

    def _create(self, state: ServedObject) -> None:
        server = get_object_server()
        oid = server.add(state)
        if isinstance(state, SemaphoreState):
            state.oid = oid
            lockstats.watch(state)
        self._ref = (server.address, server.authkey, oid)
        self._target = state
        keep_until_unused(state, self, oid)

    def _extra_state(self) -> dict:
        """Handle attributes that travel with a pickled handle."""
        return {}

    def __reduce__(self):
        return (_rebuild, (type(self), self._ref, self._extra_state()))

    def _call(self, op: str, *args: Any) -> Any:
        return self._target.call(op, *args)


def _rebuild(cls: type, ref: tuple, extra: dict) -> Any:
    obj = cls.__new__(cls)
    obj.__dict__.update(extra)
    obj._ref = ref
    obj._target = resolve(*ref)
    return obj


class Semaphore(ServedHandle):
    """``multiprocessing.Semaphore`` usable from any process of the cluster."""

    _maxvalue_of_value = False
    _recursive = False

    def __init__(self, value: int = 1, *, ctx: Any = None) -> None:
        if value < 0:
            raise ValueError("semaphore initial value must be >= 0")
        self._create(
            SemaphoreState(
                value,
                value if self._maxvalue_of_value else None,
                self._recursive,
                type(self).__name__,
                lockstats.creation_site(),
            )
        )

    def acquire(self, block: bool = True, timeout: float | None = None) -> bool:
        """Take one unit; ``False`` if none came within ``timeout`` s."""
        return self._call("acquire", block, timeout, _me(), _my_name())

    def holders(self) -> list[LockHolder]:
        """Who holds it now, the longest first (beyond the stdlib).

        One :class:`~fiber_dask.comm.lockstats.LockHolder` per unit held: the
        holding process's name, pid, host and thread, since when (Unix time)
        and for how many seconds; ``alive`` False for a holder whose process
        has gone.  Empty when nobody holds it.  Asks the process that owns
        the lock (one round trip from another process).
        """
        return [LockHolder(*h) for h in self._call("get_holders")]

    def holder(self) -> LockHolder | None:
        """Who holds it (the longest holder of a semaphore), or None (beyond
        the stdlib); see :meth:`holders`."""
        held = self.holders()
        return held[0] if held else None

    def release(self) -> None:
        """Give one unit back (any process may)."""
        self._call("release", _me())

    def get_value(self) -> int:
        return self._call("get_value")

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def __repr__(self) -> str:
        try:
            value = self.get_value()
        except Exception:
            value = "unknown"
        return f"<{type(self).__name__}(value={value})>"


class BoundedSemaphore(Semaphore):
    """``multiprocessing.BoundedSemaphore``: releasing past the initial value is
    a ``ValueError``."""

    _maxvalue_of_value = True

    def __repr__(self) -> str:
        try:
            value = self.get_value()
        except Exception:
            value = "unknown"
        maxvalue = self._call("get_maxvalue")
        return f"<{type(self).__name__}(value={value}, maxvalue={maxvalue})>"


class Lock(Semaphore):
    """``multiprocessing.Lock``: any process may release it, as in the stdlib."""

    _maxvalue_of_value = True

    def __init__(self, *, ctx: Any = None) -> None:
        super().__init__(1, ctx=ctx)

    def __repr__(self) -> str:
        try:
            state = "unlocked" if self.get_value() else "locked"
        except Exception:
            state = "unknown"
        return f"<Lock({state})>"


class RLock(Semaphore):
    """``multiprocessing.RLock``: reentrant for the thread that holds it."""

    _recursive = True
    _maxvalue_of_value = True

    def __init__(self, *, ctx: Any = None) -> None:
        super().__init__(1, ctx=ctx)

    def _is_owned(self) -> bool:
        return self._call("is_mine", _me())


class _EventState(ServedObject):
    def __init__(self) -> None:
        self.flag = False
        self.cond = threading.Condition()

    def is_set(self) -> bool:
        with self.cond:
            return self.flag

    def set(self) -> None:
        with self.cond:
            self.flag = True
            self.cond.notify_all()

    def clear(self) -> None:
        with self.cond:
            self.flag = False

    def wait(self, timeout: float | None) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: self.flag, timeout)

    def serve(self, op: str, args: tuple, session: dict) -> Any:
        if op in ("is_set", "set", "clear", "wait"):
            return getattr(self, op)(*args)
        raise ValueError(f"unknown event operation {op!r}")


class Event(ServedHandle):
    """``multiprocessing.Event`` usable from any process of the cluster."""

    def __init__(self, *, ctx: Any = None) -> None:
        self._create(_EventState())

    def is_set(self) -> bool:
        return self._call("is_set")

    def set(self) -> None:
        self._call("set")

    def clear(self) -> None:
        self._call("clear")

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until set; returns the flag (False after a timeout)."""
        return self._call("wait", timeout)

    def __repr__(self) -> str:
        set_status = "set" if self.is_set() else "unset"
        return f"<{type(self).__qualname__} at {id(self):#x} {set_status}>"


class Condition:
    """``multiprocessing.Condition`` usable from any process of the cluster.

    It lives with its lock: ``Condition()`` makes an ``RLock``;
    ``Condition(lock)`` takes a fiber-dask ``Lock`` or ``RLock`` of yours, and
    waits and notifies go to the process that owns that lock.
    """

    def __init__(self, lock: Any = None, *, ctx: Any = None) -> None:
        if lock is None:
            lock = RLock(ctx=ctx)
        elif not isinstance(lock, Semaphore):
            raise TypeError(
                f"Condition(lock) needs a fiber_dask Lock or RLock, not "
                f"{type(lock).__name__}: a lock of another kind cannot be shared "
                "with processes on other hosts"
            )
        self._lock = lock
        self._cid = uuid.uuid4().hex
        target = getattr(lock, "_target", None)
        if isinstance(target, SemaphoreState):  # its lock is this process's
            with target.cond:
                target.conditions += 1

    def __reduce__(self):
        return (_rebuild_condition, (self._lock, self._cid))

    def holders(self) -> list[LockHolder]:
        """Who holds its lock (beyond the stdlib); see :meth:`Semaphore.holders`."""
        return self._lock.holders()

    def holder(self) -> LockHolder | None:
        """Who holds its lock, or None (beyond the stdlib)."""
        return self._lock.holder()

    def acquire(self, block: bool = True, timeout: float | None = None) -> bool:
        return self._lock.acquire(block, timeout)

    def release(self) -> None:
        self._lock.release()

    def __enter__(self) -> bool:
        return self._lock.acquire()

    def __exit__(self, *exc: Any) -> None:
        self._lock.release()

    def wait(self, timeout: float | None = None) -> bool:
        """Release the lock, wait for a notify (or ``timeout``), take it back."""
        return self._lock._call("cond_wait", self._cid, timeout, _me(), _my_name())

    def wait_for(self, predicate: Any, timeout: float | None = None) -> Any:
        import time

        end = None if timeout is None else time.monotonic() + timeout
        result = predicate()
        while not result:
            left = None if end is None else end - time.monotonic()
            if left is not None and left <= 0:
                break
            self.wait(left)
            result = predicate()
        return result

    def notify(self, n: int = 1) -> None:
        self._lock._call("cond_notify", self._cid, n, _me())

    def notify_all(self) -> None:
        self.notify(1 << 30)

    def __repr__(self) -> str:
        try:
            sleeping, woken, _ = self._info()
            waiters: Any = sleeping - woken
        except Exception:
            waiters = "unknown"
        return f"<Condition({self._lock!r}, {waiters})>"

    def _info(self) -> tuple[int, int, int]:
        return self._lock._call("cond_info", self._cid)

    # The stdlib's Condition is built of three semaphores that code (and
    # CPython's tests) read: waits begun, waits ended, wake-ups not yet taken.
    @property
    def _sleeping_count(self) -> _Count:
        return _Count(self, 0)

    @property
    def _woken_count(self) -> _Count:
        return _Count(self, 1)

    @property
    def _wait_semaphore(self) -> _Count:
        return _Count(self, 2)


class _Count:
    """One of a Condition's counts, read with ``get_value()`` like the
    stdlib's semaphore of the same name."""

    def __init__(self, cond: Condition, index: int) -> None:
        self._cond, self._index = cond, index

    def get_value(self) -> int:
        return self._cond._info()[self._index]


def _rebuild_condition(lock: Semaphore, cid: str) -> Condition:
    cond = Condition.__new__(Condition)
    cond._lock, cond._cid = lock, cid
    return cond


class _BarrierState(ServedObject):
    """A ``threading.Barrier`` in the owner; each remote waiter waits in the
    owner's thread serving its connection."""

    def __init__(self, parties: int, action: Any, timeout: float | None) -> None:
        self.barrier = threading.Barrier(parties, action, timeout)

    def wait(self, timeout: float | None) -> int:
        return self.barrier.wait(timeout)

    def abort(self) -> None:
        self.barrier.abort()

    def reset(self) -> None:
        self.barrier.reset()

    def info(self) -> tuple:
        b = self.barrier
        return b.parties, b.n_waiting, b.broken

    def serve(self, op: str, args: tuple, session: dict) -> Any:
        if op in ("wait", "abort", "reset", "info"):
            return getattr(self, op)(*args)
        raise ValueError(f"unknown barrier operation {op!r}")


class Barrier(ServedHandle):
    """``multiprocessing.Barrier`` usable from any process of the cluster.

    The ``action`` runs in the process that created the barrier (the stdlib
    runs it in one of the waiting processes) when the last party arrives.
    """

    def __init__(
        self,
        parties: int,
        action: Any = None,
        timeout: float | None = None,
        *,
        ctx: Any = None,
    ) -> None:
        self._create(_BarrierState(parties, action, timeout))

    def _info(self) -> tuple:
        return self._call("info")

    def wait(self, timeout: float | None = None) -> int:
        """Wait for all parties; returns this party's index (0..parties-1).

        ``threading.BrokenBarrierError`` if the barrier is, or becomes, broken.
        """
        return self._call("wait", timeout)

    def abort(self) -> None:
        self._call("abort")

    def reset(self) -> None:
        self._call("reset")

    @property
    def parties(self) -> int:
        return self._info()[0]

    @property
    def n_waiting(self) -> int:
        return self._info()[1]

    @property
    def broken(self) -> bool:
        return self._info()[2]

    def __repr__(self) -> str:
        parties, waiting, broken = self._info()
        return f"<Barrier(parties={parties}, n_waiting={waiting}, broken={broken})>"
