#!/usr/bin/env python
"""A fresh pool's first ``map`` of a function it has never run, against the stdlib's.

Issue 30, item 2.  Each measurement is a fresh process: it starts its engine
(fiber_dask's embedded cluster, warmed by a pool that maps *another*
function, so that the cluster's start is not counted), then opens ``Pool(N)``
and times, from ``Pool()`` returning:

``first map``   ``pool.map(f, range(items))`` of a function this pool and
                every earlier one never ran (no chunksize: each engine's own
                rule — the stdlib's ``len / (4 x N)``, fiber_dask's measured
                chunking);
``second map``  the same map again on the same pool (the function is known);
``slots up``    the first map of the function in another fresh pool whose slots
                have each run a task first: what the chunking costs without
                the slots' start.

Cells are elapsed / ideal (``items x seconds / N``; 1.00 = no overhead), with
fiber_dask's ratio to the stdlib's in the same round.  Kinds of task: ``busy``
(a busy-wait on the clock, as the Fiber paper's) and ``cpu`` (a fixed amount
of pure-Python work, calibrated to the same seconds: it also sees CPU that
something else takes from the task's core).  The engines alternate in each
round (A B B A ...), medians over ``--repeats`` rounds.

Run from the repository root::

    python benchmarks/firstmap.py --repeats 7
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

from benchmarks.common import calibrate_cpu_work, median, run_json_program  # noqa: E402

#: The program's imports, at its top as a program has them (a slot template
#: imports the main module under the stdlib's ``__mp_main__``, and with it these).
HEAD = textwrap.dedent(
    """
    import json, sys, time
    from benchmarks.common import busy, cpu_work, square
    """
)

SCRIPT = textwrap.dedent(
    """
    engine, workers, items, kind, arg = sys.argv[1:6]
    workers, items = int(workers), int(items)
    arg = float(arg) if kind == "busy" else int(arg)
    func = busy if kind == "busy" else cpu_work
    if engine == "multiprocessing":
        import multiprocessing
        mp = multiprocessing.get_context("fork")
    else:
        import fiber_dask as mp
        with mp.Pool(workers) as warm:  # the cluster and its templates up
            warm.map(square, range(4 * workers))
            mp.get_client()  # (its first pool ran on early slots meanwhile)
    t0 = time.perf_counter()
    pool = mp.Pool(workers)
    t1 = time.perf_counter()
    pool.map(func, [arg] * items)
    t2 = time.perf_counter()
    pool.map(func, [arg] * items)
    t3 = time.perf_counter()
    pool.close()
    pool.join()
    with mp.Pool(workers) as pool:  # another fresh pool, its slots up first
        pool.map(square, range(8 * workers), chunksize=1)
        t4 = time.perf_counter()
        pool.map(func, [arg] * items)
        t5 = time.perf_counter()
    print(json.dumps({"Pool()": t1 - t0, "first map": t2 - t1, "second map": t3 - t2,
                      "first map, slots up": t5 - t4}))
    """
)

ENGINES = ("multiprocessing", "fiber_dask")


def run_once(
    script: str, engine: str, workers: int, items: int, kind: str, arg: float
) -> dict:
    return run_json_program(
        script, [engine, str(workers), str(items), kind, str(arg)], workers
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=2, help="Pool(N) (default 2)")
    p.add_argument("--repeats", type=int, default=5, help="rounds (default 5)")
    p.add_argument(
        "--durations", default="0.01,0.001", help="task seconds (default 0.01,0.001)"
    )
    p.add_argument(
        "--ideal", type=float, default=1.0,
        help="ideal seconds of each map; items = ideal x workers / duration (default 1)",
    )  # fmt: skip
    p.add_argument("--kinds", default="busy,cpu", help="busy,cpu (default both)")
    p.add_argument("--json", help="also write every raw timing to this file")
    a = p.parse_args(argv)
    durations = [float(d) for d in a.durations.split(",") if d]
    kinds = [k for k in a.kinds.split(",") if k]
    cases = []
    for kind in kinds:
        for d in durations:
            arg = d if kind == "busy" else calibrate_cpu_work(d)
            cases.append((kind, d, arg, round(a.ideal * a.workers / d)))
    # A script file, run as users run one (``python prog.py``): a slot
    # template imports the program's main module, and with it the modules the
    # program's functions come from, as a forked stdlib worker inherits them
    # (``python -c`` has no main module to import: every fresh slot process
    # would then import benchmarks.common on its first task, ~12 ms).
    d = tempfile.mkdtemp(prefix="firstmap-")
    script = os.path.join(d, "firstmap_prog.py")
    with open(script, "w") as f:
        f.write(HEAD + "if __name__ == '__main__':\n" + textwrap.indent(SCRIPT, "    "))
    try:
        raw = _rounds(a, cases, script)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    _report(a, cases, raw)
    return 0


def _rounds(a: argparse.Namespace, cases: list, script: str) -> dict:
    print(f"load before: {os.getloadavg()}", flush=True)
    raw: dict[str, dict[str, dict[str, list[float]]]] = {}
    for r in range(a.repeats):
        for kind, d, arg, items in cases:
            case = f"{d * 1000:g} ms {kind}"
            order = ENGINES if r % 2 == 0 else ENGINES[::-1]
            for engine in order:
                got = run_once(script, engine, a.workers, items, kind, arg)
                cell = raw.setdefault(case, {}).setdefault(engine, {})
                for k, v in got.items():
                    cell.setdefault(k, []).append(v)
            fd, mp = raw[case]["fiber_dask"], raw[case]["multiprocessing"]
            print(
                f"[{r + 1}/{a.repeats}] {case} x{items}: first map "
                f"{fd['first map'][-1]:.3f} vs {mp['first map'][-1]:.3f} s",
                flush=True,
            )
    print(f"load after: {os.getloadavg()}")
    return raw


def _report(a: argparse.Namespace, cases: list, raw: dict) -> None:
    print()
    print(
        "| case | multiprocessing first | fiber_dask first | multiprocessing second "
        "| fiber_dask second | multiprocessing slots up | fiber_dask slots up "
        "| Pool() s (mp / fd) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for kind, d, _, items in cases:
        case = f"{d * 1000:g} ms {kind}"
        ideal = items * d / a.workers
        mp, fd = raw[case]["multiprocessing"], raw[case]["fiber_dask"]
        cells = [f"{case} x{items}"]
        for key in ("first map", "second map", "first map, slots up"):
            m = median(mp[key]) / ideal
            f = median(fd[key]) / ideal
            ratio = median(x / y for x, y in zip(fd[key], mp[key], strict=True))
            cells += [f"{m:.2f}", f"{f:.2f} ({ratio:.2f}×)"]
        cells.append(f"{median(mp['Pool()']):.3f} / {median(fd['Pool()']):.3f}")
        print("| " + " | ".join(cells) + " |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"workers": a.workers, "cases": raw}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
