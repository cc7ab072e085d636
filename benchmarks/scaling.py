#!/usr/bin/env python
"""Scaling: the Fiber paper's ES experiment, simulated on one machine.

The paper ran evolution strategies with a population of 2048 on 32 to 1024
workers (Fiber: 1475 s for 50 iterations at 32 workers, 243 s at 512 and 1024;
IPyParallel 1371 s at 512 and did not finish at 1024). Here every evaluation is a
``time.sleep(--eval-seconds)`` instead of an episode, so that 8 to 256 task
slots fit on two cores: a few Dask worker processes with many threads each
(``fiber.local.n-workers`` x ``fiber.local.threads-per-worker``). The rest is the
real thing: each iteration maps ``--population`` tasks (``theta`` and a noise
seed, mirrored pairs) through ``Pool(slots).map``, each task rebuilds its
perturbation from the seed, and the master ranks the rewards and updates a
``--params``-parameter ``theta``.

For every slot count: seconds per iteration (median over iterations and
repeats), and efficiency = ideal / actual, where ideal =
ceil(population / slots) x eval-seconds (the sleeps alone, perfectly packed).

Engines: ``fiber_dask`` (one embedded cluster for the whole run, a fresh
``Pool(slots)`` per slot count; ``--slot-kind thread`` by default, since 128
slots per worker process only make sense as threads), ``fiber_dask-direct``
(the same, on the same cluster, with ``fiber.pool.relay: false``: with
process slots each slot process dials the owner), ``multiprocessing``
(``Pool(slots)`` with the fork start method) and ``dask`` (plain
``client.map`` of one task per evaluation, on a ``LocalCluster`` with exactly
``slots`` threads, started per slot count) and ``no-pool`` (the bound: the
same tasks on ``--processes`` forked processes x threads, handed to each thread
directly, one pipe message per process and iteration; what the tasks' own CPU
leaves of ideal on this machine, which no pool can beat). Slot counts and
engines are interleaved within each repeat.

Startup per slot count: from ``Pool(slots)`` until every slot is running a
task (fiber_dask: every loop connected; multiprocessing: the pool object
returned, its processes forked; dask: the cluster's workers joined).

Run from the repository root::

    python benchmarks/scaling.py --quick
    python benchmarks/scaling.py --plot benchmarks/scaling.png --markdown /tmp/s.md

This module is also what the workers import for the task (by reference, as
``benchmarks.scaling.sleep_evaluate``), so its top level imports only the
standard library.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Sequence
from functools import partial
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import (  # noqa: E402
    Harness,
    add_choice_list,
    add_output_options,
    check_choices,
    csv_of,
    log,
    median,
    prepare_main,
    rotated,
    timed,
)
from benchmarks.engines import LocalClusterMixin  # noqa: E402

ENGINE_NAMES = ("fiber_dask", "fiber_dask-direct", "multiprocessing", "dask", "no-pool")
EFFICIENCY_TARGET = 0.80  # issue 6, at 256 slots
#: Issue 15's targets: (slots, efficiency at least, seconds to all slots at most).
SCALE_TARGETS = ((256, 0.80, 2.0), (512, 0.90, None), (1024, 0.85, 10.0))
#: ... and its chunking one (``--plain-map``): 1024 slots x 10 ms tasks.
PLAIN_MAP_TARGETS = ((1024, 0.90, 10.0),)
#: The paper's Fiber figures: seconds for 50 iterations, population 2048.
PAPER_FIBER = {32: 1475.0, 512: 243.0, 1024: 243.0}


def sleep_evaluate(task: tuple) -> float:
    """One evaluation: rebuild the perturbation from its seed, "play" by sleeping,
    score the perturbed parameters on a fixed quadratic."""
    import numpy as np

    theta, seed, sign, sigma, seconds = task
    params = theta + (sign * sigma) * np.random.default_rng(seed).standard_normal(
        theta.size
    )
    time.sleep(seconds)
    return -float(((params - 1.0) ** 2).mean())


def sleep_only(task: tuple) -> float:
    """``--sleep-only``'s evaluation: the same task and message, only the sleep
    (no perturbation rebuilt: the pool's cost alone, without the numpy work
    that on a 2-core machine is itself a large part of an ideal iteration)."""
    time.sleep(task[4])
    return float(-task[1])


def plain_sleep(seconds: float) -> None:
    """``--plain-map``'s task: nothing but the sleep, and nothing to pickle
    beyond a float."""
    time.sleep(seconds)


def es_iteration(map_fn: Any, theta: Any, rng: Any, a: argparse.Namespace) -> Any:
    """One ES iteration through ``map_fn``; returns the new ``theta``
    (unchanged with ``--sleep-only``, which also skips the master's update).
    With ``--plain-map``: one ``map`` of ``--population`` plain sleeps
    instead (issue 15's chunking case: the pool's chunks sized by
    measurement, no ES task tuple)."""
    import numpy as np

    if a.plain_map:
        map_fn(plain_sleep, [a.eval_seconds] * a.population)
        return theta

    pairs = a.population // 2
    seeds = rng.integers(0, 2**31 - 1, size=pairs)
    tasks = [
        (theta, int(s), sign, a.sigma, a.eval_seconds)
        for s in seeds
        for sign in (1, -1)
    ]
    rewards = np.asarray(
        map_fn(sleep_only if a.sleep_only else sleep_evaluate, tasks), dtype=float
    )
    if a.sleep_only:
        return theta
    ranks = np.empty(len(rewards))
    ranks[np.argsort(rewards, kind="stable")] = np.arange(len(rewards))
    ranks = ranks / (len(rewards) - 1) - 0.5
    weights = ranks[0::2] - ranks[1::2]
    grad = np.zeros(theta.size)
    for w, s in zip(weights, seeds, strict=True):
        grad += w * np.random.default_rng(int(s)).standard_normal(theta.size)
    return theta + a.lr * grad / (a.population * a.sigma)


# --------------------------------------------------------------------------- engines


class Engine:
    name = "?"

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.version = "?"
        self.note = ""

    def setup(self) -> None:
        pass

    def open(self, slots: int) -> None:
        """Get ``slots`` task slots ready (untimed)."""
        raise NotImplementedError

    def map(self, func: Any, items: list) -> list:
        raise NotImplementedError

    def close(self) -> None:
        pass

    def teardown(self) -> None:
        self.close()

    def owner_mark(self) -> Any:
        """Before the timed iterations: what :meth:`owner_cost` compares with."""
        return None

    def owner_cost(self, mark: Any) -> dict[str, float] | None:
        """After them: the pool owner's connections and CPU per chunk since
        ``mark`` (None for engines that do not say)."""
        return None


class _PoolEngine(Engine):
    """An engine whose slots are one ``Pool`` (``self.pool``), opened anew per
    slot count."""

    pool: Any = None

    def map(self, func: Any, items: list) -> list:
        return self.pool.map(func, items)

    def close(self) -> None:
        if self.pool is not None:
            pool, self.pool = self.pool, None
            pool.terminate()
            pool.join()


class FiberDaskEngine(_PoolEngine):
    name = "fiber_dask"
    #: fiber_dask engines set up: they share one embedded cluster, which the
    #: last one to go shuts down.
    live = 0
    #: fiber.pool.relay for this engine's pools (None: the policy's default).
    relay: bool | None = None

    def setup(self) -> None:
        import dask

        a = self.args
        dask.config.set(
            {
                "fiber.local.n-workers": a.processes,
                "fiber.local.threads-per-worker": a.threads,
                "fiber.pool.slots": a.slot_kind,
            }
        )
        import fiber_dask

        self.fd = fiber_dask
        self.version = fiber_dask.__version__
        self.note = (
            f"embedded cluster of {a.processes} worker processes x {a.threads} "
            f"threads, {a.slot_kind} slots; Pool(slots).map, default chunksize"
        )
        if self.relay is not None:
            self.note += f", fiber.pool.relay: {str(self.relay).lower()}"
        if FiberDaskEngine.live == 0:
            fiber_dask.init()
        FiberDaskEngine.live += 1
        self.pool = None

    def open(self, slots: int) -> None:
        import dask

        self.close()
        t0 = time.monotonic()
        with dask.config.set({"fiber.pool.relay": self.relay}):
            self.pool = self.fd.Pool(slots)
        # Pool() returns at once and its loops connect as Dask starts them; the
        # figures are for a pool that is up (as the paper's were), so wait until
        # every loop has connected (``_pool``: one entry per slot, as the stdlib).
        deadline = time.monotonic() + self.args.timeout
        while (
            sum(s.is_alive() for s in self.pool._pool) < slots
            and time.monotonic() < deadline
        ):
            time.sleep(0.02)
        self.startup = time.monotonic() - t0

    def teardown(self) -> None:
        try:
            self.close()
        finally:
            FiberDaskEngine.live -= 1
            if FiberDaskEngine.live == 0:
                self.fd.shutdown()

    def owner_mark(self) -> Any:
        e = self.pool._engine
        return _thread_cpu(e._thread.native_id), next(e._ckeys)

    def owner_cost(self, mark: Any) -> dict[str, float] | None:
        # The result thread's CPU (dispatching, reading, settling: the owner's
        # work for the pool, not the ES arithmetic of the main thread) per
        # chunk sent, and the connections the owner holds (one per worker
        # process with thread slots or the relay, one per slot process
        # without).
        e = self.pool._engine
        cpu, ckey = _thread_cpu(e._thread.native_id), next(e._ckeys)
        chunks = max(1, ckey - mark[1] - 1)
        return {
            "connections": len(e._links),
            "owner_cpu_us_per_chunk": (cpu - mark[0]) / chunks * 1e6,
            "chunks": chunks,
        }


class FiberDaskDirectEngine(FiberDaskEngine):
    """fiber_dask with every process slot dialling the owner itself
    (``fiber.pool.relay: false``), on the same cluster, to compare the relay."""

    name = "fiber_dask-direct"
    relay = False


def _thread_cpu(native_id: int) -> float:
    """Seconds of CPU thread ``native_id`` of this process used (Linux)."""
    try:
        with open(f"/proc/self/task/{native_id}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class MultiprocessingEngine(_PoolEngine):
    """The stdlib: ``multiprocessing.Pool(slots)``, fork start method."""

    name = "multiprocessing"

    def setup(self) -> None:
        import multiprocessing

        self.ctx = multiprocessing.get_context("fork")
        self.version = sys.version.split()[0]
        self.note = "Pool(slots) per slot count, fork; map, default chunksize"
        self.pool = None

    def open(self, slots: int) -> None:
        self.close()
        t0 = time.monotonic()
        self.pool = self.ctx.Pool(slots)
        self.startup = time.monotonic() - t0


def _no_pool_process(conn: Any, threads: int) -> None:
    """A ``no-pool`` engine's process: ``threads`` threads that stay for the
    whole slot count; each iteration it gets one list of items per thread
    (one pipe message), runs them and answers with all results at once."""
    import queue
    import threading

    inboxes = [queue.SimpleQueue() for _ in range(threads)]
    done: queue.SimpleQueue = queue.SimpleQueue()

    def slot(i: int) -> None:
        while True:
            job = inboxes[i].get()
            if job is None:
                return
            func, items = job
            try:
                done.put((i, [func(x) for x in items]))
            except BaseException as e:  # the map raises it, never hangs
                done.put((i, e))

    workers = [threading.Thread(target=slot, args=(i,)) for i in range(threads)]
    for t in workers:
        t.start()
    try:
        while True:
            msg = conn.recv()
            if msg is None:
                return
            func, lists = msg
            for i, items in enumerate(lists):
                inboxes[i].put((func, items))
            out: list = [None] * len(lists)
            for _ in lists:
                i, results = done.get()
                out[i] = results
            failed = [r for r in out if isinstance(r, BaseException)]
            if failed:
                try:
                    conn.send(failed[0])
                except Exception:  # an exception that does not pickle
                    conn.send(RuntimeError(repr(failed[0])))
            else:
                conn.send(out)
    finally:
        for box in inboxes:
            box.put(None)
        for t in workers:
            t.join()


class NoPoolEngine(Engine):
    """What this machine allows any pool: the same tasks on the same
    processes x threads, but no pool at all.  ``--processes`` processes
    forked once per slot count, each with its share of ``slots`` threads;
    every iteration each process gets its threads' items in one pipe message
    (item k to slot k mod slots: the ideal packing for tasks of one length)
    and sends all their results back in one.  Nothing is sized, balanced,
    retried or pickled per task: its efficiency is a bound for fiber_dask's
    thread slots on this machine, the part of ideal an iteration loses to
    the tasks' own CPU (the ES arithmetic, the sleeps' wake-ups) on these
    cores."""

    name = "no-pool"

    def setup(self) -> None:
        import multiprocessing

        self.ctx = multiprocessing.get_context("fork")
        self.version = "-"
        self.note = (
            f"bound: {self.args.processes} forked processes x slots/"
            f"{self.args.processes} threads, each thread handed its items "
            "directly (one pipe message per process and iteration)"
        )
        self.procs: list = []

    def open(self, slots: int) -> None:
        self.close()
        t0 = time.monotonic()
        n = min(self.args.processes, slots)
        self.shares = [slots // n + (p < slots % n) for p in range(n)]
        self.slots = slots
        for share in self.shares:
            mine, theirs = self.ctx.Pipe()
            proc = self.ctx.Process(target=_no_pool_process, args=(theirs, share))
            proc.start()
            theirs.close()
            self.procs.append((proc, mine))
        self.startup = time.monotonic() - t0

    def map(self, func: Any, items: list) -> list:
        per_slot = [items[k :: self.slots] for k in range(self.slots)]
        first = 0
        for (_, conn), share in zip(self.procs, self.shares, strict=True):
            conn.send((func, per_slot[first : first + share]))
            first += share
        answers = [conn.recv() for _, conn in self.procs]
        for answer in answers:
            if isinstance(answer, BaseException):
                raise answer
        lists = [x for answer in answers for x in answer]
        out: list = [None] * len(items)
        for k, results in enumerate(lists):
            out[k :: self.slots] = results
        return out

    def close(self) -> None:
        procs, self.procs = self.procs, []
        for _, conn in procs:
            try:
                conn.send(None)
            except OSError:
                pass
        for proc, conn in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
                proc.join()
            conn.close()


class DaskEngine(LocalClusterMixin, Engine):
    """Plain Dask: a task per evaluation on a cluster of exactly ``slots`` threads."""

    name = "dask"

    def setup(self) -> None:
        import distributed

        self.distributed = distributed
        self.version = distributed.__version__
        self.note = (
            "LocalCluster per slot count (slots threads over up to "
            f"{self.args.processes} processes); client.map, one task per evaluation"
        )

    def open(self, slots: int) -> None:
        self.close()
        procs = min(self.args.processes, slots)
        t0 = time.monotonic()
        self.start_cluster(procs, -(-slots // procs), "scaling-dask-")
        self.client.wait_for_workers(procs)
        self.startup = time.monotonic() - t0

    def map(self, func: Any, items: list) -> list:
        return self.client.gather(self.client.map(func, items, pure=False))

    def close(self) -> None:
        self.close_cluster()


# --------------------------------------------------------------------------- harness


class Benchmark(Harness):
    teardown_timeout = 120
    text_title = "Scaling: ES, population {p}, evaluation = {e:g} s sleep"
    markdown_title = "Scaling (the paper's ES experiment, simulated)"
    ratio_note = "efficiency = ideal / actual; ideal = ceil(population / slots) x eval"
    cells_note = (
        "cells: median seconds per iteration (efficiency = ideal / actual); "
        "ideal = ceil(population / slots) × evaluation seconds"
    )
    targets_title = "fiber_dask against the issue-6 and issue-15 targets"

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args)
        self.text_title = self.text_title.format(p=args.population, e=args.eval_seconds)
        self.engines = [
            {
                "fiber_dask": FiberDaskEngine,
                "fiber_dask-direct": FiberDaskDirectEngine,
                "multiprocessing": MultiprocessingEngine,
                "dask": DaskEngine,
                "no-pool": NoPoolEngine,
            }[n](args)
            for n in args.engines
        ]
        self.times: dict[tuple[str, int], list[float]] = {}  # per iteration
        self.startups: dict[tuple[str, int], list[float]] = {}
        #: fiber_dask's owner: connections and CPU per chunk (owner_cost).
        self.owners: dict[tuple[str, int], list[dict]] = {}

    def ideal(self, slots: int) -> float:
        a = self.args
        return -(-a.population // slots) * a.eval_seconds

    def measure(self) -> int:
        import numpy as np

        a = self.args
        for eng in self.engines:
            log(f"starting {eng.name} ...", a.quiet)
            self.live.append(eng)
            try:
                timed(eng.setup, a.timeout)
            except Exception as e:
                self.fail(eng, "setup", e)
                continue
            self.active.append(eng)
        if not self.active:
            log("error: no engine could be started")
            return 1
        theta0 = np.zeros(a.params)
        for r in range(a.repeats):
            for si, slots in enumerate(rotated(a.slots, r)):
                for eng in rotated(list(self.active), r + si):
                    self.run_case(eng, slots, theta0, r)
            self.repeats_done = r + 1
        return 0

    def run_case(self, eng: Engine, slots: int, theta: Any, r: int) -> None:
        import numpy as np

        a = self.args
        try:
            timed(partial(eng.open, slots), a.timeout)
            # Untimed warm-up: every loop/worker connected and its imports done,
            # with short sleeps so the big slot counts' warm-up stays short.
            warm = argparse.Namespace(**{**vars(a), "eval_seconds": 0.01})
            rng = np.random.default_rng([a.seed, r])
            timed(partial(es_iteration, eng.map, theta, rng, warm), a.timeout)
            times = []
            mark = eng.owner_mark()
            for _ in range(a.iterations):
                dt, theta = timed(
                    partial(es_iteration, eng.map, theta, rng, a), a.timeout
                )
                times.append(dt)
            owner = eng.owner_cost(mark)
            self.check_same_result((slots, r), theta)
        except Exception as e:
            self.fail(eng, f"{slots} slots", e)
            return
        finally:
            try:
                eng.close()
            except Exception:
                pass
        self.times.setdefault((eng.name, slots), []).extend(times)
        startup = getattr(eng, "startup", float("nan"))
        self.startups.setdefault((eng.name, slots), []).append(startup)
        med = median(times)
        said = ""
        if owner is not None:
            self.owners.setdefault((eng.name, slots), []).append(owner)
            said = (
                f"  owner: {owner['connections']} connections, "
                f"{owner['owner_cpu_us_per_chunk']:.0f} us CPU/chunk"
            )
        log(
            f"[{r + 1}/{a.repeats}] {slots:4d} slots  {eng.name:<15} "
            f"{med:7.3f} s/it  efficiency {self.ideal(slots) / med:5.1%}  "
            f"startup {startup:6.2f} s{said}",
            a.quiet,
        )

    # -- reporting

    def measured(self) -> list[str]:
        return [e.name for e in self.engines if any(k[0] == e.name for k in self.times)]

    def cell(self, name: str, slots: int) -> str:
        t = median(self.times.get((name, slots), []))
        if math.isnan(t):
            return "-"
        up = median(self.startups.get((name, slots), []))
        return f"{t:.3f} ({self.ideal(slots) / t:.0%}; up {up:.1f} s)"

    def table(self, x: str) -> tuple[list[str], list[list[str]]]:
        names = self.measured()
        rows = [
            [str(s), f"{self.ideal(s):.3f}", *(self.cell(n, s) for n in names)]
            for s in self.args.slots
        ]
        return ["slots", "ideal (s)", *names], rows

    def target_rows(self, x: str = "x") -> list[list[str]]:
        ge = ">=" if x == "x" else "≥"
        le = "<=" if x == "x" else "≤"
        rows = []
        targets = PLAIN_MAP_TARGETS if self.args.plain_map else SCALE_TARGETS
        for slots, eff_min, up_max in targets:
            t = median(self.times.get(("fiber_dask", slots), []))
            if math.isnan(t):
                continue
            eff = self.ideal(slots) / t
            rows.append(
                [
                    f"efficiency at {slots} slots",
                    f"{eff:.0%}",
                    f"{ge} {eff_min:.0%}",
                    "ok" if eff >= eff_min else "MISSED",
                ]
            )
            up = median(self.startups.get(("fiber_dask", slots), []))
            if up_max is not None and not math.isnan(up):
                rows.append(
                    [
                        f"startup at {slots} slots",
                        f"{up:.1f} s",
                        f"{le} {up_max:g} s",
                        "ok" if up <= up_max else "MISSED",
                    ]
                )
        return rows

    def meta_lines(self) -> list[str]:
        a = self.args
        lines = [
            self.machine_line(),
            f"population {a.population}, {a.params} parameters, evaluation = "
            f"{a.eval_seconds:g} s sleep"
            f"{' only (--sleep-only)' if a.sleep_only else ''}"
            f"{'; each iteration one plain map of the sleeps (--plain-map)' if a.plain_map else ''}"
            f"; {a.iterations} timed iteration(s) per slot "
            f"count and repeat after one untimed; " + self.repeats_note("over"),
        ]
        if (
            len(self.measured()) > 1
            and not (a.sleep_only or a.plain_map)
            and not self.mismatched
        ):
            lines.append(self.same_result_line)
        return lines + self.engine_lines()

    def json_report(self) -> dict[str, Any]:
        a = self.args
        return {
            **self.machine_json(),
            "population": a.population,
            "params": a.params,
            "eval_seconds": a.eval_seconds,
            "sleep_only": a.sleep_only,
            "iterations": a.iterations,
            "repeats_done": self.repeats_done,
            "interrupted": self.interrupted,
            "engines": self.engines_json(
                lambda e: {
                    "seconds_per_iteration": {
                        str(s): self.times.get((e.name, s), []) for s in a.slots
                    },
                    "startup_s": {
                        str(s): self.startups.get((e.name, s), []) for s in a.slots
                    },
                    "owner": {
                        str(s): self.owners.get((e.name, s), []) for s in a.slots
                    },
                }
            ),
            "ideal_s": {str(s): self.ideal(s) for s in a.slots},
        }

    def plot(self, path: str) -> None:
        """Time per iteration and efficiency against slots, like the paper's figure."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            log("note: no plot: matplotlib is not installed (the benchmarks extra)")
            return
        a = self.args
        slots = a.slots
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
        ax1.plot(slots, [self.ideal(s) for s in slots], "k--", label="ideal")
        for name, style in zip(self.measured(), ("o-", "s-", "^-", "d-"), strict=False):
            pts = [(s, median(self.times.get((name, s), []))) for s in slots]
            pts = [(s, t) for s, t in pts if not math.isnan(t)]
            ax1.plot([s for s, _ in pts], [t for _, t in pts], style, label=name)
            ax2.plot(
                [s for s, _ in pts],
                [100 * self.ideal(s) / t for s, t in pts],
                style,
                label=name,
            )
        for ax in (ax1, ax2):
            ax.set_xscale("log", base=2)
            ax.set_xticks(slots, [str(s) for s in slots])
            ax.set_xlabel("task slots (workers)")
            ax.grid(True, alpha=0.3)
            ax.legend()
        ax1.set_yscale("log")
        ax1.set_ylabel("seconds per iteration")
        ax1.set_title(
            f"ES, population {a.population}, {a.eval_seconds:g} s per evaluation"
        )
        ax2.axhline(100 * EFFICIENCY_TARGET, color="grey", lw=0.8, ls=":")
        ax2.set_ylim(0, 105)
        ax2.set_ylabel("efficiency (ideal / actual, %)")
        ax2.set_title("efficiency")
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        log(f"wrote {path}", a.quiet)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--slots",
        type=csv_of(int),
        default=None,
        help="task slot counts (default 32,64,128,256,512,1024; --quick 32,256)",
    )
    p.add_argument("--population", type=int, default=2048, help="(default 2048)")
    p.add_argument(
        "--eval-seconds",
        type=float,
        default=0.1,
        help="sleep per evaluation (default 0.1)",
    )
    p.add_argument(
        "--iterations",
        type=int,
        default=2,
        help="timed iterations per slot count and repeat (default 2)",
    )
    p.add_argument("--params", type=int, default=1000, help="size of theta")
    p.add_argument(
        "--sleep-only",
        action="store_true",
        help="evaluations only sleep and the master skips its update: the "
        "pool's own cost, without the ES arithmetic (same tasks and messages)",
    )
    p.add_argument(
        "--plain-map",
        action="store_true",
        help="each iteration is one map of --population plain sleeps of "
        "--eval-seconds, default chunksize (the chunking case: e.g. 1024 slots "
        "x 10 ms tasks), instead of an ES iteration",
    )
    p.add_argument("--sigma", type=float, default=0.05)
    p.add_argument("--lr", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--repeats", type=int, default=None, help="repeats (default 2, --quick 1)"
    )
    p.add_argument(
        "--processes",
        type=int,
        default=8,
        help="worker processes the slots are spread over (default 8)",
    )
    p.add_argument(
        "--slot-kind",
        choices=("thread", "process"),
        default="thread",
        help="fiber.pool.slots for fiber_dask (default thread: W/8 per process)",
    )
    add_choice_list(p, "--engines", ENGINE_NAMES)
    p.add_argument("--quick", action="store_true", help="32 and 256 slots, 1 repeat")
    p.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="seconds before one step counts as hung (default 600)",
    )
    p.add_argument("--plot", metavar="PNG", help="also draw the figure (matplotlib)")
    add_output_options(p, "also write every iteration's time as JSON")
    a = p.parse_args(argv)
    if a.slots is None:
        a.slots = [32, 256] if a.quick else [32, 64, 128, 256, 512, 1024]
    if a.repeats is None:
        a.repeats = 1 if a.quick else 2
    a.engines = check_choices(p, a.engines, ENGINE_NAMES, "engine")
    if min(a.slots) < 1 or a.population < 2 or a.iterations < 1 or a.repeats < 1:
        p.error("--slots, --iterations, --repeats must be >= 1, --population >= 2")
    a.threads = -(-max(a.slots) // a.processes)
    return a


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    prepare_main(args)
    bench = Benchmark(args)
    status = bench.run(bench.measure)
    if args.plot and bench.measured():
        bench.plot(args.plot)
    return status


if __name__ == "__main__":
    sys.exit(main())
