"""Serving objects owned by this process to the other processes of a program.

A Queue or Pipe lives in the process that created it (its *owner*), as the
stdlib's live in the OS pipes of the machine that made them.  Other processes
(children on other hosts, Pool tasks) hold small references that pickle as the
owner's channel address plus an object id, and talk to the owner over the
authenticated direct channel::

    holder process                         owner process
    Queue ref ── connect("objects",   ──►  ObjectServer ─ thread per connection
                 hello=object id)          └─ obj.serve(op, args) ─► reply
    In the owner itself the same object is used directly, without a socket.

One connection per (holder process, object); requests on it are answered in
order, so one producer's puts stay FIFO.  A holder that dies drops its
connection, which the object hears about (``disconnected``): a Pipe end then
counts one holder less, a Queue puts back an item it was about to hand over.
"""

from __future__ import annotations

import itertools
import logging
import os
import pickle
import select
import socket
import threading
import time
import uuid
import weakref
from multiprocessing.connection import Connection
from typing import Any

from . import channel, security

__all__ = [
    "ObjectServer",
    "Remote",
    "get_object_server",
    "NO_REPLY",
    "ServedObject",
    "wait_for_holder",
]

logger = logging.getLogger(__name__)

SERVICE = "objects"
_TCP_CORK = getattr(socket, "TCP_CORK", None)
NO_REPLY = object()


_HANGUP = select.POLLHUP | select.POLLERR | getattr(select, "POLLRDHUP", 0)
_WAIT_SLICE = 1.0  # seconds between looks at a waiting holder's connection


def holder_gone(session: dict) -> bool:
    """Whether the holder of this session hung up or became unreachable (its
    connection got a FIN or reset, or timed out), even while one of its
    requests is still being served."""
    fd = session.get("fd")
    if fd is None:
        return False
    poller = select.poll()
    poller.register(fd, _HANGUP)
    try:
        return bool(poller.poll(0))
    except OSError:
        return True


def wait_for_holder(
    cond: threading.Condition, predicate: Any, timeout: float | None, session: Any
) -> bool:
    """``cond.wait_for(predicate, timeout)`` for a request of a holder, which
    raises ``EOFError`` if the holder goes away meanwhile.

    A served request that blocks (a Pipe's ``recv``) keeps its connection's
    thread from reading the socket, so the end of the connection is not seen
    there; without this, what the holder leaves behind (its copy of a pipe
    end) would stay open for as long as it waits: forever for a dead process.
    ``session`` None (the owner's own call) waits as ``wait_for``.
    """
    if session is None:
        return cond.wait_for(predicate, timeout)
    deadline = None if timeout is None else time.monotonic() + timeout
    while not predicate():
        if holder_gone(session):
            raise EOFError("the process that made this request is gone")
        left = _WAIT_SLICE
        if deadline is not None:
            left = min(left, deadline - time.monotonic())
            if left <= 0:
                return False
        cond.wait(left)
    return True


class ServedObject:
    """Base of objects an ObjectServer serves.  ``serve`` runs in the
    connection's thread and may block (a ``get`` waiting for an item).

    ``session`` is per connection: an object keeps there what it handed to a
    holder and was not yet acknowledged, to take it back in ``disconnected``.
    """

    connections = 0  # holders connected now
    orphaned = False  # the owner's handle is garbage: drop when unused

    def serve(self, op: str, args: tuple, session: dict) -> Any:
        raise NotImplementedError

    def call(self, op: str, *args: Any) -> Any:
        """``op(*args)`` on this object, in its owner: the same call a
        holder's :meth:`Remote.call` makes over the channel, so a handle calls
        its target alike wherever it is."""
        return getattr(self, op)(*args)

    def serve_raw(self, raw: bytes, session: dict) -> None:
        """A one-way message that is not a pickle (its first byte says what)."""
        raise ValueError(f"unexpected raw message {raw[:1]!r}")

    def disconnected(self, session: dict) -> None:
        """A holder's connection ended (closed, or its process died)."""


class ObjectServer:
    """This process's object service on its channel server."""

    def __init__(self, host: str, authkey: bytes) -> None:
        self.server = channel.get_server(host, authkey)
        self.authkey = authkey
        self._objects: dict[str, ServedObject] = {}
        self._lock = threading.Lock()
        self._prefix = uuid.uuid4().hex[:8]
        self._ids = itertools.count()
        self.server.register(SERVICE, self._on_connect)

    @property
    def address(self) -> tuple[str, int]:
        return self.server.address

    def add(self, obj: ServedObject) -> str:
        oid = f"{self._prefix}-{next(self._ids)}"
        with self._lock:
            self._objects[oid] = obj
        return oid

    def get(self, oid: str) -> ServedObject | None:
        with self._lock:
            return self._objects.get(oid)

    def discard(self, oid: str) -> None:
        with self._lock:
            self._objects.pop(oid, None)

    def _on_connect(self, conn: Any, hello: Any) -> None:
        obj = self.get(hello)
        if obj is None:
            channel.hangup(conn)
            return
        threading.Thread(
            target=_serve_connection,
            args=(obj, conn, self, hello),
            name="fiber-objects",
            daemon=True,
        ).start()


def _serve_connection(
    obj: ServedObject, conn: Any, server: ObjectServer, oid: str
) -> None:
    session: dict = {"fd": conn.fileno()}
    with server._lock:
        obj.connections += 1
    try:
        while True:
            try:
                raw = conn.recv_bytes()
            except (EOFError, OSError):
                return
            if raw[:1] != b"\x80":
                # A raw one-way message (no pickle, no reply): the hot path of
                # pipelined puts and acknowledgements.
                obj.serve_raw(raw, session)
                raw = None  # not held while waiting for the next message
                continue
            op, *args = pickle.loads(raw)  # an authenticated peer's plain tuple
            raw = None
            try:
                reply = (True, obj.serve(op, tuple(args), session))
            except Exception as e:  # the error travels back to the caller
                reply = (False, e)
            if reply[1] is NO_REPLY:
                continue
            try:
                conn.send_bytes(pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL))
            except OSError:
                return
    finally:
        try:
            obj.disconnected(session)
        finally:
            channel.hangup(conn)
            with server._lock:
                obj.connections -= 1
                if obj.orphaned and not obj.connections:
                    server._objects.pop(oid, None)


_object_server: ObjectServer | None = None
_object_server_lock = threading.Lock()


def get_object_server() -> ObjectServer:
    """This process's object server, started on first use."""
    global _object_server
    with _object_server_lock:
        if _object_server is None or _object_server.server._closed:
            from .. import cluster

            _object_server = ObjectServer(cluster.listen_host(), security.authkey())
        return _object_server


class Remote:
    """A holder's connection to one object in another process.

    Thread-safe: one request at a time, replies in order.
    """

    def __init__(self, address: tuple[str, int], authkey: bytes, oid: str) -> None:
        self.address, self.authkey, self.oid = tuple(address), authkey, oid
        self._conn: Any = None
        self._raw = False  # a plain Connection: acks may be written to its fd
        self._corked = False
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._pid = os.getpid()

    def _connection(self) -> Any:
        if self._conn is None or self._pid != os.getpid():
            self._pid = os.getpid()
            self._conn = channel.connect(self.address, self.authkey, SERVICE, self.oid)
            self._raw = type(self._conn) is Connection  # not a TLSConnection
            self._corked = False
            self._sock = None
        return self._conn

    def _uncorked(self) -> Any:
        """The connection, with any corked acks sent: before a request."""
        conn = self._connection()
        if self._corked:
            self._set_cork(conn, False)
            self._corked = False
        return conn

    def call(self, op: str, *args: Any) -> Any:
        """Send a request and wait for its reply; re-raise a remote error."""
        msg = pickle.dumps((op, *args), protocol=pickle.HIGHEST_PROTOCOL)
        with self._lock:
            conn = self._uncorked()
            try:
                conn.send_bytes(msg)
                ok, value = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError) as e:
                self._drop()
                raise _owner_gone(self) from e
            except BaseException:
                # Interrupted mid-request (Ctrl-C): the reply would be read as
                # the next call's.  A new connection starts clean, and the
                # owner puts back an item it could not deliver.
                self._drop()
                raise
        if ok:
            return value
        raise value

    def send(self, op: str, *args: Any) -> None:
        """Send a request that has no reply (pipelined)."""
        self.send_raw(pickle.dumps((op, *args), protocol=pickle.HIGHEST_PROTOCOL))

    def send_raw(self, msg: bytes) -> None:
        """Send one message as is: a pickled request, or a raw one-way message
        (see ``ServedObject.serve_raw``)."""
        with self._lock:
            conn = self._uncorked()
            try:
                conn.send_bytes(msg)
            except OSError as e:
                self._drop()
                raise _owner_gone(self) from e

    _ACK_FRAME = len(b"A").to_bytes(4, "big") + b"A"

    def ack(self, more_coming: bool = False) -> None:
        """The raw one-way message ``b"A"``, framed once and written directly:
        the hot path of a consumer taking leased items.  ``more_coming``: the
        caller holds more leased items, so the ack may wait for the next one
        or the next request (corked) instead of costing a packet of its own."""
        with self._lock:
            conn = self._connection()
            try:
                if more_coming and not self._corked:
                    # Acks wait in the kernel's send buffer (they are ours the
                    # moment they are written: a killed process's buffer is
                    # still sent) and go together with the next request.
                    self._set_cork(conn, True)
                    self._corked = True
                if not self._raw:  # TLS: the frame must be encrypted
                    conn.send_bytes(b"A")
                elif os.write(conn.fileno(), self._ACK_FRAME) != len(self._ACK_FRAME):
                    raise OSError("short write")
            except OSError as e:
                self._drop()
                raise _owner_gone(self) from e

    def _set_cork(self, conn: Any, on: bool) -> None:
        """TCP_CORK (Linux): hold small writes in the send buffer until
        uncorked (or 200 ms).  Elsewhere a no-op: each write goes at once.
        (Under TLS the corked writes are whole encrypted records.)"""
        if _TCP_CORK is None:
            return
        if self._sock is None:  # a socket object on a dup of the fd, kept
            self._sock = socket.socket(fileno=os.dup(conn.fileno()))
        self._sock.setsockopt(socket.IPPROTO_TCP, _TCP_CORK, 1 if on else 0)

    def _drop(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._conn is not None:
            channel.hangup(self._conn)
            self._conn = None

    def close(self) -> None:
        with self._lock:
            self._drop()


def _owner_gone(remote: Remote) -> ConnectionError:
    host, port = remote.address
    return ConnectionError(
        f"the process that owns this object ({host}:{port}) is gone or unreachable; "
        "a Queue or Pipe lives as long as the process that created it"
    )


def resolve(
    address: tuple[str, int], authkey: bytes, oid: str
) -> ServedObject | Remote:
    """The object itself when this process owns it, else a Remote to it."""
    server = _object_server
    if server is not None and tuple(server.address) == tuple(address):
        obj = server.get(oid)
        if obj is not None:
            return obj
    return Remote(address, authkey, oid)


def keep_until_unused(obj: ServedObject, owner: Any, oid: str) -> None:
    """Serve ``obj`` until ``owner`` (the owner's handle) is garbage and no
    holder is connected any more."""
    server = get_object_server()

    def orphaned() -> None:
        with server._lock:
            obj.orphaned = True
            if not obj.connections:
                server._objects.pop(oid, None)

    weakref.finalize(owner, orphaned)
