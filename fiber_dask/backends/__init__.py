"""Cluster backends: how fiber-dask gets a Dask cluster, and their registry.

A backend turns the ``fiber`` config into a connected ``distributed.Client``.
Built-ins are ``local`` (the embedded default) and ``address`` (an existing
scheduler); ``kubernetes``, the batch schedulers ``slurm``, ``pbs``, ``sge``,
``lsf`` and ``htcondor`` (dask-jobqueue, :mod:`.jobqueue`) and third-party
backends register themselves in the ``fiber_dask.backends`` entry-point group::

    [project.entry-points."fiber_dask.backends"]
    mybackend = "mypackage.fiber:MyBackend"

and are chosen with ``fiber.backend: mybackend``.

The registry is :mod:`.registry`, a leaf that imports nothing of fiber_dask:
:func:`available_backends` (the names ``fiber.validate`` accepts) and
:func:`load_backend` (the class for a name, here) read the same entries.  An
entry point whose target cannot be imported is a
:class:`~fiber_dask.errors.ConfigError` naming the entry point and the error,
raised when it is chosen.
"""

from __future__ import annotations

import importlib
from typing import Any

from ..errors import ConfigError
from .base import Backend, ClusterHandle
from .registry import (
    BUILTIN_BACKENDS,
    ENTRY_POINT_GROUP,
    available_backends,
    entries,
)

__all__ = [
    "BUILTIN_BACKENDS",
    "ENTRY_POINT_GROUP",
    "Backend",
    "ClusterHandle",
    "available_backends",
    "load_backend",
]


def load_backend(name: str) -> type[Backend]:
    """The backend class registered under ``name``.

    Raises
    ------
    fiber_dask.errors.ConfigError
        No backend has that name, or its entry point cannot be loaded (the
        message names the entry point and the error).
    """
    registry = entries()
    try:
        target = registry[name]
    except KeyError:
        raise ConfigError(
            f"fiber.backend is {name!r}, which is not an installed backend; "
            f"allowed: {', '.join(sorted(registry))} (or null for automatic). "
            f"Third-party backends register in the {ENTRY_POINT_GROUP!r} "
            "entry-point group."
        ) from None
    module_name, _, attr = target.partition(":")
    try:
        found: Any = importlib.import_module(module_name)
        for part in filter(None, attr.split(".")):
            found = getattr(found, part)
    except Exception as e:  # noqa: BLE001 - whatever the plugin's import raises
        raise ConfigError(
            f"fiber.backend is {name!r}, whose entry point {name} = {target} "
            f"cannot be loaded ({type(e).__name__}: {e}). Fix or reinstall the "
            "package that provides it, or choose another fiber.backend."
        ) from e
    return found
