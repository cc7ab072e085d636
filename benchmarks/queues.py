#!/usr/bin/env python
"""Queues, Pipes and Processes: stdlib ``multiprocessing`` vs ``fiber_dask``, one run.

Every case starts fresh Processes and creates its Queues/Pipes in this process (the
parent), so with fiber_dask every item goes producer -> parent (the owner) ->
consumer over the direct channel; with the stdlib it goes through an OS pipe:

``ints``      a producer Process puts ``--items`` ints on a Queue, a consumer Process
              gets them; items/s from the consumer's first to its last item
``latency``   ping-pong of ``--pings`` messages between two Processes over two Queues;
              each message carries ``time.perf_counter()`` from before its ``put``, the
              receiver takes the time after its ``get`` (one host, one clock): p50 and
              p99 of put -> get, both directions, and of the round trip
``queue10``   ``--payloads`` bytes objects of ``--payload-mb`` MB through a Queue; MB/s
              from the producer's first ``put`` to the consumer's last ``get``
``pipe10``    the same through a ``Pipe(duplex=False)`` (``send``/``recv``)
``mem100``    one ``--big-mb`` MB bytes object producer -> Queue -> consumer; peak RSS
              increase of the parent (the owner), the consumer and the producer, as a
              multiple of the object's size (Linux: VmHWM after resetting it through
              /proc/self/clear_refs; elsewhere psutil sampling / ru_maxrss)
``start``     ``p.start()`` until the child's target runs (it puts ``time.time()`` on
              a Queue), median of ``--starts`` Processes started one after another

A consumer always runs (and has said so) before its producer starts, so no item
waits for a consumer that is still starting. The runs are interleaved -- for each
repeat, for each case, every engine in turn, starting with a different engine each
time -- and the tables show medians over the repeats, and fiber_dask's ratio to the
stdlib (forkserver by default) in the same run.

Run from the repository root::

    python benchmarks/queues.py --quick
    python benchmarks/queues.py --markdown /tmp/queues.md

See ``benchmarks/README.md`` for what each row means and the noise caveats.

This module is also what the child processes import for their targets (by
reference, as ``benchmarks.queues.<name>``), so its top level imports only the
standard library.
"""

from __future__ import annotations

import argparse
import gc
import math
import multiprocessing
import os
import platform
import queue as stdqueue
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

if __package__ in (None, ""):
    # ``python benchmarks/queues.py`` puts benchmarks/ on sys.path; the targets must
    # be importable as ``benchmarks.queues`` (here and in every child process).
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import (  # noqa: E402
    Harness,
    PeakProbe,
    SampledPeak,
    add_choice_list,
    add_output_options,
    add_start_method_option,
    check_choices,
    log,
    median,
    prepare_main,
    rotated,
)
from benchmarks.report import format_cell  # noqa: E402

ENGINE_NAMES = ("multiprocessing", "fiber_dask")
BASELINE = "multiprocessing"
CASES = ("ints", "latency", "queue10", "pipe10", "mem100", "start")
MB = 1_000_000

#: The issue's targets for fiber_dask.
INTS_TARGET = 20_000.0  # items/s
INTS_RATIO_TARGET = 0.50  # of multiprocessing.Queue's items/s
LATENCY_TARGET_MS = 1.0  # p50 put -> get
BANDWIDTH_TARGET = 200.0  # MB/s, 10 MB payloads
MEMORY_TARGET_X = 3.0  # peak RSS increase / object size
START_TARGET_S = 0.5  # p.start() -> target running


# ------------------------------------------------ targets (run in the children)
#
# Each gets the engine's own Queue/Pipe objects; ``res`` is a Queue back to the
# parent. A consumer says ("ready",) before it blocks, and the parent starts the
# producer only then.


def produce_ints(q: Any, n: int) -> None:
    put = q.put
    for i in range(n):
        put(i)
    q.close()
    q.join_thread()


def consume_ints(q: Any, res: Any, n: int) -> None:
    res.put(("ready",))
    get = q.get
    total = get()
    t0 = time.perf_counter()
    for _ in range(n - 1):
        total += get()
    t1 = time.perf_counter()
    res.put(("ints", t0, t1, n, total))


def ping(a: Any, b: Any, res: Any, n: int, warmup: int) -> None:
    one_way: list[float] = []
    rtt: list[float] = []
    clock = time.perf_counter
    for i in range(warmup + n):
        t = clock()
        a.put((i, t))
        j, t_sent, t_echo = b.get()
        now = clock()
        if j != i:
            raise RuntimeError(f"ping {i} came back as {j}")
        if i >= warmup:
            one_way.append(t_sent - t)  # a.put -> a.get in the echo process
            one_way.append(now - t_echo)  # b.put -> b.get here
            rtt.append(now - t)
    a.put(None)
    res.put(("latency", one_way, rtt))


def pong(a: Any, b: Any, res: Any) -> None:
    res.put(("ready",))
    clock = time.perf_counter
    while True:
        m = a.get()
        t = clock()
        if m is None:
            return
        b.put((m[0], t, clock()))


def produce_payloads(dst: Any, res: Any, count: int, size: int, kind: str) -> None:
    # Built before the clock starts; two alternating objects, so nothing can be
    # deduplicated and every page is touched.
    blobs = [bytes([1]) * size, bytes([2]) * size]
    send = dst.put if kind == "queue" else dst.send
    t0 = time.perf_counter()
    for i in range(count):
        send(blobs[i % 2])
    res.put(("producer", t0))
    if kind == "queue":
        dst.close()
        dst.join_thread()


def consume_payloads(src: Any, res: Any, count: int, size: int, kind: str) -> None:
    res.put(("ready",))
    recv = src.get if kind == "queue" else src.recv
    bad = 0
    for i in range(count):
        b = recv()
        if len(b) != size or b[0] != 1 + i % 2 or b[-1] != 1 + i % 2:
            bad += 1
    res.put(("consumer", time.perf_counter(), bad))


def produce_big(q: Any, res: Any, size: int) -> None:
    probe = PeakProbe().start()
    blob = bytes([7]) * size
    q.put(blob)
    q.close()
    q.join_thread()  # stdlib: the feeder has written it all into the pipe
    res.put(("producer", probe.stop()))


def consume_big(q: Any, res: Any, size: int) -> None:
    res.put(("ready",))
    probe = PeakProbe().start()
    blob = q.get()
    inc = probe.stop()
    ok = len(blob) == size and blob[0] == 7 and blob[-1] == 7
    res.put(("consumer", inc, ok))


def report_started(q: Any) -> None:
    q.put(time.time())


# ---------------------------------------------------------------- engines


class CaseError(Exception):
    """A case went wrong (a child failed, a result is missing or wrong)."""


class Engine:
    name = "?"

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self.ctx: Any = None
        self.version = "?"
        self.note = ""

    def prepare(self) -> None:
        pass

    def teardown(self) -> None:
        pass

    def where(self, p: Any) -> str | None:
        """The Dask worker a Process ran on (None for the stdlib)."""
        return None


class MultiprocessingEngine(Engine):
    name = "multiprocessing"

    def __init__(self, workers: int, start_method: str = "forkserver") -> None:
        super().__init__(workers)
        self.ctx = multiprocessing.get_context(start_method)
        self.version = platform.python_version()
        self.note = f"start method {start_method!r}"


class FiberDaskEngine(Engine):
    name = "fiber_dask"

    def prepare(self) -> None:
        import dask

        # Must be set before fiber_dask starts its embedded cluster.
        dask.config.set({"fiber.local.n-workers": self.workers})
        import fiber_dask

        self.fiber_dask = fiber_dask
        self.ctx = fiber_dask
        self.version = getattr(fiber_dask, "__version__", "?")
        self.note = f"embedded local cluster, {self.workers} workers"
        address = dask.config.get("scheduler-address", None) or dask.config.get(
            "fiber.address", None
        )
        if address:
            self.note = f"scheduler-address/fiber.address is set ({address})!"

    def teardown(self) -> None:
        self.fiber_dask.shutdown()

    def where(self, p: Any) -> str | None:
        return getattr(getattr(p, "_popen", None), "worker", None)


def make_engine(name: str, workers: int, start_method: str) -> Engine:
    if name == "multiprocessing":
        return MultiprocessingEngine(workers, start_method)
    return FiberDaskEngine(workers)


# ---------------------------------------------------------------- harness


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


class Run:
    """Processes of one case: started in order, results collected, always reaped."""

    def __init__(self, eng: Engine, timeout: float) -> None:
        self.eng = eng
        self.deadline = time.monotonic() + timeout
        self.timeout = timeout
        self.procs: list[Any] = []

    def start(self, target: Callable[..., Any], *args: Any) -> Any:
        p = self.eng.ctx.Process(target=target, args=args, daemon=True)
        p.start()
        self.procs.append(p)
        return p

    def get(self, q: Any, what: str) -> Any:
        """The next message on ``q``; fail fast if a child died, or past the deadline."""
        while True:
            try:
                return q.get(timeout=0.5)
            except stdqueue.Empty:
                pass
            for p in self.procs:
                if p.exitcode not in (None, 0):
                    raise CaseError(
                        f"{p.name} exited with {p.exitcode} while waiting for {what}"
                        + (f" ({p.reason})" if getattr(p, "reason", None) else "")
                    )
            if time.monotonic() > self.deadline:
                raise CaseError(f"no {what} within {self.timeout:g} s")

    def join(self) -> None:
        for p in self.procs:
            p.join(max(0.1, self.deadline - time.monotonic()))
            if p.exitcode is None:
                raise CaseError(f"{p.name} did not exit within {self.timeout:g} s")
            if p.exitcode != 0:
                raise CaseError(f"{p.name} exited with {p.exitcode}")

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *exc: Any) -> None:
        for p in self.procs:
            try:
                if p.exitcode is None:
                    p.kill()
                    p.join(10)
            except Exception:
                pass


#: (metric, label, number format, target kind) of every row, by case.
ROWS: dict[str, list[tuple[str, str, str]]] = {
    "ints": [("ints_per_s", "ints through a Queue (items/s)", "{:,.0f}")],
    "latency": [
        ("lat_p50_ms", "put->get latency p50 (ms)", "{:.3f}"),
        ("lat_p99_ms", "put->get latency p99 (ms)", "{:.3f}"),
        ("rtt_p50_ms", "ping-pong round trip p50 (ms)", "{:.3f}"),
    ],
    "queue10": [("queue10_mb_s", "{mb} MB payloads via Queue (MB/s)", "{:,.0f}")],
    "pipe10": [("pipe10_mb_s", "{mb} MB payloads via Pipe (MB/s)", "{:,.0f}")],
    "mem100": [
        ("mem_owner_x", "{big} MB object: parent/owner peak (x size)", "{:.2f}"),
        ("mem_consumer_x", "{big} MB object: consumer peak (x size)", "{:.2f}"),
        ("mem_producer_x", "{big} MB object: producer peak (x size)", "{:.2f}"),
    ],
    "start": [("start_s", "Process start->running (s)", "{:.3f}")],
}


class Benchmark(Harness):
    text_title = "Queues, Pipes, Processes: medians over interleaved repeats"
    markdown_title = "Queues, Pipes and Processes"
    ratio_note = f"(N x) = fiber_dask / {BASELINE} in the same run"
    cells_note = (
        f"cells: medians over the repeats; (N×) = fiber_dask ÷ {BASELINE} in "
        "the same run (items/s and MB/s: higher is better; ms, s and × size: "
        "lower is better)"
    )
    targets_title = "fiber_dask against the issue's targets"

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args)
        self.case_errors: list[str] = []
        self.values: dict[str, dict[str, list[float]]] = {}  # metric -> eng -> reps
        self.cold_start: dict[str, float] = {}
        self.placement: dict[str, list[bool]] = {}  # fiber: on different workers?
        self.command = "python " + " ".join(
            [os.path.relpath(sys.argv[0]) if sys.argv else "benchmarks/queues.py"]
            + sys.argv[1:]
        )

    def failures(self) -> bool:
        return bool(self.failed or self.case_errors)

    def record(self, metric: str, eng: Engine, value: float) -> None:
        self.values.setdefault(metric, {}).setdefault(eng.name, []).append(value)

    # -- phases

    def prepare_and_start(self) -> list[Engine]:
        a = self.args
        active = []
        for name in a.engines:
            eng = make_engine(name, a.workers, a.start_method)
            self.engines.append(eng)
            log(f"starting {name} ...", a.quiet)
            self.live.append(eng)
            try:
                eng.prepare()
                # Cold: the forkserver, or the whole embedded cluster, starts here.
                dt = self.start_once(eng, a.timeout)
            except Exception as e:
                self.failed[name] = f"setup: {type(e).__name__}: {e}"
                log(f"note: {name} failed in {self.failed[name]}")
                self.teardown_one(eng)
                continue
            self.cold_start[name] = dt
            log(f"  {name}: first Process running {dt:.2f} s after start()", a.quiet)
            active.append(eng)
        return active

    def start_once(self, eng: Engine, timeout: float) -> float:
        q = eng.ctx.Queue()
        with Run(eng, timeout) as run:
            t0 = time.time()
            run.start(report_started, q)
            t = run.get(q, "the child's start time")
            run.join()
        return t - t0

    def measure(self, active: list[Engine]) -> None:
        a = self.args
        for r in range(a.repeats):
            for ci, case in enumerate(a.cases):
                parts = []
                for eng in rotated(active, r + ci):
                    if eng.name in self.failed:
                        continue
                    gc.collect()
                    try:
                        parts.append(f"{eng.name} {getattr(self, 'case_' + case)(eng)}")
                    except CaseError as e:
                        msg = f"[{r + 1}] {case}: {e}"
                        self.case_errors.append(f"{eng.name}: {msg}")
                        log(f"note: {eng.name} failed in {msg}")
                        parts.append(f"{eng.name} FAILED")
                log(f"[{r + 1}/{a.repeats}] {case:<8} " + "  ".join(parts), a.quiet)
            self.repeats_done = r + 1

    # -- cases; each returns a short progress string

    def case_ints(self, eng: Engine) -> str:
        n = self.args.items
        q, res = eng.ctx.Queue(), eng.ctx.Queue()
        with Run(eng, self.args.timeout) as run:
            c = run.start(consume_ints, q, res, n)
            run.get(res, "the consumer's ready")
            p = run.start(produce_ints, q, n)
            _, t0, t1, count, total = run.get(res, "the consumer's result")
            run.join()
            self.note_placement(eng, p, c)
        if count != n or total != n * (n - 1) // 2:
            raise CaseError(f"wrong ints: {count} items, sum {total}")
        rate = (n - 1) / (t1 - t0)
        self.record("ints_per_s", eng, rate)
        return f"{rate:,.0f}/s"

    def case_latency(self, eng: Engine) -> str:
        a, b, res = eng.ctx.Queue(), eng.ctx.Queue(), eng.ctx.Queue()
        n, warmup = self.args.pings, max(20, self.args.pings // 10)
        with Run(eng, self.args.timeout) as run:
            e = run.start(pong, a, b, res)
            run.get(res, "the echo process's ready")
            p = run.start(ping, a, b, res, n, warmup)
            _, one_way, rtt = run.get(res, "the ping-pong result")
            run.join()
            self.note_placement(eng, p, e)
        if len(rtt) != n:
            raise CaseError(f"{len(rtt)} round trips of {n}")
        p50, p99 = percentile(one_way, 50) * 1e3, percentile(one_way, 99) * 1e3
        self.record("lat_p50_ms", eng, p50)
        self.record("lat_p99_ms", eng, p99)
        self.record("rtt_p50_ms", eng, percentile(rtt, 50) * 1e3)
        return f"p50 {p50:.3f} ms p99 {p99:.3f} ms"

    def _payloads(self, eng: Engine, kind: str) -> float:
        count, size = self.args.payloads, int(self.args.payload_mb * MB)
        res = eng.ctx.Queue()
        if kind == "queue":
            src = dst = eng.ctx.Queue()
        else:
            src, dst = eng.ctx.Pipe(duplex=False)
        with Run(eng, self.args.timeout) as run:
            c = run.start(consume_payloads, src, res, count, size, kind)
            run.get(res, "the consumer's ready")
            p = run.start(produce_payloads, dst, res, count, size, kind)
            got = dict(
                (m[0], m[1:]) for m in (run.get(res, "payload results") for _ in "pc")
            )
            run.join()
            self.note_placement(eng, p, c)
        if kind == "pipe":
            src.close()
            dst.close()
        (t0,), (t1, bad) = got["producer"], got["consumer"]
        if bad:
            raise CaseError(f"{bad} of {count} payloads arrived wrong")
        return count * size / MB / (t1 - t0)

    def case_queue10(self, eng: Engine) -> str:
        v = self._payloads(eng, "queue")
        self.record("queue10_mb_s", eng, v)
        return f"{v:,.0f} MB/s"

    def case_pipe10(self, eng: Engine) -> str:
        v = self._payloads(eng, "pipe")
        self.record("pipe10_mb_s", eng, v)
        return f"{v:,.0f} MB/s"

    def case_mem100(self, eng: Engine) -> str:
        size = int(self.args.big_mb * MB)
        q, res = eng.ctx.Queue(), eng.ctx.Queue()
        with Run(eng, self.args.timeout) as run:
            c = run.start(consume_big, q, res, size)
            run.get(res, "the consumer's ready")
            with SampledPeak() as owner:
                p = run.start(produce_big, q, res, size)
                got = dict(
                    (m[0], m[1:])
                    for m in (run.get(res, "memory results") for _ in "pc")
                )
                run.join()
            self.note_placement(eng, p, c)
        (prod,), (cons, ok) = got["producer"], got["consumer"]
        if not ok:
            raise CaseError("the 100 MB object arrived wrong")
        vals = {
            "mem_owner_x": owner.increase / size,
            "mem_consumer_x": cons / size,
            "mem_producer_x": prod / size,
        }
        for k, v in vals.items():
            self.record(k, eng, v)
        return (
            f"owner {vals['mem_owner_x']:.2f}x consumer {vals['mem_consumer_x']:.2f}x "
            f"producer {vals['mem_producer_x']:.2f}x"
        )

    def case_start(self, eng: Engine) -> str:
        samples = [
            self.start_once(eng, self.args.timeout) for _ in range(self.args.starts)
        ]
        v = median(samples)
        self.record("start_s", eng, v)
        return f"{v:.3f} s (min {min(samples):.3f}, max {max(samples):.3f})"

    def note_placement(self, eng: Engine, p: Any, c: Any) -> None:
        wp, wc = eng.where(p), eng.where(c)
        if wp and wc:
            self.placement.setdefault(eng.name, []).append(wp != wc)

    # -- reporting

    def measured(self) -> list[str]:
        return [e.name for e in self.engines if e.name in self.cold_start]

    def med(self, metric: str, name: str) -> float:
        return median(self.values.get(metric, {}).get(name, []))

    def label(self, text: str) -> str:
        a = self.args
        return text.format(mb=f"{a.payload_mb:g}", big=f"{a.big_mb:g}")

    def rows(self, x: str, arrow: str) -> tuple[list[str], list[list[str]]]:
        names = self.measured()
        base = BASELINE if BASELINE in names else None
        header = ["case", *names]

        def cell(value: float, base_value: float, fmt: str, name: str) -> str:
            ratio = (
                base
                and name != BASELINE
                and base_value > 0
                and not math.isnan(base_value)
                # tiny baselines (the stdlib parent never holds the item) say nothing
                and not (fmt == "{:.2f}" and base_value < 0.05)
            )
            return format_cell(value, fmt, base_value if ratio else None, x)

        out = []
        for case in self.args.cases:
            for metric, label, fmt in ROWS[case]:
                meds = {n: self.med(metric, n) for n in names}
                b = meds[base] if base else float("nan")
                lab = self.label(label).replace("->", arrow)
                if x != "x":
                    lab = lab.replace("(x size)", f"({x} size)")
                out.append([lab, *(cell(meds[n], b, fmt, n) for n in names)])
        cs = {n: self.cold_start.get(n, float("nan")) for n in names}
        b = cs[base] if base else float("nan")
        out.append(
            [
                f"first Process start{arrow}running, cold (s)",
                *(cell(cs[n], b, "{:.3f}", n) for n in names),
            ]
        )
        return header, out

    def target_rows(self, x: str = "x") -> list[list[str]]:
        names = self.measured()
        if "fiber_dask" not in names:
            return []
        le, ge = ("<=", ">=") if x == "x" else ("≤", "≥")
        arrow = "->" if x == "x" else "→"
        a = self.args
        out = []

        def row(what: str, value: float, shown: str, limit: str, ok: bool) -> None:
            if not math.isnan(value):
                out.append([what, shown, limit, "ok" if ok else "MISSED"])

        fd = self.med
        ints = fd("ints_per_s", "fiber_dask")
        row(
            "ints through a Queue",
            ints,
            f"{ints:,.0f}/s",
            f"{ge} {INTS_TARGET:,.0f}/s",
            ints >= INTS_TARGET,
        )
        mp_ints = fd("ints_per_s", BASELINE)
        if not math.isnan(mp_ints) and mp_ints > 0:
            ratio = ints / mp_ints
            row(
                "ints vs multiprocessing.Queue",
                ratio,
                f"{ratio:.2f}{x}",
                f"{ge} {INTS_RATIO_TARGET:.2f}{x}",
                ratio >= INTS_RATIO_TARGET,
            )
        lat = fd("lat_p50_ms", "fiber_dask")
        row(
            f"put{arrow}get latency p50",
            lat,
            f"{lat:.3f} ms",
            f"{le} {LATENCY_TARGET_MS:g} ms",
            lat <= LATENCY_TARGET_MS,
        )
        for metric, via in (("queue10_mb_s", "Queue"), ("pipe10_mb_s", "Pipe")):
            v = fd(metric, "fiber_dask")
            row(
                f"{a.payload_mb:g} MB payloads via {via}",
                v,
                f"{v:,.0f} MB/s",
                f"{ge} {BANDWIDTH_TARGET:g} MB/s",
                v >= BANDWIDTH_TARGET,
            )
        mem = max(fd("mem_owner_x", "fiber_dask"), fd("mem_consumer_x", "fiber_dask"))
        row(
            f"{a.big_mb:g} MB object: peak of parent/owner and consumer",
            mem,
            f"{mem:.2f}{x}",
            f"{le} {MEMORY_TARGET_X:g}{x}",
            mem <= MEMORY_TARGET_X,
        )
        st = fd("start_s", "fiber_dask")
        row(
            f"Process start{arrow}running",
            st,
            f"{st:.3f} s",
            f"{le} {START_TARGET_S:g} s",
            st <= START_TARGET_S,
        )
        return out

    def meta_lines(self) -> list[str]:
        a = self.args
        lines = [
            f"command: `{self.command}`",
            self.machine_line(),
            self.repeats_note()
            + f"; {a.items:,} ints, {a.pings:,} ping-pongs, {a.payloads} x "
            f"{a.payload_mb:g} MB payloads, one {a.big_mb:g} MB object, "
            f"{a.starts} starts per repeat",
        ]
        lines += self.engine_lines()
        lines += [f"error: {e}" for e in self.case_errors]
        return lines

    def engine_note(self, eng: Engine) -> str:
        pl = self.placement.get(eng.name)
        if not pl:
            return ""
        return (
            f"; producer and consumer on different Dask workers in "
            f"{sum(pl)} of {len(pl)} runs"
        )

    def table(self, x: str) -> tuple[list[str], list[list[str]]]:
        return self.rows(x, "->" if x == "x" else "→")

    def json_report(self) -> dict[str, Any]:
        return {
            "command": self.command,
            **self.machine_json(),
            "args": {k: v for k, v in vars(self.args).items()},
            "repeats_done": self.repeats_done,
            "interrupted": self.interrupted,
            "engines": self.engines_json(),
            "cold_start_s": self.cold_start,
            "values_per_repeat": self.values,
            "different_workers": self.placement,
            "errors": self.case_errors,
        }


# --------------------------------------------------------------------------- CLI


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--workers",
        type=int,
        default=2,
        help="Dask workers of fiber_dask's embedded cluster (default 2)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="interleaved repeats (default 3, --quick 2)",
    )
    p.add_argument(
        "--items",
        type=int,
        default=None,
        help="ints per throughput run (default 50000, --quick 20000)",
    )
    p.add_argument(
        "--pings",
        type=int,
        default=None,
        help="timed ping-pongs per latency run, after pings/10 (at least 20) "
        "untimed ones (default 2000, --quick 500)",
    )
    p.add_argument(
        "--payloads",
        type=int,
        default=None,
        help="payloads per bandwidth run (default 20, --quick 10)",
    )
    p.add_argument(
        "--payload-mb",
        type=float,
        default=10.0,
        help="payload size in MB of 10^6 bytes (default 10)",
    )
    p.add_argument(
        "--big-mb",
        type=float,
        default=100.0,
        help="size of the object of the memory case, MB (default 100)",
    )
    p.add_argument(
        "--starts",
        type=int,
        default=None,
        help="Processes started per start-latency run (default 10, --quick 5)",
    )
    add_choice_list(p, "--cases", CASES)
    add_choice_list(p, "--engines", ENGINE_NAMES)
    p.add_argument(
        "--quick",
        action="store_true",
        help="2 repeats and smaller counts (explicit flags win)",
    )
    add_start_method_option(p)
    p.add_argument(
        "--timeout",
        type=float,
        default=120.0,
        help="seconds one case may take before it counts as failed (default 120)",
    )
    add_output_options(p, "also write every raw value as JSON")
    a = p.parse_args(argv)
    q = a.quick
    a.repeats = a.repeats or (2 if q else 3)
    a.items = a.items or (20_000 if q else 50_000)
    a.pings = a.pings or (500 if q else 2000)
    a.payloads = a.payloads or (10 if q else 20)
    a.starts = a.starts or (5 if q else 10)
    a.engines = check_choices(p, a.engines, ENGINE_NAMES, "engine")
    a.cases = check_choices(p, a.cases, CASES, "case")
    if (
        min(a.repeats, a.items, a.pings, a.payloads, a.starts, a.workers) < 1
        or min(a.payload_mb, a.big_mb) <= 0
    ):
        p.error("counts must be >= 1 and sizes > 0")
    if a.items < 2:
        p.error("--items must be >= 2")
    return a


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    prepare_main(args)
    bench = Benchmark(args)

    def measure() -> int:
        active = bench.prepare_and_start()
        if not active:
            log("error: no engine could be started")
            return 1
        bench.measure(active)
        return 0

    return bench.run(measure)


if __name__ == "__main__":
    # The children must get the targets by reference (``benchmarks.queues.<name>``),
    # not as ``__main__.<name>``, which cloudpickle would ship by value.
    import benchmarks.queues as _module

    sys.exit(_module.main())
