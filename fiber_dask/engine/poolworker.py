"""The pool-worker loop: the code that runs Pool chunks, next to a Dask worker.

Dask places one loop per pool slot (the long-running task
:func:`fiber_dask.engine.slottask.run_pool_worker`) and re-runs a loop whose worker died.  The loop
joins its process's link to the pool's owner (:mod:`fiber_dask.engine.poollink`: one
authenticated connection per process and pool, shared by its thread slots)
and then only moves bytes: no scheduler round trip per task.  The messages are
those of :mod:`fiber_dask.engine.poolprotocol`, which both ends share.

With ``fiber.pool.slots: process`` (the default) the Dask task is only the
slot's *keeper*: it hands the loop (:func:`serve_slot`)
to a slot process of its own and waits for it (see :mod:`fiber_dask.engine.slots`);
with ``thread`` the Dask task thread runs :func:`serve_slot` itself.

:func:`serve_slot` joins the link (:func:`fiber_dask.engine.poollink.attach`), runs
the initializer and serves chunks until STOP, TERMINATE, the owner's loss or
``maxtasksperchild``, then leaves the link saying why it ended (a
:class:`~fiber_dask.engine.poolprotocol.Reason`, also its return value).  It does
not assume it runs inside a Dask worker.

The link's receiver thread drains the socket into each loop's inbox at all
times, so the owner's sends never block on a busy worker (which would
deadlock against our own result sends), and so TERMINATE can interrupt a
running task.
"""

from __future__ import annotations

import ctypes
import os
import pickle
import queue
import threading
import time
from multiprocessing.pool import MaybeEncodingError
from typing import Any

from ..errors import SoftTimeLimitExceeded
from ..launch.mainglobals import MainNamespace
from ..transparency import interrupts
from . import poollink, timelimits
from . import poolprotocol as proto

__all__ = ["serve_slot", "serve"]


class _Terminated(BaseException):
    """Raised asynchronously in the executing thread by TERMINATE or owner loss."""


#: ``(thread id, exception)``: raise it in that thread at its next bytecode
#: check; an exception of NULL (None) withdraws one not yet raised.
_set_async_exc = ctypes.pythonapi.PyThreadState_SetAsyncExc


class _Loop:
    def __init__(self, number: int, kill_after: float | None = None) -> None:
        self.number = number
        self.link: Any = None  # its poollink.Link, once joined
        self.kill_after = kill_after
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.exec_lock = threading.Lock()
        self.executing = False
        self.stop_now = False
        #: DRAIN came (its Dask worker is closing): no chunk starts any more.
        self.draining = False
        #: It left its link (:meth:`leave`): its thread runs other code now.
        self.left = False
        #: The chunk it runs (its ckey), or None between chunks; and whether
        #: an ``Expire`` came for a chunk it had already answered, or not yet
        #: started: it then starts no other and leaves (:meth:`begin`).
        #: Both under ``exec_lock``.
        self.chunk: int | None = None
        self.retire = False
        self.main_ident = threading.get_ident()
        self._thread = ctypes.c_ulong(self.main_ident)  # for _set_async_exc
        self.main = MainNamespace()  # the script's globals, shared by its functions
        self.funcs = proto.LoopFunctions(
            lambda blob: self.main.adopt(pickle.loads(blob))
        )
        #: Arms the time limits around each item (made on the loop's own
        #: thread, at the first chunk that has limits).
        self.limiter: timelimits.Limiter | None = None

    def send(self, msg: Any) -> None:
        self.link.post(self.number, msg)

    def result(
        self, ckey: int, ok: bool, value: Any, secs: float, last: bool
    ) -> proto.Result:
        """A chunk's outcome, for a ``Results``.  The value is pickled on its
        own so the owner can fail just this chunk if it cannot load it."""
        if ok:
            try:
                blob = proto.dumps_value(value)
            except Exception as e:
                # The stdlib's rule: a result that cannot be pickled becomes a
                # MaybeEncodingError for that task, and the worker carries on.
                ok, blob = (
                    False,
                    proto.encode_failure(
                        MaybeEncodingError(e, value[0] if value else value)
                    ),
                )
        else:
            blob = proto.encode_failure(value)
        return proto.Result(ckey, ok, blob, secs, last)

    def deliver(self, msg: Any) -> None:
        """On the link's receiver thread: a message for this loop, or None
        (the link dropped: the owner is gone).  TERMINATE and None interrupt
        the running task, until the loop has left; DRAIN lets it finish (set
        here, not queued behind the chunks waiting in the inbox)."""
        if msg is proto.DRAIN:
            self.draining = True
            self.inbox.put(msg)  # wakes a loop waiting for work: it leaves
            return
        if msg is not None and msg is not proto.TERMINATE:
            if type(msg) is proto.Expire:
                self.expire(msg.ckey)
                return
            self.inbox.put(msg)
            return
        self.stop_now = True
        with self.exec_lock:
            if self.executing and not self.left:
                # Interrupts Python code at its next bytecode; a task
                # blocked in C (sleep, I/O, a long numpy call) only
                # notices when that call returns.
                _set_async_exc(self._thread, ctypes.py_object(_Terminated))
                if self.kill_after is not None:
                    t = threading.Timer(self.kill_after, self._kill_if_stuck)
                    t.daemon = True
                    interrupts.start_helper(t)
        self.inbox.put(None)

    def expire(self, ckey: int) -> None:
        """The owner ended chunk ``ckey`` (an item past its hard time limit,
        or its job cancelled): a slot process still in it ends now, its
        template forking a successor.  One that has moved on (the owner
        takes a loop's first unanswered chunk for the one it runs, and that
        chunk's answer may be on its way, or not sent yet behind a short
        chunk's) or has not started it finishes the chunk it runs, answers,
        and leaves as after ``maxtasksperchild``: what it runs is another
        job's, which would otherwise run again elsewhere."""
        with self.exec_lock:
            self.retire = True
            if self.chunk == ckey:
                # Under the lock: the loop cannot end this chunk and leave
                # (writing its own reason) before the kill.
                timelimits.expire()  # a slot process ends here, now
        self.inbox.put(proto.STOP)  # wakes a loop waiting for work: it leaves

    def begin(self, ckey: int) -> bool:
        """Chunk ``ckey`` starts, unless an ``Expire`` came (False)."""
        with self.exec_lock:
            if self.retire:
                return False
            self.chunk = ckey
            return True

    def end(self) -> None:
        with self.exec_lock:
            self.chunk = None

    def _kill_if_stuck(self) -> None:
        """Still in the task after the grace period: end this worker process,
        as the stdlib's terminate() does.  Only on clusters fiber-dask started
        (its nanny starts a fresh worker); never on someone else's cluster."""
        with self.exec_lock:
            if self.executing and not self.left:
                os._exit(1)

    def leave(self) -> None:
        """The loop is done (call on its own thread, before it leaves the
        link): no TERMINATE or hang-up may interrupt this thread or end this
        process from now on, whatever runs in it next (the link's code, or
        another Dask task on this worker thread).

        ``executing`` can stay set after a task: a TERMINATE interrupt that
        lands just after the mark was set, before the ``try`` that clears it.
        The loop then ends, and a late TERMINATE or the link's EOF, seeing
        the stale mark, would interrupt whatever the thread runs next and
        start the timer that ends the process.  An interrupt sent before
        this and not yet raised is withdrawn too; one raised in here (before
        it was withdrawn) was for this loop: call it again then (see
        :func:`serve_slot`).
        """
        with self.exec_lock:
            # First under the lock, before any Python-level call (where a
            # pending interrupt is raised): no deliver() can send another
            # now, and an exception of NULL withdraws one sent before.
            _set_async_exc(self._thread, None)
            self.left = True
            self.executing = False

    def call(self, func: Any, mode: int, item: Any) -> Any:
        with self.exec_lock:
            self.executing = True
        try:
            if mode == 0:
                return func(item)
            if mode == 1:
                return func(*item)
            return func(*item[0], **item[1])
        finally:
            with self.exec_lock:
                self.executing = False

    def call_limited(self, func: Any, call: proto.Call, items: list) -> list:
        """``call_items`` under time limits: each try of each item is armed
        by the limiter, and, under a hard limit, announced to the owner
        (``Running``), whose clock decides when it has run too long."""
        limiter = self.limiter
        if limiter is None:
            in_main = (
                timelimits._reason_fd is not None
                and threading.current_thread() is threading.main_thread()
            )
            limiter = self.limiter = timelimits.Limiter(
                in_main, lambda: not self.stop_now
            )
        limits, mode, ckey = call.limits, call.mode, call.ckey
        hard = limits[1] is not None
        results = []
        with self.exec_lock:
            self.executing = True
        try:
            for offset, item in enumerate(items):
                for attempt in range(call.retries + 1):
                    if hard:
                        self.send(proto.Running(ckey, offset))
                    limiter.start(limits)
                    try:
                        if mode == 0:
                            value = func(item)
                        elif mode == 1:
                            value = func(*item)
                        else:
                            value = func(*item[0], **item[1])
                    except Exception:
                        if attempt == call.retries:
                            raise
                        continue
                    finally:
                        # The item's own soft limit may land in here: nothing
                        # may fire for it once this returns.
                        while True:
                            try:
                                limiter.stop()
                                break
                            except SoftTimeLimitExceeded:
                                pass
                    results.append(value)
                    break
            return results
        finally:
            with self.exec_lock:
                self.executing = False

    def call_items(self, func: Any, mode: int, items: list, retries: int) -> list:
        """``func`` on each item of a chunk, stopping at the first that
        raises (after ``retries`` more tries of it).  Marked executing once
        for the whole chunk: per item, the two lock round trips cost more
        than a trivial task (7 us against 0.3 us an item)."""
        with self.exec_lock:
            self.executing = True
        try:
            if not retries:
                if mode == 0:
                    return [func(item) for item in items]
                if mode == 1:
                    return [func(*item) for item in items]
                return [func(*item[0], **item[1]) for item in items]
            results = []
            for item in items:
                for attempt in range(retries + 1):
                    try:
                        if mode == 0:
                            results.append(func(item))
                        elif mode == 1:
                            results.append(func(*item))
                        else:
                            results.append(func(*item[0], **item[1]))
                        break
                    except Exception:
                        if attempt == retries:
                            raise
            return results
        finally:
            with self.exec_lock:
                self.executing = False


def serve(
    link: Any,
    loop: _Loop,
    init_blob: bytes | None,
    maxtasks: int | None,
) -> str:
    """Run the initializer, then serve ``loop``'s chunks until told to end.

    Returns why it ended (:class:`~fiber_dask.engine.poolprotocol.Reason`).
    """
    import cloudpickle  # noqa: F401  (unpickling cloudpickled functions needs it)

    loop.link = link
    try:
        if init_blob is not None:
            try:
                initializer, initargs = pickle.loads(init_blob)
                initializer = loop.main.adopt(initializer)
                loop.call(initializer, 1, initargs)
            except Exception as e:
                # Also an initializer that cannot be loaded here (ImportError):
                # the owner fails the pool with it, it never runs without it.
                loop.send(proto.InitFailed(proto.encode_failure(e)))
                return proto.Reason.INIT_FAILED
        return _serve(loop, maxtasks)
    except _Terminated:
        return proto.Reason.TERMINATED


def serve_slot(
    address: tuple[str, int],
    authkey: bytes,
    service: str,
    slot: int,
    init_blob: bytes | None,
    maxtasks: int | None,
    kill_after: float | None,
    worker_address: str | None,
    relay: tuple[Any, bytes] | None = None,
) -> str:
    """One pool slot, wherever it runs (a Dask task thread, or the main thread
    of a process of its own): join the link to the owner as loop ``slot``,
    :func:`serve`, leave.  Returns why it ended.

    ``kill_after``: seconds after a terminate (or the owner's loss) at which a
    task that has not stopped ends this process; None never does.
    ``relay``: a slot process's ticket to its Dask worker's relay (address,
    token; :mod:`fiber_dask.engine.slotrelay`), which it dials instead of the
    owner; None: dial the owner.
    """
    loop = _Loop(slot, kill_after)
    dial = None
    if relay is not None:
        from . import slotrelay

        def dial() -> Any:
            return slotrelay.connect(*relay)

    link = poollink.attach(
        address, authkey, service, slot, worker_address, loop.deliver, dial=dial
    )
    if isinstance(link, str):
        return link
    reason = proto.Reason.TERMINATED
    try:
        reason = serve(link, loop, init_blob, maxtasks)
    except _Terminated:  # arrived between serve's return and here
        pass
    except KeyboardInterrupt:
        # SIGINT in a slot process: it ends, as a stdlib pool worker does
        # (the process prints it); the owner re-runs its chunks.
        reason = proto.Reason.INTERRUPTED
        raise
    finally:
        # Leave before detaching: what the link hands this loop after that
        # (its EOF when this loop hangs it up, a late TERMINATE) must neither
        # interrupt this thread nor end its process, whatever it runs next.
        while True:
            try:
                loop.leave()
                break
            except _Terminated:  # sent before it left: this loop ends anyway
                pass
        link.detach(slot, reason)
    return reason


def _serve(loop: _Loop, maxtasks: int | None) -> str:
    """Run each ``Calls``' chunks in order and answer them with ``Results``.

    A chunk's result waits to be sent with the next ones only while the
    chunks are short: it goes at once after a chunk that ran
    ``FLUSH_SECONDS`` or more, once ``FLUSH_SECONDS`` have passed since the
    oldest result waiting finished or ``FLUSH_CHUNKS`` wait, and at the end
    of each ``Calls``.  The first chunk of a ``Calls`` is answered on its
    own, so a loop lost in it is known to have run only that one.  Never in
    the same ``Results`` as a later ``Calls``' chunks: the owner's rule for a
    lost loop, ``poolprotocol.lost_chunks``, depends on it.

    After DRAIN (``loop.draining``) no chunk starts: the loop answers what
    it ran and leaves (``Reason.DRAINED``), so the chunks it leaves
    unanswered never started and the owner sends them elsewhere as they are.
    """
    completed = 0
    flush_after, flush_chunks = proto.FLUSH_SECONDS, proto.FLUSH_CHUNKS
    clock = time.perf_counter
    while True:
        msg = loop.inbox.get()
        if msg is None or loop.stop_now:
            return proto.Reason.TERMINATED
        if loop.retire:
            return proto.Reason.RECYCLED
        if msg is proto.STOP:
            return proto.Reason.STOPPED
        if loop.draining:
            return proto.Reason.DRAINED
        calls = msg.calls
        answers: list = []
        oldest = 0.0  # when the oldest result in answers finished
        for i, call in enumerate(calls):
            if loop.stop_now:
                return proto.Reason.TERMINATED
            if loop.draining:
                if answers:
                    loop.send(proto.Results(answers))
                return proto.Reason.DRAINED
            if answers and call.limits is not None and call.limits[1] is not None:
                # Under a hard limit the owner must have every earlier
                # chunk's answer before this one's Running: a slot process
                # killed in it then held only it and what never started.
                loop.send(proto.Results(answers))
                answers = []
            if not loop.begin(call.ckey):
                # Expire for a chunk it had moved past: answer, and leave as
                # after maxtasksperchild (the owner re-sends what is left).
                if answers:
                    loop.send(proto.Results(answers))
                return proto.Reason.RECYCLED
            try:
                ok, value, secs = _run_chunk(loop, call, msg.shared)
            finally:
                loop.end()
            completed += 1
            last = bool(maxtasks) and completed >= maxtasks
            now = clock()
            if not answers:
                oldest = now
            answers.append(loop.result(call.ckey, ok, value, secs, last))
            if (
                last
                or i == 0
                or i == len(calls) - 1
                or secs >= flush_after
                or now - oldest >= flush_after
                or len(answers) >= flush_chunks
            ):
                loop.send(proto.Results(answers))
                answers = []
            if last:
                return proto.Reason.RECYCLED


def _run_chunk(
    loop: _Loop, call: proto.Call, shared: list | None
) -> tuple[bool, Any, float]:
    """Run one chunk: ``(ok, results or the exception, seconds its items took)``.

    The envelope holds only plain types; the function and the arguments are
    loaded inside the try, so one that cannot be loaded here (a module
    missing on this host) fails its task, not the loop.  The seconds leave
    out that loading (the pool sizes chunks from them, per item).
    """
    start = time.perf_counter()
    try:
        func = loop.funcs.lookup(call)
        items = proto.loads_items(call.payload, shared)
        start = time.perf_counter()
        if call.limits is None:
            results = loop.call_items(func, call.mode, items, call.retries)
        else:
            results = loop.call_limited(func, call, items)
        return True, results, time.perf_counter() - start
    except _Terminated:
        raise
    except Exception as e:
        return False, e, time.perf_counter() - start
