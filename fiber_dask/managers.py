"""Managers whose shared objects are reachable from every process of the cluster.

``Manager()`` starts a server process holding shared objects (dicts, lists,
queues, locks, your own registered classes) and returns proxies to them, as
the stdlib does — with the stdlib's own server, protocol and proxy classes.
fiber-dask changes where things live and how they are reached:

* **Where the server runs**: a process of its own on the host of the process
  that started the manager (spawned, never forked: this process runs Dask's
  threads), listening on the interface that reaches the Dask scheduler — not
  on a Dask worker.  So the manager survives the loss of any worker, holds no
  worker slot, and never stops adaptive scaling from retiring a worker (a Dask
  Actor would pin its worker).  If its own host dies, proxies raise
  :class:`~fiber_dask.errors.ManagerConnectionError` (never hang: TCP
  keep-alive and a user timeout bound the wait to about 30 s).  The server
  exits with the process that started it, even if that one is SIGKILLed.
* **Proxies work anywhere**: they carry the manager's authkey when pickled (see
  :mod:`fiber_dask.comm.proxies`), so a proxy passed to a Process or a Pool task on
  another host still reaches its object.
* **Locks held by a dead client cannot deadlock the others**: a managed
  ``Lock``, ``RLock``, ``Semaphore`` or ``BoundedSemaphore`` remembers which
  connection took it; when that connection drops (its process ended), an RLock
  is released, and a Lock or semaphore unit stays held for a hand-off (another
  process may release it, as in the stdlib) until a blocking ``acquire`` needs
  it (see :mod:`fiber_dask.synchronize`).
* ``manager.Pool()`` is a fiber-dask Pool on the same cluster, not a pool of
  local processes.
* **TLS when the cluster uses it**: the server process listens in the mode
  (and with the certificate) of the process that started it; see
  :mod:`fiber_dask.comm.security`.
* :class:`AsyncManager` (from Fiber): proxy calls return results to collect
  later, so one controller can drive hundreds of remote objects.

``BaseManager.register``, ``connect()`` by address and authkey, ``get_server()``,
``start()``/``shutdown()`` and the context manager are the stdlib's.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import threading
import weakref
from multiprocessing import managers as _std
from typing import Any

from .comm import proxies
from .comm.proxies import (
    AsyncAutoProxy,
    AsyncBaseProxy,
    AsyncProxyResult,
    AutoProxy,
    BaseProxy,
    MakeAsyncProxyType,
    MakeProxyType,
    proxy_type_for,
)
from .synchronize import SemaphoreState

__all__ = [
    "AsyncManager",
    "BaseManager",
    "BaseProxy",
    "SharedMemoryManager",
    "SyncManager",
    "Token",
]

# The stdlib's names, re-exported so ``fiber_dask.managers`` is a drop-in.
Token = _std.Token
Namespace = _std.Namespace
Value = _std.Value
Array = _std.Array
RemoteError = _std.RemoteError
dispatch = _std.dispatch
State = _std.State
# Shared memory cannot span hosts: this is the stdlib's, for one machine.
SharedMemoryManager = getattr(_std, "SharedMemoryManager", None)
SharedMemoryServer = getattr(_std, "SharedMemoryServer", None)
HAS_SHMEM = _std.HAS_SHMEM
# The stdlib's helpers, for code that builds its own proxies and servers.
all_methods = _std.all_methods
public_methods = _std.public_methods
convert_to_error = _std.convert_to_error
rebuild_as_list = _std.rebuild_as_list
reduce_array = _std.reduce_array
ProcessLocalSet = _std.ProcessLocalSet
RebuildProxy = _std.RebuildProxy
# The serializer table (the stdlib's own dict: fiber-dask's entries are in it).
listener_client = _std.listener_client

IteratorProxy = proxy_type_for(_std.IteratorProxy, __name__)
AcquirerProxy = proxy_type_for(_std.AcquirerProxy, __name__)
ConditionProxy = proxy_type_for(_std.ConditionProxy, __name__)
EventProxy = proxy_type_for(_std.EventProxy, __name__)
BarrierProxy = proxy_type_for(_std.BarrierProxy, __name__)
NamespaceProxy = proxy_type_for(_std.NamespaceProxy, __name__)
ValueProxy = proxy_type_for(_std.ValueProxy, __name__)
BaseListProxy = proxy_type_for(_std.BaseListProxy, __name__)
ListProxy = proxy_type_for(_std.ListProxy, __name__)
DictProxy = proxy_type_for(_std.DictProxy, __name__)
ArrayProxy = proxy_type_for(_std.ArrayProxy, __name__)
BasePoolProxy = proxy_type_for(_std.BasePoolProxy, __name__)
PoolProxy = proxy_type_for(_std.PoolProxy, __name__)


# --- the server ---------------------------------------------------------------

_leased: weakref.WeakSet[SemaphoreState] = weakref.WeakSet()


class Server(_std.Server):
    """The stdlib's manager server; what a connection held is released when
    the connection ends.  Connections are accepted and authenticated by this
    process's handshake gate (:mod:`fiber_dask.comm.gate`), not by a thread per
    connection: a peer must finish the handshake within the gate's deadline,
    may keep only a bounded number waiting, and hears nothing but the
    protocol's ``#FAILURE#`` if it fails (the stdlib sends it a pickled
    traceback)."""

    def accepter(self) -> None:
        sock = getattr(getattr(self.listener, "_listener", None), "_socket", None)
        if sock is None:  # not a socket listener: the stdlib's own loop
            return super().accepter()
        from .comm import channel, gate

        authkey = bytes(self.authkey)
        gate.get_gate().listen(
            sock,
            lambda: _server_handshake(authkey),
            self._authenticated,
            getattr(self.listener, "_context", None),
            channel.tune,
        )

    def _authenticated(self, conn: Any, _result: Any) -> None:
        """An authenticated connection (in a thread of its own)."""
        if isinstance(self.listener, proxies.XmlListener):
            conn = proxies.XmlClientWrap(conn)
        self.handle_request(conn)

    def _handle_request(self, c: Any) -> None:
        """The stdlib's, without its handshake: the gate ran it."""
        request = None
        try:
            request = c.recv()
            ignore, funcname, args, kwds = request
            assert funcname in self.public, f"{funcname!r} unrecognized"
            func = getattr(self, funcname)
        except Exception:
            msg = ("#TRACEBACK", _std.format_exc())
        else:
            try:
                result = func(c, *args, **kwds)
            except Exception:
                msg = ("#TRACEBACK", _std.format_exc())
            else:
                msg = ("#RETURN", result)
        try:
            c.send(msg)
        except Exception:
            try:
                c.send(("#TRACEBACK", _std.format_exc()))
            except Exception:
                pass

    def serve_client(self, conn: Any) -> None:
        try:
            super().serve_client(conn)
        finally:
            session = {"id": _conn_id()}
            for state in list(_leased):
                state.disconnected(session)


def _server_handshake(authkey: bytes) -> Any:
    """The server's side of the stdlib's handshake (``deliver_challenge``,
    then ``answer_challenge``), as a :mod:`fiber_dask.comm.gate` handshake: one
    deadline for all of it, frames of at most 256 bytes."""
    import hmac
    from multiprocessing import AuthenticationError
    from multiprocessing import connection as mpc

    from .comm import gate

    challenge = getattr(mpc, "_CHALLENGE", None) or mpc.CHALLENGE
    welcome = getattr(mpc, "_WELCOME", None) or mpc.WELCOME
    failure = getattr(mpc, "_FAILURE", None) or mpc.FAILURE
    verify = getattr(mpc, "_verify_challenge", None)  # 3.12+: digest negotiation
    respond = getattr(mpc, "_create_response", None)
    message = os.urandom(mpc.MESSAGE_LENGTH)
    if verify is not None:
        message = b"{sha256}" + message
    yield gate.frame(challenge + message)
    response = yield from gate.recv_frame()
    if verify is not None:
        try:
            verify(authkey, message, response)
        except AuthenticationError:
            yield gate.frame(failure)
            raise
    elif not hmac.compare_digest(response, hmac.new(authkey, message, "md5").digest()):
        yield gate.frame(failure)
        raise AuthenticationError("digest received was wrong (wrong authkey?)")
    yield gate.frame(welcome)
    theirs = yield from gate.recv_frame()
    if not theirs.startswith(challenge):
        raise AuthenticationError("peer did not speak the multiprocessing handshake")
    theirs = theirs[len(challenge) :]
    if respond is not None:
        yield gate.frame(respond(authkey, theirs))
    else:
        yield gate.frame(hmac.new(authkey, theirs, "md5").digest())
    if (yield from gate.recv_frame()) != welcome:
        raise AuthenticationError("digest sent was rejected (wrong authkey?)")


def _conn_id() -> int:
    # Each client thread has its own connection, served by its own thread.
    return threading.get_ident()


class _ManagedSemaphore:
    """``threading.Semaphore`` semantics, with acquisitions leased to the
    client connection that made them."""

    _recursive = False
    _bounded = False

    def __init__(self, value: int = 1) -> None:
        if value < 0:
            raise ValueError("semaphore initial value must be >= 0")
        self._state = SemaphoreState(
            value, value if self._bounded else None, self._recursive
        )
        _leased.add(self._state)

    def acquire(self, blocking: bool = True, timeout: float | None = None) -> bool:
        if not blocking and timeout is not None and timeout != -1:
            raise ValueError("can't specify a timeout for a non-blocking call")
        if timeout is not None and timeout < 0:
            timeout = None
        me = _conn_id()
        return self._state.acquire(blocking, timeout, me, sid=me)

    def release(self) -> None:
        me = _conn_id()
        try:
            self._state.release(me, me)
        except ValueError:
            raise self._over_release() from None
        except AssertionError:
            raise RuntimeError("cannot release un-acquired lock") from None

    def _over_release(self) -> Exception:
        return ValueError("Semaphore released too many times")

    __enter__ = acquire

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"<managed {type(self).__name__.lstrip('_')} value={self._state.value}>"


class _ManagedBoundedSemaphore(_ManagedSemaphore):
    _bounded = True


class _ManagedLock(_ManagedSemaphore):
    _bounded = True

    def __init__(self) -> None:
        super().__init__(1)

    def _over_release(self) -> Exception:
        return RuntimeError("release unlocked lock")

    def locked(self) -> bool:
        return self._state.get_value() == 0


class _ManagedRLock(_ManagedSemaphore):
    _recursive = True

    def __init__(self) -> None:
        super().__init__(1)

    def _is_owned(self) -> bool:  # lets threading.Condition use it
        return self._state.is_mine(_conn_id())


def _managed_pool(*args: Any, **kwargs: Any) -> Any:
    """``manager.Pool()``: a fiber-dask Pool on the manager owner's cluster."""
    from .pool import Pool

    return Pool(*args, **kwargs)


def _watch_parent(ppid: int) -> None:
    """End the server when the process that started it is gone (the stdlib's
    server lives on after a SIGKILLed owner; a cluster would collect them)."""

    def watch() -> None:
        while os.getppid() == ppid:
            threading.Event().wait(0.5)
        os._exit(0)

    threading.Thread(target=watch, name="fiber-manager-watchdog", daemon=True).start()


def _server_init(
    settings: dict, initializer: Any, initargs: tuple, tls_settings: Any = None
) -> None:
    """Runs first in the server process (before its listener is made): bind
    to the owner's cluster (for ``manager.Pool()``), take the owner's TLS
    mode for the listener, watch the owner, then the user's initializer."""
    import dask.config

    from .comm import security

    if settings:
        dask.config.set(settings)
    security.pin(tls_settings, "the process that started the manager")
    _watch_parent(os.getppid())
    if initializer is not None:
        initializer(*initargs)


def _manager_host() -> str:
    """The interface the server listens on: where this process's other
    endpoints listen (the one that reaches the scheduler; the cluster is
    resolved for it if nothing else decides)."""
    from . import cluster

    return cluster.listen_host(resolve_cluster=True)


def _cluster_settings(tls_settings: Any = None) -> dict:
    """Config for the server process so that ``manager.Pool()`` attaches to
    this process's cluster instead of starting one of its own (with this
    process's certificate when the cluster uses TLS)."""
    from . import cluster
    from .comm import security

    handle = cluster.current_handle()
    if handle is None:
        return {}
    try:
        address = handle.client.scheduler.address
    except AttributeError:
        return {}
    settings = {"fiber.backend": "address", "fiber.address": address}
    if handle.listen_host:
        settings["fiber.listen-host"] = handle.listen_host
    settings.update(security.dask_config(tls_settings))
    return settings


# --- the managers --------------------------------------------------------------


class BaseManager(_std.BaseManager):
    """``multiprocessing.managers.BaseManager`` whose objects are reachable
    from every process of the cluster (see the module docstring).

    ``address=None`` listens on a free port of the interface that reaches the
    Dask scheduler; give ``address=(host, port)`` to choose.  ``ctx`` may be a
    stdlib context for the server process (default: spawn); a fiber-dask
    context is accepted and means the default.
    """

    _registry: dict = {}
    _Server = Server
    _auto_proxy = staticmethod(AutoProxy)

    def __init__(
        self,
        address: Any = None,
        authkey: bytes | None = None,
        serializer: str = "pickle",
        ctx: Any = None,
        *,
        shutdown_timeout: float = 1.0,
    ) -> None:
        if not isinstance(ctx, multiprocessing.context.BaseContext):
            ctx = multiprocessing.get_context("spawn")
        super().__init__(
            address,
            authkey,
            proxies.fiber_serializer(serializer),
            ctx,
            shutdown_timeout=shutdown_timeout,
        )

    def start(self, initializer: Any = None, initargs: tuple = ()) -> None:
        """Start the server process for this manager."""
        if initializer is not None and not callable(initializer):
            raise TypeError("initializer must be a callable")
        if self._state.value == State.INITIAL and self._address is None:
            self._address = (_manager_host(), 0)
        from .comm import security

        tls_settings = security.export()  # the server listens as this process connects
        super().start(
            _server_init,
            (
                _cluster_settings(tls_settings),
                initializer,
                tuple(initargs),
                tls_settings,
            ),
        )

    def get_server(self) -> Any:
        """A server to run in this process (``serve_forever()``)."""
        if self._state.value == State.STARTED:
            raise multiprocessing.ProcessError("Already started server")
        if self._state.value == State.SHUTDOWN:
            raise multiprocessing.ProcessError("Manager has shut down")
        if self._address is None:
            self._address = (_manager_host(), 0)
        return self._Server(
            self._registry, self._address, self._authkey, self._serializer
        )

    def connect(self) -> None:
        """Connect to a running manager at ``address`` with ``authkey``."""
        conn = self._Client(self._address, authkey=self._authkey)
        try:
            dispatch(conn, None, "dummy")
        finally:
            conn.close()
        self._state.value = State.STARTED

    @classmethod
    def register(
        cls,
        typeid: str,
        callable: Any = None,  # noqa: A002 - the stdlib's parameter name
        proxytype: Any = None,
        exposed: Any = None,
        method_to_typeid: Any = None,
        create_method: bool = True,
    ) -> None:
        """Register a type (or callable) whose instances live in the server."""
        if proxytype is None:
            proxytype = cls._auto_proxy
        elif isinstance(proxytype, type) and issubclass(proxytype, _std.BaseProxy):
            proxytype = proxy_type_for(proxytype)  # pickles with its authkey
        super().register(
            typeid, callable, proxytype, exposed, method_to_typeid, create_method
        )


class SyncManager(BaseManager):
    """``multiprocessing.managers.SyncManager`` across the cluster: ``dict``,
    ``list``, ``Namespace``, ``Value``, ``Array``, ``Queue``,
    ``JoinableQueue``, ``Lock``, ``RLock``, ``Semaphore``,
    ``BoundedSemaphore``, ``Condition``, ``Event``, ``Barrier`` and ``Pool``.
    """


SyncManager.register("Queue", queue.Queue)
SyncManager.register("JoinableQueue", queue.Queue)
SyncManager.register("Event", threading.Event, EventProxy)
SyncManager.register("Lock", _ManagedLock, AcquirerProxy)
SyncManager.register("RLock", _ManagedRLock, AcquirerProxy)
SyncManager.register("Semaphore", _ManagedSemaphore, AcquirerProxy)
SyncManager.register("BoundedSemaphore", _ManagedBoundedSemaphore, AcquirerProxy)
SyncManager.register("Condition", threading.Condition, ConditionProxy)
SyncManager.register("Barrier", threading.Barrier, BarrierProxy)
SyncManager.register("Pool", _managed_pool, PoolProxy)
SyncManager.register("list", list, ListProxy)
SyncManager.register("dict", dict, DictProxy)
SyncManager.register("Value", Value, ValueProxy)
SyncManager.register("Array", Array, ArrayProxy)
SyncManager.register("Namespace", Namespace, NamespaceProxy)
# types returned by methods of PoolProxy
SyncManager.register("Iterator", proxytype=IteratorProxy, create_method=False)
SyncManager.register("AsyncResult", create_method=False)


class AsyncManager(BaseManager):
    """A manager whose proxies return results to collect later (Fiber's).

    Every method call on its proxies sends the request and returns an
    :class:`~fiber_dask.comm.proxies.AsyncProxyResult` at once (``get(timeout)`` /
    ``result(timeout)``, ``ready()``), so a controller can call hundreds of
    objects and then gather the answers::

        class Envs(AsyncManager): pass
        Envs.register("Env", make_env)
        with Envs() as m:
            envs = [m.Env() for _ in range(100)]
            steps = [env.step(action) for env in envs]   # no waiting
            observations = [s.get() for s in steps]

    Registered types default to async auto proxies.  It registers ``dict``,
    ``list``, ``Value``, ``Array``, ``Queue`` and ``JoinableQueue`` (whose
    calls, ``d["k"]`` included, are asynchronous too).
    """

    _auto_proxy = staticmethod(AsyncAutoProxy)


def _async_type(name: str, exposed: tuple) -> type:
    cls = MakeAsyncProxyType(name, tuple(m for m in exposed if m != "__iter__"))
    cls.__module__ = __name__  # the registry pickles it by name
    return cls


AsyncDictProxy = _async_type("AsyncDictProxy", _std.DictProxy._exposed_)
AsyncListProxy = _async_type("AsyncListProxy", _std.ListProxy._exposed_)
AsyncValueProxy = _async_type("AsyncValueProxy", ("get", "set"))
AsyncArrayProxy = _async_type("AsyncArrayProxy", _std.ArrayProxy._exposed_)

AsyncManager.register("Queue", queue.Queue)
AsyncManager.register("JoinableQueue", queue.Queue)
AsyncManager.register("list", list, AsyncListProxy)
AsyncManager.register("dict", dict, AsyncDictProxy)
AsyncManager.register("Value", Value, AsyncValueProxy)
AsyncManager.register("Array", Array, AsyncArrayProxy)

__all__ += [
    "AcquirerProxy",
    "Array",
    "ArrayProxy",
    "AsyncArrayProxy",
    "AsyncAutoProxy",
    "AsyncBaseProxy",
    "AsyncDictProxy",
    "AsyncListProxy",
    "AsyncProxyResult",
    "AsyncValueProxy",
    "AutoProxy",
    "BarrierProxy",
    "ConditionProxy",
    "DictProxy",
    "EventProxy",
    "IteratorProxy",
    "ListProxy",
    "MakeProxyType",
    "Namespace",
    "NamespaceProxy",
    "PoolProxy",
    "RemoteError",
    "Server",
    "Value",
    "ValueProxy",
]
