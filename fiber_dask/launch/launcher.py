"""The worker side of a fiber-dask ``Process``: the launcher.

A ``Process``'s parent (:mod:`fiber_dask.launch.popen`) submits
:func:`run_launcher` as one Dask task; it runs in a Dask worker process,
connects back to the parent over the authenticated channel, starts the child
(``python -c`` :data:`fiber_dask.launch.processchild.BOOT`) and relays for it,
in the messages of :mod:`fiber_dask.launch.launchprotocol`::

    Dask worker process                                 worker host
    ───────────────────                                 ───────────
    run_launcher ── connect, HMAC, Hello ──► parent's channel
      ◄── Payload(blob) ────────────
      Popen(python -c processchild.BOOT) ─────────────► child: reads the
      ── Started(pid) ──────────────►                     payload on stdin,
      ── Output(fd, bytes) ─────────► ◄── pumps ───────── runs
      ◄── Signal(signum) ─────────── os.kill(child)       BaseProcess._bootstrap
                                     (SIGINT: once it takes it)
      ── Exit(returncode) ──────────► child.wait()
      connection drops ─── PARENT_LOST on stdin ─────────► parent_process() dead;
                           kill after ORPHAN_GRACE s        it may end by itself

It returns a :class:`~fiber_dask.launch.launchprotocol.LaunchResult` saying
how it ended; the parent reads it only when no launcher ever connected (to
say why in ``Process.reason``).  The launcher secedes from the worker's thread
pool once the child runs, so a running Process does not hold a task slot.
Mirrors :mod:`fiber_dask.engine.poolworker`, the worker side of a Pool.
"""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import threading
import time
from typing import Any

from ..comm import channel
from . import launchprotocol as proto
from .launchprotocol import LaunchResult, Outcome
from .processchild import BOOT, PARENT_LOST

__all__ = [
    "run_launcher",
    "launch_beside_tasks",
    "child_env",
]

_PIPE_DRAIN = 5.0  # seconds the launcher waits for the child's output after it exits
_INTERRUPT_WAIT = 10.0  # seconds an interrupt waits for a starting child to take it
# Seconds a child whose parent died gets to notice (its parent_process() is
# dead at once) and end by itself before the launcher kills it.
ORPHAN_GRACE = 5.0


def run_launcher(
    address: tuple[str, int],
    authkey: bytes,
    service: str,
    worker: Any = None,
    *,
    task: bool = True,
) -> LaunchResult:
    """Body of a Process's Dask task: start the child and relay for it.

    ``task`` False: run by :func:`launch_beside_tasks` (the parent then
    cancels the queued task, which this launcher replaces).  Returns how it
    ended (see :class:`Outcome`); for ``UNREACHABLE`` the error, which the
    parent puts in :attr:`fiber_dask.Process.reason`.
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
            hello=proto.Hello(os.getpid(), worker_address, task).to_wire(),
        )
    except channel.Unreachable as e:  # the parent's address, from this host
        return LaunchResult(Outcome.UNREACHABLE, str(e))
    except channel.ChannelError:
        return LaunchResult(Outcome.REFUSED)
    except OSError as e:
        return LaunchResult(Outcome.UNREACHABLE, str(e))
    try:
        try:
            msg = proto.decode(conn.recv_bytes())
        except (EOFError, OSError):
            return LaunchResult(Outcome.REFUSED)
        if type(msg) is not proto.Payload:
            raise proto.ProtocolError(
                f"fiber-dask launch protocol: the parent's first message is a "
                f"{type(msg).__name__}, not the Payload"
            )
        _secede()
        return _launch(conn, msg.blob, worker_address, scheduler_address, security)
    finally:
        channel.hangup(conn)


def launch_beside_tasks(address, authkey, service, dask_worker=None) -> None:
    """Run a launcher in a thread of this worker process, outside its task
    slots (``client.run`` calls this on the worker's event loop: return at once)."""
    threading.Thread(
        target=run_launcher,
        args=(address, authkey, service, dask_worker),
        kwargs={"task": False},
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


def child_env(
    worker_address: str | None,
    scheduler_address: str | None,
    security: Any = None,
    worker_name: Any = None,
) -> dict:
    """The environment of a process a Dask task starts beside its worker (a
    Process child, a pool slot process): the worker's import path, the same
    scheduler for nested objects, the worker's TLS settings, and which worker
    hosts it (``FIBER_DASK_WORKER_ADDRESS``, ``FIBER_DASK_WORKER_NAME``: such a
    process has no ``distributed.get_worker()`` of its own)."""
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
        env["FIBER_DASK_WORKER_ADDRESS"] = worker_address
    if worker_name is not None:
        env["FIBER_DASK_WORKER_NAME"] = str(worker_name)
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


def _orphaned(child: subprocess.Popen, reaped: threading.Event) -> None:
    """The parent's connection dropped (the process that called ``start()``
    died, or its host became unreachable): tell the child, whose
    ``parent_process()`` turns dead at once, and kill it if it has not ended
    within :data:`ORPHAN_GRACE` seconds (the parent is gone: so is its
    child; the stdlib would leave it running as an orphan)."""
    try:
        child.stdin.write(PARENT_LOST)
        child.stdin.flush()
    except (OSError, ValueError):
        pass  # it died already
    if not reaped.wait(ORPHAN_GRACE):
        try:
            child.kill()
        except OSError:
            pass


def _ignores_sigint(pid: int) -> bool:
    """Whether process ``pid`` ignores SIGINT now (Linux: its ``SigIgn``
    mask; elsewhere, or if it cannot be read, False)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("SigIgn:"):
                    return bool(int(line.split()[1], 16) >> (signal.SIGINT - 1) & 1)
    except (OSError, ValueError):
        pass
    return False


def _interrupt(child: subprocess.Popen, reaped: threading.Event) -> None:
    """``Process.interrupt()``: SIGINT to the child, once it can take it.

    The child starts with its worker's disposition, SIGINT ignored (on the
    embedded cluster), until the first statement of its bootstrap holds what
    arrives (:data:`~fiber_dask.launch.processchild.BOOT`): a SIGINT sent
    before that would be lost, so it waits (polling, at most
    ``_INTERRUPT_WAIT`` s: a target may ignore SIGINT itself).
    """
    deadline = time.monotonic() + _INTERRUPT_WAIT
    while _ignores_sigint(child.pid) and time.monotonic() < deadline:
        if reaped.wait(0.01):
            return
    try:
        child.send_signal(signal.SIGINT)  # no-op once the child is reaped
    except OSError:
        pass


def _launch(
    conn: Any, payload: bytes, worker_address, scheduler_address, security=None
) -> LaunchResult:
    send_lock = threading.Lock()

    def send(msg: Any) -> bool:
        with send_lock:
            try:
                conn.send_bytes(proto.encode(msg))
                return True
            except OSError:
                return False

    env = child_env(worker_address, scheduler_address, security)
    from ..transparency import resourcetracker

    tracker_fds = resourcetracker.for_child(env)  # the worker's, as spawn shares it
    try:
        child = subprocess.Popen(
            [sys.executable, "-c", BOOT],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            close_fds=True,
            pass_fds=tracker_fds,
        )
    except OSError as e:
        why = f"cannot start the child process on {worker_address}: {e}"
        send(proto.StartFailed(why))
        return LaunchResult(Outcome.FAILED, why)
    send(proto.Started(child.pid))
    try:
        child.stdin.write(struct.pack("!Q", len(payload)) + payload)
        child.stdin.flush()
    except OSError:
        pass  # the child died already; its exit status tells why
    del payload

    state = {"exited": False, "parent_lost": False}
    reaped = threading.Event()  # child.wait() returned

    def pump(stream: Any, child_fd: int) -> None:
        fd = stream.fileno()
        while True:
            try:
                data = os.read(fd, 65536)
            except OSError:
                return
            if not data:
                return
            send(proto.Output(child_fd, data))

    def control() -> None:
        while True:
            try:
                msg = proto.decode(conn.recv_bytes())
            except (EOFError, OSError, ValueError):  # ProtocolError is one
                if not state["exited"]:
                    state["parent_lost"] = True
                    _orphaned(child, reaped)
                return
            if type(msg) is proto.Signal and msg.signum == signal.SIGINT:
                threading.Thread(
                    target=_interrupt,
                    args=(child, reaped),
                    name="fiber-process-interrupt",
                    daemon=True,
                ).start()
            elif type(msg) is proto.Signal:
                try:
                    child.send_signal(msg.signum)  # no-op once the child is reaped
                except OSError:
                    pass

    pumps = [
        threading.Thread(target=pump, args=(child.stdout, 1), daemon=True),
        threading.Thread(target=pump, args=(child.stderr, 2), daemon=True),
    ]
    for t in pumps:
        t.start()
    threading.Thread(target=control, name="fiber-process-control", daemon=True).start()
    returncode = child.wait()
    reaped.set()
    for t in pumps:  # a grandchild may hold the pipes open: do not wait forever
        t.join(_PIPE_DRAIN)
    state["exited"] = True
    send(proto.Exit(returncode))
    for f in (child.stdin, child.stdout, child.stderr):
        try:
            f.close()
        except OSError:
            pass
    return LaunchResult(Outcome.PARENT_LOST if state["parent_lost"] else Outcome.EXITED)
