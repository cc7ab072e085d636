"""Queue, SimpleQueue, JoinableQueue and Pipe: the stdlib's contract, then the cluster.

The first half runs the same assertions against the stdlib (oracle) and
fiber_dask within one process.  The second half is fiber-only: the parties are
Pool tasks on different Dask workers, and worker processes are really killed.
"""

from __future__ import annotations

import array
import multiprocessing
import os
import queue
import signal
import threading
import time

import numpy as np
import pytest
from support.wait import wait_for_file, wait_until

import fiber_dask
from fiber_dask.comm import objserver

pytestmark = pytest.mark.timeout(60)


# --------------------------------------------------------------- conformance


def test_queue_fifo_and_types(ctx):
    q = ctx.Queue()
    items = [1, "two", [3], (4,), {"five": 5}, b"six", np.arange(3)]
    for item in items:
        q.put(item)
    got = [q.get(timeout=5) for _ in items]
    assert got[:6] == items[:6]
    assert [type(x) for x in got] == [type(x) for x in items]
    assert (got[6] == items[6]).all()
    assert q.empty()


def test_queue_get_timeout_and_nowait_raise_queue_empty(ctx):
    q = ctx.Queue()
    t0 = time.monotonic()
    with pytest.raises(queue.Empty):
        q.get(timeout=0.3)
    assert time.monotonic() - t0 >= 0.25
    with pytest.raises(queue.Empty):
        q.get_nowait()
    with pytest.raises(queue.Empty):
        q.get(block=False)


def test_queue_maxsize_full(ctx):
    q = ctx.Queue(2)
    q.put(1)
    q.put_nowait(2)
    assert q.full()
    assert q.qsize() == 2
    with pytest.raises(queue.Full):
        q.put(3, timeout=0.2)
    with pytest.raises(queue.Full):
        q.put_nowait(3)
    assert q.get() == 1
    q.put(3)
    assert [q.get(), q.get()] == [2, 3]


def test_queue_blocked_put_wakes_when_room(ctx):
    q = ctx.Queue(1)
    q.put("a")
    threading.Timer(0.3, q.get).start()
    q.put("b", timeout=10)
    assert q.get(timeout=5) == "b"


def test_queue_close_and_join_thread(ctx):
    q = ctx.Queue()
    q.put(1)
    with pytest.raises(AssertionError):
        q.join_thread()
    q.close()
    with pytest.raises(ValueError, match="is closed"):
        q.put(2)
    q.join_thread()
    q.cancel_join_thread()


def test_joinable_queue_task_done_and_join(ctx):
    q = ctx.JoinableQueue()
    for i in range(3):
        q.put(i)
    done = threading.Event()

    def joiner():
        q.join()
        done.set()

    threading.Thread(target=joiner, daemon=True).start()
    for _ in range(3):
        q.get(timeout=5)
        assert not done.wait(0.05)
        q.task_done()
    assert done.wait(5)
    with pytest.raises(ValueError, match="too many times"):
        q.task_done()


def test_simple_queue(ctx):
    q = ctx.SimpleQueue()
    assert q.empty()
    q.put([1, 2])
    assert not q.empty()
    assert q.get() == [1, 2]
    q.close()


def test_pipe_duplex_send_recv_poll(ctx):
    a, b = ctx.Pipe()
    assert not b.poll()
    a.send({"x": [1, 2]})
    assert b.poll(1)
    assert b.recv() == {"x": [1, 2]}
    b.send(("back",))
    assert a.recv() == ("back",)
    t0 = time.monotonic()
    assert a.poll(0.3) is False
    assert time.monotonic() - t0 >= 0.25


def test_pipe_bytes_offsets_and_recv_into(ctx):
    a, b = ctx.Pipe()
    a.send_bytes(b"0123456789", 2, 5)
    assert b.recv_bytes() == b"23456"
    a.send_bytes(array.array("i", [1, 2, 3]))
    assert b.recv_bytes() == array.array("i", [1, 2, 3]).tobytes()
    buf = bytearray(10)
    a.send_bytes(b"abc")
    assert b.recv_bytes_into(buf, 4) == 3
    assert bytes(buf) == b"\0\0\0\0abc\0\0\0"
    a.send_bytes(b"too long for it")
    with pytest.raises(multiprocessing.BufferTooShort) as info:
        b.recv_bytes_into(bytearray(4))
    assert info.value.args[0] == b"too long for it"
    with pytest.raises(ValueError):
        a.send_bytes(b"abc", 5)
    with pytest.raises(ValueError):
        a.send_bytes(b"abc", 1, 5)
    with pytest.raises(ValueError):
        a.send_bytes(b"abc", -1)


def test_pipe_eof_when_other_end_closed(ctx):
    a, b = ctx.Pipe()
    a.send("last")
    a.close()
    assert b.recv() == "last"
    with pytest.raises(EOFError):
        b.recv()
    assert a.closed
    with pytest.raises(OSError, match="handle is closed"):
        a.send(1)


def test_pipe_one_way(ctx):
    r, w = ctx.Pipe(duplex=False)
    w.send(1)
    assert r.recv() == 1
    assert r.readable and not r.writable and w.writable and not w.readable
    with pytest.raises(OSError, match="read-only"):
        r.send(1)
    with pytest.raises(OSError, match="write-only"):
        w.recv()


def test_pipe_big_message(ctx):
    a, b = ctx.Pipe()
    payload = os.urandom(16 * 2**20)
    # An OS pipe holds 64 KiB: the stdlib's sender blocks until b reads.
    sender = threading.Thread(target=a.send_bytes, args=(payload,))
    sender.start()
    assert b.recv_bytes() == payload
    sender.join()


def _queues_module(ctx):
    import multiprocessing.queues as stdlib_queues

    import fiber_dask.queues as fiber_queues

    if isinstance(ctx, multiprocessing.context.BaseContext):
        return stdlib_queues
    return fiber_queues


@pytest.mark.parametrize("maxsize", [0, 1])
def test_queue_put_of_unpicklable_goes_to_the_feeder_error_hook(ctx, maxsize):
    # The stdlib's feeder thread hands the error to _on_queue_feeder_error and
    # goes on; the caller's put() does not raise, and nothing is counted.
    errors = []

    class HookedQueue(_queues_module(ctx).Queue):
        @staticmethod
        def _on_queue_feeder_error(e, obj):
            errors.append((type(e), type(obj)))

    q = HookedQueue(maxsize, ctx=ctx)
    q.put(threading.Lock())
    q.put("after")
    assert q.get(timeout=10) == "after"
    wait_until(lambda: errors, 10, "the feeder error hook to be called")
    assert errors == [(TypeError, type(threading.Lock()))]
    assert q.empty()
    q.close()


def test_queue_feeder_error_default_prints_the_traceback(ctx, capfd):
    q = ctx.Queue()
    q.put(threading.Lock())
    q.put(1)
    assert q.get(timeout=10) == 1
    q.close()
    q.join_thread()
    assert "TypeError" in capfd.readouterr().err


def test_simple_queue_put_of_unpicklable_raises_in_the_caller(ctx):
    q = ctx.SimpleQueue()
    with pytest.raises(TypeError, match="pickle"):
        q.put(threading.Lock())
    assert q.empty()


def test_simple_queue_reader_and_writer_closed(ctx):
    q = ctx.SimpleQueue()
    assert not q._reader.closed and not q._writer.closed
    assert q._reader.readable and q._writer.writable
    q.close()
    assert q._reader.closed and q._writer.closed


# ------------------------------------------------------- across the cluster


def produce(q, start, n):
    for i in range(start, start + n):
        q.put(i)
    q.close()  # as in the stdlib: flushes this process's puts
    q.join_thread()
    return os.getpid()


def consume(q, n):
    return os.getpid(), [q.get(timeout=30) for _ in range(n)]


def consume_until_none(q):
    got = []
    while True:
        item = q.get(timeout=60)
        if item is None:
            return os.getpid(), got
        got.append(item)


def test_producer_and_consumer_on_different_workers(fiber_ctx):
    q = fiber_ctx.Queue()
    with fiber_ctx.Pool(2) as pool:
        consumer = pool.apply_async(consume, (q, 5000))
        producer_pid = pool.apply(produce, (q, 0, 5000))
        consumer_pid, got = consumer.get(timeout=60)
    assert got == list(range(5000))  # FIFO per producer
    assert consumer_pid != producer_pid  # two worker processes
    assert q.empty()


def test_many_producers_and_consumers_lose_and_duplicate_nothing(fiber_ctx):
    q = fiber_ctx.Queue()
    with fiber_ctx.Pool(4) as pool:
        consumers = [pool.apply_async(consume_until_none, (q,)) for _ in range(2)]
        producers = [pool.apply_async(produce, (q, k * 1000, 1000)) for k in range(2)]
        for p in producers:
            p.get(timeout=60)
        q.put(None)
        q.put(None)
        got = [x for c in consumers for x in c.get(timeout=60)[1]]
    assert sorted(got) == list(range(2000))


def test_big_payloads_keep_their_type(fiber_ctx):
    q = fiber_ctx.Queue()
    arr = np.random.default_rng(0).random(10 * 2**20 // 8)
    blob = os.urandom(10 * 2**20)
    with fiber_ctx.Pool(1) as pool:
        pool.apply(_put_back_doubled, (q, arr, blob))
    got_arr, got_blob = q.get(timeout=30), q.get(timeout=30)
    assert isinstance(got_arr, np.ndarray) and np.array_equal(got_arr, arr * 2)
    assert got_blob == blob[::-1]


def _put_back_doubled(q, arr, blob):
    q.put(arr * 2)
    q.put(blob[::-1])


def slow_consumer(q, pidfile):
    if os.path.exists(pidfile):
        return  # the re-run after the kill: the test checks what the first left
    with open(pidfile, "w") as f:
        f.write(str(os.getpid()))
    got = []
    while True:
        got.append(q.get(timeout=60))
        time.sleep(0.01)


def test_queue_survives_sigkill_of_a_consumers_worker(fiber_ctx, tmp_path):
    q = fiber_ctx.Queue()
    for i in range(300):
        q.put(i)
    pidfile = tmp_path / "pid"
    with fiber_ctx.Pool(1) as pool:
        rerun = pool.apply_async(slow_consumer, (q, str(pidfile)))
        wait_until(lambda: q.qsize() <= 250, 30, "the consumer to take 50 items")
        os.kill(int(pidfile.read_text()), signal.SIGKILL)
        rerun.get(timeout=60)  # re-run after the loss, and took nothing
    # Everything not taken before the kill is still there, in order, once.
    deadline = time.monotonic() + 10
    left = []
    while True:
        try:
            left.append(q.get(timeout=2))
        except queue.Empty:
            break
        if time.monotonic() > deadline:
            break
    assert left == list(range(left[0], 300))
    assert 0 < left[0] <= 60


def test_queue_in_pool_initializer(fiber_ctx):
    q = fiber_ctx.Queue()
    with fiber_ctx.Pool(2, initializer=_remember_queue, initargs=(q,)) as pool:
        pool.map(_report, range(10))
    assert sorted(q.get(timeout=10) for _ in range(10)) == list(range(10))


_Q = None


def _remember_queue(q):
    global _Q
    _Q = q


def _report(x):
    _Q.put(x)


def test_joinable_queue_across_workers(fiber_ctx):
    q = fiber_ctx.JoinableQueue()
    for i in range(20):
        q.put(i)
    with fiber_ctx.Pool(2) as pool:
        workers = [pool.apply_async(_drain_and_mark_done, (q,)) for _ in range(2)]
        q.join()  # returns only once the workers called task_done for all
        assert sum(w.get(timeout=30) for w in workers) == 20


def _drain_and_mark_done(q):
    n = 0
    while True:
        try:
            q.get(timeout=0.5)
        except queue.Empty:
            return n
        n += 1
        q.task_done()


def _take_ten_then_hang(q, marker):
    """Take 10 items, mark the first 5 done, then wait to be killed."""
    for i in range(10):
        q.get(timeout=30)
        if i < 5:
            q.task_done()
    with open(marker, "w") as f:
        f.write("taken")
    time.sleep(600)


def test_joinable_queue_redelivers_what_a_killed_consumer_did_not_finish(
    fiber_ctx, tmp_path
):
    """A consumer SIGKILLed after its 10th get, 5 of them unfinished: those
    5 are delivered again (at-least-once), so join() still returns once the
    survivors have done every item."""
    from support.wait import wait_for_file, wait_until

    q = fiber_ctx.JoinableQueue()
    for i in range(200):
        q.put(i)
    marker = str(tmp_path / "taken")
    p = fiber_ctx.Process(target=_take_ten_then_hang, args=(q, marker))
    p.start()
    wait_for_file(marker, 60)
    p.kill()
    p.join(30)
    assert p.exitcode == -signal.SIGKILL
    received = []
    while len(received) < 195:
        received.append(q.get(timeout=30))
        q.task_done()
    joined = threading.Event()
    threading.Thread(target=lambda: (q.join(), joined.set()), daemon=True).start()
    wait_until(joined.is_set, 10, "join() after every item was done")
    # The 5 taken but not done came back first; the 5 done did not.
    assert received[:5] == [5, 6, 7, 8, 9]
    assert sorted(received) == list(range(5, 200))
    assert q.empty()


def ping(conn, n):
    for _ in range(n):
        conn.send(conn.recv() + 1)
    return os.getpid()


def test_pipe_between_two_tasks_on_different_workers(fiber_ctx):
    a, b = fiber_ctx.Pipe()
    with fiber_ctx.Pool(2) as pool:
        pa = pool.apply_async(_ping_pong_starter, (a, 50))
        pb = pool.apply_async(ping, (b, 50))
        assert pa.get(timeout=60)[1] == 100
        assert pa.get()[0] != pb.get(timeout=60)


def _ping_pong_starter(conn, n):
    value = 0
    for _ in range(n):
        conn.send(value)
        value = conn.recv() + 1
    return os.getpid(), value


def test_pipe_eof_when_the_holder_process_dies(fiber_ctx, tmp_path):
    a, b = fiber_ctx.Pipe()
    pidfile = tmp_path / "pid"
    with fiber_ctx.Pool(1) as pool:
        pool.apply_async(_hold_and_wait, (b, str(pidfile)))
        assert a.recv() == "holding"
        b.close()  # the task's copy is now the only one
        os.kill(int(pidfile.read_text()), signal.SIGKILL)
        with pytest.raises(EOFError):
            a.recv()


def _hold_and_wait(conn, pidfile):
    with open(pidfile, "w") as f:
        f.write(str(os.getpid()))
    conn.send("holding")
    time.sleep(120)


def test_wrong_authkey_cannot_reach_a_queue(fiber_ctx):
    q = fiber_ctx.Queue()
    q.put("secret")
    address, _, oid, _ = q._ref
    intruder = objserver.Remote(address, b"not-the-key", oid)
    with pytest.raises(multiprocessing.AuthenticationError):
        intruder.call("get", True, 1, 1)
    assert q.get(timeout=5) == "secret"


def test_top_level_names(fiber_ctx):
    assert fiber_dask.Queue is not None
    assert isinstance(fiber_dask.Queue(), fiber_dask.queues.Queue)
    a, b = fiber_dask.Pipe()
    assert isinstance(a, fiber_dask.connection.Connection)


def _put_once(q, x):
    q.put(x)


def _feeder_threads():
    import threading

    return sum(t.name == "fiber-queue-feeder" for t in threading.enumerate())


def test_feeder_threads_end_with_their_queue_handles(fiber_ctx):
    q = fiber_ctx.Queue()
    with fiber_ctx.Pool(1) as pool:
        for i in range(30):
            pool.apply(_put_once, (q, i))
        assert sorted(q.get(timeout=10) for _ in range(30)) == list(range(30))
        # The handles are garbage; their feeders notice within about 1 s.
        wait_until(
            lambda: pool.apply(_feeder_threads) <= 2,
            10,
            "the feeder threads of the collected queue handles to end",
        )


def _take_three_then_idle(q, release):
    got = [q.get(timeout=10) for _ in range(3)]  # fast: the later gets lease
    # Idle, still holding the handle and its lease, until the owner has got
    # the rest (it was a fixed 3 s).
    wait_for_file(release, 60)
    return got


def test_an_idle_consumer_gives_back_its_lease(fiber_ctx, tmp_path):
    q = fiber_ctx.Queue()
    for i in range(500):
        q.put(i)
    release = str(tmp_path / "release")
    with fiber_ctx.Pool(1) as pool:
        res = pool.apply_async(_take_three_then_idle, (q, release))
        wait_until(lambda: q.qsize() < 500, 30, "the consumer to take its items")
        # The owner gets the other 497 while the consumer idles with its lease.
        try:
            mine = [q.get(timeout=2) for _ in range(497)]
        finally:
            open(release, "w").close()
        theirs = res.get(timeout=30)
    assert sorted(mine + theirs) == list(range(500))
    assert theirs == sorted(theirs)
