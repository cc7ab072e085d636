"""Conformance suite for ``concurrent.futures.ProcessPoolExecutor``: stdlib is the oracle.

Every parametrised test runs the same body against the stdlib's executor
(forkserver context: this process runs Dask's threads, see ``conftest.py``) and
``fiber_dask.futures.ProcessPoolExecutor`` on the session's embedded cluster.
Tests named ``test_fiber_*`` cover what goes beyond the stdlib (worker loss that
is recovered, cloudpickled functions, the compatibility arguments; the swap is
tests/test_swap.py).

Task functions live in ``tasks/futures.py`` and ``tasks/conformance.py`` because the
stdlib's workers import them by name.  Tasks that must keep a worker busy wait
for a file the test creates; nothing here sleeps for a fixed time.
"""

from __future__ import annotations

import concurrent.futures
import concurrent.futures.process
import contextlib
import itertools
import multiprocessing
import os
import pathlib
import pickle
import signal
import sys
import threading

import dask
import pytest
from distributed import Client
from support.clusters import loopback_cluster
from support.wait import wait_until
from tasks import futures as hf
from tasks.conformance import (
    CustomError,
    add,
    get_global,
    init_global,
    raise_custom,
    square,
)

import fiber_dask
import fiber_dask.futures

pytestmark = pytest.mark.timeout(90)

BrokenProcessPool = concurrent.futures.process.BrokenProcessPool


@pytest.fixture(params=["stdlib", "fiber"])
def make_executor(request):
    """A factory of executors of one kind; each is shut down after the test."""
    created = []

    def make(max_workers=2, **kwargs):
        if request.param == "stdlib":
            kwargs.setdefault("mp_context", multiprocessing.get_context("forkserver"))
            ex = concurrent.futures.ProcessPoolExecutor(max_workers, **kwargs)
        else:
            ex = fiber_dask.futures.ProcessPoolExecutor(max_workers, **kwargs)
        created.append(ex)
        return ex

    make.kind = request.param
    yield make
    for ex in created:
        ex.shutdown(wait=True, cancel_futures=True)


@pytest.fixture
def gate(tmp_path):
    """A file tasks wait for (``hf.block_until``); ``open_gate()`` creates it."""
    path = tmp_path / "gate"

    def open_gate():
        path.touch()

    open_gate.path = str(path)
    yield open_gate
    open_gate()  # never leave a worker blocked


# ------------------------------------------------------------------ submit


def test_submit_returns_a_stdlib_future(make_executor):
    ex = make_executor()
    f = ex.submit(add, 1, 2, c=3)
    assert type(f) is concurrent.futures.Future
    assert f.result(timeout=30) == 6
    assert f.done() and not f.cancelled() and f.exception() is None


def test_done_callbacks_run_once_with_the_future(make_executor):
    ex = make_executor()
    seen = []
    done = threading.Event()

    def callback(fut):
        seen.append(fut.result())
        done.set()

    f = ex.submit(square, 7)
    f.add_done_callback(callback)
    assert done.wait(30)
    assert seen == [49]
    f.add_done_callback(lambda fut: seen.append("late"))  # already done: runs now
    assert seen == [49, "late"]


def all_workers_up(ex, directory, n=2):
    """Both workers are running: no call queues behind a blocked one meanwhile."""
    pids = [ex.submit(hf.rendezvous, str(directory), n) for _ in range(n)]
    assert len({f.result(timeout=60) for f in pids}) == n


def test_as_completed_and_wait(make_executor, gate, tmp_path):
    ex = make_executor()
    all_workers_up(ex, tmp_path)
    fast = [ex.submit(square, i) for i in range(6)]
    assert sorted(f.result() for f in concurrent.futures.as_completed(fast, 30)) == [
        i * i for i in range(6)
    ]
    slow = ex.submit(hf.block_until, gate.path, "slow")
    quick = ex.submit(square, 3)
    done, not_done = concurrent.futures.wait(
        [slow, quick], timeout=30, return_when=concurrent.futures.FIRST_COMPLETED
    )
    assert quick in done and slow in not_done
    gate()
    done, not_done = concurrent.futures.wait([slow, quick], timeout=30)
    assert not not_done and slow.result() == "slow"


def test_result_timeout(make_executor, gate):
    ex = make_executor()
    f = ex.submit(hf.block_until, gate.path, 1)
    with pytest.raises(TimeoutError):
        f.result(timeout=0.2)
    with pytest.raises(concurrent.futures.TimeoutError):
        f.exception(timeout=0.01)
    gate()
    assert f.result(timeout=30) == 1


# --------------------------------------------------------------------- map


def test_map_is_ordered_and_lazy(make_executor):
    ex = make_executor()
    it = ex.map(square, range(20))
    assert iter(it) is it and not isinstance(it, list)
    assert list(it) == [i * i for i in range(20)]
    assert list(ex.map(add, [1, 2, 3], [10, 20], chunksize=2)) == [11, 22]
    assert list(ex.map(square, range(25), chunksize=4)) == [i * i for i in range(25)]
    assert list(ex.map(square, [])) == []
    with pytest.raises(ValueError, match="chunksize must be >= 1"):
        ex.map(square, range(3), chunksize=0)


def test_map_timeout(make_executor, gate):
    ex = make_executor()
    it = ex.map(hf.block_until, [gate.path] * 2, timeout=0.3)
    with pytest.raises(TimeoutError):
        next(it)
    gate()


def test_map_raises_at_the_failing_item(make_executor):
    ex = make_executor()
    it = ex.map(raise_custom, [1])
    with pytest.raises(CustomError):
        next(it)
    results = ex.map(square, range(3))
    assert list(results) == [0, 1, 4]


# -------------------------------------------------------------- exceptions


def test_task_exception_type_and_remote_traceback(make_executor):
    ex = make_executor()
    f = ex.submit(raise_custom, 7)
    with pytest.raises(CustomError) as info:
        f.result(timeout=30)
    assert info.value.args == ("custom failure", 7)
    cause = info.value.__cause__
    assert type(cause) is concurrent.futures.process._RemoteTraceback
    assert "raise_custom" in str(cause) and "CustomError" in str(cause)
    assert isinstance(f.exception(), CustomError)


def test_sys_exit_in_a_task_is_its_exception(make_executor):
    ex = make_executor()
    with pytest.raises(SystemExit) as info:
        ex.submit(hf.exit_task, 3).result(timeout=30)
    assert info.value.code == 3
    assert ex.submit(square, 4).result(timeout=30) == 16


def test_unpicklable_argument_fails_that_future_only(make_executor):
    ex = make_executor()
    f = ex.submit(square, threading.Lock())
    with pytest.raises(TypeError, match="pickle"):
        f.result(timeout=30)
    assert ex.submit(square, 5).result(timeout=30) == 25


def test_unpicklable_result_fails_that_future_only(make_executor):
    ex = make_executor()
    f = ex.submit(threading.Lock)
    with pytest.raises(TypeError, match="pickle"):
        f.result(timeout=30)
    assert type(f.exception().__cause__) is concurrent.futures.process._RemoteTraceback
    assert ex.submit(square, 6).result(timeout=30) == 36


# ------------------------------------------------------- cancel / shutdown


def test_cancel_a_queued_call(make_executor, gate):
    ex = make_executor(1)
    first = ex.submit(hf.block_until, gate.path, "first")
    queued = [ex.submit(square, i) for i in range(20)]
    last = queued[-1]
    assert last.cancel()
    assert last.cancelled() and last.done()
    with pytest.raises(concurrent.futures.CancelledError):
        last.result()
    gate()
    assert first.result(timeout=30) == "first"
    assert [f.result(timeout=30) for f in queued[:-1]] == [i * i for i in range(19)]


def test_running_call_cannot_be_cancelled(make_executor, gate):
    ex = make_executor(1)
    f = ex.submit(hf.block_until, gate.path, 1)
    wait_until(f.running, 30, "the call to be running")
    assert not f.cancel()
    gate()
    assert f.result(timeout=30) == 1


def test_shutdown_cancel_futures(make_executor, gate):
    ex = make_executor(1)
    first = ex.submit(hf.block_until, gate.path, "first")
    queued = [ex.submit(square, i) for i in range(20)]
    ex.shutdown(wait=False, cancel_futures=True)
    gate()
    assert first.result(timeout=30) == "first"
    cancelled = [f for f in queued if f.cancelled()]
    assert queued[-1] in cancelled and len(cancelled) >= 10
    for f in queued:
        if not f.cancelled():
            assert f.result(timeout=30) == queued.index(f) ** 2
    ex.shutdown(wait=True)


def test_shutdown_wait_finishes_the_calls(make_executor):
    ex = make_executor()
    futures = [ex.submit(square, i) for i in range(10)]
    ex.shutdown(wait=True)
    assert all(f.done() for f in futures)
    assert [f.result() for f in futures] == [i * i for i in range(10)]
    ex.shutdown()  # again: no effect


def test_shutdown_without_wait_still_runs_the_calls(make_executor, gate):
    ex = make_executor()
    f = ex.submit(hf.block_until, gate.path, "done")
    ex.shutdown(wait=False)
    gate()
    assert f.result(timeout=30) == "done"


def test_submit_and_map_after_shutdown(make_executor):
    ex = make_executor()
    ex.shutdown()
    with pytest.raises(
        RuntimeError, match="cannot schedule new futures after shutdown"
    ):
        ex.submit(square, 1)
    with pytest.raises(RuntimeError, match="after shutdown"):
        ex.map(square, [1])


def test_context_manager(make_executor):
    with make_executor() as ex:
        f = ex.submit(square, 9)
    assert f.done() and f.result() == 81
    with pytest.raises(RuntimeError):
        ex.submit(square, 1)


# ------------------------------------------------- initializer / recycling


def test_initializer(make_executor):
    ex = make_executor(initializer=init_global, initargs=("set by init",))
    assert set(ex.map(get_global, range(8))) == {"set by init"}


def test_failing_initializer_breaks_the_executor(make_executor):
    ex = make_executor(initializer=hf.fail_init)
    f = ex.submit(square, 2)
    with pytest.raises(BrokenProcessPool):
        f.result(timeout=60)
    # The executor notices asynchronously (the stdlib when the worker exits).
    wait_until(
        lambda: _submit_is_refused(ex), 30, "submit() to raise BrokenProcessPool"
    )


def _submit_is_refused(ex) -> bool:
    try:
        ex.submit(square, 1).result(timeout=30)
    except BrokenProcessPool:
        return True
    return False


def test_max_tasks_per_child(make_executor):
    ex = make_executor(1, initializer=hf.reset_count, max_tasks_per_child=2)
    counts = [ex.submit(hf.count_tasks).result(timeout=30) for _ in range(7)]
    # A fresh worker (its initializer run again) after every two tasks.
    assert counts == [1, 2, 1, 2, 1, 2, 1]


def test_argument_validation(make_executor):
    with pytest.raises(ValueError, match="max_workers must be greater than 0"):
        make_executor(0)
    with pytest.raises(TypeError, match="initializer must be a callable"):
        make_executor(initializer=42)
    with pytest.raises(TypeError, match="max_tasks_per_child must be an integer"):
        make_executor(max_tasks_per_child="3")
    with pytest.raises(ValueError, match="max_tasks_per_child must be >= 1"):
        make_executor(max_tasks_per_child=0)


def test_worker_that_dies_past_the_limit_is_broken_process_pool(make_executor):
    # The stdlib: any worker death.  fiber-dask: a call that lost more workers
    # than fiber.pool.allowed-failures (1 here, so it is re-run once first), on
    # a cluster of its own so that the kills spare the session's.
    with contextlib.ExitStack() as stack:
        kwargs = {}
        if make_executor.kind == "fiber":
            cluster = stack.enter_context(loopback_cluster(2))
            kwargs["client"] = stack.enter_context(
                Client(cluster, set_as_default=False)
            )
        stack.enter_context(dask.config.set({"fiber.pool.allowed-failures": 1}))
        ex = make_executor(**kwargs)
        f = ex.submit(hf.kill_self)
        with pytest.raises(BrokenProcessPool):
            f.result(timeout=80)
        ex.shutdown()


# ------------------------------------------------------------- fiber only


@pytest.fixture
def own_client():
    """A cluster of its own, so killed workers do not disturb the session's."""
    with loopback_cluster(2) as cluster, Client(cluster, set_as_default=False) as c:
        yield c


def _started(directory: pathlib.Path) -> list[tuple[int, int]]:
    found = []
    for p in directory.glob("started-*"):
        _, x, pid = p.name.split("-")
        found.append((int(x), int(pid)))
    return found


def test_fiber_sigkill_mid_map_completes(own_client, tmp_path):
    with fiber_dask.futures.ProcessPoolExecutor(2, client=own_client) as ex:
        assert ex.submit(square, 2).result(timeout=60) == 4  # loops are up
        results = ex.map(hf.record_then_wait, [str(tmp_path)] * 6, range(6))
        x, pid = wait_until(lambda: _started(tmp_path), 60, "a task to start")[0]
        os.kill(pid, signal.SIGKILL)  # the process running task x, mid-task
        (tmp_path / "go").touch()
        assert list(results) == [i * i for i in range(6)]
        runs = (tmp_path / "executions.log").read_text().split()
        assert sorted(set(runs)) == [str(i) for i in range(6)]
        assert runs.count(str(x)) >= 2, f"task {x} was not re-run: {runs}"
        wait_until(lambda: _gone(pid), 30, f"the killed process {pid} to be gone")


def _gone(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_fiber_broken_process_pool_carries_the_cause_and_executor_goes_on(
    own_client,
):
    with dask.config.set({"fiber.pool.allowed-failures": 1}):
        with fiber_dask.futures.ProcessPoolExecutor(2, client=own_client) as ex:
            f = ex.submit(hf.kill_self)
            with pytest.raises(fiber_dask.futures.BrokenProcessPool) as info:
                f.result(timeout=80)
            assert isinstance(info.value, BrokenProcessPool)
            assert isinstance(info.value.__cause__, fiber_dask.WorkerLostError)
            assert "fiber.pool.allowed-failures=1" in str(info.value)
            # Unlike the stdlib's, the executor is not broken for other calls.
            assert ex.submit(square, 3).result(timeout=60) == 9


def test_fiber_functions_travel_by_value():
    offset = 10
    with fiber_dask.futures.ProcessPoolExecutor(2) as ex:
        assert ex.submit(lambda x: x + offset, 1).result(timeout=60) == 11
        assert list(ex.map(lambda a, b: a * b, [1, 2], [3, 4])) == [3, 8]


def test_fiber_compatibility_arguments():
    with fiber_dask.futures.ProcessPoolExecutor(
        1, mp_context=fiber_dask.get_context()
    ) as ex:
        assert isinstance(ex, concurrent.futures.ProcessPoolExecutor)
        assert ex._max_workers == 1
        assert ex.submit(square, 2).result(timeout=30) == 4
    with pytest.warns(RuntimeWarning, match="mp_context=.* is ignored"):
        ex = fiber_dask.futures.ProcessPoolExecutor(
            1, mp_context=multiprocessing.get_context("spawn")
        )
    ex.shutdown()
    with pytest.raises(TypeError, match="mp_context must be None"):
        fiber_dask.futures.ProcessPoolExecutor(1, mp_context="spawn")
    with fiber_dask.futures.ProcessPoolExecutor() as ex:
        assert ex._max_workers == fiber_dask.cpu_count()


def test_fiber_module_reexports_the_stdlib_names():
    fut = fiber_dask.futures
    for name in concurrent.futures.__all__:
        if name != "ProcessPoolExecutor":
            assert getattr(fut, name) is getattr(concurrent.futures, name), name
    assert fut.process.ProcessPoolExecutor is fut.ProcessPoolExecutor
    assert fut.process.BrokenProcessPool is BrokenProcessPool
    assert issubclass(fut.BrokenProcessPool, BrokenProcessPool)
    assert fut.thread is concurrent.futures.thread
    assert fiber_dask.errors.BrokenProcessPool is fut.BrokenProcessPool


def test_fiber_executor_refuses_pickling():
    with fiber_dask.futures.ProcessPoolExecutor(1) as ex:
        with pytest.raises(Exception):  # noqa: B017 - as the stdlib: not picklable
            pickle.dumps(ex)


# -------------------------------------------------------------- real clients


def _nevergrad_minimize(executor, name, num_workers):
    import nevergrad as ng

    param = ng.p.Array(shape=(3,))
    param.random_state.seed(12)
    optimizer = ng.optimizers.registry[name](
        parametrization=param, budget=24, num_workers=num_workers
    )
    recommendation = optimizer.minimize(hf.sphere, executor=executor)
    return recommendation.value.tolist(), optimizer.num_tell


@pytest.mark.parametrize(
    "name, num_workers",
    [
        # Two calls at a time; what it asks does not depend on the order results
        # come back in, so every executor must give the sequential run's answer.
        ("RandomSearch", 2),
        # Ask, evaluate through the executor, tell: each step depends on the last.
        ("OnePlusOne", 1),
    ],
)
def test_nevergrad_minimize_with_an_executor(make_executor, name, num_workers):
    pytest.importorskip("nevergrad")
    import nevergrad as ng

    sequential = ng.optimization.utils.SequentialExecutor()
    expected = _nevergrad_minimize(sequential, name, num_workers)
    assert expected[1] == 24
    assert _nevergrad_minimize(make_executor(), name, num_workers) == expected


# --------------------------------------------------------------- benchmark


@pytest.mark.timeout(300)
def test_executor_benchmark_runs(tmp_path):
    """benchmarks/executor.py end to end, tiny: every executor gets results
    (no timing is asserted; the figures are what the benchmark reports)."""
    import json
    import subprocess

    root = pathlib.Path(__file__).resolve().parent.parent
    out = tmp_path / "executor.json"
    proc = subprocess.run(
        [sys.executable, str(root / "benchmarks" / "executor.py")]
        + ["--engines", "stdlib,fiber_dask,loky", "--repeats", "1"]
        + ["--ideal", "0.05", "--latency-calls", "5", "--idle-seconds", "0"]
        + ["--quiet", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=root,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    report = json.loads(out.read_text())
    for name in ("stdlib", "fiber_dask", "loky"):
        assert report["engines"][name]["failed"] is None, report["engines"][name]
        assert len(report["engines"][name]["round_trip_s"]) == 1
    for case in report["cases"]:
        assert set(case["elapsed_s"]) == {"stdlib", "fiber_dask", "loky"}


EXIT_SCRIPT = """\
import sys
import fiber_dask.futures
from tasks import futures as hf

if __name__ == "__main__":
    ex = fiber_dask.futures.ProcessPoolExecutor(1)
    gate, marker = sys.argv[1], sys.argv[2]
    ex.submit(hf.block_until, gate)
    ex.submit(open, marker, "w")  # queued behind it; no shutdown() before exit
    open(gate, "w").close()
"""


def test_fiber_calls_pending_at_exit_are_completed_first(tmp_path):
    """As the stdlib: the interpreter waits for submitted calls before it exits."""
    import subprocess

    script = tmp_path / "exit_script.py"
    script.write_text(EXIT_SCRIPT)
    marker = tmp_path / "marker"
    env = {**os.environ, "DASK_FIBER__LOCAL__N_WORKERS": "1"}
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "gate"), str(marker)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert marker.exists()


# --------------------------------------- Python 3.14's additions, on every Python


@pytest.mark.parametrize("operation", ["terminate_workers", "kill_workers"])
def test_fiber_terminate_and_kill_workers_end_a_busy_executor(operation, tmp_path):
    """3.14's terminate_workers()/kill_workers(): shutdown(wait=False,
    cancel_futures=True), then SIGTERM/SIGKILL to each worker process; the
    calls that were running fail with BrokenProcessPool, the queued ones are
    cancelled, the executor is broken, the processes are gone."""
    ex = fiber_dask.futures.ProcessPoolExecutor(2)
    try:
        handed = ex._limit  # calls handed to the pool; the rest stay cancellable
        futures = [
            ex.submit(hf.trap_then_wait, str(tmp_path), x) for x in range(handed + 3)
        ]
        started = wait_until(
            lambda: len(_started(tmp_path)) == 2 and _started(tmp_path),
            60,
            "both workers to run a call",
        )
        pids = sorted(pid for _, pid in started)
        getattr(ex, operation)()
        for pid in pids:
            wait_until(lambda: _gone(pid), 30, f"worker process {pid} to be gone")
        # (cancelled futures are done but not "notified": as the stdlib's,
        # concurrent.futures.wait() would not count them)
        wait_until(lambda: all(f.done() for f in futures), 30, "every call to end")
        for x, pid in started:
            with pytest.raises(BrokenProcessPool, match=operation):
                futures[x].result()
        assert [f.cancelled() for f in futures[handed:]] == [True] * 3
        for f in futures:
            assert f.cancelled() or isinstance(f.exception(), BrokenProcessPool)
        with pytest.raises(RuntimeError):
            ex.submit(square, 2)
        signalled = sorted(int(p.name[8:]) for p in tmp_path.glob("sigterm-*"))
        if operation == "terminate_workers":
            assert signalled == pids  # the SIGTERM reached each, where it ran
        else:
            assert signalled == []
        # Ended by the signal, not by the pool's interrupt (whose exception
        # would have run the task's finally block).
        assert list(tmp_path.glob("finally-*")) == []
    finally:
        (tmp_path / "go").touch()
        ex.shutdown(wait=True, cancel_futures=True)


def test_fiber_terminate_workers_after_a_shutdown_or_twice_is_harmless():
    ex = fiber_dask.futures.ProcessPoolExecutor(1)
    assert ex.submit(square, 3).result(timeout=60) == 9
    ex.shutdown()
    ex.terminate_workers()
    ex.kill_workers()
    with pytest.raises(ValueError, match="Unsupported operation"):
        ex._force_shutdown("pause")


def _counting(source, drawn):
    for item in source:
        drawn.append(item)
        yield item


def test_fiber_map_buffersize_reads_an_endless_input_lazily():
    """3.14's map(..., buffersize=): at most buffersize calls submitted and not
    yet yielded; each result taken submits one more (itertools.count() works)."""
    drawn: list[int] = []
    with fiber_dask.futures.ProcessPoolExecutor(2) as ex:
        results = ex.map(square, _counting(itertools.count(), drawn), buffersize=3)
        assert drawn == [0, 1, 2]  # the first buffersize, at once
        assert [next(results) for _ in range(5)] == [0, 1, 4, 9, 16]
        assert len(drawn) == 3 + 5
        results.close()  # the buffered calls are cancelled or done
        # chunksize: buffersize counts chunks, as the stdlib's
        drawn.clear()
        chunked = ex.map(
            square, _counting(itertools.count(), drawn), chunksize=2, buffersize=2
        )
        assert len(drawn) == 2 * 2
        assert [next(chunked) for _ in range(5)] == [0, 1, 4, 9, 16]
        assert len(drawn) == 2 * (2 + 3)  # 3 chunks yielded from
        chunked.close()
        # a finite input, a second iterable, a timeout: as without buffersize
        assert list(ex.map(add, range(7), range(7), buffersize=2, timeout=60)) == [
            2 * i for i in range(7)
        ]
        with pytest.raises(CustomError):
            list(ex.map(raise_custom, range(3), buffersize=1))


def test_fiber_map_buffersize_is_checked_as_the_stdlibs():
    import inspect

    with fiber_dask.futures.ProcessPoolExecutor(1) as ex:
        with pytest.raises(ValueError, match="buffersize must be None or > 0"):
            ex.map(square, [1], buffersize=0)
        with pytest.raises(TypeError, match="buffersize must be an integer or None"):
            ex.map(square, [1], buffersize=2.0)
    params = inspect.signature(fiber_dask.futures.ProcessPoolExecutor.map).parameters
    assert list(params)[1:] == ["fn", "iterables", "timeout", "chunksize", "buffersize"]
    assert params["buffersize"].default is None
