"""The backend registry: which names ``fiber.backend`` accepts, and what each names.

Built-ins are ``local`` and ``address``; every other backend (``kubernetes``,
the batch schedulers, third-party ones) registers in the ``fiber_dask.backends``
entry-point group.  :func:`available_backends` (the names ``fiber.validate``
accepts) and :func:`fiber_dask.backends.load_backend` (the class for a name) read
the same :func:`entries`.

A leaf: this module imports nothing of fiber_dask, so the configuration's
validation (:mod:`fiber_dask.configschema`, below the cluster layer) can ask it
for the names without an import cycle.  Broken entry-point metadata is reported
once, as a warning naming the group and the error, and leaves the built-ins
usable.
"""

from __future__ import annotations

import warnings

__all__ = [
    "BUILTIN_BACKENDS",
    "ENTRY_POINT_GROUP",
    "available_backends",
    "entries",
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


def entries() -> dict[str, str]:
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
    return sorted(entries())
