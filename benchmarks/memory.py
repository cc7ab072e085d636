#!/usr/bin/env python
"""Memory: the client's peak RSS during a million-item ``imap``, stdlib vs fiber_dask.

``pool.imap(f, items, chunksize=c)`` over a *generator* of ``--items`` ints (default
1,000,000), consumed one result at a time: the input is read lazily and only a
bounded number of chunks is in flight, so the client's memory must not grow with
the number of items. The table shows the increase of this process's peak RSS
over its RSS just before the call (Linux: ``VmHWM`` after resetting it through
``/proc/self/clear_refs``, so the peak is exact; elsewhere psutil sampled every
millisecond), in MB (10^6 bytes), for:

``imap``          the generator of ``--items`` ints through ``imap``
``imap (1/10)``   the same with a tenth of the items: bounded means about the same
``map (list)``    for contrast, ``pool.map`` of ``list(range(items))``: the input
                  and the result list are materialised, as ``map`` must

and the items per second of the ``imap`` row. ``f`` is ``benchmarks.common.
square``. With fiber_dask the client process also hosts the embedded cluster's
scheduler (the workers are separate processes), as it does for a user.

Run from the repository root::

    python benchmarks/memory.py --quick
    python benchmarks/memory.py --markdown /tmp/memory.md
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from collections.abc import Sequence
from functools import partial
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import (  # noqa: E402
    SampledPeak,
    add_choice_list,
    add_output_options,
    add_start_method_option,
    check_choices,
    log,
    median,
    prepare_main,
    rotated,
    rss_bytes,
    square,
    timed,
)
from benchmarks.engines import EngineHarness  # noqa: E402
from benchmarks.report import format_cell  # noqa: E402

ENGINE_NAMES = ("multiprocessing", "fiber_dask")
BASELINE = "multiprocessing"
CASES = ("imap", "imap10", "map")
MB = 1_000_000
#: What "bounded" is checked against: the 1M-item imap's peak increase may be at
#: most this many MB (a materialised list of a million ints is ~40 MB, its
#: results as many again).
BOUND_MB = 30.0


class Benchmark(EngineHarness):
    text_title = "Memory: client peak RSS increase (MB) during a large imap"
    markdown_title = "Memory: the client's peak RSS during a 1-million-item imap"
    ratio_note = f"(N x) = ratio to {BASELINE} in the same run"
    cells_note = (
        "cells: median increase of the client's peak RSS over its RSS just before "
        f"the call, MB; (N×) = ratio to {BASELINE} in the same run"
    )
    targets_title = "fiber_dask: the imap stays bounded"

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args)
        self.peak: dict[tuple[str, str], list[float]] = {}
        self.rate: dict[str, list[float]] = {}
        self.base_rss: dict[str, list[float]] = {}

    def warm_up(self, eng: Any) -> None:
        list(eng.pool.imap(square, range(1000), chunksize=self.args.chunksize))

    def items(self, case: str) -> int:
        return self.args.items // 10 if case == "imap10" else self.args.items

    def measure(self) -> int:
        a = self.args
        self.prepare_engines()
        if not self.start_all():
            log("error: no engine could be started")
            return 1
        for r in range(a.repeats):
            for ci, case in enumerate(a.cases):
                for eng in rotated(list(self.active), r + ci):
                    self.run_case(eng, case, r)
            self.repeats_done = r + 1
        return 0

    def run_case(self, eng: Any, case: str, r: int) -> None:
        a = self.args
        n = self.items(case)
        gc.collect()
        try:
            with SampledPeak() as peak:
                base = rss_bytes()
                dt, (count, total) = timed(
                    partial(self.consume, eng, case, n), a.timeout
                )
            expected = (n - 1) * n * (2 * n - 1) // 6
            if count != n or total != expected:
                raise RuntimeError(f"wrong results: {count} items, sum {total}")
        except Exception as e:
            self.fail(eng, case, e)
            return
        self.peak.setdefault((eng.name, case), []).append(peak.increase / MB)
        self.base_rss.setdefault(eng.name, []).append(base / MB)
        if case == "imap":
            self.rate.setdefault(eng.name, []).append(n / dt)
        log(
            f"[{r + 1}/{a.repeats}] {case:<7} {eng.name:<16} +{peak.increase / MB:7.1f} MB"
            f"  {n / dt:9,.0f} items/s",
            a.quiet,
        )

    def consume(self, eng: Any, case: str, n: int) -> tuple[int, int]:
        c = self.args.chunksize
        if case == "map":
            results = eng.pool.map(square, list(range(n)), chunksize=c)
            return len(results), sum(results)
        count = total = 0
        for x in eng.pool.imap(square, iter(range(n)), chunksize=c):
            count += 1
            total += x
        return count, total

    # -- reporting

    def measured(self) -> list[str]:
        return [e.name for e in self.engines if self.base_rss.get(e.name)]

    def table(self, x: str) -> tuple[list[str], list[list[str]]]:
        names = self.measured()
        base = BASELINE if BASELINE in names else None
        label = {
            "imap": f"imap, {self.items('imap'):,} items (MB)",
            "imap10": f"imap, {self.items('imap10'):,} items (MB)",
            "map": f"map of a list, {self.items('map'):,} items (MB)",
        }

        def row(what: str, vals: dict[str, float], fmt: str) -> list[str]:
            b = vals.get(base) if base else None
            if b is not None and fmt == "{:.1f}" and b < 1.0:
                b = None  # no ratio to a peak of less than 1 MB
            return [what] + [
                format_cell(vals[n], fmt, b if n != BASELINE and b else None, x)
                for n in names
            ]

        rows = [
            row(
                label[c],
                {n: median(self.peak.get((n, c), [])) for n in names},
                "{:.1f}",
            )
            for c in self.args.cases
        ]
        if "imap" in self.args.cases:
            rows.append(
                row(
                    "imap items/s",
                    {n: median(self.rate.get(n, [])) for n in names},
                    "{:,.0f}",
                )
            )
        return ["", *names], rows

    def target_rows(self, x: str = "x") -> list[list[str]]:
        if "fiber_dask" not in self.measured():
            return []
        le = "<=" if x == "x" else "≤"
        out = []
        big = median(self.peak.get(("fiber_dask", "imap"), []))
        if big == big:
            out.append(
                [
                    f"imap of {self.items('imap'):,} items: peak increase",
                    f"{big:.1f} MB",
                    f"{le} {BOUND_MB:g} MB",
                    "ok" if big <= BOUND_MB else "MISSED",
                ]
            )
        small = median(self.peak.get(("fiber_dask", "imap10"), []))
        if big == big and small == small:
            grew = big - small
            out.append(
                [
                    "growth from a tenth of the items to all",
                    f"{grew:+.1f} MB",
                    f"{le} {BOUND_MB / 3:g} MB",
                    "ok" if grew <= BOUND_MB / 3 else "MISSED",
                ]
            )
        return out

    def meta_lines(self) -> list[str]:
        a = self.args
        lines = [
            self.machine_line(),
            f"{a.workers} workers; chunksize {a.chunksize}; " + self.repeats_note(),
        ]
        rss = median(v for vs in self.base_rss.values() for v in vs)
        if rss == rss:
            lines.append(
                f"the client is this one process for every engine (and fiber_dask's "
                f"embedded scheduler): RSS before the calls ~{rss:.0f} MB"
            )
        return lines + self.engine_lines()

    def json_report(self) -> dict[str, Any]:
        a = self.args
        return {
            **self.machine_json(),
            "items": a.items,
            "chunksize": a.chunksize,
            "workers": a.workers,
            "repeats_done": self.repeats_done,
            "interrupted": self.interrupted,
            "engines": self.engines_json(
                lambda e: {
                    "client_rss_before_mb": self.base_rss.get(e.name, []),
                    "peak_increase_mb": {
                        c: self.peak.get((e.name, c), []) for c in a.cases
                    },
                    "imap_items_per_s": self.rate.get(e.name, []),
                }
            ),
        }


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--items", type=int, default=None, help="(default 1,000,000; --quick 200,000)"
    )
    p.add_argument(
        "--chunksize",
        type=int,
        default=100,
        help="imap/map chunksize (default 100)",
    )
    p.add_argument("--workers", type=int, default=2, help="(default 2)")
    p.add_argument(
        "--repeats", type=int, default=None, help="repeats (default 3, --quick 1)"
    )
    add_choice_list(p, "--cases", CASES)
    add_choice_list(p, "--engines", ENGINE_NAMES)
    p.add_argument("--quick", action="store_true", help="200,000 items, 1 repeat")
    add_start_method_option(p)
    p.add_argument(
        "--timeout", type=float, default=600.0, help="seconds per case (default 600)"
    )
    add_output_options(p, "also write every raw figure as JSON")
    a = p.parse_args(argv)
    if a.items is None:
        a.items = 200_000 if a.quick else 1_000_000
    if a.repeats is None:
        a.repeats = 1 if a.quick else 3
    a.engines = check_choices(p, a.engines, ENGINE_NAMES, "engine")
    check_choices(p, a.cases, CASES, "case")
    if a.items < 10 or a.chunksize < 1 or a.repeats < 1 or a.workers < 1:
        p.error("--items >= 10; --chunksize, --repeats, --workers >= 1")
    return a


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    prepare_main(args)
    bench = Benchmark(args)
    t0 = time.perf_counter()
    status = bench.run(bench.measure)
    log(f"done in {time.perf_counter() - t0:.0f} s", args.quiet)
    return status


if __name__ == "__main__":
    sys.exit(main())
