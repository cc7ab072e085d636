"""Queue, SimpleQueue and JoinableQueue that work across the cluster.

The items live in the process that created the queue (its owner), pickled, as
the stdlib's live in an OS pipe; any process holding the queue — a child on
another host, a Pool task — puts and gets through the owner over the
authenticated direct channel (see ``objserver``).  So:

- a queue outlives the death of any producer or consumer other than its owner:
  items put and not yet taken stay; an item the owner was handing to a consumer
  that died is put back at the front;
- values are pickled in ``put()`` (cloudpickle: lambdas and ``__main__`` classes
  travel too) and types survive exactly (a list stays a list).  An object that
  cannot be pickled is handed to ``Queue._on_queue_feeder_error(e, obj)``, which
  prints the traceback, and the queue goes on, as the stdlib's feeder thread
  does; ``SimpleQueue.put`` raises the pickler's error in the caller, as the
  stdlib's does;
- a producer's puts stay in order (one ordered connection per process and
  queue); on an unbounded queue they are pipelined, without a round trip.
"""

from __future__ import annotations

import collections
import itertools
import pickle
import queue
import threading
import time
import weakref
from multiprocessing.synchronize import SEM_VALUE_MAX
from typing import Any

import cloudpickle

from .comm.objserver import (
    NO_REPLY,
    Remote,
    ServedObject,
    get_object_server,
    keep_until_unused,
    resolve,
)

__all__ = ["Queue", "SimpleQueue", "JoinableQueue"]


_LEASE = 256  # items a fast remote consumer takes per round trip
_BATCH_LIMIT = 64 * 1024  # a put this big is sent alone, not batched
_LEASE_IDLE = 0.02  # seconds unread leased items stay with an idle consumer


class _Feeder:
    """Sends a process's puts to a remote queue from a thread, as the stdlib's
    feeder thread does: ``put`` returns at once, and what accumulates while a
    send is under way goes in one message.  ``close()``/``join_thread()`` and
    process exit (a ``multiprocessing.util.Finalize``) wait until all is sent;
    a process killed meanwhile loses what was not sent, as with the stdlib."""

    def __init__(self, remote: Remote, owner: Queue) -> None:
        from multiprocessing.util import Finalize

        self.remote = remote
        self.items: list[bytes] = []
        self.cond = threading.Condition()
        self.sending = False
        self.error: BaseException | None = None
        self.owner = weakref.ref(owner)
        threading.Thread(
            target=self._run, name="fiber-queue-feeder", daemon=True
        ).start()
        self.cancelled = False  # cancel_join_thread(): no flush at exit
        Finalize(owner, self._flush_at_exit, exitpriority=10)

    def put(self, blob: bytes) -> None:
        with self.cond:
            if self.error is not None:
                raise self.error
            self.items.append(blob)
            self.cond.notify_all()

    def _flush_at_exit(self) -> None:
        if not self.cancelled:
            try:
                self.flush()
            except BaseException:  # the owner is gone: nothing to wait for
                pass

    def flush(self) -> None:
        with self.cond:
            self.cond.wait_for(lambda: not self.items and not self.sending)
            if self.error is not None:
                raise self.error

    def _send(self, items: list[bytes]) -> None:
        """Small items go together in one message; a big one goes alone (a
        batch would cost it another copy and gain nothing)."""
        batch: list[bytes] = []
        for blob in items:
            if len(blob) < _BATCH_LIMIT:
                batch.append(blob)
                continue
            self._send_batch(batch)
            batch = []
            self.remote.send_raw(b"P" + blob)
        self._send_batch(batch)

    def _send_batch(self, batch: list[bytes]) -> None:
        if len(batch) == 1:
            self.remote.send_raw(b"P" + batch[0])
        elif batch:
            self.remote.send_raw(b"M" + pickle.dumps(batch, protocol=5))

    def _run(self) -> None:
        while True:
            with self.cond:
                if not self.cond.wait_for(lambda: self.items, timeout=1.0):
                    if self.owner() is None:
                        return  # its queue handle is gone and all is sent
                    continue
                items, self.items = self.items, []
                self.sending = True
            try:
                self._send(items)
            except BaseException as e:  # the owner is gone: say so at the next put
                with self.cond:
                    self.error = e
            finally:
                with self.cond:
                    self.sending = False
                    self.cond.notify_all()


class _LeaseReaper:
    """One thread per process that hands back the leases of idle consumers."""

    def __init__(self) -> None:
        self._queues: set = set()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def watch(self, q: Queue) -> None:
        with self._lock:
            self._queues.add(q)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="fiber-queue-leases", daemon=True
                )
                self._thread.start()
        self._wake.set()

    def _run(self) -> None:
        while True:
            self._wake.wait()
            time.sleep(_LEASE_IDLE / 2)
            now = time.monotonic()
            with self._lock:
                queues = list(self._queues)
            done = [q for q in queues if not q._return_stale_lease(now)]
            with self._lock:
                self._queues.difference_update(done)
                if not self._queues:
                    self._wake.clear()


_reaper = _LeaseReaper()


_PLAIN = frozenset({int, float, str, bytes, bool, type(None)})


def _dumps(obj: Any) -> bytes:
    if type(obj) in _PLAIN:  # nothing cloudpickle could add: the C pickler
        return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return cloudpickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


class _QueueState(ServedObject):
    """The owner's side: the items, and the operations on them."""

    def __init__(self, maxsize: int) -> None:
        self.maxsize = maxsize
        self.items: collections.deque = collections.deque()
        self.lock = threading.Lock()
        self.not_empty = threading.Condition(self.lock)
        self.not_full = threading.Condition(self.lock)
        self.all_done = threading.Condition(self.lock)
        self.unfinished = 0

    # Every operation takes plain arguments and returns plain values, so the
    # owner calls them directly and holders call them through ``serve``.
    def put(
        self, blob: bytes, block: bool = True, timeout: float | None = None
    ) -> None:
        with self.not_full:
            if len(self.items) >= self.maxsize:
                if not block:
                    raise queue.Full
                if not self.not_full.wait_for(
                    lambda: len(self.items) < self.maxsize, timeout
                ):
                    raise queue.Full
            self.items.append(blob)
            self.unfinished += 1
            self.not_empty.notify()

    def get(self, block: bool = True, timeout: float | None = None) -> bytes:
        """The owner's own get."""
        return self._take(block, timeout)

    def _take(self, block: bool = True, timeout: float | None = None) -> bytes:
        with self.not_empty:
            if not self.items:
                if not block:
                    raise queue.Empty
                if not self.not_empty.wait_for(lambda: self.items, timeout):
                    raise queue.Empty
            blob = self.items.popleft()
            self.not_full.notify()
            return blob

    def qsize(self) -> int:
        with self.lock:
            return len(self.items)

    def task_done(self) -> None:
        with self.lock:
            if self.unfinished <= 0:
                raise ValueError("task_done() called too many times")
            self.unfinished -= 1
            if self.unfinished == 0:
                self.all_done.notify_all()

    def join(self, timeout: float | None = None) -> bool:
        with self.all_done:
            return self.all_done.wait_for(lambda: self.unfinished == 0, timeout)

    def serve(self, op: str, args: tuple, session: dict) -> Any:
        if op == "put":
            self.put(*args)
            return None
        if op == "get":
            block, timeout, most = args
            blobs = [self._take(block, timeout)]
            if most > 1:
                blobs.extend(self._take_more(most - 1))
            # Leased until acknowledged: a holder that dies with them unread
            # gives them back (it acknowledges each before returning it).
            session.setdefault("pending", collections.deque()).extend(blobs)
            return blobs
        if op == "return":  # a consumer hands back items it leased, unread
            self._give_back(session["pending"])
            session["pending"].clear()
            return NO_REPLY
        if op in ("qsize", "task_done", "join"):
            return getattr(self, op)(*args)
        raise ValueError(f"unknown queue operation {op!r}")

    def serve_raw(self, raw: bytes, session: dict) -> None:
        kind = raw[:1]
        if kind == b"A":  # one leased item was taken
            session["pending"].popleft()
        elif kind == b"P":  # a pipelined put on an unbounded queue
            self.put(raw[1:])
        elif kind == b"M":  # several, from a producer's feeder thread
            for blob in pickle.loads(raw[1:]):
                self.put(blob)
        else:
            super().serve_raw(raw, session)

    def _take_more(self, most: int) -> list[bytes]:
        """Extra items for a fast consumer: never more than its share."""
        with self.lock:
            share = len(self.items) // max(1, self.connections)
            n = min(most, share)
            out = [self.items.popleft() for _ in range(n)]
            if n:
                self.not_full.notify(n)
            return out

    def disconnected(self, session: dict) -> None:
        pending = session.get("pending")
        if pending:
            # Its consumer died (or hung up) before taking these.
            self._give_back(pending)

    def _give_back(self, blobs: Any) -> None:
        """Items handed out and not taken go back to the front, in order
        (they are still counted unfinished: they were never taken)."""
        if blobs:
            with self.lock:
                self.items.extendleft(reversed(blobs))
                self.not_empty.notify(len(blobs))


class _JoinableState(_QueueState):
    """A JoinableQueue's owner side: it also keeps each item another process
    took until that process calls ``task_done`` for it, and re-delivers the
    items of a process that dies first (at-least-once, as a Pool re-runs the
    tasks of a dead worker), so ``join()`` still returns once they are done.

    ``task_done`` does not say which item it is for: a holder's call retires
    the oldest item that holder took (FIFO, the usual consumer loop); a call
    from a process holding none retires the owner's own, else the oldest item
    any holder took.  Items the owner takes itself are only counted: they die
    with it, and so does the queue.
    """

    def __init__(self, maxsize: int) -> None:
        super().__init__(maxsize)
        self.holding: dict[int, dict] = {}  # id(session) -> session with taken items
        self.own_taken = 0
        self._seq = itertools.count()

    def get(self, block: bool = True, timeout: float | None = None) -> bytes:
        blob = self._take(block, timeout)
        with self.lock:
            self.own_taken += 1
        return blob

    def task_done(self) -> None:
        self._task_done(None)

    def _task_done(self, session: dict | None) -> None:
        with self.lock:
            if self.unfinished <= 0:
                raise ValueError("task_done() called too many times")
            if session is not None and session.get("taken"):
                self._retire(session)
            elif self.own_taken:
                self.own_taken -= 1
            elif self.holding:
                oldest = min(self.holding.values(), key=lambda h: h["taken"][0][0])
                self._retire(oldest)
            self.unfinished -= 1
            if self.unfinished == 0:
                self.all_done.notify_all()

    def _retire(self, session: dict) -> None:
        taken = session["taken"]
        taken.popleft()
        if not taken:
            self.holding.pop(id(session), None)

    def serve(self, op: str, args: tuple, session: dict) -> Any:
        if op == "task_done":
            return self._task_done(session)
        return super().serve(op, args, session)

    def serve_raw(self, raw: bytes, session: dict) -> None:
        if raw[:1] != b"A":
            return super().serve_raw(raw, session)
        blob = session["pending"].popleft()  # taken: in hand until task_done
        with self.lock:
            session.setdefault("taken", collections.deque()).append(
                (next(self._seq), blob)
            )
            self.holding[id(session)] = session

    def disconnected(self, session: dict) -> None:
        super().disconnected(session)
        with self.lock:
            taken = session.pop("taken", None)
            self.holding.pop(id(session), None)
        if taken:
            # Its process ended before task_done: run them again (first, in
            # the order they were taken), still counted as unfinished.
            self._give_back([blob for _, blob in taken])


def _rebuild(cls: type, ref: tuple) -> Any:
    q = cls.__new__(cls)
    q._setup(ref)
    return q


class Queue:
    """``multiprocessing.Queue`` whose items live in the creating process and
    which any process of the cluster can use.

    Parameters
    ----------
    maxsize : int
        Items the queue holds before ``put`` blocks; ``<= 0`` means unbounded.
    """

    _served = _QueueState

    def __init__(self, maxsize: int = 0, *, ctx: Any = None) -> None:
        if maxsize <= 0:
            maxsize = SEM_VALUE_MAX  # as the stdlib
        state = self._served(maxsize)
        server = get_object_server()
        oid = server.add(state)
        self._setup((server.address, server.authkey, oid, maxsize), state)
        keep_until_unused(state, self, oid)

    def _setup(self, ref: tuple, target: Any = None) -> None:
        self._ref = ref
        self._maxsize = ref[3]
        self._target = target if target is not None else resolve(*ref[:3])
        self._closed = False
        self._feeder: _Feeder | None = None  # sends this process's puts
        self._buffer: collections.deque = collections.deque()  # leased items
        self._get_lock = threading.Lock()
        self._last_get = 0.0

    def __reduce__(self):
        return (_rebuild, (type(self), self._ref))

    def __repr__(self) -> str:
        return f"<{type(self).__module__}.{type(self).__qualname__} object at {id(self):#x}>"

    def _call(self, op: str, *args: Any) -> Any:
        if self._feeder is not None:  # only a remote holder has one
            self._feeder.flush()  # this process's puts come first
        return self._target.call(op, *args)

    def _check_closed(self) -> None:
        if self._closed:
            raise ValueError(f"Queue {self!r} is closed")

    def put(self, obj: Any, block: bool = True, timeout: float | None = None) -> None:
        """Put ``obj``; with ``block`` wait up to ``timeout`` s for room
        (``queue.Full`` then).

        ``obj`` is pickled now, in the caller.  If that fails, the error goes
        to :meth:`_on_queue_feeder_error` (which prints it) and nothing is put,
        as with the stdlib, whose feeder thread reports it the same way.
        """
        self._check_closed()
        try:
            blob = _dumps(obj)
        except Exception as e:
            self._on_queue_feeder_error(e, obj)
            return
        self._put_blob(blob, block, timeout)

    @staticmethod
    def _on_queue_feeder_error(e: BaseException, obj: Any) -> None:
        """Called with the error and the object when ``obj`` cannot be
        pickled for a ``put``; override it to handle that (the stdlib's hook,
        same signature).  The default prints the traceback to stderr."""
        import traceback

        traceback.print_exc()

    def _put_blob(self, blob: bytes, block: bool, timeout: float | None) -> None:
        target = self._target
        if isinstance(target, Remote):
            if self._maxsize == SEM_VALUE_MAX:
                if self._feeder is None:
                    self._feeder = _Feeder(target, self)
                self._feeder.put(blob)
            else:
                target.call("put", blob, block, timeout)
        else:
            target.put(blob, block, timeout)

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        """Remove and return an item; ``queue.Empty`` if none comes in time."""
        self._check_closed()
        if block and timeout is not None and timeout < 0:
            raise ValueError("'timeout' must be a non-negative number")
        target = self._target
        if not isinstance(target, Remote):
            return pickle.loads(target.get(block, timeout))
        with self._get_lock:
            if not self._buffer:
                if self._feeder is not None:
                    # This process's own puts first: a get would otherwise
                    # hold the connection while they wait behind it.
                    self._feeder.flush()
                # A consumer that comes back within 2 ms is draining the queue
                # in a loop: lease it a few items per round trip.  A slow one
                # takes one at a time, so items never wait behind its work.
                fast = time.monotonic() - self._last_get < 0.002
                self._buffer.extend(
                    target.call("get", block, timeout, _LEASE if fast else 1)
                )
                if len(self._buffer) > 1:
                    _reaper.watch(self)
            blob = self._buffer.popleft()
            target.ack(bool(self._buffer))  # taken: ours now, as in the stdlib
            self._last_get = time.monotonic()
        return pickle.loads(blob)

    def _return_stale_lease(self, now: float) -> bool:
        """Give back leased items this consumer has not come for within
        ``_LEASE_IDLE`` s, so no item waits on a consumer that stopped (the
        stdlib never holds items for a process that is not in ``get``).
        Returns True while a lease remains to watch."""
        if not self._get_lock.acquire(blocking=False):
            return True  # a get() is under way: look again later
        try:
            if not self._buffer:
                return False
            if now - self._last_get < _LEASE_IDLE:
                return True
            self._buffer.clear()
            try:
                self._target.send("return")
            except ConnectionError:
                pass  # the owner is gone, and with it the items
            return False
        finally:
            self._get_lock.release()

    def qsize(self) -> int:
        """Approximate number of items in the queue (exact in its owner)."""
        return self._call("qsize")

    def empty(self) -> bool:
        return self.qsize() == 0

    def full(self) -> bool:
        return self.qsize() >= self._maxsize

    def put_nowait(self, obj: Any) -> None:
        return self.put(obj, False)

    def get_nowait(self) -> Any:
        return self.get(False)

    def close(self) -> None:
        """This process will put no more.  Its puts so far are in the queue
        when ``close`` returns (they are pipelined; one round trip flushes
        them), and its connection is released."""
        if self._closed:
            return
        self._closed = True
        target = self._target
        if isinstance(target, Remote):
            try:
                self._call("qsize")  # answered after every earlier put
            except ConnectionError:
                pass
            with self._get_lock:
                self._buffer.clear()  # the owner takes back unread leases
            target.close()

    def join_thread(self) -> None:
        """Wait for this process's puts to be in the queue: ``close`` did."""
        if not self._closed:
            raise AssertionError(f"Queue {self!r} not closed")

    @property
    def _reader(self) -> _QueueEnd:
        """The receiving end, as the stdlib's queues have one (an OS pipe end
        there): only ``closed``/``readable``/``writable`` and ``close()``."""
        return _QueueEnd(self, readable=True)

    @property
    def _writer(self) -> _QueueEnd:
        """The sending end (see :attr:`_reader`)."""
        return _QueueEnd(self, readable=False)

    def cancel_join_thread(self) -> None:
        """Do not wait at process exit for this process's unsent puts (they may
        be lost), as the stdlib's does."""
        if self._feeder is not None:
            self._feeder.cancelled = True


class _QueueEnd:
    """What ``Queue._reader``/``_writer`` are: the stdlib's are the two
    Connection ends of an OS pipe; a fiber-dask queue has no pipe, so only the
    state code reads (``closed``) and ``close()`` exist here."""

    __slots__ = ("_queue", "readable", "writable")

    def __init__(self, q: Queue, readable: bool) -> None:
        self._queue = q
        self.readable = readable
        self.writable = not readable

    @property
    def closed(self) -> bool:
        return self._queue._closed

    def close(self) -> None:
        self._queue.close()

    def fileno(self) -> int:
        raise NotImplementedError(
            "a fiber-dask queue has no OS pipe, so its _reader/_writer have no file "
            "descriptor; wait on a fiber-dask Pipe end instead, whose fileno() "
            "works with multiprocessing.connection.wait()"
        )


class JoinableQueue(Queue):
    """``multiprocessing.JoinableQueue``: a :class:`Queue` with ``task_done``/``join``.

    An item a process took is re-delivered if that process ends (dies, or
    closes its connection) before its ``task_done``: delivery is at least
    once, and ``join()`` returns once every item has been done by someone.
    """

    _served = _JoinableState

    def task_done(self) -> None:
        """One item taken earlier is processed; ``ValueError`` if called too often."""
        self._call("task_done")

    def join(self) -> None:
        """Block until every item put has had its ``task_done``."""
        target = self._target
        if isinstance(target, Remote):
            target.call("join", None)
        else:
            target.join(None)


class SimpleQueue(Queue):
    """``multiprocessing.SimpleQueue``: unbounded ``get``/``put``/``empty``/``close``."""

    def __init__(self, *, ctx: Any = None) -> None:
        super().__init__(0, ctx=ctx)

    def put(self, obj: Any) -> None:  # type: ignore[override]
        """Put ``obj``; an object that cannot be pickled raises here, in the
        caller, as with the stdlib's SimpleQueue (which has no feeder)."""
        self._check_closed()
        self._put_blob(_dumps(obj), True, None)

    def get(self) -> Any:  # type: ignore[override]
        return super().get()

    def _check_closed(self) -> None:
        if self._closed:
            raise OSError("handle is closed")
