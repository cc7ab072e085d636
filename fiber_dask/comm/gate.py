"""The handshake gate: where connections to fiber-dask's listeners wait until
their peer has authenticated.

Every fiber-dask endpoint that accepts connections from the network — the
direct channel (Pool loops, Process launchers, Queues, Pipes, Locks) and a
Manager's server — hands its listening socket to this process's one gate.  One
thread accepts and runs every handshake in progress at once, driven by a
selector; a connection leaves it only once its peer has proved it knows the
authkey, and then goes to its service in a thread of its own::

    listening sockets ──► gate thread (selector) ──────────────► on_ready(conn)
                          accept (never blocks)                  in a new thread:
                          TLS handshake, HMAC challenges,        the service
                          a bounded hello, each with a deadline   (trusted peer)

What an unauthenticated peer can cost, and no more:

* **a whole-handshake deadline**: :data:`HANDSHAKE_TIMEOUT` from the accept to
  the end of the handshake — bytes, frames and the TLS handshake alike; a
  peer that sends a partial frame (or a byte at a time) does not extend it;
* **a bound per peer address**: at most :data:`MAX_PER_PEER` handshakes
  older than :data:`MIN_AGE` from one host whose peer has not proved it
  knows the authkey yet (a burst of real clients from one big host is let
  in; the idle ones beyond the bound are closed, oldest first), and
  :data:`MAX_PENDING` in all (a new connection beyond it closes the oldest).
  A real client proves the key in one round trip, so it always gets in while
  stalled sockets are dropped: an attacker would have to keep opening
  connections faster than a round trip.  A handshake that yields
  :data:`AUTHENTICATED` (its peer proved the key) no longer counts against
  the bound — a thousand pool loops of one host finishing their handshakes
  together are not stalled peers (issue 15) — but keeps its deadline;
* **frames of at most 256 bytes** before authentication, and nothing is
  unpickled before it;
* **no thread, no blocking call**: the accept loop never waits for a peer, so
  new connections are always accepted;
* **a quiet log**: rejected connections are warned of once per peer address
  per :data:`LOG_INTERVAL`, with a count of the others; handshakes dropped to
  keep the bounds from an address whose peers have been proving the key (a
  big host's processes connecting at once, which a fiber-dask client dials
  again) are said the same way at INFO.

A handshake is a generator (the sans-I/O style): it yields ``bytes`` to send,
an ``int`` to receive exactly that many bytes of the (decrypted) stream, or
:data:`AUTHENTICATED` once the peer has proved it knows the authkey, and
returns its result, or raises to reject the peer.  :func:`recv_frame` and
:func:`frame` do the ``multiprocessing.connection`` framing.  TLS (when a
listener has a context) is run by the gate around it: the clear-text
:data:`fiber_dask.comm.tls.HELLO` frame, the TLS handshake, then the generator
inside TLS.  The gate reads exactly what the handshake asks for (and TLS one
record at a time), never past it, so the connection handed on holds no bytes
of the peer's next message in a buffer of the gate's.
"""

from __future__ import annotations

import collections
import errno
import logging
import os
import selectors
import socket
import struct
import threading
import time
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection
from typing import Any, Callable, Generator

from . import tls

__all__ = [
    "AUTHENTICATED",
    "HANDSHAKE_TIMEOUT",
    "LOG_INTERVAL",
    "MAX_PENDING",
    "MAX_PER_PEER",
    "MIN_AGE",
    "Refused",
    "frame",
    "get_gate",
    "recv_frame",
]

logger = logging.getLogger(__name__)

#: Seconds from the accept to the end of the handshake, whatever the peer sends.
HANDSHAKE_TIMEOUT = 10.0
#: Handshakes in progress from one peer address older than MIN_AGE; the
#: oldest beyond it are dropped.
MAX_PER_PEER = 64
#: Seconds a handshake may take before it counts against MAX_PER_PEER.
MIN_AGE = 1.0
#: Handshakes in progress in all; a new one drops the oldest.
MAX_PENDING = 1024
#: Seconds between two log lines about rejected connections from one address.
LOG_INTERVAL = 60.0
_LOG_PEERS = 1024  # addresses logged apart in one interval; the rest together
#: The largest frame an unauthenticated peer may send.
SMALL_FRAME = 256

Handshake = Generator[Any, Any, Any]

#: What a handshake yields once its peer has proved it knows the authkey:
#: from then on the handshake no longer counts against :data:`MAX_PER_PEER`.
AUTHENTICATED = object()


class Refused(Exception):
    """Raised by a handshake to end a connection without a warning in the log
    (an authenticated peer asked for something that is not there)."""


def frame(payload: bytes) -> bytes:
    """``payload`` framed as ``Connection.send_bytes`` sends it."""
    return struct.pack("!i", len(payload)) + payload


def recv_frame(maxlength: int = SMALL_FRAME) -> Handshake:
    """In a handshake generator: ``data = yield from recv_frame(n)`` receives
    one ``Connection.send_bytes`` message of at most ``maxlength`` bytes."""
    (size,) = struct.unpack("!i", (yield 4))
    if size == -1:
        (size,) = struct.unpack("!Q", (yield 8))
    if size < 0 or size > maxlength:
        raise AuthenticationError(
            f"the peer sent a frame of {size} bytes during the handshake "
            f"(at most {maxlength} allowed)"
        )
    if size == 0:
        return b""
    return (yield size)


class _Listener:
    __slots__ = (
        "sock",
        "handshake",
        "on_ready",
        "context",
        "tune",
        "inline",
        "paused_until",
    )

    def __init__(self, sock, handshake, on_ready, context, tune, inline) -> None:
        self.sock = sock
        self.handshake = handshake
        self.on_ready = on_ready
        self.context = context
        self.tune = tune
        self.inline = inline
        self.paused_until = 0.0


class _Pending:
    """One connection whose handshake is in progress."""

    __slots__ = (
        "sock",
        "peer",
        "listener",
        "deadline",
        "accepted",
        "gen",
        "want",
        "buf",
        "out",
        "ssl",
        "inbio",
        "outbio",
        "tls_phase",
        "rec_head",
        "rec_left",
        "events",
    )

    def __init__(self, sock: socket.socket, peer: str, listener: _Listener) -> None:
        self.sock = sock
        self.peer = peer
        self.listener = listener
        self.accepted = time.monotonic()
        self.deadline = self.accepted + HANDSHAKE_TIMEOUT
        self.gen: Handshake | None = None
        self.want = 0  # bytes the handshake waits for (0: none)
        self.buf = bytearray()
        self.out = bytearray()  # raw bytes to write
        self.ssl: Any = None
        self.inbio: Any = None
        self.outbio: Any = None
        self.tls_phase = 0  # 0 plain, 1 TLS handshake, 2 TLS established
        self.rec_head = b""
        self.rec_left = 0
        self.events = 0


class _RejectLog:
    """One line per peer address per LOG_INTERVAL, with a count: a warning
    for rejections (junk, wrong keys, stalls, refused TLS).

    ``drops=True``: handshakes dropped to keep the bounds from an address
    whose peers have been proving the key (:meth:`Gate._drop`), which a
    fiber-dask client dials again: hundreds of processes of one host
    connecting at once.  Said at INFO, and the interval's count too while
    that address's peers proved the key at least as often as they were
    dropped (:meth:`proved`); a count above its proofs is warned of, since
    stalled sockets beside real clients of one address (a NAT) drop that
    way.
    """

    def __init__(self, drops: bool = False) -> None:
        #: peer -> [start, suppressed, last reason, dropped, proved]
        self._windows: dict[str, list] = {}
        self._drops = drops
        if drops:
            self._level = logging.INFO
            self._first = (
                "fiber-dask: dropped a handshake from %s: %s; a fiber-dask client "
                "dials again (further ones from this address are counted and "
                "logged every %g s)"
            )
            self._more = (
                "fiber-dask: dropped %d more handshake(s) from %s in the last %g s "
                "(the last: %s)"
            )
        else:
            self._level = logging.WARNING
            self._first = (
                "fiber-dask: rejected a connection from %s: %s (further ones from "
                "this address are counted and logged every %g s)"
            )
            self._more = (
                "fiber-dask: rejected %d more connection(s) from %s in the last %g s "
                "(the last: %s)"
            )

    def note(self, peer: str, reason: str) -> None:
        if peer not in self._windows and len(self._windows) >= _LOG_PEERS:
            peer = "other addresses"  # a flood from many: one line for the rest
        window = self._windows.get(peer)
        if window is None:
            self._windows[peer] = [time.monotonic(), 0, reason, 1, 0]
            logger.log(self._level, self._first, peer, reason, LOG_INTERVAL)
        else:
            window[1] += 1
            window[2] = reason
            window[3] += 1

    def proved(self, peer: str) -> None:
        """A handshake from ``peer`` proved the key (counted while a window
        of it is open)."""
        window = self._windows.get(peer)
        if window is not None:
            window[4] += 1

    def flush(self, now: float) -> float | None:
        """Log the counts of windows that ended; the seconds until the next
        window ends, or None."""
        nearest = None
        for peer, window in list(self._windows.items()):
            left = window[0] + LOG_INTERVAL - now
            if left > 0:
                nearest = left if nearest is None else min(nearest, left)
                continue
            if window[1]:
                _, more, reason, dropped, proved = window
                if self._drops and dropped > proved:
                    logger.warning(
                        "fiber-dask: dropped %d handshake(s) from %s in the last %g "
                        "s, more than the %d from it that proved the key: stalled "
                        "sockets beside real clients of that address, or more of "
                        "its processes connecting at once than the gate takes (the "
                        "last: %s)",
                        dropped, peer, LOG_INTERVAL, proved, reason,
                    )  # fmt: skip
                else:
                    logger.log(
                        self._level, self._more, more, peer, LOG_INTERVAL, reason
                    )
                self._windows[peer] = [now, 0, None, 0, 0]
                nearest = (
                    LOG_INTERVAL if nearest is None else min(nearest, LOG_INTERVAL)
                )
            else:
                del self._windows[peer]
        return nearest


class Gate:
    """This process's handshake gate (see the module docstring); use
    :func:`get_gate`."""

    def __init__(self) -> None:
        self._sel = selectors.DefaultSelector()
        self._lock = threading.Lock()
        self._commands: collections.deque = collections.deque()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        # In accept order, which is deadline order (one timeout for all).
        self._pending: dict[int, _Pending] = {}
        self._by_peer: dict[str, dict[int, _Pending]] = {}
        self._crowded: set[str] = set()  # peers with over MAX_PER_PEER pending
        self._log = _RejectLog()
        self._drops = _RejectLog(drops=True)
        #: peer address -> when a handshake from it last proved the key
        #: (oldest first; at most _LOG_PEERS addresses).
        self._proved: dict[str, float] = {}
        self._paused: list[_Listener] = []  # out of descriptors: not accepting
        self.stats = collections.Counter()  # what happened, for tests and debugging
        self._thread = threading.Thread(
            target=self._run, name="fiber-handshake-gate", daemon=True
        )
        self._thread.start()

    # ------------------------------------------------------------ public

    def listen(
        self,
        sock: socket.socket,
        handshake: Callable[[], Handshake],
        on_ready: Callable[[Any, Any], None],
        context: Any = None,
        tune: Callable[[socket.socket], None] | None = None,
        inline: Callable[[Any], bool] | None = None,
    ) -> None:
        """Accept connections on the listening ``sock``: each runs
        ``handshake()`` (inside TLS with ``context``), then
        ``on_ready(connection, result)`` in a new thread, the connection a
        blocking ``Connection`` or :class:`~fiber_dask.comm.tls.TLSConnection`.
        ``tune(sock)`` sets the options of each accepted TCP socket.

        ``inline(result)`` true: ``on_ready`` is quick and never blocks (it
        hands the connection on, e.g. to a queue), so the gate runs it on its
        own thread.  A thread per connection costs the gate a thread start
        (the gate waits until the thread runs: milliseconds on a loaded
        host), which capped a thousand pool loops' connects (issue 15)."""
        sock.setblocking(False)
        listener = _Listener(sock, handshake, on_ready, context, tune, inline)
        self._command(("listen", listener))

    def close_listener(self, sock: socket.socket) -> None:
        """Stop accepting on ``sock`` and close it.  New connections are
        refused at once; the socket is closed by the gate's thread once it
        is out of the selector, so its descriptor cannot be reused while
        still registered."""
        try:
            sock.shutdown(socket.SHUT_RDWR)  # accept() fails from now on
        except OSError:
            pass
        self._command(("forget", sock))

    def pending(self) -> int:
        """Handshakes in progress now."""
        return len(self._pending)

    # ------------------------------------------------------------ the thread

    def _command(self, cmd: tuple) -> None:
        self._commands.append(cmd)
        try:
            self._wake_w.send(b"x")
        except OSError:  # the wake buffer is full: a wake-up is on its way
            pass

    def _run(self) -> None:
        while True:
            try:
                self._once()
            except Exception:  # a bug here must not end every endpoint's accepts
                logger.exception("fiber-dask: the handshake gate failed; going on")
                time.sleep(0.1)

    def _once(self) -> None:
        now = time.monotonic()
        timeout = self._log.flush(now)
        drops = self._drops.flush(now)
        if drops is not None:
            timeout = drops if timeout is None else min(timeout, drops)
        if self._pending:
            first = next(iter(self._pending.values()))
            left = max(0.0, first.deadline - now)
            timeout = left if timeout is None else min(timeout, left)
        for peer in self._crowded:
            mine = self._by_peer.get(peer)
            if mine:
                left = max(0.0, next(iter(mine.values())).accepted + MIN_AGE - now)
                timeout = left if timeout is None else min(timeout, left)
        for lst in list(self._paused):
            left = lst.paused_until - now
            if left <= 0:
                self._paused.remove(lst)
                self._sel.register(lst.sock, selectors.EVENT_READ, lst)
            else:
                timeout = left if timeout is None else min(timeout, left)
        events = self._sel.select(timeout)
        for key, mask in events:
            data = key.data
            if data is None:
                self._drain_commands()
            elif isinstance(data, _Listener):
                self._accept(data)
            elif data.sock.fileno() == key.fd:  # not closed by an earlier event
                self._on_event(data, mask)
        self._expire(time.monotonic())

    def _drain_commands(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except OSError:
            pass
        while self._commands:
            kind, arg = self._commands.popleft()
            if kind == "listen":
                self._sel.register(arg.sock, selectors.EVENT_READ, arg)
            else:
                self._paused = [lst for lst in self._paused if lst.sock is not arg]
                try:
                    self._sel.unregister(arg)
                except (KeyError, ValueError):
                    pass
                arg.close()

    def _accept(self, listener: _Listener) -> None:
        for _ in range(64):  # then let the handshakes in progress move too
            try:
                sock, address = listener.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    # Out of file descriptors: make room by dropping the
                    # oldest handshake; with none, stop accepting for a moment
                    # (the listen backlog holds the connections meanwhile).
                    if self._pending:
                        oldest = next(iter(self._pending.values()))
                        self._reject(oldest, f"dropped: {os.strerror(e.errno)}")
                        continue
                    listener.paused_until = time.monotonic() + 0.1
                    self._sel.unregister(listener.sock)
                    self._paused.append(listener)
                    return
                if listener.sock.fileno() < 0:  # closed
                    self._forget_closed(listener)
                    return
                continue  # ECONNABORTED and the like: that peer is gone
            self._admit(sock, address, listener)

    def _forget_closed(self, listener: _Listener) -> None:
        for key in list(self._sel.get_map().values()):
            if key.data is listener:
                self._sel.unregister(key.fileobj)

    def _admit(self, sock: socket.socket, address: Any, listener: _Listener) -> None:
        peer = address[0] if isinstance(address, tuple) and address else "local"
        mine = self._by_peer.setdefault(peer, {})
        if len(mine) >= MAX_PER_PEER:
            self._crowded.add(peer)  # trimmed by _expire once they age
        if len(self._pending) >= MAX_PENDING:
            self.stats["evicted-total"] += 1
            self._drop(
                next(iter(self._pending.values())),
                f"over {MAX_PENDING} handshakes in progress (the oldest goes)",
            )
        try:
            sock.setblocking(False)
            if listener.tune is not None and sock.family != socket.AF_UNIX:
                listener.tune(sock)
        except OSError:
            sock.close()
            return
        p = _Pending(sock, peer, listener)
        fd = sock.fileno()
        self._pending[fd] = p
        mine[fd] = p
        self.stats["accepted"] += 1
        p.events = selectors.EVENT_READ
        try:
            self._sel.register(sock, p.events, p)
            if listener.context is not None:
                p.ssl, p.inbio, p.outbio = tls.server_object(listener.context)
                p.tls_phase = 1
                self._send(p, frame(tls.HELLO))
            else:
                self._start(p)
        except Refused as e:
            self._close(p, str(e))
        except Exception as e:
            self._failed(p, e)

    # ------------------------------------------------------------ one connection

    def _start(self, p: _Pending) -> None:
        p.gen = p.listener.handshake()
        self._advance(p, None)

    def _advance(self, p: _Pending, value: Any) -> None:
        """Run the handshake until it waits for bytes that are not there yet."""
        while True:
            try:
                action = p.gen.send(value)
            except StopIteration as stop:
                self._hand_over(p, stop.value)
                return
            if isinstance(action, int):
                p.want = action
                value = self._read(p)
                if value is None:
                    return  # wait for the socket
            elif action is AUTHENTICATED:
                self._trusted(p)
                value = None
            else:
                self._send(p, action)
                value = None

    def _on_event(self, p: _Pending, mask: int) -> None:
        try:
            if mask & selectors.EVENT_WRITE:
                self._flush(p)
            if not mask & selectors.EVENT_READ:
                return
            if p.tls_phase == 1:
                self._tls_handshake(p)
                return
            value = self._read(p)
            if value is not None:
                self._advance(p, value)
        except Refused as e:
            self._close(p, str(e))
        except Exception as e:
            self._failed(p, e)

    def _tls_handshake(self, p: _Pending) -> None:
        import ssl

        while True:
            if not self._pull(p):
                return
            try:
                p.ssl.do_handshake()
            except ssl.SSLWantReadError:
                self._send_raw(p, p.outbio.read())
                continue
            except ssl.SSLError:
                self._send_raw(p, p.outbio.read())  # the alert says why
                raise
            self._send_raw(p, p.outbio.read())
            p.tls_phase = 2
            self._start(p)
            return

    def _pull(self, p: _Pending) -> bool:
        """Move bytes of the current TLS record from the socket to the SSL
        object, never past the record's end; False if none are there."""
        try:
            if p.rec_left == 0:
                data = p.sock.recv(tls.RECORD_HEADER - len(p.rec_head))
                if not data:
                    raise EOFError("the peer closed the connection")
                p.rec_head += data
                if len(p.rec_head) < tls.RECORD_HEADER:
                    return True
                head, p.rec_head = p.rec_head, b""
                p.rec_left = tls.record_length(head)
                p.inbio.write(head)
                return True
            data = p.sock.recv(min(p.rec_left, 65536))
        except (BlockingIOError, InterruptedError):
            return False
        if not data:
            raise EOFError("the peer closed the connection")
        p.rec_left -= len(data)
        p.inbio.write(data)
        return True

    def _read(self, p: _Pending) -> bytes | None:
        """The ``p.want`` bytes the handshake waits for, or None (not all
        there yet; what came is kept)."""
        while len(p.buf) < p.want:
            need = p.want - len(p.buf)
            if p.tls_phase == 2:
                import ssl

                try:
                    data = p.ssl.read(need)
                except ssl.SSLWantReadError:
                    if not self._pull(p):
                        return None
                    continue
                except ssl.SSLZeroReturnError:
                    data = b""
                if p.outbio.pending:  # an alert or key update to answer
                    self._send_raw(p, p.outbio.read())
            else:
                try:
                    data = p.sock.recv(need)
                except (BlockingIOError, InterruptedError):
                    return None
            if not data:
                raise EOFError("the peer closed the connection during the handshake")
            p.buf += data
        value = bytes(p.buf)
        p.buf.clear()
        p.want = 0
        return value

    def _send(self, p: _Pending, data: bytes) -> None:
        if p.tls_phase == 2:
            p.ssl.write(data)
            data = p.outbio.read()
        self._send_raw(p, data)

    def _send_raw(self, p: _Pending, data: bytes) -> None:
        if data:
            p.out += data
            self._flush(p)

    def _flush(self, p: _Pending) -> None:
        """Write what is queued without waiting; the rest when writable.
        (Handshake messages are small: the kernel's buffer takes them.)"""
        while p.out:
            try:
                n = p.sock.send(p.out)
            except (BlockingIOError, InterruptedError):
                break
            del p.out[:n]
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if p.out else 0)
        if events != p.events:
            p.events = events
            self._sel.modify(p.sock, events, p)

    def _expire(self, now: float) -> None:
        for peer in list(self._crowded):
            mine = self._by_peer.get(peer)
            while mine and len(mine) > MAX_PER_PEER:
                oldest = next(iter(mine.values()))
                if now - oldest.accepted < MIN_AGE:
                    break
                self.stats["evicted-peer"] += 1
                self._drop(
                    oldest,
                    f"over {MAX_PER_PEER} handshakes in progress from this "
                    "address (the oldest go)",
                )
                mine = self._by_peer.get(peer)
            if not mine or len(mine) <= MAX_PER_PEER:
                self._crowded.discard(peer)
        while self._pending:
            p = next(iter(self._pending.values()))
            if p.deadline > now:
                return
            self.stats["timed-out"] += 1
            self._reject(
                p, f"the handshake did not complete within {HANDSHAKE_TIMEOUT:g} s"
            )

    def _trusted(self, p: _Pending) -> None:
        """``p``'s peer proved the key: it leaves its address's bound."""
        mine = self._by_peer.get(p.peer)
        if mine is not None:
            mine.pop(p.sock.fileno(), None)
            if not mine:
                del self._by_peer[p.peer]
        self.stats["trusted"] += 1

    def _note_proved(self, peer: str) -> None:
        """A connection from ``peer`` proved the key (once each: at its
        hand-over, which handshakes that yield AUTHENTICATED reach too)."""
        self._drops.proved(peer)
        proved = self._proved
        proved.pop(peer, None)
        proved[peer] = time.monotonic()
        if len(proved) > _LOG_PEERS:
            del proved[next(iter(proved))]

    def _remove(self, p: _Pending) -> None:
        fd = p.sock.fileno()
        self._pending.pop(fd, None)
        mine = self._by_peer.get(p.peer)
        if mine is not None:
            mine.pop(fd, None)
            if not mine:
                del self._by_peer[p.peer]
        try:
            self._sel.unregister(p.sock)
        except (KeyError, ValueError):
            pass

    def _close(self, p: _Pending, reason: str | None = None) -> None:
        if reason:
            logger.debug("fiber-dask: closed a connection from %s: %s", p.peer, reason)
        self._remove(p)
        try:
            if p.out:  # a last word (FAILURE, NOSERVICE), if it fits
                p.sock.send(p.out)
        except OSError:
            pass
        p.sock.close()
        p.gen = None

    def _reject(self, p: _Pending, reason: str) -> None:
        self.stats["rejected"] += 1
        self._log.note(p.peer, reason)
        self._close(p)

    def _drop(self, p: _Pending, reason: str) -> None:
        """Close ``p`` to keep the bounds (counted as rejected).  Said at INFO
        when a handshake from its address proved the key within
        LOG_INTERVAL (a crowd of real clients: the dropped one dials again);
        warned of otherwise, as a stranger's flood of stalled sockets is."""
        self.stats["rejected"] += 1
        proved = self._proved.get(p.peer)
        if proved is not None and time.monotonic() - proved < LOG_INTERVAL:
            self._drops.note(p.peer, reason)
        else:
            self._log.note(p.peer, f"dropped: {reason}")
        self._close(p)

    def _failed(self, p: _Pending, e: Exception) -> None:
        """The handshake with ``p`` raised ``e``: a rejection, logged (junk,
        a wrong key, TLS refused); but a peer that went away in the middle
        (end of file, reset: a process killed while it connected, as slot
        processes are when their program exits) is counted and left to the
        debug log, as any connection that closes is."""
        if isinstance(e, (EOFError, ConnectionResetError, BrokenPipeError)):
            self.stats["rejected"] += 1
            self.stats["gone"] += 1
            self._close(p, _why(e))
            return
        self._reject(p, _why(e))

    def _hand_over(self, p: _Pending, result: Any) -> None:
        """Authenticated: the connection leaves the gate for its service."""
        self._remove(p)
        self.stats["authenticated"] += 1
        self._note_proved(p.peer)
        sock, out = p.sock, bytes(p.out)
        try:
            sock.setblocking(True)
            if p.tls_phase == 2:
                conn: Any = tls.TLSConnection.adopt(
                    sock, p.ssl, p.inbio, p.outbio, p.rec_head, p.rec_left
                )
            else:
                conn = Connection(sock.detach())
        except OSError:
            sock.close()
            return
        inline = p.listener.inline
        if not out and inline is not None and inline(result):
            _serve(p.listener.on_ready, conn, out, result)
            return
        threading.Thread(
            target=_serve,
            args=(p.listener.on_ready, conn, out, result),
            name="fiber-handshake-done",
            daemon=True,
        ).start()


def _serve(on_ready: Callable, conn: Any, out: bytes, result: Any) -> None:
    try:
        if out:  # the handshake's last bytes the kernel did not take at once
            fd = conn.fileno() if not isinstance(conn, tls.TLSConnection) else None
            if fd is not None:
                view = memoryview(out)
                while view:
                    view = view[os.write(fd, view) :]
            else:
                conn._sock.sendall(out)
        on_ready(conn, result)
    except Exception:  # a service's bug must not go unnoticed, nor kill anything
        logger.exception("fiber-dask: a service failed on a new connection")
        try:
            conn.close()
        except OSError:
            pass


def _why(e: BaseException) -> str:
    if isinstance(e, EOFError):
        return str(e) or "the peer closed the connection during the handshake"
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


_gate: Gate | None = None
_gate_pid = 0
_gate_lock = threading.Lock()


def get_gate() -> Gate:
    """This process's gate, started on first use (again in a forked child)."""
    global _gate, _gate_pid
    with _gate_lock:
        if _gate is None or _gate_pid != os.getpid():
            _gate = Gate()
            _gate_pid = os.getpid()
        return _gate
