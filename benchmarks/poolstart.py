#!/usr/bin/env python
"""Pool start-up, phase by phase: from ``Pool(N)`` until every slot runs a task.

The issue-15 setup (8 Dask worker processes x N/8 threads, thread slots by
default) with one ``Pool(N).map`` of N tasks of ``--task-seconds`` each,
chunksize 1, submitted right after ``Pool()`` returns, as a user's first map
is.  Every phase is stamped with the wall clock (one machine: the processes
share it) by wrapping the functions that mark it, in the owner and, through
``client.run``, in every worker:

* ``submitted``: ``Pool()`` returned (slot claim + the loops' ``client.map``);
* ``started``: the loop's Dask task began (``poolworker.serve_slot``);
* ``dialling``: a process's first loop dials the owner (the process's link,
  :mod:`fiber_dask.engine.poollink`: one per worker process with thread slots);
* ``connected``: that handshake finished (worker side);
* ``accepted``: the owner's pool took the link (``PoolEngine._on_connect``);
* ``attached``: the owner took in a loop on its link (``PoolEngine._on_attach``);
* ``running``: the slot's first task began (stamped by the task itself).

``dialling``, ``connected`` and ``accepted`` count links, the others loops.
The worker-side phases (``started``, ``dialling``, ``connected``) are stamped
for thread slots only: process slots connect from processes forked by each
worker's template, which the wrappers do not reach.  For each phase: the time
after ``Pool()`` at which 50 % / 100 % of the slots had passed it.  Also the gate's counters (handshakes cut, timed out) and,
with ``--idle``, the CPU an idle connected pool costs (owner + workers).

Run from the repository root::

    python benchmarks/poolstart.py --slots 256 --repeats 3
    python benchmarks/poolstart.py --slots 1024 --idle 20
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PHASES = (
    "submitted",
    "started",
    "dialling",
    "connected",
    "accepted",
    "attached",
    "running",
)

#: (phase, loop number or dialling thread, wall time)
_stamps: list[tuple[str, int, float]] = []


def slot_task(seconds: float) -> tuple[float, int, int]:
    """A task that stamps when it started, in which process and thread."""
    t = time.time()
    time.sleep(seconds)
    return t, os.getpid(), threading.get_ident()


def _install() -> int:
    """In a worker: wrap the functions that mark the loop's phases."""
    from fiber_dask.comm import channel
    from fiber_dask.engine import poolworker, slottask

    if getattr(poolworker, "_probe_installed", False):
        _stamps.clear()
        return os.getpid()
    poolworker._probe_installed = True
    serve_slot, connect = poolworker.serve_slot, channel.connect

    def stamped_serve_slot(address, authkey, service, slot, *args, **kw):
        _stamps.append(("started", slot, time.time()))
        return serve_slot(address, authkey, service, slot, *args, **kw)

    def stamped_connect(address, authkey, service, hello=None, timeout=None):
        me = threading.get_ident()
        _stamps.append(("dialling", me, time.time()))
        conn = channel.connect.__wrapped__(address, authkey, service, hello, timeout)
        _stamps.append(("connected", me, time.time()))
        return conn

    stamped_connect.__wrapped__ = connect
    poolworker.serve_slot = stamped_serve_slot
    slottask.serve_slot = stamped_serve_slot  # the name the Dask task calls
    channel.connect = stamped_connect
    return os.getpid()


def _collect() -> list:
    return list(_stamps)


def _sample(sched, stop: threading.Event, timeline: list, t0: float) -> None:
    """Every 0.25 s: the scheduler's pool-loop tasks, counted by state."""
    while not stop.wait(0.25):
        counts: dict[str, int] = {}
        try:
            for k, ts in list(sched.tasks.items()):
                if str(k).startswith("fiber-pool"):
                    counts[ts.state] = counts.get(ts.state, 0) + 1
        except RuntimeError:  # the dict changed size: sample again
            continue
        timeline.append((time.time() - t0, counts))


def _pairs(per_worker: dict) -> list:
    """(dialling, connected) stamp pairs of the same dial, per worker."""
    out = []
    for v in per_worker.values():
        dial = {}
        for st in v:
            if st[0] == "dialling":
                dial[st[1]] = st
            elif st[0] == "connected" and st[1] in dial:
                out.append((dial.pop(st[1]), st))
    return out


def _cpu_of(pids: list[int]) -> float:
    import psutil

    total = 0.0
    for pid in pids:
        try:
            t = psutil.Process(pid).cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--slots", type=int, default=256)
    p.add_argument("--processes", type=int, default=8)
    p.add_argument("--slot-kind", choices=("thread", "process"), default="thread")
    p.add_argument(
        "--task-seconds",
        type=float,
        default=None,
        help="each task's sleep (default: long enough for one task per slot)",
    )
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument(
        "--idle",
        type=float,
        default=0.0,
        help="also measure an idle connected pool's CPU for this many seconds",
    )
    p.add_argument(
        "--timeline",
        action="store_true",
        help="sample the scheduler's loop-task states every 0.25 s",
    )
    p.add_argument(
        "--no-profile",
        action="store_true",
        help="distributed.worker.profile.enabled: False",
    )
    a = p.parse_args(argv)

    import dask

    threads = -(-a.slots // a.processes)
    dask.config.set(
        {
            "fiber.local.n-workers": a.processes,
            "fiber.local.threads-per-worker": threads,
            "fiber.pool.slots": a.slot_kind,
        }
    )
    if a.no_profile:
        dask.config.set({"distributed.worker.profile.enabled": False})
    import fiber_dask
    from fiber_dask import cluster
    from fiber_dask.comm import gate
    from fiber_dask.engine import poolengine

    os.environ["PYTHONPATH"] = os.pathsep.join(
        x for x in (os.getcwd(), os.environ.get("PYTHONPATH")) if x
    )
    fiber_dask.init()
    client = cluster.get_handle().client
    client.wait_for_workers(a.processes)
    print(f"uptime: {os.popen('uptime').read().strip()}", flush=True)
    # Workers must import this module by name: it is benchmarks.poolstart.
    from benchmarks import poolstart as me

    worker_pids = list(client.run(me._install).values())

    owner: list[tuple[str, int, float]] = []
    on_connect = poolengine.PoolEngine._on_connect

    on_attach = poolengine.PoolEngine._on_attach

    def stamped_on_connect(self, conn, hello):
        owner.append(("accepted", -1, time.time()))
        return on_connect(self, conn, hello)

    def stamped_on_attach(self, link, n, hello):
        owner.append(("attached", n, time.time()))
        return on_attach(self, link, n, hello)

    poolengine.PoolEngine._on_connect = stamped_on_connect
    poolengine.PoolEngine._on_attach = stamped_on_attach
    g = gate.get_gate()

    for r in range(a.repeats):
        client.run(me._install)  # clears the stamps
        owner.clear()
        before = dict(g.stats)
        seconds = a.task_seconds or max(3.0, a.slots / 40)
        sched = getattr(cluster.get_handle().cluster, "scheduler", None)
        timeline: list[tuple[float, dict]] = []
        sampling = threading.Event()

        t0 = time.time()
        if sched is not None and a.timeline:
            threading.Thread(
                target=_sample, args=(sched, sampling, timeline, t0), daemon=True
            ).start()
        pool = fiber_dask.Pool(a.slots)
        t_sub = time.time()
        res = pool.map_async(me.slot_task, [seconds] * a.slots, chunksize=1)
        out = res.get(timeout=600)
        sampling.set()
        last = None
        for t, c in timeline:
            if c != last:
                print(f"  scheduler at {t:6.2f} s: {c}")
            last = c
        per_worker = client.run(me._collect)
        stamps = [s for v in per_worker.values() for s in v] + owner
        firsts = sorted(
            min((t - t0 for ph, _, t in v if ph == "started"), default=float("nan"))
            for v in per_worker.values()
        )
        print(
            "  first loop started per worker: " + " ".join(f"{x:.2f}" for x in firsts)
        )
        first_run: dict[tuple[int, int], float] = {}
        for t, pid, tid in out:
            first_run[(pid, tid)] = min(t, first_run.get((pid, tid), t))
        by_phase: dict[str, list[float]] = {ph: [] for ph in PHASES}
        by_phase["submitted"] = [t_sub - t0]
        for ph, _slot, t in stamps:
            by_phase[ph].append(t - t0)
        by_phase["running"] = [t - t0 for t in first_run.values()]
        after = dict(g.stats)
        diff = {k: after.get(k, 0) - before.get(k, 0) for k in after}
        print(
            f"[{r + 1}/{a.repeats}] Pool({a.slots}) {a.slot_kind} slots, "
            f"{a.processes} processes x {threads} threads; "
            f"{os.popen('uptime').read().strip()}"
        )
        hs = sorted(c - d for (ph1, s1, d), (ph2, s2, c) in _pairs(per_worker))
        if hs:
            print(
                f"  handshake (dialling -> connected) median {hs[len(hs) // 2]:.3f} s, "
                f"p90 {hs[int(len(hs) * 0.9)]:.3f} s, max {hs[-1]:.3f} s"
            )
        for ph in PHASES:
            ts = sorted(by_phase[ph])
            if not ts:
                print(f"  {ph:<10} -")
                continue
            half = ts[len(ts) // 2]
            print(
                f"  {ph:<10} n={len(ts):5d}  first {ts[0]:6.2f}  50% {half:6.2f}  "
                f"all {ts[-1]:6.2f} s"
            )
        print(f"  distinct slots that ran a task: {len(first_run)}; gate {diff}")
        if a.idle and r == a.repeats - 1:
            pids = [os.getpid(), *worker_pids]
            c0, w0 = _cpu_of(pids), time.monotonic()
            time.sleep(a.idle)
            c1, w1 = _cpu_of(pids), time.monotonic()
            pool_cpu = (c1 - c0) / (w1 - w0)
            pool.terminate()
            pool.join()
            time.sleep(2)
            c0, w0 = _cpu_of(pids), time.monotonic()
            time.sleep(a.idle)
            c1, w1 = _cpu_of(pids), time.monotonic()
            base = (c1 - c0) / (w1 - w0)
            print(
                f"  idle CPU over {a.idle:g} s (owner + workers, cores): with the "
                f"connected pool {pool_cpu:.3f}, cluster alone {base:.3f}"
            )
        else:
            pool.terminate()
            pool.join()
    fiber_dask.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
