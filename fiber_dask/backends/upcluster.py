"""The long-lived local cluster of ``fiber-dask up`` / ``fiber-dask down``.

A legacy script that the stdlib runs in 0.2 s would otherwise pay the start of an
embedded ``LocalCluster`` (1–7 s) on every run.  ``fiber-dask up`` starts one
cluster in a detached server process and records it in a per-user state file;
the cluster layer's automatic resolution (:func:`fiber_dask.cluster._resolve`, just
before it would start an embedded cluster) calls :func:`running_handle`, so every
program of that user on this machine attaches to it, until ``fiber-dask down``::

    fiber-dask up ──spawn, new session──► python -m fiber_dask.backends.upcluster
        │                                    LocalCluster(host=127.0.0.1)
        │ waits for ◄── state file ───────── {"pid", "address", "dashboard", ...}
        │              ($XDG_RUNTIME_DIR/fiber-dask/up.json,    │
        │               else ~/.cache/fiber-dask/up.json, 0600)  │ SIGTERM
    program ── _resolve ── running_handle() ── reads it ─► Client(address)
    fiber-dask down ── SIGTERM ────────────────────────────────► cluster.close()

* Everything listens on 127.0.0.1 only: the scheduler, the workers and the
  dashboard.
* A state file whose process is gone, or is not this server (a reused pid), is
  ignored, and removed by ``up``/``down``.
* The cluster is attached to, not owned: a program's ``fiber_dask.shutdown()``
  leaves it running and never resizes it.
* Its workers are long-lived: they import the modules a program's functions refer
  to once (from the directory ``up`` ran in, and installed packages) and keep
  them; functions defined in the script itself travel by value, as always.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from dataclasses import dataclass
from typing import Any

__all__ = ["State", "running_handle", "read_state", "state_path", "SERVER_MODULE"]

#: The module the server process runs (``python -m``), also how a state file's
#: pid is recognised as ours.
SERVER_MODULE = "fiber_dask.backends.upcluster"
STATE_NAME = "up.json"


@dataclass
class State:
    """What the state file says about the running cluster."""

    pid: int
    address: str
    dashboard: str | None
    workers: int
    threads: int
    started: float


def state_dir() -> str:
    """The per-user directory of the state file.

    ``fiber.up.state-dir`` if set, else ``$XDG_RUNTIME_DIR/fiber-dask`` (per user,
    cleared at logout), else ``~/.cache/fiber-dask``.
    """
    from .. import config

    configured = config.get("up.state-dir")
    if configured:
        return os.path.expanduser(str(configured))
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        return os.path.join(runtime, "fiber-dask")
    return os.path.join(os.path.expanduser("~"), ".cache", "fiber-dask")


def state_path() -> str:
    """The state file: where ``fiber-dask up`` records its cluster."""
    return os.path.join(state_dir(), STATE_NAME)


def _is_server(pid: int) -> bool:
    """Whether ``pid`` is alive and is an upcluster server (not a reused pid)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return False  # another user's process: not ours
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return SERVER_MODULE.encode() in f.read()
    except OSError:
        return False


def read_state(path: str | None = None) -> State | None:
    """The running cluster's state, or None (no file, unreadable, or stale)."""
    path = path or state_path()
    try:
        with open(path) as f:
            data = json.load(f)
        state = State(**data)
    except (OSError, ValueError, TypeError):
        return None
    return state if _is_server(state.pid) else None


def running_handle() -> Any:
    """A handle on the ``fiber-dask up`` cluster if one runs, else None.

    Called by the cluster layer where it would otherwise start an embedded
    cluster; ``fiber.up.use: false`` turns it off.  A cluster that does not
    answer within ``fiber.connect-timeout`` is an error, not a silent fallback:
    its state file says it runs.
    """
    from .. import config

    if not config.get("up.use"):
        return None
    state = read_state()
    if state is None:
        return None
    from .address import listen_host
    from .base import ClusterHandle, connect

    client = connect(
        state.address,
        lambda timeout, e: (
            f"the cluster of `fiber-dask up` (pid {state.pid}, {state_path()}) does "
            f"not answer at {state.address} within fiber.connect-timeout="
            f"{timeout:g}s: {e}. Restart it with `fiber-dask down && fiber-dask "
            "up`, or set fiber.up.use: false to start an embedded cluster instead."
        ),
    )
    return ClusterHandle(
        client,
        None,
        owned=False,
        backend="up",
        listen_host=listen_host(state.address),  # 127.0.0.1 unless configured
    )


def _write_state(path: str, state: State) -> None:
    """Write the state file atomically, readable by this user only."""
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(state.__dict__, f)
    os.replace(tmp, path)


def _remove_state(path: str, pid: int) -> None:
    """Remove the state file if it still names ``pid``."""
    try:
        with open(path) as f:
            if json.load(f).get("pid") != pid:
                return
        os.unlink(path)
    except (OSError, ValueError):
        pass


def loopback(address: str | None) -> str | None:
    """A dashboard address on 127.0.0.1: ":8787" would listen on every interface."""
    if address is None:
        return None
    address = str(address)
    if address.startswith(":"):
        return "127.0.0.1" + address
    return address


def serve(path: str, settings: dict[str, Any]) -> None:
    """Run the cluster until SIGTERM or SIGINT (the server process's main)."""
    import threading

    from distributed import LocalCluster

    from .base import scheduler_preloads

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    # The terminal `up` ran in may close; the cluster stays.
    signal.signal(signal.SIGHUP, signal.SIG_IGN)

    cluster = LocalCluster(
        n_workers=settings["n_workers"],
        threads_per_worker=settings["threads"],
        processes=True,
        memory_limit=settings["memory_limit"],
        dashboard_address=loopback(settings["dashboard_address"]),
        host="127.0.0.1",
        scheduler_port=0,
        # The pools of the programs using it, on its dashboard and in `info`.
        scheduler_kwargs={"preload": scheduler_preloads()},
    )
    try:
        try:
            dashboard = cluster.dashboard_link
        except Exception:  # noqa: BLE001 - no dashboard (bokeh missing or disabled)
            dashboard = None
        if settings["dashboard_address"] is None:
            dashboard = None
        _write_state(
            path,
            State(
                pid=os.getpid(),
                address=cluster.scheduler_address,
                dashboard=dashboard,
                workers=settings["n_workers"],
                threads=settings["n_workers"] * settings["threads"],
                started=time.time(),
            ),
        )
        print(f"serving {cluster.scheduler_address}", flush=True)
        while not stop.wait(1.0):
            pass
    finally:
        _remove_state(path, os.getpid())
        cluster.close(timeout=30)


if __name__ == "__main__":
    serve(sys.argv[1], json.loads(sys.argv[2]))
