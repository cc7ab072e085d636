"""The slot-memory monitor's own CPU: what counting slot processes against their
worker's memory limit costs the worker process.

A Dask worker process with process slots runs one monitor thread
(``fiber_dask.engine.slotmemory``) that sizes every slot process each
``distributed.worker.memory.monitor-interval`` (100 ms).  This benchmark forks
N idle processes sharing a numpy-laden heap (as slot processes share their
template's pages), has the monitor of a fiber-dask tree watch them for
``--seconds``, and reads the monitor thread's CPU time from
``/proc/self/task/<tid>/stat`` (Linux).  Trees are run alternately, each in a
fresh interpreter, ``--repeats`` times; the report gives each tree's median
share of a core and the ratio to the first tree::

    git worktree add /tmp/before <revision>
    python benchmarks/slotmemory.py --trees /tmp/before,. --slots 16,128

The limit is far above what the processes use, so nothing is ever ended: this
is the steady-state cost, paid all the time a pool is open.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time


def child(tree: str, slots: int, seconds: float) -> float:
    """In a fresh interpreter: the monitor's share of a core (percent)."""
    sys.path.insert(0, os.path.abspath(tree))
    import numpy  # noqa: F401 - a heap the forks share, as slots share a template's

    from fiber_dask.engine import slotmemory

    class Fork:  # what the monitor reads of a keeper's fork
        code = None

        def __init__(self, pid: int) -> None:
            self.pid = pid

    kids = []
    for _ in range(slots):
        pid = os.fork()
        if pid == 0:
            signal.pause()
            os._exit(0)
        kids.append(pid)
    forks = [Fork(p) for p in kids]
    try:
        for f in forks:
            slotmemory.watch(f, (1 << 50, 0.95, 0.1, True))
        tid = slotmemory._monitor.native_id
        time.sleep(0.5)  # past the first turn, which reads every slot exactly

        def cpu() -> float:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

        c0, t0 = cpu(), time.monotonic()
        time.sleep(seconds)
        c1, t1 = cpu(), time.monotonic()
        return 100.0 * (c1 - c0) / (t1 - t0)
    finally:
        for f in forks:
            slotmemory.unwatch(f)
        for p in kids:
            os.kill(p, signal.SIGKILL)
            os.waitpid(p, 0)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trees", default=".", help="comma-separated checkouts (default .)")
    p.add_argument("--slots", default="16,128", help="slot processes per worker")
    p.add_argument("--seconds", type=float, default=5.0, help="per measurement")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--child", nargs=3, metavar=("TREE", "SLOTS", "SECONDS"))
    a = p.parse_args()
    if a.child:
        tree, slots, seconds = a.child
        print(json.dumps(child(tree, int(slots), float(seconds))))
        return 0
    trees = a.trees.split(",")
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    rows = []
    for slots in [int(s) for s in a.slots.split(",")]:
        got: dict[str, list[float]] = {t: [] for t in trees}
        for r in range(a.repeats):
            for tree in trees if r % 2 == 0 else trees[::-1]:  # interleaved
                out = subprocess.run(
                    [sys.executable, __file__, "--child", tree, str(slots), str(a.seconds)],
                    capture_output=True, text=True, check=True,
                )  # fmt: skip
                got[tree].append(json.loads(out.stdout.splitlines()[-1]))
        medians = {t: statistics.median(v) for t, v in got.items()}
        base = medians[trees[0]]
        for t in trees:
            ratio = medians[t] / base if base else float("nan")
            rows.append((slots, t, medians[t], ratio, got[t]))
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    print("| slots | tree | monitor, % of a core (median) | ratio | runs |")
    print("|---:|---|---:|---:|---|")
    for slots, t, m, ratio, runs in rows:
        each = " ".join(f"{v:.1f}" for v in runs)
        print(f"| {slots} | `{t}` | {m:.1f} | {ratio:.2f} | {each} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
