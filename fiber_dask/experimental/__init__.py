"""Experimental parts beyond the stdlib's API, as Fiber's ``fiber.experimental``.

Their interface may still change between releases.

* :class:`~fiber_dask.experimental.ring.Ring`: N processes across the cluster,
  each with a rank, that find each other so that an initializer can set up a
  collective (``torch.distributed``, Horovod) before they run the same function.
"""

from __future__ import annotations

from ..errors import RingError
from .ring import Ring, RingNode

__all__ = ["Ring", "RingError", "RingNode"]
