#!/usr/bin/env python
"""Where CPU-bound pool work loses time: GIL sharing, the framework's processes, the tail.

Runs the same map of CPU-bound tasks (``benchmarks.common.cpu_work``: a fixed number
of pure-Python loop turns, ``--task-ms`` on one quiet core) on ``multiprocessing``
(fork), ``fiber_dask`` (slot processes) and ``fiber_dask_thread`` (tasks in the Dask
worker's thread), one engine alive at a time, the order rotating per repeat, and
reports per engine, as medians over ``--repeats``:

``elapsed/ideal``   wall time of the map / (tasks x task CPU time / workers);
``wall/cpu``        inside each task, wall / thread-CPU seconds (1.00 = the task had a
                    core to itself; > 1 when anything else ran on it: other load on the
                    machine, the framework's processes, or another thread of the task's
                    process holding the GIL);
``gil share``       CPU seconds used by the *other threads of the task's process* while
                    the task ran, per task CPU second (the Dask worker's event loop,
                    heartbeats and profiler in thread mode; a receiver thread in a slot
                    process or stdlib worker).  Independent of other load;
``framework cores`` CPU seconds used by every process of the engine (this one included:
                    the embedded scheduler, nannies, client and result threads) during
                    the map beyond the tasks' own CPU, per wall second, then the same
                    per role (driver, Dask worker processes, slot templates, slot
                    processes and stdlib pool workers beyond their tasks).

Run from the repository root::

    python benchmarks/cpushare.py --repeats 5
"""

from __future__ import annotations

import argparse
import os
import sys
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import psutil  # noqa: E402

from benchmarks.common import (  # noqa: E402
    calibrate_cpu_work,
    cpu_work,
    cpu_work_shares,
    median,
)
from benchmarks.engines import make_engine  # noqa: E402

ENGINES = ("multiprocessing", "fiber_dask", "fiber_dask_thread")


def pid_after(loops: int) -> int:
    cpu_work(loops)
    return os.getpid()


def _role(p: psutil.Process, me: int) -> str:
    """What a process of the tree is, from where it sits (forked processes
    carry their parent's command line, so that alone cannot tell)."""
    if p.pid == me:
        return "driver"
    try:
        cmd = " ".join(p.cmdline())
        parent = p.parent()
    except psutil.Error:
        return "other"
    if parent is None:
        return "other"
    if parent.pid == me:
        if "spawn_main" in cmd:
            return "dask worker"  # spawned by a nanny
        if "workerstart import serve" in cmd:
            return "worker server"  # fiber_dask.backends.workerstart
        if "resource_tracker" in cmd:
            return "other"
        return "pool worker"  # the stdlib's forked workers
    up = _role(parent, me)
    return {
        "worker server": "dask worker",
        "dask worker": "template",
        "template": "slot",
    }.get(up, "other")


def tree_cpu() -> dict[str, float]:
    """CPU seconds used so far by this process and its descendants, by role."""
    me = psutil.Process()
    out: dict[str, float] = {}
    for p in [me, *me.children(recursive=True)]:
        try:
            t = p.cpu_times()
        except psutil.NoSuchProcess:
            continue
        role = _role(p, me.pid)
        out[role] = out.get(role, 0.0) + t.user + t.system
    return out


def warm_up(eng, loops: int, workers: int) -> None:
    """Until every slot has served a task, then a second for startup work (a
    template's imports, a worker's first heartbeats) to end."""
    seen: set = set()
    deadline = time.monotonic() + 120
    while len(seen) < workers and time.monotonic() < deadline:
        seen.update(eng.map(pid_after, [loops] * 4 * workers))
    time.sleep(1.0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--tasks", type=int, default=100)
    p.add_argument("--task-ms", type=float, default=10.0)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--engines", default=",".join(ENGINES))
    a = p.parse_args(argv)
    loops = calibrate_cpu_work(a.task_ms / 1e3)
    names = a.engines.split(",")
    print(f"load before: {os.getloadavg()}", flush=True)
    stats: dict[str, dict[str, list[float]]] = {n: {} for n in names}
    # One engine alive at a time (started and stopped in every repeat), so that
    # the CPU counted for an engine is its own; the order rotates per repeat.
    for r in range(a.repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            eng = make_engine(name, a.workers, "fork")
            eng.prepare()
            eng.setup()
            try:
                warm_up(eng, loops, a.workers)
                c0, t0 = tree_cpu(), time.perf_counter()
                out = eng.map(cpu_work_shares, [loops] * a.tasks)
                wall = time.perf_counter() - t0
                c1 = tree_cpu()
            finally:
                eng.teardown()
            used = {k: c1.get(k, 0.0) - c0.get(k, 0.0) for k in c1}
            task_cpu = sum(c for _, c, _ in out)
            s = stats[name]
            s.setdefault("elapsed/ideal", []).append(wall / (task_cpu / a.workers))
            s.setdefault("wall/cpu", []).append(sum(w for w, _, _ in out) / task_cpu)
            s.setdefault("gil share", []).append(sum(o for *_, o in out) / task_cpu)
            s.setdefault("framework cores", []).append(
                (sum(used.values()) - task_cpu) / wall
            )
            # Where the framework's CPU went, in cores (the tasks' own CPU is
            # taken off the role that ran them).
            task_role = {"multiprocessing": "pool worker", "fiber_dask": "slot"}.get(
                name, "dask worker"
            )
            used[task_role] = used.get(task_role, 0.0) - task_cpu
            for role in ("driver", "dask worker", "template", "slot", "pool worker"):
                s.setdefault(f"{role} cores", []).append(used.get(role, 0.0) / wall)
            print(
                f"[{r + 1}/{a.repeats}] {name:<18} "
                + "  ".join(f"{k} {v[-1]:.3f}" for k, v in s.items()),
                flush=True,
            )
    print(f"load after: {os.getloadavg()}")
    keys = list(next(iter(stats.values())).keys())
    width = max(15, *(len(k) + 2 for k in keys))
    print(
        f"\n{'median of ' + str(a.repeats):<18}"
        + "".join(f"{k:>{width}}" for k in keys)
    )
    for name, s in stats.items():
        print(f"{name:<18}" + "".join(f"{median(s[k]):>{width}.3f}" for k in keys))
    return 0


if __name__ == "__main__":
    sys.exit(main())
