"""A fast subset of CPython's own multiprocessing suite, run as tests/cpython/run.py
runs it (the whole suite is opt-in: ``python tests/cpython/run.py``).

The classes are run against the stdlib and, under ``fiber-dask run
--swap-multiprocessing``, against fiber-dask; every test the stdlib passes must
pass on fiber-dask.  They cover the swap of the ``test`` package itself (the
suite imports at all), Pipe ends with ``fileno()``/``wait()``-based polling, and
Structure-typed, raw and locked ctypes values.

The tests after it check, with the stdlib as the oracle, what the suite's
tests found fiber-dask doing differently: ``Pool._state``/``_pool``/
``_repopulate_pool``, the initializer of a pool closed before any task, a
child's shared resource tracker (shared memory attached in a child), and the
slots of a pool made in a manager's server.
"""

from __future__ import annotations

import os
import sys

import pytest
from support.wait import wait_until
from tasks import cpython

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "cpython"))
import run as cpython_run  # noqa: E402

CLASSES = ["WithProcessesTestValue", "WithProcessesTestSharedCTypes"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_fast_subset_passes_where_the_stdlib_passes(tmp_path):
    paths = {t: str(tmp_path / f"{t}.jsonl") for t in ("stdlib", "fiber")}
    for target, path in paths.items():
        cpython_run.run_target(target, CLASSES, 60, path)
    _, std = cpython_run._summary(paths["stdlib"])
    plan, ours = cpython_run._summary(paths["fiber"])
    assert sorted(plan) == sorted(CLASSES)
    passed_std = {k for k, r in std.items() if r["outcome"] == "pass"}
    assert len(passed_std) == 6, std  # the subset really ran (3 + 3 tests)
    missing = {
        f"{c}.{t}": ours.get((c, t), {}).get("detail")
        for c, t in sorted(passed_std)
        if ours.get((c, t), {}).get("outcome") != "pass"
    }
    assert missing == {}


# ---------------------------------------------------------------------------
# What the CPython suite checks that fiber-dask used to do differently, as
# stdlib-oracle tests (each runs against the stdlib and fiber-dask).

pytestmark = pytest.mark.timeout(120)


def test_pool_state_can_be_forced_and_del_warns(ctx):
    # test_resource_warning: code sets pool._state; __del__ then warns.
    import gc
    import multiprocessing.pool

    pool = ctx.Pool(1)
    pool.terminate()
    pool.join()
    pool._state = multiprocessing.pool.RUN
    assert pool._state == multiprocessing.pool.RUN
    with pytest.warns(ResourceWarning, match="unclosed running multiprocessing pool"):
        pool = None
        gc.collect()


def test_pool_forced_state_does_not_revive_a_terminated_pool(fiber_ctx):
    import multiprocessing.pool

    pool = fiber_ctx.Pool(1)
    pool.terminate()
    pool.join()
    pool._state = multiprocessing.pool.RUN
    with pytest.raises(ValueError, match="Pool not running"):
        pool.apply(cpython.square, (2,))
    pool._state = multiprocessing.pool.TERMINATE  # no warning at collection


def test_pool_pids_are_known_after_pool_returns_and_change_on_recycle(ctx):
    # test_pool_worker_lifetime: the pids right after Pool(), then fresh ones
    # after maxtasksperchild; _repopulate_pool exists.
    pool = ctx.Pool(2, maxtasksperchild=2)
    try:
        first = [slot.pid for slot in pool._pool]
        assert None not in first and len(first) == 2
        assert pool.map(cpython.square, range(20), chunksize=1) == [
            x * x for x in range(20)
        ]
        pool._repopulate_pool()
        wait_until(
            lambda: all(slot.is_alive() for slot in pool._pool), 60, "slots alive"
        )
        later = [slot.pid for slot in pool._pool]
        assert None not in later
        assert sorted(later) != sorted(first)
    finally:
        pool.close()
        pool.join()


def test_pool_initializer_runs_even_with_no_task(ctx, tmp_path):
    # TestInitializers.test_pool_initializer: close() + join() right away.
    path = str(tmp_path / "pids")
    pool = ctx.Pool(2, cpython.record_pid, (path,))
    pool.close()
    pool.join()
    with open(path) as f:
        pids = f.read().split()
    assert len(pids) == 2 and len(set(pids)) == 2


def test_shared_memory_attached_in_a_child_survives_its_exit(ctx):
    # test_shared_memory_across_processes: the child shares its parent's
    # resource tracker, so its exit does not unlink the segment.
    from multiprocessing import shared_memory

    shm = shared_memory.SharedMemory(create=True, size=64)
    try:
        for data in (b"howdy", b"HELLO"):
            p = ctx.Process(target=cpython.attach_and_write, args=(shm.name, data))
            p.start()
            p.join()
            assert p.exitcode == 0
            assert bytes(shm.buf[:5]) == data
            # Still there: another process can attach to it.
            again = shared_memory.SharedMemory(shm.name)
            again.close()
    finally:
        shm.close()
        shm.unlink()


def test_child_reuses_a_live_resource_tracker(ctx):
    # TestResourceTracker.test_resource_tracker_reused.
    from multiprocessing.resource_tracker import _resource_tracker

    _resource_tracker.ensure_running()
    r, w = ctx.Pipe(duplex=False)
    p = ctx.Process(target=cpython.tracker_shared, args=(w, _resource_tracker._pid))
    p.start()
    assert r.poll(60)
    assert r.recv() is True
    p.join()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_manager_pool_gets_its_slots_on_the_embedded_cluster():
    # WithManagerTestPool: a manager's Pool(n) runs in the manager's server
    # process, attached to this process's embedded cluster; it must get n
    # slots at once (the cluster grows for it, as for a Pool made here), and
    # give them back when terminated.
    import fiber_dask
    from fiber_dask import cluster

    client = cluster.get_client()
    n = len(client.scheduler_info()["workers"]) + 1
    with fiber_dask.Manager() as manager:
        barrier = manager.Barrier(n)
        pool = manager.Pool(n)
        try:
            # Each task waits until all n run at once: n slots exist.
            out = pool.map(cpython.wait_at, [barrier] * n, chunksize=1)
            assert sorted(out) == list(range(n))
        finally:
            pool.terminate()
            pool.join()
        wait_until(
            lambda: fiber_dask.backends.peerslots.peer_slots() == 0,
            30,
            "the manager's claim to be withdrawn",
        )


def test_a_dropped_running_pool_gives_its_slots_back(fiber_ctx):
    # A Pool nobody closed, once collected, releases its claim at once (its
    # __del__ warns and terminates), so the next pool is not sized around it.
    import gc

    from fiber_dask import cluster

    handle = cluster.get_handle()
    before = cluster.slots_in_use(handle)
    pool = fiber_ctx.Pool(2)
    assert pool.apply(cpython.square, (3,)) == 9
    assert cluster.slots_in_use(handle) == before + 2
    with pytest.warns(ResourceWarning, match="unclosed running multiprocessing pool"):
        del pool
        gc.collect()
    assert cluster.slots_in_use(handle) == before
