"""The direct channel: authenticated, framed byte connections between processes.

Dask's own comms go through the scheduler's bookkeeping and batched messages
(10-25 ms per sequential round trip on a small machine).  fiber-dask keeps Dask
for placement, scaling and re-running lost work, and moves the data of Pools
(and later Queues, Pipes and Managers) over plain TCP connections between the
process that owns an object and the processes that use it::

    parent process                                  Dask worker process
    ┌──────────────────────────┐                    ┌───────────────────────┐
    │ ChannelServer            │ ◄──── connect ──── │ connect(address, ...)  │
    │  the process's gate      │  mutual HMAC auth  │                        │
    │  (accepts, authenticates) ──► service handler │                        │
    │  (e.g. a Pool's          │ ◄── frames ──────► │ pool-worker loop       │
    │   result thread)         │                    │                        │
    └──────────────────────────┘                    └───────────────────────┘

Security: nothing is unpickled before the peer has proved it knows the authkey.
Both sides challenge each other with HMAC-SHA256 over random nonces (the scheme
of ``multiprocessing.connection``, with a modern digest, pipelined: the client
answers the server's challenge and sends its own and its hello in one burst,
the server proves itself and answers the hello in one), so neither a stranger
nor an impostor server can feed us pickles.  The authkey itself travels to the
workers inside the Dask task, i.e. over Dask's comm (encrypted when Dask's TLS
is configured).  When the cluster uses TLS, so do these connections (see
:mod:`fiber_dask.comm.tls`): the server sends a clear-text hello, both ends run a
TLS handshake with the cluster's certificates, and the HMAC handshake and all
frames then go inside TLS.  A server's mode is fixed when it starts, a
client's when it connects; a mismatch fails at once with
:class:`~fiber_dask.errors.TLSConnectionError`.

Accepting and the server's side of the handshake are
:mod:`fiber_dask.comm.gate`'s (one thread for every listener, a deadline on the
whole handshake, a bound on stalled peers per address); the server's protocol
is :meth:`ChannelServer._serve_handshake`, the client's :func:`connect`.

Frames are ``multiprocessing.connection.Connection`` byte messages (4-byte
length prefix), which stdlib code already trusts, on sockets with TCP_NODELAY
and keep-alive so a vanished host is noticed without Dask's help.
"""

from __future__ import annotations

import hmac
import logging
import os
import pickle
import socket
import struct
import threading
import time
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection
from typing import Any, Callable

from .. import cluster
from ..transparency import privaterandom
from . import gate, security, tls

logger = logging.getLogger(__name__)

__all__ = [
    "ChannelServer",
    "FrameReader",
    "connect",
    "get_server",
    "ChannelError",
    "Unreachable",
]

_NONCE = 32
_CHALLENGE = b"#FIBER-CHALLENGE#"
_WELCOME = b"#FIBER-WELCOME#"
_FAILURE = b"#FIBER-FAILURE#"
#: The first and the longest pause between redials of a cut handshake.
_REDIAL_PAUSE = (0.05, 1.0)
#: Seconds a client waits for each step of its handshake; a server's whole
#: handshake is bounded by :data:`fiber_dask.comm.gate.HANDSHAKE_TIMEOUT`.
HANDSHAKE_TIMEOUT = gate.HANDSHAKE_TIMEOUT
_HELLO_MAX = 1 << 20  # an authenticated peer's hello: small plain data

Handler = Callable[[Connection, Any], None]


class ChannelError(ConnectionError):
    """A direct-channel connection could not be made or was refused."""


class Unreachable(ChannelError):
    """The server's address cannot be reached from this host, or the
    connection stalled before the handshake finished (an address valid only
    on the server's own host, a firewall, a partition; or the server exited).

    The one test of "the owner cannot be reached" for every Dask task that
    connects back to the process that submitted it (a pool's loops, a
    Process's launcher): other :class:`ChannelError` errors mean the server
    answered and the service is gone.
    """


def _digest(authkey: bytes, message: bytes) -> bytes:
    return hmac.new(authkey, message, "sha256").digest()


def _recv_small(conn: Connection, timeout: float) -> bytes:
    if not conn.poll(timeout):
        raise AuthenticationError(
            f"peer sent nothing for {timeout:g} s during the handshake"
        )
    _read_timeout(conn, timeout)  # a partial frame cannot hold us forever
    return conn.recv_bytes(256)  # a bounded read: large junk is rejected


def _read_timeout(conn: Any, timeout: float | None) -> None:
    """Bound each read of ``conn``'s socket (SO_RCVTIMEO), or lift the bound."""
    seconds = 0.0 if timeout is None else max(timeout, 0.001)
    value = struct.pack("ll", int(seconds), int(seconds % 1 * 1e6))
    try:
        s = socket.socket(fileno=os.dup(conn.fileno()))
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, value)
        finally:
            s.close()
    except OSError:
        pass


class _Cut(Exception):
    """The server closed the connection during the handshake without saying
    why (no verdict): :func:`connect` dials again."""


def _client_handshake(
    conn: Connection,
    authkey: bytes,
    service: str,
    hello: Any,
    timeout: float,
    where: str,
) -> bytes:
    """The client's side of the handshake (the server's is
    :meth:`ChannelServer._serve_handshake`); returns the server's answer
    about ``service`` (``OK`` or ``NOSERVICE``).

    Pipelined, so a connect waits for the server one and a half round trips
    (its challenge, then its proof and answer) instead of three and a half:
    the answer to the server's challenge, our own challenge and the hello go
    in one burst.  Nothing the server sends is trusted (nor ever unpickled)
    before it has proved it knows the authkey; the hello it gets early is
    plain metadata (a pid, a worker address, a slot number, the service
    name), which the server reads only once *we* have proved the key.
    """
    try:
        message = _recv_small(conn, timeout)
    except (EOFError, ConnectionError) as e:
        raise _Cut("before its challenge") from e
    if not message.startswith(_CHALLENGE):
        if tls.is_hello(message):
            raise tls.required_error("the fiber-dask endpoint")
        raise AuthenticationError("peer did not speak the fiber-dask handshake")
    nonce = os.urandom(_NONCE)
    try:
        conn.send_bytes(_digest(authkey, message[len(_CHALLENGE) :]))
        conn.send_bytes(_CHALLENGE + nonce)
        conn.send_bytes(pickle.dumps((service, hello)))
    except ConnectionError:
        # A server that rejects our digest sends its verdict and closes the
        # connection at once, possibly while the rest of the burst is still
        # on its way: the verdict is read all the same (what arrived before
        # the reset stays readable).
        pass
    try:
        verdict = _recv_small(conn, timeout)
    except (EOFError, ConnectionError) as e:
        # Closed without a verdict: a gate over its bound of handshakes in
        # progress from this host dropped us (many processes of one host
        # connecting at once), or the server went away.
        raise _Cut("after our answer, without a verdict") from e
    if verdict == _FAILURE:
        raise AuthenticationError("digest sent was rejected (wrong authkey?)")
    if verdict != _WELCOME:
        raise AuthenticationError("peer did not speak the fiber-dask handshake")
    if not hmac.compare_digest(_recv_small(conn, timeout), _digest(authkey, nonce)):
        raise AuthenticationError("digest received was wrong (wrong authkey?)")
    if not conn.poll(timeout):
        raise ChannelError(f"handshake with {where} timed out")
    return conn.recv_bytes(64)


def peer_timeout() -> float:
    """``fiber.peer-timeout`` in seconds: how long a peer host may stay silent."""
    from .. import config

    try:
        return max(1.0, config.timedelta("peer-timeout"))
    except Exception:  # an old or broken config must not break the channel
        return 30.0


def tune(sock: socket.socket) -> None:
    """TCP_NODELAY and keep-alive with ``fiber.peer-timeout`` on a connection."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    # With T = fiber.peer-timeout (30 s by default): a peer host that vanishes
    # without a FIN is detected within about T on an idle connection
    # (keep-alive probes from T/3 on), and a send to a host that stopped
    # acknowledging fails after T instead of the kernel's ~15 minutes of
    # retransmissions.
    timeout = peer_timeout()
    options = (
        ("TCP_KEEPIDLE", max(1, int(timeout / 3))),
        ("TCP_KEEPINTVL", max(1, int(timeout / 6))),
        ("TCP_KEEPCNT", 3),
        ("TCP_USER_TIMEOUT", int(timeout * 1000)),
    )
    for name, value in options:
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


class ChannelServer:
    """Listen for authenticated connections and hand them to named services.

    Accepting and authenticating is :mod:`fiber_dask.comm.gate`'s: a peer that
    does not complete the handshake in time, or stalls among too many from
    its address, is dropped there without holding a thread or the accepts.

    Parameters
    ----------
    host : str
        Interface to listen on.  Never a wildcard unless the user configured one.
    authkey : bytes
        Shared secret the peers must prove they know.
    context : ssl.SSLContext, optional
        Serve TLS with this context (see :mod:`fiber_dask.comm.tls`); None: plain.
    """

    def __init__(self, host: str, authkey: bytes, context: Any = None) -> None:
        self.authkey = bytes(authkey)
        self.context = context
        self._services: dict[str, tuple[Handler, bool]] = {}
        self._lock = threading.Lock()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, 0))
        self._sock.listen(512)
        self.address: tuple[str, int] = self._sock.getsockname()[:2]
        self._closed = False
        self._gate = gate.get_gate()
        self._gate.listen(
            self._sock,
            self._serve_handshake,
            self._on_ready,
            context,
            tune,
            inline=lambda accepted: accepted[3],
        )

    def __repr__(self) -> str:
        tls_ = " tls" if self.context is not None else ""
        return f"<ChannelServer{tls_} {self.address[0]}:{self.address[1]}>"

    def register(self, service: str, handler: Handler, *, inline: bool = False) -> None:
        """Route authenticated connections whose hello names ``service``.

        ``inline``: ``handler`` only hands the connection on and never blocks;
        it runs on the gate's thread instead of a thread of its own (see
        :meth:`fiber_dask.comm.gate.Gate.listen`)."""
        with self._lock:
            self._services[service] = (handler, inline)

    def unregister(self, service: str) -> None:
        with self._lock:
            self._services.pop(service, None)

    def _serve_handshake(self) -> gate.Handshake:
        """The server's side of the handshake, run by the gate: challenge the
        peer; once it has proved the key (and only then trusting it with
        pickle), read its challenge and hello, and answer both at once (see
        :func:`_client_handshake` for the client's side)."""
        authkey = self.authkey
        nonce = os.urandom(_NONCE)
        yield gate.frame(_CHALLENGE + nonce)
        response = yield from gate.recv_frame()
        if not hmac.compare_digest(response, _digest(authkey, nonce)):
            yield gate.frame(_FAILURE)
            raise AuthenticationError("digest received was wrong (wrong authkey?)")
        yield gate.AUTHENTICATED  # out of its host's bound on stalled peers
        message = yield from gate.recv_frame()
        if not message.startswith(_CHALLENGE):
            raise AuthenticationError("peer did not speak the fiber-dask handshake")
        # Authenticated: only now is the peer trusted with pickle.
        service, hello = pickle.loads((yield from gate.recv_frame(_HELLO_MAX)))
        with self._lock:
            handler, inline = self._services.get(service, (None, False))
        proof = gate.frame(_WELCOME) + gate.frame(
            _digest(authkey, message[len(_CHALLENGE) :])
        )
        if handler is None:
            yield proof + gate.frame(b"NOSERVICE")
            raise gate.Refused(f"no service {service!r}")
        yield proof + gate.frame(b"OK")
        return handler, service, hello, inline

    def _on_ready(self, conn: Any, accepted: tuple) -> None:
        handler, service, hello, _ = accepted
        try:
            handler(conn, hello)
        except Exception:  # a handler bug must not kill the server
            logger.exception(
                "fiber-dask: service %r failed on a new connection", service
            )
            conn.close()

    def close(self) -> None:
        self._closed = True
        self._gate.close_listener(self._sock)


def dial(
    host: str,
    port: int,
    timeout: float,
    where: str,
    unreachable: Callable[[OSError], Exception],
) -> Any:
    """A tuned client connection to ``host:port``, ready for an authkey
    handshake: TLS when this process's cluster uses it (the server's hello
    read and the TLS handshake done; ``where`` names the server in errors,
    see :func:`fiber_dask.comm.tls.connect`), else a plain ``Connection``.  A
    failed TCP connect raises ``unreachable(e)`` from ``e``."""
    context = security.client_context()
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except OSError as e:
        raise unreachable(e) from e
    try:
        tune(sock)
        if context is None:
            sock.settimeout(None)
            return Connection(sock.detach())
    except OSError:
        sock.close()
        raise
    return tls.connect(sock, context, timeout, where)


def connect(
    address: tuple[str, int],
    authkey: bytes,
    service: str,
    hello: Any = None,
    timeout: float | None = None,
    *,
    redial_for: float | None = None,
) -> Connection:
    """Connect to a :class:`ChannelServer`, authenticate, and open ``service``.

    ``timeout`` bounds the connection attempt and each handshake step; default
    ``fiber.peer-timeout``.  A handshake the server cuts without a verdict (its
    gate drops the oldest of too many handshakes in progress from one host, as
    when hundreds of processes of one host connect at once) is dialled again,
    after a jittered pause from 50 ms doubling up to 1 s, for up to
    ``redial_for`` seconds (default ``timeout``); nothing is unpickled before
    the server has proved the key, so a redial costs only time.  Raises
    :class:`Unreachable` when the server cannot be reached,
    :class:`ChannelError` (a ``ConnectionError``, the base of both) when it
    has no such service,
    ``multiprocessing.AuthenticationError`` when the authkeys differ, and
    :class:`~fiber_dask.errors.TLSConnectionError` when one end uses TLS and
    the other does not (or their certificates do not match).
    """
    host, port = address
    if timeout is None:
        timeout = peer_timeout()
    deadline = time.monotonic() + (timeout if redial_for is None else redial_for)
    pause, cuts = _REDIAL_PAUSE[0], 0
    while True:
        try:
            return _connect_once(host, port, authkey, service, hello, timeout)
        except _Cut as e:
            cuts += 1
            if time.monotonic() + pause > deadline:
                raise Unreachable(
                    f"{host}:{port} cut the handshake {cuts} time(s), the last "
                    f"{e}: it is overloaded (more processes of this host "
                    "connecting at once than it takes), or not a fiber-dask "
                    "endpoint"
                ) from e.__cause__
        time.sleep(pause * (0.5 + privaterandom.rng.random()))
        pause = min(_REDIAL_PAUSE[1], pause * 2)


def _connect_once(
    host: str, port: int, authkey: bytes, service: str, hello: Any, timeout: float
) -> Connection:
    try:
        conn = dial(
            host,
            port,
            timeout,
            f"{host}:{port}",
            lambda e: Unreachable(
                f"cannot reach the fiber-dask channel at {host}:{port}: {e}. "
                "The process that owns this object must be reachable from this "
                "host; set fiber.listen-host to an address the workers can "
                "connect to."
            ),
        )
    except tls.HandshakeCut as e:
        raise _Cut(
            "in its TLS part, without an alert (if every dial ends so, it may "
            "not accept this process's certificate)"
        ) from e
    try:
        answer = _client_handshake(
            conn, authkey, service, hello, timeout, f"{host}:{port}"
        )
        _read_timeout(conn, None)  # the connection's own reads wait as long as needed
    except (BlockingIOError, TimeoutError) as e:
        conn.close()
        raise Unreachable(
            f"the handshake with {host}:{port} stalled for over {timeout:g} s "
            "(not a fiber-dask endpoint, or it is overloaded)"
        ) from e
    except _Cut:
        conn.close()
        raise
    except BaseException as e:
        conn.close()
        err = tls.handshake_error(e, f"{host}:{port}")
        if err is e:
            raise
        raise err from e
    if answer != b"OK":
        conn.close()
        raise ChannelError(
            f"{host}:{port} has no service {service!r} (it was closed or finished)"
        )
    return conn


_servers: dict[tuple[str, bytes, Any], ChannelServer] = {}
_server_lock = threading.Lock()


def get_server(host: str, authkey: bytes, client: Any = None) -> ChannelServer:
    """This process's channel server on ``host``, started on first use; TLS
    if this process's cluster (or ``client``'s, for an object made for that
    client's cluster) uses TLS (see :mod:`fiber_dask.comm.tls`)."""
    context = security.server_context(client)
    key = (host, authkey, id(context) if context is not None else None)
    with _server_lock:
        server = _servers.get(key)
        if server is None:
            server = _servers[key] = ChannelServer(host, authkey, context)
        return server


def close_servers() -> None:
    """Stop this process's channel servers (at shutdown)."""
    with _server_lock:
        for server in _servers.values():
            server.close()
        _servers.clear()


# Whoever made a server (a Pool, a Process, a Queue, a Manager's proxies), the
# servers close once the clusters have: the transport goes last.
cluster.on_shutdown(close_servers, after_close=True)


def hangup(conn: Connection) -> None:
    """Shut a connection down and close it.

    ``close()`` alone does not wake a thread blocked reading the same socket on
    Linux; ``shutdown`` does (the reader sees EOF), so no reader thread leaks.
    """
    try:
        fd = conn.fileno()
    except OSError:
        return
    try:
        s = socket.socket(fileno=os.dup(fd))
        try:
            s.shutdown(socket.SHUT_RDWR)
        finally:
            s.close()
    except OSError:
        pass
    conn.close()


_HEADER = struct.Struct("!i")
_LONG_HEADER = struct.Struct("!Q")
#: Bytes of a :class:`FrameReader`'s buffer, and room it keeps for one read.
_BUFFER = 1 << 18
_MIN_READ = 1 << 16


class FrameReader:
    """Every complete frame a connection holds, read in one system call.

    ``Connection.recv_bytes`` makes two reads per frame (the length, then the
    body); a peer that sends often (a pool's loops answering chunks) leaves
    several frames waiting by the time a busy reader gets to it, and this
    takes them all with one read of what the socket holds, into a buffer it
    keeps (an ``os.read`` of 256 KB allocated and shrank a bytes object every
    time: 9 us a read, against 1 us into a kept buffer).  Call
    :meth:`frames` when the connection is readable (a selector said so, or
    from a thread that may block): it reads once.  The frames are those of
    ``Connection.send_bytes`` (4-byte big-endian length, or -1 and an 8-byte
    length for frames of 2 GiB and more).

    A TLS connection (:class:`fiber_dask.comm.tls.TLSConnection`) is read frame by
    frame with its own ``recv_bytes``, as long as it holds decrypted data.
    """

    __slots__ = ("_conn", "_fd", "_buf", "_view", "_start", "_end", "_need")

    def __init__(self, conn: Any) -> None:
        self._conn = conn
        self._fd = conn.fileno() if isinstance(conn, Connection) else None
        self._buf = bytearray(_BUFFER)
        self._view = memoryview(self._buf)
        self._start = self._end = 0  # the bytes read and not yet framed
        self._need = 0  # bytes from _start that the frame begun there needs

    def frames(self) -> list[bytes]:
        """The frames received so far (possibly none: a frame's start only).

        Raises ``EOFError`` once the peer has hung up (a frame cut short by
        the hang-up is dropped), ``OSError`` when the connection fails.
        """
        if self._fd is None:
            conn = self._conn
            out = [conn.recv_bytes()]
            while conn.poll(0):
                out.append(conn.recv_bytes())
            return out
        self._make_room()
        n = os.readv(self._fd, [self._view[self._end :]])
        if not n:
            raise EOFError("the peer hung up")
        self._end += n
        buf, view = self._buf, self._view
        out = []
        pos, end = self._start, self._end
        while end - pos >= 4:
            (size,) = _HEADER.unpack_from(buf, pos)
            start = pos + 4
            if size == -1:
                if end - pos < 12:
                    break
                (size,) = _LONG_HEADER.unpack_from(buf, start)
                start += 8
            if end - start < size:
                self._need = start + size - pos
                break
            out.append(bytes(view[start : start + size]))
            pos = start + size
        else:
            self._need = 0
        if pos == end:
            pos = self._end = 0
            if len(buf) > 4 * _BUFFER:  # a large frame is through: let it go
                self._resize(_BUFFER)
        self._start = pos
        return out

    def _make_room(self) -> None:
        """Free space after the unread bytes for the frame begun, or at least
        ``_MIN_READ``: move them to the front, or grow the buffer."""
        unread = self._end - self._start
        room = max(_MIN_READ, self._need - unread)
        if len(self._buf) - self._end >= room:
            return
        if unread + room <= len(self._buf):
            # memoryview copies move overlapping ranges safely (memmove)
            self._view[:unread] = self._view[self._start : self._end]
        else:
            self._resize(unread + room, keep=(self._start, self._end))
        self._start, self._end = 0, unread

    def _resize(self, size: int, keep: tuple[int, int] = (0, 0)) -> None:
        buf = bytearray(size)
        buf[: keep[1] - keep[0]] = self._view[keep[0] : keep[1]]
        self._view.release()
        self._buf, self._view = buf, memoryview(buf)
