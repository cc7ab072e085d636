"""``fiber-dask up`` / ``fiber-dask down``: a local cluster that outlives programs.

The server process and the state file are :mod:`fiber_dask.backends.upcluster`'s;
these commands start it detached, wait until it serves, and stop it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import TYPE_CHECKING

import click

from ._common import CONTEXT_SETTINGS, CLIError, apply_config, config_option

if TYPE_CHECKING:
    from ..backends.upcluster import State

# How long `down` waits for the cluster to close before it kills what is left.
STOP_TIMEOUT = 30.0


@click.command("up", context_settings=CONTEXT_SETTINGS)
@config_option
@click.option(
    "--n-workers",
    type=click.IntRange(min=1),
    default=None,
    help="Worker processes (default: fiber.local.n-workers, else one per CPU).",
)
def up(config_files: tuple[str, ...], n_workers: int | None) -> None:
    """Start a local cluster that programs use until `fiber-dask down`.

    Programs of this user on this machine that would otherwise start an embedded
    cluster attach to this one instead (fiber.up.use), so a short script does not
    pay a cluster's start-up on every run.  The cluster has the fiber.local
    settings and listens on 127.0.0.1 only.  Its workers are long-lived: a module
    your functions import is imported once per worker; restart the cluster
    (`fiber-dask down && fiber-dask up`) after changing one.
    """
    import dask.config

    from ..backends import upcluster

    loaded = apply_config(config_files)
    path = upcluster.state_path()
    state = upcluster.read_state(path)
    if state is not None:
        click.echo(f"already up: {_describe(state)}")
        return
    local = loaded.fiber["local"]
    workers = n_workers or local["n-workers"] or os.cpu_count() or 1
    settings = {
        "n_workers": workers,
        "threads": local["threads-per-worker"],
        "memory_limit": local["memory-limit"],
        "dashboard_address": local["dashboard-address"],
    }
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    log_path = os.path.join(os.path.dirname(path), "up.log")
    env = dict(os.environ)
    # The server and its workers get this command's whole Dask config (the
    # --config files too), as distributed passes config to the processes it starts.
    env["DASK_INTERNAL_INHERIT_CONFIG"] = dask.config.serialize(dask.config.config)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", upcluster.SERVER_MODULE, path, json.dumps(settings)],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # outlives this command and its terminal
        )
    from .. import config

    deadline = time.monotonic() + config.timedelta("connect-timeout") + 60
    while time.monotonic() < deadline:
        state = upcluster.read_state(path)
        if state is not None and state.pid == proc.pid:
            click.echo(f"up: {_describe(state)}")
            click.echo("stop it with: fiber-dask down")
            return
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    else:
        _stop(proc.pid)
    with open(log_path) as f:
        tail = "".join(f.readlines()[-15:])
    raise CLIError(f"the cluster did not start (log: {log_path}):\n{tail}")


@click.command("down", context_settings=CONTEXT_SETTINGS)
def down() -> None:
    """Stop the cluster of `fiber-dask up`.

    Programs still using it lose their cluster.  Without a running cluster this
    says so and exits with status 0 (a stale state file is removed).
    """
    from ..backends import upcluster

    path = upcluster.state_path()
    state = upcluster.read_state(path)
    if state is None:
        if os.path.exists(path):
            os.unlink(path)
            click.echo(f"not up (removed the stale {path})")
        else:
            click.echo("not up")
        return
    if not _stop(state.pid):
        raise CLIError(
            f"the cluster (pid {state.pid}) did not stop within {STOP_TIMEOUT:g}s; "
            "its processes were killed"
        )
    click.echo(f"down: stopped the cluster at {state.address} (pid {state.pid})")


def _stop(pid: int) -> bool:
    """SIGTERM the server, wait for it; kill its process group if it hangs.

    Returns whether it stopped by itself.
    """
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return True
    deadline = time.monotonic() + STOP_TIMEOUT
    while time.monotonic() < deadline:
        try:
            os.waitpid(pid, os.WNOHANG)  # reap it if it is our own child
        except ChildProcessError:
            pass
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    try:
        os.killpg(pid, signal.SIGKILL)  # the server leads its own session
    except ProcessLookupError:
        pass
    return False


def _describe(state: State) -> str:
    dashboard = f", dashboard {state.dashboard}" if state.dashboard else ""
    return (
        f"{state.workers} workers, {state.threads} task slots at {state.address}"
        f"{dashboard} (pid {state.pid})"
    )
