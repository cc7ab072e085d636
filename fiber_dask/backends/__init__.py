"""Cluster backends: how fiber-dask gets a Dask cluster, and their registry.

A backend turns the ``fiber`` config into a connected ``distributed.Client``.
Built-ins are ``local`` (the embedded default) and ``address`` (an existing
scheduler); ``kubernetes``, the batch schedulers ``slurm``, ``pbs``, ``sge``,
``lsf`` and ``htcondor`` (dask-jobqueue, :mod:`.jobqueue`) and third-party
backends register themselves in the ``fiber_dask.backends`` entry-point group::

    [project.entry-points."fiber_dask.backends"]
    mybackend = "mypackage.fiber:MyBackend"

and are chosen with ``fiber.backend: mybackend``.

This module is the one registry: :func:`available_backends` (the names
``fiber.validate`` accepts) and :func:`load_backend` (the class for a name) read
the same entries.  Broken entry-point metadata is reported once, as a warning
naming the group and the error, and leaves the built-ins usable; an entry point
whose target cannot be imported is a :class:`~fiber_dask.config.ConfigError`
naming the entry point and the error, raised when it is chosen.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

from .base import Backend, ClusterHandle

__all__ = [
    "BUILTIN_BACKENDS",
    "ENTRY_POINT_GROUP",
    "Backend",
    "ClusterHandle",
    "available_backends",
    "load_backend",
]

#: Entry-point group in which backends register their names.
ENTRY_POINT_GROUP = "fiber_dask.backends"

#: Backends that ship with fiber-dask, usable even without installed metadata
#: (a source checkout on ``sys.path``); plugins add more through entry points.
BUILTIN_BACKENDS = {
    "local": "fiber_dask.backends.local:LocalBackend",
    "address": "fiber_dask.backends.address:AddressBackend",
}

_reported: set[str] = set()  # broken metadata already warned about


def _registry() -> dict[str, str]:
    """Name → ``module:attribute`` of every backend: the built-ins, then the
    entry points (which may replace a built-in)."""
    found = dict(BUILTIN_BACKENDS)
    from importlib.metadata import entry_points

    try:
        registered = [
            (ep.name, ep.value) for ep in entry_points(group=ENTRY_POINT_GROUP)
        ]
    except Exception as e:  # noqa: BLE001 - any broken distribution's metadata
        # It must not make every Pool creation fail: the built-ins stay usable,
        # and an unknown name is still reported by fiber.backend's check.
        message = f"{type(e).__name__}: {e}"
        if message not in _reported:
            _reported.add(message)
            warnings.warn(
                f"fiber-dask cannot read the {ENTRY_POINT_GROUP!r} entry points "
                f"({message}); only the built-in backends "
                f"({', '.join(sorted(BUILTIN_BACKENDS))}) are available. Reinstall "
                "the distribution whose metadata is broken.",
                RuntimeWarning,
                stacklevel=3,
            )
        registered = []
    found.update(registered)
    return found


def available_backends() -> list[str]:
    """Names accepted by ``fiber.backend``, sorted."""
    return sorted(_registry())


def load_backend(name: str) -> type[Backend]:
    """The backend class registered under ``name``.

    Raises
    ------
    fiber_dask.config.ConfigError
        No backend has that name, or its entry point cannot be loaded (the
        message names the entry point and the error).
    """
    from ..config import ConfigError

    registry = _registry()
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
