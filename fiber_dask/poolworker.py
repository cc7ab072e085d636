"""The pool-worker loop: a long-running Dask task that executes Pool chunks.

Dask places one loop per pool slot on its workers and re-runs a loop whose
worker died.  The loop connects back to the pool's owner over the direct
channel and then only moves bytes: no scheduler round trip per task.

With ``fiber.pool.slots: process`` (the default) the Dask task is only the
slot's *keeper*: :func:`run_pool_worker` hands the loop (:func:`serve_slot`)
to a slot process of its own and waits for it (see :mod:`fiber_dask.slots`);
with ``thread`` the Dask task thread runs :func:`serve_slot` itself.

Messages (pickled tuples), owner → loop:

* ``("T", ckey, fid, fblob, mode, payload, retries)`` run a chunk (``payload``
  is the pickled list of items); ``fblob`` is the
  cloudpickled function the first time this loop sees ``fid``, else None;
  ``mode`` 0: ``f(x)``, 1: ``f(*x)``, 2: ``f(*args, **kwds)``.
* raw ``b"S"``: stop after the queued work; raw ``b"K"``: stop now (terminate).

loop → owner:

* ``("R", ckey, ok, blob, seconds, last)`` a chunk's pickled results (a list)
  or its exception (wrapped with the remote traceback, as the stdlib does); ``last``
  is True when ``maxtasksperchild`` retires this loop.
* ``("I", blob)`` the initializer raised (the pickled exception).

A receiver thread drains the socket into a local queue at all times, so the
owner's sends never block on a busy worker (which would deadlock against our
own result sends), and so ``("K",)`` can interrupt a running task.
"""

from __future__ import annotations

import ctypes
import os
import pickle
import queue
import threading
import time
from multiprocessing.pool import ExceptionWithTraceback, MaybeEncodingError
from typing import Any

from . import channel
from .mainglobals import MainNamespace

__all__ = ["run_pool_worker", "serve_slot"]

_FUNC_CACHE_SIZE = 512


class _Terminated(BaseException):
    """Raised asynchronously in the executing thread by ``("K",)`` or owner loss."""


def _dumps_value(value: Any) -> bytes:
    # Plain pickle first: it is fastest, and classes the owner can import go by
    # reference.  cloudpickle for what only it can carry (lambdas, closures).
    try:
        return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:
        import cloudpickle

        return cloudpickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)


def _wrap(exc: BaseException) -> Any:
    return ExceptionWithTraceback(exc, exc.__traceback__)


class _Loop:
    def __init__(self, conn: Any, kill_after: float | None = None) -> None:
        self.conn = conn
        self.kill_after = kill_after
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.send_lock = threading.Lock()
        self.exec_lock = threading.Lock()
        self.executing = False
        self.stop_now = False
        self.main_ident = threading.get_ident()
        self.main = MainNamespace()  # the script's globals, shared by its functions

    def send(self, msg: tuple) -> None:
        with self.send_lock:
            self.conn.send_bytes(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))

    def send_result(
        self, ckey: int, ok: bool, value: Any, secs: float, last: bool
    ) -> None:
        """Send a chunk's outcome.  The value is pickled on its own so the owner
        can fail just this chunk if it cannot load it."""
        try:
            blob = _dumps_value(value)
        except Exception as e:
            # The stdlib's rule: a result that cannot be pickled becomes a
            # MaybeEncodingError for that task, and the worker carries on.
            shown = value[0] if ok and value else value
            ok, blob = False, _dumps_value(MaybeEncodingError(e, shown))
        self.send(("R", ckey, ok, blob, secs, last))

    def receive(self) -> None:
        """Receiver thread: drain the socket; interrupt the task on K or EOF."""
        while True:
            try:
                raw = self.conn.recv_bytes()
            except (EOFError, OSError):
                raw = None
            if raw is None or raw == b"K":
                self.stop_now = True
                with self.exec_lock:
                    if self.executing:
                        # Interrupts Python code at its next bytecode; a task
                        # blocked in C (sleep, I/O, a long numpy call) only
                        # notices when that call returns.
                        ctypes.pythonapi.PyThreadState_SetAsyncExc(
                            ctypes.c_ulong(self.main_ident),
                            ctypes.py_object(_Terminated),
                        )
                        if self.kill_after is not None:
                            t = threading.Timer(self.kill_after, self._kill_if_stuck)
                            t.daemon = True
                            t.start()
                self.inbox.put(None)
                return
            self.inbox.put(raw)

    def _kill_if_stuck(self) -> None:
        """Still in the task after the grace period: end this worker process,
        as the stdlib's terminate() does.  Only on clusters fiber-dask started
        (its nanny starts a fresh worker); never on someone else's cluster."""
        with self.exec_lock:
            if self.executing:
                os._exit(1)

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


def run_pool_worker(
    address: tuple[str, int],
    authkey: bytes,
    service: str,
    slot: int,
    init_blob: bytes | None,
    maxtasks: int | None,
    kill_after: float | None = None,
    slots: str | None = None,
) -> str:
    """Body of one pool-slot Dask task.  Returns why it ended.

    ``kill_after``: seconds after a terminate (or the owner's loss) at which a
    task that has not stopped ends this process; None never does.
    ``slots``: ``"process"`` (the task is a *keeper*: it holds the Dask slot
    while a slot process of its own runs the loop, see :mod:`fiber_dask.slots`)
    or ``"thread"`` (this Dask task thread runs the loop); None reads
    ``fiber.pool.slots``.
    """
    try:
        from distributed import get_worker

        worker = get_worker()
    except (ImportError, ValueError):
        worker = None
    if slots is None:
        from . import config

        slots = config.get("pool.slots")
    if slots == "process":
        from .slots import keep

        return keep(address, authkey, service, slot, init_blob, maxtasks, worker)
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


def serve_slot(
    address: tuple[str, int],
    authkey: bytes,
    service: str,
    slot: int,
    init_blob: bytes | None,
    maxtasks: int | None,
    kill_after: float | None,
    worker_address: str | None,
) -> str:
    """Connect back to the pool's owner and serve chunks until told to stop.

    Runs in the Dask task thread (thread slots) or in the main thread of a
    slot process (:mod:`fiber_dask.slotserver`).  Returns why it ended.
    """
    import cloudpickle  # noqa: F401  (unpickling cloudpickled functions needs it)

    try:
        conn = channel.connect(
            address,
            authkey,
            service,
            hello={"pid": os.getpid(), "worker": worker_address, "slot": slot},
        )
    except channel.ChannelError as e:
        if isinstance(e.__cause__, OSError):
            # The owner cannot be reached from this host (an address valid
            # only on its own host, a firewall, a partition; or it exited).
            # Not "no-pool": the pool counts this as a failed loop, so that it
            # fails with an error naming the address instead of starting
            # loops that cannot connect forever.
            return f"unreachable: {e}"
        # The pool is gone (closed): nothing to do.
        return "no-pool"
    loop = _Loop(conn, kill_after)
    try:
        if init_blob is not None:
            try:
                initializer, initargs = pickle.loads(init_blob)
                initializer = loop.main.adopt(initializer)
                loop.call(initializer, 1, initargs)
            except Exception as e:
                loop.send(("I", _dumps_value(_wrap(e))))
                return "initializer-failed"
        threading.Thread(
            target=loop.receive, name="fiber-pool-recv", daemon=True
        ).start()
        return _serve(loop, maxtasks)
    except _Terminated:
        return "terminated"
    finally:
        channel.hangup(conn)


def _serve(loop: _Loop, maxtasks: int | None) -> str:
    funcs: dict[int, Any] = {}
    completed = 0
    while True:
        raw = loop.inbox.get()
        if raw is None or loop.stop_now:
            return "terminated"
        if raw == b"S":
            return "stopped"
        # The envelope holds only plain types; the function and the arguments
        # are unpickled inside the try, so one that cannot be loaded here (a
        # module missing on this host) fails its task, not the loop.
        _, ckey, fid, fblob, mode, payload, retries = pickle.loads(raw)
        start = time.perf_counter()
        try:
            items = pickle.loads(payload)
            func = funcs.get(fid)
            if func is None:
                func = loop.main.adopt(pickle.loads(fblob))
                if len(funcs) >= _FUNC_CACHE_SIZE:
                    funcs.pop(next(iter(funcs)))
                funcs[fid] = func
            results = []
            for item in items:
                for attempt in range(retries + 1):
                    try:
                        results.append(loop.call(func, mode, item))
                        break
                    except Exception:
                        if attempt == retries:
                            raise
            reply: tuple = ("R", ckey, True, results)
        except _Terminated:
            raise
        except Exception as e:
            reply = ("R", ckey, False, _wrap(e))
        completed += 1
        last = bool(maxtasks) and completed >= maxtasks
        loop.send_result(ckey, reply[2], reply[3], time.perf_counter() - start, last)
        if last:
            return "recycled"
