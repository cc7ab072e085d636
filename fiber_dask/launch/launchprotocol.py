"""The launch protocol: every message between a Process's parent and its launcher.

Both ends import this module to speak to each other, so they cannot disagree
about a message's shape: the parent's half is :mod:`fiber_dask.launch.popen`,
the launcher's (the Dask task beside the child, on the worker host) is
:mod:`fiber_dask.launch.launcher`.  :mod:`fiber_dask.engine.poolprotocol` is
the model, for the Pool.

One Process has one connection, the launcher's, over the authenticated
channel (:mod:`fiber_dask.comm.channel`); its handshake carries the
launcher's :class:`Hello`, then each frame is one message (:func:`encode`)::

    parent (popen)                              launcher
    ──────────────                              ────────
    channel server ◄── connect, HMAC, Hello ─── channel.connect
      ── Payload(blob) ─────────────────────►  the child's payload (first)
      ◄── Started(pid) ─────────────────────   the child runs, pid on its host
       or StartFailed(why)                     it could not be started (last)
      ◄── Output(fd, data) ─────────────────   bytes the child wrote to fd 1/2
      ── Signal(signum) ────────────────────►  terminate(), kill(), interrupt()
      ◄── Exit(returncode) ─────────────────   the child was reaped (last)

A connection that drops is the end of the other side: the parent's Process
ends with ``exitcode == -SIGKILL`` (its launcher's worker died), the
launcher's child is told its parent is gone and killed soon after.  A frame
that is not a message of this module (:class:`ProtocolError`) ends the
connection the same way: the two ends ship together, so this is a bug or two
fiber-dask versions, never something to skip.

The launcher's Dask task returns a :class:`LaunchResult` (an :class:`Outcome`
and its detail); the parent reads it only when no launcher ever connected, to
say why in ``Process.reason``.

Each message is pickled as one plain tuple ``(tag, *fields)``: an
:class:`Output` costs what its bytes cost, as the child's stdout and stderr
travel in them.
"""

from __future__ import annotations

import enum
import pickle
from dataclasses import dataclass
from typing import Any

__all__ = [
    "Hello",
    "Payload",
    "Signal",
    "Started",
    "StartFailed",
    "Output",
    "Exit",
    "ProtocolError",
    "encode",
    "decode",
    "Outcome",
    "LaunchResult",
]

_PROTOCOL = pickle.HIGHEST_PROTOCOL


class ProtocolError(ValueError):
    """A frame on a launcher connection that is not a launch-protocol message."""


class Hello:
    """Launcher → parent, in the channel's handshake: the process that runs
    the launcher (``pid``), its Dask worker's address (``worker``), which
    ``Process.reason`` names if it is lost, and whether it runs as the
    Process's Dask task (``task``: it holds the Process's ``resources=``
    until the child ends) or beside a worker's tasks (its twin, started when
    the task stayed queued: the queued task is then cancelled).  Travels as
    a plain dict (the channel's handshake carries small plain data only)."""

    __slots__ = ("pid", "worker", "task")

    def __init__(self, pid: int | None, worker: str | None, task: bool = True) -> None:
        self.pid, self.worker, self.task = pid, worker, task

    def to_wire(self) -> dict:
        return {"pid": self.pid, "worker": self.worker, "task": self.task}

    @classmethod
    def from_wire(cls, raw: Any) -> Hello:
        raw = raw if isinstance(raw, dict) else {}
        return cls(raw.get("pid"), raw.get("worker"), raw.get("task") is True)


class Payload:
    """Parent → launcher, the first message: the child's payload (the
    Process object's state, for :mod:`fiber_dask.launch.processchild`),
    opaque to the launcher, which writes it to the child's stdin."""

    __slots__ = ("blob",)
    tag = "P"

    def __init__(self, blob: bytes) -> None:
        self.blob = blob

    def fields(self) -> tuple:
        return (self.blob,)


class Signal:
    """Parent → launcher: send ``signum`` to the child (``terminate()``,
    ``kill()``; ``interrupt()``'s SIGINT once the starting child takes it); a
    no-op once the child is reaped."""

    __slots__ = ("signum",)
    tag = "S"

    def __init__(self, signum: int) -> None:
        self.signum = signum

    def fields(self) -> tuple:
        return (self.signum,)


class Started:
    """Launcher → parent: the child runs; ``pid`` on the worker host."""

    __slots__ = ("pid",)
    tag = "R"

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def fields(self) -> tuple:
        return (self.pid,)


class StartFailed:
    """Launcher → parent, its last message: the child could not be started;
    ``why`` says so, for ``Process.reason``."""

    __slots__ = ("why",)
    tag = "F"

    def __init__(self, why: str) -> None:
        self.why = why

    def fields(self) -> tuple:
        return (self.why,)


class Output:
    """Launcher → parent: ``data`` the child wrote to its stdout (``fd`` 1)
    or stderr (``fd`` 2), as read from the pipe (any size, any cut)."""

    __slots__ = ("fd", "data")
    tag = "O"

    def __init__(self, fd: int, data: bytes) -> None:
        self.fd, self.data = fd, data

    def fields(self) -> tuple:
        return (self.fd, self.data)


class Exit:
    """Launcher → parent, its last message: the child was reaped with
    ``returncode`` (``subprocess``'s: ``-N`` for signal ``N``), after the
    output it wrote before it exited."""

    __slots__ = ("returncode",)
    tag = "X"

    def __init__(self, returncode: int) -> None:
        self.returncode = returncode

    def fields(self) -> tuple:
        return (self.returncode,)


_KINDS = {
    kind.tag: kind for kind in (Payload, Signal, Started, StartFailed, Output, Exit)
}


def encode(msg: Any) -> bytes:
    """One frame: ``msg`` as the plain tuple ``(tag, *fields)``."""
    return pickle.dumps((msg.tag, *msg.fields()), protocol=_PROTOCOL)


def decode(raw: bytes) -> Any:
    """The message of a frame :func:`encode` made.

    Raises :class:`ProtocolError` for anything else (what pickle raised for
    bytes that are no pickle is its ``__cause__``).
    """
    try:
        tag, *fields = pickle.loads(raw)
    except Exception as e:  # truncated, not a pickle, not a tuple
        raise ProtocolError(
            f"fiber-dask launch protocol: a frame of {len(raw)} bytes is not a "
            f"message ({type(e).__name__}: {e})"
        ) from e
    kind = _KINDS.get(tag) if isinstance(tag, str) else None
    if kind is None:
        raise ProtocolError(
            f"fiber-dask launch protocol: unknown message tag {tag!r} (known: "
            f"{', '.join(sorted(_KINDS))}); the parent and the launcher must run "
            "the same fiber-dask version"
        )
    try:
        return kind(*fields)
    except TypeError as e:
        raise ProtocolError(
            f"fiber-dask launch protocol: a {kind.__name__} message with "
            f"{len(fields)} fields ({e})"
        ) from None


# ------------------------------------------------------------- task result


class Outcome(enum.Enum):
    """How a launcher ended."""

    EXITED = "exited"  # the child ran and exited; its status went to the parent
    REFUSED = "refused"  # another launcher already runs this Process, or it ended
    PARENT_LOST = "parent-lost"  # the parent's connection dropped: child killed
    UNREACHABLE = "unreachable"  # the parent's address cannot be reached from here
    FAILED = "failed"  # the child could not be started


@dataclass(frozen=True)
class LaunchResult:
    """A launcher task's result: its :class:`Outcome` and, for
    ``UNREACHABLE`` and ``FAILED``, what went wrong (for ``Process.reason``)."""

    outcome: Outcome
    detail: str = ""
