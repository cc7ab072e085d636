#!/usr/bin/env python
"""What pool slot processes cost to start: cold template, fork per slot, restarts.

Measured on fiber_dask's embedded cluster (``--workers`` Dask workers), with the
stdlib's ``multiprocessing.Pool`` (fork) alongside where it has an equivalent:

``cluster up``            ``fiber_dask.cluster.get_handle()``: the embedded cluster
                          starts (each worker starts its slot template as it imports
                          this script, which imports fiber_dask at its top);
``first result``          then ``Pool(workers)`` and its first ``apply``: the time to
                          the first result once the cluster is up (``multiprocessing``:
                          ``Pool(workers)`` and its first ``apply``);
``all slots``             until every slot has served a task;
``cold template``         a template process started from scratch in this process
                          (``fiber_dask.engine.slots.Template``) until its first slot process
                          connects: the interpreter plus fiber_dask's imports;
``next slot``             a further slot process of that template, until it connects
                          (the hand-over of the spare the template keeps forked);
``restart per task``      ``Pool(1, maxtasksperchild=1)``: sequential ``apply`` calls,
                          each in a fresh process, minus the same without
                          ``maxtasksperchild`` (the restart's cost per task), with
                          ``benchmarks.common.noop`` (which a fresh slot process must
                          import; a stdlib fork child inherits it) and with a task
                          defined in this script (``__main__``: pickled by value).

The fiber_dask figures are taken for both slot kinds (``fiber.pool.slots``:
``process`` and ``thread``, each on a fresh embedded cluster, the order alternating):
with ``thread`` a restart is a new Dask task in the same worker process.

Medians over ``--repeats``.  Run from the repository root::

    python benchmarks/slotstart.py --repeats 5

``SLOTSTART_IMPORT=late`` imports fiber_dask only inside ``main()``: the
workers' templates then start at their ``dask_setup`` preload, later (what a
script that imports fiber_dask lazily gets).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import threading
import time
import warnings

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import median, noop  # noqa: E402

if os.environ.get("SLOTSTART_IMPORT") != "late":
    # As a user's script does (`import fiber_dask as multiprocessing`): the
    # embedded cluster's workers import it with this module and start their
    # slot templates then (fiber_dask.engine.slots.early_templates).
    import fiber_dask  # noqa: E402, F401


def slow_pid(_=None) -> int:
    time.sleep(0.05)
    return os.getpid()


def main_noop() -> None:
    """A task defined in the script: pickled by value, nothing to import."""


def restart_cost(pool, calls: int, func=noop) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        pool.apply(func)
    return (time.perf_counter() - t0) / calls


def template_costs() -> tuple[float, float]:
    from fiber_dask.comm import channel
    from fiber_dask.engine import slots

    authkey = os.urandom(32)
    server = channel.get_server("127.0.0.1", authkey)
    service = f"slotstart-{os.getpid()}-{time.monotonic_ns()}"
    connected = threading.Semaphore(0)
    conns = []

    def on_connect(conn, hello):
        conns.append(conn)
        connected.release()

    server.register(service, on_connect)
    spec = slots.SlotSpec(
        server.address, authkey, service, 0, None, None, None, dict(os.environ)
    )
    try:
        t0 = time.perf_counter()
        template = slots.Template()
        template.fork(spec)
        connected.acquire()
        cold = time.perf_counter() - t0
        time.sleep(0.2)  # the template forks its next spare after a hand-over
        t1 = time.perf_counter()
        template.fork(spec)
        connected.acquire()
        warm = time.perf_counter() - t1
    finally:
        server.unregister(service)
        for c in conns:
            channel.hangup(c)
        template.close()
        template.thread.join(10)
    return cold, warm


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--restart-calls", type=int, default=50)
    a = p.parse_args(argv)
    import dask

    dask.config.set({"fiber.local.n-workers": a.workers})
    import fiber_dask
    from fiber_dask import cluster

    print(f"load before: {os.getloadavg()}", flush=True)
    rows: dict[str, list[float]] = {}
    mp = multiprocessing.get_context("fork")
    for r in range(a.repeats):
        got: dict[str, float] = {}
        kinds = ("process", "thread") if r % 2 == 0 else ("thread", "process")
        for kind in kinds:
            with dask.config.set({"fiber.pool.slots": kind}):
                t0 = time.perf_counter()
                cluster.get_handle()
                t1 = time.perf_counter()
                pool = fiber_dask.Pool(a.workers)
                pool.apply(noop)
                t2 = time.perf_counter()
                seen: set = set()
                while len(seen) < a.workers:
                    seen.update(pool.map(slow_pid, range(4 * a.workers), chunksize=1))
                t3 = time.perf_counter()
                pool.terminate()
                pool.join()
                with fiber_dask.Pool(1) as plain:
                    plain.apply(noop)
                    base = restart_cost(plain, a.restart_calls)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", RuntimeWarning)  # thread kind
                    fresh = fiber_dask.Pool(1, maxtasksperchild=1)
                with fresh:
                    fresh.apply(noop)
                    restart = restart_cost(fresh, a.restart_calls)
                    restart_main = restart_cost(fresh, a.restart_calls, main_noop)
                fiber_dask.shutdown()
            got[f"{kind}: cluster up (s)"] = t1 - t0
            got[f"{kind}: first result after cluster up (s)"] = t2 - t1
            got[f"{kind}: all slots serving (s)"] = t3 - t1
            got[f"{kind}: restart per task (ms)"] = 1e3 * (restart - base)
            got[f"{kind}: restart, task from __main__ (ms)"] = 1e3 * (
                restart_main - base
            )
        t0 = time.perf_counter()
        with mp.Pool(a.workers) as first:
            first.apply(noop)
            got["multiprocessing: first result (s)"] = time.perf_counter() - t0
        with mp.Pool(1) as plain:
            plain.apply(noop)
            mp_base = restart_cost(plain, a.restart_calls)
        with mp.Pool(1, maxtasksperchild=1) as fresh:
            fresh.apply(noop)
            mp_restart = restart_cost(fresh, a.restart_calls)
            mp_restart_main = restart_cost(fresh, a.restart_calls, main_noop)
        got["multiprocessing: restart per task (ms)"] = 1e3 * (mp_restart - mp_base)
        got["multiprocessing: restart, task from __main__ (ms)"] = 1e3 * (
            mp_restart_main - mp_base
        )
        cold, warm = template_costs()
        got["cold template to first slot (s)"] = cold
        got["next slot (spare), to connected (ms)"] = 1e3 * warm
        for k, v in got.items():
            rows.setdefault(k, []).append(v)
        print(
            f"[{r + 1}/{a.repeats}] "
            + "  ".join(f"{k} {v:.3f}" for k, v in got.items()),
            flush=True,
        )
    print(f"load after: {os.getloadavg()}")
    print()
    for k, v in rows.items():
        print(f"{k:<40} median {median(v):8.3f}   ({', '.join(f'{x:.3f}' for x in v)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
