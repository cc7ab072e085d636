#!/usr/bin/env python
"""Dispatch rate: items per second through a Pool of trivial tasks, chunksize 1.

What the owner's per-chunk cost caps (issue 15): every item is its own chunk,
so the figure is the pool's chunks per second.  ``multiprocessing.Pool``
(fork) and ``fiber_dask.Pool`` run side by side in one run, interleaved over
``--repeats``; each cell is the median items/s.  Cases: ``imap`` (chunksize=1,
the stdlib default), ``map`` with ``chunksize=1``, ``map`` with no chunksize
(the stdlib's len/(4 x processes) rule against fiber-dask's chunking by
measurement, of a function the pool has measured), and ``map-new``: the
same with a function the pool has not seen yet (a new ``functools.partial``
each time), so fiber-dask starts it unmeasured.

Run from the repository root::

    python benchmarks/dispatch.py                    # 2 slots, 20000 items, 5 repeats
    python benchmarks/dispatch.py --slots 4 --items 50000 --repeats 5

This module is also what the workers import for the task (by reference, as
``benchmarks.dispatch.noop``), so its top level imports only the standard
library.
"""

from __future__ import annotations

import argparse
import functools
import multiprocessing
import os
import statistics
import sys
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CASES = ("imap1", "map1", "map-default", "map-new")


def noop(x: int) -> int:
    return x


def run_case(pool, case: str, n: int) -> float:
    """Items per second of one case on ``pool``."""
    items = range(n)
    t = time.perf_counter()
    if case == "imap1":
        got = sum(1 for _ in pool.imap(noop, items, chunksize=1))
    elif case == "map1":
        got = len(pool.map(noop, items, chunksize=1))
    elif case == "map-default":
        got = len(pool.map(noop, items))
    else:
        got = len(pool.map(functools.partial(noop), items))
    dt = time.perf_counter() - t
    assert got == n
    return n / dt


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--slots", type=int, default=2)
    p.add_argument("--items", type=int, default=20000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument(
        "--slot-kind",
        choices=("process", "thread"),
        default="process",
        help="fiber.pool.slots for fiber_dask (default process)",
    )
    a = p.parse_args(argv)
    import dask

    dask.config.set({"fiber.pool.slots": a.slot_kind})
    import fiber_dask

    fiber_dask.init()
    mp = multiprocessing.get_context("fork").Pool(a.slots)
    fd = fiber_dask.Pool(a.slots)
    try:
        for pool in (mp, fd):  # warm-up: loops connected, imports done
            pool.map(noop, range(200), chunksize=1)
        rates: dict[tuple[str, str], list[float]] = {}
        for r in range(a.repeats):
            order = [("multiprocessing", mp), ("fiber_dask", fd)]
            if r % 2:
                order.reverse()
            for case in CASES:
                for name, pool in order:
                    rates.setdefault((name, case), []).append(
                        run_case(pool, case, a.items)
                    )
    finally:
        mp.terminate()
        fd.terminate()
        fd.join()
        fiber_dask.shutdown()
    load = os.getloadavg()
    print(
        f"# dispatch: {a.items} trivial items, {a.slots} slots, fiber_dask "
        f"{a.slot_kind} slots, median of {a.repeats} interleaved repeats; "
        f"load {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}, {os.cpu_count()} CPUs"
    )
    print("| case | multiprocessing (fork) items/s | fiber_dask items/s | ratio |")
    print("|---|---:|---:|---:|")
    for case in CASES:
        m = statistics.median(rates[("multiprocessing", case)])
        f = statistics.median(rates[("fiber_dask", case)])
        print(f"| {case} | {m:,.0f} | {f:,.0f} | {f / m:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
