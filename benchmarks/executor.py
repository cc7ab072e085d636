#!/usr/bin/env python
"""``concurrent.futures`` executors side by side: round trip and 1 ms-task throughput.

Four executors with ``--workers`` processes each, all in one run:

``stdlib``      ``concurrent.futures.ProcessPoolExecutor`` (forkserver), the baseline
``fiber_dask``  ``fiber_dask.futures.ProcessPoolExecutor`` on the embedded cluster
``loky``        ``loky.ProcessPoolExecutor`` (joblib's executor)
``dask``        ``Client.get_executor(pure=False)`` on a ``LocalCluster`` of processes

Cases: ``submit().result()`` round trips of a no-op (median of ``--latency-calls``),
and busy-wait tasks of ``--durations`` (1 ms by default) handed over two ways:

``submit``  ``[ex.submit(busy, d) for _ in range(n)]``, then ``.result()`` on each
``map``     ``list(ex.map(busy, [d] * n))`` (chunksize 1, the stdlib's default)

``n`` is chosen so that the ideal time ``n * d / workers`` is ``--ideal`` seconds; the
figure is elapsed / ideal (1.00 = no overhead), the median over ``--repeats``
interleaved repeats (each case runs every executor in turn, starting with a different
one each time), with its ratio to the stdlib's executor in the same run.

Issue 16's targets for fiber_dask: 1 ms tasks within 1.3x of the stdlib's executor,
and ahead of loky and of Dask's executor.

Run from the repository root::

    python benchmarks/executor.py
    python benchmarks/executor.py --repeats 7 --markdown /tmp/executor.md
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
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import (  # noqa: E402
    add_choice_list,
    add_output_options,
    busy,
    check_choices,
    csv_of,
    log,
    median,
    noop,
    prepare_main,
    timed,
)
from benchmarks.engines import (  # noqa: E402
    ComparisonHarness,
    Engine,
    LocalClusterMixin,
    Skip,
    Step,
    add_isolation_options,
)
from benchmarks.report import format_cell, format_duration  # noqa: E402

EXECUTORS = ("stdlib", "fiber_dask", "loky", "dask")
BASELINE = "stdlib"
MODES = ("submit", "map")
#: Issue 16: fiber_dask's 1 ms tasks at most this many times the stdlib's time.
RATIO_TARGET = 1.3


class ExecutorEngine(Engine):
    """An executor in ``self.ex``; every case goes through its public API."""

    ex: Any = None

    def run(self, mode: str, args: list[float]) -> list[Any]:
        if mode == "submit":
            futures = [self.ex.submit(busy, a) for a in args]
            return [f.result() for f in futures]
        if mode == "map":
            return list(self.ex.map(busy, args))
        raise ValueError(mode)

    def call_noop(self) -> None:
        self.ex.submit(noop).result()

    def teardown(self) -> None:
        if self.ex is not None:
            ex, self.ex = self.ex, None
            ex.shutdown(wait=True)


class StdlibEngine(ExecutorEngine):
    name = "stdlib"

    def prepare(self) -> None:
        import platform

        self.version = platform.python_version()
        self.note = "concurrent.futures.ProcessPoolExecutor, start method 'forkserver'"

    def setup(self) -> None:
        import concurrent.futures
        import multiprocessing

        self.ex = concurrent.futures.ProcessPoolExecutor(
            self.workers, mp_context=multiprocessing.get_context("forkserver")
        )
        self.call_noop()


class FiberDaskEngine(ExecutorEngine):
    name = "fiber_dask"

    def prepare(self) -> None:
        import dask

        dask.config.set({"fiber.local.n-workers": self.workers})
        try:
            import fiber_dask
            import fiber_dask.futures
        except ImportError as e:
            raise Skip(f"cannot import fiber_dask.futures: {e}") from e
        self.fiber_dask = fiber_dask
        self.version = fiber_dask.__version__
        self.note = "fiber_dask.futures.ProcessPoolExecutor, embedded local cluster"

    def setup(self) -> None:
        self.ex = self.fiber_dask.futures.ProcessPoolExecutor(self.workers)
        self.call_noop()

    def teardown(self) -> None:
        try:
            super().teardown()
        finally:
            self.fiber_dask.shutdown()


class LokyEngine(ExecutorEngine):
    name = "loky"

    def prepare(self) -> None:
        try:
            import loky
        except ImportError as e:
            raise Skip(f"cannot import loky: {e}") from e
        self.loky = loky
        self.version = loky.__version__
        self.note = "loky.ProcessPoolExecutor"

    def setup(self) -> None:
        self.ex = self.loky.ProcessPoolExecutor(self.workers)
        self.call_noop()

    def teardown(self) -> None:
        try:
            super().teardown()
        finally:
            # Its resource tracker would otherwise outlive the run.
            from loky.backend import resource_tracker

            tracker = resource_tracker._resource_tracker
            if getattr(tracker, "_pid", None) is not None:
                tracker._stop()


class DaskExecutorEngine(LocalClusterMixin, ExecutorEngine):
    name = "dask"

    def prepare(self) -> None:
        try:
            import distributed
        except ImportError as e:
            raise Skip(f"cannot import distributed: {e}") from e
        self.distributed = distributed
        self.version = distributed.__version__
        self.note = "Client.get_executor(pure=False), LocalCluster of processes"
        self.client = self.cluster = self.tmpdir = None

    def setup(self) -> None:
        self.start_cluster(self.workers, 1, "executor-dask-")
        self.ex = self.client.get_executor(pure=False)
        self.call_noop()

    def teardown(self) -> None:
        try:
            super().teardown()
        finally:
            self.close_cluster()


ENGINES = {
    "stdlib": StdlibEngine,
    "fiber_dask": FiberDaskEngine,
    "loky": LokyEngine,
    "dask": DaskExecutorEngine,
}


class Benchmark(ComparisonHarness):
    text_title = "concurrent.futures executors: elapsed / ideal (1.00 = no overhead)"
    markdown_title = "concurrent.futures executors"
    ratio_note = f"(N x) = ratio to {BASELINE} in the same run"
    cells_note = (
        "cells: median elapsed / ideal (1.00 = no overhead), round trips in ms; "
        f"(N×) = ratio to {BASELINE} in the same run"
    )
    targets_title = "fiber_dask against the issue-16 targets"

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args)
        self.cases = [(d, m) for d in args.durations for m in args.modes]
        self.elapsed: dict[tuple[float, str], dict[str, list[float]]] = {
            c: {} for c in self.cases
        }
        self.latency: dict[str, list[float]] = {}

    def make(self, name: str) -> Engine:
        return ENGINES[name](self.args.workers)

    def tasks(self, duration: float) -> int:
        return max(1, round(self.args.ideal * self.args.workers / duration))

    def ideal(self, duration: float) -> float:
        return self.tasks(duration) * duration / self.args.workers

    def steps(self) -> list[Step]:
        cases: list[Step] = [
            (case, partial(self.run_case, duration=case[0], mode=case[1]))
            for case in self.cases
        ]
        return [*cases, (None, self.run_latency)]

    def run_case(self, eng: Engine, duration: float, mode: str) -> str:
        if eng not in self.active:
            return ""
        n = self.tasks(duration)
        gc.collect()
        try:
            dt, out = timed(partial(eng.run, mode, [duration] * n), self.args.timeout)
            if len(out) != n or any(x != duration for x in out):
                raise RuntimeError(f"wrong results ({len(out)} of {n})")
        except Exception as e:
            self.fail(eng, f"{format_duration(duration)} {mode}", e)
            return ""
        self.elapsed[(duration, mode)].setdefault(eng.name, []).append(dt)
        return f"{eng.name} {dt / self.ideal(duration):.2f}"

    def run_latency(self, eng: Engine) -> str:
        if eng not in self.active:
            return ""
        try:
            _, lat = timed(partial(self.round_trips, eng), self.args.timeout)
        except Exception as e:
            self.fail(eng, "submit().result() round trips", e)
            return ""
        self.latency.setdefault(eng.name, []).append(lat)
        return f"{eng.name} {lat * 1e3:.2f} ms"

    def round_trips(self, eng: Engine) -> float:
        for _ in range(20):
            eng.call_noop()
        samples = []
        for _ in range(self.args.latency_calls):
            t0 = time.perf_counter()
            eng.call_noop()
            samples.append(time.perf_counter() - t0)
        return median(samples)

    def log_step(self, r: int, case: Any, parts: list[str]) -> None:
        if case is None:
            what = "submit().result() round trip"
        else:
            d, m = case
            what = f"{format_duration(d):>6} {m:<7} x{self.tasks(d):<5}"
        text = "  ".join(p for p in parts if p)
        log(f"[{r + 1}/{self.args.repeats}] {what} {text}", self.args.quiet)

    # -- reporting

    def table(self, x: str) -> tuple[list[str], list[list[str]]]:
        names = self.measured()
        base = BASELINE if BASELINE in names else None

        def row(label: str, values: dict[str, float], fmt: str) -> list[str]:
            b = values.get(base) if base else None
            cells = []
            for n in names:
                ratio = b if b and n != base and not math.isnan(b) else None
                cells.append(format_cell(values[n], fmt, ratio, x))
            return [label, *cells]

        rows = []
        for duration, mode in self.cases:
            ideal = self.ideal(duration)
            meds = {
                n: median(self.elapsed[(duration, mode)].get(n, [])) / ideal
                for n in names
            }
            label = f"{format_duration(duration)} {mode} x{self.tasks(duration)}"
            rows.append(row(label, meds, "{:.2f}"))
        rows.append(
            row(
                "startup (s)",
                {n: median(self.startup.get(n, [])) for n in names},
                "{:.2f}",
            )
        )
        rows.append(
            row(
                "submit().result() (ms)",
                {n: median(self.latency.get(n, [])) * 1e3 for n in names},
                "{:.2f}",
            )
        )
        return ["case", *names], rows

    def target_rows(self, x: str = "x") -> list[list[str]]:
        names = self.measured()
        if "fiber_dask" not in names:
            return []
        le = "<=" if x == "x" else "≤"
        out = []
        for duration, mode in self.cases:
            if duration != 0.001:
                continue
            el = self.elapsed[(duration, mode)]
            fd = median(el.get("fiber_dask", []))
            for other in ("stdlib", "loky", "dask"):
                ref = median(el.get(other, []))
                if other not in names or math.isnan(fd) or math.isnan(ref):
                    continue
                ratio = fd / ref
                limit = RATIO_TARGET if other == "stdlib" else 1.0
                out.append(
                    [
                        f"1 ms {mode} vs {other}",
                        f"{ratio:.2f}{x}",
                        f"{le} {limit:.2f}{x}" if other == "stdlib" else "< 1.00" + x,
                        "ok"
                        if (ratio <= limit if other == "stdlib" else ratio < 1.0)
                        else "MISSED",
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
            "interrupted": self.interrupted,
            "engines": self.engines_json(
                lambda e: {"round_trip_s": self.latency.get(e.name, [])}
            ),
            "cases": [
                {
                    "duration_s": d,
                    "mode": m,
                    "tasks": self.tasks(d),
                    "ideal_s": self.ideal(d),
                    "elapsed_s": self.elapsed[(d, m)],
                }
                for d, m in self.cases
            ],
        }


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=2, help="processes per executor")
    p.add_argument(
        "--ideal", type=float, default=1.0, help="ideal seconds per case (default 1)"
    )
    p.add_argument(
        "--durations",
        type=csv_of(float),
        default=[0.001],
        help="task durations in seconds (default 0.001)",
    )
    add_choice_list(p, "--modes", MODES)
    p.add_argument("--repeats", type=int, default=5, help="repeats (default 5)")
    add_choice_list(p, "--engines", EXECUTORS, "; unavailable ones are skipped")
    p.add_argument(
        "--latency-calls",
        type=int,
        default=200,
        help="submit(noop).result() round trips per repeat (default 200)",
    )
    p.add_argument(
        "--timeout", type=float, default=300.0, help="seconds before a case is hung"
    )
    add_isolation_options(
        p, "keep one executor alive at a time (each repeat starts and stops each)"
    )
    add_output_options(p, "also write every raw timing as JSON")
    a = p.parse_args(argv)
    a.start_method = "forkserver"
    a.engines = check_choices(p, a.engines, EXECUTORS, "engine")
    check_choices(p, a.modes, MODES, "mode")
    if a.workers < 1 or a.repeats < 1 or a.ideal <= 0 or a.latency_calls < 1:
        p.error("--workers, --repeats, --latency-calls must be >= 1 and --ideal > 0")
    return a


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    prepare_main(args)
    bench = Benchmark(args)
    return bench.run(bench.measure)


if __name__ == "__main__":
    sys.exit(main())
