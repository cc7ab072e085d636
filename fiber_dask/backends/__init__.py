"""Cluster backends: how fiber-dask gets a Dask cluster.

A backend turns the ``fiber`` config into a connected ``distributed.Client``.
Built-ins are ``local`` (the embedded default) and ``address`` (an existing
scheduler); ``kubernetes``, the batch schedulers ``slurm``, ``pbs``, ``sge``,
``lsf`` and ``htcondor`` (dask-jobqueue, :mod:`.jobqueue`) and third-party
backends register themselves in the ``fiber_dask.backends`` entry-point group::

    [project.entry-points."fiber_dask.backends"]
    mybackend = "mypackage.fiber:MyBackend"

and are chosen with ``fiber.backend: mybackend``.
"""

from __future__ import annotations

from importlib.metadata import entry_points

from .base import Backend, ClusterHandle

__all__ = ["Backend", "ClusterHandle", "load_backend", "available_backends"]

_BUILTIN = {
    "local": "fiber_dask.backends.local:LocalBackend",
    "address": "fiber_dask.backends.address:AddressBackend",
}


def _registry() -> dict[str, str]:
    found = dict(_BUILTIN)
    for ep in entry_points(group="fiber_dask.backends"):
        found[ep.name] = ep.value
    return found


def available_backends() -> list[str]:
    """Names accepted by ``fiber.backend``."""
    return sorted(_registry())


def load_backend(name: str) -> type[Backend]:
    """The backend class registered under ``name``."""
    registry = _registry()
    try:
        target = registry[name]
    except KeyError:
        from ..config import ConfigError

        raise ConfigError(
            f"fiber.backend is {name!r}, which is not an installed backend; "
            f"allowed: {', '.join(sorted(registry))} (or null for automatic). "
            "Third-party backends register in the 'fiber_dask.backends' entry-point group."
        ) from None
    module_name, _, attr = target.partition(":")
    import importlib

    module = importlib.import_module(module_name)
    return getattr(module, attr)
