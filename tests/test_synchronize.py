"""Lock, RLock, Semaphore, BoundedSemaphore and Event: stdlib oracle and fiber_dask,
then across processes, and a holder killed while it holds a lock."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from support.interrupts import python_sigint

pytestmark = pytest.mark.timeout(60)


def test_lock_acquire_release_and_timeout(ctx):
    lock = ctx.Lock()
    assert lock.acquire()
    assert lock.acquire(False) is False
    t0 = time.monotonic()
    assert lock.acquire(timeout=0.3) is False
    assert time.monotonic() - t0 >= 0.25
    lock.release()
    with pytest.raises(ValueError):
        lock.release()
    with lock:
        assert lock.acquire(block=False) is False
    assert lock.acquire(block=False)
    lock.release()


def test_lock_released_by_another_thread(ctx):
    lock = ctx.Lock()
    lock.acquire()
    t = threading.Thread(target=lock.release)
    t.start()
    t.join()
    assert lock.acquire(timeout=5)
    lock.release()


def test_rlock_is_owner_reentrant(ctx):
    rlock = ctx.RLock()
    assert rlock.acquire()
    assert rlock.acquire()
    errors = []

    def other():
        errors.append(rlock.acquire(timeout=0.2))
        try:
            rlock.release()
        except AssertionError:
            errors.append("assert")

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert errors == [False, "assert"]
    rlock.release()
    rlock.release()
    with pytest.raises(AssertionError):
        rlock.release()


def test_semaphore_counts(ctx):
    sem = ctx.Semaphore(2)
    assert sem.acquire() and sem.acquire()
    assert sem.acquire(timeout=0.1) is False
    sem.release()
    sem.release()
    sem.release()  # unbounded: allowed
    assert sem.get_value() == 3


def test_bounded_semaphore_refuses_over_release(ctx):
    sem = ctx.BoundedSemaphore(1)
    sem.acquire()
    sem.release()
    with pytest.raises(ValueError):
        sem.release()


def test_event(ctx):
    ev = ctx.Event()
    assert not ev.is_set()
    assert ev.wait(0.1) is False
    threading.Timer(0.2, ev.set).start()
    assert ev.wait(10) is True
    assert ev.is_set()
    ev.clear()
    assert not ev.is_set()


def critical(lock, path, n):
    # Written straight to a file (not through a queue, whose puts are sent
    # asynchronously): the file's order is the order things happened.
    for _ in range(n):
        with lock:
            with open(path, "a") as f:
                f.write(f"in {os.getpid()}\n")
            time.sleep(0.001)
            with open(path, "a") as f:
                f.write(f"out {os.getpid()}\n")


def test_lock_excludes_across_processes(ctx, tmp_path):
    lock = ctx.Lock()
    path = str(tmp_path / "log")
    procs = [ctx.Process(target=critical, args=(lock, path, 20)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    with open(path) as f:
        events = [line.split() for line in f]
    assert len(events) == 3 * 20 * 2
    # Every "in" is followed by the same process's "out": no interleaving.
    for enter, leave in zip(events[::2], events[1::2], strict=True):
        assert enter[0] == "in" and leave == ["out", enter[1]]


def wait_then_report(ev, q):
    q.put(ev.wait(30))


def test_event_wakes_a_child(ctx):
    ev, q = ctx.Event(), ctx.Queue()
    p = ctx.Process(target=wait_then_report, args=(ev, q))
    p.start()
    time.sleep(0.3)
    ev.set()
    assert q.get(timeout=30) is True
    p.join(30)


def hold_forever(lock, q):
    lock.acquire()
    q.put(os.getpid())
    time.sleep(600)


def test_fiber_lock_of_a_killed_holder_is_released(fiber_ctx):
    lock, q = fiber_ctx.Lock(), fiber_ctx.Queue()
    p = fiber_ctx.Process(target=hold_forever, args=(lock, q))
    p.start()
    pid = q.get(timeout=30)
    assert lock.acquire(timeout=0.3) is False  # really held
    os.kill(pid, signal.SIGKILL)
    p.join(30)
    t0 = time.monotonic()
    assert lock.acquire(timeout=20)  # released with its dead holder
    assert time.monotonic() - t0 < 20
    lock.release()


def test_condition_wait_notify_and_timeout(ctx):
    cond = ctx.Condition()
    with pytest.raises(AssertionError):
        cond.wait(0.1)
    with pytest.raises(AssertionError):
        cond.notify()
    with cond:
        assert cond.wait(0.2) is False  # nobody notifies
    box = []

    def producer():
        time.sleep(0.2)
        with cond:
            box.append(1)
            cond.notify()

    threading.Thread(target=producer).start()
    with cond:
        assert cond.wait_for(lambda: box, timeout=10)
    assert box == [1]


def wait_for_go(cond, ev, q):
    with cond:
        ev.set()
        q.put(cond.wait(30))


def test_condition_across_processes(ctx):
    cond, ev, q = ctx.Condition(), ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=wait_for_go, args=(cond, ev, q)) for _ in range(2)]
    for p in procs:
        ev.clear()
        p.start()
        assert ev.wait(30)  # it holds the condition's lock and is about to wait
    time.sleep(0.3)
    with cond:
        cond.notify_all()
    assert [q.get(timeout=30), q.get(timeout=30)] == [True, True]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0


def barrier_party(barrier, q):
    q.put(barrier.wait(30))


def test_barrier_across_processes(ctx):
    barrier, q = ctx.Barrier(3), ctx.Queue()
    assert barrier.parties == 3 and barrier.n_waiting == 0 and not barrier.broken
    procs = [ctx.Process(target=barrier_party, args=(barrier, q)) for _ in range(2)]
    for p in procs:
        p.start()
    mine = barrier.wait(30)
    indices = sorted([mine, q.get(timeout=30), q.get(timeout=30)])
    assert indices == [0, 1, 2]
    for p in procs:
        p.join(30)


def test_barrier_timeout_abort_reset(ctx):
    barrier = ctx.Barrier(2)
    with pytest.raises(threading.BrokenBarrierError):
        barrier.wait(0.2)
    assert barrier.broken
    barrier.reset()
    assert not barrier.broken
    barrier.abort()
    with pytest.raises(threading.BrokenBarrierError):
        barrier.wait(1)


def add_under_lock(v, arr, n):
    for _ in range(n):
        with v.get_lock():
            v.value += 1
        with arr.get_lock():
            arr[0] = arr[0] + 1


def test_value_and_array_exact_totals_across_processes(ctx):
    v = ctx.Value("i", 0)
    arr = ctx.Array("d", [0.0, 2.5, 5.0])
    procs = [ctx.Process(target=add_under_lock, args=(v, arr, 50)) for _ in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert v.value == 200
    assert arr[:] == [200.0, 2.5, 5.0]
    assert len(arr) == 3 and arr[1:] == [2.5, 5.0]


def test_value_array_api(ctx):
    import ctypes

    v = ctx.Value(ctypes.c_double, 1.5)
    assert v.value == 1.5
    v.value = 2.5
    assert v.value == 2.5
    raw = ctx.RawValue("i", 7)
    assert raw.value == 7
    chars = ctx.Array("c", b"hello")
    assert chars.value == b"hello"
    chars.value = b"hi"
    assert chars.value == b"hi"
    nolock = ctx.Array("i", 4, lock=False)
    assert nolock[:] == [0, 0, 0, 0]
    lock = ctx.Lock()
    shared = ctx.Value("i", 0, lock=lock)
    assert shared.get_lock() is lock
    ra = ctx.RawArray("i", [1, 2, 3])
    assert list(ra) == [1, 2, 3]


def notify_under(lock, cond, q):
    with lock:  # the condition's lock, taken through the lock itself
        q.put("notifying")
        cond.notify_all()


@pytest.mark.parametrize("kind", ["Lock", "RLock"])
def test_condition_with_a_lock_of_your_own(ctx, kind):
    lock = getattr(ctx, kind)()
    cond = ctx.Condition(lock)
    with pytest.raises(AssertionError):
        cond.wait(0.1)  # not held
    with cond:
        # The condition's acquire is the lock's: another thread cannot take it.
        box = []
        t = threading.Thread(target=lambda: box.append(lock.acquire(timeout=0.1)))
        t.start()
        t.join()
        assert box == [False]
        assert cond.wait(0.1) is False  # nobody notifies; the lock comes back
        assert box == [False]
    q = ctx.Queue()
    with cond:
        p = ctx.Process(target=notify_under, args=(lock, cond, q))
        p.start()
        assert cond.wait(30) is True  # released the lock for the child, woken
    assert q.get(timeout=30) == "notifying"
    p.join(30)
    assert p.exitcode == 0
    assert lock.acquire(timeout=5)  # released after the with block
    lock.release()


def test_fiber_condition_refuses_a_foreign_lock(fiber_ctx):
    with pytest.raises(TypeError, match="fiber_dask Lock or RLock"):
        fiber_ctx.Condition(threading.Lock())


def take_and_exit(lock):
    lock.acquire()  # and exit holding it: a hand-off to whoever releases it


@pytest.mark.parametrize("kind", ["Lock", "BoundedSemaphore"])
def test_lock_taken_by_an_exited_child_is_released_by_the_parent(ctx, kind):
    lock = getattr(ctx, kind)()
    p = ctx.Process(target=take_and_exit, args=(lock,))
    p.start()
    p.join(30)
    assert p.exitcode == 0
    assert lock.acquire(False) is False  # still held, as the stdlib's
    lock.release()  # the hand-off
    with pytest.raises(ValueError):
        lock.release()
    assert lock.acquire(timeout=5)
    lock.release()


def interrupt_soon(cond, pid):
    with cond:
        cond.notify()
    time.sleep(0.5)
    os.kill(pid, signal.SIGINT)


def test_condition_wait_interrupted_keeps_the_lock(ctx):
    cond = ctx.Condition()
    with python_sigint(), cond:
        p = ctx.Process(target=interrupt_soon, args=(cond, os.getpid()))
        p.start()
        assert cond.wait(30)
        with pytest.raises(KeyboardInterrupt):
            cond.wait(30)
        # wait() left holding the lock, as threading's does: release works
        # and another process can take it afterwards.
    p.join(30)
    assert cond.acquire(timeout=5)
    cond.release()


def wait_on(cond, ready):
    with cond:
        ready.release()
        cond.wait(30)


def test_condition_counts_waiters_like_the_stdlib(ctx):
    cond, ready = ctx.Condition(), ctx.Semaphore(0)
    p = ctx.Process(target=wait_on, args=(cond, ready))
    p.start()
    assert ready.acquire(timeout=30)
    with cond:  # the waiter is inside wait() now (it released the lock)
        sleeping = cond._sleeping_count.get_value()
        woken = cond._woken_count.get_value()
        assert sleeping - woken == 1
        cond.notify()
    p.join(30)
    assert cond._sleeping_count.get_value() - cond._woken_count.get_value() == 0
    assert cond._wait_semaphore.get_value() == 0


def test_event_repr_is_the_stdlibs(ctx):
    ev = ctx.Event()
    assert repr(ev).startswith("<Event at 0x") and repr(ev).endswith(" unset>")
    ev.set()
    assert repr(ev).endswith(" set>")


# ------------------------------------------- who holds a lock (beyond the stdlib)


@pytest.mark.parametrize("kind", ["Lock", "RLock", "Semaphore", "Condition"])
def test_fiber_holder_names_the_holding_process_its_host_and_for_how_long(
    fiber_ctx, kind
):
    import socket

    from support.wait import wait_until
    from tasks.process import ask_holder, hold_lock

    from fiber_dask.synchronize import LockHolder

    lock = getattr(fiber_ctx, kind)()
    assert lock.holder() is None and lock.holders() == []
    started, release = fiber_ctx.Event(), fiber_ctx.Event()
    name = f"holds-the-{kind}"
    holder = fiber_ctx.Process(
        target=hold_lock, args=(lock, started, release), name=name
    )
    holder.start()
    try:
        assert started.wait(60)
        here = lock.holder()  # asked in the lock's owner (this process)
        assert isinstance(here, LockHolder)
        assert (here.process, here.pid, here.host) == (
            name,
            holder.pid,
            socket.gethostname(),
        )
        assert here.alive and here.thread
        assert 0 <= here.held_for < 60
        assert abs(here.since + here.held_for - time.time()) < 5
        wait_until(
            lambda: lock.holder().held_for > here.held_for + 0.05,
            10,
            "the holding time to grow",
        )
        assert len(lock.holders()) == 1
        # Asked from another process: a round trip to the owner.
        answers = fiber_ctx.Queue()
        asker = fiber_ctx.Process(target=ask_holder, args=(lock, answers))
        asker.start()
        there = answers.get(timeout=60)
        asker.join(30)
        assert isinstance(there, LockHolder)
        assert (there.process, there.pid, there.host) == (name, holder.pid, here.host)
        assert there.since == here.since and there.held_for > here.held_for
    finally:
        release.set()
        holder.join(60)
    assert holder.exitcode == 0
    assert lock.holder() is None and lock.holders() == []


def test_fiber_holders_of_a_semaphore_and_of_a_dead_lock_holder(fiber_ctx):
    from tasks.process import hold_lock

    sem = fiber_ctx.Semaphore(3)
    with sem:
        with sem:
            held = sem.holders()
            assert [h.pid for h in held] == [os.getpid()] * 2
            assert held[0].since <= held[1].since
        assert len(sem.holders()) == 1
    assert sem.holders() == []
    # A Lock's holder that dies keeps it held (for a hand-off), shown as gone.
    lock = fiber_ctx.Lock()
    started, release = fiber_ctx.Event(), fiber_ctx.Event()
    p = fiber_ctx.Process(target=hold_lock, args=(lock, started, release))
    p.start()
    assert started.wait(60)
    pid = p.pid
    os.kill(pid, signal.SIGKILL)
    p.join(30)
    from support.wait import wait_until

    gone = wait_until(
        lambda: (h := lock.holder()) is not None and not h.alive and h,
        30,
        "the holder's death to show",
    )
    assert gone.pid == pid
    assert lock.acquire(timeout=30)  # a waiter takes the dead holder's unit
    (mine,) = lock.holders()
    assert (mine.pid, mine.alive) == (os.getpid(), True)
    lock.release()
    assert lock.holder() is None
