"""Worker recovery: real SIGKILLs of real Dask worker processes.

Each test runs on its own LocalCluster (passed with ``client=``) so the kills do
not disturb the session's embedded cluster, and so every kill is of a worker
process this test started.
"""

from __future__ import annotations

import functools
import os
import signal
import time

import dask
import pytest
from distributed import Client
from support.clusters import loopback_cluster
from support.processes import running
from support.wait import wait_for_file, wait_until
from tasks.poolcore import counted_square, executions, marked_spin

import fiber_dask
from fiber_dask import WorkerLostError

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def client():
    with loopback_cluster(2) as cluster, Client(cluster, set_as_default=False) as c:
        yield c


def slow_square(x, delay=0.05):
    time.sleep(delay)
    return x * x


def kill_self(_):
    os.kill(os.getpid(), signal.SIGKILL)


def kill_marked(directory, x) -> int:
    """Wait for item ``x``'s started marker, then SIGKILL the process it names."""
    path = wait_for_file(os.path.join(directory, f"started-{x}"), timeout=60)
    with open(path) as f:
        pid = int(f.read())
    os.kill(pid, signal.SIGKILL)
    return pid


def test_map_survives_sigkill_of_a_worker(client, tmp_path):
    d = str(tmp_path)
    with fiber_dask.Pool(2, client=client) as pool:
        assert pool.apply(slow_square, (2,)) == 4  # loops are up
        res = pool.map_async(
            functools.partial(counted_square, directory=d, victims=(20,)),
            range(60),
            chunksize=2,
        )
        victim = kill_marked(d, 20)
        assert res.get(timeout=90) == [x * x for x in range(60)]
        assert executions(d, 20) == 2  # killed while running, then re-run
        # The victim is really gone (a new process serves instead).
        wait_until(lambda: not running(victim), what=f"killed pid {victim} to end")


def test_imap_and_apply_async_survive_sigkill(client, tmp_path):
    d = str(tmp_path)
    with fiber_dask.Pool(2, client=client) as pool:
        pool.apply(slow_square, (1,))
        asyncs = [pool.apply_async(counted_square, (i, d, (5,))) for i in range(20)]
        kill_marked(d, 5)
        streamed = list(pool.imap(slow_square, range(40)))
        assert streamed == [x * x for x in range(40)]
        assert [r.get(timeout=60) for r in asyncs] == [x * x for x in range(20)]
        assert executions(d, 5) == 2


def test_task_that_kills_every_worker_fails_clearly(client):
    with dask.config.set({"fiber.pool.allowed-failures": 1}):
        with fiber_dask.Pool(2, client=client) as pool:
            res = pool.apply_async(kill_self, (0,))
            with pytest.raises(WorkerLostError) as info:
                res.get(timeout=90)
            message = str(info.value)
            assert "kill_self" in message
            assert "this item (index 0) killed every process it ran in" in message
            assert "fiber.pool.allowed-failures=1" in message
            assert isinstance(info.value, fiber_dask.ProcessError)
            # The pool still works once the nannies have restarted the workers.
            assert pool.map(slow_square, range(6)) == [0, 1, 4, 9, 16, 25]


def test_poison_item_in_map_fails_the_map_not_the_caller(client):
    with dask.config.set({"fiber.pool.allowed-failures": 1}):
        with fiber_dask.Pool(2, client=client) as pool:
            with pytest.raises(WorkerLostError):
                pool.map(kill_self, [1], chunksize=1)


def flaky(path):
    """Fail the first time it is called for ``path``, succeed afterwards."""
    if not os.path.exists(path):
        open(path, "w").close()
        raise RuntimeError("transient")
    return "ok"


def test_retries_rerun_a_task_that_raises(client, tmp_path):
    with fiber_dask.Pool(1, client=client, retries=1) as pool:
        assert pool.apply(flaky, (str(tmp_path / "a"),)) == "ok"
    with fiber_dask.Pool(1, client=client) as pool:
        with pytest.raises(RuntimeError, match="transient"):
            pool.apply(flaky, (str(tmp_path / "b"),))


def spin_forever(_):
    while True:
        pass


def executing_tasks(client):
    return sum(
        client.run(lambda dask_worker: len(dask_worker.state.executing)).values()
    )


def test_terminate_interrupts_a_cpu_bound_task(client, tmp_path):
    pool = fiber_dask.Pool(2, client=client)
    marker = str(tmp_path / "started")
    res = pool.apply_async(marked_spin, (marker,))
    wait_for_file(marker)
    assert not res.ready()
    pool.terminate()
    pool.join()
    with pytest.raises(fiber_dask.PoolTerminatedError):
        res.get(timeout=5)
    # The spinning task was interrupted: its worker thread is free again
    # (the stdlib would SIGTERM the process; we must not kill a Dask worker).
    wait_until(lambda: executing_tasks(client) == 0, 10, "no task executing")


def test_worker_death_with_maxtasksperchild(client, tmp_path):
    d = str(tmp_path)
    pool = fiber_dask.Pool(2, maxtasksperchild=3, client=client)
    with pool:
        pool.apply(slow_square, (1,))
        res = pool.map_async(
            functools.partial(counted_square, directory=d, victims=(10,)),
            range(30),
            chunksize=1,
        )
        kill_marked(d, 10)
        assert res.get(timeout=90) == [x * x for x in range(30)]
        assert executions(d, 10) == 2


def test_terminate_stops_a_task_blocked_in_c_on_the_embedded_cluster(tmp_path):
    """time.sleep ignores the asynchronous interrupt; on a cluster fiber-dask
    started, the worker process is ended after a grace period, as the stdlib's
    terminate() ends its workers, and the slot is usable again."""
    import subprocess
    import sys
    import textwrap

    script = tmp_path / "blocked.py"
    script.write_text(
        textwrap.dedent("""
        import os, time
        import fiber_dask
        from fiber_dask import cluster

        def marked_sleep(path, delay):
            open(path, "w").close()
            time.sleep(delay)

        if __name__ == "__main__":
            import sys
            marker = sys.argv[1]
            pool = fiber_dask.Pool(1)
            res = pool.apply_async(marked_sleep, (marker, 600))
            while not os.path.exists(marker):  # the task has started
                time.sleep(0.01)
            t0 = time.monotonic()
            pool.terminate()
            pool.join()
            with fiber_dask.Pool(1) as pool2:
                assert pool2.apply(abs, (-5,)) == 5
            print("recovered in", round(time.monotonic() - t0, 1))
    """)
    )
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "started")],
        capture_output=True,
        text=True,
        timeout=100,
        env={**os.environ, "DASK_FIBER__LOCAL__N_WORKERS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "recovered in" in proc.stdout


def test_dropped_running_pool_warns_and_frees_its_slots(client):
    import gc
    import warnings

    pool = fiber_dask.Pool(2, client=client)
    assert pool.apply(slow_square, (3,)) == 9
    thread = pool._engine._thread
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        del pool
        gc.collect()
        thread.join(10)
    assert not thread.is_alive()
    assert any(
        issubclass(w.category, ResourceWarning) and "unclosed running" in str(w.message)
        for w in caught
    )
    # Its loops ended, so a new pool gets both slots.
    wait_until(lambda: executing_tasks(client) == 0, 20, "its loops to end")
