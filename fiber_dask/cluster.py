"""The cluster layer: config → one connected ``distributed.Client`` per process.

Resolution, first match wins:

1. an explicit ``client=`` or ``address=`` argument;
2. ``fiber.backend`` in the config (YAML, ``DASK_FIBER__BACKEND``);
3. ``fiber.address``, then Dask's own ``scheduler-address``
   (``DASK_SCHEDULER_ADDRESS``) → the ``address`` backend;
4. inside a Dask worker, or with a default ``distributed.Client`` already
   running: that client;
5. the long-lived local cluster of ``fiber-dask up``, if one runs
   (:mod:`fiber_dask.backends.upcluster`);
6. a new embedded ``LocalCluster`` (the ``local`` backend), started lazily on
   first use and closed at interpreter exit.

A cluster fiber-dask did not start is never shut down by it.

This layer also keeps what every user of a cluster shares: where this
process's endpoints listen (:func:`listen_host`, by the rule in
:mod:`fiber_dask.backends.address`), the accounting of task slots that live
pools hold (:func:`claim_slots`, next to :func:`ensure_slots`, which grows a
cluster through its backend's ``grow`` hook), the health check of a handle's
connection (:func:`check_connected`), and the shutdown order.  Layers above register
their shutdown with :func:`on_shutdown` (this module imports none of them):
at exit, first the cluster's users stop (pools: their loops told to end and
waited for, with a deadline), then the clients and clusters close, then the
transports registered ``after_close``.
"""

from __future__ import annotations

import atexit
import logging
import sys
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any, Callable

from . import config
from .backends import ClusterHandle, load_backend, peerslots, upcluster
from .backends import address as address_rules
from .backends.address import configured_address
from .backends.upcluster import running_handle
from .errors import ClusterConnectionError
from .launch import mainguard
from .transparency import interrupts, privaterandom

if TYPE_CHECKING:
    from .comm.ports import PortReservation

__all__ = [
    "init",
    "shutdown",
    "get_handle",
    "current_handle",
    "listen_host",
    "get_client",
    "task_slots",
    "ensure_slots",
    "claim_slots",
    "check_connected",
    "scheduler_address",
    "on_shutdown",
]

_handle: ClusterHandle | None = None
#: The embedded cluster starting in the background (:func:`start_embedded`).
_starting: Starting | None = None
_attached: dict[str, ClusterHandle] = {}
_lock = threading.RLock()

#: Seconds the clients and clusters get to close at shutdown.
CLOSE_TIMEOUT = 5.0

_hooks_lock = threading.Lock()
_before_close: list[Callable[[], None]] = []
_after_close: list[Callable[[], None]] = []


def on_shutdown(fn: Callable[[], None], *, after_close: bool = False) -> None:
    """Call ``fn()`` from :func:`shutdown` (and so at interpreter exit).

    Hooks run before the clients and clusters close (users of the cluster:
    stop your work), or after them with ``after_close=True`` (transports).
    Newest first, as ``atexit``; registering the same function twice keeps
    one.  A hook must bound its own waits: nothing at exit may block without a
    deadline.
    """
    with _hooks_lock:
        hooks = _after_close if after_close else _before_close
        if fn not in hooks:
            hooks.append(fn)


def _run_hooks(hooks: list[Callable[[], None]]) -> None:
    with _hooks_lock:
        todo = list(reversed(hooks))
    for fn in todo:
        try:
            fn()
        except Exception:  # pragma: no cover - best effort at exit
            logging.getLogger(__name__).debug("shutdown hook failed", exc_info=True)


def init(
    backend: str | None = None,
    *,
    address: str | None = None,
    client: Any = None,
) -> Any:
    """Bind this process to a cluster now instead of on first use.

    Parameters
    ----------
    backend : str, optional
        A backend name (``local``, ``address``, ...); default from ``fiber.backend``.
    address : str, optional
        Scheduler address to attach to (implies the ``address`` backend).
    client : distributed.Client, optional
        Use this client; fiber-dask will not close it.

    Returns
    -------
    distributed.Client

    Examples
    --------
    >>> import fiber_dask
    >>> client = fiber_dask.init()            # doctest: +SKIP
    >>> client = fiber_dask.init(address="tcp://10.0.0.5:8786")  # doctest: +SKIP
    """
    global _handle
    with _lock:
        if _handle is not None:
            shutdown()
        _handle = _resolve(backend, address, client)
        _run_first_at_exit()
        return _handle.client


def shutdown() -> None:
    """Close what fiber-dask opened: its client, and the cluster if it started it.

    Also runs at interpreter exit.  Attached clusters keep running.
    """
    global _handle, _starting

    with _lock:
        handles = list(_attached.values())
        if _handle is not None:
            handles.append(_handle)
        _handle = None
        _attached.clear()
        starting, _starting = _starting, None
    _run_hooks(_before_close)
    if starting is not None:
        # Still importing distributed: given up (no waiting on a background
        # import at exit); already making the cluster: waited for, then closed.
        h = starting.give_up(CLOSE_TIMEOUT)
        if h is not None:
            handles.append(h)
    for h in handles:
        _close_quietly(h)
    _run_hooks(_after_close)


_CLOSE_LOGGERS = (
    "distributed",
    "distributed.client",
    "distributed.nanny",
    "distributed.worker",
    "distributed.scheduler",
    "distributed.core",
    "distributed.comm",
    "distributed.batched",
    "distributed.deploy",
    "distributed.worker.state_machine",
    "tornado.application",
)


def _silence_close_logs() -> list[int]:
    """Raise distributed's loggers to CRITICAL here; return their levels.

    Run in every process of a cluster fiber-dask is about to close: closing
    cuts comms and heartbeats in flight, which distributed reports as
    warnings and tracebacks (expected at exit, and they were the noise a
    script printed on its way out)."""
    levels = []
    for name in _CLOSE_LOGGERS:
        lg = logging.getLogger(name)
        levels.append(lg.level)
        lg.setLevel(logging.CRITICAL)
    return levels


def _close_quietly(h: ClusterHandle) -> None:
    """Close a handle within :data:`CLOSE_TIMEOUT`, without distributed's
    close-time warnings, here and (for a cluster we started) in its workers
    and nannies."""
    levels = _silence_close_logs()
    try:
        if h.owned and h.cluster is not None and h.client.status == "running":
            for nanny in (False, True):
                try:
                    h.client.sync(
                        h.client._run,
                        _silence_close_logs,
                        nanny=nanny,
                        on_error="return",
                        callback_timeout=2,
                    )
                except Exception:  # only quieter; never a reason not to close
                    pass
        h.close(timeout=CLOSE_TIMEOUT)
    except Exception:  # pragma: no cover - best effort at exit
        pass
    finally:
        for name, level in zip(_CLOSE_LOGGERS, levels, strict=True):
            logging.getLogger(name).setLevel(level)


def _run_first_at_exit() -> None:
    """(Re-)register :func:`shutdown` with ``atexit`` so that it runs before
    the exit handlers ``distributed`` registered since (``atexit`` runs the
    newest first).  Without this, distributed's own handler, registered when
    the first ``LocalCluster`` was made, closed the cluster while the pools'
    loops still ran on it: warnings, tracebacks and a worker killed after 4 s."""
    atexit.unregister(shutdown)
    atexit.register(shutdown)


atexit.register(shutdown)


def get_handle(*, client: Any = None, address: str | None = None) -> ClusterHandle:
    """The cluster handle for an object created with these options."""
    global _handle
    if client is not None:
        return _handle_for_client(client)
    if address is not None:
        with _lock:
            h = _attached.get(address)
            if h is None:
                h = _attached[address] = _resolve(None, address, None)
                _run_first_at_exit()
            return h
    with _lock:
        if _handle is None and _starting is None:
            _handle = _resolve(None, None, None)
            _run_first_at_exit()
        if _handle is not None:
            return _handle
        starting = _starting
    # The embedded cluster is starting in the background (the first pool's
    # early slots run meanwhile): wait for it, outside the lock.
    return starting.result()


class Starting:
    """The embedded cluster, starting on a thread of its own
    (:func:`start_embedded`): what is known of it before it is up, and the
    handle once it is.

    A :class:`~fiber_dask.engine.poolengine.PoolEngine` given one instead of a
    handle runs on early slots until the cluster is up
    (:mod:`fiber_dask.engine.earlyslots`); anything else asking for the
    cluster meanwhile (:func:`get_handle`) waits for it.
    """

    backend = "local"
    owned = True
    client = None

    def __init__(
        self,
        listen_host: str,
        planned_slots: int,
        scheduler_address: str,
        fork_server: Any,
        *,
        reservation: PortReservation | None = None,
    ) -> None:
        self.listen_host = listen_host
        self.planned_slots = planned_slots
        #: Where the scheduler will listen (its port picked before it starts,
        #: so that processes started meanwhile know where to attach).
        self.scheduler_address = scheduler_address
        #: Its port, held bound until the scheduler listens on it.
        self._reservation = reservation
        self.fork_server = fork_server
        self.handle: ClusterHandle | None = None
        self.error: BaseException | None = None
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._phase = "importing"  # -> "starting" -> "done" | "given up"
        self._callbacks: list[Callable[[], None]] = []
        self._ready_hooks: list[Callable[[ClusterHandle], None]] = []
        self._go = threading.Event()

    def done(self) -> bool:
        return self._done.is_set()

    #: Seconds the start waits for :meth:`go` before it begins anyway.
    HOLD = 1.0

    def go(self) -> None:
        """Begin now: the early slots serve (they started without the CPU the
        cluster's imports would have taken from them), or someone waits for
        the cluster."""
        self._go.set()

    def result(self, timeout: float | None = None) -> ClusterHandle:
        """The handle once the cluster is up; raises what its start raised."""
        self.go()
        if not self._done.wait(timeout):
            raise TimeoutError("the embedded cluster is still starting")
        if self.error is not None:
            raise self.error
        assert self.handle is not None
        return self.handle

    def add_done_callback(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` (on the starting thread, or now) once it is done."""
        with self._lock:
            if not self._done.is_set():
                self._callbacks.append(fn)
                return
        fn()

    def add_ready_hook(self, fn: Callable[[ClusterHandle], None]) -> None:
        """Call ``fn(handle)`` on the starting thread once the cluster is up,
        before anything waiting for it (:meth:`result`) is let go: the first
        pool claims its slots there, ahead of a pool made meanwhile.  Only
        before the start ends."""
        self._ready_hooks.append(fn)

    def entering(self) -> bool:
        """Asked by the backend once distributed is imported: go on and make
        the cluster (True), or stop, the start having been given up."""
        with self._lock:
            if self._phase == "given up":
                return False
            self._phase = "starting"
            return True

    def give_up(self, timeout: float) -> ClusterHandle | None:
        """At shutdown: give the start up if it has not begun making the
        cluster (its fork server is stopped now; the thread's import is left
        to the interpreter's exit); else wait up to ``timeout`` seconds for
        it and return the handle, for the caller to close."""
        with self._lock:
            if self._phase == "importing":
                self._phase = "given up"
                server = self.fork_server
            else:
                server = None
        self._go.set()  # a start still held back ends at once
        if server is not None:
            server.stop(timeout=0)  # busy importing what is not needed now
            return None
        if self._done.wait(timeout) and self.error is None:
            return self.handle
        return None

    def _run(self, start: Callable[[], ClusterHandle]) -> None:
        global _handle, _starting
        # Held back until the early slots serve (go()), at most HOLD seconds:
        # on a machine of few cores, importing distributed here slowed the
        # slots' own start, which the first result waits for.
        self._go.wait(self.HOLD)
        try:
            if self._phase == "given up":
                raise RuntimeError("the embedded cluster's start was given up")
            h = start()
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits
            h, self.error = None, e
        finally:
            if self._reservation is not None:
                self._reservation.release()  # the scheduler listens, or never will
        if h is not None:
            for hook in self._ready_hooks:
                try:
                    hook(h)
                except Exception:  # pragma: no cover - a hook's own bug
                    logging.getLogger(__name__).exception("fiber-dask: start hook")
        with _lock:
            if _starting is self:
                _starting = None
                if h is not None:
                    _handle = h
                    _run_first_at_exit()
        with self._lock:
            if self._phase != "given up":
                self._phase = "done"
            self.handle = h
            self._done.set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            try:
                fn()
            except Exception:  # pragma: no cover - a callback's own bug
                logging.getLogger(__name__).exception("fiber-dask: start callback")


def start_embedded(
    planned_slots: int, scheduler_port: PortReservation, fork_server: Any
) -> Starting | None:
    """Start the embedded cluster on a thread of its own and return at once,
    if this process has no cluster and the resolution order (module
    docstring) would start one; else None (and nothing is started).

    ``fork_server``: the worker fork server, already started (with the early
    slot template it forks: :mod:`fiber_dask.engine.earlyslots`);
    ``scheduler_port``: the port the scheduler is to listen on, held until it
    does (or its start fails), then released here."""
    global _starting

    # A Ctrl-C here is held to the end: bound but not running, a start would
    # leave every later get_handle() waiting for it forever.
    with interrupts.deferred(), _lock:
        if _handle is not None or _starting is not None:
            return None
        privaterandom.isolate_dask()
        starting = Starting(
            "127.0.0.1",
            planned_slots,
            f"tcp://127.0.0.1:{scheduler_port.port}",
            fork_server,
            reservation=scheduler_port,
        )
        backend = load_backend("local")(  # fiber_dask.backends.local
            fork_server=fork_server,
            scheduler_port=scheduler_port.port,
            entering=starting.entering,
        )
        thread = threading.Thread(
            target=starting._run,
            args=(backend.start,),
            name="fiber-cluster-start",
            daemon=True,
        )
        _starting = starting
        thread.start()
        return starting


def would_start_embedded() -> bool:
    """Whether :func:`get_handle` would start the embedded cluster now: no
    cluster bound, and none chosen by the configuration, the environment, a
    running client or ``fiber-dask up``.  Raises what starting one would
    (an unguarded main module)."""
    if _handle is not None or _starting is not None:
        return False
    config.validate()
    if config.get("backend") or configured_address()[0]:
        return False
    if _existing_client() is not None:
        return False
    if config.get("up.use") and upcluster.read_state() is not None:
        return False  # `fiber-dask up` runs one: get_handle attaches to it
    _check_not_bootstrapping()
    mainguard.check()
    return True


def get_client(**kwargs: Any) -> Any:
    """The ``distributed.Client`` fiber-dask uses, connecting it if needed.

    The cluster is resolved as for a Pool (see the module docstring); also
    ``fiber_dask.get_client()``.

    Parameters
    ----------
    **kwargs
        ``client=`` or ``address=``, as for :func:`get_handle`.

    Returns
    -------
    distributed.Client

    Examples
    --------
    >>> import fiber_dask
    >>> fiber_dask.get_client().dashboard_link  # doctest: +SKIP
    'http://127.0.0.1:8787/status'
    """
    return get_handle(**kwargs).client


def _handle_for_client(client: Any) -> ClusterHandle:
    privaterandom.isolate_dask()  # as in _resolve
    host = address_rules.listen_host(client.scheduler.address)
    return ClusterHandle(client, None, owned=False, backend="client", listen_host=host)


def current_handle() -> ClusterHandle | None:
    """This process's cluster handle if it is bound to a cluster, else None
    (never starts one)."""
    return _handle


def listen_host(resolve_cluster: bool = False) -> str:
    """Where this process's endpoints (channel, object and manager servers)
    listen, by :func:`fiber_dask.backends.address.listen_host`: its cluster
    handle's host if it has one; no cluster is started for it unless
    ``resolve_cluster`` says so (and nothing else decides)."""
    return address_rules.listen_host(
        handle=_handle, resolve=get_handle if resolve_cluster else None
    )


def _resolve(backend: str | None, address: str | None, client: Any) -> ClusterHandle:
    # Before any Dask code runs here on our behalf (a backend starting a
    # scheduler, a client connecting): Dask's draws must not move the
    # program's random state (fiber_dask.transparency.privaterandom).
    privaterandom.isolate_dask()
    handle = _find(backend, address, client)
    if not handle.listen_host:  # a third-party backend that left it to us
        handle.listen_host = address_rules.listen_host(handle.client.scheduler.address)
    return handle


def _find(backend: str | None, address: str | None, client: Any) -> ClusterHandle:
    """The handle the resolution order (see the module docstring) gives."""
    if client is not None:
        return _handle_for_client(client)
    config.validate()
    if address is not None:
        return load_backend("address")().start(address=address)
    backend = backend or config.get("backend")
    if backend:
        return load_backend(backend)().start()
    if configured_address()[0]:
        return load_backend("address")().start()
    existing = _existing_client()
    if existing is not None:
        return _handle_for_client(existing)
    up = running_handle()  # the long-lived cluster of `fiber-dask up`, if any
    if up is not None:
        return up
    _check_not_bootstrapping()
    mainguard.check()  # `fiber-dask run` of a script without a __main__ guard
    return load_backend("local")().start()


def _existing_client() -> Any:
    """A client already running in this process: a worker's, or the default one."""
    if "distributed" not in sys.modules:
        # Neither can exist yet; importing distributed only to be told so cost
        # the first Pool() 0.5 s before the embedded cluster began to start.
        return None
    from distributed import get_client as dask_get_client
    from distributed import get_worker

    try:
        get_worker()
    except ValueError:
        pass
    else:
        return dask_get_client()
    try:
        from distributed import default_client

        return default_client()
    except ValueError:
        return None


def _check_not_bootstrapping() -> None:
    """Refuse to start a cluster while a spawned process imports ``__main__``.

    Dask starts its worker processes with the ``spawn`` method, which re-imports
    the main script; a script without ``if __name__ == "__main__":`` would start
    a cluster from every worker.  This is the stdlib's own check and message.
    """
    from multiprocessing import process

    if getattr(process.current_process(), "_inheriting", False):
        raise RuntimeError(
            "An attempt has been made to start a fiber-dask cluster before the "
            "current process has finished its bootstrapping phase.\n\n"
            "Dask starts worker processes by importing your main module; protect "
            "the entry point of the program with:\n\n"
            "    if __name__ == '__main__':\n        main()\n"
        )


def task_slots(handle: ClusterHandle | None = None) -> int:
    """How many tasks the cluster runs at once (sum of worker threads).

    For a cluster fiber-dask started, at least what its backend sized it for
    (``planned_slots``: its fixed size, grown by pools, or an adaptive
    cluster's maximum, not the minimum it runs while idle); for an attached
    cluster with no workers yet, ``fiber.adaptive.maximum`` or the CPU count.
    """
    import os

    handle = handle or get_handle()
    info = handle.client.scheduler_info(n_workers=-1)
    slots = sum(w.get("nthreads", 0) for w in info.get("workers", {}).values())
    if handle.owned and handle.planned_slots:
        # An adaptive cluster's maximum, not the workers it happens to have now.
        return max(slots, handle.planned_slots)
    if slots:
        return slots
    # An attached cluster with no workers yet (one that is still starting, or
    # scales from zero): what adaptive scaling may start, else one slot per CPU
    # as the stdlib's Pool.
    return config.get("adaptive.maximum") or os.cpu_count() or 1


def ensure_slots(handle: ClusterHandle, n: int) -> None:
    """Grow a non-adaptive cluster fiber-dask started so ``n`` tasks fit at once.

    ``Pool(processes=N)`` means N tasks run at once; where fiber-dask manages the
    cluster it provides the slots, as the stdlib starts N processes: through
    the backend's ``grow`` hook (how depends on the backend: worker processes,
    pods, batch jobs).  Attached clusters are never resized.
    """
    if not handle.owned or handle.grow is None or config.get("adaptive.enabled"):
        return
    handle.grow(n)


# ------------------------------------------------------------ slot accounting

_slots_lock = threading.Lock()
_slots_in_use: dict[int, int] = {}  # id(handle) -> slots held by live claims
_live_claims: weakref.WeakSet = weakref.WeakSet()


class SlotClaim:
    """Task slots one user (a pool) holds on a cluster while it lives.

    Created by :func:`claim_slots`; :meth:`release` (idempotent) gives them
    back, so that the next pool on a cluster fiber-dask manages is sized for
    what is really in use.
    """

    __slots__ = ("handle", "n", "_held", "__weakref__")

    def __init__(self, handle: ClusterHandle, n: int) -> None:
        self.handle, self.n, self._held = handle, n, True

    def release(self) -> None:
        with _slots_lock:
            if self._held:
                self._held = False
                key = id(self.handle)
                _slots_in_use[key] = max(0, _slots_in_use.get(key, 0) - self.n)
                _live_claims.discard(self)
            else:
                return
        peerslots.tell_owner(self.handle, self, 0)

    def resize(self, n: int) -> None:
        """Hold ``n`` slots from now on: an elastic pool gave some back, or asks
        for them again (:mod:`fiber_dask.engine.poolelastic`); a cluster fiber-dask
        manages grows if the slots in use no longer fit (never shrinks: that is
        adaptive scaling's call).  No effect once released."""
        n = max(0, n)
        with _slots_lock:
            if not self._held:
                return
            key = id(self.handle)
            _slots_in_use[key] = needed = max(0, _slots_in_use.get(key, 0) + n - self.n)
            grew, self.n = n > self.n, n
        if grew:
            ensure_slots(self.handle, needed)


def claim_slots(handle: ClusterHandle, n: int) -> SlotClaim:
    """Count ``n`` more slots in use on ``handle``'s cluster and make sure a
    cluster fiber-dask manages has room for all the slots in use at once
    (:func:`ensure_slots`)."""
    claim = SlotClaim(handle, n)
    with _slots_lock:
        key = id(handle)
        _slots_in_use[key] = needed = _slots_in_use.get(key, 0) + n
        _live_claims.add(claim)
    # Attached processes (a manager's server, a child) claim with the owner.
    try:
        ensure_slots(handle, needed + peerslots.peer_slots())
    except BaseException:  # it cannot grow that far: the claim was never made
        claim.release()
        raise
    peerslots.tell_owner(handle, claim, n)
    return claim


def slots_in_use(handle: ClusterHandle) -> int:
    """Slots the live claims hold on ``handle``'s cluster."""
    with _slots_lock:
        return _slots_in_use.get(id(handle), 0)


def _owns_scheduler(dask_scheduler: Any) -> bool:
    """Whether this process started the cluster ``dask_scheduler`` belongs to."""
    handle = _handle
    return (
        handle is not None
        and handle.owned
        and handle.cluster is not None
        and getattr(handle.cluster, "scheduler", None) is dask_scheduler
    )


def _grow_for_peers(peers: int) -> None:
    """Size this process's cluster for its own pools plus attached ones'."""
    handle = _handle
    if handle is not None:
        ensure_slots(handle, slots_in_use(handle) + peers)


peerslots.serve_owner_side(_owns_scheduler, _grow_for_peers)


# ------------------------------------------------------------------- health


def scheduler_address(handle: ClusterHandle) -> str:
    """The scheduler address of ``handle``, also once its client has closed."""
    addr = getattr(handle, "_fiber_address", None)
    if addr is None:
        try:
            addr = handle.client.scheduler.address
        except Exception:
            addr = "(unknown address)"
        else:
            try:
                handle._fiber_address = addr
            except Exception:  # pragma: no cover - a frozen handle
                pass
    return addr


def wait_reconnected(client: Any, timeout: float) -> str:
    """``client``'s status once it is no longer reconnecting (``connecting``,
    ``newly-created``), or when ``timeout`` seconds have passed."""
    status = client.status
    deadline = time.monotonic() + timeout
    while status in ("connecting", "newly-created") and time.monotonic() < deadline:
        time.sleep(0.05)
        status = client.status
    return status


def check_connected(handle: ClusterHandle, timeout: float | None = None) -> None:
    """Raise :class:`ClusterConnectionError` if ``handle``'s scheduler is lost.

    A client that lost its scheduler reconnects for a while (status
    ``connecting``); wait for it at most ``timeout`` seconds (default
    ``fiber.connect-timeout``), and fail at once if it has given up (closed).
    """
    client = handle.client
    status = getattr(client, "status", "running")
    if status == "running":
        scheduler_address(handle)  # remembered for the message, should it go
        return
    if timeout is None:
        timeout = config.timedelta("connect-timeout")
    status = wait_reconnected(client, timeout)
    if status == "running":
        return
    addr = scheduler_address(handle)
    raise ClusterConnectionError(
        f"the Dask scheduler at {addr} is unreachable (the client is {status}; "
        f"it reconnects for at most fiber.connect-timeout={timeout:g}s): it "
        "stopped or the network to it is down. Start it again and call fiber_dask.init() (or pass "
        "address=/client=), or raise fiber.connect-timeout "
        "(DASK_FIBER__CONNECT_TIMEOUT) if it is only slow to come back."
    )
