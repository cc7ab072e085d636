"""Managers: the stdlib as the oracle, then what goes beyond it (proxies in Pool
tasks on other workers, AsyncManager, a killed client, a killed server)."""

from __future__ import annotations

import array
import multiprocessing
import os
import signal
import time

import psutil
import pytest
from tasks.managers import (
    FiberAsyncCounterManager,
    connector_class,
    counter_manager,
)

import fiber_dask
from fiber_dask.errors import ManagerConnectionError

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def manager(ctx):
    with ctx.Manager() as m:
        yield m


def ctx_name(ctx) -> str:
    return "fiber" if isinstance(ctx, fiber_dask.DaskContext) else "stdlib"


# --- the shared types, in this process ------------------------------------------


def test_dict_list_namespace_value_array(manager):
    d = manager.dict({"a": 1})
    d["b"] = 2
    d.update(c=3)
    assert sorted(d.items()) == [("a", 1), ("b", 2), ("c", 3)]
    assert d.get("zz", 9) == 9 and "a" in d and len(d) == 3
    with pytest.raises(KeyError):
        d["missing"]
    assert sorted(iter(d)) == ["a", "b", "c"]  # __iter__ returns an Iterator proxy
    lst = manager.list([3, 1])
    lst.append(2)
    lst += [5]
    lst.sort()
    assert lst[:] == [1, 2, 3, 5] and lst[-1] == 5 and len(lst) == 4
    with pytest.raises(IndexError):
        lst[10]
    ns = manager.Namespace(x=1)
    ns.y = "two"
    assert (ns.x, ns.y) == (1, "two")
    with pytest.raises(AttributeError):
        _ = ns.nothing
    v = manager.Value("i", 5)
    v.value += 1
    assert v.value == 6 and v.get() == 6
    arr = manager.Array("d", [1.0, 2.0])
    arr[1] = 4.5
    assert len(arr) == 2 and arr[:] == array.array("d", [1.0, 4.5])
    nested = manager.list([d])  # a proxy inside a managed container
    assert nested[0]["a"] == 1


def test_queues(manager):
    q = manager.Queue(2)
    q.put(1)
    q.put(2)
    assert q.full() and q.qsize() == 2
    import queue

    with pytest.raises(queue.Full):
        q.put(3, timeout=0.1)
    assert [q.get(), q.get()] == [1, 2]
    with pytest.raises(queue.Empty):
        q.get(timeout=0.1)
    jq = manager.JoinableQueue()
    jq.put("x")
    assert jq.get() == "x"
    jq.task_done()
    jq.join()


def test_sync_types(manager):
    lock = manager.Lock()
    assert lock.acquire() and lock.acquire(False) is False
    assert lock.acquire(timeout=0.1) is False
    lock.release()
    with pytest.raises(RuntimeError):
        lock.release()
    with lock:
        pass
    rlock = manager.RLock()
    assert rlock.acquire() and rlock.acquire()
    rlock.release()
    rlock.release()
    with pytest.raises(RuntimeError):
        rlock.release()
    sem = manager.Semaphore(2)
    assert sem.acquire() and sem.acquire() and sem.acquire(timeout=0.1) is False
    sem.release()
    sem.release()
    sem.release()  # unbounded
    bsem = manager.BoundedSemaphore(1)
    bsem.acquire()
    bsem.release()
    with pytest.raises(ValueError):
        bsem.release()
    ev = manager.Event()
    assert not ev.is_set() and ev.wait(0.1) is False
    ev.set()
    assert ev.is_set() and ev.wait(1)
    cond = manager.Condition()
    with cond:
        assert cond.wait(0.1) is False
        cond.notify_all()
    barrier = manager.Barrier(1)
    assert barrier.wait(5) == 0
    assert barrier.parties == 1 and not barrier.broken


def test_pool_from_the_manager(manager):
    pool = manager.Pool(2)
    try:
        assert pool.map(abs, [-1, -2, 3]) == [1, 2, 3]
        assert pool.apply_async(divmod, (7, 2)).get(30) == (3, 1)
        assert sorted(pool.imap_unordered(abs, [-4, 5])) == [4, 5]
    finally:
        pool.terminate()


# --- across processes ------------------------------------------------------------


def increment(counter, lock, key, n):
    for _ in range(n):
        with lock:
            counter.value += 1
            key["total"] = key.get("total", 0) + 1


def test_eight_processes_under_a_managed_lock_give_exact_totals(ctx, manager):
    value, lock, d = manager.Value("i", 0), manager.Lock(), manager.dict()
    procs = [ctx.Process(target=increment, args=(value, lock, d, 25)) for _ in range(8)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert value.value == 200
    assert d["total"] == 200


def record(d, lst, ns, x):
    d[x] = x * x
    lst.append(x)
    ns.last = x
    return os.getpid()


def test_proxies_in_pool_tasks(ctx, manager):
    d, lst, ns = manager.dict(), manager.list(), manager.Namespace()
    with ctx.Pool(2) as pool:
        pids = pool.starmap(record, [(d, lst, ns, i) for i in range(12)], chunksize=1)
    assert dict(d) == {i: i * i for i in range(12)}
    assert sorted(lst) == list(range(12))
    assert ns.last in range(12)
    assert os.getpid() not in pids


def producer(q, n):
    for i in range(n):
        q.put(i)
    q.put(None)


def test_managed_queue_between_processes(ctx, manager):
    q = manager.Queue()
    p = ctx.Process(target=producer, args=(q, 50))
    p.start()
    got = []
    while (item := q.get(timeout=30)) is not None:
        got.append(item)
    p.join(30)
    assert got == list(range(50))


def wait_at(barrier, ev, q):
    q.put(barrier.wait(30))
    ev.wait(30)


def test_barrier_and_event_across_processes(ctx, manager):
    barrier, ev, q = manager.Barrier(3), manager.Event(), manager.Queue()
    procs = [ctx.Process(target=wait_at, args=(barrier, ev, q)) for _ in range(2)]
    for p in procs:
        p.start()
    mine = barrier.wait(30)
    ev.set()
    assert sorted([mine, q.get(timeout=30), q.get(timeout=30)]) == [0, 1, 2]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0


# --- custom types, connect() ----------------------------------------------------------


def test_registered_custom_class(ctx):
    with counter_manager(ctx_name(ctx)) as m:
        c = m.Counter(5)
        assert c.add(2) == 7 and c.get() == 7
        assert c.pid() == m._process.pid  # the object lives in the server
        with pytest.raises(KeyError, match="boom"):
            c.fail("boom")
        with pytest.raises(AttributeError):
            c._private()  # not exposed
        parent = m.ChildCounter(3)
        child = parent.child()  # method_to_typeid: a proxy to a new object
        assert child.get() == 30 and child.add(1) == 31


def use_connected(address, authkey, ctx_name_, out):
    m = connector_class(ctx_name_)(address=address, authkey=authkey)
    m.connect()
    out.put(m.Counter(40).add(2))


def test_connect_by_address_and_authkey(ctx):
    authkey = b"secret key"
    with counter_manager(ctx_name(ctx), authkey=authkey) as m:
        q = ctx.Queue()
        p = ctx.Process(
            target=use_connected, args=(m.address, authkey, ctx_name(ctx), q)
        )
        p.start()
        assert q.get(timeout=30) == 42
        p.join(30)
        assert p.exitcode == 0
        bad = connector_class(ctx_name(ctx))(address=m.address, authkey=b"wrong")
        with pytest.raises(multiprocessing.AuthenticationError):
            bad.connect()


def test_manager_lifecycle_errors(ctx):
    m = counter_manager(ctx_name(ctx))
    m.start()
    with pytest.raises(multiprocessing.ProcessError, match="Already started"):
        m.start()
    m.shutdown()
    with pytest.raises(multiprocessing.ProcessError, match="shut down"):
        m.start()


# --- beyond the stdlib ---------------------------------------------------------------


def test_fiber_server_listens_where_the_cluster_is_and_holds_no_worker(fiber_ctx):
    from fiber_dask import cluster

    with fiber_ctx.Manager() as m:
        assert m.address[0] == cluster.get_handle().listen_host
        server = psutil.Process(m._process.pid)
        assert server.ppid() == os.getpid()  # beside us, not on a Dask worker
        client = cluster.get_client()
        assert not any(client.processing().values())  # no task pins a worker


def hold_managed_lock(lock, q):
    lock.acquire()
    q.put(os.getpid())
    time.sleep(600)


def test_fiber_managed_lock_of_a_killed_client_is_released(fiber_ctx):
    with fiber_ctx.Manager() as m:
        lock, q = m.Lock(), m.Queue()
        p = fiber_ctx.Process(target=hold_managed_lock, args=(lock, q))
        p.start()
        pid = q.get(timeout=30)
        assert lock.acquire(timeout=0.3) is False  # really held
        os.kill(pid, signal.SIGKILL)
        p.join(30)
        assert lock.acquire(timeout=20)  # released with its dead holder
        lock.release()
        d = m.dict(a=1)  # the manager itself is unaffected
        assert d["a"] == 1


def test_fiber_killed_server_gives_a_clear_error_not_a_hang(fiber_ctx):
    m = fiber_ctx.Manager()
    try:
        d = m.dict(a=1)
        assert d["a"] == 1
        os.kill(m._process.pid, signal.SIGKILL)
        m._process.join(10)
        t0 = time.monotonic()
        with pytest.raises(ManagerConnectionError, match="manager at") as info:
            d["a"]
        assert isinstance(info.value, EOFError)  # what stdlib code catches
        with pytest.raises(ManagerConnectionError, match="cannot reach the manager"):
            m.dict()
        assert time.monotonic() - t0 < 15
    finally:
        m.shutdown()


def make_manager_then_wait(q):
    m = fiber_dask.Manager()
    q.put(m._process.pid)
    time.sleep(600)


def test_fiber_server_exits_with_its_killed_owner(fiber_ctx):
    q = fiber_ctx.Queue()
    p = fiber_ctx.Process(target=make_manager_then_wait, args=(q,))
    p.start()
    server_pid = q.get(timeout=60)
    assert psutil.pid_exists(server_pid)
    os.kill(p.pid, signal.SIGKILL)
    p.join(30)
    server = None
    try:
        server = psutil.Process(server_pid)
        server.wait(15)
    except psutil.NoSuchProcess:
        pass
    assert server is None or not server.is_running() or server.status() == "zombie"


def test_fiber_async_manager_pipelines_calls():
    with FiberAsyncCounterManager() as m:
        counters = [m.Counter(i).get() for i in range(100)]  # creation is sync
        assert [r.get(30) for r in counters] == list(range(100))
        c = m.Counter()
        results = [c.add(1) for _ in range(200)]  # sent at once, no waiting
        assert results[-1].get(30) == 200  # the last one read first
        assert [r.get() for r in results] == list(range(1, 201))
        assert results[0].ready() and results[0].successful()
        failing = c.fail("nope")
        with pytest.raises(KeyError, match="nope"):
            failing.result()
        slow = c.slow(0.5, "late")
        with pytest.raises(multiprocessing.TimeoutError):
            slow.get(0.05)
        assert slow.get(30) == "late"
        d = m.dict()
        d.__setitem__("k", 1).get()
        assert d.get("k").get() == 1 and d["k"].get() == 1


def test_fiber_managers_submodule_is_a_drop_in():
    import multiprocessing.managers as std

    import fiber_dask.managers as ours

    assert set(std.__all__) <= set(ours.__all__)
    m = fiber_dask.Manager()
    try:
        assert isinstance(m, ours.SyncManager)
        assert isinstance(m, std.SyncManager.__mro__[1])  # a stdlib BaseManager
    finally:
        m.shutdown()


def take_managed_lock_and_exit(lock):
    lock.acquire()


@pytest.mark.parametrize("kind", ["Lock", "BoundedSemaphore"])
def test_managed_lock_taken_by_an_exited_child_is_released_by_the_parent(
    ctx, manager, kind
):
    lock = getattr(manager, kind)()
    p = ctx.Process(target=take_managed_lock_and_exit, args=(lock,))
    p.start()
    p.join(60)
    assert p.exitcode == 0
    lock.release()  # a hand-off, as with the stdlib
    with pytest.raises((RuntimeError, ValueError)):
        lock.release()


def test_xmlrpclib_serializer_by_its_stdlib_name(ctx):
    manager_cls = (
        fiber_dask.managers.SyncManager
        if ctx_name(ctx) == "fiber"
        else multiprocessing.managers.SyncManager
    )
    with manager_cls(serializer="xmlrpclib") as m:
        d = m.dict()
        d["x"] = None  # xmlrpc's None needs allow_none, which the stdlib sets
        assert d.get("x", 1) is None
    with pytest.raises(ValueError, match="xmlrpclib"):
        fiber_dask.managers.SyncManager(serializer="json")
