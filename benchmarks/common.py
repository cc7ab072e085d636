"""Task functions and the harness shared by the benchmarks.

The task functions live in this importable module, not in the benchmark script, so
every engine ships them *by reference* (module + name), the way a real user's library
function travels: stdlib ``pickle`` under ``spawn``/``forkserver``, cloudpickle in Dask
and fiber-dask, Ray and IPyParallel all send ``benchmarks.common.busy`` as a name that
the worker imports. The benchmark puts the repository root on ``sys.path`` and on
``PYTHONPATH`` so that every worker process started on this machine can import it.

The harness below (memory probes, cleanup, the run and its teardown, the command
line's common options) serves every benchmark; ``report.py`` formats the reports and
``engines.py`` adds the engines compared and their life cycle. Child processes import
this module, so its top level imports only the standard library (and ``report.py``,
which does the same): no dask, no psutil.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import re
import signal
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from benchmarks.report import Report

#: Repository root (the parent of ``benchmarks/``).
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def busy(seconds: float) -> float:
    """Keep one CPU busy for ``seconds`` of wall-clock time and return ``seconds``.

    A busy-wait rather than ``time.sleep``: the point of the experiment is CPU-bound
    work competing with the framework's own processes for the same cores.
    """
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass
    return seconds


def cpu_work(loops: int) -> tuple[float, float]:
    """A fixed amount of real CPU work (``loops`` turns of a pure-Python loop).

    Unlike :func:`busy`, which waits on the wall clock and so cannot see CPU
    taken from it, this takes longer when something else runs on its core or
    holds its GIL.  Returns ``(wall, thread_cpu)`` seconds measured inside the
    task: ``wall / thread_cpu`` is 1.00 when the task had its core to itself.
    """
    w0, c0 = time.perf_counter(), time.thread_time()
    x = 0
    for i in range(loops):
        x += i * i
    return time.perf_counter() - w0, time.thread_time() - c0


def cpu_work_shares(loops: int) -> tuple[float, float, float]:
    """:func:`cpu_work`, also returning the CPU seconds the *other* threads of
    the task's process used meanwhile (``process_time - thread_time``): the
    framework's threads competing for the task's GIL and core."""
    p0 = time.process_time()
    wall, cpu = cpu_work(loops)
    return wall, cpu, max(0.0, time.process_time() - p0 - cpu)


def calibrate_cpu_work(seconds: float, rounds: int = 5) -> int:
    """Loops of :func:`cpu_work` that take ``seconds`` of CPU here (the best of
    ``rounds`` short runs, so a busy moment does not inflate it)."""
    n = 200_000
    best = min(cpu_work(n)[1] or 1e-9 for _ in range(rounds))
    return max(1, round(n * seconds / best))


def cartpole_fixed_cost(task: tuple, batch: int = 16, steps: int = 500) -> float:
    """An ES evaluation whose cost never varies: ``examples.es.evaluate``'s task
    tuple, played as ``batch`` CartPole-v1 episodes stepped together with numpy
    for exactly ``steps`` steps; an episode that ends stops counting reward
    (masked) but the batch keeps stepping.  The real evaluation's cost follows
    the episode lengths (short early, 500 steps once solved); this one lets the
    time per iteration show only the framework.  Linear policies only.
    """
    import numpy as np

    theta, noise_seed, sign, sigma, episode_seed, _episodes, _hidden, _kind = task
    params = theta
    if sign:
        params = theta + (sign * sigma) * np.random.default_rng(
            noise_seed
        ).standard_normal(theta.size)
    rng = np.random.default_rng(episode_seed)
    x, x_dot, th, th_dot = rng.uniform(-0.05, 0.05, size=(4, batch))
    alive = np.ones(batch, dtype=bool)
    total = np.zeros(batch)
    # CartPole-v1's constants and Euler integration (gymnasium's cartpole.py).
    g, mc, mp, length, fmag, tau = 9.8, 1.0, 0.1, 0.5, 10.0, 0.02
    mt, pml = mc + mp, mp * 0.5
    for _ in range(steps):
        out = params[0] * x + params[1] * x_dot + params[2] * th + params[3] * th_dot
        force = np.where(out + params[4] > 0, fmag, -fmag)
        cos, sin = np.cos(th), np.sin(th)
        temp = (force + pml * th_dot * th_dot * sin) / mt
        th_acc = (g * sin - cos * temp) / (length * (4.0 / 3.0 - mp * cos * cos / mt))
        x_acc = temp - pml * th_acc * cos / mt
        x, x_dot = x + tau * x_dot, x_dot + tau * x_acc
        th, th_dot = th + tau * th_dot, th_dot + tau * th_acc
        total += alive
        alive &= (np.abs(x) <= 2.4) & (np.abs(th) <= 0.2095)
    return float(total.mean())


def noop(*args: object) -> None:
    """Do nothing; used for startup and round-trip latency measurements."""
    return None


def square(x: int) -> int:
    """``x * x``: a trivial task whose results can be checked (memory.py)."""
    return x * x


def ensure_importable() -> None:
    """Make ``benchmarks.common`` importable here and in every child process.

    ``python benchmarks/overhead.py`` puts ``benchmarks/`` on ``sys.path``, not the
    repository root; children (forkserver, Dask nannies' spawned workers, Ray workers,
    IPyParallel engines) inherit ``PYTHONPATH`` from the environment.
    """
    if REPO_ROOT not in sys.path:
        sys.path.insert(0, REPO_ROOT)
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if REPO_ROOT not in parts:
        os.environ["PYTHONPATH"] = os.pathsep.join([REPO_ROOT, *parts])


def median(values: Iterable[float]) -> float:
    """Median of ``values``, ``nan`` when there are none."""
    values = list(values)
    return statistics.median(values) if values else float("nan")


# ---------------------------------------------------------------- memory probes


def _status_kb(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            m = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M)
        return int(m.group(1)) if m else None
    except OSError:
        return None


def _reset_peak() -> bool:
    """Reset this process's peak RSS (VmHWM) to its current RSS (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def rss_bytes() -> int:
    kb = _status_kb("VmRSS")
    if kb is not None:
        return kb * 1024
    import resource  # no /proc: the best we have is the peak so far

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def peak_bytes() -> int:
    kb = _status_kb("VmHWM")
    if kb is not None:
        return kb * 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class PeakProbe:
    """Peak RSS increase of this process between ``start()`` and ``stop()``."""

    def start(self) -> PeakProbe:
        gc.collect()
        self.base = rss_bytes()
        self.exact = _reset_peak()
        return self

    def stop(self) -> int:
        return max(0, peak_bytes() - self.base)


class SampledPeak:
    """The parent's peak RSS increase: VmHWM reset where Linux allows, else psutil
    sampled every millisecond in a thread."""

    def __enter__(self) -> SampledPeak:
        self.probe = PeakProbe().start()
        self.max_rss = self.probe.base
        self._stop = threading.Event()
        self._thread = None
        if not self.probe.exact:
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        try:
            import psutil

            me = psutil.Process()
            while not self._stop.wait(0.001):
                self.max_rss = max(self.max_rss, me.memory_info().rss)
        except ImportError:
            pass

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self.probe.exact:
            self.increase = self.probe.stop()
        else:
            self.increase = max(0, self.max_rss - self.probe.base)


# --------------------------------------------------------------------------- harness


def idle_cpu_percent(seconds: float) -> float:
    """CPU used by this process and all its children while we sleep, in % of a core.

    What the engines that are up burn in the background (heartbeats, monitors) --
    CPU that every engine measured meanwhile on the same cores does not get.
    """
    if seconds <= 0:
        return float("nan")
    try:
        import psutil
    except ImportError:
        return float("nan")

    def total() -> float:
        t = 0.0
        for p in [psutil.Process(), *psutil.Process().children(recursive=True)]:
            try:
                c = p.cpu_times()
                t += c.user + c.system
            except psutil.Error:
                pass
        return t

    before, t0 = total(), time.perf_counter()
    time.sleep(seconds)
    return 100 * (total() - before) / (time.perf_counter() - t0)


def log(msg: str, quiet: bool = False) -> None:
    if not quiet:
        print(msg, file=sys.stderr, flush=True)


def rotated(items: Sequence[Any], k: int) -> list[Any]:
    """``items`` starting at index ``k`` (mod len), so every item gets to go first."""
    n = len(items)
    return [items[(i + k) % n] for i in range(n)]


class CaseTimeout(Exception):
    """A single measured call took longer than ``--timeout``."""


def _on_alarm(signum: int, frame: Any) -> None:
    raise CaseTimeout


def timed(fn: Callable[[], Any], timeout: float) -> tuple[float, Any]:
    """Run ``fn()``; return (seconds, result). Raise :class:`CaseTimeout` past timeout.

    SIGALRM interrupts the main thread's blocking waits, so a hung engine costs one
    timeout instead of the whole run.
    """
    old = signal.signal(signal.SIGALRM, _on_alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        t0 = time.perf_counter()
        out = fn()
        return time.perf_counter() - t0, out
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def stop_forkserver(timeout: float | None = None) -> None:
    """Stop the stdlib forkserver now, so no process outlives the run even briefly.

    Otherwise it only exits on noticing our exit, a moment after we are gone. With a
    ``timeout`` the stop runs under :func:`timed` and nothing it raises escapes (not
    even a second Ctrl-C); without one, an ``Exception`` is noted and that is all.
    """
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    if server is None or not hasattr(server, "_stop"):
        return
    caught = Exception if timeout is None else BaseException
    try:
        if timeout is None:
            server._stop()
        else:
            timed(server._stop, timeout)
    except caught as e:
        log(f"note: could not stop the forkserver: {type(e).__name__}: {e}")


def reap_children(grace: float = 10.0) -> list[str]:
    """Wait for this process's children to exit; kill stragglers; describe them.

    The forkserver and the resource tracker are left alone: they exit with us.
    """
    try:
        import psutil
    except ImportError:
        return []
    benign = ("multiprocessing.forkserver", "multiprocessing.resource_tracker")

    def leftovers() -> list[Any]:
        out = []
        for p in psutil.Process().children(recursive=True):
            try:
                cmd = " ".join(p.cmdline())
                if p.status() == psutil.STATUS_ZOMBIE or any(b in cmd for b in benign):
                    continue
            except psutil.Error:
                continue
            out.append(p)
        return out

    deadline = time.monotonic() + grace
    procs = leftovers()
    while procs and time.monotonic() < deadline:
        time.sleep(0.2)
        procs = leftovers()
    described = []
    for p in procs:
        try:
            described.append(f"pid {p.pid}: {' '.join(p.cmdline())[:100]}")
            p.kill()
        except psutil.Error:
            pass
    return described


def _raise_keyboard_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _default_sigterm() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def prepare_main(args: argparse.Namespace) -> None:
    """What ``main()`` does before the run: imports, log levels, SIGTERM."""
    ensure_importable()
    if not args.verbose:
        # Shutdown chatter ("Stream is closed", ...) from the in-process nannies.
        logging.getLogger("distributed").setLevel(logging.ERROR)
    # A plain `kill` should clean up as well as Ctrl-C does.  Only here: a
    # process forked from this one (the stdlib Pool's workers) gets SIGTERM's
    # default back, as it would have without the benchmark, so that
    # ``Pool.terminate()`` kills its workers at once.  With the handler
    # inherited, a worker that the signal reached still in its bootstrap went
    # on to block on the pool's queue lock, and ``terminate()`` waited on it
    # for ever (seen in scaling.py at 1024 slots).
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    os.register_at_fork(after_in_child=_default_sigterm)


class Harness(Report):
    """A run of a benchmark: its measuring, its teardown, then its reports.

    On top of :class:`~benchmarks.report.Report` (what a subclass provides for the
    reports): ``args`` (``verbose``, ``quiet``, ``markdown``, ``json``, ``timeout``)
    and the engines' life cycle. Engines have ``teardown()``.
    """

    #: Seconds for one engine's teardown and for stopping the forkserver; ``None``
    #: calls them plainly (see :func:`stop_forkserver`).
    teardown_timeout: float | None = None
    forkserver_timeout: float | None = None

    #: The meta line of a run whose engines all reached the same result.
    same_result_line = (
        "every engine reached the same final parameters (checked bit for bit)"
    )

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.args = args
        self.active: list[Any] = []  # set up, being measured, not failed
        self.live: list[Any] = []  # started, teardown() not yet
        # case -> the final parameters the first engine reached in it; every
        # other engine must reach them bit for bit (same seeds, same results
        # in the same order).
        self.reference: dict[Any, Any] = {}
        self.mismatched = False

    def check_same_result(self, case: Any, theta: Any) -> None:
        """Raise if ``theta`` (a numpy array) differs from the first engine's
        for ``case``; the first one sets it."""
        ref = self.reference.setdefault(case, theta)
        if not (theta == ref).all():
            self.mismatched = True
            raise RuntimeError(
                f"different result: final parameters {theta} instead of {ref}"
            )

    def failures(self) -> bool:
        """Whether anything failed, so that the run exits with status 2."""
        return bool(self.failed)

    # -- teardown

    def teardown_one(self, eng: Any) -> None:
        if eng not in self.live:
            return
        self.live.remove(eng)
        if not self.args.verbose:
            # A LocalCluster restores the log level it found when it started, which
            # may be INFO again if another cluster closed in between.
            logging.getLogger("distributed").setLevel(logging.ERROR)
        try:
            if self.teardown_timeout is None:
                eng.teardown()
            else:
                timed(eng.teardown, self.teardown_timeout)
        except BaseException as e:  # keep tearing the others down on a second Ctrl-C
            log(f"note: teardown of {eng.name} failed: {type(e).__name__}: {e}")

    def teardown_all(self) -> None:
        self.active = []
        if self.interrupted and not self.args.verbose:
            # Futures cut off mid-gather log "Task exception was never retrieved".
            logging.getLogger("asyncio").setLevel(logging.CRITICAL)
        for eng in list(self.live):
            log(f"stopping {eng.name} ...", self.args.quiet)
            self.teardown_one(eng)
        stop_forkserver(self.forkserver_timeout)
        for s in reap_children():
            log(f"warning: killed a leftover child process, {s}")
        self.load_after = os.getloadavg()

    def fail(self, eng: Any, what: str, e: BaseException) -> None:
        """Note that ``eng`` failed in ``what``, drop it from the run, tear it down."""
        msg = f"{what}: {type(e).__name__}: {e}".rstrip(": ")
        if isinstance(e, CaseTimeout):
            msg = f"{what}: timed out after {self.args.timeout:g} s"
        self.failed[eng.name] = msg
        log(f"note: {eng.name} failed in {msg}; dropping it from the run")
        if eng in self.active:
            self.active.remove(eng)
        self.teardown_one(eng)

    # -- the run

    def run(self, measure: Callable[[], int]) -> int:
        """``measure()``, then teardown and every report; the exit status.

        That is ``measure()``'s, or 2 if it was 0 but something failed. Ctrl-C (or
        SIGTERM) stops the measuring with status 130; what was measured by then is
        still reported.
        """
        args = self.args
        status = 0
        try:
            status = measure()
        except KeyboardInterrupt:
            self.interrupted = True
            status = 130
            log("interrupted; cleaning up and reporting what was measured")
        finally:
            self.teardown_all()

        if self.measured():
            print(self.text_report(), flush=True)
            if args.markdown:
                with open(args.markdown, "w") as f:
                    f.write(self.markdown_report())
                log(f"wrote {args.markdown}", args.quiet)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(self.json_report(), f, indent=2)
                f.write("\n")
            log(f"wrote {args.json}", args.quiet)
        if status == 0 and self.failures():
            status = 2
        return status


# --------------------------------------------------------------------------- CLI


def csv_of(convert: Callable[[str], Any]) -> Callable[[str], list[Any]]:
    """An argparse ``type``: comma-separated values, each through ``convert``."""
    return lambda s: [convert(x.strip()) for x in s.split(",") if x.strip()]


def add_start_method_option(p: argparse.ArgumentParser) -> None:
    import multiprocessing

    p.add_argument(
        "--start-method",
        default="forkserver",
        choices=multiprocessing.get_all_start_methods(),
        help="multiprocessing start method (default forkserver)",
    )


def add_output_options(p: argparse.ArgumentParser, json_help: str) -> None:
    """``--markdown``, ``--json``, ``--quiet``, ``--verbose``."""
    p.add_argument("--markdown", metavar="FILE", help="also write a markdown table")
    p.add_argument("--json", metavar="FILE", help=json_help)
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    p.add_argument(
        "--verbose", action="store_true", help="keep distributed's warnings in the log"
    )


def add_choice_list(
    p: argparse.ArgumentParser, flag: str, choices: Sequence[str], more: str = ""
) -> None:
    """``flag``: some of ``choices``, comma-separated, all of them by default."""
    p.add_argument(
        flag,
        type=csv_of(str),
        default=list(choices),
        help=f"comma-separated (default {','.join(choices)}){more}",
    )


def check_choices(
    p: argparse.ArgumentParser, values: list[str], choices: Sequence[str], what: str
) -> list[str]:
    """Exit with a usage error if one of ``values`` is not one of ``choices``;
    ``values`` without repeats."""
    for v in values:
        if v not in choices:
            p.error(f"unknown {what} {v!r}; choose from {', '.join(choices)}")
    return list(dict.fromkeys(values))


def run_json_program(script: str, args: list[str], workers: int) -> dict:
    """Run ``script`` with ``args`` in a fresh interpreter (the repository on
    its import path, ``workers`` embedded-cluster workers) and return the JSON
    object its last line of output holds; RuntimeError with its stderr if it
    failed."""
    import subprocess

    env = dict(os.environ)
    env["DASK_FIBER__LOCAL__N_WORKERS"] = str(workers)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (REPO_ROOT, env.get("PYTHONPATH")) if p
    )
    out = subprocess.run(
        [sys.executable, script, *args],
        env=env, capture_output=True, text=True, timeout=600, cwd=REPO_ROOT,
    )  # fmt: skip
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({out.returncode}):\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])
