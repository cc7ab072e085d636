"""``fiber-dask info``: which cluster the configuration gives, and what is in it."""

from __future__ import annotations

import json
import platform
from typing import Any

import click

from ._common import (
    CONTEXT_SETTINGS,
    CLIError,
    apply_config,
    cluster_options,
    config_option,
)


@click.command("info", context_settings=CONTEXT_SETTINGS)
@config_option
@cluster_options
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
@click.option(
    "--keep",
    is_flag=True,
    help="Keep a cluster started for this command (and its dashboard) running "
    "until Ctrl-C, instead of closing it at once.",
)
def info(
    config_files: tuple[str, ...],
    backend: str | None,
    address: str | None,
    as_json: bool,
    keep: bool,
) -> None:
    """Connect as a program would and describe the cluster.

    Prints the backend, the scheduler address, the workers with their threads and
    memory, the batch jobs (SLURM, PBS, SGE, LSF, HTCondor: id and state), the
    live pools of the programs using the cluster (done, in flight, queued,
    failed, re-runs, items per second, each slot's busy fraction: what the
    dashboard's fiber-pools page shows), the held locks (Lock, RLock,
    Semaphore, Condition: which process holds each, on which host, for how
    long) and the dashboard link.  A cluster that fiber-dask starts for this
    (the embedded one, a new Kubernetes cluster, batch jobs) is closed again
    afterwards (its jobs
    cancelled), so its dashboard link is dead once this returns: --keep keeps it
    until Ctrl-C, and `fiber-dask up` starts a local cluster that stays.  One it
    attaches to keeps running.
    """
    loaded = apply_config(config_files, backend=backend, address=address)

    import fiber_dask
    from fiber_dask import cluster
    from fiber_dask.errors import ClusterConnectionError, ConfigError

    try:
        handle = cluster.get_handle()
    except ClusterConnectionError as e:
        raise CLIError(str(e)) from None
    except (ConfigError, OSError) as e:
        raise CLIError(f"cannot start or reach the cluster: {e}") from None
    except TimeoutError as e:
        raise CLIError(f"timed out starting or reaching the cluster: {e}") from None
    try:
        data = _describe(handle, loaded.fiber)
        data["kept"] = bool(keep and data["owned"])
        if as_json:
            click.echo(json.dumps(data, indent=2))
        else:
            _print(data)
        if data["kept"]:
            _wait_for_interrupt()
    finally:
        fiber_dask.shutdown()


def _wait_for_interrupt() -> None:
    """Say so, then block until SIGINT or SIGTERM."""
    import signal
    import threading

    stop = threading.Event()
    # Handlers first: a Ctrl-C right after the message must not abort the close.
    previous = {
        sig: signal.signal(sig, lambda *_: stop.set())
        for sig in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        click.echo("keeping the cluster until Ctrl-C (or SIGTERM) ...")
        while not stop.wait(0.5):
            pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _describe(handle: Any, fiber: dict[str, Any]) -> dict[str, Any]:
    from urllib.parse import urlsplit

    import dask
    import distributed
    from dask.utils import parse_timedelta

    import fiber_dask

    client = handle.client
    adaptive = fiber.get("adaptive", {})
    if handle.owned and handle.cluster is not None and not adaptive.get("enabled"):
        # A cluster we just started: let its workers finish registering.
        expected = len(getattr(handle.cluster, "worker_spec", {}) or {})
        if expected:
            timeout = parse_timedelta(fiber.get("connect-timeout"), default="seconds")
            try:
                client.wait_for_workers(expected, timeout=timeout)
            except (TimeoutError, OSError):
                pass  # report what is there
    sched = client.scheduler_info(n_workers=-1)
    workers = sched.get("workers", {})
    try:
        dashboard = client.dashboard_link if sched.get("services") else None
    except Exception:  # noqa: BLE001 - no dashboard is not an error here
        dashboard = None
    # Batch-job clusters list their jobs with the batch system's state.
    jobs = handle.jobs() if handle.jobs is not None else None
    try:
        import bokeh  # noqa: F401

        has_bokeh = True
    except ImportError:
        has_bokeh = False
    pool_document = _pool_document(client)
    pools = None if pool_document is None else pool_document["pools"]
    # None: the scheduler's plugin takes no lock reports (none, or an older one)
    locks = None if pool_document is None else pool_document.get("locks")
    page = None if pool_document is None else pool_document.get("page")
    return {
        "backend": handle.backend,
        "owned": bool(handle.owned),
        "scheduler": client.scheduler.address,
        "workers": len(workers),
        "threads": sum(int(w.get("nthreads") or 0) for w in workers.values()),
        "memory": sum(int(w.get("memory_limit") or 0) for w in workers.values()),
        "adaptive": (
            {"minimum": adaptive.get("minimum"), "maximum": adaptive.get("maximum")}
            if adaptive.get("enabled")
            else None
        ),
        "jobs": jobs,
        # None: the scheduler has no pool-stats plugin (fiber_dask.dashboard)
        "pools": pools,
        # Held Lock/RLock/Semaphore/Condition objects with their holders
        "locks": locks,
        "pools_page": (
            urlsplit(dashboard)._replace(path=page, query="").geturl()
            if dashboard and page
            else None
        ),
        "dashboard": dashboard,
        "dashboard_needs_bokeh": bool(dashboard) and not has_bokeh,
        "versions": {
            "fiber-dask": fiber_dask.__version__,
            "dask": dask.__version__,
            "distributed": distributed.__version__,
            "python": platform.python_version(),
        },
    }


def _pool_document(client: Any) -> dict[str, Any] | None:
    """The scheduler's pool document, or None without its plugin."""
    from fiber_dask.engine import poolstats

    try:
        return poolstats.fetch(client)
    except (OSError, TimeoutError) as e:
        raise CLIError(f"cannot read the pools from the scheduler: {e}") from None


def _pool_lines(
    pools: list[dict[str, Any]] | None, owned: bool = False
) -> tuple[str, list[str]]:
    """The ``pools:`` row and one indented line per pool."""
    if pools is None:
        return (
            "not reported: the scheduler has no fiber-dask pool-stats plugin "
            "(start it with `--preload fiber_dask.dashboard`; see the README, "
            "Progress and the dashboard)",
            [],
        )
    if not pools:
        if owned:
            # Started for this command: no other program uses it.
            return (
                "none running (on this cluster, started for this command; a "
                "program's pools are on the cluster it uses: `fiber-dask up` "
                "starts one that programs share and this command lists)",
                [],
            )
        return "none running", []
    from fiber_dask.dashboard import summary

    lines = []
    for p in pools:
        slots = ", ".join(f"{s['name']} {s['busy']:.0%}" for s in p["slots"])
        lines.append(f"  {summary(p)} ({slots})")
    return f"{len(pools)} live", lines


def _lock_lines(locks: list[dict[str, Any]] | None) -> tuple[str, list[str]]:
    """The ``locks:`` row and one indented line per held lock."""
    if locks is None:
        return (
            "not reported: the scheduler's fiber-dask plugin takes no lock "
            "reports (none, or an older fiber-dask's)",
            [],
        )
    if not locks:
        return "none held", []
    from fiber_dask.comm.lockstats import describe

    return f"{len(locks)} held", [f"  {describe(lock)}" for lock in locks]


def _print(data: dict[str, Any]) -> None:
    from dask.utils import format_bytes

    if data["owned"]:
        owned = (
            "started for this command, kept until Ctrl-C"
            if data.get("kept")
            else "started for this command, closed again"
        )
    elif data["backend"] == "up":
        owned = "the cluster of `fiber-dask up`; left running"
    else:
        owned = "attached; left running"
    memory = format_bytes(data["memory"]) if data["memory"] else "no limit"
    rows = [
        ("backend", f"{data['backend']} ({owned})"),
        ("scheduler", data["scheduler"]),
        ("workers", str(data["workers"])),
        ("threads", f"{data['threads']} (tasks at once)"),
        ("memory", f"{memory} (sum of worker limits)"),
    ]
    if data["adaptive"]:
        a = data["adaptive"]
        rows.append(("adaptive", f"minimum {a['minimum']}, maximum {a['maximum']}"))
    if data.get("jobs") is not None:
        jobs = data["jobs"]
        listed = ", ".join(
            f"{j['id'] or j['name']} {j['state'] or 'ended'} "
            f"({j['workers']} worker{'s' * (j['workers'] != 1)})"
            for j in jobs
        )
        rows.append(("jobs", f"{len(jobs)}" + (f": {listed}" if jobs else "")))
    pools_row, pool_lines = _pool_lines(data["pools"], data["owned"])
    rows.append(("pools", pools_row))
    locks_row, lock_lines = _lock_lines(data.get("locks"))
    rows.append(("locks", locks_row))
    dashboard = data["dashboard"] or "not served"
    if data["dashboard"] and data["owned"] and not data.get("kept"):
        dashboard += (
            " (closed with the cluster when this command ends: `fiber-dask info "
            "--keep` keeps it open, `fiber-dask up` starts a cluster that stays)"
        )
    if data["dashboard_needs_bokeh"]:
        dashboard += " (install bokeh to see it: pip install 'fiber-dask[diagnostics]')"
    rows.append(("dashboard", dashboard))
    if data.get("pools_page"):
        rows.append(("pools page", data["pools_page"]))
    rows.append(
        ("versions", ", ".join(f"{k} {v}" for k, v in data["versions"].items()))
    )
    width = max(len(k) for k, _ in rows) + 1
    for key, value in rows:
        click.echo(f"{(key + ':').ljust(width)} {value}")
        if key == "pools":
            for line in pool_lines:
                click.echo(line)
        if key == "locks":
            for line in lock_lines:
                click.echo(line)
