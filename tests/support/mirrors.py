"""The stdlib ``multiprocessing`` submodules fiber_dask replaces with its own
(the others, e.g. ``dummy``, ``util``, are the stdlib's own under the swap)."""

from __future__ import annotations

__all__ = ["SUBMODULES"]

SUBMODULES = [
    "connection",
    "context",
    "managers",
    "pool",
    "process",
    "queues",
    "sharedctypes",
    "synchronize",
]
