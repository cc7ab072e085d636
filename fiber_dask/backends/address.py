"""Attach to an existing Dask scheduler by address."""

from __future__ import annotations

import dask

from .. import config
from ..errors import ClusterConnectionError
from .base import Backend, ClusterHandle, connect, route_host

__all__ = ["AddressBackend", "configured_address"]


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
        host = config.get("listen-host") or route_host(client.scheduler.address)
        return ClusterHandle(
            client, None, owned=False, backend=self.name, listen_host=host
        )
