"""``meta``: per-function resource hints (from Fiber) mapped to Dask worker resources.

Fiber let a target declare what it needs::

    @fiber_dask.meta(cpu=4, memory=2000, gpu=1)
    def train(...): ...

fiber-dask turns that into Dask *worker resources* for the task that runs it:
``cpu`` → ``CPU``, ``gpu`` → ``GPU``, ``memory`` (MB, as in Fiber) → ``MEMORY``.
Dask only places such a task on workers started with those resources, e.g.
``dask worker ... --resources "GPU=1,MEMORY=16000"``; on a cluster with no such
worker it waits (the embedded local cluster declares none).
"""

from __future__ import annotations

from typing import Any, Callable

__all__ = ["meta", "resources_of", "RESOURCE_NAMES"]

#: Fiber's keyword → the Dask resource name it requests.
RESOURCE_NAMES = {"cpu": "CPU", "gpu": "GPU", "memory": "MEMORY"}


def meta(**hints: float) -> Callable[[Callable], Callable]:
    """Declare the resources a Process target needs (``cpu``, ``gpu``, ``memory`` in MB).

    Examples
    --------
    >>> import fiber_dask
    >>> @fiber_dask.meta(gpu=1)
    ... def train():
    ...     pass
    >>> fiber_dask.meta.resources_of(train)  # doctest: +SKIP
    {'GPU': 1}
    """
    unknown = set(hints) - set(RESOURCE_NAMES)
    if unknown:
        raise TypeError(
            f"meta() got unknown hints {sorted(unknown)}; allowed: "
            f"{', '.join(sorted(RESOURCE_NAMES))}"
        )
    for key, value in hints.items():
        if not isinstance(value, (int, float)) or value < 0:
            raise ValueError(f"meta({key}=...) must be a number >= 0, not {value!r}")

    def decorate(func: Callable) -> Callable:
        func.__fiber_meta__ = dict(hints)  # type: ignore[attr-defined]
        return func

    return decorate


def resources_of(func: Any) -> dict[str, float] | None:
    """The Dask resources ``func``'s ``meta`` hints ask for, or None."""
    hints = getattr(func, "__fiber_meta__", None)
    if not hints:
        return None
    return {RESOURCE_NAMES[k]: v for k, v in hints.items() if v}


meta.resources_of = resources_of  # type: ignore[attr-defined]
