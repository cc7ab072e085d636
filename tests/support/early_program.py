"""A program whose first Pool runs on early slots (tests/test_early_slots.py).

``python early_program.py SCENARIO DIR``: runs the scenario on the embedded
cluster it starts, as a user's script does, and prints its result as JSON on
its last line.  Tasks note where they ran: a slot of the cluster's Dask
workers has ``FIBER_DASK_WORKER_ADDRESS`` in its environment, an early slot
(:mod:`fiber_dask.engine.earlyslots`) has none.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import fiber_dask


def where() -> str | None:
    return os.environ.get("FIBER_DASK_WORKER_ADDRESS")


def square(x: int, marks: str) -> tuple:
    with open(os.path.join(marks, "runs"), "a") as f:
        f.write(f"{x}\n")
    time.sleep(0.001)
    return x * x, where(), os.getpid()


def hang_first_time(x: int, marks: str) -> tuple:
    """Item 0 says it started, then waits to be killed; its re-run returns."""
    with open(os.path.join(marks, "runs"), "a") as f:
        f.write(f"{x}\n")
    started = os.path.join(marks, "started")
    if x == 0 and not os.path.exists(started):
        with open(started + ".tmp", "w") as f:
            json.dump({"pid": os.getpid(), "where": where()}, f)
        os.rename(started + ".tmp", started)
        while True:
            time.sleep(0.05)
    time.sleep(0.002)
    return x * x, where(), os.getpid()


def nested(_: int) -> tuple:
    q = fiber_dask.Queue()
    q.put("through a nested queue")
    return q.get(timeout=60), os.environ.get("DASK_SCHEDULER_ADDRESS"), where()


def runs(marks: str) -> dict[int, int]:
    counts: dict[int, int] = {}
    with open(os.path.join(marks, "runs")) as f:
        for line in f:
            counts[int(line)] = counts.get(int(line), 0) + 1
    return counts


def until_on_cluster(pool, func, marks: str, n: int, offset: int = 0) -> list:
    """Map ``n`` new items (from ``offset`` on) again and again until a whole
    map ran on the cluster's slots; every map's results."""
    import functools

    maps = []
    deadline = time.monotonic() + 120
    while True:
        items = range(offset, offset + n)
        got = pool.map(functools.partial(func, marks=marks), items)
        assert [r[0] for r in got] == [x * x for x in items], "wrong results"
        maps.append(got)
        offset += n
        if all(r[1] is not None for r in got):
            return maps
        assert time.monotonic() < deadline, "the cluster's slots never took over"


def looks(_: int) -> dict:
    """What a task sees of its process, beyond where it runs."""
    import multiprocessing
    import signal as sig

    me = multiprocessing.current_process()
    skip = {"FIBER_DASK_WORKER_ADDRESS", "FIBER_DASK_WORKER_NAME"}
    return {
        "where": where(),
        "start method": multiprocessing.get_start_method(allow_none=True),
        "name": me.name.rstrip("0123456789"),
        "daemon": me.daemon,
        "parent": repr(multiprocessing.parent_process()),
        "argv": sys.argv,
        "cwd": os.getcwd(),
        "path": sys.path,
        "main": sorted(n for n in ("__mp_main__", "__main__") if n in sys.modules),
        "main module": getattr(sys.modules.get("__main__"), "__name__", None),
        "sigint": str(sig.getsignal(sig.SIGINT)),
        "sigterm": str(sig.getsignal(sig.SIGTERM)),
        "env": sorted(k for k in os.environ if k not in skip),
        "dask scheduler": os.environ.get("DASK_SCHEDULER_ADDRESS"),
        "stdin": os.readlink("/proc/self/fd/0"),
        "numpy imported": "numpy" in sys.modules,
        "threads": len(os.listdir("/proc/self/task")),
    }


def scenario_looks(marks: str) -> dict:
    with fiber_dask.Pool(2) as pool:
        early = pool.apply(looks, (0,))
        deadline = time.monotonic() + 120
        while True:
            later = pool.apply(looks, (0,))
            if later["where"] is not None:
                break
            assert time.monotonic() < deadline, "the cluster's slots never took over"
            time.sleep(0.05)
    return {"early": early, "later": later}


def scenario_handover(marks: str) -> dict:
    with fiber_dask.Pool(2) as pool:
        first = pool.apply(square, (10**6, marks))
        pids_early = [pool._pool[i].pid for i in range(2)]
        maps = until_on_cluster(pool, square, marks, 400)
        scheduler = fiber_dask.get_client().scheduler.address
    counts = runs(marks)
    return {
        "first": first,
        "pids_early": pids_early,
        "maps": [[r[1:] for r in m] for m in maps],
        "items": sum(len(m) for m in maps) + 1,
        "counts": sorted(set(counts.values())),
        "counted": len(counts),
        "scheduler": scheduler,
    }


def scenario_kill(marks: str) -> dict:
    import functools

    started = os.path.join(marks, "started")
    with fiber_dask.Pool(2) as pool:
        result = pool.map_async(
            functools.partial(hang_first_time, marks=marks), range(40), chunksize=1
        )
        deadline = time.monotonic() + 120
        while not os.path.exists(started):
            assert time.monotonic() < deadline, "item 0 never started"
            time.sleep(0.01)
        with open(started) as f:
            victim = json.load(f)
        os.kill(victim["pid"], signal.SIGKILL)
        got = result.get(timeout=120)
    return {
        "victim": victim,
        "results": [r[0] for r in got],
        "counts": runs(marks),
    }


def scenario_recycle(marks: str) -> dict:
    """maxtasksperchild=3 on early slots: successors, then the hand-over."""
    import functools

    with fiber_dask.Pool(2, maxtasksperchild=3) as pool:
        first = pool.map(functools.partial(square, marks=marks), range(12), 1)
        maps = until_on_cluster(pool, square, marks, 12, offset=12)
    return {
        "first": [r[1:] for r in first],
        "last": [r[1:] for r in maps[-1]],
        "counts": sorted(set(runs(marks).values())),
    }


def scenario_nested(marks: str) -> dict:
    with fiber_dask.Pool(2) as pool:
        got = pool.apply(nested, (0,))
        scheduler = fiber_dask.get_client().scheduler.address
    return {"got": got, "scheduler": scheduler}


def scenario_exit(marks: str) -> dict:
    """Map once and leave at once, while the cluster may still be starting."""
    import functools

    pool = fiber_dask.Pool(2)
    got = pool.map(functools.partial(square, marks=marks), range(10))
    pool.close()
    pool.join()
    return {"results": [r[0] for r in got], "where": [r[1] for r in got]}


def scenario_others_wait(marks: str) -> dict:
    """A second Pool and a Process made while the first pool's cluster starts."""
    import functools

    first = fiber_dask.Pool(2)
    a = first.apply(square, (3, marks))
    second = fiber_dask.Pool(1)
    b = second.apply(square, (4, marks))
    q = fiber_dask.Queue()
    p = fiber_dask.Process(target=q.put, args=("from a process",))
    p.start()
    c = q.get(timeout=60)
    p.join(60)
    got = first.map(functools.partial(square, marks=marks), range(20))
    for pool in (first, second):
        pool.close()
        pool.join()
    return {
        "a": a[:2],
        "b": b[:2],
        "c": c,
        "exitcode": p.exitcode,
        "results": [r[0] for r in got],
    }


def scenario_port_taken(marks: str) -> dict:
    """Another socket tries to take the scheduler's port, picked before the
    scheduler starts, while the cluster starts (an outgoing connection's
    ephemeral port or another test's bind to port 0 did in CI); it listens
    there if it got it, as a stranger's server would."""
    import errno
    import functools
    import socket

    from fiber_dask import cluster

    pool = fiber_dask.Pool(2)
    starting = cluster._starting
    before_up = starting is not None and not starting.done()
    port = int(starting.scheduler_address.rsplit(":", 1)[1]) if starting else None
    stranger = socket.socket()
    try:
        stranger.bind(("127.0.0.1", port))
        stranger.listen()
        refused = None
    except OSError as e:
        refused = errno.errorcode.get(e.errno, str(e.errno))
    maps = until_on_cluster(pool, square, marks, 10)  # results checked there
    scheduler = fiber_dask.get_client().scheduler.address
    pool.close()
    pool.join()
    stranger.close()
    return {
        "before_up": before_up,
        "port": port,
        "refused": refused,
        "maps": len(maps),
        "scheduler": scheduler,
    }


def scenario_owner_killed(marks: str) -> dict:
    """Item 0 starts in an early slot; the test SIGKILLs this process then."""
    import functools

    pool = fiber_dask.Pool(2)
    pool.map_async(functools.partial(hang_first_time, marks=marks), range(4))
    while True:
        time.sleep(1)


if __name__ == "__main__":
    scenario, marks = sys.argv[1], sys.argv[2]
    out = globals()[f"scenario_{scenario}"](marks)
    print(json.dumps(out))
