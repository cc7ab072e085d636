"""Uncontended acquire+release of a lock, from another process of the cluster.

For each engine, a child process (a Dask worker's child for fiber_dask) times
``--ops`` acquire+release pairs on a lock that the parent created, and reports
the median pair's time (median over ``--repeats`` interleaved runs):

* ``Lock``: the top-level ``Lock()`` (fiber-dask: served by the parent over its
  authenticated channel; the stdlib: a POSIX semaphore in shared memory).
* ``Manager().Lock()``: a managed lock (a round trip to the manager's server).
* In-owner ``Lock``: the same top-level lock acquired in the process that made it.
* ``distributed.Lock``: Dask's own lease-based lock, from a task, for reference.

Issue #4's target: fiber-dask's uncontended acquire+release <= 2 ms on the
embedded default.  Run: ``python benchmarks/sync.py`` (a few seconds).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import ensure_importable, median  # noqa: E402


def time_pairs(lock, ops: int) -> float:
    """Median seconds of one acquire+release pair, over ``ops`` pairs."""
    for _ in range(20):  # warm: connect, first-use costs
        lock.acquire()
        lock.release()
    times = []
    for _ in range(ops):
        t0 = time.perf_counter()
        lock.acquire()
        lock.release()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def child(locks, ops, results):
    results.put({name: time_pairs(lock, ops) for name, lock in locks.items()})


def dask_lock_pairs(ops: int) -> float:
    from distributed import Lock

    return time_pairs(Lock("fiber-bench-lock"), ops)


def measure(engine: str, ops: int, manager) -> dict:
    if engine == "multiprocessing":
        import multiprocessing

        ctx = multiprocessing.get_context("forkserver")
    else:
        import fiber_dask

        ctx = fiber_dask.get_context()
    lock, managed = ctx.Lock(), manager.Lock()  # referenced here until joined
    results = ctx.Queue()
    p = ctx.Process(
        target=child,
        args=({"Lock": lock, "Manager().Lock()": managed}, ops, results),
    )
    p.start()
    out = results.get(timeout=120)
    p.join(60)
    out["in-owner Lock"] = time_pairs(lock, ops)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ops", type=int, default=500, help="pairs per measurement")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", help="write the figures to this file")
    args = p.parse_args(argv)
    ensure_importable()
    import multiprocessing

    import fiber_dask

    engines = ["multiprocessing", "fiber_dask"]
    managers = {
        "multiprocessing": multiprocessing.get_context("forkserver").Manager(),
        "fiber_dask": fiber_dask.Manager(),
    }
    runs: dict = {e: [] for e in engines}
    dask_runs = []
    client = fiber_dask.cluster.get_client()
    for r in range(args.repeats):
        for engine in engines[r % 2 :] + engines[: r % 2]:  # interleaved
            runs[engine].append(measure(engine, args.ops, managers[engine]))
        dask_runs.append(client.submit(dask_lock_pairs, args.ops, pure=False).result())
    for m in managers.values():
        m.shutdown()
    names = ["Lock", "Manager().Lock()", "in-owner Lock"]
    table = {e: {n: median(run[n] for run in runs[e]) for n in names} for e in engines}
    table["dask"] = {"distributed.Lock": median(dask_runs)}
    print(
        f"uncontended acquire+release, median of {args.repeats} runs x {args.ops} pairs"
    )
    print(f"{'':22}{'multiprocessing':>18}{'fiber_dask':>14}")
    for n in names:
        mp_t, fd_t = table["multiprocessing"][n], table["fiber_dask"][n]
        print(f"{n:22}{mp_t * 1e6:15.1f} us{fd_t * 1e6:11.1f} us")
    print(
        f"{'distributed.Lock':22}{'':18}{table['dask']['distributed.Lock'] * 1e6:11.1f} us"
    )
    worst = max(table["fiber_dask"][n] for n in names)
    print(
        f"target <= 2 ms: {'ok' if worst <= 2e-3 else 'MISSED'} (worst {worst * 1e3:.3f} ms)"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(table, f, indent=2)
    fiber_dask.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
