"""The slot relay: a Dask worker process's slot processes reach their pool's owner through it.

Process slots (``fiber.pool.slots: process``, :mod:`fiber_dask.engine.slots`)
each used to dial the owner: one TCP connection, one HMAC handshake and one
socket in the owner's selector per slot process, every chunk one write and
every answer one read on the owner's one thread (a 1024-slot pool: 1024 of
each).  Now the Dask worker process that keeps the slots holds the pool's
link (:mod:`fiber_dask.engine.poollink`, as its thread slots would) and
relays; the owner sees one connection and one handshake per worker process::

    owner (PoolEngine)     Dask worker process                 slot processes
    ──────────────────     ───────────────────                 ──────────────
                           keeper of loop 7 (a Dask task):
                             joins the link (the first keeper
                             dials), holds it, hands its slot
                             process the relay's address and
                             a token (in its SlotSpec)
    _Link ◄── one ───────► Link ── receiver thread: a message
      connection,            for route -3 re-framed as loop
      HMAC (TLS)             7's and written to its socket ──► local ─► slot process
                           relay thread (one per process):     socket   (serve_slot as
                             accepts a slot process (its                 loop 7, its link
                             token before anything else),                dialled the relay)
                             reads what each sends and ◄──────────────
                             sends every slot's messages of
                             one pass in one frame

* **Routes.**  Each slot process the relay takes in gets a route of its
  own on the link, a number below zero that no loop has; its ``Attach``
  goes on naming the loop it serves (``Attach.slot``, see
  :mod:`fiber_dask.engine.poolprotocol`).  A loop's successor after
  ``maxtasksperchild`` is a new route: nothing the owner sent the
  predecessor (a ``Calls`` on its way as it retired) reaches it.  The
  keeper's own hold on the link is its loop number, never announced: the
  owner sends it nothing, and it keeps the link up between a slot process
  and its successor.
* **Failures.**  A slot process that ends without saying ``Gone`` (SIGKILL,
  a segfault, the OOM killer) is seen by its socket's EOF: the relay says
  ``Gone`` for its route after what it sent, and the owner re-runs its chunk
  as when a slot's own connection dropped.  When the link drops (the owner
  is gone) every route is told: the relay shuts its slot process's socket
  down, and the slot process ends its task as on the owner's loss.  The
  keeper waits for its slot process's last word to be handed on before it
  leaves the link (:meth:`Hold.close`), so a ``Gone`` never follows the
  link's hang-up.
* **Writes never wait.**  The receiver thread writes to a slot process's
  socket without blocking; what does not fit waits in that route's buffer,
  which the relay thread writes as the socket drains.  A slot process
  whose task holds its GIL (a long C call) then delays only its own
  messages, not the other slots'.
* **Security.**  The listening socket is a Unix socket (Linux's abstract
  namespace; elsewhere a path in a private directory) any local process
  could connect to: a slot process first proves itself with the 32 random
  bytes its keeper made and handed it over the template's private pipes.
  The relay reads nothing else, and unpickles nothing, before; a stranger
  is cut off.  A slot process reads only the socket it dialled at the
  address its keeper gave it.
"""

from __future__ import annotations

import collections
import hmac
import itertools
import logging
import os
import secrets
import selectors
import socket
import struct
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

from ..comm import channel
from . import poollink
from . import poolprotocol as proto

__all__ = ["Relay", "Hold", "get_relay", "connect", "wanted", "RELAY_FROM"]

logger = logging.getLogger("fiber_dask.pool")

#: Bytes of the token a slot process sends first.
TOKEN_BYTES = 32
#: Seconds a local connection gets to send its token.
_GREETING_WAIT = 10.0
#: Seconds a keeper waits for its ended slot process's last messages to be
#: handed on before the relay cuts its routes (a child of the slot process
#: that kept its socket open hides the EOF).
_SETTLE_WAIT = 2.0
#: What the relay says for a slot process that ended without a word.
DIED = "slot process died"

#: Pool size from which process slots use the relay when ``fiber.pool.relay``
#: is null (:func:`wanted`).
RELAY_FROM = 64

_HEADER = struct.Struct("!i")
_LONG_HEADER = struct.Struct("!Q")
_route_numbers = itertools.count(1)  # route -n; never reused in a process


def wanted(slots: int) -> bool:
    """Whether the process slots of a pool of ``slots`` use the relay: the
    policy, ``fiber.pool.relay`` (null: from :data:`RELAY_FROM` slots on).

    The hop costs each message a thread wake-up and two local socket calls
    in the Dask worker process (~30 us of CPU a chunk on the 2-core test
    machine: a flood of trivial ``apply_async`` on 2 slots ran ~20 % slower);
    what it saves grows with the slots: the owner's connections, handshakes
    and reads (one per worker process, not per slot).
    """
    from .. import config

    relay = config.get("pool.relay")
    if relay is None:
        return slots >= RELAY_FROM
    return bool(relay)


def connect(address: Any, token: bytes) -> Any:
    """In a slot process: dial this worker's relay, prove the token; a
    ``Connection`` for :class:`~fiber_dask.engine.poollink.Link`, or the
    :class:`~fiber_dask.engine.poolprotocol.Reason` text why not."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(address)
        s.sendall(token)
    except OSError as e:
        s.close()
        return (
            f"{proto.Reason.UNREACHABLE}: cannot reach the slot relay of this "
            f"process's Dask worker: {e}"
        )
    return Connection(s.detach())


def _framed(data: bytes) -> bytes:
    """``data`` as ``Connection.send_bytes`` frames it."""
    n = len(data)
    if n > 0x7FFFFFFF:
        return _HEADER.pack(-1) + _LONG_HEADER.pack(n) + data
    return _HEADER.pack(n) + data


class Hold:
    """A keeper's hold on its pool's link, for the slot processes it starts
    (:meth:`Relay.open`).  ``ticket``: what its slot processes dial."""

    def __init__(self, relay: Relay, slot: int, token: bytes) -> None:
        self.relay = relay
        self.slot = slot
        self.token = token
        self.ticket = (relay.address, token)
        self.link: Any = None
        self.dropped = False  # the link dropped: no slot process joins it
        self.routes: set[_Route] = set()  # under relay.cond

    def _deliver(self, msg: Any) -> None:
        # The owner never sends to the hold (never announced); None: the link
        # dropped, and each route hears it too.
        if msg is None:
            self.dropped = True

    def close(self, wait: float = _SETTLE_WAIT) -> None:
        """The keeper is done: once its slot processes' last messages were
        handed on (at most ``wait`` seconds; then their routes are cut, and
        their ``Gone`` said), leave the link."""
        relay = self.relay
        relay.forget(self)
        with relay.cond:
            if not relay.cond.wait_for(lambda: not self.routes, wait):
                relay.call(lambda: relay.cut(self))
                relay.cond.wait_for(lambda: not self.routes, wait)
        if self.link is not None:
            self.link.detach(self.slot, None)


class _Route:
    """One slot process behind the relay: its socket and route number."""

    __slots__ = ("relay", "hold", "number", "conn", "fd", "reader", "out", "lock")

    def __init__(self, relay: Relay, hold: Hold, number: int, sock: socket.socket):
        self.relay, self.hold, self.number = relay, hold, number
        self.conn = Connection(sock.detach())
        self.fd: int | None = self.conn.fileno()  # None once closed
        os.set_blocking(self.fd, False)
        self.reader = channel.FrameReader(self.conn)
        self.out = bytearray()  # written when the socket drains
        self.lock = threading.Lock()  # fd, out

    def deliver(self, msg: Any) -> None:
        """On the link's receiver thread: hand ``msg`` to the slot process;
        None (the link dropped): shut its socket down, so that it ends."""
        if msg is None:
            with self.lock:
                if self.fd is not None:
                    _shutdown(self.fd)
            return
        self.write(_framed(proto.forward_frame(self.hold.slot, msg)))

    def write(self, data: bytes) -> None:
        with self.lock:
            if self.fd is None:
                return
            if self.out:
                self.out += data
                return
            try:
                n = os.write(self.fd, data)
            except BlockingIOError:
                n = 0
            except OSError:
                return  # it is gone: the relay thread sees its EOF
            if n < len(data):
                self.out += memoryview(data)[n:]
                self.relay.call(self.relay.watch_writes, self)


class _Greeting:
    """A local connection that has not sent its token yet."""

    __slots__ = ("sock", "got", "since")

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.got, self.since = sock, b"", time.monotonic()


_LISTENER = object()


class Relay:
    """This process's slot relay: its listener and its thread (see the
    module docstring).  One per process, :func:`get_relay`."""

    def __init__(self) -> None:
        self._dir = None
        if sys.platform.startswith("linux"):
            self.address: Any = (
                f"\0fiber-dask-relay-{os.getpid()}-{secrets.token_hex(8)}"
            )
        else:
            import tempfile

            self._dir = tempfile.mkdtemp(prefix="fiber-dask-relay-")
            self.address = os.path.join(self._dir, "relay")
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._listener.bind(self.address)
            self._listener.listen(1024)
            self._listener.setblocking(False)
        except OSError:
            self._listener.close()
            raise
        self.cond = threading.Condition()  # holds' routes, _holds
        self._holds: dict[bytes, Hold] = {}
        self._commands: collections.deque = collections.deque()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ, _LISTENER)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._greetings: set[_Greeting] = set()
        #: Routes that ended this pass, with the Gone to say for them (None:
        #: they said it), ended once what was read is sent.
        self._ended: list[tuple[_Route, str | None]] = []
        self._stopping = False
        self.thread = threading.Thread(
            target=self._run, name="fiber-slot-relay", daemon=True
        )
        self.thread.start()

    # ------------------------------------------------------------ keepers

    def open(
        self,
        address: tuple[str, int],
        authkey: bytes,
        service: str,
        slot: int,
        worker: str | None,
    ) -> Hold | str:
        """A keeper of loop ``slot`` holds the link to the pool (dialling it
        if this process has none): its :class:`Hold`, or the
        :class:`~fiber_dask.engine.poolprotocol.Reason` text why there is no
        link (as :func:`~fiber_dask.engine.poollink.attach` says)."""
        hold = Hold(self, slot, secrets.token_bytes(TOKEN_BYTES))
        link = poollink.attach(
            address, authkey, service, slot, worker, hold._deliver, announce=False
        )
        if isinstance(link, str):
            return link
        hold.link = link
        with self.cond:
            self._holds[hold.token] = hold
        return hold

    def close(self) -> None:
        """Stop relaying (a process's own relay lives as long as it does):
        every route ends, its ``Gone`` said; no slot process joins any more."""
        self.call(self._stop)
        self.thread.join()

    def _stop(self) -> None:
        self._stopping = True

    def forget(self, hold: Hold) -> None:
        """No slot process joins through ``hold`` any more."""
        with self.cond:
            self._holds.pop(hold.token, None)

    def call(self, func: Any, *args: Any) -> None:
        """Run ``func(*args)`` on the relay thread, soon."""
        self._commands.append((func, args))
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass

    # ------------------------------------------------- on the relay thread

    def watch_writes(self, route: _Route) -> None:
        with route.lock:
            if route.fd is not None and route.out:
                self._sel.modify(
                    route.fd, selectors.EVENT_READ | selectors.EVENT_WRITE, route
                )

    def cut(self, hold: Hold) -> None:
        """End ``hold``'s routes now (their slot processes ended, but their
        sockets' EOF did not come): say ``Gone`` for each."""
        with self.cond:
            routes = list(hold.routes)
        self._ended.extend((route, DIED) for route in routes)

    def _run(self) -> None:
        while True:
            timeout = 1.0 if self._greetings else None
            try:
                events = self._sel.select(timeout)
            except InterruptedError:
                continue
            sends: dict[Any, list] = {}
            ended = self._ended
            for key, mask in events:
                obj = key.data
                try:
                    if obj is None:
                        self._commanded()
                    elif obj is _LISTENER:
                        self._accept()
                    elif type(obj) is _Greeting:
                        self._greet(obj)
                    else:
                        if mask & selectors.EVENT_WRITE:
                            self._flush(obj)
                        if mask & selectors.EVENT_READ:
                            why = self._read(obj, sends)
                            if why is not False:
                                ended.append((obj, why))
                except Exception:  # a bug: keep relaying for the others
                    logger.exception("fiber-dask: the slot relay failed an event")
            # What was read goes before the Gone said for a route that ended.
            for link, routed in sends.items():
                if routed:
                    link.send_now(routed)
            while ended:
                self._end(*ended.pop(0))
            if self._greetings:
                self._expire_greetings()
            if self._stopping:
                self._shut()
                return

    def _shut(self) -> None:
        for key in list(self._sel.get_map().values()):
            obj = key.data
            if type(obj) is _Route:
                self._end(obj, DIED)
            elif type(obj) is _Greeting:
                self._drop_greeting(obj)
        self._sel.close()
        self._listener.close()
        self._wake_r.close()
        self._wake_w.close()
        if self._dir is not None:
            import shutil

            shutil.rmtree(self._dir, ignore_errors=True)

    def _commanded(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except OSError:
            pass
        while self._commands:
            func, args = self._commands.popleft()
            func(*args)

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # out of descriptors: the slot process retries
                logger.warning("fiber-dask: the slot relay cannot accept: %r", e)
                return
            sock.setblocking(False)
            greeting = _Greeting(sock)
            self._greetings.add(greeting)
            self._sel.register(sock, selectors.EVENT_READ, greeting)

    def _drop_greeting(self, greeting: _Greeting) -> None:
        self._greetings.discard(greeting)
        self._sel.unregister(greeting.sock)
        greeting.sock.close()

    def _greet(self, greeting: _Greeting) -> None:
        """Read the token; a slot process it names becomes a route."""
        try:
            data = greeting.sock.recv(TOKEN_BYTES - len(greeting.got))
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._drop_greeting(greeting)
            return
        greeting.got += data
        if len(greeting.got) < TOKEN_BYTES:
            return
        with self.cond:
            hold = self._holds.get(greeting.got)
        if (
            hold is None
            or not hmac.compare_digest(hold.token, greeting.got)
            or hold.dropped
        ):
            # A stranger, or the slot process of a keeper that is done or
            # whose link dropped: EOF, and it ends.
            self._drop_greeting(greeting)
            return
        self._greetings.discard(greeting)
        self._sel.unregister(greeting.sock)
        route = _Route(self, hold, -next(_route_numbers), greeting.sock)
        if not hold.link.add(route.number, route.deliver):
            route.conn.close()
            return
        with self.cond:
            hold.routes.add(route)
        self._sel.register(route.fd, selectors.EVENT_READ, route)

    def _expire_greetings(self) -> None:
        old = time.monotonic() - _GREETING_WAIT
        for greeting in [g for g in self._greetings if g.since < old]:
            self._drop_greeting(greeting)

    def _flush(self, route: _Route) -> None:
        with route.lock:
            if route.fd is None:
                return
            try:
                n = os.write(route.fd, route.out)
            except BlockingIOError:
                return
            except OSError:
                route.out.clear()  # it is gone: its EOF ends the route
                n = 0
            del route.out[:n]
            if not route.out:
                self._sel.modify(route.fd, selectors.EVENT_READ, route)

    def _read(self, route: _Route, sends: dict) -> str | None | bool:
        """Take what ``route``'s slot process sent into ``sends`` (per link,
        ``(route, message)`` pairs); False while it goes on, else why it
        ended: None (it said ``Gone``) or the reason to say for it."""
        try:
            frames = route.reader.frames()
        except BlockingIOError:
            return False
        except (EOFError, OSError):
            return DIED
        slot, number = route.hold.slot, route.number
        routed = sends.setdefault(route.hold.link, [])
        for raw in frames:
            try:
                msgs = proto.decode_frame(raw)
            except Exception:
                logger.exception(
                    "fiber-dask: the slot relay could not read a slot process's "
                    "message; ending it: its chunks run again"
                )
                return DIED
            for loop, msg in msgs:
                if loop != slot:
                    logger.error(
                        "fiber-dask: a slot process of loop %d spoke for loop %r; "
                        "ending it: its chunks run again",
                        slot,
                        loop,
                    )
                    return DIED
                kind = type(msg)
                if kind is proto.Attach:
                    msg = proto.Attach(msg.pid, msg.worker, slot)
                routed.append((number, msg))
                if kind is proto.Gone:
                    return None  # its last word
        return False

    def _end(self, route: _Route, why: str | None) -> None:
        """``route``'s slot process is done: close its socket, say ``Gone``
        for it unless it did (``why`` is the reason to say), leave the link."""
        with route.lock:
            fd, route.fd = route.fd, None
            route.out.clear()
        if fd is None:
            return  # already ended
        try:
            self._sel.unregister(fd)
        except (KeyError, ValueError):
            pass
        _shutdown(fd)
        route.conn.close()
        link = route.hold.link
        if why is not None:
            link.send_now([(route.number, proto.Gone(why))])
        link.detach(route.number, None)
        with self.cond:
            route.hold.routes.discard(route)
            self.cond.notify_all()


def _shutdown(fd: int) -> None:
    """Shut a socket down both ways, its descriptor still open: the peer and
    any reader see EOF."""
    try:
        s = socket.socket(fileno=os.dup(fd))
    except OSError:
        return
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        s.close()


_relay: Relay | None = None
_relay_lock = threading.Lock()


def get_relay() -> Relay:
    """This process's relay, started on first use.  Raises ``OSError`` when
    its socket cannot be made."""
    global _relay
    with _relay_lock:
        if _relay is None:
            _relay = Relay()
        return _relay
