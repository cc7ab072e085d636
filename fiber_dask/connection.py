"""``Pipe()`` and its ``Connection`` ends, usable from any process of the cluster.

The pipe's two message buffers live in the process that called ``Pipe()`` (the
owner); an end passed to another process (a child, a Pool task) talks to the
owner over the authenticated direct channel.  As with an OS pipe, ``recv``
raises ``EOFError`` once the buffer is empty and every copy of the other end
is closed — a copy held by a process that died counts as closed.

Each end object counts as one open copy: pickling an end opens one more (for
whoever unpickles it), and a holder process that exits closes its copies.
"""

from __future__ import annotations

import pickle
import threading
from typing import Any

import cloudpickle

from .objserver import (
    Remote,
    ServedObject,
    get_object_server,
    keep_until_unused,
    resolve,
    wait_for_holder,
)
from .tls import message_view, receive_into

__all__ = ["Pipe", "Connection"]


class _PipeState(ServedObject):
    """The owner's side: ``inbox[e]`` holds the messages end ``e`` receives."""

    def __init__(self) -> None:
        self.inbox: tuple[list, list] = ([], [])
        self.heads = [0, 0]
        self.copies = [1, 1]  # open copies of each end
        self.cond = threading.Condition()

    def _other_gone(self, end: int) -> bool:
        return self.copies[1 - end] <= 0

    def send(self, end: int, blob: bytes) -> None:
        with self.cond:
            if self._other_gone(end):
                raise BrokenPipeError(32, "Broken pipe: the other end is closed")
            self.inbox[1 - end].append(blob)
            self.cond.notify_all()

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
            return blob

    def opened(self, end: int) -> None:
        with self.cond:
            self.copies[end] += 1

    def closed(self, end: int) -> None:
        with self.cond:
            self.copies[end] -= 1
            self.cond.notify_all()

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
        for end in session.get("ends", ()):
            self.closed(end)  # its holder went away without close()


def _rebuild(ref: tuple, end: int, readable: bool, writable: bool) -> Connection:
    conn = Connection.__new__(Connection)
    conn._setup(ref, end, readable, writable, None)
    if isinstance(conn._target, Remote):
        conn._target.call("attach", end)
    return conn


class Connection:
    """One end of a :func:`Pipe`: the ``multiprocessing.connection.Connection`` API."""

    def _setup(self, ref, end, readable, writable, target) -> None:
        self._ref, self._end = ref, end
        self._readable, self._writable = readable, writable
        self._target = target if target is not None else resolve(*ref)
        self._closed = False

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
        raise NotImplementedError(
            "a fiber-dask Connection has no file descriptor (its pipe may live on "
            "another host); use poll(timeout) instead of select/wait on it"
        )

    def close(self) -> None:
        """Close this copy; the other end sees EOF once every copy is closed."""
        if self._closed:
            return
        self._closed = True
        target = self._target
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
        self._call(
            "send", self._end, cloudpickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        )

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
