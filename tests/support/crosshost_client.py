"""The user's side of the cross-host tests: run on the client host.

``python crosshost_client.py <scenario> '<json params>'`` inside the client's
network namespace (see ``netns.py``), attached to the cluster the way a user
would: ``DASK_SCHEDULER_ADDRESS`` in the environment, ``import fiber_dask as
multiprocessing``.  Every observation is printed as one JSON line
(``{"event": ..., ...}``) for the test to check; the test answers on stdin
where a scenario waits for it (to kill or cut a host at the right moment).

Functions that run remotely are defined here, in ``__main__``: they travel by
value with cloudpickle, as a user's script's would.  ``host_ip()`` reads
the host's own address from its interface, independently of fiber-dask.
"""

from __future__ import annotations

import fcntl
import json
import os
import queue
import signal
import socket
import struct
import sys
import time
import traceback

from wait import wait_until  # tests/support, this script's directory

import fiber_dask as multiprocessing

from support import stackdump

T0 = time.monotonic()


def emit(event: str, **data) -> None:
    data["t"] = round(time.monotonic() - T0, 3)
    data["clock"] = time.monotonic()  # CLOCK_MONOTONIC: shared by all namespaces
    print(json.dumps({"event": event, **data}, default=repr), flush=True)


def wait_line() -> str:
    line = sys.stdin.readline()
    if not line:
        raise SystemExit("the test went away")
    return line.strip()


def host_ip(dev: str = "eth0") -> str:
    """This host's address on the Dask network, read from its interface."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", dev.encode()))
    return socket.inet_ntoa(packed[20:24])


def check(cond: bool, what: str, **details) -> None:
    if not cond:
        raise AssertionError(f"{what}: {json.dumps(details, default=repr)}")


# ------------------------------------------------------------ remote functions


def square_where(x, delay=0.0):
    if delay:
        time.sleep(delay)
    return x * x, host_ip(), os.getpid()


def put_where(q, i):
    q.put((i, host_ip()))
    return i


def exit_with(code):
    sys.exit(code)


def raise_value_error():
    raise ValueError("raised on purpose")


def child_basic(q, conn, lock):
    """Talks to the client over a Queue, a Pipe and a Lock it created."""
    q.put(("hello", host_ip(), os.getpid()))
    x = conn.recv()
    conn.send(("echo", x, host_ip()))
    q.put(("lock-busy", lock.acquire(timeout=0.5)))
    lock.acquire()  # the client releases it now
    q.put(("lock-acquired", host_ip()))
    check(conn.recv() == "release", "protocol")
    lock.release()
    q.put(("lock-released", host_ip()))


def child_owner(q, n):
    """Owns a Queue and a Pipe on its own host; another host uses them."""
    mine = multiprocessing.Queue()
    a, b = multiprocessing.Pipe()
    q.put(("owner", host_ip(), mine, b))
    got = [mine.get(timeout=30) for _ in range(n)]
    check(a.poll(30), "no pipe message from the other worker host")
    piped = a.recv()
    q.put(("owner-got", host_ip(), got, piped))


def child_user(mine, b, n):
    for i in range(n):
        mine.put((i, host_ip()))
    b.send(("piped", host_ip()))
    mine.close()
    mine.join_thread()


def child_nested_pool(q):
    """A Process that uses the cluster itself: a Pool from a worker host."""
    with multiprocessing.Pool(2) as pool:
        res = pool.map(square_where, range(20))
    q.put(("nested", host_ip(), [r[0] for r in res], sorted({r[1] for r in res})))


def child_manager(d, lst, mq, mlock):
    with mlock:
        d[host_ip()] = os.getpid()
        lst.append(host_ip())
    mq.put(("manager", host_ip()))


def child_serving(q, conn):
    """Owns a Queue and a Lock on a worker host; answers until told to stop."""
    mine = multiprocessing.Queue()
    lk = multiprocessing.Lock()
    q.put(("serving", host_ip(), mine, lk))
    while conn.recv() != "stop":
        item = mine.get(timeout=30)
        with lk:
            q.put(("served", item, host_ip()))


_KEEP: list = []  # what a pool task keeps alive in its slot process


def pool_task_queue(_):
    """A Queue created inside a Pool task on a worker host (in its slot
    process), kept alive there while the pool is open."""
    qq = multiprocessing.Queue()
    _KEEP.append(qq)
    qq.put("from-pool-task")
    return qq, host_ip()


def slow_square(x, delay=0.05):
    """(x*x, host, pid, when): the clock is CLOCK_MONOTONIC, which every
    namespace of this machine shares."""
    time.sleep(delay)
    return x * x, host_ip(), os.getpid(), time.monotonic()


def child_doomed(lock, mlock, q, qi, rq, conn, n_produce, n_take):
    """On the host about to die: hold a lock and a Manager's lock, put items,
    take a few from another queue, say so, and wait in a Pipe's recv()."""
    lock.acquire()
    mlock.acquire()
    for i in range(n_produce):
        q.put(("produced", i))
    q.close()
    q.join_thread()  # all sent to the owner
    taken = [qi.get(timeout=30) for _ in range(n_take)]
    rq.put(("ready", os.getpid(), host_ip(), taken))
    conn.recv()  # never comes
    time.sleep(3600)


def child_cut(lock, conn):
    """On the host the test cuts off: hold a lock, own a queue, answer pings."""
    lock.acquire()
    mine = multiprocessing.Queue()
    conn.send(("ready", os.getpid(), host_ip(), mine))
    while True:
        conn.send(("pong", conn.recv()))


def wire_child(q, back, ml, carried, token):
    """On a worker host: take the client's queue items, send some back, add
    to the client's Manager; ``carried`` came in this Process's arguments.
    Markers are made here from the token, so each crosses the network only
    on the path it names."""
    got = [q.get(timeout=30) for _ in range(3)]
    back.put((f"QUEUE-BACK-{token}" * 40, host_ip(), len(got), carried[:8]))
    ml.append(f"MANAGER-{token}" * 40)
    back.close()
    back.join_thread()


def wire_task(arg, token):
    """A Pool task: its argument and its result carry markers."""
    return arg.count(f"POOL-ARG-{token}"), f"POOL-RESULT-{token}" * 40, host_ip()


class Stdin:
    """Lines from the test, read in the background (the main thread works)."""

    def __init__(self) -> None:
        import threading

        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in sys.stdin:
            self.lines.put(line.strip())

    def get(self, timeout: float) -> str:
        return self.lines.get(timeout=timeout)


def watch(results: dict, key: str, fn, *args) -> None:
    """Run ``fn(*args)`` in a thread; record when it returned, and what."""
    import threading

    start = time.monotonic()

    def run():
        error = None
        try:
            value = fn(*args)
        except BaseException as e:
            value, error = repr(e), e
        results[key] = {
            "start": start,
            "clock": time.monotonic(),
            "value": value,
            "connection_error": isinstance(error, ConnectionError),
        }

    threading.Thread(target=run, daemon=True).start()


# ------------------------------------------------------------------- scenarios


def scenario_basic(params: dict) -> dict:
    """Pool, Process, Queue, Pipe, Lock (and Manager) with parties on
    different hosts."""
    mp = multiprocessing
    from fiber_dask import cluster
    from fiber_dask.comm.objserver import get_object_server

    hosts = params["workers"]  # worker host name -> its address
    out: dict = {"client": host_ip()}
    handle = cluster.get_handle()
    out["scheduler"] = handle.client.scheduler.address
    out["listen_host"] = handle.listen_host

    # Pool: every worker host takes part; results in order and correct.
    with mp.Pool(len(hosts)) as pool:
        res = pool.starmap(square_where, [(x, 0.01) for x in range(120)], chunksize=1)
        check([r[0] for r in res] == [x * x for x in range(120)], "pool results")
        out["pool_hosts"] = sorted({r[1] for r in res})
        out["pool_pids"] = len({r[2] for r in res})
        out["apply"] = pool.apply_async(square_where, (7,)).get(timeout=60)[0]
        out["imap"] = [r[0] for r in pool.imap(square_where, range(10))]
        q = mp.Queue()
        done = pool.starmap(put_where, [(q, i) for i in range(12)], chunksize=1)
        got = sorted(q.get(timeout=30) for _ in done)
        out["pool_queue"] = [g[0] for g in got]
        out["pool_queue_hosts"] = sorted({g[1] for g in got})
    emit("pool-done", hosts=out["pool_hosts"])

    # Process on w1 with a Queue, a Pipe and a Lock owned by the client.
    names = sorted(hosts)
    q = mp.Queue()
    lock = mp.Lock()
    parent_end, child_end = mp.Pipe()
    lock.acquire()
    p = mp.Process(
        target=child_basic, args=(q, child_end, lock), resources={names[0]: 1}
    )
    p.start()
    hello = q.get(timeout=60)
    out["process_hello"] = hello[:2]
    out["process_pid_matches"] = hello[2] == p.pid
    parent_end.send({"x": [1, 2, 3]})
    check(parent_end.poll(30), "no echo through the pipe")
    out["pipe_echo"] = parent_end.recv()
    out["lock_busy_for_child"] = q.get(timeout=30)[1]
    lock.release()
    out["child_acquired"] = q.get(timeout=30)
    out["client_blocked_while_child_holds"] = not lock.acquire(timeout=0.3)
    parent_end.send("release")
    out["child_released"] = q.get(timeout=30)[0]
    out["client_reacquired"] = lock.acquire(timeout=30)
    lock.release()
    p.join(60)
    out["process_exitcode"] = p.exitcode

    # Worker host to worker host: a Queue and a Pipe owned by a Process on w1,
    # used by a Process on w2; the data never passes through the client.
    owner = mp.Process(target=child_owner, args=(q, 5), resources={names[0]: 1})
    owner.start()
    kind, owner_host, mine, b = q.get(timeout=60)
    out["owner_queue_address"] = mine._ref[0]
    user = mp.Process(target=child_user, args=(mine, b, 5), resources={names[1]: 1})
    user.start()
    kind, owner_host2, got, piped = q.get(timeout=60)
    out["worker_to_worker"] = {
        "owner": owner_host,
        "items": [g[0] for g in got],
        "from": sorted({g[1] for g in got}),
        "piped": piped,
    }
    user.join(60)
    owner.join(60)
    out["w2w_exitcodes"] = [owner.exitcode, user.exitcode]

    # Exit codes, as the stdlib's, from the third host.
    last = names[-1]
    ps = [
        mp.Process(target=exit_with, args=(3,), resources={last: 1}),
        mp.Process(target=raise_value_error, resources={last: 1}),
        mp.Process(target=child_nested_pool, args=(q,), resources={last: 1}),
    ]
    for p in ps:
        p.start()
    nested = q.get(timeout=90)
    for p in ps:
        p.join(60)
    out["exitcodes"] = [p.exitcode for p in ps]
    out["nested_pool"] = {"host": nested[1], "results": nested[2], "hosts": nested[3]}
    out["client_endpoint"] = list(get_object_server().address)
    return out


def spin_after_hello(q):
    q.put(("spinning", host_ip(), os.getpid()))
    while True:  # pure Python: SIGINT raises KeyboardInterrupt here
        pass


def hold_lock_until(lock, q, release):
    lock.acquire()
    q.put(("holding", host_ip(), os.getpid()))
    release.wait(60)
    lock.release()


def ask_holder_from(lock, q):
    holder = lock.holder()
    q.put(("asked", host_ip(), None if holder is None else tuple(holder)))


def trap_task(directory, x):
    """An executor call: say where it runs, record a SIGTERM, wait (polling)."""
    pid = os.getpid()

    def on_sigterm(signum, frame):
        open(os.path.join(directory, f"sigterm-{pid}"), "w").close()
        os._exit(0)

    signal.signal(signal.SIGTERM, on_sigterm)
    with open(os.path.join(directory, f"started-{pid}"), "w") as f:
        f.write(host_ip())
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        time.sleep(0.01)
    return x


def scenario_py314(params: dict) -> dict:
    """Python 3.14's Process.interrupt() and executor terminate_workers(),
    and lock.holder(), with the processes on worker hosts."""
    mp = multiprocessing
    import psutil

    import fiber_dask.futures

    names = sorted(params["workers"])
    out: dict = {}
    q = mp.Queue()

    p = mp.Process(target=spin_after_hello, args=(q,), resources={names[1]: 1})
    p.start()
    hello = q.get(timeout=60)
    p.interrupt()
    p.join(30)
    out["interrupt"] = [hello[1], p.exitcode]

    lock, release = mp.Lock(), mp.Event()
    holder = mp.Process(
        target=hold_lock_until,
        args=(lock, q, release),
        resources={names[2]: 1},
        name="holder-on-w3",
    )
    holder.start()
    _, where, pid = q.get(timeout=60)
    here = lock.holder()
    asker = mp.Process(target=ask_holder_from, args=(lock, q), resources={names[0]: 1})
    asker.start()
    _, asked_from, there = q.get(timeout=60)
    asker.join(30)
    release.set()
    holder.join(60)
    out["holder"] = {
        "where": where,
        "here": [here.process, here.pid == pid, here.alive, here.held_for >= 0],
        "asked_from": asked_from,
        "there": [there[0], there[1] == pid],
        "after": lock.holder(),
    }

    directory = params["dir"]
    ex = fiber_dask.futures.ProcessPoolExecutor(len(names))
    futures = [ex.submit(trap_task, directory, x) for x in range(len(names) + 2)]

    def started():
        return [f for f in os.listdir(directory) if f.startswith("started-")]

    wait_until(lambda: len(started()) == len(names), 90, "every worker to run a call")
    pids = sorted(int(f.split("-")[1]) for f in started())
    ex.terminate_workers()
    wait_until(
        lambda: not any(psutil.pid_exists(p) for p in pids), 30, "the workers to go"
    )
    wait_until(lambda: all(f.done() for f in futures), 30, "every call to end")
    hosts = set()
    for f in started():
        with open(os.path.join(directory, f)) as fh:
            hosts.add(fh.read())
    out["terminate"] = {
        "hosts": sorted(hosts),
        "signalled": sorted(
            int(f[8:]) for f in os.listdir(directory) if f.startswith("sigterm-")
        )
        == pids,
        "outcomes": sorted(
            "cancelled" if f.cancelled() else type(f.exception()).__name__
            for f in futures
        ),
    }
    try:
        ex.submit(abs, 1)
        out["submit_after"] = "accepted"
    except RuntimeError as e:
        out["submit_after"] = type(e).__name__
    ex.shutdown()
    return out


def scenario_manager(params: dict) -> dict:
    """A Manager on the client; its proxies used from two worker hosts."""
    mp = multiprocessing
    names = sorted(params["workers"])
    out: dict = {}
    with mp.Manager() as manager:
        d = manager.dict()
        lst = manager.list()
        mq = manager.Queue()
        mlock = manager.Lock()
        ps = [
            mp.Process(target=child_manager, args=(d, lst, mq, mlock), resources={n: 1})
            for n in names[:2]
        ]
        for p in ps:
            p.start()
        got = sorted(mq.get(timeout=60) for _ in ps)
        for p in ps:
            p.join(60)
        out["dict"] = dict(d)
        out["list"] = sorted(lst)
        out["queue"] = got
        out["exitcodes"] = [p.exitcode for p in ps]
        out["manager_address"] = list(manager.address)
    return out


def scenario_wire(params: dict) -> dict:
    """Data with known markers (``<PATH>-<token>``) through a Queue (both
    ways), a Process's arguments, a Manager and a Pool's arguments and
    results, between this host and the worker hosts, while the test captures
    at the switch."""
    mp = multiprocessing
    names = sorted(params["workers"])
    token = params["token"]
    out: dict = {}
    with mp.Manager() as manager:
        q, back = mp.Queue(), mp.Queue()
        ml = manager.list()
        for _ in range(3):
            q.put(f"QUEUE-{token}" * 40)
        p = mp.Process(
            target=wire_child,
            args=(q, back, ml, f"PROCESS-{token}" * 40, token),
            resources={names[0]: 1},
        )
        p.start()
        item, where, n, carried = back.get(timeout=60)
        p.join(60)
        out["queue_back"] = item == f"QUEUE-BACK-{token}" * 40 and n == 3
        out["process"] = [where, carried, p.exitcode]
        out["manager"] = list(ml) == [f"MANAGER-{token}" * 40]
    with mp.Pool(2) as pool:
        args = [(f"POOL-ARG-{token}" * 40, token)] * 6
        res = pool.starmap(wire_task, args, chunksize=1)
    out["pool"] = [r[0] for r in res] == [40] * 6 and all(
        r[1] == f"POOL-RESULT-{token}" * 40 for r in res
    )
    out["pool_hosts"] = sorted({r[2] for r in res})
    return out


def scenario_serve(params: dict) -> dict:
    """Open every kind of fiber-dask endpoint, on the client and on worker
    hosts; report them; wait while the test inspects and attacks them; then
    check they all still work."""
    mp = multiprocessing
    from fiber_dask.comm.objserver import get_object_server

    names = sorted(params["workers"])
    q = mp.Queue()
    lock = mp.Lock()
    parent_end, child_end = mp.Pipe()
    manager = mp.Manager()
    md = manager.dict()
    pool = mp.Pool(1)  # (each worker host has one task slot: leave some free)
    ((qq, qq_host),) = pool.map(pool_task_queue, [0])
    p = mp.Process(target=child_serving, args=(q, child_end), resources={names[0]: 1})
    p.start()
    _, serving_host, mine, lk = q.get(timeout=60)
    endpoints = [
        {
            "role": "client objects",
            "host": host_ip(),
            "addr": get_object_server().address,
        },
        {"role": "client pool", "host": host_ip(), "addr": pool._server.address},
        {"role": "client manager", "host": host_ip(), "addr": manager.address},
        {"role": "process child objects", "host": serving_host, "addr": mine._ref[0]},
        {"role": "pool task objects", "host": qq_host, "addr": qq._ref[0]},
    ]
    emit("endpoints", endpoints=endpoints)
    check(wait_line() == "verify", "protocol")

    # Every check opens new connections to the endpoints (the client's first
    # use of the worker-side objects, a new Pool's loops and tasks, a new
    # managed object), so it fails if an endpoint stopped accepting.
    out: dict = {"endpoints": endpoints}
    checks = {}
    start = time.monotonic()
    mine.put("ping")
    parent_end.send("go")
    checks["worker queue+lock"] = q.get(timeout=30) == ("served", "ping", serving_host)
    with lk:
        with lock:
            checks["locks"] = True
    checks["pool task queue"] = qq.get(timeout=30) == "from-pool-task"
    with mp.Pool(1) as pool2:
        q2 = mp.Queue()
        pool2.starmap(put_where, [(q2, i) for i in range(4)], chunksize=1)
        checks["new pool"] = sorted(q2.get(timeout=30)[0] for _ in range(4)) == [
            0,
            1,
            2,
            3,
        ]
    checks["pool"] = [r[0] for r in pool.map(square_where, range(8))] == [
        x * x for x in range(8)
    ]
    md2 = manager.dict()
    md2["k"] = host_ip()
    md["k"] = host_ip()
    checks["manager"] = dict(md2) == dict(md) == {"k": host_ip()}
    out["checks"] = checks
    out["verify_seconds"] = round(time.monotonic() - start, 2)
    parent_end.send("stop")
    p.join(60)
    out["exitcode"] = p.exitcode
    pool.close()
    pool.join()
    manager.shutdown()
    return out


def scenario_kill(params: dict) -> dict:
    """A Pool map, a Process, a lock and queues with a party on the host the
    test kills (every process SIGKILLed) in the middle."""
    mp = multiprocessing
    doomed = params["doomed"]  # host name (= its Dask resource)
    doomed_ip = params["doomed_ip"]
    n = params["items"]
    stdin = Stdin()
    out: dict = {}
    lock = mp.Lock()
    manager = mp.Manager()
    mlock = manager.Lock()
    q, qi, rq = mp.Queue(), mp.Queue(), mp.Queue()
    parent_end, child_end = mp.Pipe()
    for i in range(100):
        qi.put(i)
    p = mp.Process(
        target=child_doomed,
        args=(lock, mlock, q, qi, rq, child_end, 20, 10),
        resources={doomed: 1},
    )
    p.start()
    child_end.close()  # as with the stdlib: only the child holds that end now
    _, pid, where, taken = rq.get(timeout=60)
    check(where == doomed_ip and pid == p.pid, "the process is not on the host")
    check(not lock.acquire(timeout=0.2), "the lock is not held there")
    check(not mlock.acquire(timeout=0.2), "the manager's lock is not held there")
    out["taken_before_kill"] = taken

    pool = mp.Pool(params["slots"])
    wait_for_slot_on(pool, doomed_ip)
    it = pool.imap(slow_square, range(n))
    results = []
    killed_at = None
    watched: dict = {}
    for r in it:
        results.append(r)
        if killed_at is None and len(results) >= params["kill_after"]:
            if "asked" not in watched and any(x[1] == doomed_ip for x in results):
                watched["asked"] = True
                emit("kill-now", done=len(results))
                watch(watched, "join", lambda: (p.join(60), p.exitcode)[1])
                watch(watched, "lock", lock.acquire, True, 60)
                watch(watched, "pipe", parent_end.recv)
                watch(watched, "manager lock", mlock.acquire, True, 60)
        if killed_at is None and "asked" in watched:
            try:
                killed_at, dead_at = map(float, stdin.get(timeout=0).split()[1:])
            except queue.Empty:
                pass
    done_at = time.monotonic()
    check("asked" in watched, "the doomed host ran no pool task", results=results)
    if killed_at is None:
        killed_at, dead_at = map(float, stdin.get(timeout=60).split()[1:])
    pool.close()
    pool.join()
    deadline = time.monotonic() + 60
    while len(watched) < 5 and time.monotonic() < deadline:
        time.sleep(0.05)

    xs = [r[0] for r in results]
    out["map"] = {
        "count": len(results),
        "correct": xs == [x * x for x in range(n)],
        "unique": len(set(xs)),
        "by_doomed_before_kill": sum(
            1 for r in results if r[1] == doomed_ip and r[3] < killed_at
        ),
        "by_doomed_after_kill": sum(
            1 for r in results if r[1] == doomed_ip and r[3] >= dead_at
        ),
        "hosts": sorted({r[1] for r in results}),
        "done_after_kill": round(done_at - killed_at, 2),
        "done_in": round(done_at - T0, 2),
        "killed_at": round(killed_at - T0, 2),
    }
    out["process"] = {
        "exitcode": p.exitcode,
        "reason": p.reason,
        "join_after_kill": round(watched["join"]["clock"] - killed_at, 2)
        if "join" in watched
        else None,
    }
    out["pipe"] = {
        "recv": watched.get("pipe", {}).get("value"),
        "after_kill": round(watched["pipe"]["clock"] - killed_at, 2)
        if "pipe" in watched
        else None,
    }
    for key in ("lock", "manager lock"):
        out[key] = {
            "acquired": watched.get(key, {}).get("value"),
            "after_kill": round(watched[key]["clock"] - killed_at, 2)
            if key in watched
            else None,
        }
    produced = []
    try:
        while True:
            produced.append(q.get(timeout=1)[1])
    except queue.Empty:
        pass
    out["produced"] = produced
    rest = []
    try:
        while True:
            rest.append(qi.get(timeout=1))
    except queue.Empty:
        pass
    out["queue_rest"] = rest
    manager.shutdown()
    return out


def wait_for_slot_on(pool, ip: str, timeout: float = 60.0) -> None:
    """Until one of the pool's slots runs on the host at ``ip`` (on a loaded
    machine its slots can come up after the others have done a whole map)."""

    def host(slot):
        where = slot.worker or ""
        return where.rpartition("//")[2].rpartition(":")[0]

    try:
        wait_until(
            lambda: any(host(s) == ip for s in pool._pool),
            timeout,
            f"a pool slot on the host {ip}",
        )
    except AssertionError:
        check(
            False,
            "no pool slot came up on the host",
            ip=ip,
            slots=[s.worker for s in pool._pool],
        )


def _map_across(pool, n, host_of_interest, ask, stdin, ordered=True):
    """imap (or imap_unordered) ``n`` slow squares; once the host of interest
    has run some, emit ``ask`` and take the clock the test sends back.
    Returns what was seen, and that clock."""
    results, asked, clock = [], False, None
    imap = pool.imap if ordered else pool.imap_unordered
    for r in imap(slow_square, range(n)):
        results.append(r)
        if (
            not asked
            and len(results) >= 20
            and any(x[1] == host_of_interest for x in results)
        ):
            asked = True
            emit(ask, done=len(results))
        if asked and clock is None:
            try:
                clock = float(stdin.get(timeout=0).split()[1])
            except queue.Empty:
                pass
    done = time.monotonic()
    check(asked, "the host ran no pool task", hosts=sorted({r[1] for r in results}))
    if clock is None:
        clock = float(stdin.get(timeout=60).split()[1])
    xs = [r[0] for r in results]
    if not ordered:
        xs.sort()
    return {
        "count": len(results),
        "correct": xs == [x * x for x in range(n)],
        "unique": len(set(xs)),
        "hosts": sorted({r[1] for r in results}),
        "by_host_after_cut": sum(
            1 for r in results if r[1] == host_of_interest and clock <= r[3]
        ),
        "done_after_cut": round(done - clock, 2),
    }, clock


def scenario_partition(params: dict) -> dict:
    """Cut a worker host off mid-job, shortly then for longer than
    fiber.peer-timeout, and plug it back in."""
    mp = multiprocessing
    cut, cut_ip = params["host"], params["host_ip"]
    stdin = Stdin()
    out: dict = {"peer_timeout": params["peer_timeout"]}
    lock = mp.Lock()
    parent_end, child_end = mp.Pipe()
    p = mp.Process(target=child_cut, args=(lock, child_end), resources={cut: 1})
    p.start()
    child_end.close()  # as with the stdlib: only the child holds that end now
    check(parent_end.poll(60), "the process on the host did not start")
    _, pid, where, mine = parent_end.recv()
    check(where == cut_ip and pid == p.pid, "the process is not on the host")
    pool = mp.Pool(params["slots"])
    wait_for_slot_on(pool, cut_ip)

    # 1. A short cut, shorter than the timeout: everything rides it out.
    out["short"], cut_at = _map_across(pool, 150, cut_ip, "cut-short", stdin)
    check(stdin.get(timeout=60) == "restored", "protocol")
    parent_end.send("after the short cut")
    out["short"]["pipe_after"] = parent_end.recv() if parent_end.poll(30) else None
    out["short"]["process_alive"] = p.is_alive()
    out["short"]["lock_still_held"] = not lock.acquire(timeout=0.2)

    # 2. A long cut: the map completes without the host, within the timeout;
    # what the Process there held or owned fails as it would if it had died.
    # Waiting from before the cut: when they return says when the loss was seen.
    watched: dict = {}
    watch(watched, "join", lambda: (p.join(60), p.exitcode)[1])
    watch(watched, "lock", lock.acquire, True, 60)
    watch(watched, "pipe recv", parent_end.recv)
    emit("arm")
    check(stdin.get(timeout=60) == "armed", "protocol")
    # (imap_unordered: an ordered imap's results wait behind the lost chunk,
    # and back-pressure then idles the other workers; here they go on.)
    out["long"], cut_at = _map_across(
        pool, 200, cut_ip, "cut-long", stdin, ordered=False
    )
    emit("long-map-done", **out["long"])
    # A first call to an object the cut-off process owns: a new connection.
    watch(watched, "remote queue get", mine.get, True, 60)
    deadline = time.monotonic() + 60
    while len(watched) < 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    out["long"]["after_cut"] = {
        k: {
            "value": v["value"],
            "connection_error": v["connection_error"],
            "since_cut": round(v["clock"] - cut_at, 2),
            "since_call": round(v["clock"] - v["start"], 2),
        }
        for k, v in watched.items()
    }
    out["long"]["reason"] = p.reason
    emit("long-done")

    # 3. Plugged back in: the pool still works, with every result once.
    check(stdin.get(timeout=60) == "restored", "protocol")
    res = pool.map(slow_square, range(60))
    out["after"] = {
        "correct": [r[0] for r in res] == [x * x for x in range(60)],
        "hosts": sorted({r[1] for r in res}),
    }
    pool.close()
    pool.join()
    return out


def scenario_unreachable(params: dict) -> dict:
    """This process listens where the workers cannot reach it (an address
    valid only on its own host): clear errors, soon, instead of a hang."""
    mp = multiprocessing
    out: dict = {}
    start = time.monotonic()
    p = mp.Process(target=exit_with, args=(0,))
    p.start()
    p.join(120)
    out["process"] = {
        "exitcode": p.exitcode,
        "reason": p.reason,
        "seconds": round(time.monotonic() - start, 2),
    }
    start = time.monotonic()
    with mp.Pool(2) as pool:
        try:
            pool.map_async(square_where, range(10)).get(timeout=120)
            out["pool"] = {"error": None}
        except Exception as e:
            out["pool"] = {"error": f"{type(e).__name__}: {e}"}
        out["pool"]["seconds"] = round(time.monotonic() - start, 2)
    return out


def marked_wait(path):
    """Write the started marker ``path`` (this pid), then wait to be cut off."""
    with open(path + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(path + ".tmp", path)
    time.sleep(120)
    return "not cut off"


def scenario_cause_cut(params: dict) -> dict:
    """A pool's only slot on a host that the test cuts off mid-task: the
    task's WorkerLostError says why (issue 31)."""
    mp = multiprocessing
    stdin = Stdin()
    marker = params["marker"]
    pool = mp.Pool(1, resources={params["host"]: 1})
    res = pool.apply_async(marked_wait, (marker,))
    wait_until(lambda: os.path.exists(marker), 60, "the task's started marker")
    emit("cut-now")
    check(stdin.get(timeout=60) == "cut", "protocol")
    cut_at = time.monotonic()
    try:
        res.get(timeout=60)
        out: dict = {"cause": "none"}
    except mp.WorkerLostError as e:
        out = {
            "cause": e.cause,
            "address": e.address,
            "signal": e.signal,
            "message": str(e),
            "after_cut": round(time.monotonic() - cut_at, 2),
        }
    pool.terminate()
    return out


def main() -> None:
    scenario = sys.argv[1]
    params = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    try:
        result = globals()[f"scenario_{scenario}"](params)
    except BaseException:
        emit("error", traceback=traceback.format_exc())
        raise SystemExit(1) from None
    emit("result", **result)


if __name__ == "__main__":
    stackdump.install()  # where it hangs, if a test gives up on it
    # Stop at once if the test is interrupted (its end of our stdin closes).
    signal.signal(signal.SIGTERM, lambda *a: os._exit(1))
    main()
