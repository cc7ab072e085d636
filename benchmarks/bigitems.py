#!/usr/bin/env python
"""The owner's memory for large inputs: a big array through a pool, in pieces.

Issue 30, item 1.  A ``--mb`` MB float64 array cut into ``--pieces`` pieces
(``numpy.array_split``: views, no copy) goes through ``Pool(2)``; the table
shows the increase of the owner's peak RSS over its RSS just before the call
(Linux ``VmHWM``, reset through ``/proc/self/clear_refs``), in MB, for:

``map``            ``pool.map(total, pieces)`` (each engine's default chunking),
                   scalar results;
``map(chunksize=1)`` the same, one piece per chunk;
``imap``           ``pool.imap(total, pieces)`` consumed as it comes;
``map (array results)`` ``pool.map(double, pieces)``: as many bytes come back.

Each measurement is a fresh process (the engines alternating, A B B A ...);
medians over ``--repeats``, with fiber_dask's figure over the stdlib's
(fork) in the same round.  Also the seconds each ``map`` took.

Run from the repository root::

    python benchmarks/bigitems.py --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import textwrap

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import median, run_json_program  # noqa: E402

PROGRAM = textwrap.dedent(
    """
    import json, sys, time
    import numpy as np
    from benchmarks.common import PeakProbe, square


    def total(a):
        return float(a.sum())


    def double(a):
        return a * 2.0


    if __name__ == "__main__":
        engine, mode, mb, pieces = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
        if engine == "multiprocessing":
            import multiprocessing
            mp = multiprocessing.get_context("fork")
        else:
            import fiber_dask as mp
        parts = np.array_split(np.random.default_rng(0).random(mb * 10**6 // 8), pieces)
        with mp.Pool(2) as pool:
            pool.map(square, range(8), chunksize=1)  # workers (slots) up
            if engine != "multiprocessing":
                # The first pool starts on early slots: wait for the cluster
                # (and the pool's slots on it), whose start is not the map's.
                mp.get_client()
                while not all(slot.worker for slot in pool._pool):
                    time.sleep(0.01)
            probe = PeakProbe().start()
            t0 = time.perf_counter()
            if mode == "map":
                pool.map(total, parts)
            elif mode == "map(chunksize=1)":
                pool.map(total, parts, chunksize=1)
            elif mode == "imap":
                for _ in pool.imap(total, parts):
                    pass
            else:
                out = pool.map(double, parts)
                del out
            seconds = time.perf_counter() - t0
            print(json.dumps({"MB": probe.stop() / 1e6, "seconds": seconds}))
    """
)

ENGINES = ("multiprocessing", "fiber_dask")
MODES = ("map", "map(chunksize=1)", "imap", "map (array results)")


def run_once(script: str, engine: str, mode: str, mb: int, pieces: int) -> dict:
    return run_json_program(script, [engine, mode, str(mb), str(pieces)], 2)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=int, default=300, help="the array's MB (default 300)")
    p.add_argument("--pieces", type=int, default=100, help="pieces (default 100)")
    p.add_argument("--repeats", type=int, default=5, help="rounds (default 5)")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated")
    p.add_argument("--json", help="also write every raw figure to this file")
    a = p.parse_args(argv)
    modes = [m for m in a.modes.split(",") if m]
    unknown = set(modes) - set(MODES)
    if unknown:
        p.error(f"unknown modes: {', '.join(sorted(unknown))}")
    d = tempfile.mkdtemp(prefix="bigitems-")
    script = os.path.join(d, "bigitems_prog.py")
    with open(script, "w") as f:
        f.write(PROGRAM)
    raw: dict[str, dict[str, dict[str, list[float]]]] = {}
    try:
        print(f"load before: {os.getloadavg()}", flush=True)
        for r in range(a.repeats):
            for mode in modes:
                order = ENGINES if r % 2 == 0 else ENGINES[::-1]
                for engine in order:
                    got = run_once(script, engine, mode, a.mb, a.pieces)
                    cell = raw.setdefault(mode, {}).setdefault(engine, {})
                    for k, v in got.items():
                        cell.setdefault(k, []).append(v)
                fd, mp = raw[mode]["fiber_dask"], raw[mode]["multiprocessing"]
                print(
                    f"[{r + 1}/{a.repeats}] {mode}: +{fd['MB'][-1]:.0f} MB vs "
                    f"+{mp['MB'][-1]:.0f} MB",
                    flush=True,
                )
        print(f"load after: {os.getloadavg()}")
    finally:
        shutil.rmtree(d, ignore_errors=True)
    print()
    print(f"{a.mb} MB in {a.pieces} pieces, Pool(2), median of {a.repeats}:")
    print()
    print(
        "| | multiprocessing MB | fiber_dask MB | target (1.25 x mp + 32) "
        "| multiprocessing s | fiber_dask s |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for mode in modes:
        mp, fd = raw[mode]["multiprocessing"], raw[mode]["fiber_dask"]
        m, f = median(mp["MB"]), median(fd["MB"])
        ok = "ok" if f <= 1.25 * m + 32 else "MISSED"
        print(
            f"| `{mode}` | +{m:.0f} | +{f:.0f} | {1.25 * m + 32:.0f} {ok} "
            f"| {median(mp['seconds']):.2f} | {median(fd['seconds']):.2f} |"
        )
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"mb": a.mb, "pieces": a.pieces, "modes": raw}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
