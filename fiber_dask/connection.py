"""``Pipe()`` and its ``Connection`` ends, usable from any process of the cluster.

The pipe's two message buffers live in the process that called ``Pipe()`` (the
owner); an end passed to another process (a child, a Pool task) talks to the
owner over the authenticated direct channel.  As with an OS pipe, ``recv``
raises ``EOFError`` once the buffer is empty and every copy of the other end
is closed — a copy held by a process that died counts as closed.

Each end object counts as one open copy: pickling an end opens one more (for
whoever unpickles it), and a holder process that exits closes its copies.

``fileno()`` and ``wait()``
---------------------------
An end has no socket of its own, so ``fileno()`` gives a *readiness descriptor*:
the read end of a local OS pipe that is readable exactly while ``poll()`` would be
true, so that ``select``, :func:`wait` and event loops can wait on fiber-dask
Connections next to sockets and ``Process.sentinel`` objects.

* In the owner, the pipe's buffers set and clear it on every ``send``, ``recv``
  and ``close`` (exact, no thread).
* In a holder (another process), a watcher thread started by the first
  ``fileno()`` long-polls the owner on a connection of its own and sets it when a
  message or EOF is waiting; a ``recv`` clears it and the watcher looks again.
  It can be set a moment too long (a message taken by another holder meanwhile),
  which :func:`wait` corrects by asking the owner (``poll(0)``) before it returns
  such an end.

The descriptor is for waiting only: bytes written to it are not messages
(``os.write(conn.fileno(), ...)`` and passing descriptors with
``reduction.send_handle`` over a fiber-dask Connection do not work).

``Listener``, ``Client`` and the authentication helpers are the stdlib's: they
make real sockets, reachable from wherever their address routes.
"""

from __future__ import annotations

import os
import pickle
import threading
import time
import weakref

# The stdlib's socket-based half of the module, re-exported (see the docstring).
from multiprocessing import AuthenticationError, BufferTooShort  # noqa: F401
from multiprocessing.connection import (  # noqa: F401
    BUFSIZE,
    CHALLENGE,
    CONNECTION_TIMEOUT,
    FAILURE,
    MESSAGE_LENGTH,
    WELCOME,
    Client,
    ConnectionWrapper,
    Listener,
    SocketClient,
    SocketListener,
    XmlClient,
    XmlListener,
    address_type,
    answer_challenge,
    arbitrary_address,
    default_family,
    deliver_challenge,
    families,
    rebuild_connection,
    reduce_connection,
)
from multiprocessing.connection import Connection as _StdConnection
from multiprocessing.connection import wait as _select_wait
from typing import Any

from .comm.objserver import (
    Remote,
    ServedObject,
    get_object_server,
    keep_until_unused,
    resolve,
    wait_for_holder,
)
from .comm.tls import message_view, receive_into
from .launch.mainglobals import dumps_for_child

__all__ = ["Client", "Connection", "Listener", "Pipe", "wait"]


class _Readiness:
    """A local OS pipe whose read end is readable while a flag is set.

    Level-triggered, as ``select`` expects: setting writes one byte, clearing
    reads it back.  ``cond`` wakes a watcher thread when the flag is cleared.
    """

    def __init__(self) -> None:
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)
        self.is_set = False
        self.closed = False
        self.cond = threading.Condition()

    def fileno(self) -> int:
        return self._r

    def set(self, flag: bool) -> None:
        with self.cond:
            if self.closed or flag == self.is_set:
                return
            if flag:
                os.write(self._w, b"\0")
            else:
                try:
                    os.read(self._r, 1)
                except BlockingIOError:
                    pass
                self.cond.notify_all()
            self.is_set = flag

    def close(self) -> None:
        with self.cond:
            if self.closed:
                return
            self.closed = True
            self.cond.notify_all()
            os.close(self._r)
            os.close(self._w)


class _PipeState(ServedObject):
    """The owner's side: ``inbox[e]`` holds the messages end ``e`` receives."""

    def __init__(self) -> None:
        self.inbox: tuple[list, list] = ([], [])
        self.heads = [0, 0]
        self.copies = [1, 1]  # open copies of each end
        self.cond = threading.Condition()
        # Readiness descriptors of this process's ends, kept exact here.
        self.watchers: tuple[list, list] = ([], [])

    def _signal(self, end: int) -> None:
        """Bring end ``end``'s readiness descriptors up to date (under cond)."""
        if self.watchers[end]:
            ready = self._ready(end)
            for r in self.watchers[end]:
                r.set(ready)

    def watch(self, end: int, readiness: _Readiness) -> None:
        with self.cond:
            self.watchers[end].append(readiness)
            self._signal(end)

    def unwatch(self, end: int, readiness: _Readiness) -> None:
        with self.cond:
            if readiness in self.watchers[end]:
                self.watchers[end].remove(readiness)

    def _other_gone(self, end: int) -> bool:
        return self.copies[1 - end] <= 0

    def send(self, end: int, blob: bytes) -> None:
        with self.cond:
            if self._other_gone(end):
                raise BrokenPipeError(32, "Broken pipe: the other end is closed")
            self.inbox[1 - end].append(blob)
            self.cond.notify_all()
            self._signal(1 - end)

    def _ready(self, end: int) -> bool:
        return self.heads[end] < len(self.inbox[end]) or self._other_gone(end)

    # ``session``: the holder's, when it asks over the channel (None: the owner).
    def poll(self, end: int, timeout: float | None, session: Any = None) -> bool:
        with self.cond:
            return wait_for_holder(
                self.cond, lambda: self._ready(end), timeout, session
            )

    def recv(self, end: int, session: Any = None) -> bytes:
        with self.cond:
            wait_for_holder(self.cond, lambda: self._ready(end), None, session)
            box = self.inbox[end]
            if self.heads[end] >= len(box):
                raise EOFError
            blob = box[self.heads[end]]
            box[self.heads[end]] = None
            self.heads[end] += 1
            if self.heads[end] > 64 and self.heads[end] * 2 > len(box):
                del box[: self.heads[end]]  # compact, amortised O(1)
                self.heads[end] = 0
            self._signal(end)
            return blob

    def opened(self, end: int) -> None:
        with self.cond:
            self.copies[end] += 1

    def closed(self, end: int) -> None:
        with self.cond:
            self.copies[end] -= 1
            self.cond.notify_all()
            self._signal(1 - end)

    def serve(self, op: str, args: tuple, session: dict) -> Any:
        if op == "attach":  # a holder's copy (counted when it was pickled)
            session.setdefault("ends", []).append(args[0])
            return None
        if op == "close":
            session["ends"].remove(args[0])
            self.closed(args[0])
            return None
        if op == "recv":
            blob = self.recv(*args, session)
            # Until acknowledged, a message handed to a holder that dies in
            # between goes back to the head of the buffer.
            session["pending"] = (args[0], blob)
            return blob
        if op == "poll":
            return self.poll(*args, session)
        if op in ("send", "opened"):
            return getattr(self, op)(*args)
        raise ValueError(f"unknown pipe operation {op!r}")

    def serve_raw(self, raw: bytes, session: dict) -> None:
        if raw == b"A":  # the holder received the message it asked for
            session.pop("pending", None)
        else:
            super().serve_raw(raw, session)

    def disconnected(self, session: dict) -> None:
        pending = session.get("pending")
        if pending is not None:
            end, blob = pending
            with self.cond:
                if self.heads[end] > 0:
                    self.heads[end] -= 1
                    self.inbox[end][self.heads[end]] = blob
                else:
                    self.inbox[end].insert(0, blob)
                self.cond.notify_all()
                self._signal(end)
        for end in session.get("ends", ()):
            self.closed(end)  # its holder went away without close()


def _rebuild(ref: tuple, end: int, readable: bool, writable: bool) -> Connection:
    conn = Connection.__new__(Connection)
    conn._setup(ref, end, readable, writable, None)
    if isinstance(conn._target, Remote):
        conn._target.call("attach", end)
    return conn


class Connection:
    """One end of a :func:`Pipe`: the ``multiprocessing.connection.Connection`` API.

    ``Connection(handle, readable=True, writable=True)`` with an OS handle (a
    socket or pipe descriptor of this process) gives the stdlib's Connection on
    that handle, as ``multiprocessing.connection.Connection(handle)`` does.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        if args or kwargs:
            return _StdConnection(*args, **kwargs)
        return super().__new__(cls)

    def _setup(self, ref, end, readable, writable, target) -> None:
        self._ref, self._end = ref, end
        self._readable, self._writable = readable, writable
        self._target = target if target is not None else resolve(*ref)
        self._closed = False
        self._readiness: _Readiness | None = None

    def __reduce__(self):
        self._check_closed()
        self._call("opened", self._end)  # the copy being made is open
        return (_rebuild, (self._ref, self._end, self._readable, self._writable))

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"end {self._end}"
        return f"<{type(self).__module__}.Connection {state}>"

    def __enter__(self):
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            try:
                self.close()
            except Exception:  # the owner may be gone already
                pass

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def readable(self) -> bool:
        return self._readable

    @property
    def writable(self) -> bool:
        return self._writable

    def _call(self, op: str, *args: Any) -> Any:
        return self._target.call(op, *args)

    def _recv(self) -> bytes:
        target = self._target
        if not isinstance(target, Remote):
            return target.recv(self._end)
        blob = target.call("recv", self._end)
        target.ack()  # received: from now on ours
        if self._readiness is not None:
            self._readiness.set(False)  # the watcher looks again
        return blob

    def _check_closed(self) -> None:
        if self._closed:
            raise OSError("handle is closed")

    def _check_readable(self) -> None:
        if not self._readable:
            raise OSError("connection is write-only")

    def _check_writable(self) -> None:
        if not self._writable:
            raise OSError("connection is read-only")

    def fileno(self) -> int:
        """A descriptor readable while :meth:`poll` is true, for ``select`` and
        :func:`wait` (not for reading or writing messages; see the module)."""
        self._check_closed()
        if self._readiness is None:
            with _readiness_lock:
                if self._readiness is None:
                    self._readiness = self._start_readiness()
        return self._readiness.fileno()

    def _start_readiness(self) -> _Readiness:
        readiness = _Readiness()
        target = self._target
        if not self._readable:
            pass  # never readable, as a write-only stdlib end never selects
        elif isinstance(target, Remote):
            stop = threading.Event()
            threading.Thread(
                target=_watch_remote,
                args=(Remote(*self._ref), self._end, readiness, stop),
                name="fiber-pipe-watch",
                daemon=True,
            ).start()
            weakref.finalize(self, _stop_watch, stop, readiness)
            self._stop_watch = stop
        else:
            target.watch(self._end, readiness)
            weakref.finalize(self, _unwatch, target, self._end, readiness)
        return readiness

    def _ready_confirmed(self) -> bool:
        """For :func:`wait`: whether this end is really ready (asks the owner
        when the descriptor is kept by a watcher, which may lag)."""
        if self._closed:
            return True
        if isinstance(self._target, Remote):
            ready = self._call("poll", self._end, 0.0)
            if not ready and self._readiness is not None:
                self._readiness.set(False)
            return ready
        return True

    def close(self) -> None:
        """Close this copy; the other end sees EOF once every copy is closed."""
        if self._closed:
            return
        self._closed = True
        target = self._target
        readiness, self._readiness = self._readiness, None
        if readiness is not None:
            stop = getattr(self, "_stop_watch", None)
            if stop is not None:
                _stop_watch(stop, readiness)
            else:
                _unwatch(target, self._end, readiness)
        if isinstance(target, Remote):
            try:
                target.call("close", self._end)
            finally:
                target.close()
        else:
            target.closed(self._end)

    def send_bytes(self, buf: Any, offset: int = 0, size: int | None = None) -> None:
        """Send a bytes-like object's bytes (from ``offset``, ``size`` of them)."""
        self._check_closed()
        self._check_writable()
        self._call("send", self._end, bytes(message_view(buf, offset, size)))

    def send(self, obj: Any) -> None:
        """Send a picklable object (pickled here, in the caller)."""
        self._check_closed()
        self._check_writable()
        # With the stdlib's reducers: a socket or stdlib Connection sent
        # through a Pipe arrives as a duplicate descriptor (on one host), as
        # with the stdlib, instead of as a meaningless number.
        self._call("send", self._end, dumps_for_child(obj))

    def recv_bytes(self, maxlength: int | None = None) -> bytes:
        """Receive one message as bytes; ``EOFError`` when the other end is closed."""
        self._check_closed()
        self._check_readable()
        if maxlength is not None and maxlength < 0:
            raise ValueError("negative maxlength")
        blob = self._recv()
        if maxlength is not None and len(blob) > maxlength:
            self.close()
            raise OSError("bad message length")
        return blob

    def recv_bytes_into(self, buf: Any, offset: int = 0) -> int:
        """Receive one message into ``buf`` at byte ``offset``; returns its size.

        ``BufferTooShort`` (whose ``args[0]`` is the message) if it does not fit.
        """
        self._check_closed()
        self._check_readable()
        return receive_into(buf, offset, self._recv)

    def recv(self) -> Any:
        """Receive one object; ``EOFError`` when the other end is closed."""
        self._check_closed()
        self._check_readable()
        return pickle.loads(self._recv())

    def poll(self, timeout: float | None = 0.0) -> bool:
        """Whether ``recv`` would not block, waiting up to ``timeout`` s (None: forever)."""
        self._check_closed()
        self._check_readable()
        return self._call("poll", self._end, timeout)


def Pipe(duplex: bool = True) -> tuple[Connection, Connection]:  # noqa: N802
    """A pair of connected :class:`Connection` ends, usable across the cluster.

    With ``duplex=False`` the first end only receives and the second only sends.
    """
    state = _PipeState()
    server = get_object_server()
    oid = server.add(state)
    ref = (server.address, server.authkey, oid)
    a, b = Connection.__new__(Connection), Connection.__new__(Connection)
    a._setup(ref, 0, True, duplex, state)
    b._setup(ref, 1, duplex, True, state)
    # Served while either end lives here, or any holder is connected.
    a._keep = b._keep = keep = _Keep()
    keep_until_unused(state, keep, oid)
    return a, b


class _Keep:
    """Shared by the owner's two ends: garbage when both are."""


_readiness_lock = threading.Lock()


def _unwatch(state: _PipeState, end: int, readiness: _Readiness) -> None:
    state.unwatch(end, readiness)
    readiness.close()


def _stop_watch(stop: threading.Event, readiness: _Readiness) -> None:
    stop.set()
    readiness.close()  # wakes the watcher, which then exits


_WATCH_SLICE = 1.0  # seconds: how long one long-poll of the owner lasts


def _watch_remote(
    remote: Remote, end: int, readiness: _Readiness, stop: threading.Event
) -> None:
    """A holder's watcher: sets ``readiness`` while the owner has a message or
    EOF for end ``end``, on a connection of its own (the holder's requests
    never wait behind a long-poll)."""
    try:
        while not stop.is_set():
            with readiness.cond:
                while readiness.is_set and not readiness.closed:
                    readiness.cond.wait()
                if readiness.closed:
                    return
            try:
                ready = remote.call("poll", end, _WATCH_SLICE)
            except Exception:  # noqa: BLE001 - the owner is gone: recv says so
                readiness.set(True)
                return
            if ready:
                readiness.set(True)
    finally:
        remote.close()


def wait(object_list: Any, timeout: float | None = None) -> list:
    """Wait till an object in ``object_list`` is ready; return the ready ones.

    ``multiprocessing.connection.wait``: the objects are fiber-dask
    Connections, stdlib Connections, sockets, ``Process.sentinel`` descriptors or
    anything else with a ``fileno()`` (or an int descriptor).  ``timeout`` None
    waits forever; a negative one does not wait.
    """
    object_list = list(object_list)
    deadline = None if timeout is None else time.monotonic() + max(timeout, 0.0)
    while True:
        left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        ready = _select_wait(object_list, left)
        confirmed = [
            o for o in ready if not isinstance(o, Connection) or o._ready_confirmed()
        ]
        if confirmed or len(confirmed) == len(ready):
            return confirmed
        if deadline is not None and time.monotonic() >= deadline:
            return []
