"""A worker process's link to a pool's owner, shared by all its loops of that pool.

Thread slots put a hundred loops of one pool in one Dask worker process.  Each
used to dial the owner and keep a TCP connection, a receiver thread and its
own socket writes: 1024 slots were 1024 connections into one owner thread,
1024 writes for a map's first wave and 1024 reads for its answers (issue 15:
32 us of owner time per write, ~0.35 ms of the worker's CPU per chunk with 256
threads sharing its GIL).  Now a process has one :class:`Link` per pool::

    owner (PoolEngine)                   Dask worker process
    ──────────────────                   ───────────────────
    _Link, its loops {3: ..., 7: ...}    Link ── receiver thread: reads every
         ◄──── one authenticated ─────►       frame, hands each loop its
               connection                     messages in order ──► inbox of
                                              loop 3, of loop 7, ...
                                         post(): loop threads queue their
                                         messages; the link's sender thread
                                         sends all that waits in one frame

* **Joining.**  :func:`attach` finds this process's link to the pool (the
  pool's channel address and service name) or, for the first loop, dials it
  (:func:`connect_to_owner`, the authenticated channel with its retries),
  while the others wait for that one dial.  The loop is routed first, then
  says ``Attach``; the owner sends it nothing before that.
* **Sending.**  A loop thread only queues its message; the link's sender
  thread sends everything waiting, of every loop, in one frame.  A loop
  thread that sent for itself (or for the others, combining their messages
  into its frame) waited on the socket and then for the GIL among a hundred
  busy threads: in a 1024-slot ES map some loops took 30-60 ms to get from
  one chunk to the next, with the next chunk already in their inbox.  A
  link with one loop (a slot process) sends in that loop's thread: there is
  nobody to wait for, and a hand-over would cost each result a thread switch.
* **Leaving.**  :meth:`Link.detach` says ``Gone`` with the loop's reason; the
  last loop out hangs the link up.  A link that drops (the owner's exit, a
  cut connection) ends every loop on it as a ``TERMINATE`` does.  The socket
  is closed only once the receiver and every loop are done with it, so a
  descriptor number is never reused under a thread still using it.
* **Failing.**  Whatever goes wrong on a link drops it, so that its loops
  end and the owner, seeing it hang up, re-runs their chunks; nothing leaves
  a loop waiting for an answer that cannot come.  A frame that cannot be
  made or sent (out of memory pickling it, an interrupt half-way through
  writing it) and bytes from the owner that are not a frame drop it, logged.
  With no thread to spare, a link does without: when its sender thread
  cannot start, the loops send for themselves (under the send lock); when
  its receiver cannot, the dial fails, as an unreachable owner does.

A slot process (``fiber.pool.slots: process``) has one loop, so its link
carries one; the messages are the same (:mod:`fiber_dask.engine.poolprotocol`).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from typing import Any, Callable

from ..comm import channel
from ..transparency import interrupts
from . import poolprotocol as proto

__all__ = ["Link", "attach", "connect_to_owner"]

logger = logging.getLogger("fiber_dask.pool")

#: Seconds a link keeps dialling again when the owner cuts the handshake (a
#: crowded gate: fiber_dask.comm.channel.connect redials).
_REDIAL_FOR = 60.0

#: Seconds the last loop to leave waits for the sender thread to send what
#: is queued (its Gone last) before the link is shut down.
_FLUSH_WAIT = 5.0
_END = object()  # tells the sender thread to end, after what is queued

Deliver = Callable[[Any], None]


def connect_to_owner(
    address: tuple[str, int],
    authkey: bytes,
    service: str,
    worker: str | None = None,
) -> Any:
    """Connect to the pool's owner: a channel ``Connection``, or the
    :class:`~fiber_dask.engine.poolprotocol.Reason` text why not (a string).

    A handshake cut by the owner's side (its gate drops the oldest of too
    many handshakes from one host, as when many workers start together) is
    dialled again by :func:`fiber_dask.comm.channel.connect`, for up to
    ``_REDIAL_FOR`` seconds.
    """
    hello = {"pid": os.getpid(), "worker": worker}
    try:
        return channel.connect(
            address, authkey, service, hello=hello, redial_for=_REDIAL_FOR
        )
    except channel.Unreachable as e:
        # Not "no-pool": the pool counts this as a failed loop, so that it
        # fails with an error naming the address instead of starting loops
        # that cannot connect forever.
        return f"{proto.Reason.UNREACHABLE}: {e}"
    except channel.ChannelError:  # the pool is gone (closed): nothing to do
        return proto.Reason.NO_POOL
    except (ConnectionError, EOFError) as e:  # TLS refused, or cut after the verdict
        return f"{proto.Reason.UNREACHABLE}: the owner closed the connection ({e!r})"


class Link:
    """This process's connection to one pool's owner (see the module docstring).

    Made by :func:`attach`; a loop uses :meth:`post` and :meth:`detach`.
    """

    def __init__(self, key: tuple) -> None:
        self.key = key
        self.conn: Any = None
        #: Set once the dial ended: ``conn`` is open, or ``failure`` says why not.
        self.ready = threading.Event()
        self.failure: str | None = None
        self._routes: dict[int, Deliver] = {}  # loop -> where its messages go
        self._lock = threading.Lock()  # _routes, _closing, _users
        self._closing = False  # no loop joins any more
        #: Threads that may still use the socket: the receiver and each loop
        #: that joined; the last one to finish closes it.
        self._users = 1
        self._send_lock = threading.Lock()  # one frame on the socket at a time
        self._queue: queue.SimpleQueue = queue.SimpleQueue()  # for the sender
        self._sender: threading.Thread | None = None
        self._no_sender = False  # it could not start: loops send themselves
        self._broken = False  # set under the send lock: nothing more goes out

    def __repr__(self) -> str:
        return f"<Link {self.key[1]} loops={sorted(self._routes)}>"

    # ------------------------------------------------------------ sending

    def post(self, loop: int, msg: Any) -> None:
        """Send ``msg`` for ``loop``.  Never raises: a link that cannot send
        is dropped, and its receiver then ends every loop on it.

        A link with one loop (a slot process) sends in the loop's thread; one
        with several hands the message to the link's sender thread, which
        sends all that waits in one frame, so that no loop thread waits on a
        socket (or for the GIL after it) with its next chunk ready.  Without
        a sender thread (none could start) each loop sends its own.
        """
        if self._sender is None and (
            self._no_sender or len(self._routes) <= 1 or not self._start_sender()
        ):
            with self._send_lock:
                self._send([(loop, msg)])
            return
        self._queue.put((loop, msg))

    def send_now(self, routed: list) -> None:
        """Send ``routed`` (``(loop, message)`` pairs) in one frame from this
        thread, now (a relay's thread, handing on what its slot processes
        sent).  Never raises, as :meth:`post`."""
        with self._send_lock:
            self._send(routed)

    def _send(self, routed: list) -> None:
        """Send ``routed`` in one frame (call with the send lock held)."""
        if self._broken:
            return
        # An interrupt while the frame is made (a loop sending its own: its
        # _Terminated, a slot process's KeyboardInterrupt) goes through: the
        # stream is whole, and the loop it ends says Gone, so the owner re-runs
        # the chunks whose answers it lost.
        try:
            frame = proto.encode_frame(routed)
        except Exception as e:
            self._cannot_send(e)
            return
        try:
            self.conn.send_bytes(frame)
        except OSError:  # the connection failed (the owner is gone): no news
            self._drop()
        except Exception as e:
            self._cannot_send(e)
        except BaseException:
            # An interrupt half-way through writing the frame: what follows
            # on the stream would not be frames.
            self._drop()
            raise

    def _cannot_send(self, e: Exception) -> None:
        """A frame could not be made or sent (out of memory pickling it, say):
        its messages are lost, and the loops that sent them would wait for
        ever for answers.  Drop the link: they end, and the owner re-runs
        their chunks.  Logged first, so that the log has it by the time
        anyone hears of the drop."""
        logger.error(
            "fiber-dask: a pool link could not send to its owner (%r); "
            "dropping it: its loops end and their chunks run again",
            e,
            exc_info=True,
        )
        self._drop()

    def _drop(self) -> None:
        """Send nothing more and shut the socket down: the receiver (which
        then ends every loop) and the owner (which re-runs their chunks) see
        EOF.  Call with the send lock held."""
        self._broken = True
        _shutdown(self.conn)

    def _start_sender(self) -> bool:
        """Start the sender thread, if it is not running: False if it cannot
        start (the process is out of threads), and then never again."""
        with self._lock:
            if self._sender is not None:
                return True
            if self._no_sender:
                return False
            sender = threading.Thread(
                target=self._send_all, name="fiber-pool-link-send", daemon=True
            )
            self._users += 1
            try:
                interrupts.start_helper(sender)
            except Exception as e:  # RuntimeError: can't start new thread
                self._users -= 1
                self._no_sender = True
                logger.warning(
                    "fiber-dask: a pool link could not start its sender thread "
                    "(%r); its loops send for themselves",
                    e,
                )
                return False
            self._sender = sender
            return True

    def _send_all(self) -> None:
        """The sender thread: everything queued, in frames, until told to end."""
        q = self._queue
        try:
            while True:
                batch = [q.get()]
                while True:
                    try:
                        batch.append(q.get_nowait())
                    except queue.Empty:
                        break
                done = any(m is _END for m in batch)
                routed = [m for m in batch if m is not _END]
                if routed:
                    with self._send_lock:
                        self._send(routed)
                if done:
                    return
        finally:
            self._release()

    # ------------------------------------------------------ joining, leaving

    def _open(self, conn: Any) -> None:
        self.conn = conn
        try:
            interrupts.start_helper(
                threading.Thread(
                    target=self._receive, name="fiber-pool-link", daemon=True
                )
            )
        except Exception as e:  # RuntimeError: can't start new thread
            # Nobody would hear the owner: the dial fails, for the loops
            # waiting for it too, counted as failed loops by the pool.
            channel.hangup(conn)
            self._fail(
                f"{proto.Reason.UNREACHABLE}: no thread to read the owner's "
                f"messages with ({e!r}); the worker process is out of threads"
            )
            return
        self.ready.set()

    def _fail(self, reason: str) -> None:
        with _links_lock:
            if _links.get(self.key) is self:
                del _links[self.key]
        self.failure = reason
        self._closing = True
        self.ready.set()

    def add(self, loop: int, deliver: Deliver) -> bool:
        """Join ``loop`` to this link, which is up (a relay's route for a
        slot process, :mod:`fiber_dask.engine.slotrelay`): False if it is
        closing.  The loop leaves with :meth:`detach`."""
        with self._lock:
            if self._closing:
                return False
            self._routes[loop] = deliver
            self._users += 1
            return True

    def detach(self, loop: int, reason: str | None) -> None:
        """``loop`` ends: tell the owner why (``Gone``; None: it was told, or
        ``loop`` is a keeper's hold on the link that the owner never knew,
        see :mod:`fiber_dask.engine.slotrelay`); the last loop out stops the
        sender thread (after what it holds) and hangs the link up."""
        if reason is not None:
            self.post(loop, proto.Gone(reason))  # before it leaves: the last
            # loop out then finds every other loop's Gone queued before its own
        with _links_lock:
            with self._lock:
                self._routes.pop(loop, None)
                empty = not self._routes
                hang_up = empty and not self._closing  # else it dropped
                if empty:
                    self._closing = True
                    if _links.get(self.key) is self:
                        del _links[self.key]
        if empty:
            sender = self._sender
            if sender is not None:  # it sends what waits, then ends
                self._queue.put(_END)
                sender.join(_FLUSH_WAIT)
            if hang_up:
                _shutdown(self.conn)  # the owner and our receiver see EOF
        self._release()

    def _release(self) -> None:
        with self._lock:
            self._users -= 1
            done = self._users == 0
        if done:
            with self._send_lock:
                self._broken = True
                self.conn.close()

    # ------------------------------------------------------------ receiving

    def _receive(self) -> None:
        """The link's receiver thread: hand each loop its messages, in order;
        at EOF, hand every loop None (the owner is gone).  Bytes that are
        not a frame drop the link: nothing after them can be trusted."""
        routes = self._routes
        try:
            reader = channel.FrameReader(self.conn)
            while True:
                try:
                    frames = reader.frames()
                except (EOFError, OSError):
                    break
                for raw in frames:
                    for loop, msg in proto.decode_frame(raw):
                        deliver = routes.get(loop)
                        if deliver is not None:  # else it has just left
                            deliver(msg)
        except Exception:  # junk (a bug, a version skew): end the loops, say why
            logger.exception(
                "fiber-dask: a pool link could not read its owner's messages; "
                "dropping it: its loops end and their chunks run again"
            )
            _shutdown(self.conn)  # the owner sees the hang-up
        finally:
            with _links_lock:
                with self._lock:
                    self._closing = True
                    if _links.get(self.key) is self:
                        del _links[self.key]
                    left = list(routes.values())
            for deliver in left:
                deliver(None)
            self._release()


_links: dict[tuple, Link] = {}
_links_lock = threading.Lock()


def attach(
    address: tuple[str, int],
    authkey: bytes,
    service: str,
    loop: int,
    worker: str | None,
    deliver: Deliver,
    dial: Callable[[], Any] | None = None,
    announce: bool = True,
) -> Link | str:
    """Join loop number ``loop`` to this process's link to the pool
    ``service`` at ``address``, dialling it if there is none: the
    :class:`Link`, or the :class:`~fiber_dask.engine.poolprotocol.Reason` text why
    there is none.

    ``deliver(msg)`` is called on the link's receiver thread with each
    message for this loop, in order, and with None when the link drops.
    ``dial()``: how to reach the owner, a connection or the reason text why
    not (default :func:`connect_to_owner`; a slot process behind a relay
    dials the relay, :func:`fiber_dask.engine.slotrelay.connect`).
    ``announce``: say ``Attach`` for the loop (False: a keeper holding the
    link for the slot processes it relays, which attach themselves).
    """
    key = (tuple(address), service, authkey)
    while True:
        with _links_lock:
            link = _links.get(key)
            dialler = link is None
            if dialler:
                link = _links[key] = Link(key)
        if dialler:
            try:
                if dial is None:
                    conn = connect_to_owner(address, authkey, service, worker)
                else:
                    conn = dial()
            except BaseException as e:
                # A wrong key, a TLS mismatch: this loop's task fails with
                # it, and every loop waiting for this dial fails counted.
                link._fail(f"{proto.Reason.UNREACHABLE}: dialling the owner: {e!r}")
                raise
            if isinstance(conn, str):
                link._fail(conn)
            else:
                link._open(conn)
        else:
            link.ready.wait()
        if link.failure is not None:
            return link.failure
        if link.add(loop, deliver):
            if announce:
                link.post(loop, proto.Attach(os.getpid(), worker))
            return link
        # The link closed in between (its last loop left, or it dropped):
        # another dial.


def _shutdown(conn: Any) -> None:
    """Shut the socket down both ways without closing it: threads blocked on
    it wake up (EOF), and its descriptor stays ours until ``close``."""
    import socket

    try:
        s = socket.socket(fileno=os.dup(conn.fileno()))
    except OSError:
        return
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        s.close()
