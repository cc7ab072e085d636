"""Repeated short runs of a legacy script: with and without ``fiber-dask up``.

A legacy ``multiprocessing`` script that the stdlib runs in a fraction of a second
pays, under ``fiber-dask run``, the start of an embedded cluster on every run.
``fiber-dask up`` starts one cluster that later runs attach to.  This times the
whole process, from outside, three ways in turn (A B C A B C ...), so that drift
in the machine's load hits all three alike:

* ``python SCRIPT`` (the stdlib),
* ``fiber-dask run --swap-multiprocessing SCRIPT`` with no cluster up (an embedded
  cluster per run),
* the same with a ``fiber-dask up`` cluster of the same size running.

::

    python benchmarks/up.py --repeats 7
    python benchmarks/up.py --script examples/legacy/manager_dict.py --workers 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIBER_DASK = os.path.join(os.path.dirname(sys.executable), "fiber-dask")


def timed(cmd: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    subprocess.run(
        cmd, env=env, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, timeout=600
    )
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--script",
        default="examples/legacy/pool_initializer.py",
        help="the legacy script to run (default: %(default)s)",
    )
    parser.add_argument(
        "--repeats", type=int, default=5, help="runs of each (default: %(default)s)"
    )
    parser.add_argument(
        "--workers", type=int, default=2, help="worker processes (default: %(default)s)"
    )
    args = parser.parse_args()

    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        base = {k: v for k, v in os.environ.items() if not k.startswith("DASK_")}
        base["DASK_FIBER__LOCAL__N_WORKERS"] = str(args.workers)
        none = {**base, "DASK_FIBER__UP__STATE_DIR": os.path.join(tmp, "none")}
        up = {**base, "DASK_FIBER__UP__STATE_DIR": os.path.join(tmp, "up")}
        run = [FIBER_DASK, "run", "--swap-multiprocessing", args.script]
        commands = {
            "python (stdlib)": ([sys.executable, args.script], base),
            "fiber-dask run, no cluster up": (run, none),
            "fiber-dask run, `fiber-dask up` running": (run, up),
        }
        subprocess.run([FIBER_DASK, "up"], env=up, check=True, timeout=300)
        try:
            for cmd, env in commands.values():  # warm-up: file caches, imports
                timed(cmd, env)
            times: dict[str, list[float]] = {name: [] for name in commands}
            for _ in range(args.repeats):
                for name, (cmd, env) in commands.items():
                    times[name].append(timed(cmd, env))
        finally:
            subprocess.run([FIBER_DASK, "down"], env=up, check=True, timeout=120)

    print(f"{args.script}, {args.workers} workers, {args.repeats} runs each")
    print(
        f"load average (1 min): {load_before:.1f} before, {os.getloadavg()[0]:.1f} after"
    )
    stdlib = statistics.median(times["python (stdlib)"])
    for name, values in times.items():
        med = statistics.median(values)
        print(
            f"{name:42s} median {med:6.2f} s  (min {min(values):.2f}, "
            f"max {max(values):.2f})  {med / stdlib:5.1f}x stdlib"
        )


if __name__ == "__main__":
    main()
