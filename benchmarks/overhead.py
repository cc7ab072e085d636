#!/usr/bin/env python
"""Framework overhead: the Fiber paper's experiment, every engine in one run.

Fixed-duration CPU tasks (1 s, 100 ms, 10 ms, 1 ms); the task count is chosen so that
the *ideal* time -- tasks x duration / workers -- is the same for every duration. Two
task kinds (``--kinds``):

``busy``  a busy-wait on the wall clock (the Fiber paper's task): it measures dispatch
          overhead, but cannot see CPU taken from the task, since it waits for the clock
          whatever share of its core it gets;
``cpu``   a fixed amount of real work (a pure-Python loop calibrated in this process to
          take the duration on one quiet core): CPU stolen from the task by the
          framework's own threads and processes makes it longer.  Each task also
          reports wall / thread-CPU time measured inside itself (1.00 = the task had
          its core to itself), printed per engine.

Three ways of handing the tasks over:

``map``          ``pool.map(busy, [d] * n)`` with the default chunksize
``imap1``        ``list(pool.imap(busy, [d] * n, chunksize=1))``
``apply_async``  ``[pool.apply_async(busy, (d,)) for _ in range(n)]``, ``.get()`` each

The figure reported is ``elapsed / ideal`` (1.00 = no overhead at all), the median over
``--repeats`` runs, and its ratio to ``multiprocessing.Pool`` in the same run. The runs
are interleaved -- for each repeat, for each case, every engine in turn, starting with
a different engine each time -- so that background noise hits all engines alike. All
engines stay up for the whole run, so the idle ones' background CPU (measured and
printed) is shared by all; ``--isolate`` keeps one engine alive at a time instead.

Engines: ``multiprocessing`` (stdlib Pool, forkserver by default), ``fiber_dask`` (its
Pool on the embedded local cluster), ``dask`` (plain ``Client.map``/``submit`` on a
``LocalCluster``), ``ray`` (``ray.util.multiprocessing.Pool``) and ``ipyparallel`` (a
load-balanced view). An engine that cannot be imported is skipped with a note.

Run from the repository root::

    python benchmarks/overhead.py --quick --engines multiprocessing,dask
    python benchmarks/overhead.py --markdown /tmp/overhead.md --json /tmp/overhead.json

See ``benchmarks/README.md`` for what each column means and the noise caveats.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import sys
import time
from collections.abc import Sequence
from functools import partial
from typing import Any

if __package__ in (None, ""):
    # ``python benchmarks/overhead.py`` puts benchmarks/ on sys.path; the task
    # functions must be importable as ``benchmarks.common`` (here and in workers).
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import (  # noqa: E402
    add_choice_list,
    add_output_options,
    add_start_method_option,
    calibrate_cpu_work,
    check_choices,
    cpu_work,
    csv_of,
    log,
    median,
    prepare_main,
    timed,
)
from benchmarks.engines import (  # noqa: E402
    BASELINE,
    ENGINE_NAMES,
    ComparisonHarness,
    Engine,
    Step,
    add_isolation_options,
)
from benchmarks.report import format_cell, format_duration  # noqa: E402

MODES = ("map", "imap1", "apply_async")
KINDS = ("busy", "cpu")

#: Targets from issue 2 for fiber_dask, as ratios to multiprocessing.Pool in the same
#: run (the 10 ms target is "1.05-1.1x"; the upper end is checked).
RATIO_TARGETS: dict[tuple[str, float, str], float] = {
    ("busy", 0.001, "map"): 1.10,
    ("busy", 0.001, "imap1"): 1.30,
    ("busy", 0.001, "apply_async"): 1.30,
    **{("busy", 0.01, m): 1.10 for m in MODES},
    **{("busy", 0.1, m): 1.05 for m in MODES},
    **{("busy", 1.0, m): 1.05 for m in MODES},
    # Issue 12: CPU-bound 10 ms tasks within 3 % of the stdlib.
    **{("cpu", 0.01, m): 1.03 for m in MODES},
}
STARTUP_TARGET_S = 3.0
LATENCY_TARGET_S = 2e-3


# --------------------------------------------------------------------------- harness


class Benchmark(ComparisonHarness):
    text_title = "Framework overhead: elapsed / ideal (1.00 = no overhead)"
    markdown_title = "Framework overhead"
    ratio_note = f"(N x) = ratio to {BASELINE} in the same run"
    cells_note = (
        f"cells: median elapsed / ideal (1.00 = no overhead); "
        f"(N×) = ratio to {BASELINE} in the same run"
    )
    targets_title = "fiber_dask against the issue-2 targets"

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args)
        self.latency: dict[str, list[float]] = {}  # per-repeat medians
        self.cases = [
            (k, d, m) for k in args.kinds for d in args.durations for m in args.modes
        ]
        self.elapsed: dict[tuple[str, float, str], dict[str, list[float]]] = {
            c: {} for c in self.cases
        }
        # cpu kind: wall / thread-CPU seconds summed over a case's tasks, per engine.
        self.stolen: dict[tuple[str, float, str], dict[str, list[float]]] = {
            c: {} for c in self.cases
        }
        self.loops = {
            d: calibrate_cpu_work(d) for d in args.durations if "cpu" in args.kinds
        }

    def tasks(self, duration: float) -> int:
        return max(1, round(self.args.ideal * self.args.workers / duration))

    def ideal(self, duration: float) -> float:
        return self.tasks(duration) * duration / self.args.workers

    # -- steps

    def steps(self) -> list[Step]:
        """Every case, then the round trips."""
        cases: list[Step] = [
            (case, partial(self.run_case, kind=case[0], duration=case[1], mode=case[2]))
            for case in self.cases
        ]
        return [*cases, (None, self.run_latency)]

    def run_case(self, eng: Engine, kind: str, duration: float, mode: str) -> str:
        if eng not in self.active:  # failed earlier in this case round
            return ""
        n = self.tasks(duration)
        gc.collect()
        try:
            if kind == "busy":
                run = partial(eng.run, mode, [duration] * n)
            else:
                run = partial(eng.run, mode, [self.loops[duration]] * n, cpu_work)
            dt, out = timed(run, self.args.timeout)
            if len(out) != n or (kind == "busy" and any(x != duration for x in out)):
                raise RuntimeError(f"wrong results ({len(out)} of {n})")
        except Exception as e:
            self.fail(eng, f"{kind} {format_duration(duration)} {mode}", e)
            return ""
        case = (kind, duration, mode)
        self.elapsed[case].setdefault(eng.name, []).append(dt)
        text = f"{eng.name} {dt / self.ideal(duration):.2f}"
        if kind == "cpu":
            wall, cpu = sum(w for w, _ in out), sum(c for _, c in out)
            self.stolen[case].setdefault(eng.name, []).append(wall / max(cpu, 1e-9))
            text += f" (w/c {self.stolen[case][eng.name][-1]:.3f})"
        return text

    def run_latency(self, eng: Engine) -> str:
        if eng not in self.active:
            return ""
        try:
            _, lat = timed(partial(self.round_trips, eng), self.args.timeout)
        except Exception as e:
            self.fail(eng, "apply() round trips", e)
            return ""
        self.latency.setdefault(eng.name, []).append(lat)
        return f"{eng.name} {lat * 1e3:.2f} ms"

    def log_step(
        self, r: int, case: tuple[float, str] | None, parts: list[str]
    ) -> None:
        if case is None:
            what = "apply() round trip"
        else:
            k, d, m = case
            what = f"{k:<4} {format_duration(d):>6} {m:<11} x{self.tasks(d):<5}"
        text = "  ".join(p for p in parts if p)
        log(f"[{r + 1}/{self.args.repeats}] {what} {text}", self.args.quiet)

    def round_trips(self, eng: Engine) -> float:
        """Median seconds of sequential trivial round trips, after a warm-up."""
        for _ in range(20):
            eng.call_noop()
        samples = []
        for _ in range(self.args.latency_calls):
            t0 = time.perf_counter()
            eng.call_noop()
            samples.append(time.perf_counter() - t0)
        return median(samples)

    # -- reporting

    def table(self, x: str) -> tuple[list[str], list[list[str]]]:
        """Header and rows of the results table; ``x`` is the multiplication sign."""
        names = self.measured()
        base = BASELINE if BASELINE in names else None
        header = ["case", "tasks", *names]

        def cell(value: float, base_value: float | None, fmt: str, name: str) -> str:
            ratio = base_value and name != BASELINE and not math.isnan(base_value)
            return format_cell(value, fmt, base_value if ratio else None, x)

        rows = []
        for kind, duration, mode in self.cases:
            case = (kind, duration, mode)
            meds = {n: median(self.elapsed[case].get(n, [])) for n in names}
            ideal = self.ideal(duration)
            b = meds[base] / ideal if base else None
            rows.append(
                [
                    f"{kind} {format_duration(duration)} {mode}",
                    str(self.tasks(duration)),
                    *(cell(meds[n] / ideal, b, "{:.2f}", n) for n in names),
                ]
            )
            if kind == "cpu":
                st = {n: median(self.stolen[case].get(n, [])) for n in names}
                rows.append(
                    [
                        "  wall/CPU in task",
                        "",
                        *("-" if math.isnan(st[n]) else f"{st[n]:.3f}" for n in names),
                    ]
                )
        st = {n: median(self.startup[n]) for n in names}
        b = st[base] if base else None
        rows.append(["startup (s)", "", *(cell(st[n], b, "{:.2f}", n) for n in names)])
        lat = {n: median(self.latency.get(n, [])) * 1e3 for n in names}
        b = lat[base] if base else None
        rows.append(
            ["apply() round trip (ms)", ""]
            + [cell(lat[n], b, "{:.2f}", n) for n in names]
        )
        return header, rows

    def target_rows(self, x: str = "x") -> list[list[str]]:
        """fiber_dask against the issue-2 targets, if both it and the baseline ran."""
        names = self.measured()
        if "fiber_dask" not in names or BASELINE not in names:
            return []
        le = "<=" if x == "x" else "≤"  # plain text stays ASCII
        out = []
        for kind, duration, mode in self.cases:
            limit = RATIO_TARGETS.get((kind, duration, mode))
            el = self.elapsed[(kind, duration, mode)]
            fd, mp = median(el.get("fiber_dask", [])), median(el.get(BASELINE, []))
            if limit is None or math.isnan(fd) or math.isnan(mp):
                continue
            ratio = fd / mp
            out.append(
                [
                    f"{kind} {format_duration(duration)} {mode} vs multiprocessing",
                    f"{ratio:.2f}{x}",
                    f"{le} {limit:.2f}{x}",
                    "ok" if ratio <= limit else "MISSED",
                ]
            )
        s = median(self.startup["fiber_dask"])
        out.append(
            [
                "startup",
                f"{s:.2f} s",
                f"{le} {STARTUP_TARGET_S:g} s",
                "ok" if s <= STARTUP_TARGET_S else "MISSED",
            ]
        )
        lat = median(self.latency.get("fiber_dask", []))
        if not math.isnan(lat):
            out.append(
                [
                    "apply() round trip",
                    f"{lat * 1e3:.2f} ms",
                    f"{le} {LATENCY_TARGET_S * 1e3:g} ms",
                    "ok" if lat <= LATENCY_TARGET_S else "MISSED",
                ]
            )
        return out

    def meta_lines(self) -> list[str]:
        a = self.args
        return [
            self.machine_line(),
            f"{a.workers} workers, ideal time {a.ideal:g} s per case, "
            + self.repeats_note(),
            self.isolation_line(),
            *self.idle_lines(),
            *self.engine_lines(),
        ]

    def json_report(self) -> dict[str, Any]:
        a = self.args
        return {
            **self.machine_json(),
            "workers": a.workers,
            "ideal_s": a.ideal,
            "repeats_done": self.repeats_done,
            "isolate": a.isolate,
            "idle_cpu_percent_all_engines": self.idle_cpu.get("all engines"),
            "interrupted": self.interrupted,
            "engines": self.engines_json(
                lambda e: {"apply_round_trip_s": self.latency.get(e.name, [])}
            ),
            "cases": [
                {
                    "kind": k,
                    "duration_s": d,
                    "mode": m,
                    "tasks": self.tasks(d),
                    "ideal_s": self.ideal(d),
                    "elapsed_s": self.elapsed[(k, d, m)],
                    "wall_over_cpu_in_task": self.stolen[(k, d, m)],
                }
                for k, d, m in self.cases
            ],
        }


# --------------------------------------------------------------------------- CLI


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument(
        "--workers", type=int, default=2, help="worker processes per engine (default 2)"
    )
    p.add_argument(
        "--ideal",
        type=float,
        default=None,
        help="ideal seconds per case; tasks = ideal * workers / duration "
        "(default 2, --quick 1)",
    )
    p.add_argument(
        "--durations",
        type=csv_of(float),
        default=None,
        help="task durations in seconds (default 1,0.1,0.01,0.001; --quick 0.01,0.001)",
    )
    add_choice_list(p, "--modes", MODES)
    add_choice_list(
        p,
        "--kinds",
        KINDS,
        ": busy = busy-wait on the clock, cpu = a fixed amount of real work",
    )
    p.add_argument(
        "--repeats", type=int, default=None, help="repeats (default 3, --quick 2)"
    )
    add_choice_list(
        p, "--engines", ENGINE_NAMES, "; the unavailable ones are skipped with a note"
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="ideal 1 s, 2 repeats, durations 0.01,0.001 (explicit flags win)",
    )
    add_start_method_option(p)
    p.add_argument(
        "--latency-calls",
        type=int,
        default=200,
        help="sequential apply(noop) round trips per repeat, after 20 warm-up calls "
        "(default 200)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        help="seconds before one measured call counts as hung and its engine is "
        "dropped (default 300)",
    )
    add_isolation_options(
        p,
        "keep one engine alive at a time (each repeat starts and stops every "
        "engine) so that idle engines do not steal CPU from the one being measured",
    )
    add_output_options(p, "also write every raw timing as JSON")
    a = p.parse_args(argv)
    if a.ideal is None:
        a.ideal = 1.0 if a.quick else 2.0
    if a.repeats is None:
        a.repeats = 2 if a.quick else 3
    if a.durations is None:
        a.durations = [0.01, 0.001] if a.quick else [1.0, 0.1, 0.01, 0.001]
    a.engines = check_choices(p, a.engines, ENGINE_NAMES, "engine")
    check_choices(p, a.modes, MODES, "mode")
    check_choices(p, a.kinds, KINDS, "kind")
    if a.workers < 1 or a.repeats < 1 or a.ideal <= 0 or a.latency_calls < 1:
        p.error("--workers, --repeats, --latency-calls must be >= 1 and --ideal > 0")
    if any(d <= 0 for d in a.durations):
        p.error("--durations must be > 0")
    return a


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    prepare_main(args)
    bench = Benchmark(args)
    return bench.run(bench.measure)


if __name__ == "__main__":
    sys.exit(main())
