"""The engines the benchmarks compare, behind one small interface.

``multiprocessing`` (the stdlib Pool, the baseline), ``fiber_dask`` (its Pool on
the embedded local cluster), ``dask`` (plain ``Client.map``/``submit`` on a
``LocalCluster``), ``ray`` (``ray.util.multiprocessing.Pool``) and
``ipyparallel`` (a load-balanced view). Each is imported only in ``prepare()``, so
a missing one is skipped with a note (:class:`Skip`) and this module's top level
imports only the standard library.

``map(func, items)`` is what ``es.py`` times; ``run(mode, args)`` and
``call_noop()`` are the three hand-over modes and the round trip of
``overhead.py``.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing
import platform
import shutil
import tempfile
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from benchmarks.common import (
    Harness,
    busy,
    idle_cpu_percent,
    log,
    noop,
    rotated,
    stop_forkserver,
    timed,
)

ENGINE_NAMES = (
    "multiprocessing",
    "fiber_dask",
    "fiber_dask_thread",
    "dask",
    "ray",
    "ipyparallel",
)
BASELINE = "multiprocessing"


class Skip(Exception):
    """The engine is not available here (not installed, not implemented yet)."""


# --------------------------------------------------------------------------- engines


class Engine:
    """One framework under test.

    ``prepare()`` imports (untimed, may raise :class:`Skip`); ``setup()`` is timed by
    the harness and must return only once a first trivial task has come back;
    ``run()`` returns the results of one case; ``call_noop()`` is one sequential round
    trip; ``teardown()`` must release every process the engine started.
    """

    name = "?"

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self.version = "?"
        self.note = ""

    def prepare(self) -> None:
        pass

    def setup(self) -> None:
        raise NotImplementedError

    def run(self, mode: str, args: list[Any], func: Callable = busy) -> list[Any]:
        raise NotImplementedError

    def map(self, func: Callable[[Any], Any], items: list[Any]) -> list[Any]:
        """``[func(x) for x in items]``, in order, the engine's usual way."""
        raise NotImplementedError

    def call_noop(self) -> None:
        """One sequential round trip of a trivial task (``pool.apply(noop)``)."""
        raise NotImplementedError

    def teardown(self) -> None:
        pass


class PoolEngine(Engine):
    """Anything with the ``multiprocessing.Pool`` API in ``self.pool``."""

    pool: Any = None

    def map(self, func: Callable[[Any], Any], items: list[Any]) -> list[Any]:
        return self.pool.map(func, items)

    def run(self, mode: str, args: list[Any], func: Callable = busy) -> list[Any]:
        pool = self.pool
        if mode == "map":
            return pool.map(func, args)
        if mode == "imap1":
            return list(pool.imap(func, args, chunksize=1))
        if mode == "apply_async":
            pending = [pool.apply_async(func, (a,)) for a in args]
            return [r.get() for r in pending]
        raise ValueError(mode)

    def call_noop(self) -> None:
        self.pool.apply(noop)

    def teardown(self) -> None:
        if self.pool is not None:
            pool, self.pool = self.pool, None
            pool.terminate()
            pool.join()


class MultiprocessingEngine(PoolEngine):
    name = "multiprocessing"

    def __init__(self, workers: int, start_method: str = "forkserver") -> None:
        super().__init__(workers)
        self.start_method = start_method
        self.version = platform.python_version()
        self.note = f"start method {start_method!r}"
        if start_method != "fork":
            self.note += " (fork would start faster)"

    def setup(self) -> None:
        ctx = multiprocessing.get_context(self.start_method)
        self.pool = ctx.Pool(self.workers)
        self.pool.apply(noop)


class FiberDaskEngine(PoolEngine):
    name = "fiber_dask"

    def prepare(self) -> None:
        import dask

        # Must be set before fiber_dask starts its embedded cluster.
        dask.config.set({"fiber.local.n-workers": self.workers})
        try:
            import fiber_dask
        except ImportError as e:
            raise Skip(f"cannot import fiber_dask: {e}") from e
        if not hasattr(fiber_dask, "Pool"):
            raise Skip("fiber_dask has no Pool (yet)")
        self.fiber_dask = fiber_dask
        self.version = getattr(fiber_dask, "__version__", "?")
        self.note = "embedded local cluster"
        address = dask.config.get("scheduler-address", None) or dask.config.get(
            "fiber.address", None
        )
        if address:
            self.note = f"scheduler-address/fiber.address is set ({address})!"

    def setup(self) -> None:
        self.pool = self.fiber_dask.Pool(self.workers)
        self.pool.apply(noop)
        self.on_cluster()

    def on_cluster(self) -> None:
        """Wait until the embedded cluster is up and the pool's slots are its
        own: a program's first pool starts on early slots while the cluster
        starts (fiber_dask.engine.earlyslots), whose start (importing
        distributed, the scheduler) would fall inside the first measurement.
        These benchmarks measure a pool at work; coldstart.py the start."""
        self.fiber_dask.get_client()
        deadline = time.monotonic() + 120
        while not all(slot.worker for slot in self.pool._pool):
            if time.monotonic() > deadline:
                raise RuntimeError("the pool's slots never moved to the cluster")
            time.sleep(0.01)

    def teardown(self) -> None:
        try:
            super().teardown()
        finally:
            self.fiber_dask.shutdown()


class FiberDaskThreadEngine(FiberDaskEngine):
    """fiber_dask with ``fiber.pool.slots: thread``: tasks in the Dask worker's
    task thread (the behaviour before slot processes), for comparison.  Alive
    beside ``fiber_dask`` it shares its embedded cluster, which then grows to
    both pools' slots (``--isolate`` keeps them apart)."""

    name = "fiber_dask_thread"

    def prepare(self) -> None:
        super().prepare()
        self.note += ", fiber.pool.slots: thread"

    def setup(self) -> None:
        import dask

        with dask.config.set({"fiber.pool.slots": "thread"}):
            self.pool = self.fiber_dask.Pool(self.workers)
        self.pool.apply(noop)
        self.on_cluster()


class LocalClusterMixin:
    """``self.client`` on a ``distributed.LocalCluster`` of processes, whose
    workers keep their files in a temporary directory (``self.distributed`` is
    the imported module)."""

    distributed: Any
    client: Any = None
    cluster: Any = None
    tmpdir: str | None = None

    def start_cluster(self, n_workers: int, threads: int, prefix: str) -> None:
        self.tmpdir = tempfile.mkdtemp(prefix=prefix)
        self.cluster = self.distributed.LocalCluster(
            n_workers=n_workers,
            threads_per_worker=threads,
            processes=True,
            dashboard_address=":0",
            local_directory=self.tmpdir,
        )
        self.client = self.distributed.Client(self.cluster)

    def close_cluster(self) -> None:
        try:
            if self.client is not None:
                self.client.close()
            if self.cluster is not None:
                self.cluster.close()
        finally:
            self.client = self.cluster = None
            if self.tmpdir:
                shutil.rmtree(self.tmpdir, ignore_errors=True)
                self.tmpdir = None


class DaskEngine(LocalClusterMixin, Engine):
    """Plain Dask: a task per item, ``pure=False`` so identical calls stay distinct."""

    name = "dask"

    def prepare(self) -> None:
        try:
            import distributed
        except ImportError as e:
            raise Skip(f"cannot import distributed: {e}") from e
        self.distributed = distributed
        self.version = distributed.__version__
        self.note = "LocalCluster, processes, 1 thread each"
        self.client = self.cluster = self.tmpdir = None

    def setup(self) -> None:
        self.start_cluster(self.workers, 1, "overhead-dask-")
        self.client.submit(noop, pure=False).result()

    def run(self, mode: str, args: list[Any], func: Callable = busy) -> list[Any]:
        client = self.client
        if mode == "map":
            return client.gather(client.map(func, args, pure=False))
        if mode == "imap1":
            # Everything submitted at once, consumed one by one in order, like imap.
            futures = client.map(func, args, pure=False)
            return [f.result() for f in futures]
        if mode == "apply_async":
            futures = [client.submit(func, a, pure=False) for a in args]
            return client.gather(futures)
        raise ValueError(mode)

    def map(self, func: Callable[[Any], Any], items: list[Any]) -> list[Any]:
        return self.client.gather(self.client.map(func, items, pure=False))

    def call_noop(self) -> None:
        self.client.submit(noop, pure=False).result()

    def teardown(self) -> None:
        self.close_cluster()


class RayEngine(PoolEngine):
    name = "ray"

    def prepare(self) -> None:
        try:
            import ray
            from ray.util.multiprocessing import Pool
        except ImportError as e:
            raise Skip(f"cannot import ray: {e}") from e
        self.ray, self.Pool = ray, Pool
        self.version = ray.__version__
        self.note = "ray.util.multiprocessing.Pool"

    def setup(self) -> None:
        self.ray.init(num_cpus=self.workers, include_dashboard=False)
        self.pool = self.Pool(self.workers)
        self.pool.apply(noop)

    def teardown(self) -> None:
        try:
            super().teardown()
        finally:
            self.ray.shutdown()


class IPyParallelEngine(Engine):
    name = "ipyparallel"

    def prepare(self) -> None:
        try:
            import ipyparallel
        except ImportError as e:
            raise Skip(f"cannot import ipyparallel: {e}") from e
        self.ipp = ipyparallel
        self.version = ipyparallel.__version__
        self.note = "load-balanced view (map chunksize 1)"
        self.cluster = self.rc = self.view = None

    def setup(self) -> None:
        self.cluster = self.ipp.Cluster(n=self.workers)
        self.rc = self.cluster.start_and_connect_sync()
        self.view = self.rc.load_balanced_view()
        self.view.apply_sync(noop)

    def run(self, mode: str, args: list[Any], func: Callable = busy) -> list[Any]:
        view = self.view
        if mode == "map":
            return list(view.map_sync(func, args))
        if mode == "imap1":
            if hasattr(view, "imap"):
                return list(view.imap(func, args))
            return list(view.map(func, args, ordered=True, chunksize=1))
        if mode == "apply_async":
            pending = [view.apply_async(func, a) for a in args]
            return [r.get() for r in pending]
        raise ValueError(mode)

    def map(self, func: Callable[[Any], Any], items: list[Any]) -> list[Any]:
        return list(self.view.map_sync(func, items))

    def call_noop(self) -> None:
        self.view.apply_sync(noop)

    def teardown(self) -> None:
        try:
            if self.rc is not None:
                self.rc.close()
        finally:
            if self.cluster is not None:
                self.cluster.stop_cluster_sync()
            self.cluster = self.rc = self.view = None


def make_engine(name: str, workers: int, start_method: str) -> Engine:
    if name == "multiprocessing":
        return MultiprocessingEngine(workers, start_method)
    return {
        "fiber_dask": FiberDaskEngine,
        "fiber_dask_thread": FiberDaskThreadEngine,
        "dask": DaskEngine,
        "ray": RayEngine,
        "ipyparallel": IPyParallelEngine,
    }[name](workers)


class EngineHarness(Harness):
    """A :class:`Harness` whose engines come from this module: importing them,
    starting them (timed) with a warm-up, dropping one that fails.

    ``args`` needs ``engines``, ``workers``, ``start_method``, ``timeout`` and
    ``quiet``; a subclass may override :meth:`make` and :meth:`warm_up`.
    """

    teardown_timeout = 60
    forkserver_timeout = 10

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args)
        self.engines: list[Engine] = []  # all requested, in --engines order
        self.prepared: list[Engine] = []  # imported fine
        self.active: list[Engine] = []  # set up, being measured, not failed
        self.live: list[Engine] = []  # setup() attempted, teardown() not yet
        self.startup: dict[str, list[float]] = {}  # one per setup()
        self.idle_cpu: dict[str, float] = {}  # % of one core, whole process tree

    def make(self, name: str) -> Engine:
        a = self.args
        return make_engine(name, a.workers, a.start_method)

    def warm_up(self, eng: Engine) -> None:
        """Untimed, after setup: workers import benchmarks.common, caches fill."""
        eng.run("map", [0.001] * 4 * self.args.workers)

    def prepare_engines(self) -> None:
        """Import every requested engine; skip the unavailable ones with a note."""
        a = self.args
        for name in a.engines:
            eng = self.make(name)
            self.engines.append(eng)
            try:
                eng.prepare()
            except Skip as e:
                self.skipped[name] = str(e)
                log(f"note: skipping {name}: {e}")
                continue
            except Exception as e:
                self.failed[name] = f"import: {type(e).__name__}: {e}"
                log(f"note: {name} failed in {self.failed[name]}")
                continue
            self.prepared.append(eng)

    def start(self, eng: Engine) -> bool:
        """Set ``eng`` up (timed) and warm it up (untimed); False if that failed."""
        a = self.args
        log(f"starting {eng.name} ...", a.quiet)
        self.live.append(eng)  # so that Ctrl-C in the middle of setup cleans up
        try:
            dt, _ = timed(eng.setup, a.timeout)
            timed(partial(self.warm_up, eng), a.timeout)
        except Exception as e:
            self.fail(eng, "setup", e)
            return False
        self.startup.setdefault(eng.name, []).append(dt)
        log(f"  {eng.name} ready in {dt:.2f} s", a.quiet)
        return True

    def start_all(self) -> bool:
        """Start every prepared engine; whether any of them is up."""
        self.active = [eng for eng in self.prepared if self.start(eng)]
        return bool(self.active)

    def measured(self) -> list[str]:
        """Engines with at least one measurement, in --engines order."""
        names = set(self.startup)
        return [e.name for e in self.engines if e.name in names]


#: A step of a :class:`ComparisonHarness`'s repeat: a label for the progress line
#: and what measures one engine (a short progress note, ``""`` if it failed).
Step = tuple[Any, Callable[[Engine], str]]


class ComparisonHarness(EngineHarness):
    """Every engine through the same steps, repeat after repeat (overhead.py, es.py).

    By default all engines stay up for the whole run and take turns at each step,
    starting with a different engine each time, so that background noise hits
    them alike; the idle engines' background CPU is measured once. With
    ``--isolate`` one engine is alive at a time: each repeat starts, measures and
    stops every engine in turn, and each one's idle CPU is measured alone.

    ``args`` also needs ``isolate``, ``idle_seconds`` and ``repeats``; a subclass
    provides :meth:`steps` and :meth:`log_step`.
    """

    def steps(self) -> list[Step]:
        raise NotImplementedError

    def log_step(self, r: int, label: Any, parts: list[str]) -> None:
        """The progress line of step ``label`` in repeat ``r`` (0-based)."""
        raise NotImplementedError

    def measure(self) -> int:
        """Import, start and measure the engines; 1 if none could be started."""
        self.prepare_engines()
        self.measure_engines()
        if not self.measured():
            log("error: no engine could be started")
            return 1
        return 0

    def measure_engines(self) -> None:
        if self.args.isolate:
            self.measure_isolated()
        else:
            self.measure_shared()

    def measure_shared(self) -> None:
        """All engines up for the whole run; every step rotates through them."""
        a = self.args
        if not self.start_all():
            return
        self.idle_cpu["all engines"] = idle_cpu_percent(a.idle_seconds)
        for r in range(a.repeats):
            for k, (label, step) in enumerate(self.steps()):
                parts = [step(eng) for eng in rotated(self.active, r + k)]
                self.log_step(r, label, parts)
            self.repeats_done = r + 1

    def measure_isolated(self) -> None:
        """One engine alive at a time; each repeat starts and stops every engine."""
        a = self.args
        for r in range(a.repeats):
            for eng in rotated(self.prepared, r):
                if eng.name in self.failed or not self.start(eng):
                    continue
                if eng.name not in self.idle_cpu:
                    self.idle_cpu[eng.name] = idle_cpu_percent(a.idle_seconds)
                self.active = [eng]
                for label, step in self.steps():
                    self.log_step(r, label, [step(eng)])
                self.active = []
                log(f"stopping {eng.name} ...", a.quiet)
                self.teardown_one(eng)
                # So that the next multiprocessing startup is cold.
                stop_forkserver(self.forkserver_timeout)
            self.repeats_done = r + 1

    # -- reporting

    def isolation_line(self) -> str:
        if self.args.isolate:
            return "one engine alive at a time (--isolate)"
        return "all engines alive for the whole run; idle ones share the cores"

    def idle_lines(self) -> list[str]:
        """The background CPU of all engines while idle, if it was measured."""
        idle = self.idle_cpu.get("all engines", float("nan"))
        if math.isnan(idle):
            return []
        return [f"background CPU of all engines while idle: {idle:.0f}% of one core"]

    def engine_note(self, eng: Engine) -> str:
        idle = self.idle_cpu.get(eng.name, float("nan"))
        return "" if math.isnan(idle) else f"; {idle:.0f}% of one core while idle"

    def engine_json(self, eng: Engine) -> dict[str, Any]:
        return {
            "version": eng.version,
            "note": eng.note,
            "skipped": self.skipped.get(eng.name),
            "failed": self.failed.get(eng.name),
            "startup_s": self.startup.get(eng.name, []),
            "idle_cpu_percent": self.idle_cpu.get(eng.name),
        }


def add_isolation_options(p: argparse.ArgumentParser, isolate_help: str) -> None:
    """``--isolate`` and ``--idle-seconds`` of a :class:`ComparisonHarness`."""
    p.add_argument("--isolate", action="store_true", help=isolate_help)
    p.add_argument(
        "--idle-seconds",
        type=float,
        default=3.0,
        help="seconds to measure the idle engines' background CPU (default 3; 0 skips)",
    )
