"""Addresses: the scheduler's and fiber-dask's own.

This module holds the ``address`` backend (attach to a running scheduler by
address, never shut it down), where the scheduler address comes from
(:func:`configured_address`), and the one rule for the interface fiber-dask's
endpoints listen on (:func:`listen_host`): every backend decides its handle's
host with it, and the cluster layer (:func:`fiber_dask.cluster.listen_host`)
decides every channel, object and manager server's with it.
"""

from __future__ import annotations

import socket
from typing import Callable

import dask

from .. import config
from ..errors import ClusterConnectionError
from .base import Backend, ClusterHandle, connect

__all__ = ["AddressBackend", "configured_address", "listen_host", "route_host"]


def configured_address() -> tuple[str | None, str]:
    """The scheduler address from config, and where it was found."""
    addr = config.get("address")
    if addr:
        return addr, "fiber.address"
    addr = dask.config.get("scheduler-address", None)
    if addr:
        return addr, "scheduler-address (DASK_SCHEDULER_ADDRESS)"
    return None, ""


class AddressBackend(Backend):
    """Connect to a running scheduler; never shut it down."""

    name = "address"

    def start(self, *, address: str | None = None) -> ClusterHandle:
        source = "address= argument"
        if address is None:
            address, source = configured_address()
        if not address:
            raise ClusterConnectionError(
                "fiber.backend is 'address' but no scheduler address is configured: "
                "set fiber.address (DASK_FIBER__ADDRESS) or scheduler-address "
                "(DASK_SCHEDULER_ADDRESS), or pass address=."
            )
        client = connect(
            address,
            lambda timeout, e: (
                f"cannot reach the Dask scheduler at {address} (from {source}) "
                f"within fiber.connect-timeout={timeout:g}s: {e}. Check that the "
                "scheduler runs and the address is right, or unset it to use the "
                "embedded local cluster."
            ),
        )
        host = listen_host(client.scheduler.address)
        return ClusterHandle(
            client, None, owned=False, backend=self.name, listen_host=host
        )


def listen_host(
    scheduler_address: str | None = None,
    *,
    handle: ClusterHandle | None = None,
    resolve: Callable[[], ClusterHandle] | None = None,
) -> str:
    """The interface fiber-dask's endpoints listen on: the one rule.

    First match wins:

    1. ``fiber.listen-host``, if set (a launcher sets it for the child it
       starts: the host of the child's Dask worker);
    2. the local address that routes to ``scheduler_address`` (a backend
       deciding for the handle it makes): workers that reach the scheduler
       reach us, and nothing listens on other interfaces;
    3. ``handle``'s host (this process's cluster handle, decided by 2);
    4. inside a Dask worker, the worker's own host;
    5. the host of the handle ``resolve()`` returns (a caller that may start
       the cluster for it);
    6. the local address that routes to the configured scheduler address;
    7. ``127.0.0.1``.

    Never a wildcard unless the user configured one.
    """
    host = config.get("listen-host")
    if host:
        return host
    if scheduler_address:
        return route_host(scheduler_address)
    if handle is not None and handle.listen_host:
        return handle.listen_host
    try:
        from distributed import get_worker
        from distributed.comm import get_address_host

        return get_address_host(get_worker().address)
    except (ImportError, ValueError):
        pass
    if resolve is not None:
        return resolve().listen_host or "127.0.0.1"
    address, _ = configured_address()
    return route_host(address) if address else "127.0.0.1"


def route_host(address: str) -> str:
    """The local IP address this host uses to reach ``address`` (a Dask URI).

    Step 2 of :func:`listen_host`.
    """
    from distributed.comm import get_address_host

    host = get_address_host(address)
    if host in ("localhost", "127.0.0.1", "::1") or host.startswith("127."):
        return "127.0.0.1" if ":" not in host else host
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.connect((host, 9))  # UDP connect sends nothing; it picks a route
            return s.getsockname()[0]
        except OSError:
            return socket.gethostbyname(socket.gethostname())
