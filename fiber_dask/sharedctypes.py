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

from multiprocessing.sharedctypes import typecode_to_type
from typing import Any

from .objserver import Remote, ServedObject
from .synchronize import Lock, RLock, _Served

__all__ = ["Value", "Array", "RawValue", "RawArray"]


def _ctype(typecode_or_type: Any) -> Any:
    return typecode_to_type.get(typecode_or_type, typecode_or_type)


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

    def serve(self, op: str, args: tuple, session: dict) -> Any:
        if op in ("get", "set", "len", "getitem", "setitem"):
            return getattr(self, op)(*args)
        raise ValueError(f"unknown shared ctypes operation {op!r}")


class _Proxy(_Served):
    _lock: Any = None

    def _start(self, obj: Any, lock: Any) -> None:
        self._create(_CState(obj))
        self._lock = lock

    def _extra_state(self) -> dict:
        return {"_lock": self._lock}

    def get_lock(self) -> Any:
        if self._lock is None:
            raise AttributeError("a Raw value or array has no lock")
        return self._lock

    def get_obj(self) -> Any:
        """The ctypes object itself: only in the process that created it."""
        target = self._target
        if isinstance(target, Remote):
            raise NotImplementedError(
                "get_obj() works only in the process that created the value: "
                "elsewhere there is no shared memory to point into"
            )
        return target.obj

    def acquire(self, *args: Any) -> bool:
        return self.get_lock().acquire(*args)

    def release(self) -> None:
        self.get_lock().release()

    def __enter__(self) -> bool:
        return self.get_lock().__enter__()

    def __exit__(self, *exc: Any) -> None:
        self.get_lock().__exit__(*exc)


class _ValueProxy(_Proxy):
    @property
    def value(self) -> Any:
        return self._call("get", "value")

    @value.setter
    def value(self, v: Any) -> None:
        self._call("set", "value", v)

    def __repr__(self) -> str:
        return f"<Synchronized wrapper for value {self.value!r}>"


class _ArrayProxy(_Proxy):
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
        return f"<Synchronized wrapper for array {self[:]!r}>"


def _lock_for(lock: Any) -> Any:
    if lock is True or lock is None:
        return RLock()
    if isinstance(lock, (Lock, RLock)):
        return lock
    if lock is False:
        return None
    raise AttributeError(f"{lock!r} has no method 'acquire'")


def RawValue(typecode_or_type: Any, *args: Any) -> Any:  # noqa: N802
    """A cluster-wide ctypes value without a lock (not shared memory)."""
    proxy = _ValueProxy()
    proxy._start(_ctype(typecode_or_type)(*args), None)
    return proxy


def RawArray(typecode_or_type: Any, size_or_initializer: Any) -> Any:  # noqa: N802
    """A cluster-wide ctypes array without a lock (not shared memory)."""
    type_ = _ctype(typecode_or_type)
    if isinstance(size_or_initializer, int):
        obj = (type_ * size_or_initializer)()
    else:
        init = list(size_or_initializer)
        obj = (type_ * len(init))(*init)
    proxy = _ArrayProxy()
    proxy._start(obj, None)
    return proxy


def Value(typecode_or_type: Any, *args: Any, lock: Any = True, ctx: Any = None) -> Any:  # noqa: N802
    """A cluster-wide ctypes value with a cluster-wide lock (``get_lock()``)."""
    proxy = RawValue(typecode_or_type, *args)
    proxy._lock = _lock_for(lock)
    return proxy


def Array(  # noqa: N802
    typecode_or_type: Any,
    size_or_initializer: Any,
    *,
    lock: Any = True,
    ctx: Any = None,
) -> Any:
    """A cluster-wide ctypes array with a cluster-wide lock (``get_lock()``)."""
    proxy = RawArray(typecode_or_type, size_or_initializer)
    proxy._lock = _lock_for(lock)
    return proxy
