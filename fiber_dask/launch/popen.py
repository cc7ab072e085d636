"""The parent's half of a ``Process`` launch: the ``Popen`` a Process holds.

As CPython cuts ``process.py`` (the ``BaseProcess`` face) from ``popen_*.py``
(how a started process is run and watched), :mod:`fiber_dask.process` is the
face and this module is how the child runs: it submits the launcher task,
speaks the launch protocol (:mod:`fiber_dask.launch.launchprotocol`) to the
launcher that connects back, relays the child's output and the parent's
signals, and reports the exit::

    parent (Popen)                     Dask worker process             worker host
    ──────────────                     ───────────────────             ───────────
    Popen(cls, state):
      register service process-<id>
      on the channel server
      client.submit(run_launcher) ───► run_launcher (one Dask task,
                                         seceded from the thread pool)
      _on_connect ◄── connect, HMAC, ─── channel.connect
                      Hello
      ── Payload(blob) ────────────────► Popen(python -c
                                           processchild.BOOT) ────────► child: reads the
      ◄── Started(pid) ─────────────────                                  payload on stdin,
      ◄── Output(fd, bytes) ──────────── pumps the child's stdout/err ◄── runs
      ── Signal(signum) ───────────────► os.kill(child)                   BaseProcess._bootstrap
         (terminate, kill, interrupt)
      ◄── Exit(returncode) ──────────── child.wait()

* The payload (the Process object's state, cloudpickled: target or an
  overridden ``run``, args, kwargs, name, daemon, authkey, parent pid/name)
  travels over the authenticated channel and the child's stdin, never on a
  command line or through the scheduler.
* Dask re-runs a task whose worker died; the service accepts only the first
  launcher, so a Process is never started twice.
* A launcher task still queued after ``_SLOT_WAIT`` s (Pool loops hold every
  slot) gets a twin started beside a worker's tasks (``client.run``); the
  first to connect runs the child.
* The child dies with its launcher: it watches its stdin (EOF = the launcher's
  worker process is gone) and asks the kernel for ``SIGKILL`` on its parent's
  death (``PR_SET_PDEATHSIG``).  When the parent's connection drops (the
  parent died, on whatever host), the launcher tells the child, whose
  ``parent_process()`` turns dead (its sentinel ready) at once, and kills it
  ``launcher.ORPHAN_GRACE`` s later if it has not ended; the parent terminates
  its daemonic children at exit.
* A launcher that vanishes before reporting an exit code (its worker was
  killed, its host lost) ends the Process with ``exitcode == -SIGKILL`` and a
  human-readable ``reason``.

The launcher secedes from the worker's thread pool once the child runs, so a
running Process does not hold a task slot (as stdlib processes oversubscribe
the CPUs); ``resources=`` stay reserved until it ends.  The launcher, the
worker's side, is :mod:`fiber_dask.launch.launcher`; the child's start-up is
:mod:`fiber_dask.launch.processchild`.
"""

from __future__ import annotations

import codecs
import logging
import os
import pickle
import signal
import sys
import threading
import time
import uuid
import weakref
from typing import Any

from .. import cluster
from ..comm import channel, security
from ..transparency import privaterandom
from . import launcher
from . import launchprotocol as proto
from .mainglobals import dumps_for_child, main_path

__all__ = ["Popen"]

logger = logging.getLogger(__name__)

_SLOT_WAIT = 0.5  # seconds a queued launcher task waits before launching beside tasks


def _encode_payload(cls: type, state: dict) -> bytes:
    """What the child (:mod:`fiber_dask.launch.processchild`) rebuilds its
    Process from: ``(authkey, inner)``, ``inner`` the cloudpickled
    ``(cls, state)`` with what spawn's preparation data would carry."""
    state = dict(state)
    config = dict(state["_config"])
    config["authkey"] = bytes(config["authkey"])  # AuthenticationString refuses
    state["_config"] = config
    # The multiprocessing logger's level reaches the child, as spawn's
    # preparation data carries it (log_to_stderr / get_logger().setLevel).
    from multiprocessing import util

    if util._logger is not None:
        state["_fiber_log_level"] = util._logger.getEffectiveLevel()
    state["_fiber_main_path"] = main_path()  # as spawn's preparation data
    # With the stdlib's reducers for descriptors (see mainglobals); the
    # authkey first, in a plain pickle: the child must be authenticated as
    # this process before unpickling them (resource_sharer checks it).
    inner = dumps_for_child((cls, state))
    return pickle.dumps((config["authkey"], inner), protocol=pickle.HIGHEST_PROTOCOL)


class Popen:
    """The parent's handle on one launched child, as the stdlib's ``Popen``
    objects are (``poll``, ``wait``, ``terminate``, ``kill``, ``close``,
    ``sentinel``, ``pid``), plus what only a remote child has: ``reason``,
    ``worker``, ``worker_pid`` and :meth:`wait_pid`.

    ``cls`` and ``state`` are the Process's class and the attributes its
    child gets; they are pickled first, so an unpicklable target or argument
    fails in the caller of ``start()``, as with the stdlib's spawn method.
    ``client`` / ``address`` say which cluster (``cluster.get_handle``);
    ``resources`` the Dask resources its launcher task holds.
    """

    def __init__(
        self,
        cls: type,
        state: dict,
        *,
        resources: dict | None = None,
        client: Any = None,
        address: str | None = None,
    ) -> None:
        payload = _encode_payload(cls, state)
        handle = cluster.get_handle(client=client, address=address)
        _require_scheduler(handle.client)
        self.name: str = state["_name"]
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
        self._decoders: dict[int, Any] = {}
        r, w = os.pipe()
        self.sentinel = r
        # Open fds, closed exactly once each (a double close could hit an fd
        # number the process has reused since).
        self._fds = {"r": r, "w": w}
        self._fds_finalizer = weakref.finalize(self, _close_fds, self._fds)
        token = uuid.uuid4().hex
        self._service = f"process-{token}"
        self._server = channel.get_server(
            handle.listen_host, security.authkey(), handle.client
        )
        self._server.register(self._service, self._on_connect)
        self._future: Any = None
        self._client = handle.client
        self._started_at = time.monotonic()
        try:
            self._future = handle.client.submit(
                launcher.run_launcher,
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
        self._beside_timer = timer  # tests join it: the decision is made

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

    def interrupt(self) -> None:
        """SIGINT to the child, where it runs (Python 3.14's ``Popen.interrupt``)."""
        self._signal(signal.SIGINT)

    def close(self) -> None:
        self._fds_finalizer()

    def wait_at_exit(self) -> None:
        """Wait for the child as the stdlib's exit handler joins one, but
        give up a Process that has not started and whose client has lost its
        scheduler for ``fiber.connect-timeout`` (ending it with a reason)."""
        lost_since = None
        while self.wait(0.5) is None:
            if self._conn is not None:
                continue  # running: wait for it, as the stdlib does
            if self._client.status == "running":
                lost_since = None
                continue
            now = time.monotonic()
            lost_since = lost_since or now
            timeout = _connect_timeout()
            if now - lost_since > timeout:
                self._finish(
                    -signal.SIGKILL,
                    f"process {self.name!r} never started: "
                    + _lost_scheduler(self._client, timeout),
                )
                return

    # ---------------------------------------------------------------- internals

    def _signal(self, signum: int) -> None:
        with self._lock:
            if self.returncode is not None:
                return
            conn = self._conn
            if conn is None:
                # No launcher has connected: none ever will (the service goes).
                self._finish_locked(
                    -signum,
                    f"ended by {signal.Signals(signum).name} before it started",
                )
                release = True
            else:
                release = False
        if release:
            self._release()
            return
        with self._send_lock:
            try:
                conn.send_bytes(proto.encode(proto.Signal(int(signum))))
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
            hello = proto.Hello.from_wire(hello)
            if not hello.task and self._future is not None:
                # Launched beside tasks: the queued task is not needed.  (Not
                # when the task itself connected: a client's future stays
                # "pending" while its task runs, and cancelling it would free
                # the Process's resources= for others while it runs.)
                _cancel_quietly(self._client, self._future)
            self.worker = hello.worker
            self.worker_pid = hello.pid
            payload, self._payload = self._payload, None
            try:
                conn.send_bytes(proto.encode(proto.Payload(payload)))
            except OSError:
                pass  # the read loop below sees the connection is gone
        self._read_loop(conn)

    def _read_loop(self, conn: Any) -> None:
        try:
            while True:
                msg = proto.decode(conn.recv_bytes())
                kind = type(msg)
                if kind is proto.Output:
                    self._write(msg.fd, msg.data)
                elif kind is proto.Started:
                    self.pid = msg.pid
                    self._started.set()
                elif kind is proto.Exit:
                    self._finish(msg.returncode, None)
                    return
                elif kind is proto.StartFailed:
                    self._finish(1, msg.why)
                    return
        except (EOFError, OSError):
            self._finish(
                -signal.SIGKILL,
                f"lost the connection to the launcher of process {self.name!r}"
                f"{self._where()}: the Dask worker hosting it died or became "
                "unreachable, and the process was killed with it",
            )
        except proto.ProtocolError as e:
            # Hanging up makes the launcher kill the child, as if we had died.
            self._finish(
                -signal.SIGKILL,
                f"the launcher of process {self.name!r}{self._where()} sent what "
                f"this process cannot read, and the process was killed: {e}",
            )
        finally:
            channel.hangup(conn)
            self._release()

    def _where(self) -> str:
        where = f" on {self.worker}" if self.worker else ""
        return where + (f" (pid {self.worker_pid})" if self.worker_pid else "")

    def _write(self, fd: int, data: bytes) -> None:
        """Relay the child's output to ours (fd 1: ``sys.stdout``, else
        ``sys.stderr``), in bytes where the stream takes them."""
        stream = sys.stdout if fd == 1 else sys.stderr
        if stream is None:
            return
        try:
            buffer = getattr(stream, "buffer", None)
            if buffer is not None:
                stream.flush()
                buffer.write(data)
                buffer.flush()
            else:
                decoder = self._decoders.get(fd)
                if decoder is None:
                    decoder = codecs.getincrementaldecoder("utf-8")("replace")
                    self._decoders[fd] = decoder
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
        if getattr(handle.client, "status", "running") != "running":
            self._watch_scheduler(handle.client)
            return
        try:
            if self._future.status != "pending":
                return
            if resources:
                # Room left, not capacity: a worker whose resources other
                # tasks or Processes hold must not get this one beside them
                # (meta(cpu=1) Processes would share a worker's one CPU).
                free = handle.client.run_on_scheduler(_free_resources)
            else:
                free = {
                    addr: {}
                    for addr in handle.client.scheduler_info(n_workers=-1)["workers"]
                }
            fits = [
                addr
                for addr, room in free.items()
                if all(room.get(k, 0) >= v for k, v in (resources or {}).items())
            ]
            if not fits or self._claimed:
                return  # none fits now: the queued task waits for scaling
            target = privaterandom.rng.choice(fits)
            handle.client.run(
                launcher.launch_beside_tasks,
                self._server.address,
                self._server.authkey,
                self._service,
                workers=[target],
            )
        except Exception:  # the client may be closing: the task path remains
            logger.debug("fiber-dask: could not launch beside tasks", exc_info=True)

    def _watch_scheduler(self, client: Any) -> None:
        """The client lost its scheduler before a launcher connected: wait
        for it to come back until ``fiber.connect-timeout`` after start(),
        else end the Process saying so (Dask itself would cancel the task
        only when its own reconnect gives up)."""
        timeout = _connect_timeout()
        deadline = self._started_at + timeout
        while time.monotonic() < deadline:
            if self._claimed or self.returncode is not None:
                return
            if client.status == "running":
                return
            time.sleep(0.05)
        with self._lock:
            if self._claimed or self.returncode is not None:
                return
            self._finish_locked(
                -signal.SIGKILL,
                f"process {self.name!r} could not start: "
                + _lost_scheduler(client, timeout),
            )
        self._release()

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
            elif status == "cancelled" and self._client.status != "running":
                why = _lost_scheduler(self._client, _connect_timeout())
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
        if (
            isinstance(result, proto.LaunchResult)
            and result.outcome is proto.Outcome.UNREACHABLE
        ):
            why = (
                "its launcher could not connect back to this process from its "
                f"worker: {result.detail}"
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
            _cancel_quietly(self._client, fut)


def _cancel_quietly(client: Any, fut: Any) -> None:
    """Cancel ``fut`` without waiting: ``Future.cancel`` waits for the event
    loop, forever if it has stopped (at exit) or its scheduler is gone."""
    try:
        if client.status in ("closing", "closed"):
            return  # nothing to cancel with: the scheduler forgets it
        client.loop.add_callback(client._cancel, [fut])
    except Exception:  # a closed loop: nothing is running the task for us
        pass


def _free_resources(dask_scheduler: Any = None) -> dict[str, dict[str, float]]:
    """On the scheduler: each worker's resources not held by its tasks."""
    return {
        addr: {
            k: total - ws.used_resources.get(k, 0)
            for k, total in (ws.resources or {}).items()
        }
        for addr, ws in dask_scheduler.workers.items()
    }


def _connect_timeout() -> float:
    from .. import config

    try:
        return config.timedelta("connect-timeout")
    except Exception:  # an old or broken config must not break a Process
        return 10.0


def _scheduler_address(client: Any) -> str:
    try:
        return client.scheduler.address or "?"
    except Exception:
        return str(getattr(client, "_start_arg", None) or "?")


def _lost_scheduler(client: Any, timeout: float) -> str:
    return (
        f"the Dask scheduler at {_scheduler_address(client)} is unreachable: this "
        f"process lost its connection to it and did not get it back within "
        f"fiber.connect-timeout={timeout:g}s (client status {client.status!r}). "
        "Start the scheduler again (or attach to a running one) and retry."
    )


def _require_scheduler(client: Any) -> None:
    """Raise :class:`~fiber_dask.errors.ClusterConnectionError` unless
    ``client`` is connected to its scheduler, or reconnects within
    ``fiber.connect-timeout``: a Process started after its scheduler was lost
    fails at once, saying so, instead of ending with an unexplained
    ``exitcode == -9`` when Dask gives the task up."""
    status = getattr(client, "status", "running")
    if status == "running":
        return
    timeout = _connect_timeout()
    if cluster.wait_reconnected(client, timeout) == "running":
        return
    from ..errors import ClusterConnectionError

    raise ClusterConnectionError(
        "cannot start a fiber-dask Process: " + _lost_scheduler(client, timeout)
    )


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
