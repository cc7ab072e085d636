"""Per-task time limits (issue 31): ``Pool(time_limit=, soft_time_limit=)``,
the same on ``ProcessPoolExecutor``, and ``fiber.pool.time-limit`` /
``fiber.pool.soft-time-limit``.  Beyond the stdlib, as billiard's.

On the embedded cluster (a hard limit kills a slot process, never a Dask
worker).  Executions are counted through files (``tasks/timelimits.py``): an
item past its hard limit runs exactly once.  The limits are short (0.5-1.5 s)
so each test takes seconds.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import time

import dask
import pytest
import yaml
from support.latecancel import SEND_AHEAD, cancel_after_the_slot_moved_on
from support.processes import running
from support.wait import wait_for_file, wait_until
from tasks import timelimits as t

import fiber_dask
from fiber_dask.errors import SoftTimeLimitExceeded, TimeLimitExceeded
from fiber_dask.futures import ProcessPoolExecutor

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def cluster_up():
    # A pool made first in a program starts on early slots and hands them to
    # the cluster's once it is up: a new slot process that is not a time
    # limit's doing.  The tests compare slot pids, so the cluster is up first.
    fiber_dask.get_client()


# ------------------------------------------------------------------- soft


def test_soft_limit_is_raised_inside_the_task_which_cleans_up(tmp_path):
    d = str(tmp_path)
    with fiber_dask.Pool(1, soft_time_limit=0.5) as pool:
        before = pool.apply(t.pid)
        start = time.monotonic()
        # Blocked in a system call (time.sleep): the signal interrupts it.
        assert pool.apply(t.sleep_then_clean_up, (0, d, 60)) == "cleaned up 0"
        # Busy in Python code.
        assert pool.apply(t.spin_then_clean_up, (1, d, 60)) == "cleaned up 1"
        assert time.monotonic() - start < 30  # not the tasks' 60 s each
        for x in (0, 1):
            with open(os.path.join(d, f"cleaned-{x}")) as f:
                assert "soft time limit of 0.5s" in f.read()
            assert t.executions(d, x) == 1
        # A task under the limit is not disturbed, and the process stays.
        assert pool.apply(t.sleep_then_clean_up, (2, d, 0.05)) == "finished 2"
        assert pool.apply(t.pid) == before


def test_uncaught_soft_limit_raises_in_the_caller(tmp_path):
    d = str(tmp_path)
    with fiber_dask.Pool(1, soft_time_limit=0.5) as pool:
        before = pool.apply(t.pid)
        res = pool.apply_async(t.sleep_counted, (0, d, 60))
        with pytest.raises(SoftTimeLimitExceeded, match="soft time limit of 0.5s"):
            res.get(timeout=30)
        assert pool.map(t.square, range(5)) == [0, 1, 4, 9, 16]
        assert pool.apply(t.pid) == before  # a soft limit kills nothing
        assert t.executions(d, 0) == 1


# ------------------------------------------------------------------- hard


@pytest.mark.parametrize("relay", [False, True], ids=["own-connection", "relay"])
@pytest.mark.parametrize("task", [t.sleep_counted, t.spin_counted])
def test_hard_limit_kills_and_replaces_the_slot_process(tmp_path, task, relay):
    d = str(tmp_path)
    with dask.config.set({"fiber.pool.relay": relay}):
        pool = fiber_dask.Pool(1, time_limit=1)
    with pool:
        victim = pool.apply(t.pid)
        res = pool.apply_async(task, (0, d, 60))
        wait_for_file(os.path.join(d, "started-0"))
        start = time.monotonic()
        expected = r"index 0\) ran past its time limit of 1s"
        with pytest.raises(TimeLimitExceeded, match=expected) as info:
            res.get(timeout=30)
        assert time.monotonic() - start < 20
        assert isinstance(info.value, multiprocessing.TimeoutError)
        assert "was killed and replaced" in str(info.value)
        assert "fiber.pool.time-limit" in str(info.value)
        wait_until(lambda: not running(victim), what=f"slot process {victim} to end")
        # A new slot process serves, and the pool goes on.
        assert pool.apply(t.pid) != victim
        assert pool.map(t.square, range(6)) == [0, 1, 4, 9, 16, 25]
        assert t.executions(d, 0) == 1  # not re-run


def test_map_with_a_mix_fails_only_the_slow_item(tmp_path):
    d = str(tmp_path)
    with fiber_dask.Pool(2, time_limit=1) as pool:
        # imap: each item its own result; the slow one raises, the rest come.
        slow3 = functools.partial(t.mixed, directory=d, slow=(3,), seconds=60)
        it = pool.imap(slow3, range(8), chunksize=1)
        got = []
        for x in range(8):
            try:
                got.append(next(it))
            except TimeLimitExceeded as e:
                assert f"index {x})" in str(e)
                got.append("limit")
        assert got == [0, 1, 4, "limit", 16, 25, 36, 49]
        # map: the slow item's chunk fails the map, as any failing item
        # does in the stdlib (its chunks not started by then are dropped).
        res = pool.starmap_async(
            t.mixed, [(x, d, (13,), 60) for x in range(10, 20)], chunksize=2
        )
        with pytest.raises(TimeLimitExceeded, match=r"index 3\)"):
            res.get(timeout=30)
        assert pool.map(t.square, range(4)) == [0, 1, 4, 9]
    assert [t.executions(d, x) for x in range(8)] == [1] * 8
    assert t.executions(d, 13) == 1
    assert all(t.executions(d, x) <= 1 for x in range(10, 20))


def test_a_slot_told_to_end_after_it_moved_on_keeps_the_next_chunks_limit(tmp_path):
    """A slot process told to end for a chunk it had moved past finishes the
    chunk it runs, under that chunk's hard limit: the owner still times its
    items.  The next job's item hangs: it fails with TimeLimitExceeded,
    run once (not killed by the kernel's backstop and run again)."""
    d = str(tmp_path)
    with dask.config.set(SEND_AHEAD), fiber_dask.Pool(1, time_limit=3) as pool:
        b, ran_b = cancel_after_the_slot_moved_on(pool, d)  # b waits for go-1
        with pytest.raises(TimeLimitExceeded, match="time limit of 3s"):
            b.get(timeout=60)
        assert t.executions(d, 1) == 1
        wait_until(lambda: not running(ran_b), 10, "its slot process to be killed")
        assert pool.apply(t.square, (3,)) == 9


def test_soft_then_hard_limit(tmp_path):
    d = str(tmp_path)
    with fiber_dask.Pool(1, soft_time_limit=0.5, time_limit=1.5) as pool:
        victim = pool.apply(t.pid)
        res = pool.apply_async(t.ignore_soft, (0, d, 60))
        with pytest.raises(TimeLimitExceeded, match="time limit of 1.5s"):
            res.get(timeout=30)
        with open(os.path.join(d, "soft-0")) as f:
            assert f.read() == "soft\n"  # once, then killed
        assert pool.apply(t.pid) != victim
        assert t.executions(d, 0) == 1


def test_hard_limit_kills_a_task_that_holds_the_gil(tmp_path):
    """The owner's word cannot be handled in a process whose task holds the
    GIL in C code: the kernel's backstop timer kills it (timelimits.HARD_GRACE
    past the limit), and its result raised at the limit all the same."""
    d = str(tmp_path)
    with fiber_dask.Pool(1, time_limit=1) as pool:
        pool.apply(t.pid)
        res = pool.apply_async(t.hold_the_gil, (0, d))
        wait_for_file(os.path.join(d, "started-0"))
        with open(os.path.join(d, "started-0")) as f:
            victim = int(f.read())
        with pytest.raises(TimeLimitExceeded):
            res.get(timeout=30)
        wait_until(lambda: not running(victim), 20, f"slot process {victim} to end")
        assert pool.apply(t.pid) != victim
        assert t.executions(d, 0) == 1


# --------------------------------------------------------------- executor


def test_executor_time_limits_leave_it_usable(tmp_path):
    d = str(tmp_path)
    with ProcessPoolExecutor(2, soft_time_limit=0.5, time_limit=1.5) as ex:
        slow = ex.submit(t.ignore_soft, 0, d, 60)
        cleaned = ex.submit(t.sleep_then_clean_up, 1, d, 60)
        fine = ex.submit(t.square, 7)
        assert isinstance(slow.exception(timeout=30), TimeLimitExceeded)
        assert cleaned.result(timeout=30) == "cleaned up 1"
        assert fine.result(timeout=30) == 49
        # Not broken: it takes more work.
        assert list(ex.map(t.square, range(4))) == [0, 1, 4, 9]
    assert t.executions(d, 0) == 1


# ----------------------------------------------------------------- config


def test_config_keys_from_yaml(tmp_path):
    d = str(tmp_path)
    text = "fiber:\n  pool:\n    time-limit: 1500ms\n    soft-time-limit: 0.5\n"
    pool_keys = yaml.safe_load(text)["fiber"]["pool"]
    settings = {f"fiber.pool.{k}": v for k, v in pool_keys.items()}
    with dask.config.set(settings):
        fiber_dask.config.validate()
        pool = fiber_dask.Pool(1)
    with pool:
        assert pool.apply(t.sleep_then_clean_up, (0, d, 60)) == "cleaned up 0"
        res = pool.apply_async(t.ignore_soft, (1, d, 60))
        with pytest.raises(TimeLimitExceeded, match="time limit of 1.5s"):
            res.get(timeout=30)
        assert pool.apply(t.square, (3,)) == 9


@pytest.mark.parametrize(
    "settings, argument",
    [
        ({"fiber.pool.time-limit": 0}, "fiber.pool.time-limit"),
        ({"fiber.pool.soft-time-limit": "0s"}, "fiber.pool.soft-time-limit"),
        ({"fiber.pool.time-limit": "soon"}, "fiber.pool.time-limit"),
    ],
)
def test_bad_limits_in_config_name_the_key(settings, argument):
    with dask.config.set(settings):
        with pytest.raises(ValueError, match=argument.replace(".", r"\.")):
            fiber_dask.Pool(1)


@pytest.mark.parametrize("kwargs", [{"time_limit": -1}, {"soft_time_limit": "x"}])
def test_bad_limit_arguments_name_the_argument(kwargs):
    (name,) = kwargs
    with pytest.raises(ValueError, match=rf"Pool\({name}=\.\.\.\)"):
        fiber_dask.Pool(1, **kwargs)


def test_soft_limit_not_below_hard_warns():
    with pytest.warns(RuntimeWarning, match="soft_time_limit .* is not below"):
        pool = fiber_dask.Pool(1, time_limit=1, soft_time_limit=2)
    pool.terminate()
    pool.join()


# ----------------------------------------------------------- thread slots


def test_thread_slots_refuse_a_hard_limit():
    with dask.config.set({"fiber.pool.slots": "thread"}):
        with pytest.raises(ValueError, match="cannot be killed"):
            fiber_dask.Pool(1, time_limit=1)
        with dask.config.set({"fiber.pool.time-limit": "1s"}):
            with pytest.raises(ValueError, match="fiber.pool.slots=process"):
                fiber_dask.Pool(1)


def test_thread_slots_raise_the_soft_limit_in_python_code(tmp_path):
    """In a thread slot the soft limit is an asynchronous exception: Python
    code gets it at once; a call blocked in C (time.sleep) only once it
    returns (documented)."""
    d = str(tmp_path)
    with dask.config.set({"fiber.pool.slots": "thread"}):
        pool = fiber_dask.Pool(1, soft_time_limit=0.5)
    with pool:
        start = time.monotonic()
        assert pool.apply(t.spin_then_clean_up, (0, d, 60)) == "cleaned up 0"
        assert time.monotonic() - start < 30
        start = time.monotonic()
        assert pool.apply(t.sleep_then_clean_up, (1, d, 1.5)) == "cleaned up 1"
        assert time.monotonic() - start >= 1.5  # the sleep was not cut short
        res = pool.apply_async(t.spin_counted, (2, d, 60))
        with pytest.raises(SoftTimeLimitExceeded, match="soft time limit of 0.5s"):
            res.get(timeout=30)
        # Nothing left armed: quick tasks after it run undisturbed.
        assert pool.map(t.quick, range(50), chunksize=5) == [x * x for x in range(50)]


# ---------------------------------------------------------- no spurious


def test_long_lived_pool_with_quick_tasks_sees_no_spurious_limit():
    """Limits are per item, disarmed as each ends: a pool under 1 s limits
    runs chunks longer than the limit (several 0.3 s items each) and many
    quick tasks for longer than the limit, without a limit firing or a slot
    process being replaced."""
    with fiber_dask.Pool(2, soft_time_limit=0.6, time_limit=1) as pool:
        pids = [slot.pid for slot in pool._pool]  # waits for each slot's process
        assert None not in pids
        slow = [(x, 0.3) for x in range(8)]  # chunks of 1.2 s under a 1 s limit
        assert pool.starmap(t.quick, slow, chunksize=4) == [x * x for x in range(8)]
        deadline = time.monotonic() + 3  # longer than the hard limit
        rounds = 0
        while time.monotonic() < deadline or rounds < 3:
            assert pool.map(t.quick, range(2000), chunksize=10) == [
                x * x for x in range(2000)
            ]
            assert sorted(pool.imap_unordered(t.quick, range(200))) == [
                x * x for x in range(200)
            ]
            rounds += 1
        assert [slot.pid for slot in pool._pool] == pids  # none replaced


def test_many_quick_items_under_a_long_limit_keep_few_timers():
    """Each item arms the soft limit's watcher; an item that ends leaves a
    stale entry, which must not pile up for the whole limit (a million quick
    items under a 1 h limit)."""
    from fiber_dask.engine import timelimits

    limiter = timelimits.Limiter(False, lambda: True)  # a thread slot's kind
    for _ in range(20_000):
        limiter.start((3600.0, None))
        limiter.stop()
    assert len(timelimits._watcher._heap) <= 2048
    # Still armed and fired as it should: a short limit on a live item.
    limiter.start((0.05, None))
    with pytest.raises(SoftTimeLimitExceeded, match="soft time limit of 0.05s"):
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            pass
    limiter.stop()
