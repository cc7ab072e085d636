"""``Process``: ``multiprocessing.Process`` as a real OS process on a Dask worker host.

How a Process runs::

    parent (this process)              Dask worker process             worker host
    ─────────────────────              ───────────────────             ───────────
    start():
      register service process-<id>
      on the channel server
      client.submit(run_launcher) ───► run_launcher (one Dask task,
                                         seceded from the thread pool)
      _on_connect ◄── connect, HMAC ──── channel.connect
      ── ("payload", blob) ────────────► Popen(python -m
                                           fiber_dask.processchild) ──► child: reads the
      ◄── ("started", pid) ─────────────                                  payload on stdin,
      ◄── ("out"|"err", bytes) ───────── pumps the child's stdout/err ◄── runs
      ── ("signal", signum) ───────────► os.kill(child)                   BaseProcess._bootstrap
      ◄── ("exit", returncode) ───────── child.wait()

* The payload (the Process object's state, cloudpickled: target or an
  overridden ``run``, args, kwargs, name, daemon, authkey, parent pid/name)
  travels over the authenticated channel and the child's stdin, never on a
  command line or through the scheduler.
* Dask re-runs a task whose worker died; the service accepts only the first
  launcher, so a Process is never started twice.
* The child dies with its launcher: it watches its stdin (EOF = the launcher's
  worker process is gone) and asks the kernel for ``SIGKILL`` on its parent's
  death (``PR_SET_PDEATHSIG``).  The launcher kills the child when the parent's
  connection drops, and the parent terminates its daemonic children at exit.
* A launcher that vanishes before reporting an exit code (its worker was
  killed, its host lost) ends the Process with ``exitcode == -SIGKILL`` and a
  human-readable :attr:`Process.reason`.

The launcher secedes from the worker's thread pool once the child runs, so a
running Process does not hold a task slot (as stdlib processes oversubscribe
the CPUs); ``resources=`` stay reserved until it ends.
"""

from __future__ import annotations

import atexit
import codecs
import json
import logging
import os
import pickle
import random
import signal
import struct
import subprocess
import sys
import threading
import uuid
import weakref
from multiprocessing.process import (  # noqa: F401 - the stdlib module's names
    ORIGINAL_DIR,
    AuthenticationString,
    BaseProcess,
    WeakSet,
    _dangling,
    current_process,
    parent_process,
)
from typing import Any

from . import channel, cluster
from .mainglobals import dumps_for_child

__all__ = [
    "Process",
    "current_process",
    "parent_process",
    "active_children",
    "run_launcher",
]

logger = logging.getLogger(__name__)

_children: set = set()  # started fiber Processes of this process, not yet reaped
_SLOT_WAIT = 0.5  # seconds a queued launcher task waits before launching beside tasks
_PIPE_DRAIN = 5.0  # seconds the launcher waits for the child's output after it exits


def active_children() -> list:
    """Live fiber-dask Processes started by this process (stdlib semantics)."""
    _cleanup()
    return list(_children)


def _cleanup() -> None:
    for p in list(_children):
        popen = p._popen
        if popen is None or popen.poll() is not None:
            _children.discard(p)


def _authkey() -> bytes:
    """The channel key: this process's multiprocessing authkey (as Pool uses)."""
    return bytes(current_process().authkey)


class Process(BaseProcess):
    """A process running ``target(*args, **kwargs)`` on a Dask worker host.

    Same signature and behaviour as :class:`multiprocessing.Process`; the
    keyword-only arguments after ``daemon`` are fiber-dask's.

    Parameters
    ----------
    group, target, name, args, kwargs, daemon
        As in the stdlib.  ``target`` (or a subclass with its ``run``) and the
        arguments travel with cloudpickle: lambdas and closures work.
    resources : dict, optional
        Dask worker resources the process needs, e.g. ``{"GPU": 1}``; they stay
        reserved on its worker until it ends.
    client : distributed.Client, optional
        Run on this client's cluster.
    address : str, optional
        Attach to the scheduler at this address.

    Notes
    -----
    Differences from the stdlib:

    * ``pid`` (``ident``) blocks until the child is running on its worker
      (usually well under a second after ``start()``), or returns None if the
      process ended without starting.
    * ``sentinel`` is the read end of a local pipe that becomes readable when
      the process has ended (usable with ``multiprocessing.connection.wait``).
    * If the worker hosting the process dies (SIGKILL, out of memory, a lost
      host) the process is gone with it: ``exitcode`` becomes
      ``-signal.SIGKILL`` and :attr:`reason` says what happened.  It is never
      started again elsewhere.
    * The child's stdout and stderr are forwarded to this process's
      ``sys.stdout`` / ``sys.stderr`` (line-buffered in the child).
    """

    _start_method = None

    def __init__(
        self,
        group: None = None,
        target: Any = None,
        name: str | None = None,
        args: Any = (),
        kwargs: Any = None,
        *,
        daemon: bool | None = None,
        resources: dict | None = None,
        client: Any = None,
        address: str | None = None,
    ) -> None:
        super().__init__(group, target, name, args, kwargs or {}, daemon=daemon)
        self._resources = resources
        self._fiber_client = client
        self._fiber_address = address

    def start(self) -> None:
        """Start the process on a Dask worker; returns without waiting for it."""
        self._check_closed()
        assert self._popen is None, "cannot start a process twice"
        assert self._parent_pid == os.getpid(), (
            "can only start a process object created by current process"
        )
        assert not current_process()._config.get("daemon"), (
            "daemonic processes are not allowed to have children"
        )
        _cleanup()
        # Pickled here, first: an unpicklable target or argument fails in the
        # caller, as with the stdlib's spawn method.
        payload = self._payload()
        handle = cluster.get_handle(
            client=self._fiber_client, address=self._fiber_address
        )
        resources = self._resources
        if resources is None:  # @fiber_dask.meta(...) on the target or run()
            from .meta import resources_of

            resources = resources_of(self._target) or resources_of(type(self).run)
        self._popen = _Launch(self._name, payload, handle, resources)
        self._sentinel = self._popen.sentinel
        # Avoid a refcycle if the target holds the process object (bpo-30775).
        del self._target, self._args, self._kwargs
        _children.add(self)

    def _payload(self) -> bytes:

        state = dict(self.__dict__)
        for attr in ("_popen", "_fiber_client", "_sentinel"):
            state.pop(attr, None)
        config = dict(state["_config"])
        config["authkey"] = bytes(config["authkey"])  # AuthenticationString refuses
        state["_config"] = config
        # The multiprocessing logger's level reaches the child, as spawn's
        # preparation data carries it (log_to_stderr / get_logger().setLevel).
        from multiprocessing import util

        if util._logger is not None:
            state["_fiber_log_level"] = util._logger.getEffectiveLevel()
        # With the stdlib's reducers for descriptors (see mainglobals); the
        # authkey first, in a plain pickle: the child must be authenticated as
        # this process before unpickling them (resource_sharer checks it).
        inner = dumps_for_child((type(self), state))
        return pickle.dumps(
            (config["authkey"], inner), protocol=pickle.HIGHEST_PROTOCOL
        )

    @property
    def ident(self) -> int | None:
        """The child's pid on its worker host (waits until it is running)."""
        self._check_closed()
        if self is current_process():
            return os.getpid()
        if self._popen is None:
            return None
        return self._popen.wait_pid()

    pid = ident

    @property
    def reason(self) -> str | None:
        """Why the process ended abnormally without an exit status of its own
        (its worker died, it was terminated before it started, the launch
        failed); None otherwise."""
        popen = getattr(self, "_popen", None)
        return popen.reason if popen is not None else None

    def close(self) -> None:
        super().close()
        _children.discard(self)


class _Launch:
    """The parent's handle on one launched child: a ``Popen``-like object."""

    def __init__(self, name: str, payload: bytes, handle: Any, resources: Any) -> None:
        self.name = name
        self.pid: int | None = None
        self.returncode: int | None = None
        self.reason: str | None = None
        self.worker: str | None = None
        self.worker_pid: int | None = None
        self._payload: bytes | None = payload
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._started = threading.Event()
        self._done = threading.Event()
        self._conn: Any = None
        self._claimed = False
        self._decoders: dict[str, Any] = {}
        r, w = os.pipe()
        self.sentinel = r
        # Open fds, closed exactly once each (a double close could hit an fd
        # number the process has reused since).
        self._fds = {"r": r, "w": w}
        self._fds_finalizer = weakref.finalize(self, _close_fds, self._fds)
        token = uuid.uuid4().hex
        self._service = f"process-{token}"
        self._server = channel.get_server(
            handle.listen_host or "127.0.0.1", _authkey(), handle.client
        )
        self._server.register(self._service, self._on_connect)
        self._future: Any = None
        try:
            self._future = handle.client.submit(
                run_launcher,
                self._server.address,
                self._server.authkey,
                self._service,
                key=f"fiber-process-{token}",
                pure=False,
                resources=resources,
            )
        except BaseException:
            self._server.unregister(self._service)
            self._fds_finalizer()
            raise
        _when_done(handle.client, self._future, self._on_future_done)
        # A launcher task needs a free slot for a moment; if Pool loops hold
        # them all, start it beside the tasks of a worker instead.
        timer = threading.Timer(
            _SLOT_WAIT, self._launch_without_slot, (handle, resources)
        )
        timer.daemon = True
        timer.start()

    # ---------------------------------------------------------- Popen interface

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int | None:
        self._done.wait(timeout)
        return self.returncode

    def wait_pid(self) -> int | None:
        self._started.wait()
        return self.pid

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)

    def close(self) -> None:
        self._fds_finalizer()

    # ---------------------------------------------------------------- internals

    def _signal(self, signum: int) -> None:
        with self._lock:
            if self.returncode is not None:
                return
            conn = self._conn
            if conn is None:
                # No launcher has connected: none ever will (the service goes).
                self._finish_locked(-signum, "terminated before it started")
                release = True
            else:
                release = False
        if release:
            self._release()
            return
        with self._send_lock:
            try:
                conn.send_bytes(pickle.dumps(("signal", int(signum))))
            except OSError:
                pass  # the reader notices the lost connection

    def _on_connect(self, conn: Any, hello: Any) -> None:
        """A launcher connected (runs in the channel's handshake thread)."""
        with self._send_lock:
            with self._lock:
                if self._claimed or self.returncode is not None:
                    refuse = True
                else:
                    refuse = False
                    self._claimed = True
                    self._conn = conn
            if refuse:
                # A re-run of the launcher (its first worker died): never start twice.
                channel.hangup(conn)
                return
            self._server.unregister(self._service)
            if self._future is not None and self._future.status == "pending":
                try:  # launched beside tasks: the queued task is not needed
                    self._future.cancel()
                except Exception:
                    pass
            hello = hello or {}
            self.worker = hello.get("worker")
            self.worker_pid = hello.get("pid")
            payload, self._payload = self._payload, None
            try:
                conn.send_bytes(pickle.dumps(("payload", payload), protocol=5))
            except OSError:
                pass  # the read loop below sees the connection is gone
        self._read_loop(conn)

    def _read_loop(self, conn: Any) -> None:
        try:
            while True:
                msg = pickle.loads(conn.recv_bytes())
                kind = msg[0]
                if kind in ("out", "err"):
                    self._write(kind, msg[1])
                elif kind == "started":
                    self.pid = msg[1]
                    self._started.set()
                elif kind == "exit":
                    self._finish(msg[1], None)
                    return
                elif kind == "error":
                    self._finish(1, msg[1])
                    return
        except (EOFError, OSError, pickle.UnpicklingError):
            where = f" on {self.worker}" if self.worker else ""
            pid = f" (pid {self.worker_pid})" if self.worker_pid else ""
            self._finish(
                -signal.SIGKILL,
                f"lost the connection to the launcher of process {self.name!r}"
                f"{where}{pid}: the Dask worker hosting it died or became "
                "unreachable, and the process was killed with it",
            )
        finally:
            channel.hangup(conn)
            self._release()

    def _write(self, kind: str, data: bytes) -> None:
        stream = sys.stdout if kind == "out" else sys.stderr
        if stream is None:
            return
        try:
            buffer = getattr(stream, "buffer", None)
            if buffer is not None:
                stream.flush()
                buffer.write(data)
                buffer.flush()
            else:
                decoder = self._decoders.get(kind)
                if decoder is None:
                    decoder = codecs.getincrementaldecoder("utf-8")("replace")
                    self._decoders[kind] = decoder
                stream.write(decoder.decode(data))
                stream.flush()
        except Exception:  # a closed or odd stream must not kill the reader
            pass

    def _launch_without_slot(self, handle: Any, resources: Any) -> None:
        """The launcher task is still queued: run a launcher on a worker that
        has the resources, with ``client.run`` (no slot needed).  The service
        takes only the first launcher, so the two can never both start it."""
        if self._claimed or self.returncode is not None:
            return
        try:
            if self._future.status != "pending":
                return
            workers = handle.client.scheduler_info(n_workers=-1)["workers"]
            fits = [
                addr
                for addr, w in workers.items()
                if all(
                    w.get("resources", {}).get(k, 0) >= v
                    for k, v in (resources or {}).items()
                )
            ]
            if not fits or self._claimed:
                return  # none fits now: the queued task waits for scaling
            target = random.choice(fits)
            handle.client.run(
                _launch_beside_tasks,
                self._server.address,
                self._server.authkey,
                self._service,
                workers=[target],
            )
        except Exception:  # the client may be closing: the task path remains
            logger.debug("fiber-dask: could not launch beside tasks", exc_info=True)

    def _on_future_done(self, fut: Any) -> None:
        """The launcher task ended (runs in the client's event loop: no blocking).

        Matters only if no launcher ever connected."""
        with self._lock:
            if self._claimed or self.returncode is not None:
                return
            status = getattr(fut, "status", "?")
            if status == "finished":
                # Its return value says why (e.g. this process was unreachable
                # from the worker): fetched in a thread, not in the event loop.
                threading.Thread(
                    target=self._launcher_ended, args=(fut,), daemon=True
                ).start()
                return
            if status == "error":
                exc = getattr(getattr(fut, "_state", None), "exception", None)
                why = f"its launcher task failed: {exc!r}"
            elif status == "cancelled":
                why = "its launcher task was cancelled"
            else:
                why = "its launcher task ended without starting it"
            self._finish_locked(
                -signal.SIGKILL, f"process {self.name!r} could not start: {why}"
            )
        self._server.unregister(self._service)

    def _launcher_ended(self, fut: Any) -> None:
        try:
            result = fut.result(timeout=10)
        except Exception:  # the client may be closing
            result = None
        why = "its launcher task ended without starting it"
        if isinstance(result, str) and result.startswith("unreachable: "):
            why = (
                "its launcher could not connect back to this process from its "
                f"worker: {result[len('unreachable: ') :]}"
            )
        with self._lock:
            if self._claimed or self.returncode is not None:
                return
            self._finish_locked(
                -signal.SIGKILL, f"process {self.name!r} could not start: {why}"
            )
        self._server.unregister(self._service)

    def _finish(self, code: int, reason: str | None) -> None:
        with self._lock:
            self._finish_locked(code, reason)

    def _finish_locked(self, code: int, reason: str | None) -> None:
        if self.returncode is not None:
            return
        self.returncode = code
        self.reason = reason
        _close_fds(self._fds, "w")  # the sentinel becomes readable
        self._done.set()
        self._started.set()

    def _release(self) -> None:
        """Forget the launcher task: a finished Process is never re-run."""
        self._server.unregister(self._service)
        fut, self._future = self._future, None
        if fut is not None:
            try:
                fut.cancel()
            except Exception:  # the client may be closing at exit
                pass


def _when_done(client: Any, fut: Any, callback: Any) -> None:
    """Call ``callback(fut)`` in the client's event loop when ``fut`` is done.

    ``Future.add_done_callback`` runs callbacks on a thread pool that refuses
    work once the interpreter is exiting, so a Process still pending at exit
    would log an error; the event loop is still running then.
    """
    state = getattr(fut, "_state", None)
    if state is None or not hasattr(state, "wait"):
        fut.add_done_callback(callback)
        return

    async def watch() -> None:
        while fut.status == "pending":
            await state.wait()
        callback(fut)

    client.loop.add_callback(watch)


def _close_fds(fds: dict, *which: str) -> None:
    for name in which or list(fds):
        fd = fds.pop(name, None)
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass


# ------------------------------------------------------------------- the launcher


def run_launcher(
    address: tuple[str, int], authkey: bytes, service: str, worker: Any = None
) -> str:
    """Body of a Process's Dask task: start the child and relay for it.

    Returns why it ended: ``"exited"``, ``"refused"`` (another launcher already
    ran this Process, or its parent is gone), ``"parent-lost"``, or
    ``"unreachable: <error>"`` (the parent's address cannot be reached from
    this worker; the parent puts it in :attr:`Process.reason`).
    """
    try:
        if worker is None:
            from distributed import get_worker

            worker = get_worker()
        worker_address = worker.address
        scheduler_address = worker.scheduler.address
        security = getattr(worker, "security", None)
    except (ImportError, ValueError):
        worker_address = scheduler_address = security = None
    try:
        conn = channel.connect(
            address,
            authkey,
            service,
            hello={"pid": os.getpid(), "worker": worker_address},
        )
    except channel.ChannelError as e:
        if isinstance(e.__cause__, OSError):
            return f"unreachable: {e}"  # the parent's address, from this host
        return "refused"
    except OSError as e:
        return f"unreachable: {e}"
    try:
        try:
            kind, payload = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return "refused"
        assert kind == "payload"
        _secede()
        return _launch(conn, payload, worker_address, scheduler_address, security)
    finally:
        channel.hangup(conn)


def _launch_beside_tasks(address, authkey, service, dask_worker=None) -> None:
    """Run a launcher in a thread of this worker process, outside its task
    slots (``client.run`` calls this on the worker's event loop: return at once)."""
    threading.Thread(
        target=run_launcher,
        args=(address, authkey, service, dask_worker),
        name="fiber-process-launcher",
        daemon=True,
    ).start()


def _secede() -> None:
    """Give the worker thread back: the child, not this task, does the work."""
    try:
        from distributed import secede

        secede()
    except Exception:  # not inside a Dask task (tests), or an old distributed
        pass


def _child_env(
    worker_address: str | None, scheduler_address: str | None, security: Any = None
) -> dict:
    env = dict(os.environ)
    env["FIBER_DASK_LAUNCHER_PID"] = str(os.getpid())
    # The worker's import path (a spawned worker has its parent's, the script's
    # directory included), as the stdlib hands sys.path to its children.
    env["FIBER_DASK_SYS_PATH"] = json.dumps(sys.path)
    if scheduler_address:
        # Nested Pool/Process/Queue in the child attach to this same cluster,
        # whatever backend the parent's configuration names.
        env["DASK_SCHEDULER_ADDRESS"] = scheduler_address
        env["DASK_FIBER__BACKEND"] = "address"
        env["DASK_FIBER__ADDRESS"] = scheduler_address
    if worker_address:
        from distributed.comm import get_address_host

        env["DASK_FIBER__LISTEN_HOST"] = get_address_host(worker_address)
    env.update(_security_env(security))
    return env


def _security_env(security: Any) -> dict:
    """Dask config (as environment) that lets the child connect to the
    scheduler as its worker does: a worker started with ``--tls-*`` options
    has its certificates in its Security object, not in its config, so a
    child attaching over ``tls://`` would have no TLS context without this."""
    if security is None or not (security.require_encryption or security.tls_ca_file):
        return {}
    prefix = "DASK_DISTRIBUTED__COMM__"
    env = {f"{prefix}REQUIRE_ENCRYPTION": str(bool(security.require_encryption))}
    values = {
        "TLS__CA_FILE": security.tls_ca_file,
        "TLS__CIPHERS": security.tls_ciphers,
        # The child is a client of the scheduler; a worker's own certificate
        # serves when no client certificate was given.
        "TLS__CLIENT__CERT": security.tls_client_cert or security.tls_worker_cert,
        "TLS__CLIENT__KEY": security.tls_client_key or security.tls_worker_key,
    }
    for key, value in values.items():
        if value:
            env[prefix + key] = value
    return env


def _launch(
    conn: Any, payload: bytes, worker_address, scheduler_address, security=None
) -> str:
    send_lock = threading.Lock()

    def send(msg: tuple) -> bool:
        with send_lock:
            try:
                conn.send_bytes(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))
                return True
            except OSError:
                return False

    try:
        child = subprocess.Popen(
            [sys.executable, "-m", "fiber_dask.processchild"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=_child_env(worker_address, scheduler_address, security),
            close_fds=True,
        )
    except OSError as e:
        send(("error", f"cannot start the child process on {worker_address}: {e}"))
        return "failed"
    send(("started", child.pid))
    try:
        child.stdin.write(struct.pack("!Q", len(payload)) + payload)
        child.stdin.flush()
    except OSError:
        pass  # the child died already; its exit status tells why
    del payload

    state = {"exited": False, "parent_lost": False}

    def pump(stream: Any, kind: str) -> None:
        fd = stream.fileno()
        while True:
            try:
                data = os.read(fd, 65536)
            except OSError:
                return
            if not data:
                return
            send((kind, data))

    def control() -> None:
        while True:
            try:
                kind, arg = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError, pickle.UnpicklingError, ValueError):
                if not state["exited"]:
                    state["parent_lost"] = True
                    try:
                        child.kill()  # the parent is gone: so is its child
                    except OSError:
                        pass
                return
            if kind == "signal":
                try:
                    child.send_signal(arg)  # no-op once the child is reaped
                except OSError:
                    pass

    pumps = [
        threading.Thread(target=pump, args=(child.stdout, "out"), daemon=True),
        threading.Thread(target=pump, args=(child.stderr, "err"), daemon=True),
    ]
    for t in pumps:
        t.start()
    threading.Thread(target=control, name="fiber-process-control", daemon=True).start()
    returncode = child.wait()
    for t in pumps:  # a grandchild may hold the pipes open: do not wait forever
        t.join(_PIPE_DRAIN)
    state["exited"] = True
    send(("exit", returncode))
    for f in (child.stdin, child.stdout, child.stderr):
        try:
            f.close()
        except OSError:
            pass
    return "parent-lost" if state["parent_lost"] else "exited"


# ----------------------------------------------------------------- at exit


def _exit_function() -> None:
    """As the stdlib at exit: terminate daemonic children, join the others.

    Registered after ``cluster.shutdown`` (imported above), so it runs before
    the cluster fiber-dask started is closed.
    """
    for p in active_children():
        if p.daemon:
            try:
                p._popen.terminate()
            except Exception:  # noqa: BLE001 - best effort at exit
                pass
    for p in active_children():
        try:
            p._popen.wait()
        except Exception:  # noqa: BLE001
            pass
    _cleanup()


atexit.register(_exit_function)
