"""Value, Array, RawValue and RawArray that work across the cluster.

**These are not shared memory.**  Processes on different hosts share no
memory, so the ctypes object lives in the process that created it and every
read or write from another process is a round trip to it over the
authenticated channel (~0.1–0.3 ms on one machine; a network round trip
across hosts).  The API, the typecodes and the locking are the stdlib's:
``Value``/``Array`` come with a cluster-wide ``RLock`` (``get_lock()``), and
``v.value += 1`` is only safe inside ``with v.get_lock():``, as in the stdlib.
For bulk data, prefer a Queue or a Pool task's arguments and results.
"""

from __future__ import annotations

import ctypes
from multiprocessing.sharedctypes import (  # noqa: F401 - the stdlib module's names
    assert_spawning,
    class_cache,
    get_context,
    make_property,
    prop_cache,
    rebuild_ctype,
    reduce_ctype,
    template,
    typecode_to_type,
)
from typing import Any

from .comm.objserver import Remote, ServedObject
from .synchronize import Lock, RLock, ServedHandle

__all__ = ["RawValue", "RawArray", "Value", "Array", "copy", "synchronized"]


def _ctype(typecode_or_type: Any) -> Any:
    return typecode_to_type.get(typecode_or_type, typecode_or_type)


def _fields(type_: Any) -> tuple[str, ...]:
    """The field names of a ctypes Structure type (attributes of its value)."""
    names: list[str] = []
    for klass in reversed(getattr(type_, "__mro__", ())):
        for field in getattr(klass, "_fields_", None) or ():
            if field[0] not in names:
                names.append(field[0])
    return tuple(names)


class _CState(ServedObject):
    """The owner's ctypes object and the operations on it."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def get(self, name: str) -> Any:
        return getattr(self.obj, name)

    def set(self, name: str, value: Any) -> None:
        setattr(self.obj, name, value)

    def len(self) -> int:
        return len(self.obj)

    def getitem(self, index: Any) -> Any:
        return self.obj[index]

    def setitem(self, index: Any, value: Any) -> None:
        self.obj[index] = value

    def snapshot(self) -> Any:
        """A copy of the whole ctypes object (for :func:`copy`)."""
        return type(self.obj).from_buffer_copy(self.obj)

    def serve(self, op: str, args: tuple, session: dict) -> Any:
        if op in ("get", "set", "len", "getitem", "setitem", "snapshot"):
            return getattr(self, op)(*args)
        raise ValueError(f"unknown shared ctypes operation {op!r}")


class _Raw(ServedHandle):
    """A lock-less handle to a ctypes object (``RawValue``/``RawArray``, or
    ``lock=False``): like the stdlib's raw ctypes object it has no
    ``get_lock``/``get_obj``."""

    _fields: tuple[str, ...] = ()

    def _start(self, obj: Any) -> None:
        self._create(_CState(obj))
        object.__setattr__(self, "_fields", _fields(type(obj)))

    def _extra_state(self) -> dict:
        return {"_fields": self._fields}

    # A Structure's fields are attributes, as on the ctypes object.
    def __getattr__(self, name: str) -> Any:
        if name in self.__dict__.get("_fields", ()):
            return self._call("get", name)
        raise AttributeError(
            f"{type(self).__name__!r} object has no attribute {name!r}"
        )

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self.__dict__.get("_fields", ()):
            self._call("set", name, value)
        else:
            object.__setattr__(self, name, value)

    def _snapshot(self) -> Any:
        return self._call("snapshot")


class _RawValue(_Raw):
    @property
    def value(self) -> Any:
        return self._call("get", "value")

    @value.setter
    def value(self, v: Any) -> None:
        self._call("set", "value", v)

    def __repr__(self) -> str:
        if self._fields:
            return f"<{type(self).__name__} of a Structure {self._fields}>"
        return f"<{type(self).__name__} {self.value!r}>"


class _RawArray(_Raw):
    def __len__(self) -> int:
        return self._call("len")

    def __getitem__(self, i: Any) -> Any:
        return self._call("getitem", i)

    def __setitem__(self, i: Any, v: Any) -> None:
        self._call("setitem", i, v)

    def __iter__(self):
        return iter(self[:])

    @property
    def value(self) -> Any:  # char arrays, as ctypes
        return self._call("get", "value")

    @value.setter
    def value(self, v: Any) -> None:
        self._call("set", "value", v)

    @property
    def raw(self) -> Any:
        return self._call("get", "raw")

    @raw.setter
    def raw(self, v: Any) -> None:
        self._call("set", "raw", v)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self[:]!r}>"


class SynchronizedBase:
    """What the stdlib's synchronized wrappers add: a cluster-wide lock."""

    _lock: Any = None

    def _extra_state(self) -> dict:
        return {**super()._extra_state(), "_lock": self._lock}  # type: ignore[misc]

    def get_lock(self) -> Any:
        return self._lock

    def get_obj(self) -> Any:
        """The ctypes object itself: only in the process that created it."""
        target = self._target  # type: ignore[attr-defined]
        if isinstance(target, Remote):
            raise NotImplementedError(
                "get_obj() works only in the process that created the value: "
                "elsewhere there is no shared memory to point into"
            )
        return target.obj

    def acquire(self, *args: Any) -> bool:
        return self._lock.acquire(*args)

    def release(self) -> None:
        self._lock.release()

    def __enter__(self) -> bool:
        return self._lock.__enter__()

    def __exit__(self, *exc: Any) -> None:
        self._lock.__exit__(*exc)


class Synchronized(SynchronizedBase, _RawValue):
    """``Value(...)``: a value with a cluster-wide lock (``get_lock()``)."""

    def __repr__(self) -> str:
        if self._fields:
            return f"<Synchronized wrapper for a Structure {self._fields}>"
        return f"<Synchronized wrapper for value {self.value!r}>"


class SynchronizedArray(SynchronizedBase, _RawArray):
    """``Array(...)``: an array with a cluster-wide lock (``get_lock()``)."""

    def __repr__(self) -> str:
        return f"<SynchronizedArray wrapper for {self[:]!r}>"


class SynchronizedString(SynchronizedArray):
    """``Array('c', ...)``: a char array with ``value`` and ``raw``."""


def _lock_for(lock: Any, ctx: Any) -> Any:
    if lock is True or lock is None:
        return ctx.RLock() if ctx is not None else RLock()
    if not hasattr(lock, "acquire"):
        raise AttributeError(f"{lock!r} has no method 'acquire'")
    if not isinstance(lock, (Lock, RLock)):
        raise TypeError(
            f"the lock of a fiber-dask Value or Array must be a fiber_dask Lock or "
            f"RLock, not {type(lock).__name__}: other processes must reach it"
        )
    return lock


def _new_array(type_: Any, size_or_initializer: Any) -> Any:
    if isinstance(size_or_initializer, int):
        return (type_ * size_or_initializer)()
    init = list(size_or_initializer)
    return (type_ * len(init))(*init)


def RawValue(typecode_or_type: Any, *args: Any) -> Any:  # noqa: N802
    """A cluster-wide ctypes value without a lock (not shared memory)."""
    proxy = _RawValue.__new__(_RawValue)
    proxy._start(_ctype(typecode_or_type)(*args))
    return proxy


def RawArray(typecode_or_type: Any, size_or_initializer: Any) -> Any:  # noqa: N802
    """A cluster-wide ctypes array without a lock (not shared memory)."""
    proxy = _RawArray.__new__(_RawArray)
    proxy._start(_new_array(_ctype(typecode_or_type), size_or_initializer))
    return proxy


def synchronized(obj: Any, lock: Any = None, ctx: Any = None) -> Any:
    """A lock-protected handle to ``obj`` (a raw handle or a ctypes object).

    As the stdlib's: ``lock`` None makes a new ``RLock``.
    """
    if isinstance(obj, SynchronizedBase):
        raise TypeError("object already synchronized")
    lock = _lock_for(lock, ctx)
    if isinstance(obj, _Raw):
        array = isinstance(obj, _RawArray)
        ref, target, fields = obj._ref, obj._target, obj._fields
    else:
        array = isinstance(obj, ctypes.Array)
        holder = _RawArray.__new__(_RawArray) if array else _RawValue.__new__(_RawValue)
        holder._start(obj)
        ref, target, fields = holder._ref, holder._target, holder._fields
        obj = holder
    if array:
        ctype_obj = getattr(target, "obj", None)  # None: a remote owner's
        is_char = getattr(ctype_obj, "_type_", None) is ctypes.c_char
        cls: type = SynchronizedString if is_char else SynchronizedArray
    else:
        cls = Synchronized
    proxy = cls.__new__(cls)
    proxy.__dict__.update(_ref=ref, _target=target, _fields=fields, _lock=lock)
    proxy._raw = obj  # keeps the served object while this handle lives
    return proxy


def Value(typecode_or_type: Any, *args: Any, lock: Any = True, ctx: Any = None) -> Any:  # noqa: N802
    """A cluster-wide ctypes value with a cluster-wide lock (``get_lock()``).

    ``lock=False`` gives the raw value (no ``get_lock``), as in the stdlib.
    """
    obj = RawValue(typecode_or_type, *args)
    if lock is False:
        return obj
    return synchronized(obj, None if lock is True else lock, ctx)


def Array(  # noqa: N802
    typecode_or_type: Any,
    size_or_initializer: Any,
    *,
    lock: Any = True,
    ctx: Any = None,
) -> Any:
    """A cluster-wide ctypes array with a cluster-wide lock (``get_lock()``).

    ``lock=False`` gives the raw array (no ``get_lock``), as in the stdlib.
    """
    obj = RawArray(typecode_or_type, size_or_initializer)
    if lock is False:
        return obj
    return synchronized(obj, None if lock is True else lock, ctx)


def copy(obj: Any) -> Any:
    """A new raw value holding a copy of ``obj`` (a ctypes object or a handle)."""
    if isinstance(obj, _Raw):
        snapshot = obj._snapshot()
    else:
        snapshot = type(obj).from_buffer_copy(obj)
    cls = _RawArray if isinstance(snapshot, ctypes.Array) else _RawValue
    proxy = cls.__new__(cls)
    proxy._start(snapshot)
    return proxy
