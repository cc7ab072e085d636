"""``Ring``: N processes across the cluster that find each other, as Fiber's.

Fiber's ``fiber.experimental.Ring`` starts N processes, each with a rank, so
that an initializer can set up a collective (PyTorch's ``torch.distributed``,
Horovod) among them before every member runs the same function.  This is that
contract on fiber-dask Processes, plus what a collective needs to fail
cleanly: one member that dies leaves the others blocked in an all-reduce
forever, so the parent watches every member and stops the ring on the first
failure (and re-forms it if asked, as torch's elastic launcher does).

How a ring forms, runs and fails::

    parent: Ring.run()                         member r (a fiber-dask Process
    ──────────────────                         on a worker host)
    one reports Pipe, a Pipe to each member;
    Process(_member).start() for each
                                               ip: its host's reachable address
                                               port: a free port bound there
        ◄──────── _Ready(r, ip, port, pid) ─── (the rendezvous)
    all N ready:
        ── _Members(all ranks' ip, port) ───►  ring.rank, ring.size, ring.members
                                               initializer(ring, *initargs)
                                               result = func(r, size)
        ◄──────── _Done(r, result) ─────────── or _Failed(r, the exception)
    wait(the reports pipe + the Processes' sentinels):
      every member done and exited 0 → run() returns the results by rank;
      the first member that raised, was killed, lost its host or ended without
      a result → terminate (then kill) the others, and raise RingError naming
      the rank, its host and the cause, or form a new ring (``max_restarts``).

The pipes live in the parent, so a message a member sent before it died is
already there when its sentinel fires: the cause of a failure is never lost to
a race with the exit.  All members report on one pipe, so the parent reads
their reports in the order they were sent: a member that raised comes before
the neighbours that failed because of it.  The port is picked by binding
port 0 on the member's own address, as torch's launchers do, and held bound
(:class:`~fiber_dask.comm.ports.PortReservation`) while the member waits for
the others to join, which may take seconds: it is released just before the
initializer runs, which binds it again a moment later (torch's launchers
release it at once).
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import time
import traceback
from collections.abc import Sequence
from multiprocessing.pool import RemoteTraceback
from typing import Any, Callable, NamedTuple

from ..comm.ports import PortReservation
from ..errors import RemoteTaskError, RingError

__all__ = ["Ring", "RingNode"]

logger = logging.getLogger(__name__)

#: Seconds the other members get to end after SIGTERM before SIGKILL, when
#: the ring stops (a failure, or run() interrupted).
STOP_GRACE = 5.0

#: Seconds the watch goes on collecting failures after the first, to blame
#: the root cause rather than a neighbour that failed because of it.
SETTLE = 1.0


class RingNode:
    """One member of a :class:`Ring`, as every member sees it in ``ring.members``.

    Attributes
    ----------
    rank : int
        The member's rank, 0 to ``size - 1``.  Rank 0 is where collectives
        usually put their store (``MASTER_ADDR`` / ``MASTER_PORT``).
    ip : str
        The member's address, reachable from the other members' hosts (its
        Dask worker's host, or ``fiber.listen-host``).
    port : int
        A port free on the member's host, held for it from when it joined
        until its initializer runs, for its collective to listen on.
    connected : bool
        True once the member has joined (always, in ``ring.members``); kept
        from Fiber, whose members filled in their address one by one.
    """

    def __init__(self, rank: int, ip: str | None = None, port: int | None = None):
        self.rank = rank
        self.ip = ip
        self.port = port

    @property
    def connected(self) -> bool:
        return self.ip is not None

    def __repr__(self) -> str:
        return f"RingNode(rank={self.rank}, ip={self.ip!r}, port={self.port!r})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RingNode):
            return NotImplemented
        return (self.rank, self.ip, self.port) == (other.rank, other.ip, other.port)

    def __hash__(self) -> int:
        return hash((self.rank, self.ip, self.port))


# ------------------------------------------------ the messages on a member's pipe


class _Ready(NamedTuple):
    """Member → parent: joined, with where its collective can listen."""

    rank: int
    ip: str
    port: int
    pid: int


class _Members(NamedTuple):
    """Parent → every member: the ring is complete; ``(rank, ip, port)`` each."""

    members: tuple


class _Done(NamedTuple):
    """Member → parent: ``func`` returned ``result``."""

    rank: int
    result: Any


class _Failed(NamedTuple):
    """Member → parent: the initializer or ``func`` raised.

    ``exception`` is the pickled exception, or None if it cannot be pickled;
    ``type_name`` and ``message`` describe it either way."""

    rank: int
    exception: bytes | None
    type_name: str
    message: str
    traceback: str


class Ring:
    """A ring of ``processes`` members that run ``func(rank, size)`` together.

    Fiber's ``fiber.experimental.Ring`` on fiber-dask Processes: :meth:`run`
    starts the members on the cluster, lets them find each other, and in every
    member calls ``initializer(ring)`` (to set up a collective, with
    ``ring.rank``, ``ring.size`` and ``ring.members``), then
    ``func(rank, size)``.  It returns once every member has returned, and
    raises :class:`~fiber_dask.errors.RingError` as soon as one fails.

    Parameters
    ----------
    processes : int
        Number of members (the ring's ``size``).
    func : callable
        ``func(rank, size)``, run by every member after the initializer; its
        return values are what :meth:`run` returns, by rank.  Resource hints
        on it (``@fiber_dask.meta(gpu=1)``) apply to every member, as Fiber's.
    initializer : callable
        ``initializer(ring, *initargs)``, run first in every member: the ring
        it gets has ``rank``, ``size`` and ``members`` (a :class:`RingNode`
        per rank, each with ``rank``, ``ip`` and ``port``).  None: no
        initializer.
    initargs : sequence, optional
        More positional arguments for the initializer (Fiber accepted but
        ignored them).
    max_restarts : int, keyword-only
        How often a failed ring is formed again: every member is stopped and
        all are started anew (fresh processes, fresh ports), as
        ``torchrun --max-restarts`` does.  0 (the default): the first failure
        raises.  Each failure is kept in :attr:`failures`.
    rendezvous_timeout : float, keyword-only
        Seconds to wait for all members to start and join before the ring
        fails (a cluster without room or resources for them all); None (the
        default) waits as long as it takes, e.g. for an adaptive cluster to
        scale up.
    resources : dict, keyword-only
        Dask worker resources each member needs, e.g. ``{"GPU": 1}``, as for
        a Process; default: those of ``func``'s ``meta`` hints.
    client, address : keyword-only
        Which cluster, as for a Process.

    Attributes
    ----------
    size : int
        The number of members.
    rank : int or None
        The member's own rank in a member; None in the process that runs the
        ring.
    members : list of RingNode
        In a member: the whole ring, by rank.  In the process that ran it: the
        members of the last ring formed (empty before).
    restarts : int
        How often the last :meth:`run` formed the ring again after a failure.
    failures : list of RingError
        The failures that the last :meth:`run` restarted after, oldest first.

    Examples
    --------
    Set up ``torch.distributed`` (the ``ring`` extra) with rank 0 as the store,
    then train data-parallel (``examples/ring_sgd.py`` is a whole program):

        import os
        from fiber_dask.experimental import Ring

        def init(ring):
            import torch.distributed as dist
            master = ring.members[0]
            os.environ["MASTER_ADDR"] = master.ip
            os.environ["MASTER_PORT"] = str(master.port)
            dist.init_process_group("gloo", rank=ring.rank, world_size=ring.size)

        def train(rank, size):
            ...  # forward, backward, dist.all_reduce the gradients, step
            return loss

        if __name__ == "__main__":
            losses = Ring(4, train, init).run()
    """

    def __init__(
        self,
        processes: int,
        func: Callable[[int, int], Any],
        initializer: Callable[..., Any] | None,
        initargs: Sequence | None = None,
        *,
        max_restarts: int = 0,
        rendezvous_timeout: float | None = None,
        resources: dict | None = None,
        client: Any = None,
        address: str | None = None,
    ) -> None:
        if not isinstance(processes, int) or processes < 0:
            raise ValueError(f"processes must be an int >= 0, not {processes!r}")
        if not callable(func):
            raise TypeError(f"func must be callable, not {func!r}")
        if initializer is not None and not callable(initializer):
            raise TypeError(
                f"initializer must be callable or None, not {initializer!r}"
            )
        if not isinstance(max_restarts, int) or max_restarts < 0:
            raise ValueError(f"max_restarts must be an int >= 0, not {max_restarts!r}")
        self.size = processes
        self.func = func
        self.initializer = initializer
        self.initargs = tuple(initargs or ())
        self.max_restarts = max_restarts
        self.rendezvous_timeout = rendezvous_timeout
        self.rank: int | None = None
        self.members: list[RingNode] = []
        self.restarts = 0
        self.failures: list[RingError] = []
        if resources is None:
            from ..meta import resources_of

            resources = resources_of(func)
        self._resources = resources
        self._client = client
        self._address = address
        if getattr(func, "__fiber_meta__", None):
            # As Fiber's Ring: the hints are the ring's too.
            self.__fiber_meta__ = func.__fiber_meta__

    def __repr__(self) -> str:
        where = f"rank={self.rank}" if self.rank is not None else "parent"
        return f"<Ring size={self.size} {where} restarts={self.restarts}>"

    def __getstate__(self) -> dict:
        # What a member gets: the contract, not the parent's handles.
        state = dict(self.__dict__)
        for attr in ("_client", "failures", "members"):
            state.pop(attr, None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._client = None
        self.failures = []
        self.members = []

    # ---------------------------------------------------------------- parent

    def run(self) -> list:
        """Start the ring, wait for every member, return their results by rank.

        Raises
        ------
        RingError
            A member raised, was killed, lost its host or ended before its
            ``func`` returned (after ``max_restarts`` new rings, if any), or
            the members did not all join within ``rendezvous_timeout``.  The
            other members have been stopped when it is raised.
        """
        self.restarts = 0
        self.failures = []
        if self.size <= 0:
            return []
        while True:
            try:
                return self._run_once()
            except RingError as e:
                if self.restarts >= self.max_restarts:
                    if self.restarts:
                        e.args = (
                            f"{e.args[0]} (the ring had been formed again "
                            f"{self.restarts} time(s) already: max_restarts="
                            f"{self.max_restarts})",
                        )
                    raise
                self.failures.append(e)
                self.restarts += 1
                logger.warning(
                    "fiber-dask: Ring member rank %s on %s %s; forming the ring "
                    "again (restart %d of %d)",
                    e.rank,
                    e.host,
                    e.cause,
                    self.restarts,
                    self.max_restarts,
                )

    def _run_once(self) -> list:
        from ..connection import Pipe
        from ..process import Process

        procs: list = []
        reports, report_end = Pipe(duplex=False)  # every member → here
        conns: list = [reports, report_end]
        downs: list = []  # here → each member
        try:
            for rank in range(self.size):
                theirs, mine = Pipe(duplex=False)
                conns += [theirs, mine]
                downs.append(mine)
                p = Process(
                    target=_member,
                    args=(self, rank, theirs, report_end),
                    name=f"Ring-{rank}",
                    resources=self._resources,
                    client=self._client,
                    address=self._address,
                )
                procs.append(p)
                p.start()
                theirs.close()  # the member holds its copy now
            # Only the members' copies remain: EOF once they are all gone.
            report_end.close()
            return _Watch(self, procs, downs, reports).run()
        finally:
            _stop(procs)
            for conn in conns:
                try:
                    conn.close()
                except Exception:  # noqa: BLE001 - best effort
                    pass


class _Failure(NamedTuple):
    """One member's failure, as the watch saw it."""

    rank: int
    died: bool  # it ended without reporting an exception (killed, exit, lost)
    cause: str
    exitcode: int | None
    exception: BaseException | None


class _Watch:
    """The parent's view of one ring while it forms and runs (see the module).

    One member's failure often makes its neighbours fail too: a member that
    is killed closes its sockets, and the members reading from it raise
    ``ConnectionError`` at about the moment the kill is reported.  So after
    the first failure the watch collects more for :data:`SETTLE` s (or until
    every member has ended) and blames the root cause: a member that died
    (killed, exited, lost its host) before one that raised, else the first.
    """

    def __init__(self, ring: Ring, procs: list, downs: list, reports: Any) -> None:
        self.ring = ring
        self.procs = procs
        self.size = len(procs)
        self.downs = downs
        self.reports: Any = reports  # None once every member's copy is closed
        self.sentinel_rank = {p.sentinel: rank for rank, p in enumerate(procs)}
        self.ready: dict[int, _Ready] = {}
        self.done: dict[int, Any] = {}
        self.ended: set[int] = set()
        self.failures: dict[int, _Failure] = {}  # in the order they were seen
        self.failed_at: float | None = None
        self.formed = False

    def run(self) -> list:
        from ..connection import wait

        timeout = self.ring.rendezvous_timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        while len(self.ended) < self.size:
            waiting = [s for s, r in self.sentinel_rank.items() if r not in self.ended]
            if self.reports is not None:
                waiting.append(self.reports)
            ends = []
            if not self.formed and deadline is not None:
                ends.append(deadline)
            if self.failed_at is not None:
                ends.append(self.failed_at + SETTLE)
            left = max(min(ends) - time.monotonic(), 0.0) if ends else None
            for obj in wait(waiting, left):
                if obj in self.sentinel_rank:
                    self._ended(self.sentinel_rank[obj])
                # The reports pipe: a member's _ended earlier in this list may
                # have read it empty (then recv would block for good) or to
                # its end of file (then self.reports is None).
                elif obj is self.reports and self.reports.poll(0):
                    self._read()
            now = time.monotonic()
            if self.failed_at is not None and now >= self.failed_at + SETTLE:
                self._raise()
            if not self.formed and deadline is not None and now >= deadline:
                self._rendezvous_timed_out(timeout)
        if self.failures:
            self._raise()
        return [self.done[rank] for rank in range(self.size)]

    def _read(self) -> None:
        try:
            msg = self.reports.recv()
        except (EOFError, OSError):
            # Every member's copy is closed: they all ended (their sentinels
            # say how).
            self.reports = None
            return
        rank = msg.rank
        if isinstance(msg, _Ready):
            self.ready[rank] = msg
            if len(self.ready) == self.size and not self.formed:
                self._form()
        elif isinstance(msg, _Done):
            self.done[rank] = msg.result
        elif isinstance(msg, _Failed):
            self._raised(msg)

    def _form(self) -> None:
        """Every member joined: tell each of them the whole ring."""
        self.formed = True
        nodes = tuple((r.rank, r.ip, r.port) for _, r in sorted(self.ready.items()))
        self.ring.members = [RingNode(*n) for n in nodes]
        for down in self.downs:
            try:
                down.send(_Members(nodes))
            except (BrokenPipeError, OSError):
                pass  # that member is gone: its sentinel reports it

    def _ended(self, rank: int) -> None:
        self.ended.add(rank)
        # What it sent before it ended is in the pipe already (it lives here).
        while self.reports is not None and self.reports.poll(0):
            self._read()
        if rank in self.failures:
            return  # it raised, and said so
        p = self.procs[rank]
        code = p.exitcode
        if code == 0 and rank in self.done:
            return
        if code is None:
            cause = "ended without an exit status"
        elif code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            cause = f"was killed by {name}"
            if p.reason:
                cause += f" ({p.reason})"
        elif code == 0:
            cause = (
                "exited with status 0 before its function returned (sys.exit(0) "
                "or os._exit(0) inside the initializer or func?)"
            )
        else:
            cause = f"exited with status {code}"
            if p.reason:
                cause += f" ({p.reason})"
        self._failed(_Failure(rank, True, cause, code, None))

    def _raised(self, msg: _Failed) -> None:
        exc: BaseException | None = None
        if msg.exception is not None:
            try:
                exc = pickle.loads(msg.exception)
            except Exception:  # noqa: BLE001 - its class is not importable here
                exc = None
        if not isinstance(exc, BaseException):
            exc = RemoteTaskError(msg.type_name, msg.message, msg.traceback)
        exc.__cause__ = RemoteTraceback(msg.traceback)
        cause = f"raised {msg.type_name}: {msg.message}"
        code = self.procs[msg.rank].exitcode
        self._failed(_Failure(msg.rank, False, cause, code, exc))

    def _failed(self, failure: _Failure) -> None:
        self.failures.setdefault(failure.rank, failure)
        if self.failed_at is None:
            self.failed_at = time.monotonic()

    def _raise(self) -> None:
        """Raise the root failure (see the class), naming the others."""
        ordered = list(self.failures.values())
        root = next((f for f in ordered if f.died), ordered[0])
        host, pid = self._where(root.rank)
        phase = "while running" if self.formed else "before the ring formed"
        others = [f for f in ordered if f is not root]
        also = ""
        if others:
            also = (
                " (then "
                + "; ".join(f"rank {f.rank} {_shorten(f.cause)}" for f in others)
                + ")"
            )
        error = RingError(
            f"Ring member rank {root.rank} of {self.size} on {host}{pid} "
            f"{root.cause} {phase}{also}; the other members were stopped. Fix "
            "the cause, or pass Ring(..., max_restarts=N) to form the ring again "
            "after a failure.",
            rank=root.rank,
            host=host,
            exitcode=root.exitcode,
            cause=root.cause,
        )
        raise error from root.exception

    def _where(self, rank: int) -> tuple[str, str]:
        ready = self.ready.get(rank)
        if ready is not None:
            return ready.ip, f" (pid {ready.pid})"
        popen = getattr(self.procs[rank], "_popen", None)
        worker = getattr(popen, "worker", None)
        if worker:
            from distributed.comm import get_address_host

            return get_address_host(worker), ""
        return "no host yet (it had not started)", ""

    def _rendezvous_timed_out(self, timeout: float) -> None:
        missing = [r for r in range(self.size) if r not in self.ready]
        host = "no host yet (it had not started)"
        error = RingError(
            f"Ring of {self.size}: rank(s) {missing} did not join within "
            f"rendezvous_timeout={timeout:g}s ({len(self.ready)} of {self.size} "
            "joined); the others were stopped. Does the cluster have room and "
            f"the resources ({self.ring._resources or 'none asked'}) for "
            f"{self.size} members at once? Raise rendezvous_timeout, or None to "
            "wait as long as it takes.",
            rank=missing[0],
            host=host,
            exitcode=None,
            cause=f"did not join within {timeout:g}s",
        )
        raise error


def _shorten(text: str, limit: int = 120) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _stop(procs: list) -> None:
    """Stop the members still running: SIGTERM, then SIGKILL after
    :data:`STOP_GRACE` s; never waits longer than twice that."""
    running = [p for p in procs if p._popen is not None and p.exitcode is None]
    for p in running:
        try:
            p.terminate()
        except Exception:  # noqa: BLE001 - it may have just ended
            pass
    deadline = time.monotonic() + STOP_GRACE
    for p in running:
        p.join(max(deadline - time.monotonic(), 0.0))
    late = [p for p in running if p.exitcode is None]
    for p in late:
        try:
            p.kill()
        except Exception:  # noqa: BLE001
            pass
    deadline = time.monotonic() + STOP_GRACE
    for p in late:
        p.join(max(deadline - time.monotonic(), 0.0))


# ---------------------------------------------------------------- a member


def _member(ring: Ring, rank: int, down: Any, conn: Any) -> None:
    """A member's life (the target of its Process): join, learn the ring,
    run the initializer and ``func``, report on ``conn`` (shared by all)."""
    from .. import cluster

    ip = cluster.listen_host()  # its worker's host, set by the launcher
    port = PortReservation(ip)  # held while the others join
    conn.send(_Ready(rank, ip, port.port, os.getpid()))
    try:
        formed = down.recv()
    except EOFError:
        return  # the ring was stopped before it formed
    finally:
        port.release()  # for the collective the initializer sets up
    down.close()
    ring.rank = rank
    ring.members = [RingNode(*node) for node in formed.members]
    try:
        if ring.initializer is not None:
            ring.initializer(ring, *ring.initargs)
        result = ring.func(rank, ring.size)
    except Exception as e:
        conn.send(_failure(rank, e))
        raise  # exit status 1 and the traceback on stderr, as any Process
    try:
        conn.send(_Done(rank, result))
    except Exception as e:  # an unpicklable result
        conn.send(
            _failure(
                rank,
                TypeError(
                    f"the return value of func in rank {rank} cannot be sent to "
                    f"the process running the ring: {e!r}"
                ),
            )
        )
        raise
    conn.close()


def _failure(rank: int, exc: BaseException) -> _Failed:
    try:
        blob: bytes | None = pickle.dumps(exc)
        pickle.loads(blob)
    except Exception:  # noqa: BLE001 - described by name and message instead
        blob = None
    name = type(exc).__qualname__
    module = type(exc).__module__
    if module not in ("builtins", "__main__"):
        name = f"{module}.{name}"
    return _Failed(rank, blob, name, str(exc), traceback.format_exc())
