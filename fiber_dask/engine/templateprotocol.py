"""The slot template protocol: every message between a keeper and its template.

Both ends import this module to speak to each other (the keeper,
:mod:`fiber_dask.engine.slots`; the template, :mod:`fiber_dask.engine.slotserver`),
so they cannot disagree about a message's shape; the picture of how a slot
starts is in :mod:`fiber_dask.engine.slots`.  Each message is one frame of
:mod:`fiber_dask.engine.slotpipe` (a pickled plain tuple ``(tag, *fields)``,
length-prefixed, on a private pipe between a process and its own child, never
a network socket): :func:`encode` makes the tuple, :func:`decode` the message.

keeper → template (the template's stdin)::

    Fork(rid, spec)          start a slot process running ``spec`` (the
                             pickled :class:`~fiber_dask.engine.slots.SlotSpec`);
                             ``rid`` numbers the request

template → keeper (its report pipe)::

    Started(rid, pid)        the slot process of request ``rid`` runs, as ``pid``
    Exited(rid, code, reason)
                             it was reaped: ``code`` as
                             :attr:`subprocess.Popen.returncode` (``-N`` for
                             signal N), ``reason`` the string
                             :func:`fiber_dask.engine.poolworker.serve_slot`
                             returned, or None when it died before returning one
    Failed(rid, error)       no slot process could start (``error``: why)
    Restarted(rid, pid)      its slot process returned ``Reason.RECYCLED``
                             (``maxtasksperchild``) and the template started
                             its successor with the same spec at once, as
                             ``pid``: no ``Exited`` comes for the old one; the
                             keeper keeps waiting for the new one's

A request ends with one ``Exited`` or ``Failed``.  The reason travels from
the slot process to the template as the bytes of the string, on a pipe of its
own (``Reason.RECYCLED`` is the one the template reads).

Nothing here imports more than the standard library's ``typing``: the template
and every process that imports fiber_dask load it, and slot starts are on the
path of a pool's start.
"""

from __future__ import annotations

from typing import Any, ClassVar

__all__ = [
    "Fork",
    "Started",
    "Restarted",
    "Exited",
    "Failed",
    "REQUESTS",
    "REPORTS",
    "encode",
    "decode",
]


class _Message:
    """A message: named fields (its ``__slots__``, in order) and a tag."""

    __slots__ = ()
    tag: ClassVar[str]

    def fields(self) -> tuple:
        return tuple(getattr(self, name) for name in self.__slots__)

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.fields() == self.fields()

    def __repr__(self) -> str:
        pairs = zip(self.__slots__, self.fields(), strict=True)
        return f"{type(self).__name__}({', '.join(f'{n}={v!r}' for n, v in pairs)})"


class Fork(_Message):
    """Keeper → template: start a slot process running ``spec`` (bytes)."""

    __slots__ = ("rid", "spec")
    tag = "F"

    def __init__(self, rid: int, spec: bytes) -> None:
        self.rid, self.spec = rid, spec


class Started(_Message):
    """Template → keeper: the slot process of request ``rid`` runs as ``pid``."""

    __slots__ = ("rid", "pid")
    tag = "S"

    def __init__(self, rid: int, pid: int) -> None:
        self.rid, self.pid = rid, pid


class Restarted(_Message):
    """Template → keeper: request ``rid``'s slot process was recycled and its
    successor runs as ``pid`` (no :class:`Exited` for the old one)."""

    __slots__ = ("rid", "pid")
    tag = "R"

    def __init__(self, rid: int, pid: int) -> None:
        self.rid, self.pid = rid, pid


class Exited(_Message):
    """Template → keeper: request ``rid``'s slot process was reaped."""

    __slots__ = ("rid", "code", "reason")
    tag = "X"

    def __init__(self, rid: int, code: int, reason: str | None) -> None:
        self.rid, self.code, self.reason = rid, code, reason


class Failed(_Message):
    """Template → keeper: no slot process could start for request ``rid``."""

    __slots__ = ("rid", "error")
    tag = "E"

    def __init__(self, rid: int, error: str) -> None:
        self.rid, self.error = rid, error


#: What the template reads (its stdin).
REQUESTS: frozenset[type[_Message]] = frozenset({Fork})
#: What the keeper reads (the template's report pipe).
REPORTS: frozenset[type[_Message]] = frozenset({Started, Restarted, Exited, Failed})

_KINDS: dict[str, type[_Message]] = {
    kind.tag: kind for kind in (Fork, Started, Restarted, Exited, Failed)
}


def encode(msg: _Message) -> tuple:
    """The frame for ``msg``: a plain tuple ``(tag, *fields)``."""
    return (msg.tag, *msg.fields())


def decode(frame: Any, expected: frozenset[type[_Message]]) -> Any:
    """The message a frame carries, one of the ``expected`` kinds
    (:data:`REQUESTS` in the template, :data:`REPORTS` in the keeper).

    Raises ``ValueError`` saying what is wrong when it is not: both ends run
    the same fiber_dask, so that is a bug to report.
    """
    try:
        tag, *fields = frame
        kind = _KINDS[tag]
    except (TypeError, ValueError, KeyError):
        what = frame[0] if isinstance(frame, tuple) and frame else frame
        raise ValueError(
            f"fiber-dask slot template protocol: unknown message {what!r:.80} "
            f"(known tags: {', '.join(_KINDS)}); the keeper and its slot "
            "template should run the same fiber_dask: please report this as a bug"
        ) from None
    if len(fields) != len(kind.__slots__):
        raise ValueError(
            f"fiber-dask slot template protocol: {kind.__name__} has "
            f"{len(kind.__slots__)} fields ({', '.join(kind.__slots__)}), the frame "
            f"{len(fields)}; please report this as a bug"
        )
    if kind not in expected:
        raise ValueError(
            f"fiber-dask slot template protocol: a {kind.__name__} came the wrong "
            f"way (this end reads {', '.join(sorted(k.__name__ for k in expected))})"
            "; please report this as a bug"
        )
    return kind(*fields)
