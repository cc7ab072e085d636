"""A crowd of one host's clients at a channel server: what a big host's pool
slots do when they start together, against the owner's gate's bound on
handshakes in progress from one address (lowered here, so that 40-60 threads
overflow it)."""

from __future__ import annotations

import threading
from typing import Any

from .wait import wait_until

from fiber_dask.comm import channel, gate


def crowded_gate(monkeypatch: Any, bound: int = 2) -> None:
    """Lower the gate's bound to ``bound`` handshakes from one address, of
    any age, for the test."""
    monkeypatch.setattr(gate, "MAX_PER_PEER", bound)
    monkeypatch.setattr(gate, "MIN_AGE", 0.0)


def echo_server(authkey: bytes, context: Any = None) -> tuple[Any, list]:
    """A ChannelServer on 127.0.0.1 (TLS with ``context``) whose ``echo``
    service keeps each connection in the list returned beside it."""
    server = channel.ChannelServer("127.0.0.1", authkey, context)
    served: list = []
    server.register("echo", lambda conn, hello: served.append(conn), inline=True)
    return server, served


def connect_at_once(address: Any, authkey: bytes, n: int, timeout: float) -> list[str]:
    """``n`` threads, released together, each connect to ``address``'s
    ``echo`` and close; returns the errors they met (their reprs)."""
    errors: list[str] = []
    start = threading.Barrier(n)

    def client() -> None:
        start.wait()
        try:
            channel.connect(address, authkey, "echo", timeout=timeout).close()
        except Exception as e:  # noqa: BLE001 - returned to the test
            errors.append(repr(e))

    threads = [threading.Thread(target=client) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 10)
    return errors


def all_served(served: list, n: int) -> None:
    """Wait for the service to hold ``n`` connections: it gets each just
    after its client heard "OK"."""
    wait_until(lambda: len(served) == n, 10, f"the service to get all {n}")


def close(server: Any, served: list) -> None:
    for conn in served:
        conn.close()
    server.close()
