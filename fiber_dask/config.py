"""Configuration of fiber-dask: the ``fiber`` namespace of Dask's config system.

Importing this module loads ``fiber.yaml`` next to it into Dask's defaults
(:func:`dask.config.update_defaults`), so every ``fiber.*`` key exists and can be
overridden the usual Dask ways: ``dask.config.set``, ``DASK_FIBER__POOL__CHUNKSIZE=8``
environment variables, YAML files in ``~/.config/dask/``, ``/etc/dask/`` or
``$DASK_CONFIG``.  Nothing is ever written to the user's home directory.

This module reads values (:func:`get`, :func:`timedelta`).
:mod:`fiber_dask.configschema` checks them and says what is wrong; its API is
re-exported here, so ``fiber_dask.config.validate`` and
``fiber_dask.config.ConfigError`` are the names to use.  This module imports it,
never the reverse, so the two files both need (``fiber.yaml``, ``fiber-schema.yaml``)
are loaded there.  Neither imports the cluster layer: validation asks the backend
registry for the names ``fiber.backend`` accepts when it runs.

The import is kept cheap (no ``distributed``, no ``jsonschema``) because it happens on
``import fiber_dask``; :func:`validate` imports ``jsonschema`` the first time it runs.

::

    fiber.yaml ──update_defaults──► dask.config ◄── YAML, DASK_FIBER__*, set()
                                        │
                   get() / timedelta() ─┼─► values for Pool, cluster, backends
                   validate() ──────────┴─► fiber-schema.yaml + installed backends
                   (configschema)             └─► ConfigError: key, value,
                                                  allowed, source
"""

from __future__ import annotations

import copy
from typing import Any

import dask.config

# DEFAULTS_PATH, SCHEMA_PATH and load_yaml are here too, though not in __all__ (as
# before configschema.py was split off): the CLI and the backends use them.
from .configschema import (
    DEFAULTS_PATH,  # noqa: F401
    SCHEMA_PATH,  # noqa: F401
    available_backends,
    defaults,
    describe_problems,
    describe_schema,
    find_source,
    load_yaml,  # noqa: F401
    make_problem,
    near_misses,
    schema,
    sources,
    validate,
)
from .errors import ConfigError, Problem

__all__ = [
    "ConfigError",
    "near_misses",
    "Problem",
    "available_backends",
    "defaults",
    "describe_problems",
    "distributed_setting",
    "describe_schema",
    "find_source",
    "get",
    "make_problem",
    "schema",
    "sources",
    "timedelta",
    "validate",
]

# Dask keeps the object it is given in ``dask.config.defaults`` and re-applies it on
# every ``dask.config.refresh()``; hand it a copy so nobody can change the defaults
# through the module attribute.
dask.config.update_defaults(copy.deepcopy(defaults))


# --------------------------------------------------------------------------- access


def get(key: str, override: Any = None) -> Any:
    """Return the value of ``fiber.<key>``, or ``override`` when it is not None.

    Parameters
    ----------
    key : str
        Dotted key below the ``fiber`` namespace, e.g. ``"pool.chunksize"``.
    override : object, optional
        A value given explicitly by the caller (typically a keyword argument whose
        default is None); returned unchanged when not None.

    Returns
    -------
    object
        The configured value.

    Examples
    --------
    >>> from fiber_dask import config
    >>> config.get("local.threads-per-worker")
    1
    >>> config.get("pool.chunksize", override=8)
    8
    """
    return dask.config.get("fiber." + key, override_with=override)


_distributed_defaults: dict | None = None


def distributed_setting(key: str) -> Any:
    """Dask's setting ``key`` (``distributed.*``), also before distributed is
    imported: the user's value if set (YAML, ``DASK_*``), else distributed's
    default, read from its ``distributed.yaml`` (distributed adds its defaults
    to Dask's config only as it is imported, ~0.4 s that the embedded
    cluster's start makes on a thread of its own)."""
    global _distributed_defaults
    try:
        return dask.config.get(key)
    except KeyError:
        pass
    if _distributed_defaults is None:
        import importlib.util
        import os

        spec = importlib.util.find_spec("distributed")
        if spec is None or not spec.origin:
            raise KeyError(key)
        path = os.path.join(os.path.dirname(spec.origin), "distributed.yaml")
        with open(path) as f:
            _distributed_defaults = load_yaml(f)
    value: Any = _distributed_defaults
    for part in key.split("."):
        value = value[part]
    return value


def timedelta(key: str, override: Any = None) -> float:
    """Return the duration ``fiber.<key>`` (or ``override``) in seconds.

    Parameters
    ----------
    key : str
        Dotted key below the ``fiber`` namespace, e.g. ``"connect-timeout"``.
    override : str, float or datetime.timedelta, optional
        A duration given explicitly by the caller; used when not None.

    Returns
    -------
    float
        Seconds.

    Raises
    ------
    ConfigError
        If the value is not a duration.

    Examples
    --------
    >>> from fiber_dask import config
    >>> config.timedelta("pool.prefetch")
    0.02
    >>> config.timedelta("connect-timeout", override="1m")
    60.0
    """
    from dask.utils import parse_timedelta

    value = get(key, override)
    try:
        seconds = parse_timedelta(value, default="seconds")
    except (ValueError, KeyError, TypeError, IndexError):
        seconds = None
    if seconds is None or seconds < 0:
        what = "the argument for" if override is not None else "the setting"
        raise ConfigError(
            f"{what} fiber.{key} = {value!r} is not a duration; expected a string "
            "such as '5s', '20ms', '1m' or a non-negative number of seconds"
        )
    return float(seconds)
