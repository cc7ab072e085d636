"""Module-level task functions for the Pool conformance suite.

Everything here must be importable *by name* in a worker process: stdlib
``multiprocessing`` pickles functions by reference, so the workers (forkserver
children for the stdlib oracle, Dask worker processes for fiber_dask) import this
module as ``tasks.conformance``.  ``tests/`` is on ``sys.path`` through pytest's rootdir
handling and, for processes started another way, through ``PYTHONPATH`` (see
``conftest.py``).

Keep the functions tiny and deterministic; tests assert on exact values.
"""

from __future__ import annotations

import os
import threading
import time

# Set by ``init_global`` (a Pool ``initializer``) and read back by ``get_global``.
_INIT_VALUE: object = None


class CustomError(Exception):
    """An exception class the parent can only rebuild by importing this module."""


def identity(x):
    return x


def square(x):
    return x * x


def add(a, b, c=0):
    return a + b + c


def length(data):
    return len(data)


def getpid(_=None):
    return os.getpid()


def sleepy(delay, value=None):
    """Sleep ``delay`` seconds, then return ``value`` (or ``delay`` if omitted)."""
    time.sleep(delay)
    return delay if value is None else value


def raise_value_error(message):
    raise ValueError(message)


def fail_on_three(x):
    """Square ``x``, but fail for the single item 3."""
    if x == 3:
        raise ValueError(f"bad item {x}")
    return x * x


def raise_custom(code):
    raise CustomError("custom failure", code)


def return_lock(_=None):
    """Return an object that cannot be pickled (not even by cloudpickle)."""
    return threading.Lock()


def init_global(value):
    global _INIT_VALUE
    _INIT_VALUE = value


def get_global(_=None):
    return _INIT_VALUE
