"""A port picked before the server that will listen on it starts, and held
until it does.

The embedded scheduler's address is known before the scheduler starts
(:mod:`fiber_dask.engine.earlyslots`: processes started meanwhile are told
where to attach).  Binding port 0 and closing the socket, as test suites and
launchers often do, leaves a window in which any other socket on the host
may take the port: an outgoing connection's ephemeral port or another
``bind(("127.0.0.1", 0))`` (CI saw the scheduler fail with "Address already
in use" while another test file ran beside it).

A :class:`PortReservation` keeps the port bound, with ``SO_REUSEADDR`` and
never listening, until :meth:`~PortReservation.release`.  Linux then gives
the port to no ephemeral allocation (``connect`` or ``bind`` to port 0), yet
lets a server that sets ``SO_REUSEADDR`` too (tornado's ``bind_sockets``,
which distributed's TCP listener uses) bind and listen on it: two sockets
with ``SO_REUSEADDR`` may share a port while neither listens.  The owner
releases it once the server is up, or has failed to start.
"""

from __future__ import annotations

import socket
import threading

__all__ = ["PortReservation"]


class PortReservation:
    """A free TCP port on ``host``, held bound until :meth:`release`."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, 0))
        except BaseException:
            sock.close()
            raise
        self._sock: socket.socket | None = sock
        self._lock = threading.Lock()
        self.host = host
        self.port: int = sock.getsockname()[1]

    def release(self) -> None:
        """Let the port go (idempotent): call once the server listens on it,
        or will not."""
        with self._lock:
            sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()

    def __repr__(self) -> str:
        state = "held" if self._sock is not None else "released"
        return f"<PortReservation {self.host}:{self.port} {state}>"
