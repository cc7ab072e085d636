"""TLS on fiber-dask's direct connections, with the certificates Dask uses.

When the cluster uses TLS (a ``tls://`` scheduler, ``distributed.comm.
require-encryption``, a ``distributed.security.Security`` with certificates,
workers started with ``--tls-*``), every direct connection of this program --
channel (Pool loops, Process launchers), object server (Queues, Pipes, Locks)
and Manager -- is TLS too: mutually authenticated by the cluster's CA, with the
authkey HMAC handshake still run on top.  Without TLS nothing changes: plain
``multiprocessing.connection.Connection`` objects, the fast paths as they were.
Which mode and certificate a process uses is decided in
:mod:`fiber_dask.comm.security`; this module holds the connection.

On the wire, a TLS endpoint first sends one length-prefixed frame in clear,
:data:`HELLO`, then runs the TLS handshake.  A plaintext client reads it where
it expects the authkey challenge and fails at once with a
:class:`~fiber_dask.errors.TLSConnectionError` saying so (a stdlib client shows
the text); a TLS client that gets a challenge instead refuses to go on in
clear.  Neither end waits for the other: nothing hangs.

:class:`TLSConnection` is a ``multiprocessing.connection.Connection`` over TLS
(the stdlib's reads and writes the raw file descriptor).  It keeps the TLS
state in an ``ssl.SSLObject`` over memory buffers, touched only under a lock,
so one thread may send while another receives (an ``SSLSocket`` may not be
used so).  It reads the socket one TLS record at a time and never past the end
of a message, so a readable file descriptor still means "a message is coming"
for code that selects on it (a Pool's result thread); :meth:`~TLSConnection.
poll` also sees what is already decrypted.
"""

from __future__ import annotations

import select
import socket
import struct
import threading
import time
from multiprocessing import AuthenticationError, BufferTooShort
from multiprocessing.reduction import ForkingPickler
from typing import Any

from ..errors import TLSConnectionError
from . import security

# Nothing here imports ``ssl`` or ``distributed`` until TLS is in use: a
# process without TLS (a Process child, say) pays nothing for this module.
ssl: Any = None  # the module, imported by _ssl() with the first TLS use


def _ssl() -> Any:
    global ssl
    if ssl is None:
        import ssl as module

        ssl = module
    return ssl


__all__ = [
    "HELLO",
    "HandshakeCut",
    "TLSConnection",
    "connect",
    "handshake_error",
    "is_hello",
    "message_view",
    "receive_into",
    "record_length",
    "required_error",
    "server_object",
]

#: The clear-text frame a TLS endpoint sends before its handshake.  Short
#: enough for any client's bounded first read; says what the client lacks.
HELLO = (
    b"#FIBER-TLS# this fiber-dask endpoint requires TLS (its Dask cluster uses "
    b"TLS): connect with the cluster's TLS settings"
)
_HELLO_TAG = b"#FIBER-TLS#"
_CHALLENGE_TAG = b"CHALLENGE#"  # the end of fiber-dask's and the stdlib's tags

RECORD_HEADER = 5  # bytes of a TLS record's header
_RECORD_MAX = 16384 + 2048  # the largest TLS record body (TLS 1.2 ciphertext)
_PLAIN_MAX = 16384  # the most plaintext one record holds
_CONTENT_TYPES = (20, 21, 22, 23, 24)
_WRITE_CHUNK = 256 * 1024  # plaintext encrypted and sent at a time
_SMALL = 16384  # messages up to this size go in one write with their header


def record_length(head: bytes) -> int:
    """The body length of the TLS record whose 5-byte header is ``head``;
    ``ssl.SSLError`` if it is not a TLS record header."""
    _ssl()
    length = int.from_bytes(head[3:5], "big")
    if head[0] not in _CONTENT_TYPES or length > _RECORD_MAX:
        raise ssl.SSLError(
            f"the peer did not send TLS (got {head!r}): is it configured for TLS?"
        )
    return length


def server_object(context: Any) -> tuple[Any, Any, Any]:
    """``(sslobj, incoming, outgoing)``: the server end of a TLS connection
    over two memory buffers, for a caller that moves the bytes itself (the
    handshake gate; then :meth:`TLSConnection.adopt`)."""
    _ssl()
    inbio, outbio = ssl.MemoryBIO(), ssl.MemoryBIO()
    return context.wrap_bio(inbio, outbio, server_side=True), inbio, outbio


def is_hello(message: bytes) -> bool:
    """Whether a first message is a TLS endpoint's :data:`HELLO`."""
    return bytes(message[: len(_HELLO_TAG)]) == _HELLO_TAG


def _frame(payload: bytes) -> bytes:
    return struct.pack("!i", len(payload)) + payload


def message_view(buf: Any, offset: int = 0, size: int | None = None) -> memoryview:
    """The bytes ``send_bytes(buf, offset, size)`` sends, with the stdlib
    Connection's argument checks and messages."""
    m = memoryview(buf)
    if m.itemsize > 1:
        m = m.cast("B")
    n = m.nbytes
    if offset < 0:
        raise ValueError("offset is negative")
    if n < offset:
        raise ValueError("buffer length < offset")
    if size is None:
        size = n - offset
    elif size < 0:
        raise ValueError("size is negative")
    elif offset + size > n:
        raise ValueError("buffer length < offset + size")
    return m[offset : offset + size]


def receive_into(buf: Any, offset: int, receive: Any) -> int:
    """``recv_bytes_into(buf, offset)`` with the stdlib Connection's checks
    and messages; ``receive()`` reads the message.  Its size, or
    ``BufferTooShort`` (holding the message) when it does not fit."""
    with memoryview(buf) as m:
        bytesize = m.itemsize * len(m)
        if offset < 0:
            raise ValueError("negative offset")
        if offset > bytesize:
            raise ValueError("offset too large")
        data = receive()
        size = len(data)
        if bytesize < offset + size:
            raise BufferTooShort(data)
        with m.cast("B") as flat:
            flat[offset : offset + size] = data
        return size


class HandshakeCut(TLSConnectionError):
    """The server closed the connection before or during the TLS handshake
    without a TLS alert: a gate over its bound of handshakes in progress from
    this host dropped it, or the server went away.  A refused certificate
    comes with an alert (the server sends it: ``_send_alert``), so this is
    no verdict on the certificate; :func:`fiber_dask.comm.channel.connect`
    dials again, as after a cut in the authkey handshake."""


class TLSConnection:
    """``multiprocessing.connection.Connection``'s interface over TLS.

    Same framing as the stdlib's (a 4-byte big-endian length, or -1 and an
    8-byte one), inside the TLS stream.  Made by :meth:`server` (an accepted
    socket) or :func:`connect`; ``fileno()`` is the socket's, for
    ``select``/``poll`` on it and for ``shutdown``.
    """

    def __init__(
        self, sock: socket.socket, context: ssl.SSLContext, server_side: bool
    ) -> None:
        _ssl()
        inbio, outbio = ssl.MemoryBIO(), ssl.MemoryBIO()
        sslobj = context.wrap_bio(inbio, outbio, server_side=server_side)
        self._setup(sock, sslobj, inbio, outbio)

    def _setup(self, sock: socket.socket, sslobj: Any, inbio: Any, outbio: Any) -> None:
        self._sock = sock
        self._fd = sock.fileno()
        self._in = inbio
        self._out = outbio
        self._ssl = sslobj
        self._ssl_lock = threading.Lock()  # the SSL object and its buffers
        self._send_lock = threading.Lock()  # one writer at a time, records in order
        self._recv_lock = threading.Lock()  # one reader at a time
        self._buf = bytearray(_RECORD_MAX)
        self._head = b""  # bytes of the next record's header read so far
        self._left = 0  # bytes of the current record still on the socket
        self._stash = bytearray()  # decrypted by poll(), not yet taken
        self._eof = False
        self._closed = False
        self._lazy: float | None = None  # server handshake still to do (timeout)
        self._broken: BaseException | None = None

    @classmethod
    def server(
        cls, sock: socket.socket, context: ssl.SSLContext, lazy: float | None = None
    ) -> TLSConnection:
        """The server end over an accepted socket.  With ``lazy`` (a timeout)
        the hello and handshake run on first use, in the thread that serves
        the connection (a Manager's accept loop must not wait for a peer);
        else call :meth:`handshake`."""
        conn = cls(sock, context, server_side=True)
        conn._lazy = lazy
        return conn

    @classmethod
    def adopt(
        cls,
        sock: socket.socket,
        sslobj: Any,
        inbio: Any,
        outbio: Any,
        head: bytes = b"",
        left: int = 0,
    ) -> TLSConnection:
        """A connection whose TLS handshake was run elsewhere (by
        :mod:`fiber_dask.comm.gate`) on ``sslobj`` over these memory buffers;
        ``head``/``left``: the part of a record header read so far and the
        bytes of the current record still on the socket."""
        conn = cls.__new__(cls)
        conn._setup(sock, sslobj, inbio, outbio)
        conn._head, conn._left = head, left
        return conn

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"fd={self._fd}"
        return f"<TLSConnection {state}>"

    # ------------------------------------------------------------ handshake

    def handshake(self, timeout: float) -> None:
        """Server: send :data:`HELLO` and run the TLS handshake.  Client
        (from :func:`connect`): run the handshake.  Raises ``ssl.SSLError``,
        ``TimeoutError`` or ``EOFError``."""
        self._lazy = None
        deadline = time.monotonic() + timeout
        sock = self._sock
        try:
            if self._ssl.server_side:
                sock.settimeout(timeout)
                sock.sendall(_frame(HELLO))
            while True:
                try:
                    self._ssl.do_handshake()
                    done = True
                except ssl.SSLWantReadError:
                    done = False
                except ssl.SSLError:
                    self._send_alert()
                    raise
                left = deadline - time.monotonic()
                if left <= 0 and not done:
                    raise TimeoutError(f"TLS handshake took over {timeout:g} s")
                sock.settimeout(max(left, 1.0))
                out = self._out.read()
                if out:
                    sock.sendall(out)
                if done:
                    return
                self._pull()
        finally:
            sock.settimeout(None)

    def _send_alert(self) -> None:
        """Best effort: tell the peer why (the alert OpenSSL queued)."""
        try:
            out = self._out.read()
            if out:
                self._sock.settimeout(1.0)
                self._sock.sendall(out)
        except OSError:
            pass

    def _ready(self) -> None:
        if self._lazy is not None or self._broken is not None:
            with self._send_lock, self._recv_lock:
                if self._broken is not None:
                    raise OSError(f"TLS handshake failed: {self._broken}")
                if self._lazy is not None:
                    try:
                        self.handshake(self._lazy)
                    except BaseException as e:
                        self._broken = e
                        raise

    # ------------------------------------------------------------ reading

    def _pull(self, flags: int = 0) -> None:
        """Move bytes of the current TLS record from the socket into the SSL
        object's input, never past the record's end.  Raises ``EOFError`` at
        the end of the stream, ``BlockingIOError`` if ``flags`` say not to
        wait and nothing is there."""
        if self._left == 0:
            data = self._sock.recv(RECORD_HEADER - len(self._head), flags)
            if not data:
                raise EOFError
            self._head += data
            if len(self._head) < RECORD_HEADER:
                return
            head, self._head = self._head, b""
            self._left = record_length(head)
            with self._ssl_lock:
                self._in.write(head)
            return
        n = self._sock.recv_into(self._buf, min(self._left, len(self._buf)), flags)
        if n == 0:
            raise EOFError
        self._left -= n
        with self._ssl_lock:
            self._in.write(memoryview(self._buf)[:n])

    def _decrypt(self, n: int) -> bytes | None:
        """Up to ``n`` decrypted bytes, b"" at the end of the TLS stream, or
        None if a record must be read first."""
        with self._ssl_lock:
            try:
                data = self._ssl.read(n)
            except ssl.SSLWantReadError:
                data = None
            except ssl.SSLZeroReturnError:
                data = b""
            reply = self._out.pending
        if reply:  # the peer's message asked for an answer (an alert, a key update)
            self._flush()
        return data

    def _flush(self) -> None:
        with self._send_lock:
            with self._ssl_lock:
                out = self._out.read()
            if out:
                self._sock.sendall(out)

    def _read(self, n: int) -> bytes:
        """Exactly ``n`` decrypted bytes (blocking); ``EOFError`` before."""
        chunks = []
        if self._stash:
            taken = bytes(self._stash[:n])
            del self._stash[:n]
            chunks.append(taken)
            n -= len(taken)
        while n:
            data = self._decrypt(min(n, _PLAIN_MAX))
            if data is None:
                if self._eof:
                    raise EOFError
                try:
                    self._pull()
                except EOFError:
                    self._eof = True
                    raise
                continue
            if not data:
                self._eof = True
                raise EOFError
            chunks.append(data)
            n -= len(data)
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def _read_header(self) -> int:
        (size,) = struct.unpack("!i", self._read(4))
        if size == -1:
            (size,) = struct.unpack("!Q", self._read(8))
        return size

    def recv_bytes(self, maxlength: int | None = None) -> bytes:
        """Receive one message (blocking)."""
        self._check_closed()
        if maxlength is not None and maxlength < 0:
            raise ValueError("negative maxlength")
        self._ready()
        with self._recv_lock:
            size = self._read_header()
            if maxlength is not None and size > maxlength:
                raise OSError("bad message length")
            return self._read(size) if size else b""

    def recv_bytes_into(self, buf: Any, offset: int = 0) -> int:
        """Receive one message into ``buf`` at ``offset``; its size.  Raises
        ``BufferTooShort`` (holding the message) when it does not fit."""
        self._check_closed()
        return receive_into(buf, offset, self.recv_bytes)

    def recv(self) -> Any:
        """Receive a pickled object."""
        return ForkingPickler.loads(self.recv_bytes())

    def poll(self, timeout: float | None = 0.0) -> bool:
        """Whether a message (or the end of the stream) is there to read,
        waiting up to ``timeout`` seconds (None: forever).  Looks at what
        is already decrypted or buffered before the socket."""
        self._check_closed()
        self._ready()
        deadline = None if timeout is None else time.monotonic() + max(timeout, 0)
        with self._recv_lock:
            while True:
                if self._stash or self._eof:
                    return True
                data = self._decrypt(_PLAIN_MAX)
                if data is not None:
                    if not data:
                        self._eof = True
                    self._stash += data
                    return True
                try:
                    self._pull(socket.MSG_DONTWAIT)
                    continue
                except (BlockingIOError, InterruptedError):
                    pass
                except EOFError:
                    self._eof = True
                    return True
                except OSError:
                    return True  # the error is the next recv's
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                if not _readable(self._fd, left):
                    return False

    # ------------------------------------------------------------ writing

    def send_bytes(self, buf: Any, offset: int = 0, size: int | None = None) -> None:
        """Send the bytes of a bytes-like object as one message."""
        self._check_closed()
        m = message_view(buf, offset, size)
        size = m.nbytes
        if size > 0x7FFFFFFF:
            header = struct.pack("!iQ", -1, size)
        else:
            header = struct.pack("!i", size)
        self._ready()
        with self._send_lock:
            if size <= _SMALL:
                self._write(header + m)
            else:
                first = _WRITE_CHUNK - len(header)
                self._write(header + m[:first])
                for i in range(first, size, _WRITE_CHUNK):
                    self._write(m[i : i + _WRITE_CHUNK])

    def _write(self, data: Any) -> None:
        with self._ssl_lock:
            self._ssl.write(data)
            out = self._out.read()
        self._sock.sendall(out)

    def send(self, obj: Any) -> None:
        """Send a picklable object."""
        self.send_bytes(ForkingPickler.dumps(obj))

    # ------------------------------------------------------------ the rest

    def _check_closed(self) -> None:
        if self._closed:
            raise OSError("handle is closed")

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def readable(self) -> bool:
        return True

    @property
    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        self._check_closed()
        return self._fd

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._sock.close()

    def __enter__(self) -> TLSConnection:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _readable(fd: int, timeout: float | None) -> bool:
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLPRI)
    ms = None if timeout is None else max(0, int(timeout * 1000 + 0.999))
    while True:
        try:
            return bool(poller.poll(ms))
        except InterruptedError:
            continue


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise EOFError("the peer closed the connection")
        data += chunk
    return data


def connect(
    sock: socket.socket, context: ssl.SSLContext, timeout: float, where: str
) -> TLSConnection:
    """The client end over a connected socket: read the server's
    :data:`HELLO`, run the handshake.  ``where`` names the server in errors.

    Raises :class:`TLSConnectionError` if the server does not use TLS or the
    handshake fails, ``AuthenticationError`` if it speaks neither protocol.
    """
    _ssl()
    try:
        sock.settimeout(timeout)
        try:
            (size,) = struct.unpack("!i", _recv_exact(sock, 4))
            first = _recv_exact(sock, size) if 0 < size <= 256 else b""
        except (TimeoutError, socket.timeout):
            raise AuthenticationError(
                f"{where} sent nothing for {timeout:g} s (not a fiber-dask endpoint?)"
            ) from None
        except (EOFError, ConnectionError) as e:
            raise HandshakeCut(f"{where} closed the connection before its hello") from e
        if not is_hello(first):
            if _CHALLENGE_TAG in first:
                raise TLSConnectionError(
                    f"{where} does not use TLS, but this process's Dask cluster does "
                    f"({security.mode_source()}): refusing to send data in clear. The process "
                    "that owns the endpoint must use the same Dask security settings."
                )
            raise AuthenticationError(f"{where} did not speak the fiber-dask handshake")
        conn = TLSConnection(sock, context, server_side=False)
        try:
            conn.handshake(timeout)
        except (EOFError, ConnectionError, ssl.SSLEOFError) as e:
            raise HandshakeCut(
                f"{where} closed the connection during the TLS handshake without "
                "an alert (overloaded, or it did not accept this process's "
                "certificate)"
            ) from e
        except ssl.SSLError as e:
            raise TLSConnectionError(
                f"TLS handshake with {where} failed ({e.reason or e}): are both "
                "certificates signed by the cluster's CA?"
            ) from e
        return conn
    except BaseException:
        sock.close()
        raise


def required_error(where: str) -> TLSConnectionError:
    """The error of a client without TLS that got a TLS endpoint's
    :data:`HELLO`; ``where`` names the endpoint."""
    return TLSConnectionError(
        f"{where} requires TLS (its Dask cluster uses TLS) but this process has "
        f"no TLS for its direct connections ({security.mode_source()}): give it the "
        "cluster's TLS settings (distributed.comm.tls.*, require-encryption)"
    )


def handshake_error(e: BaseException, where: str) -> BaseException:
    """A clearer error for an ``ssl.SSLError`` raised after the handshake (TLS
    1.3 clients hear that their certificate was refused only then)."""
    if ssl is not None and isinstance(e, ssl.SSLError):
        err = TLSConnectionError(
            f"TLS connection to {where} failed ({e.reason or e}): the server did not "
            "accept this process's certificate (not signed by the cluster's CA?)"
        )
        err.__cause__ = e
        return err
    return e
