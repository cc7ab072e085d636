"""Per-task time limits, the loop's half (billiard's soft and hard limits).

A pool made with ``soft_time_limit`` / ``time_limit`` (or the keys
``fiber.pool.soft-time-limit`` / ``fiber.pool.time-limit``) sends both limits
with every chunk (``Call.limits``).  The loop arms them around each call of the
task function (each item, each retry) with a :class:`Limiter`::

    owner (PoolEngine)                    slot process (one loop, main thread)
    ──────────────────                    ────────────────────────────────────
                       ◄─ Running(ckey, offset) ─  item starts: soft timer on the
    deadline = now + time_limit                    watcher thread, the hard
                                                   backstop on a kernel timer
                                                   soft expires: SIGRTMIN+4 to
                                                   the main thread, whose handler
                                                   raises SoftTimeLimitExceeded
                                                   in the task
    deadline passed, no Result:
      the chunk fails with TimeLimitExceeded,
      the loop is told ───── Expire(ckey, offset) ─►  receiver thread: write
                                                   "time-limit" as the slot's
                                                   reason, SIGKILL this process
                                                   (if it has moved past chunk
                                                   ckey: finish the chunk it
                                                   runs, answer, and leave)
    the link drops: the chunks it still held       the template forks a successor
      go again (never started; not counted)        with the same spec (as after
                                                   maxtasksperchild), which
                                                   attaches as the same loop

Why the owner decides the hard limit (not the slot process alone): the owner
is the one that must know *which* item hit it, so as to fail exactly that item
and not re-run it, whereas a lost worker's item is re-run.  A slot process that
killed itself at its own deadline would look to the owner like any crash.  The
owner's deadline runs from the ``Running`` it received, so it is never earlier
than the slot's own clock; the item gets at least its limit.

Why a kernel backstop: ``Expire`` is handled on the link's receiver thread,
which needs the GIL; a task stuck in C code that holds the GIL (rare: most
blocking calls release it) would never let it run.  A POSIX timer
(``timer_create``, Linux) armed for :data:`HARD_GRACE` seconds past the limit
delivers SIGKILL from the kernel in that case; the owner has already failed the
item by then.  Without ``timer_create`` there is no backstop (documented).

Soft limit: the watcher thread (one per process, a heap of deadlines) sends
:data:`SOFT_SIGNAL` to the main thread of a slot process, so a task blocked in
``time.sleep`` or a system call is interrupted too (``EINTR``, then the
handler); a task in C code that holds the GIL sees it when that call returns,
as with any Python signal handler.  In a *thread* slot it raises the exception
asynchronously in the slot's thread (``PyThreadState_SetAsyncExc``), which
interrupts Python code only: a task blocked in C (``sleep``, I/O) sees it once
that call returns.  A thread cannot be killed, so a pool with thread slots
refuses a hard limit (:func:`check_slots`).
"""

from __future__ import annotations

import ctypes
import heapq
import itertools
import os
import signal
import sys
import threading
import time
from typing import Any, Callable

from ..errors import SoftTimeLimitExceeded
from ..transparency import interrupts

__all__ = [
    "SOFT_SIGNAL",
    "HARD_GRACE",
    "Limiter",
    "resolve",
    "check_slots",
    "slot_process",
    "expire",
    "soft_message",
]

#: The signal a soft limit sends a slot process's main thread: a real-time
#: signal, which no library uses by default and which queues (billiard uses
#: SIGUSR1, which programs do use).
SOFT_SIGNAL = signal.SIGRTMIN + 4 if hasattr(signal, "SIGRTMIN") else None

#: Seconds past the hard limit at which the kernel's backstop timer kills a
#: slot process whose task holds the GIL (the owner's ``Expire`` could not be
#: handled).  Long next to the owner's round trip, so that the owner, which
#: must know which item hit the limit, has decided first.
HARD_GRACE = 2.0

_set_async_exc = ctypes.pythonapi.PyThreadState_SetAsyncExc


# ------------------------------------------------------------- the limits


def resolve(
    time_limit: Any, soft_time_limit: Any, slot_kind: str
) -> tuple[float | None, float | None]:
    """``(soft, hard)`` seconds from the arguments or, where they are None,
    ``fiber.pool.soft-time-limit`` / ``fiber.pool.time-limit``; None: no limit.

    Raises ``ValueError`` for a limit that is not a positive duration, and for
    a hard limit with thread slots (:func:`check_slots`).
    """
    hard = _seconds(time_limit, "time_limit", "time-limit")
    soft = _seconds(soft_time_limit, "soft_time_limit", "soft-time-limit")
    check_slots(hard, slot_kind)
    return soft, hard


def _seconds(value: Any, argument: str, key: str) -> float | None:
    from .. import config

    source = f"Pool({argument}=...)"
    if value is None:
        value = config.get(f"pool.{key}")
        source = f"fiber.pool.{key}"
    if value is None:
        return None
    from dask.utils import parse_timedelta

    try:
        if isinstance(value, bool):
            raise TypeError
        seconds = parse_timedelta(value, default="seconds")
    except (ValueError, KeyError, TypeError, IndexError):
        seconds = None
    if seconds is None or not seconds > 0:
        raise ValueError(
            f"{source} = {value!r}: a time limit must be a positive number of "
            "seconds or a duration such as '30s' or '5m' (None: no limit)"
        )
    return float(seconds)


def check_slots(hard: float | None, slot_kind: str) -> None:
    """A hard limit needs process slots: a thread cannot be killed."""
    if hard is not None and slot_kind == "thread":
        raise ValueError(
            f"a hard time limit ({hard:g}s, Pool(time_limit=...) or "
            "fiber.pool.time-limit) needs fiber.pool.slots=process: with thread "
            "slots the task runs in a Dask worker's thread, which cannot be killed. "
            "Use process slots, or only soft_time_limit "
            "(fiber.pool.soft-time-limit), which thread slots raise in the task."
        )


def soft_message(soft: float) -> str:
    return (
        f"the task ran past its soft time limit of {soft:g}s "
        "(Pool(soft_time_limit=...) or fiber.pool.soft-time-limit); catch "
        "fiber_dask.errors.SoftTimeLimitExceeded in the task to clean up"
    )


# -------------------------------------------------------- the slot process

#: Set in a slot process (:func:`slot_process`): the pipe its reason goes to.
_reason_fd: int | None = None


def slot_process(reason_fd: int) -> None:
    """This process is a slot process whose reason pipe is ``reason_fd``
    (called by :mod:`fiber_dask.engine.slotserver` before it serves): a hard
    limit may end it."""
    global _reason_fd
    _reason_fd = reason_fd


def expire() -> None:
    """The owner says the running item passed its hard limit (on the link's
    receiver thread): end this slot process now, saying why first, so that
    its template forks a successor at once.  Only in a slot process."""
    fd = _reason_fd
    if fd is None:
        return  # a thread slot: never sent one (no hard limit there)
    from .poolprotocol import Reason

    try:
        os.write(fd, Reason.EXPIRED.encode())
    except OSError:
        pass
    os.kill(os.getpid(), signal.SIGKILL)


# ----------------------------------------------------------- the watcher


class _Watcher:
    """One thread per process that fires the soft limits: a heap of
    ``(deadline, seq, limiter, token)``; an entry whose limiter moved on
    (another token) is dropped when it comes up."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._heap: list = []
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None
        self._prune_at = 1024

    def arm(self, deadline: float, limiter: Limiter, token: int) -> None:
        with self._cond:
            heap = self._heap
            heapq.heappush(heap, (deadline, next(self._seq), limiter, token))
            if len(heap) > self._prune_at:
                # Many quick items under a long limit: each left an entry
                # that would wait for its deadline to be dropped.  Keep the
                # live ones (one per loop at most), in place (_run holds it).
                heap[:] = [e for e in heap if e[2].token == e[3]]
                heapq.heapify(heap)
                self._prune_at = max(1024, 2 * len(heap))
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="fiber-time-limits", daemon=True
                )
                interrupts.start_helper(self._thread)
            elif self._heap[0][2] is limiter and self._heap[0][3] == token:
                self._cond.notify()

    def _run(self) -> None:
        heap = self._heap
        while True:
            with self._cond:
                while True:
                    # Drop what is stale: a finished item's entry at the top.
                    while heap and heap[0][2].token != heap[0][3]:
                        heapq.heappop(heap)
                    if heap:
                        wait = heap[0][0] - time.monotonic()
                        if wait <= 0:
                            _, _, limiter, token = heapq.heappop(heap)
                            break
                        self._cond.wait(wait)
                    else:
                        self._cond.wait()
            limiter._fire(token)


_watcher = _Watcher()


# ---------------------------------------------------------- the timer


class _KernelTimer:
    """A POSIX timer that SIGKILLs this process (``timer_create``, Linux):
    the hard limit's backstop.  Not inherited by a task's forked children."""

    def __init__(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)

        class Sigevent(ctypes.Structure):
            _fields_ = [
                ("value", ctypes.c_void_p),
                ("signo", ctypes.c_int),
                ("notify", ctypes.c_int),  # SIGEV_SIGNAL: 0
                ("pad", ctypes.c_int * 12),
            ]

        class Timespec(ctypes.Structure):
            _fields_ = [("sec", ctypes.c_long), ("nsec", ctypes.c_long)]

        class Itimerspec(ctypes.Structure):
            _fields_ = [("interval", Timespec), ("value", Timespec)]

        self._spec, self._ts = Itimerspec, Timespec
        self._settime = libc.timer_settime
        self._id = ctypes.c_void_p()
        event = Sigevent(None, signal.SIGKILL, 0)
        clock = getattr(time, "CLOCK_MONOTONIC", 1)
        if libc.timer_create(clock, ctypes.byref(event), ctypes.byref(self._id)):
            raise OSError(ctypes.get_errno(), "timer_create failed")

    def set(self, seconds: float) -> None:
        """Fire in ``seconds`` (0: disarm)."""
        whole = int(seconds)
        value = self._ts(whole, int((seconds - whole) * 1e9))
        spec = self._spec(self._ts(0, 0), value)
        self._settime(self._id, 0, ctypes.byref(spec), None)


_kernel_timer: _KernelTimer | None | bool = None  # False: none on this platform


def _backstop() -> _KernelTimer | None:
    global _kernel_timer
    if _kernel_timer is None:
        try:
            if not sys.platform.startswith("linux"):
                raise OSError("no timer_create")
            _kernel_timer = _KernelTimer()
        except (OSError, AttributeError):
            _kernel_timer = False
    return _kernel_timer or None


# ---------------------------------------------------------- the limiter


#: The limiter of this slot process's main thread: its signal handler's.
_main_limiter: Limiter | None = None


def _on_soft_signal(signum: int, frame: Any) -> None:
    limiter = _main_limiter
    # Only for the item it was sent for: one sent just as its item ended
    # may be handled after the next item started (a new token).
    if limiter is not None and limiter.armed and limiter.fired == limiter.token:
        limiter.armed = False  # once per item
        raise SoftTimeLimitExceeded(soft_message(limiter.soft))


class Limiter:
    """Arms and disarms one loop's limits around each call of its task.

    ``in_main``: the loop runs in a slot process's main thread (soft: a
    signal; hard: the kernel backstop); else in a thread slot (soft: an
    asynchronous exception; no hard limit).  ``may_withdraw()``: whether a
    pending asynchronous exception may be withdrawn (not when the loop's
    TERMINATE may have set its own since).
    """

    def __init__(self, in_main: bool, may_withdraw: Callable[[], bool]) -> None:
        self.in_main = in_main
        self.ident = threading.get_ident()
        self._thread = ctypes.c_ulong(self.ident)
        self._lock = threading.Lock()
        self._may_withdraw = may_withdraw
        self.token = 0
        self.armed = False
        #: The token of the item whose soft limit fired (0: none).
        self.fired = 0
        self.soft = 0.0
        self._backstop: _KernelTimer | None = None
        self._handler = False

    def start(self, limits: tuple) -> None:
        """An item starts: arm ``limits`` (``(soft, hard)`` seconds or None)."""
        soft, hard = limits
        with self._lock:
            self.token += 1
            self.armed = soft is not None
            self.soft = soft or 0.0
        if soft is not None:
            if self.in_main and not self._handler:
                global _main_limiter
                _main_limiter = self
                signal.signal(SOFT_SIGNAL, _on_soft_signal)
                self._handler = True
            _watcher.arm(time.monotonic() + soft, self, self.token)
        if hard is not None and self.in_main:
            self._backstop = _backstop()
            if self._backstop is not None:
                self._backstop.set(hard + HARD_GRACE)

    def stop(self) -> None:
        """The item is done: nothing may fire for it any more.  May be
        interrupted by the item's own soft limit (the caller calls it again
        until it returns); safe to call twice."""
        with self._lock:
            self.armed = False
            self.token += 1  # its watcher entry is stale now
            fired, self.fired = self.fired, 0
            if fired and not self.in_main and self._may_withdraw():
                _set_async_exc(self._thread, None)  # not raised yet: withdrawn
        if self._backstop is not None:
            self._backstop.set(0)

    def _fire(self, token: int) -> None:
        """On the watcher thread: the soft limit of item ``token`` expired."""
        with self._lock:
            if token != self.token or not self.armed:
                return
            self.fired = token
            if self.in_main:
                signal.pthread_kill(self.ident, SOFT_SIGNAL)
            else:
                self.armed = False
                _set_async_exc(
                    self._thread,
                    ctypes.py_object(_SoftInThread.make(self.soft)),
                )


class _SoftInThread:
    """``PyThreadState_SetAsyncExc`` raises a class (called without
    arguments): a subclass per limit carries the message."""

    _made: dict[float, type] = {}

    @classmethod
    def make(cls, soft: float) -> type:
        kind = cls._made.get(soft)
        if kind is None:
            message = soft_message(soft)

            def __init__(self, *args: Any) -> None:
                SoftTimeLimitExceeded.__init__(self, *(args or (message,)))

            def __reduce__(self) -> Any:
                return SoftTimeLimitExceeded, self.args

            kind = type(
                "SoftTimeLimitExceeded",
                (SoftTimeLimitExceeded,),
                {
                    "__init__": __init__,
                    "__reduce__": __reduce__,
                    "__module__": __name__,
                },
            )
            cls._made[soft] = kind
        return kind
