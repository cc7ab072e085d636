#!/usr/bin/env python
"""Evolution strategies: seconds per iteration of ``examples/es.py`` on every engine.

The Fiber paper's headline workload on one machine: the ES loop of ``examples/es.py``
(population ``--population``, one CartPole-v1 episode per perturbed policy, plus 10
episodes of the current policy, all in one ``map`` per iteration) runs
``--iterations`` iterations from the same seed on each engine, without stopping
early, so every engine does exactly the same work; the final parameters must be
bit-identical across engines (checked, outside the timed region).

Two evaluations (``--evaluations``): ``real`` is ``examples.es.evaluate`` (one
CartPole episode: its cost follows the episode's length, short early and 500 steps once
the policy balances, so iterations differ in cost and the tail depends on which slot
drew the long episodes); ``fixed`` is ``benchmarks.common.cartpole_fixed_cost`` (16
CartPole episodes stepped together with numpy for exactly 500 steps, masked after
termination: every evaluation does the same work, so the time per iteration shows only
the framework and stolen CPU).

The runs are interleaved -- for each repeat every engine in turn, starting with a
different engine each time -- and the table shows the median seconds per iteration
and the ratio to ``multiprocessing.Pool`` in the same run. ``--isolate`` keeps one
engine alive at a time instead (an idle Dask cluster burns 10-15 % of a core).

Engines (``benchmarks/engines.py``): ``multiprocessing`` (stdlib Pool), ``fiber_dask``
(its Pool on the embedded local cluster), ``ray`` (``ray.util.multiprocessing.Pool``),
``dask`` (``client.gather(client.map(...))``) and ``ipyparallel`` (load-balanced
``map_sync``). The evaluation function travels by reference, as
``examples.es.evaluate``.

Run from the repository root::

    python benchmarks/es.py --quick
    python benchmarks/es.py --markdown /tmp/es.md --json /tmp/es.json

See ``benchmarks/README.md`` for the options and the noise caveats.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from functools import partial
from typing import Any

if __package__ in (None, ""):
    # ``python benchmarks/es.py`` puts benchmarks/ on sys.path; the task function
    # must be importable as ``examples.es`` (here and in every worker).
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import (  # noqa: E402
    add_choice_list,
    add_output_options,
    add_start_method_option,
    cartpole_fixed_cost,
    check_choices,
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
from benchmarks.report import format_cell  # noqa: E402

#: Issue 6: fiber_dask within 1.1x of multiprocessing, and ahead of these peers.
RATIO_TARGET = 1.10
#: Issue 12: with fixed-cost evaluations, within 5 % of multiprocessing.
FIXED_RATIO_TARGET = 1.05
EVALUATIONS = ("real", "fixed")
AHEAD_OF = ("ray", "dask")


def es_module() -> Any:
    import examples.es

    return examples.es


class Benchmark(ComparisonHarness):
    text_title = "Evolution strategies: seconds per iteration (lower is better)"
    markdown_title = "Evolution strategies: seconds per iteration"
    ratio_note = f"(N x) = ratio to {BASELINE} in the same run"
    cells_note = (
        f"cells: median seconds per ES iteration; (N×) = ratio to {BASELINE} in the "
        "same run"
    )
    targets_title = "fiber_dask against the issue-6 targets"

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args)
        self.es = es_module()
        if args.env == "auto":
            args.env = self.es.env_kinds()[0]
        # evaluation -> name -> one figure per repeat
        self.per_iter: dict[str, dict[str, list[float]]] = {
            k: {} for k in args.evaluations
        }
        self.iter_times: dict[str, dict[str, list[list[float]]]] = {
            k: {} for k in args.evaluations
        }  # raw, per repeat

    def train(
        self, eng: Engine, iterations: int, population: int, evaluation: str = "real"
    ) -> dict:
        a = self.args
        map_fn = eng.map
        if evaluation == "fixed":
            # train() maps examples.es.evaluate; the same tasks go to the
            # fixed-cost evaluation instead.
            def map_fn(_func, tasks):
                return eng.map(cartpole_fixed_cost, tasks)

        return self.es.train(
            map_fn,
            population=population,
            iterations=iterations,
            env=a.env,
            target=None,
            seed=a.seed,
        )

    # -- steps

    def warm_up(self, eng: Engine) -> None:
        # Workers import examples.es (and gymnasium) and make their environments.
        for evaluation in self.args.evaluations:
            self.train(eng, 1, 4 * self.args.workers, evaluation)

    def steps(self) -> list[Step]:
        return [
            (k, partial(self.run_once, evaluation=k)) for k in self.args.evaluations
        ]

    def measure_engines(self) -> None:
        t0 = time.perf_counter()
        super().measure_engines()
        log(f"measured in {time.perf_counter() - t0:.0f} s", self.args.quiet)

    def run_once(self, eng: Engine, evaluation: str) -> str:
        if eng not in self.active:
            return ""
        a = self.args
        try:
            dt, out = timed(
                partial(self.train, eng, a.iterations, a.population, evaluation),
                a.timeout,
            )
            theta = out["theta"]
            self.check_same_result(evaluation, theta)
        except Exception as e:
            self.fail(eng, f"ES run ({evaluation})", e)
            return ""
        self.per_iter[evaluation].setdefault(eng.name, []).append(dt / a.iterations)
        self.iter_times[evaluation].setdefault(eng.name, []).append(
            [h["seconds"] for h in out["history"]]
        )
        return f"{eng.name} {dt / a.iterations:.3f} s/it"

    def log_step(self, r: int, label: str, parts: list[str]) -> None:
        text = "  ".join(p for p in parts if p)
        log(f"[{r + 1}/{self.args.repeats}] {label:<5} {text}", self.args.quiet)

    # -- reporting

    def measured(self) -> list[str]:
        return [
            e.name
            for e in self.engines
            if all(self.per_iter[k].get(e.name) for k in self.args.evaluations)
        ]

    def table(self, x: str) -> tuple[list[str], list[list[str]]]:
        names = self.measured()
        base = BASELINE if BASELINE in names else None
        st = {n: median(self.startup.get(n, [])) for n in names}

        def row(label: str, vals: dict[str, float], fmt: str) -> list[str]:
            b = vals[base] if base else None
            return [label] + [
                format_cell(vals[n], fmt, b if n != BASELINE else None, x)
                for n in names
            ]

        rows = []
        for k in self.args.evaluations:
            med = {n: median(self.per_iter[k][n]) for n in names}
            rows.append(row(f"{k}: seconds per iteration", med, "{:.3f}"))
            rows.append(
                row(
                    f"{k}: {self.args.iterations} iterations (s)",
                    {n: v * self.args.iterations for n, v in med.items()},
                    "{:.2f}",
                )
            )
        rows.append(row("startup (s)", st, "{:.2f}"))
        return ["", *names], rows

    def target_rows(self, x: str = "x") -> list[list[str]]:
        names = self.measured()
        if "fiber_dask" not in names:
            return []
        le = "<=" if x == "x" else "≤"
        out = []
        for k in self.args.evaluations:
            fd = median(self.per_iter[k]["fiber_dask"])
            target = FIXED_RATIO_TARGET if k == "fixed" else RATIO_TARGET
            if BASELINE in names:
                ratio = fd / median(self.per_iter[k][BASELINE])
                out.append(
                    [
                        f"{k}: fiber_dask vs multiprocessing",
                        f"{ratio:.2f}{x}",
                        f"{le} {target:.2f}{x}",
                        "ok" if ratio <= target else "MISSED",
                    ]
                )
            for peer in AHEAD_OF:
                if peer not in names:
                    continue
                ratio = fd / median(self.per_iter[k][peer])
                out.append(
                    [
                        f"{k}: fiber_dask vs {peer}",
                        f"{ratio:.2f}{x}",
                        f"< 1.00{x}",
                        "ok" if ratio < 1.0 else "MISSED",
                    ]
                )
        return out

    def meta_lines(self) -> list[str]:
        a = self.args
        lines = [
            self.machine_line(),
            f"{a.workers} workers; {self.es.env_description(a.env)}; population "
            f"{a.population} + 10 evaluation episodes per iteration, "
            f"{a.iterations} iterations from seed {a.seed}; " + self.repeats_note(),
            self.isolation_line(),
        ]
        if self.reference:
            lines.append(self.same_result_line)
        return lines + self.idle_lines() + self.engine_lines()

    def json_report(self) -> dict[str, Any]:
        a = self.args
        return {
            **self.machine_json(),
            "workers": a.workers,
            "env": a.env,
            "population": a.population,
            "iterations": a.iterations,
            "seed": a.seed,
            "repeats_done": self.repeats_done,
            "isolate": a.isolate,
            "interrupted": self.interrupted,
            "idle_cpu_percent_all_engines": self.idle_cpu.get("all engines"),
            "engines": self.engines_json(
                lambda e: {
                    "seconds_per_iteration": {
                        k: v.get(e.name, []) for k, v in self.per_iter.items()
                    },
                    "iteration_seconds": {
                        k: v.get(e.name, []) for k, v in self.iter_times.items()
                    },
                }
            ),
        }


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--workers", type=int, default=2, help="worker processes per engine (default 2)"
    )
    p.add_argument(
        "--population",
        type=int,
        default=256,
        help="perturbed policies per iteration (default 256, as examples/es.py)",
    )
    p.add_argument(
        "--iterations",
        type=int,
        default=None,
        help="iterations per run, never stopping early (default 20; --quick 8)",
    )
    p.add_argument(
        "--repeats", type=int, default=None, help="repeats (default 5, --quick 2)"
    )
    p.add_argument(
        "--env",
        choices=["auto", "gymnasium", "builtin"],
        default="auto",
        help="CartPole-v1 from gymnasium if installed (auto), or the built-in copy",
    )
    p.add_argument("--seed", type=int, default=0, help="ES seed (default 0)")
    add_choice_list(
        p,
        "--evaluations",
        EVALUATIONS,
        ": real = examples.es.evaluate, fixed = the same work every evaluation",
    )
    add_choice_list(
        p, "--engines", ENGINE_NAMES, "; the unavailable ones are skipped with a note"
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="8 iterations, 2 repeats (explicit flags win)",
    )
    add_start_method_option(p)
    p.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="seconds before one run counts as hung and its engine is dropped "
        "(default 600)",
    )
    add_isolation_options(
        p,
        "keep one engine alive at a time (each repeat starts and stops every engine)",
    )
    add_output_options(p, "also write every raw timing as JSON")
    a = p.parse_args(argv)
    if a.iterations is None:
        a.iterations = 8 if a.quick else 20
    if a.repeats is None:
        a.repeats = 2 if a.quick else 5
    a.engines = check_choices(p, a.engines, ENGINE_NAMES, "engine")
    a.evaluations = check_choices(p, a.evaluations, EVALUATIONS, "evaluation")
    if a.workers < 1 or a.repeats < 1 or a.iterations < 1 or a.population < 2:
        p.error("--workers, --repeats, --iterations must be >= 1, --population >= 2")
    return a


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    prepare_main(args)
    bench = Benchmark(args)
    return bench.run(bench.measure)


if __name__ == "__main__":
    sys.exit(main())
