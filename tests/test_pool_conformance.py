"""Conformance suite for ``multiprocessing.pool.Pool``: stdlib is the oracle.

Every parametrized test runs the same body against ``ctx`` = the stdlib forkserver
context and ``ctx`` = ``fiber_dask.get_context()`` (see ``conftest.py``), and asserts
the behaviour stdlib actually shows (each expectation below was checked against
CPython 3.11's ``multiprocessing.pool``).  Where fiber_dask deliberately goes beyond
stdlib (cloudpickled lambdas, closures, ``__main__`` functions; bounded ``imap``
read-ahead) the test is fiber-only and named ``test_fiber_*``.

Task functions live in ``tasks/conformance.py`` because stdlib workers import them by name.
"""

from __future__ import annotations

import itertools
import multiprocessing
import multiprocessing.pool
import os
import pickle
import threading
import time
import uuid
import warnings

import pytest
from support.wait import wait_for_file
from tasks import conformance
from tasks.conformance import (
    CustomError,
    add,
    fail_on_three,
    get_global,
    getpid,
    identity,
    init_global,
    length,
    raise_custom,
    raise_value_error,
    return_lock,
    sleepy,
    square,
)
from tasks.poolcore import marked_sleep

pytestmark = pytest.mark.timeout(60)

N = 20
SQUARES = [x * x for x in range(N)]

# Generous upper bound for "promptly": a pool shutdown must not wait for a task
# that still has several seconds to sleep.
PROMPT = 3.0
# Tasks that a test abandons with terminate() sleep this long.  Kept short on
# purpose: if an implementation cannot stop a running task it only occupies a
# shared worker for a few seconds instead of stalling the tests that follow.
LONG_TASK = 5.0


def is_fiber(ctx) -> bool:
    return type(ctx).__module__.split(".")[0] == "fiber_dask"


def _module_body_cube(x):
    """A task function defined in the test module itself (fiber-only test)."""
    return x * x * x


# --------------------------------------------------------------------------- apply


def test_apply_args_and_kwds(ctx):
    with ctx.Pool(2) as pool:
        assert pool.apply(add, (1, 2)) == 3
        assert pool.apply(add, (1,), {"b": 2, "c": 3}) == 6
        assert pool.apply(add, kwds={"a": 1, "b": 2}) == 3
        assert pool.apply(square, args=(7,)) == 49


def test_apply_async_args_and_kwds(ctx):
    with ctx.Pool(2) as pool:
        assert pool.apply_async(add, (1, 2)).get(timeout=30) == 3
        assert pool.apply_async(add, (1, 2), {"c": 10}).get(timeout=30) == 13
        assert pool.apply_async(add, kwds={"a": 1, "b": 2}).get(timeout=30) == 3


# ----------------------------------------------------------------------------- map


@pytest.mark.parametrize("chunksize", [1, 3, None], ids=["cs1", "cs3", "csdefault"])
def test_map_chunksize(ctx, chunksize):
    with ctx.Pool(2) as pool:
        assert pool.map(square, range(N), chunksize) == SQUARES
        assert pool.map(square, range(N), chunksize=chunksize) == SQUARES


@pytest.mark.parametrize("chunksize", [1, 3, None], ids=["cs1", "cs3", "csdefault"])
def test_map_async_chunksize(ctx, chunksize):
    with ctx.Pool(2) as pool:
        assert pool.map_async(square, range(N), chunksize).get(timeout=30) == SQUARES


def test_map_empty_iterable(ctx):
    with ctx.Pool(2) as pool:
        assert pool.map(square, []) == []
        assert pool.map_async(square, []).get(timeout=30) == []
        assert pool.starmap(add, []) == []
        assert pool.starmap_async(add, []).get(timeout=30) == []


def test_map_generator_input(ctx):
    with ctx.Pool(2) as pool:
        assert pool.map(square, (x for x in range(N))) == SQUARES
        assert pool.map(square, (x for x in range(N)), chunksize=3) == SQUARES
        assert pool.map_async(square, (x for x in range(N))).get(timeout=30) == SQUARES


# ------------------------------------------------------------------------- starmap


def test_starmap(ctx):
    args = [(i, i + 1) for i in range(N)]
    expected = [2 * i + 1 for i in range(N)]
    with ctx.Pool(2) as pool:
        assert pool.starmap(add, [(1, 2), (3, 4, 5)]) == [3, 12]
        assert pool.starmap(add, args) == expected
        assert pool.starmap(add, args, chunksize=3) == expected
        assert pool.starmap(add, iter(args)) == expected


def test_starmap_async(ctx):
    args = [(i, i + 1) for i in range(N)]
    expected = [2 * i + 1 for i in range(N)]
    with ctx.Pool(2) as pool:
        assert pool.starmap_async(add, args).get(timeout=30) == expected
        assert pool.starmap_async(add, args, 3).get(timeout=30) == expected


# ---------------------------------------------------------------------------- imap


@pytest.mark.parametrize("chunksize", [1, 4], ids=["cs1", "cs4"])
@pytest.mark.parametrize(
    "method, arranged",
    [("imap", list), ("imap_unordered", sorted)],
    ids=["in-order", "unordered-same-multiset"],
)
def test_imap(ctx, method, arranged, chunksize):
    with ctx.Pool(2) as pool:
        it = getattr(pool, method)(square, range(N), chunksize)
        assert iter(it) is it
        assert arranged(it) == SQUARES


def test_imap_from_generator(ctx):
    with ctx.Pool(2) as pool:
        assert list(pool.imap(square, (x for x in range(N)))) == SQUARES
        assert list(pool.imap(square, (x for x in range(N)), 3)) == SQUARES
        assert sorted(pool.imap_unordered(square, (x for x in range(N)))) == SQUARES
        assert sorted(pool.imap_unordered(square, (x for x in range(N)), 3)) == SQUARES


@pytest.mark.parametrize("method", ["imap", "imap_unordered"])
def test_imap_next_timeout(ctx, method):
    with ctx.Pool(2) as pool:
        it = getattr(pool, method)(sleepy, [1.0])
        with pytest.raises(ctx.TimeoutError):
            it.next(timeout=0.05)
        # The iterator is still usable after a timeout.
        assert it.next(timeout=30) == 1.0
        with pytest.raises(StopIteration):
            next(it)


@pytest.mark.parametrize("method", ["imap", "imap_unordered"])
def test_imap_stop_iteration(ctx, method):
    with ctx.Pool(2) as pool:
        it = getattr(pool, method)(square, [3])
        assert next(it) == 9
        with pytest.raises(StopIteration):
            next(it)
        # Exhausted stays exhausted.
        with pytest.raises(StopIteration):
            next(it)
        empty = getattr(pool, method)(square, [])
        with pytest.raises(StopIteration):
            next(empty)


def test_imap_raises_at_failing_item(ctx):
    with ctx.Pool(2) as pool:
        got = []
        with pytest.raises(ValueError, match="bad item 3"):
            for value in pool.imap(fail_on_three, range(6)):
                got.append(value)
        assert got == [0, 1, 4]


def test_imap_continues_after_error(ctx):
    # stdlib's IMapIterator raises the failed item's exception from the next()
    # call for that position, then keeps delivering the items after it.
    with ctx.Pool(2) as pool:
        it = pool.imap(fail_on_three, range(6))
        assert [next(it) for _ in range(3)] == [0, 1, 4]
        with pytest.raises(ValueError, match="bad item 3"):
            next(it)
        assert list(it) == [16, 25]


def test_imap_unordered_raises(ctx):
    with ctx.Pool(2) as pool:
        with pytest.raises(ValueError, match="bad item 3"):
            list(pool.imap_unordered(fail_on_three, range(6)))


def test_imap_infinite_generator(ctx):
    # stdlib feeds the generator from its task-handler thread; consuming a prefix
    # of the results must work and leaving the `with` block must not hang.
    with ctx.Pool(2) as pool:
        got = [
            v
            for _, v in zip(
                range(50), pool.imap(square, itertools.count()), strict=False
            )
        ]
        assert got == [x * x for x in range(50)]


# --------------------------------------------------------------------- AsyncResult


def test_timeout_error_is_multiprocessing_class(ctx):
    assert ctx.TimeoutError is multiprocessing.TimeoutError


def test_async_result_get_timeout(ctx):
    with ctx.Pool(2) as pool:
        res = pool.apply_async(sleepy, (1.0, "done"))
        with pytest.raises(ctx.TimeoutError):
            res.get(timeout=0.05)
        assert not res.ready()
        assert res.get(timeout=30) == "done"
        assert res.ready()
        assert res.successful()


def test_map_async_get_timeout(ctx):
    with ctx.Pool(2) as pool:
        res = pool.map_async(sleepy, [1.0, 1.0])
        with pytest.raises(ctx.TimeoutError):
            res.get(timeout=0.05)
        assert res.get(timeout=30) == [1.0, 1.0]


def test_async_result_wait(ctx):
    with ctx.Pool(2) as pool:
        res = pool.apply_async(sleepy, (1.0, "done"))
        t0 = time.monotonic()
        assert res.wait(timeout=0.2) is None
        waited = time.monotonic() - t0
        assert waited >= 0.1, f"wait(0.2) returned after {waited:.3f}s"
        assert not res.ready()
        assert res.wait(timeout=30) is None
        assert res.ready()
        assert res.successful()
        assert res.get(timeout=0) == "done"
        # wait() on a finished result returns at once.
        assert res.wait() is None


@pytest.mark.parametrize("kind", ["apply_async", "map_async"])
def test_successful_raises_when_not_ready(ctx, kind):
    with ctx.Pool(2) as pool:
        if kind == "apply_async":
            res = pool.apply_async(sleepy, (1.0,))
        else:
            res = pool.map_async(sleepy, [1.0, 1.0])
        assert not res.ready()
        with pytest.raises(ValueError, match="not ready"):
            res.successful()
        res.wait(timeout=30)
        assert res.successful()


def test_failed_result_not_successful(ctx):
    with ctx.Pool(2) as pool:
        res = pool.apply_async(raise_value_error, ("boom",))
        res.wait(timeout=30)
        assert res.ready()
        assert res.successful() is False
        with pytest.raises(ValueError, match="boom"):
            res.get(timeout=0)
        mres = pool.map_async(fail_on_three, range(6))
        mres.wait(timeout=30)
        assert mres.ready()
        assert mres.successful() is False


# ----------------------------------------------------------------------- callbacks


def _drain(pool):
    """Close and join: once join() returns, the result thread is done, so a
    callback that was going to be called twice would have been."""
    pool.close()
    pool.join()


class _Recorder:
    """Records callback calls: value, pid, thread, and whether ready() was True.

    stdlib sets the result's event only *after* the callback returns, so inside
    the callback ``res.ready()`` is False and, once ``get()`` returns, the callback
    has already run.  The callback may fire before ``apply_async`` has returned
    ``res`` to us, so it waits (briefly) for the test to hand the result over.
    """

    def __init__(self):
        self.calls = []
        self._result = None
        self._assigned = threading.Event()

    def attach(self, res):
        self._result = res
        self._assigned.set()

    def __call__(self, value):
        self._assigned.wait(10)
        ready = self._result.ready() if self._result is not None else None
        self.calls.append((value, os.getpid(), threading.get_ident(), ready))


def test_apply_async_callback(ctx):
    with ctx.Pool(2) as pool:
        on_ok, on_err = _Recorder(), _Recorder()
        res = pool.apply_async(
            sleepy, (0.1, "v"), callback=on_ok, error_callback=on_err
        )
        on_ok.attach(res)
        on_err.attach(res)
        assert res.get(timeout=30) == "v"
        # Already called by the time get() returns; called with ready() False.
        assert [(v, pid, ready) for v, pid, _, ready in on_ok.calls] == [
            ("v", os.getpid(), False)
        ]
        assert on_ok.calls[0][2] != threading.get_ident()
        _drain(pool)
        assert len(on_ok.calls) == 1
        assert on_err.calls == []


@pytest.mark.parametrize("method", ["apply_async", "map_async"])
def test_error_callback(ctx, method):
    with ctx.Pool(2) as pool:
        on_ok, on_err = _Recorder(), _Recorder()
        callbacks = {"callback": on_ok, "error_callback": on_err}
        if method == "apply_async":
            res = pool.apply_async(raise_value_error, ("bad item 3",), **callbacks)
        else:
            res = pool.map_async(fail_on_three, range(N), chunksize=2, **callbacks)
        on_ok.attach(res)
        on_err.attach(res)
        with pytest.raises(ValueError, match="bad item 3"):
            res.get(timeout=30)
        assert len(on_err.calls) == 1
        exc, pid, _, ready = on_err.calls[0]
        assert type(exc) is ValueError and str(exc) == "bad item 3"
        assert pid == os.getpid()
        assert ready is False
        _drain(pool)
        assert len(on_err.calls) == 1
        assert on_ok.calls == []


def test_map_async_callback_gets_full_list(ctx):
    with ctx.Pool(2) as pool:
        on_ok, on_err = _Recorder(), _Recorder()
        res = pool.map_async(
            square, range(N), chunksize=3, callback=on_ok, error_callback=on_err
        )
        on_ok.attach(res)
        on_err.attach(res)
        assert res.get(timeout=30) == SQUARES
        assert [(v, pid, ready) for v, pid, _, ready in on_ok.calls] == [
            (SQUARES, os.getpid(), False)
        ]
        _drain(pool)
        assert len(on_ok.calls) == 1
        assert on_err.calls == []


def test_starmap_async_callback(ctx):
    with ctx.Pool(2) as pool:
        on_ok = _Recorder()
        res = pool.starmap_async(add, [(1, 2), (3, 4)], callback=on_ok)
        on_ok.attach(res)
        assert res.get(timeout=30) == [3, 7]
        assert [(v, pid, ready) for v, pid, _, ready in on_ok.calls] == [
            ([3, 7], os.getpid(), False)
        ]


def test_callbacks_run_on_one_result_thread(ctx):
    with ctx.Pool(2) as pool:
        threads = []
        lock = threading.Lock()

        def record(_):
            with lock:
                threads.append((threading.get_ident(), os.getpid()))

        results = [pool.apply_async(square, (i,), callback=record) for i in range(20)]
        assert [r.get(timeout=30) for r in results] == [i * i for i in range(20)]
        assert len(threads) == 20
        assert {pid for _, pid in threads} == {os.getpid()}
        idents = {ident for ident, _ in threads}
        assert len(idents) == 1
        assert threading.get_ident() not in idents


# ---------------------------------------------------------------------- exceptions


@pytest.mark.parametrize("how", ["apply", "apply_async", "map", "imap"])
def test_exception_type_message_and_remote_traceback(ctx, how):
    with ctx.Pool(2) as pool:
        with pytest.raises(ValueError) as excinfo:
            if how == "apply":
                pool.apply(raise_value_error, ("boom 42",))
            elif how == "apply_async":
                pool.apply_async(raise_value_error, ("boom 42",)).get(timeout=30)
            elif how == "map":
                pool.map(raise_value_error, ["boom 42"])
            else:
                list(pool.imap(raise_value_error, ["boom 42"]))
    exc = excinfo.value
    assert type(exc) is ValueError
    assert str(exc) == "boom 42"
    cause = exc.__cause__
    assert isinstance(cause, multiprocessing.pool.RemoteTraceback), repr(cause)
    assert "raise_value_error" in str(cause)
    assert "boom 42" in str(cause)


@pytest.mark.parametrize("chunksize", [1, 3, None], ids=["cs1", "cs3", "csdefault"])
def test_map_one_failure_among_many(ctx, chunksize):
    with ctx.Pool(2) as pool:
        with pytest.raises(ValueError, match="bad item 3"):
            pool.map(fail_on_three, range(N), chunksize)
        with pytest.raises(ValueError, match="bad item 3"):
            pool.map_async(fail_on_three, range(N), chunksize).get(timeout=30)
        with pytest.raises(ValueError, match="bad item 3"):
            pool.starmap(fail_on_three, [(x,) for x in range(N)], chunksize)
        # The pool is still usable.
        assert pool.map(square, range(N), chunksize) == SQUARES


def test_custom_exception_preserved(ctx):
    with ctx.Pool(2) as pool:
        with pytest.raises(CustomError) as excinfo:
            pool.apply(raise_custom, (7,))
        assert type(excinfo.value) is conformance.CustomError
        assert excinfo.value.args == ("custom failure", 7)
        assert isinstance(excinfo.value.__cause__, multiprocessing.pool.RemoteTraceback)
        assert "raise_custom" in str(excinfo.value.__cause__)
        with pytest.raises(CustomError):
            pool.map(raise_custom, range(3))


def test_unpicklable_result_raises_maybe_encoding_error(ctx):
    # A lock cannot be pickled by pickle nor by cloudpickle.
    with ctx.Pool(2) as pool:
        with pytest.raises(multiprocessing.pool.MaybeEncodingError) as excinfo:
            pool.apply(return_lock)
        assert "pickle" in str(excinfo.value).lower()
        with pytest.raises(multiprocessing.pool.MaybeEncodingError):
            pool.apply_async(return_lock).get(timeout=30)
        with pytest.raises(multiprocessing.pool.MaybeEncodingError):
            pool.map(return_lock, range(3))
        # The pool is still usable.
        assert pool.apply(square, (3,)) == 9


def test_unpicklable_argument_raises_type_error(ctx):
    # stdlib: apply_async itself does not raise; the pickling TypeError from the
    # task handler is delivered through the result, never a hang.
    with ctx.Pool(2) as pool:
        res = pool.apply_async(identity, (threading.Lock(),))
        with pytest.raises(TypeError, match="pickle"):
            res.get(timeout=30)
        with pytest.raises(TypeError, match="pickle"):
            pool.map(identity, [1, threading.Lock(), 3])
        with pytest.raises(TypeError, match="pickle"):
            pool.apply(identity, (threading.Lock(),))
        # The pool is still usable.
        assert pool.map(square, range(N)) == SQUARES


def test_error_callback_of_an_unpicklable_argument_may_submit_more_work(ctx):
    # stdlib: the error reaches error_callback on a pool thread (its task
    # handler), which may submit more work; fiber-dask's result thread too,
    # never inside the caller's submission (where a submission from the
    # callback would send before the work being sent).
    with ctx.Pool(2) as pool:
        assert pool.map(square, range(N)) == SQUARES  # slots up and idle
        calls, follow, done = [], [], threading.Event()

        def on_error(e):
            calls.append(
                (type(e), threading.current_thread() is threading.main_thread())
            )
            follow.append(pool.apply_async(square, (7,)))
            done.set()

        res = pool.apply_async(identity, (threading.Lock(),), error_callback=on_error)
        with pytest.raises(TypeError, match="pickle"):
            res.get(timeout=30)
        assert done.wait(30)
        assert calls == [(TypeError, False)]
        assert follow[0].get(timeout=30) == 49
        assert pool.map(square, range(N)) == SQUARES


def test_non_callable_raises_type_error_at_get(ctx):
    # stdlib does not validate ``func``: the worker's call fails and the TypeError
    # comes back through the result.
    with ctx.Pool(2) as pool:
        res = pool.apply_async(42)
        with pytest.raises(TypeError, match="not callable"):
            res.get(timeout=30)
        with pytest.raises(TypeError, match="not callable"):
            pool.map(42, [1, 2])
        with pytest.raises(TypeError, match="not callable"):
            list(pool.imap(42, [1, 2]))
        assert pool.apply(square, (4,)) == 16


# ----------------------------------------------------------------------- lifecycle


def test_closed_pool_rejects_work(ctx):
    pool = ctx.Pool(2)
    try:
        pool.close()
        calls = [
            lambda: pool.apply(square, (1,)),
            lambda: pool.apply_async(square, (1,)),
            lambda: pool.map(square, [1]),
            lambda: pool.map_async(square, [1]),
            lambda: pool.starmap(add, [(1, 2)]),
            lambda: pool.starmap_async(add, [(1, 2)]),
            lambda: pool.imap(square, [1]),
            lambda: pool.imap_unordered(square, [1]),
        ]
        for call in calls:
            with pytest.raises(ValueError, match="not running"):
                call()
        pool.join()
    finally:
        pool.terminate()


def test_close_join_completes_outstanding_work(ctx):
    pool = ctx.Pool(2)
    try:
        res = pool.map_async(sleepy, [0.2] * 4, chunksize=1)
        single = pool.apply_async(sleepy, (0.3, "last"))
        pool.close()
        pool.join()
        assert res.ready() and single.ready()
        assert res.get(timeout=0) == [0.2] * 4
        assert single.get(timeout=0) == "last"
    finally:
        pool.terminate()


def test_join_without_close_raises(ctx):
    pool = ctx.Pool(2)
    try:
        with pytest.raises(ValueError):
            pool.join()
        pool.close()
        pool.join()
    finally:
        pool.terminate()


def test_terminate_then_join_is_prompt(ctx, tmp_path):
    pool = ctx.Pool(2)
    try:
        results = [
            pool.apply_async(marked_sleep, (str(tmp_path / f"started-{i}"), LONG_TASK))
            for i in range(2)
        ]
        for i in range(2):
            wait_for_file(str(tmp_path / f"started-{i}"))
        assert not any(r.ready() for r in results)
        t0 = time.monotonic()
        pool.terminate()
        pool.join()
        elapsed = time.monotonic() - t0
    finally:
        pool.terminate()
    assert elapsed < PROMPT, f"terminate()+join() took {elapsed:.2f}s"
    assert "state=TERMINATE" in repr(pool)
    with pytest.raises(ValueError):
        pool.apply_async(square, (1,))


def test_context_manager_exit_terminates(ctx, tmp_path):
    p = ctx.Pool(2)
    with p as pool:
        assert pool is p
        res = pool.apply_async(marked_sleep, (str(tmp_path / "started"), LONG_TASK))
        wait_for_file(str(tmp_path / "started"))
        t0 = time.monotonic()
    elapsed = time.monotonic() - t0
    assert elapsed < PROMPT, f"__exit__ took {elapsed:.2f}s"
    # The abandoned task is not completed.  stdlib leaves its result unready
    # forever; an implementation may instead fail it (no hang in get()).
    assert not res.ready() or not res.successful()
    assert "state=TERMINATE" in repr(pool)
    with pytest.raises(ValueError):
        pool.apply_async(square, (1,))
    t0 = time.monotonic()
    pool.join()  # allowed after terminate, and prompt
    assert time.monotonic() - t0 < PROMPT


@pytest.mark.parametrize("processes", [0, -1])
def test_invalid_processes(ctx, processes):
    with pytest.raises(ValueError, match="at least 1"):
        ctx.Pool(processes)


def test_processes_none(ctx):
    with ctx.Pool() as pool:
        assert pool.map(square, range(N)) == SQUARES
    with ctx.Pool(processes=None) as pool:
        assert pool.apply(square, (5,)) == 25


def test_cpu_count(ctx):
    n = ctx.cpu_count()
    assert isinstance(n, int) and n >= 1


def test_initializer_runs_before_tasks(ctx):
    # A fresh token per run: a stale global from an earlier test on a shared
    # worker cannot make this pass.
    token = uuid.uuid4().hex
    with ctx.Pool(2, initializer=init_global, initargs=(token,)) as pool:
        assert pool.map(get_global, range(8), chunksize=1) == [token] * 8
        assert pool.apply(get_global) == token
        results = [pool.apply_async(get_global) for _ in range(4)]
        assert [r.get(timeout=30) for r in results] == [token] * 4


def test_initializer_must_be_callable(ctx):
    with pytest.raises(TypeError, match="callable"):
        ctx.Pool(2, initializer=3)


def test_maxtasksperchild(ctx):
    with warnings.catch_warnings():
        if is_fiber(ctx):
            # fiber_dask may warn that it cannot recycle shared Dask workers.
            warnings.simplefilter("ignore")
        with ctx.Pool(2, maxtasksperchild=2) as pool:
            assert pool.map(square, range(N), chunksize=1) == SQUARES
            results = [pool.apply_async(add, (i, i)) for i in range(10)]
            assert [r.get(timeout=30) for r in results] == [2 * i for i in range(10)]
            assert list(pool.imap(square, range(N))) == SQUARES


@pytest.mark.parametrize("value", [0, -1, 1.5])
def test_invalid_maxtasksperchild(ctx, value):
    with pytest.raises(ValueError, match="maxtasksperchild"):
        ctx.Pool(2, maxtasksperchild=value)


def test_repr_shows_state(ctx):
    pool = ctx.Pool(2)
    try:
        assert "state=RUN" in repr(pool)
        assert "pool_size=2" in repr(pool)
        pool.close()
        assert "state=CLOSE" in repr(pool)
        pool.join()
    finally:
        pool.terminate()
    with ctx.Pool(2) as pool:
        pass
    assert "state=TERMINATE" in repr(pool)


def test_pool_cannot_be_pickled(ctx):
    with ctx.Pool(1) as pool:
        with pytest.raises(NotImplementedError, match="passed between processes"):
            pickle.dumps(pool)


def test_task_runs_in_another_process(ctx):
    with ctx.Pool(2) as pool:
        pids = set(pool.map(getpid, range(8), chunksize=1))
    assert os.getpid() not in pids


def test_large_payload_round_trip(ctx):
    data = os.urandom(5 * 1024 * 1024)
    with ctx.Pool(2) as pool:
        assert pool.apply(identity, (data,)) == data
        assert pool.map(length, [data, data[:10]]) == [len(data), 10]


def test_many_small_tasks(ctx):
    with ctx.Pool(2) as pool:
        results = [pool.apply_async(square, (i,)) for i in range(2000)]
        assert [r.get(timeout=60) for r in results] == [i * i for i in range(2000)]


# ------------------------------------------------------------ fiber beyond stdlib


def test_fiber_top_level_api():
    import fiber_dask
    import fiber_dask.pool

    assert fiber_dask.TimeoutError is multiprocessing.TimeoutError
    assert fiber_dask.pool.MaybeEncodingError is multiprocessing.pool.MaybeEncodingError
    assert fiber_dask.pool.RemoteTraceback is multiprocessing.pool.RemoteTraceback
    n = fiber_dask.cpu_count()
    assert isinstance(n, int) and n >= 1
    with fiber_dask.Pool(2) as pool:
        pids = set(pool.map(getpid, range(8), chunksize=1))
        assert pool.apply(square, (6,)) == 36
    assert os.getpid() not in pids


# What a fiber-dask pool has that a stdlib pool has not: the engine it holds
# and its own helpers, none of the engine's (issue 29: it used to inherit the
# engine it also held, and showed some 40 engine methods that failed if called).
FIBER_POOL_OWN = {"_engine", "_server", "_wait", "_imap"}


def test_fiber_pool_shows_the_stdlib_pools_surface_not_its_engine(fiber_ctx):
    from fiber_dask.engine.poolengine import PoolEngine

    with multiprocessing.get_context("forkserver").Pool(1) as oracle:
        stdlib = set(dir(oracle))
    with fiber_ctx.Pool(1) as pool:
        names = set(dir(pool))
        assert sorted(n for n in names - stdlib if not n.startswith("_")) == []
        assert names - stdlib == FIBER_POOL_OWN
        engine_only = set(dir(PoolEngine)) - stdlib
        assert sorted(n for n in engine_only if hasattr(pool, n)) == []
        for name in ("start", "submit", "slots", "signal", "_dispatch"):
            with pytest.raises(AttributeError):
                getattr(pool, name)
        assert PoolEngine not in type(pool).__mro__
        assert isinstance(pool._engine, PoolEngine)
        assert pool.map(square, range(4)) == [0, 1, 4, 9]


def test_fiber_lambda_tasks(fiber_ctx):
    with fiber_ctx.Pool(2) as pool:
        assert pool.apply(lambda x, y=0: x + y, (1,), {"y": 2}) == 3
        assert pool.apply_async(lambda: "hi").get(timeout=30) == "hi"
        assert pool.map(lambda x: x * x, range(N)) == SQUARES
        assert list(pool.imap(lambda x: x * x, range(N))) == SQUARES
        assert sorted(pool.imap_unordered(lambda x: x * x, range(N))) == SQUARES
        assert pool.starmap(lambda a, b: a * b, [(2, 3), (4, 5)]) == [6, 20]
        # A lambda *result* is picklable by cloudpickle, unlike with stdlib.
        f = pool.apply(lambda: lambda z: z + 1)
        assert f(1) == 2


def test_fiber_closure_tasks(fiber_ctx):
    offset = 10
    table = {i: str(i) for i in range(N)}

    def shifted(x):
        return x + offset

    def lookup(x):
        return table[x]

    with fiber_ctx.Pool(2) as pool:
        assert pool.map(shifted, range(N)) == [x + offset for x in range(N)]
        assert pool.map(lookup, range(N)) == [str(x) for x in range(N)]


def test_fiber_module_body_function(fiber_ctx):
    with fiber_ctx.Pool(2) as pool:
        assert pool.map(_module_body_cube, range(N)) == [x**3 for x in range(N)]


def test_fiber_main_module_function(fiber_ctx):
    # A function whose module is __main__ (a script) — not importable by a
    # worker; stdlib pickle fails on it, cloudpickle ships it by value.
    namespace = {"__name__": "__main__"}
    exec("def triple(x):\n    return 3 * x\n", namespace)
    triple = namespace["triple"]
    assert triple.__module__ == "__main__"
    with fiber_ctx.Pool(2) as pool:
        assert pool.map(triple, range(N)) == [3 * x for x in range(N)]
        assert pool.apply(triple, (5,)) == 15


def test_fiber_imap_bounded_read_ahead(fiber_ctx):
    # A 10-million-item generator must not be drained into the scheduler: imap
    # keeps a bounded number of chunks in flight.
    pulled = 0

    def source():
        nonlocal pulled
        for i in range(10_000_000):
            pulled += 1
            yield i

    pool = fiber_ctx.Pool(2)
    try:
        t0 = time.monotonic()
        got = [
            v for _, v in zip(range(1000), pool.imap(square, source()), strict=False)
        ]
        elapsed = time.monotonic() - t0
        pulled_at_consumption = pulled
        assert got == [x * x for x in range(1000)]
    finally:
        pool.terminate()
    pool.join()
    # join() returned: the result thread, which alone reads the input for
    # the loops, has ended, so the generator cannot be pulled any more.
    after_terminate = pulled
    assert pool._engine.join(timeout=0)
    assert pulled == after_terminate, "generator still consumed after terminate()"
    assert pulled_at_consumption < 100_000, pulled_at_consumption
    assert pulled < 100_000, pulled
    assert elapsed < 30, f"first 1000 imap results took {elapsed:.1f}s"


def _raising_callback(_value):
    raise RuntimeError("callback bug")


def test_fiber_result_is_ready_even_if_callback_raises(fiber_ctx):
    # The stdlib's result thread dies here and get() hangs forever; fiber-dask
    # logs the callback's error and still delivers the result.
    with fiber_ctx.Pool(2) as pool:
        res = pool.apply_async(square, (4,), callback=_raising_callback)
        assert res.get(timeout=30) == 16
        assert pool.apply(square, (5,)) == 25
