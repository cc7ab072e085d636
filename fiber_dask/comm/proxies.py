"""Manager proxies that work from any process of the cluster.

fiber-dask's managers are the stdlib's (``multiprocessing.managers``): the same
server, the same wire protocol, the same proxy classes and their methods.  What
changes is how a proxy reaches its manager, which this module supplies:

* **The authkey travels with a pickled proxy.**  The stdlib pickles a proxy's
  authkey only while spawning a child of the manager's owner, and otherwise
  uses the unpickling process's own key — which a Pool task on a Dask worker
  does not share.  Here a proxy always carries it (as fiber-dask's queues and
  locks do), so a proxy passed to a Process or a Pool task on another host
  still opens its manager.  Use Dask TLS on untrusted networks: the key rides
  inside task arguments.
* **Connections are tuned for a cluster**: TCP keep-alive and a user timeout
  (a vanished host is noticed in about 30 s, never a hang), a connect timeout
  of ``fiber.connect-timeout``, and a :class:`ManagerConnectionError` that says
  which manager is gone.  It subclasses both ``ConnectionError`` and
  ``EOFError``: the stdlib raises one or the other depending on the moment.
* **TLS when the cluster uses it**: the manager's server and its clients
  speak TLS with the cluster's certificates (see :mod:`fiber_dask.comm.tls`); the
  server process gets its owner's mode, and the stdlib's authkey handshake
  runs inside TLS.
* **AsyncManager** proxies (from Fiber) return an :class:`AsyncProxyResult`
  per call: requests are pipelined on the connection and the replies read in
  order when a result is asked for.

The connection functions are registered in the stdlib's ``listener_client``
table under serializer names of their own (``fiber-pickle``, ``fiber-xmlrpc``),
the extension point the stdlib's own proxies, ``AutoProxy`` and decref
finalisers all look up, so none of that code is copied here.
"""

from __future__ import annotations

import collections
import socket
import threading
import time
from multiprocessing import TimeoutError as MpTimeoutError
from multiprocessing import connection, managers
from typing import Any

from ..errors import ManagerConnectionError
from . import security, tls
from .channel import HANDSHAKE_TIMEOUT, dial, tune

__all__ = [
    "AsyncAutoProxy",
    "AsyncBaseProxy",
    "AsyncProxyResult",
    "AutoProxy",
    "BaseProxy",
    "MakeAsyncProxyType",
    "MakeProxyType",
    "fiber_serializer",
]

# The stdlib's names (its listener_client keys: "pickle", "xmlrpclib"), and the
# short "xmlrpc" accepted before.
SERIALIZERS = {
    "pickle": "fiber-pickle",
    "xmlrpclib": "fiber-xmlrpc",
    "xmlrpc": "fiber-xmlrpc",
}


def fiber_serializer(serializer: str) -> str:
    """The listener_client key fiber-dask uses for a stdlib serializer name."""
    if serializer in SERIALIZERS.values():
        return serializer
    try:
        return SERIALIZERS[serializer]
    except KeyError:
        raise ValueError(
            f"unknown manager serializer {serializer!r}: use 'pickle' or "
            "'xmlrpclib' (the stdlib's names)"
        ) from None


def _connect_timeout() -> float:
    from .. import config

    return config.timedelta("connect-timeout")


def _socket_client(connection_class: Any):
    def client(address: Any, family: Any = None, authkey: bytes | None = None) -> Any:
        if not isinstance(address, tuple):  # a Unix socket path: stdlib as is
            return connection.Client(address, family, authkey)
        host, port = address[:2]
        conn = dial(
            host,
            port,
            _connect_timeout(),
            f"the manager at {host}:{port}",
            lambda e: ManagerConnectionError(
                f"cannot reach the manager at {host}:{port} ({e}). Its process has "
                "exited or its host is unreachable; a manager lives as long as the "
                "process that started it (or until shutdown())"
            ),
        )
        if authkey is not None:
            try:
                connection.answer_challenge(conn, authkey)
                connection.deliver_challenge(conn, authkey)
            except BaseException as e:
                conn.close()
                if "FIBER-TLS" in str(e):  # the stdlib's error quotes the hello
                    raise tls.required_error(f"the manager at {host}:{port}") from None
                err = tls.handshake_error(e, f"the manager at {host}:{port}")
                if err is e:
                    raise
                raise err from e
        if connection_class is not connection.Connection:
            conn = connection_class(conn)
        return conn

    return client


class _Listener(connection.Listener):
    """The stdlib Listener; accepted sockets get keep-alive so that a serving
    thread whose client host vanished ends (and releases what it held).  TLS
    if this process's cluster uses TLS (decided when the listener is made);
    the handshake then runs in the thread that serves the connection, not in
    the server's accept loop."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._context = (
            security.server_context() if isinstance(self.address, tuple) else None
        )

    def accept(self) -> Any:
        if self._context is not None:
            return self._accept_tls()
        conn = super().accept()
        c = getattr(conn, "_conn", conn)  # xmlrpc wraps the Connection
        try:
            sock = socket.socket(fileno=c.fileno())
            try:
                tune(sock)
            finally:
                sock.detach()
        except OSError:
            pass
        return conn

    def _accept_tls(self) -> Any:
        listener = self._listener
        if listener is None:
            raise OSError("listener is closed")
        sock, listener._last_accepted = listener._socket.accept()
        try:
            sock.setblocking(True)
            tune(sock)
        except OSError:
            sock.close()
            raise
        return tls.TLSConnection.server(sock, self._context, lazy=HANDSHAKE_TIMEOUT)


class XmlClientWrap(connection.ConnectionWrapper):
    """A connection speaking xmlrpc (the stdlib's XmlClient/XmlListener wrap)."""

    def __init__(self, conn: Any) -> None:
        super().__init__(conn, _xml_dumps, _xml_loads)


# As the stdlib's XmlClient encodes (allow_none, utf-8); its own two functions
# need a module global that only its XmlClient/XmlListener import.
def _xml_dumps(obj: Any) -> bytes:
    import xmlrpc.client

    return xmlrpc.client.dumps((obj,), None, None, None, 1).encode("utf-8")


def _xml_loads(s: bytes) -> Any:
    import xmlrpc.client

    (obj,), _ = xmlrpc.client.loads(s.decode("utf-8"))
    return obj


class XmlListener(_Listener):
    def accept(self) -> Any:
        return XmlClientWrap(super().accept())


managers.listener_client["fiber-pickle"] = (
    _Listener,
    _socket_client(connection.Connection),
)
managers.listener_client["fiber-xmlrpc"] = (
    XmlListener,
    _socket_client(XmlClientWrap),
)


def _rebuild(func: Any, token: Any, serializer: str, kwds: dict) -> Any:
    """Unpickle a proxy: the stdlib's RebuildProxy, reached through this module
    so that the ``fiber-*`` connection functions are registered first."""
    return managers.RebuildProxy(func, token, serializer, kwds)


class BaseProxy(managers.BaseProxy):
    """A base for proxies of shared objects, usable from any process."""

    def __reduce__(self):
        kwds = {"authkey": bytes(self._authkey)}
        if getattr(self, "_isauto", False):
            kwds["exposed"] = self._exposed_
            func = self._auto_proxy
        else:
            func = type(self)
        return (_rebuild, (func, self._token, self._serializer, kwds))

    def _transport_failed(self, e: BaseException) -> ManagerConnectionError:
        try:
            self._tls.connection.close()
        except Exception:
            pass
        try:
            del self._tls.connection
        except AttributeError:
            pass
        host, port = self._token.address[:2]
        err = ManagerConnectionError(
            f"lost the connection to the manager at {host}:{port} while calling "
            f"{self._token.typeid!r} ({e or type(e).__name__}). The manager's "
            "process has exited or its host is unreachable."
        )
        err.__cause__ = e
        return err

    def _connection(self) -> Any:
        try:
            return self._tls.connection
        except AttributeError:
            self._connect()
            return self._tls.connection

    def _callmethod(
        self, methodname: str, args: tuple = (), kwds: dict | None = None
    ) -> Any:
        """Call a method of the referent and return a copy of the result."""
        conn = self._connection()
        try:
            conn.send((self._id, methodname, args, kwds or {}))
            kind, result = conn.recv()
        except (EOFError, OSError) as e:
            raise self._transport_failed(e) from e
        return self._convert(kind, result)

    def _convert(self, kind: str, result: Any) -> Any:
        if kind == "#RETURN":
            return result
        if kind == "#PROXY":
            exposed, token = result
            token.address = self._token.address
            if self._manager is not None:
                proxytype = self._manager._registry[token.typeid][-1]
            else:
                # Unpickled elsewhere: no registry here (the stdlib fails with
                # an AttributeError); an auto proxy with the exposed methods.
                proxytype = self._auto_proxy
            proxy = proxytype(
                token,
                self._serializer,
                manager=self._manager,
                authkey=self._authkey,
                exposed=exposed,
            )
            conn = self._Client(token.address, authkey=self._authkey)
            managers.dispatch(conn, None, "decref", (token.id,))
            return proxy
        raise managers.convert_to_error(kind, result)


def MakeProxyType(name: str, exposed: Any, _cache: dict = {}) -> type:  # noqa: N802, B006
    """A proxy type whose methods are ``exposed`` (as the stdlib's)."""
    return _make_type(BaseProxy, name, exposed, _cache)


def _make_type(base: type, name: str, exposed: Any, cache: dict) -> type:
    exposed = tuple(exposed)
    try:
        return cache[(name, exposed)]
    except KeyError:
        pass
    namespace: dict = {}
    for meth in exposed:
        exec(  # the stdlib's way: a real method per exposed name
            f"def {meth}(self, /, *args, **kwds):\n"
            f"    return self._callmethod({meth!r}, args, kwds)",
            namespace,
        )
    proxytype = type(name, (base,), namespace)
    proxytype._exposed_ = exposed
    cache[(name, exposed)] = proxytype
    return proxytype


def _auto(
    maker: Any,
    token: Any,
    serializer: str,
    manager: Any,
    authkey: Any,
    exposed: Any,
    incref: bool,
    manager_owned: bool,
) -> Any:
    client = managers.listener_client[serializer][1]
    if authkey is None and manager is not None:
        authkey = manager._authkey
    if authkey is None:
        authkey = security.authkey()
    if exposed is None:
        conn = client(token.address, authkey=authkey)
        try:
            exposed = managers.dispatch(conn, None, "get_methods", (token,))
        finally:
            conn.close()
    proxytype = maker(f"AutoProxy[{token.typeid}]", exposed)
    proxy = proxytype(
        token,
        serializer,
        manager=manager,
        authkey=authkey,
        incref=incref,
        manager_owned=manager_owned,
    )
    proxy._isauto = True
    return proxy


def _auto_proxy_function(maker: Any, name: str, doc: str) -> Any:
    """The stdlib's ``AutoProxy`` signature, building types with ``maker``."""

    def auto_proxy(
        token: Any,
        serializer: str,
        manager: Any = None,
        authkey: Any = None,
        exposed: Any = None,
        incref: bool = True,
        manager_owned: bool = False,
    ) -> Any:
        return _auto(
            maker, token, serializer, manager, authkey, exposed, incref, manager_owned
        )

    auto_proxy.__name__ = auto_proxy.__qualname__ = name
    auto_proxy.__doc__ = doc
    return auto_proxy


AutoProxy = _auto_proxy_function(
    MakeProxyType, "AutoProxy", "A proxy for a token exposing the referent's methods."
)


def proxy_type_for(stdlib_type: type, module: str | None = None) -> type:
    """A fiber-dask version of a stdlib-based proxy class: the same methods and
    exposed names, with fiber-dask's pickling and connections.

    The class must pickle by name (a manager's registry travels to its server
    process), so it is defined in ``module``, or else published in this module
    under a name derived from the original's; register the original at import
    time of its module, as the stdlib requires anyway.
    """
    if issubclass(stdlib_type, BaseProxy):
        return stdlib_type
    if module is not None:
        name = stdlib_type.__name__
    else:
        module = __name__
        origin = f"{stdlib_type.__module__}.{stdlib_type.__qualname__}"
        name = "_fiber_" + "".join(c if c.isalnum() else "_" for c in origin)
        existing = globals().get(name)
        if existing is not None and issubclass(existing, stdlib_type):
            return existing
    cls = type(name, (BaseProxy, stdlib_type), {"__module__": module})
    cls.__qualname__ = name
    if module == __name__:
        globals()[name] = cls
    return cls


# --- AsyncManager (Fiber): every call returns a result to ask later ----------


class AsyncProxyResult:
    """The pending result of an AsyncManager proxy call.

    ``get(timeout)`` / ``result(timeout)`` wait for it (raising the call's own
    exception, or ``multiprocessing.TimeoutError``); ``ready()``/``done()``
    tell without waiting.  Replies arrive in the order the calls were made on
    the calling thread's connection; asking for any result reads the replies
    before it, so results may be collected in any order.
    """

    __slots__ = ("_pipe", "_done", "_kind", "_value", "_proxy")

    def __init__(self, pipe: _Pipeline, proxy: Any) -> None:
        self._pipe, self._proxy = pipe, proxy
        self._done = False
        self._kind: str | None = None
        self._value: Any = None

    def _set(self, kind: str, value: Any) -> None:
        self._kind, self._value, self._done = kind, value, True

    def ready(self) -> bool:
        if not self._done:
            self._pipe.drain(self, 0)
        return self._done

    done = ready

    def wait(self, timeout: float | None = None) -> None:
        if not self._done:
            self._pipe.drain(self, timeout)

    def get(self, timeout: float | None = None) -> Any:
        self.wait(timeout)
        if not self._done:
            raise MpTimeoutError
        if self._kind == "#LOST":
            raise self._value
        return self._proxy._convert(self._kind, self._value)

    result = get

    def successful(self) -> bool:
        if not self.ready():
            raise ValueError(f"{self!r} not ready")
        return self._kind in ("#RETURN", "#PROXY")

    def __repr__(self) -> str:
        state = "done" if self._done else "pending"
        return f"<AsyncProxyResult {state}>"


class _Pipeline:
    """One async connection of a thread to a manager: requests sent, results
    waiting for their replies in order."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self.pending: collections.deque[AsyncProxyResult] = collections.deque()
        self.lock = threading.Lock()
        self.broken: BaseException | None = None

    def drain(self, target: AsyncProxyResult, timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.lock:
            while not target._done and self.pending:
                if deadline is not None:
                    left = deadline - time.monotonic()
                    if not self.conn.poll(max(left, 0)):
                        return
                try:
                    kind, value = self.conn.recv()
                except (EOFError, OSError) as e:
                    self._fail(e, target._proxy)
                    return
                self.pending.popleft()._set(kind, value)

    def _fail(self, e: BaseException, proxy: Any) -> None:
        err = proxy._transport_failed(e)
        self.broken = err
        while self.pending:
            self.pending.popleft()._set("#LOST", err)


class AsyncBaseProxy(BaseProxy):
    """A proxy whose method calls return :class:`AsyncProxyResult`."""

    def _pipeline(self) -> _Pipeline:
        pipe = getattr(self._tls, "pipeline", None)
        if pipe is None or pipe.broken is not None:
            conn = self._connection()
            pipe = self._tls.pipeline = _Pipeline(conn)
        return pipe

    def _transport_failed(self, e: BaseException) -> ManagerConnectionError:
        err = super()._transport_failed(e)
        try:
            del self._tls.pipeline
        except AttributeError:
            pass
        return err

    def _callmethod(
        self, methodname: str, args: tuple = (), kwds: dict | None = None
    ) -> AsyncProxyResult:
        pipe = self._pipeline()
        result = AsyncProxyResult(pipe, self)
        with pipe.lock:
            try:
                pipe.conn.send((self._id, methodname, args, kwds or {}))
            except (EOFError, OSError) as e:
                pipe._fail(e, self)
                raise pipe.broken from e
            pipe.pending.append(result)
        return result

    def _getvalue(self) -> Any:
        return self._callmethod("#GETVALUE").get()

    def __str__(self) -> str:
        try:
            return self._callmethod("__repr__").get()
        except Exception:
            return repr(self)[:-1] + "; '__str__()' failed>"


def MakeAsyncProxyType(name: str, exposed: Any, _cache: dict = {}) -> type:  # noqa: N802, B006
    """An async proxy type whose methods are ``exposed``."""
    return _make_type(AsyncBaseProxy, name, exposed, _cache)


AsyncAutoProxy = _auto_proxy_function(
    MakeAsyncProxyType,
    "AsyncAutoProxy",
    "An async proxy for a token exposing the referent's methods.",
)

# The auto-proxy function of each kind of proxy (for pickling an auto proxy,
# and for a proxy returned by a method of one unpickled elsewhere).
BaseProxy._auto_proxy = staticmethod(AutoProxy)
AsyncBaseProxy._auto_proxy = staticmethod(AsyncAutoProxy)
