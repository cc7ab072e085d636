"""Processes talking through Queues and Pipes: stdlib oracle and fiber_dask alike.

Each test runs with ``ctx`` = the stdlib's forkserver context and fiber-dask's
context (children on the session's embedded cluster, the queue or pipe owned
by the test process).
"""

from __future__ import annotations

import os
import queue
import signal
import time

import pytest
from support.wait import wait_until

pytestmark = pytest.mark.timeout(90)


def produce(q, n):
    for i in range(n):
        q.put((os.getpid(), i))


def relay(inbox, outbox):
    while True:
        item = inbox.get(timeout=30)
        outbox.put(item)
        if item is None:
            return


def ponger(conn, n):
    for _ in range(n):
        conn.send(conn.recv() * 2)
    conn.close()


def drain_joinable(q, n):
    for _ in range(n):
        q.get(timeout=30)
        q.task_done()


def test_child_produces_parent_consumes(ctx):
    q = ctx.Queue()
    p = ctx.Process(target=produce, args=(q, 500))
    p.start()
    got = [q.get(timeout=30) for _ in range(500)]
    p.join(30)
    assert p.exitcode == 0
    assert [i for _, i in got] == list(range(500))
    assert {pid for pid, _ in got} == {p.pid}


def test_two_children_exchange_through_queues(ctx):
    inbox, outbox = ctx.Queue(), ctx.Queue()
    producer = ctx.Process(target=produce, args=(inbox, 300))
    middle = ctx.Process(target=relay, args=(inbox, outbox))
    middle.start()
    producer.start()
    producer.join(30)
    inbox.put(None)
    got = []
    while (item := outbox.get(timeout=30)) is not None:
        got.append(item)
    middle.join(30)
    assert (producer.exitcode, middle.exitcode) == (0, 0)
    assert [i for _, i in got] == list(range(300))


def test_pipe_ping_pong_with_a_child(ctx):
    a, b = ctx.Pipe()
    p = ctx.Process(target=ponger, args=(b, 100))
    p.start()
    b.close()  # the child holds the only other copy now
    for i in range(100):
        a.send(i)
        assert a.recv() == 2 * i
    with pytest.raises(EOFError):
        a.recv()  # the child closed its end and exited
    p.join(30)
    assert p.exitcode == 0


def test_joinable_queue_join_waits_for_child_task_done(ctx):
    q = ctx.JoinableQueue()
    for i in range(50):
        q.put(i)
    p = ctx.Process(target=drain_joinable, args=(q, 50))
    p.start()
    q.join()
    p.join(30)
    assert p.exitcode == 0
    assert q.empty()


def test_simple_queue_between_parent_and_child(ctx):
    q = ctx.SimpleQueue()
    p = ctx.Process(target=produce, args=(q, 20))
    p.start()
    got = [q.get() for _ in range(20)]
    p.join(30)
    assert [i for _, i in got] == list(range(20))


def slow_produce(q, n):
    for i in range(n):
        q.put(i)
        time.sleep(0.01)


def test_fiber_queue_keeps_items_when_the_producer_is_killed(fiber_ctx):
    q = fiber_ctx.Queue()
    p = fiber_ctx.Process(target=slow_produce, args=(q, 10_000))
    p.start()
    first = q.get(timeout=30)
    wait_until(lambda: q.qsize() > 5, 30, "the producer to put more than 6 items")
    os.kill(p.pid, signal.SIGKILL)
    p.join(30)
    assert p.exitcode == -signal.SIGKILL
    got = [first]
    while True:
        try:
            got.append(q.get(timeout=1))
        except queue.Empty:
            break
    # Everything it put before dying is there, once and in order.
    assert got == list(range(len(got)))
    assert len(got) > 5


def report_parent_pid(q):
    q.put(os.getppid())  # the Dask worker process that launched us


def test_fiber_meta_places_a_process_on_a_worker_with_the_resource(tmp_path):
    """``@meta(gpu=1)`` becomes Dask resource ``GPU=1``: the child runs on the
    one worker (started like an operator would, ``dask worker --resources``)
    that has it."""
    import subprocess
    import sys

    from distributed import Client
    from support.clusters import loopback_cluster

    import fiber_dask

    targeted = fiber_dask.meta(gpu=1)(report_parent_pid)
    assert fiber_dask.meta.resources_of(targeted) == {"GPU": 1}
    with loopback_cluster(1) as cluster, Client(cluster, set_as_default=False) as c:
        gpu_worker = subprocess.Popen(
            [sys.executable, "-m", "distributed.cli.dask_worker",
             cluster.scheduler_address, "--nthreads", "1", "--no-dashboard",
             "--resources", "GPU=1", "--host", "127.0.0.1", "--name", "gpu"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            c.wait_for_workers(2, timeout=60)
            info = c.scheduler_info(n_workers=-1)["workers"]
            gpu_addr = next(a for a, w in info.items() if w.get("resources"))
            gpu_pid = c.run(os.getpid, workers=[gpu_addr])[gpu_addr]
            q = fiber_dask.Queue()
            for _ in range(3):
                p = fiber_dask.Process(target=targeted, args=(q,), client=c)
                p.start()
                assert q.get(timeout=60) == gpu_pid
                p.join(30)
                assert p.exitcode == 0
        finally:
            gpu_worker.terminate()
            gpu_worker.wait(30)
    with pytest.raises(TypeError, match="unknown hints"):
        fiber_dask.meta(tpu=1)


def stamp(path):
    with open(path, "w") as f:
        f.write(repr(time.time()))


def hold_until(release, started, ended):
    busy_until(release, started)  # (below)
    stamp(ended)


def _workers_to_close(dask_scheduler=None):
    return dask_scheduler.workers_to_close()


def test_a_running_process_holds_its_resources_until_it_ends(tmp_path):
    """``resources={"GPU": 1}`` stays reserved while the Process runs: the
    scheduler counts it used, and a second Process that asks for the one GPU
    starts only after the first has ended (neither as a task nor beside the
    worker's tasks); adaptive scaling does not pick its worker to close.  The
    launcher task used to be cancelled as soon as it
    connected (a client's future stays "pending" while its task runs), which
    freed the GPU for anyone at once."""
    from distributed import Client
    from support.clusters import loopback_cluster

    import fiber_dask
    from fiber_dask.launch.popen import _free_resources

    release = tmp_path / "release"
    a_started, a_ended = tmp_path / "a-started", tmp_path / "a-ended"
    b_started = tmp_path / "b-started"
    with loopback_cluster(1, resources={"GPU": 1}) as cluster, Client(
        cluster, set_as_default=False
    ) as c:
        a = fiber_dask.Process(
            target=hold_until,
            args=(str(release), str(a_started), str(a_ended)),
            resources={"GPU": 1},
            client=c,
        )
        a.start()
        b = None
        try:
            wait_until(a_started.exists, 60, "the first Process to start")
            (room,) = c.run_on_scheduler(_free_resources).values()
            assert room == {"GPU": 0}, "the running Process's GPU is not held"
            # Nor may an adaptive cluster retire the worker under it (Dask
            # never closes a worker that runs a long-running task).
            assert c.run_on_scheduler(_workers_to_close) == []
            b = fiber_dask.Process(
                target=stamp,
                args=(str(b_started),),
                resources={"GPU": 1},
                client=c,
            )
            b.start()
            b._popen._beside_timer.join(30)  # its launch beside tasks decided
            assert not b._popen._claimed and not b_started.exists(), (
                "the second Process started while the first held the GPU"
            )
        finally:
            release.touch()
            a.join(60)
            if b is not None:
                b.join(60)
        assert (a.exitcode, b.exitcode) == (0, 0)
        assert float(b_started.read_text()) >= float(a_ended.read_text())


def put_pid(q):
    q.put(os.getpid())


def busy_until(path, started):
    open(started, "w").close()
    while not os.path.exists(path):
        time.sleep(0.01)
    return os.getpid()


def test_fiber_process_starts_while_pool_loops_hold_every_slot(fiber_ctx, tmp_path):
    stop = str(tmp_path / "stop")
    with fiber_ctx.Pool(2) as pool:
        started = [str(tmp_path / f"started-{i}") for i in range(2)]
        busy = [pool.apply_async(busy_until, (stop, s)) for s in started]
        wait_until(
            lambda: all(map(os.path.exists, started)), 30, "both pool tasks to start"
        )
        q = fiber_ctx.Queue()
        p = fiber_ctx.Process(target=put_pid, args=(q,))
        p.start()
        try:
            assert q.get(timeout=30) == p.pid  # ran while both slots were busy
            p.join(30)
            assert p.exitcode == 0
            assert not any(r.ready() for r in busy)
        finally:
            open(stop, "w").close()
        assert len({r.get(timeout=30) for r in busy}) == 2
