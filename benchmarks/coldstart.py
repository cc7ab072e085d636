#!/usr/bin/env python
"""From nothing to the first Pool result: each measurement a fresh process.

What a user's script pays the first time: a new interpreter runs
``import fiber_dask as multiprocessing`` (or the stdlib), then ``Pool(N)`` and
its first ``apply``; no cluster is running, so fiber_dask starts its embedded
one (the scheduler, N worker processes, their slot templates).  Reported per
engine, medians over ``--repeats`` rounds, the engines interleaved in each
round (A B C A B C ...):

``import``         ``import fiber_dask`` (or ``multiprocessing``);
``first result``   from calling ``Pool(N)`` to the first ``apply`` returning
                   (issue 12's figure: the cluster's start included);
``whole``          the process from start to exit, as ``time python script.py``.

Engines: ``fiber_dask`` (process slots, the default: the first pool's slots
start while the cluster does), ``fiber_dask-late`` (``fiber.local.early-slots:
false``: ``Pool()`` waits for the whole cluster), ``fiber_dask-thread``
(``fiber.pool.slots: thread``), ``fiber_dask-spawn`` (worker processes
spawned, Dask's way, instead of forked from the preloaded server:
``fiber.local.worker-start: spawn``), ``dask`` (plain Dask: ``LocalCluster``
of N worker processes, a ``Client``, one ``submit``) and ``multiprocessing``
(fork, Linux's default).
Run from the repository root::

    python benchmarks/coldstart.py --repeats 7
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import median  # noqa: E402

SCRIPT = textwrap.dedent(
    """
    import json, os, sys, time
    t0 = time.perf_counter()
    if sys.argv[1] == "multiprocessing":
        import multiprocessing
        mp = multiprocessing.get_context("fork")
    elif sys.argv[1] == "dask":
        import distributed
    else:
        import fiber_dask as mp
    t1 = time.perf_counter()

    def noop():
        return os.getpid()

    if __name__ == "__main__":
        n = int(sys.argv[2])
        t2 = time.perf_counter()
        if sys.argv[1] == "dask":  # plain Dask, as its docs start a local cluster
            cluster = distributed.LocalCluster(
                n_workers=n, threads_per_worker=1, processes=True
            )
            client = distributed.Client(cluster)
            client.submit(noop).result()
            t3 = time.perf_counter()
            client.close()
            cluster.close()
        else:
            pool = mp.Pool(n)
            pool.apply(noop)
            t3 = time.perf_counter()
            pool.close()
            pool.join()
        print(json.dumps({"import": t1 - t0, "first result": t3 - t2}))
    """
)

ENGINES = (
    "fiber_dask",
    "fiber_dask-late",
    "fiber_dask-thread",
    "fiber_dask-spawn",
    "dask",
    "multiprocessing",
)


def run_once(engine: str, workers: int, script: str) -> dict[str, float]:
    env = dict(os.environ)
    if engine == "fiber_dask-thread":
        env["DASK_FIBER__POOL__SLOTS"] = "thread"
    if engine == "fiber_dask-spawn":
        env["DASK_FIBER__LOCAL__WORKER_START"] = "spawn"
    if engine == "fiber_dask-late":
        env["DASK_FIBER__LOCAL__EARLY_SLOTS"] = "false"
    env["DASK_FIBER__LOCAL__N_WORKERS"] = str(workers)
    name = engine if engine in ("multiprocessing", "dask") else "fiber_dask"
    t0 = time.perf_counter()
    out = subprocess.run(
        [sys.executable, script, name, str(workers)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    whole = time.perf_counter() - t0
    if out.returncode != 0:
        raise RuntimeError(f"{engine} failed ({out.returncode}):\n{out.stderr}")
    got = json.loads(out.stdout.strip().splitlines()[-1])
    got["whole"] = whole
    return got


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=2, help="Pool(N) (default 2)")
    p.add_argument("--repeats", type=int, default=7, help="rounds (default 7)")
    p.add_argument(
        "--engines",
        default=",".join(ENGINES),
        help=f"comma-separated, from {', '.join(ENGINES)}",
    )
    p.add_argument("--json", help="also write every raw timing to this file")
    a = p.parse_args(argv)
    engines = [e for e in a.engines.split(",") if e]
    unknown = set(engines) - set(ENGINES)
    if unknown:
        p.error(f"unknown engines: {', '.join(sorted(unknown))}")
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        script = os.path.join(d, "cold.py")
        with open(script, "w") as f:
            f.write(SCRIPT)
        print(f"load before: {os.getloadavg()}", flush=True)
        rows: dict[str, dict[str, list[float]]] = {e: {} for e in engines}
        for r in range(a.repeats):
            order = engines if r % 2 == 0 else engines[::-1]
            for engine in order:
                got = run_once(engine, a.workers, script)
                for k, v in got.items():
                    rows[engine].setdefault(k, []).append(v)
            print(
                f"[{r + 1}/{a.repeats}] "
                + "  ".join(f"{e} {rows[e]['first result'][-1]:.3f}" for e in engines),
                flush=True,
            )
        print(f"load after: {os.getloadavg()}")
    print()
    print("| seconds (median) | " + " | ".join(engines) + " |")
    print("|---|" + "---|" * len(engines))
    for key in ("import", "first result", "whole"):
        cells = []
        for e in engines:
            v = rows[e][key]
            cells.append(f"{median(v):.3f} ({min(v):.3f}-{max(v):.3f})")
        print(f"| {key} | " + " | ".join(cells) + " |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"workers": a.workers, "engines": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
