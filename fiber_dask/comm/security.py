"""Which security a process's direct connections use: TLS or not, which
certificate, and the authkey.

The policy's one owner.  :mod:`fiber_dask.comm.tls` holds the TLS connection
itself; the channel, the object server and the Manager ask this module which
context to listen or connect with, and which authkey peers must prove.

The authkey (:func:`authkey`) is this process's ``multiprocessing`` authkey,
the stdlib's: children inherit it, and it travels to Dask workers inside their
tasks (over Dask's comm, encrypted when Dask's TLS is configured).

Which mode a process uses (:func:`mode`), first match wins:

1. what the process that started it fixed with :func:`pin` (a Manager's server
   process gets its owner's mode);
2. the cluster handle fiber-dask resolved in this process: its client's
   ``security`` and scheduler address;
3. inside a Dask worker: the worker's ``security`` and address;
4. a default ``distributed.Client`` (when no scheduler is configured);
5. Dask's config: ``distributed.comm.require-encryption`` or a configured
   ``tls://`` scheduler address, with the ``distributed.comm.tls.*``
   certificates (what a Process child gets from its launcher).

TLS is on when that cluster uses it; the certificate is the process's own in
Dask's terms (a worker's, else a client's).  Servers listen with
``Security.get_listen_args(role)``'s context and clients connect with
``get_connection_args(role)``'s: both require the peer's certificate.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

from ..errors import TLSConnectionError

__all__ = [
    "authkey",
    "client_context",
    "dask_config",
    "export",
    "mode",
    "mode_source",
    "pin",
    "server_context",
]


def authkey() -> bytes:
    """This process's authkey: the stdlib's ``current_process().authkey``,
    which children inherit and which every fiber-dask endpoint of this
    process asks its peers to prove they know."""
    import multiprocessing

    return bytes(multiprocessing.current_process().authkey)


_UNSET: Any = object()
_pinned: Any = _UNSET  # (Security | None, role, source) fixed by pin()
_contexts: dict = {}
_contexts_lock = threading.Lock()
_ROLES = ("client", "worker", "scheduler")


def pin(
    settings: dict | None, source: str = "the process that started this one"
) -> None:
    """Fix this process's mode: ``settings`` from :func:`export` (TLS) or
    None (no TLS), whatever the config says."""
    global _pinned
    if settings is None:
        _pinned = (None, None, source)
        return
    from distributed.security import Security

    settings = dict(settings)
    role = settings.pop("role")
    _pinned = (Security(**settings), role, source)


def export() -> dict | None:
    """This process's mode, to :func:`pin` in another process: the
    ``Security`` arguments of its certificate (as a client's), or None."""
    security, role, _ = mode()
    if security is None:
        return None
    tls = security.get_tls_config_for_role(role)
    settings = {
        "role": "client",
        "require_encryption": True,
        "tls_ca_file": tls["ca_file"],
        "tls_client_cert": tls["cert"],
        "tls_client_key": tls["key"],
        "tls_min_version": security.tls_min_version,
        "tls_max_version": security.tls_max_version,
    }
    if tls.get("ciphers"):
        settings["tls_ciphers"] = tls["ciphers"]
    return settings


def dask_config(settings: dict | None) -> dict:
    """Dask config that makes a new ``Security()`` (and so a client of the
    scheduler) use the certificate of :func:`export`'s ``settings``."""
    if settings is None:
        return {}
    names = {
        "tls_ca_file": "distributed.comm.tls.ca-file",
        "tls_client_cert": "distributed.comm.tls.client.cert",
        "tls_client_key": "distributed.comm.tls.client.key",
        "tls_ciphers": "distributed.comm.tls.ciphers",
    }
    config = {"distributed.comm.require-encryption": True}
    for key, name in names.items():
        if settings.get(key):
            config[name] = settings[key]
    return config


def mode(client: Any = None) -> tuple[Any, str | None, str]:
    """``(security, role, source)``: the ``distributed.Security`` whose
    certificate of ``role`` this process's direct connections use, or None
    for no TLS; ``source`` says where that was decided (for errors).
    ``client``: the ``distributed.Client`` of the object the connection is
    for (a Pool or Process made with ``client=``/``address=``), if known."""
    if _pinned is not _UNSET:
        return _pinned
    if client is not None:
        return _from_client(client, "the cluster of its Pool or Process")
    from .. import cluster

    handle = cluster.current_handle()
    if handle is not None:
        return _from_client(handle.client, "its fiber-dask cluster handle")
    worker = _this_worker()
    if worker is not None:
        return _decide(
            getattr(worker, "security", None),
            _address_of(worker),
            "worker",
            "its Dask worker",
        )
    from .. import config
    from ..backends.address import configured_address

    address, where = configured_address()
    if not address and not config.get("backend"):
        client = _default_client()
        if client is not None:
            return _from_client(client, "the default distributed.Client")
    import dask.config

    required = dask.config.get("distributed.comm.require-encryption", None)
    if not required and not (address or "").startswith("tls://"):
        return None, None, "Dask's config (no TLS)"
    from distributed.security import Security

    source = "distributed.comm.require-encryption" if required else where
    return _decide(Security(), address or "", "client", source)


def mode_source() -> str:
    try:
        return mode()[2]
    except Exception as e:  # only for messages
        return repr(e)


def _address_of(obj: Any) -> str:
    try:
        return obj.address or ""
    except Exception:
        return ""


def _from_client(client: Any, source: str) -> tuple:
    try:
        address = client.scheduler.address or ""
    except AttributeError:
        address = ""
    return _decide(getattr(client, "security", None), address, "client", source)


def _decide(security: Any, address: str, role: str, source: str) -> tuple:
    uses_tls = address.startswith("tls://") or bool(
        security is not None and security.require_encryption
    )
    if not uses_tls:
        return None, None, f"{source} (no TLS)"
    for r in (role, *_ROLES):
        tls = security.get_tls_config_for_role(r) if security is not None else {}
        if tls.get("ca_file") and tls.get("cert"):
            return security, r, f"{source}: TLS"
    raise TLSConnectionError(
        f"this process's Dask cluster uses TLS ({source}) but it has no TLS "
        "certificate and CA for fiber-dask's direct connections: configure "
        "distributed.comm.tls.ca-file and a certificate (client/worker) as for Dask"
    )


def _this_worker() -> Any:
    module = sys.modules.get("distributed.worker")
    if module is None:  # not imported: this process runs no worker
        return None
    try:
        return module.get_worker()
    except ValueError:
        pass
    try:  # a thread of a worker process outside its tasks
        for worker in list(module.Worker._instances):
            if _address_of(worker):
                return worker
    except Exception:
        pass
    return None


def _default_client() -> Any:
    module = sys.modules.get("distributed.client")
    if module is None:  # not imported: there is no client
        return None
    try:
        return module._get_global_client()
    except Exception:
        return None


def _context(server: bool, client: Any = None) -> Any:
    security, role, _ = mode(client)
    if security is None:
        return None
    tls = security.get_tls_config_for_role(role)
    key = (
        server,
        tls.get("ca_file"),
        tls.get("cert"),
        tls.get("key"),
        tls.get("ciphers"),
        security.tls_min_version,
        security.tls_max_version,
    )
    import ssl

    with _contexts_lock:
        ctx = _contexts.get(key)
        if ctx is None:
            if server:
                ctx = security.get_listen_args(role)["ssl_context"]
                ctx.num_tickets = 0  # nothing after the handshake: no resumption
            else:
                ctx = security.get_connection_args(role)["ssl_context"]
            ctx.options |= getattr(ssl, "OP_NO_RENEGOTIATION", 0)
            _contexts[key] = ctx
        return ctx


def server_context(client: Any = None) -> Any:
    """The ``ssl.SSLContext`` endpoints of this process listen with, or None
    (no TLS); ``client`` as for :func:`mode`."""
    return _context(True, client)


def client_context() -> Any:
    """The ``ssl.SSLContext`` this process connects with, or None (no TLS)."""
    return _context(False)
