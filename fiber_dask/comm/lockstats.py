"""Who holds a lock: the held locks of each process, reported to the scheduler.

No distributed lock shows its holder (dask/distributed#8772).  A fiber-dask
``Lock``, ``RLock``, ``Semaphore``, ``BoundedSemaphore`` (and a ``Condition``,
which lives with its lock) is served by the process that created it
(:mod:`fiber_dask.comm.objserver`), which therefore knows which process holds
it: each acquisition brings the acquirer's process name, pid, host and thread,
and the owner notes when it was taken.  This module is the one owner of how
that travels, both ends::

    lock's owner process                          scheduler
    ────────────────────                          ─────────
    SemaphoreState (fiber_dask.synchronize)       LockStore (kept by the
      acquire/release keep its holders            fiber_dask.dashboard plugin,
      first holder ─► watch(state)                beside the pools' store)
    reporter thread, every INTERVAL s while
    any lock of this process is held (and once
    more when none is):
      snapshot() ──────────────── rpc ──────────► fiber_locks_update(...)
                                                  document() ─► the pools
                                                  document's "locks" (fiber-dask
                                                  info, /fiber/pools.json, the
                                                  Fiber Pools page)

* A program asks a lock itself: ``lock.holders()`` / ``lock.holder()``
  (:class:`LockHolder`), one round trip to its owner.
* Only a process bound to a cluster reports (one that started a Pool, a
  Process, ...: ``cluster.current_handle()``); none is started for it.  The
  reporter sends only to a scheduler whose plugin says it takes lock reports
  (``"locks"`` in its pool-stats metadata).
* The scheduler drops a process's locks when it reports none held, when its
  client goes away, or ``STALE_AFTER`` s after its last report.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
import uuid
import weakref
from typing import Any, NamedTuple

__all__ = [
    "LockHolder",
    "Holders",
    "creation_site",
    "watch",
    "held",
    "snapshot",
    "holder_dict",
    "LockStore",
    "describe",
    "INTERVAL",
    "STALE_AFTER",
    "MAX_LISTED",
    "UPDATE",
    "VERSION",
]

#: Seconds between two reports of a process while it has locks held.
INTERVAL = 1.0
#: Seconds after its last report a process's locks are dropped at the scheduler.
STALE_AFTER = 10.0
#: Seconds one report may take before it is given up.
SEND_TIMEOUT = 5.0
#: Version of the report format; the scheduler ignores reports of another.
VERSION = 1
#: Holders listed per lock in a report (a semaphore may have many).
MAX_LISTED = 32

#: The scheduler handler that takes a process's report.
UPDATE = "fiber_locks_update"
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class LockHolder(NamedTuple):
    """Who holds a fiber-dask lock (or one unit of a semaphore).

    ``process`` is the holder's ``current_process().name`` when it acquired,
    ``pid`` and ``host`` where it runs, ``thread`` its thread's ident,
    ``since`` when it acquired (Unix time, the owner's clock), ``held_for``
    the seconds since then, and ``alive`` False once the holder's process
    has gone (a ``Lock`` stays held for a hand-off until a waiter takes it).
    """

    process: str
    pid: int
    host: str
    thread: int
    since: float
    held_for: float
    alive: bool


class Holders:
    """The holders of one served lock, kept by its owner under the lock's own
    condition (every method is called with it held).

    An entry is ``[who, name, since, since_mono, session, alive]``; ``who``
    is ``(host, pid, thread)``, ``session`` the connection it acquired on.
    """

    __slots__ = ("entries",)

    def __init__(self) -> None:
        self.entries: list[list] = []

    def add(self, who: tuple, name: str | None, session: Any) -> None:
        self.entries.append(
            [who, name or "?", time.time(), time.monotonic(), session, True]
        )

    def drop(self, session: Any = None, who: tuple | None = None) -> None:
        """One release: the entry of ``who`` (an RLock's owner), else of
        ``session`` (the releaser's own acquisition), else of a holder that
        died, else the oldest (a ``Lock`` released by another process)."""
        entries = self.entries
        for match in (
            lambda e: who is not None and e[0] == who,
            lambda e: e[4] is session,
            lambda e: not e[5],
            lambda e: True,
        ):
            for i, entry in enumerate(entries):
                if match(entry):
                    del entries[i]
                    return

    def drop_dead(self) -> None:
        """A dead holder's unit went to a waiter."""
        for i, entry in enumerate(self.entries):
            if not entry[5]:
                del self.entries[i]
                return

    def gone(self, session: Any, release: bool) -> None:
        """The connection ``session`` ended: its entries go (``release``: an
        RLock, freed at once) or are marked dead (still held)."""
        if release:
            self.entries = [e for e in self.entries if e[4] is not session]
            return
        for entry in self.entries:
            if entry[4] is session:
                entry[5] = False

    def listed(self) -> list[tuple]:
        now = time.monotonic()
        return [
            (e[1], e[0][1], e[0][0], e[0][2], e[2], round(now - e[3], 3), e[5])
            for e in self.entries
        ]


def creation_site() -> str:
    """``file:line`` of the user's code creating a lock (the first frame
    outside fiber_dask), to tell locks apart where they are listed."""
    try:
        frame = sys._getframe(1)
    except ValueError:  # pragma: no cover
        return "?"
    while frame is not None:
        filename = frame.f_code.co_filename
        if not os.path.abspath(filename).startswith(_PACKAGE_DIR + os.sep):
            return f"{os.path.basename(filename)}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


# ------------------------------------------------------------------ owner side


def _owner() -> dict[str, Any]:
    argv0 = sys.argv[0] if sys.argv and sys.argv[0] else ""
    program = os.path.basename(argv0) or "python"
    return {"host": socket.gethostname(), "pid": os.getpid(), "program": program}


def snapshot() -> list[dict[str, Any]]:
    """This process's held locks: one dict per lock, for the scheduler."""
    out = []
    for state in _reporter.watched():
        report = state.report()
        if report is not None:
            out.append(report)
    out.sort(key=lambda r: (r["holders"][0]["since"] if r["holders"] else 0, r["id"]))
    return out


def holder_dict(holder: tuple) -> dict[str, Any]:
    return dict(zip(LockHolder._fields, holder))


class _Reporter:
    """This process's one lock-reporting thread (started by the first holder)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.states: weakref.WeakSet = weakref.WeakSet()
        self.thread: threading.Thread | None = None
        self.wake = threading.Event()
        self.id = uuid.uuid4().hex
        #: client -> whether its scheduler takes lock reports (asked once)
        self.supported: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def watch(self, state: Any) -> None:
        with self.lock:
            self.states.add(state)

    def watched(self) -> list[Any]:
        """The locks watched (a copy: locks are made in other threads)."""
        with self.lock:
            return list(self.states)

    def held(self) -> None:
        """A lock of this process got its first holder (called without the
        lock's own condition held: the thread takes it, after this lock)."""
        from .. import cluster

        if cluster.current_handle() is None:
            return  # bound to no cluster: nobody to tell (none is started)
        with self.lock:
            if self.thread is None:  # else it looks every interval
                self.thread = threading.Thread(
                    target=self._run, name="fiber-lock-stats", daemon=True
                )
                self.thread.start()

    def _run(self) -> None:
        sent_any = False
        while True:
            try:
                locks = snapshot()
                if locks or sent_any:
                    self._send(locks)
                sent_any = bool(locks)
            except Exception:  # noqa: BLE001 - never let reporting hurt a lock
                pass
            if not sent_any:
                with self.lock:
                    # A lock taken meanwhile would find the thread still set:
                    # look once more before leaving.
                    if not any(s.is_held() for s in list(self.states)):
                        self.thread = None
                        return
            self.wake.wait(INTERVAL)
            self.wake.clear()

    def _send(self, locks: list[dict[str, Any]]) -> None:
        from .. import cluster

        handle = cluster.current_handle()
        client = getattr(handle, "client", None)
        if client is None or client.status != "running":
            return
        if not self._supported(client):
            return
        _call(
            client,
            UPDATE,
            reporter=self.id,
            owner=_owner(),
            locks=locks,
            client_id=client.id,
            version=VERSION,
        )

    def _supported(self, client: Any) -> bool:
        known = self.supported.get(client)
        if known is None:
            meta = _call(
                client, "get_metadata", keys=["fiber-dask", "pool-stats"], default=None
            )
            known = self.supported[client] = bool(
                isinstance(meta, dict) and meta.get("locks")
            )
        return known


def _call(client: Any, op: str, **msg: Any) -> Any:
    """One rpc to the client's scheduler, from a thread that is not its
    loop's, given up after ``SEND_TIMEOUT``."""
    from distributed.utils import sync

    return sync(
        client.loop, getattr(client.scheduler, op), callback_timeout=SEND_TIMEOUT, **msg
    )


_reporter = _Reporter()


def watch(state: Any) -> None:
    """Report ``state`` (a served lock) whenever it is held: it has
    ``is_held()`` and ``report()``."""
    _reporter.watch(state)


def held() -> None:
    """Called by a lock as it gets its first holder."""
    _reporter.held()


# -------------------------------------------------------------- scheduler side


def _clean_holder(h: Any) -> dict[str, Any]:
    return {
        "process": str(h.get("process", "?"))[:200],
        "pid": int(h.get("pid") or 0),
        "host": str(h.get("host", "?"))[:200],
        "thread": int(h.get("thread") or 0),
        "since": float(h.get("since") or 0.0),
        "held_for": float(h.get("held_for") or 0.0),
        "alive": bool(h.get("alive", True)),
    }


def _clean(lock: Any, owner: dict[str, Any]) -> dict[str, Any] | None:
    if not isinstance(lock, dict):
        return None
    try:
        return {
            "id": str(lock.get("id", ""))[:100],
            "kind": str(lock.get("kind", "Lock"))[:40],
            "site": str(lock.get("site", "?"))[:300],
            "value": int(lock.get("value") or 0),
            "waiting": int(lock.get("waiting") or 0),
            "holders": [
                _clean_holder(h) for h in list(lock.get("holders") or [])[:MAX_LISTED]
            ],
            "owner": owner,
        }
    except (TypeError, ValueError, AttributeError):
        return None


class LockStore:
    """The scheduler's view of the held locks: each reporting process's
    latest list (kept by the pools' store, :class:`~fiber_dask.engine.
    poolstats.PoolStore`, which installs :meth:`update` as a handler)."""

    def __init__(self) -> None:
        self.reports: dict[str, list[dict[str, Any]]] = {}
        self._received: dict[str, float] = {}
        self._client_of: dict[str, str] = {}

    def update(
        self,
        reporter: str | None = None,
        owner: dict | None = None,
        locks: list | None = None,
        client_id: str | None = None,
        version: int | None = None,
    ) -> None:
        """Handler: a process's held locks now (none: it holds none)."""
        if version != VERSION or not isinstance(reporter, str):
            return
        owner = owner if isinstance(owner, dict) else {}
        who = {
            "host": str(owner.get("host", "?"))[:200],
            "pid": int(owner.get("pid") or 0),
            "program": str(owner.get("program", "?"))[:200],
        }
        cleaned = [c for c in (_clean(lock, who) for lock in locks or ()) if c]
        if not cleaned:
            self._drop(reporter)
            return
        self.reports[reporter] = cleaned
        self._received[reporter] = time.monotonic()
        if client_id is not None:
            self._client_of[reporter] = str(client_id)

    def drop_client(self, client: str) -> None:
        for reporter in [r for r, c in self._client_of.items() if c == client]:
            self._drop(reporter)

    def _drop(self, reporter: str) -> None:
        self.reports.pop(reporter, None)
        self._received.pop(reporter, None)
        self._client_of.pop(reporter, None)

    def expire(self) -> None:
        now = time.monotonic()
        for reporter, t in list(self._received.items()):
            if now - t > STALE_AFTER:
                self._drop(reporter)

    def document(self) -> list[dict[str, Any]]:
        """Every held lock, the longest held first; ``held_for`` grown by the
        time since its report, and ``age`` that time."""
        self.expire()
        now = time.monotonic()
        out = []
        for reporter, locks in self.reports.items():
            age = round(now - self._received[reporter], 2)
            for lock in locks:
                holders = [
                    {**h, "held_for": round(h["held_for"] + age, 2)}
                    for h in lock["holders"]
                ]
                out.append({**lock, "holders": holders, "age": age})
        out.sort(
            key=lambda lock: -max((h["held_for"] for h in lock["holders"]), default=0)
        )
        return out


def describe(lock: dict[str, Any]) -> str:
    """One line of a held lock, as ``fiber-dask info`` and the page say it."""
    owner = lock["owner"]
    holders = "; ".join(
        f"{h['process']} (pid {h['pid']} on {h['host']}) for {h['held_for']:.1f} s"
        + ("" if h["alive"] else ", its process is gone")
        for h in lock["holders"]
    )
    waiting = f", {lock['waiting']} waiting" if lock["waiting"] else ""
    return (
        f"{lock['kind']} {lock['id']} (made at {lock['site']} by {owner['program']} "
        f"pid {owner['pid']} on {owner['host']}): held by {holders}{waiting}"
    )
