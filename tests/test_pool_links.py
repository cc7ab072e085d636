"""Links: the loops of one process share one connection to their pool's owner.

First the link on its own, against a real channel server standing in for the
owner (every message read off the socket), then real pools of thread slots on
real Dask workers: one connection per worker process whatever the number of
slots, long runs through it, a SIGKILLed worker process taking all its slots'
chunks with it to be re-run, loops that leave (maxtasksperchild, idle slots
given back) while the others go on over the same link.
"""

from __future__ import annotations

import functools
import os
import queue
import signal
import subprocess
import sys
import textwrap
import threading
import uuid

import dask
import psutil
import pytest
from distributed import Client, LocalCluster
from support.wait import wait_for_file, wait_until
from tasks.links import held_square, perturb_in_place, where
from tasks.poolcore import base, executions

import fiber_dask
from fiber_dask.comm import channel, security
from fiber_dask.engine import poollink
from fiber_dask.engine import poolprotocol as proto

pytestmark = pytest.mark.timeout(120)


# ------------------------------------------------------------ the link alone


class _Owner:
    """A channel service standing in for a pool's owner: it keeps the
    connections and reads the loops' messages off them."""

    def __init__(self):
        self.authkey = os.urandom(32)
        self.server = channel.get_server("127.0.0.1", self.authkey)
        self.service = f"links-{uuid.uuid4().hex}"
        self.conns: queue.SimpleQueue = queue.SimpleQueue()
        self.server.register(self.service, lambda c, h: self.conns.put((c, h)))

    def attach(self, loop, deliver):
        return poollink.attach(
            self.server.address, self.authkey, self.service, loop, "w", deliver
        )

    @staticmethod
    def read(conn, n):
        """The next ``n`` messages on ``conn``, as (loop, message) pairs."""
        out = []
        while len(out) < n:
            assert conn.poll(10), f"only {len(out)} of {n} messages came"
            out.extend(proto.decode_frame(conn.recv_bytes()))
        assert len(out) == n, out
        return out

    @staticmethod
    def hung_up(conn):
        try:
            return conn.poll(10) and conn.recv_bytes() is None
        except EOFError:
            return True

    def close(self):
        self.server.unregister(self.service)
        while not self.conns.empty():
            channel.hangup(self.conns.get()[0])


def _link_threads():
    return [t for t in threading.enumerate() if t.name.startswith("fiber-pool-link")]


@pytest.fixture
def owner():
    o = _Owner()
    yield o
    o.close()


def _attach_together(owner, loops):
    """Attach ``loops`` from as many threads at once; their inboxes and links."""
    boxes = {n: queue.SimpleQueue() for n in loops}
    links = {}
    start = threading.Barrier(len(loops))

    def join(n):
        start.wait()
        links[n] = owner.attach(n, boxes[n].put)

    threads = [threading.Thread(target=join, args=(n,)) for n in loops]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return boxes, links


def test_loops_of_one_process_share_one_link_and_keep_their_order(owner):
    loops = range(8)
    boxes, links = _attach_together(owner, loops)
    assert len({id(link) for link in links.values()}) == 1
    (link,) = {id(v): v for v in links.values()}.values()
    conn, hello = owner.conns.get(timeout=10)
    assert hello["pid"] == os.getpid()
    attached = owner.read(conn, 8)
    assert sorted(n for n, _ in attached) == list(loops)
    assert all(isinstance(m, proto.Attach) and m.worker == "w" for _, m in attached)
    assert owner.conns.empty()  # one dial for the eight of them

    # One frame, every loop's messages interleaved: each gets its own, in order.
    calls = [
        (n, proto.Calls([proto.Call(k, 1, None, 0, b"", 0)]))
        for k in range(3)
        for n in loops
    ]
    conn.send_bytes(proto.encode_frame(calls))
    for n in loops:
        got = [boxes[n].get(timeout=10) for _ in range(3)]
        assert [m.calls[0].ckey for m in got] == [0, 1, 2]
    # Their answers come back on the one connection, each loop's in order.
    for k in range(3):
        for n in loops:
            link.post(n, proto.Results([proto.Result(k, True, b"", 0.0, False)]))
    answers = owner.read(conn, 24)
    for n in loops:
        mine = [m.results[0].ckey for loop, m in answers if loop == n]
        assert mine == [0, 1, 2]

    # Loops leave one by one; the link stays up for the others ...
    for n in loops[:-1]:
        link.detach(n, proto.Reason.STOPPED)
    gone = owner.read(conn, 7)
    assert [(n, m.reason) for n, m in gone] == [
        (n, proto.Reason.STOPPED) for n in loops[:-1]
    ]
    assert not conn.poll(0.2)
    # ... and the last one out hangs it up, after its Gone.
    link.detach(loops[-1], proto.Reason.RECYCLED)
    [(n, last)] = owner.read(conn, 1)
    assert (n, last.reason) == (loops[-1], proto.Reason.RECYCLED)
    assert owner.hung_up(conn)
    wait_until(lambda: not _link_threads(), what="the link's threads to end")
    assert link.conn.closed


def test_a_dropped_link_ends_every_loop_on_it(owner):
    boxes, links = _attach_together(owner, range(4))
    conn, _ = owner.conns.get(timeout=10)
    owner.read(conn, 4)
    channel.hangup(conn)  # the owner is gone
    for box in boxes.values():
        assert box.get(timeout=10) is None
    link = links[0]
    for n in range(4):
        link.detach(n, proto.Reason.TERMINATED)  # sends nothing, raises nothing
    wait_until(lambda: not _link_threads(), what="the link's threads to end")
    assert link.conn.closed


def test_a_loop_joining_after_the_last_left_dials_again(owner):
    first = owner.attach(1, lambda m: None)
    conn1, _ = owner.conns.get(timeout=10)
    owner.read(conn1, 1)
    first.detach(1, proto.Reason.STOPPED)
    assert owner.read(conn1, 1)[0][1].reason == proto.Reason.STOPPED
    assert owner.hung_up(conn1)
    second = owner.attach(2, lambda m: None)
    assert second is not first
    conn2, _ = owner.conns.get(timeout=10)
    assert owner.read(conn2, 1)[0][0] == 2
    second.detach(2, proto.Reason.STOPPED)


def test_every_loop_waiting_for_an_unreachable_owner_gets_the_reason():
    s = __import__("socket").socket()
    s.bind(("127.0.0.1", 0))
    address = s.getsockname()  # bound, never listening: refused
    try:
        got = []
        start = threading.Barrier(4)

        def join(n):
            start.wait()
            got.append(
                poollink.attach(address, b"k" * 32, "nobody", n, None, lambda m: None)
            )

        threads = [threading.Thread(target=join, args=(n,)) for n in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    finally:
        s.close()
    assert len(got) == 4
    assert all(r.startswith(proto.Reason.UNREACHABLE) for r in got), got
    assert "cannot reach the fiber-dask channel" in got[0]


def test_a_dial_with_the_wrong_key_fails_every_loop_that_waited_for_it(owner):
    from multiprocessing import AuthenticationError

    got = []
    start = threading.Barrier(4)

    def join(n):
        start.wait()
        try:
            got.append(
                poollink.attach(
                    owner.server.address, b"w" * 32, owner.service, n, None, print
                )
            )
        except AuthenticationError as e:
            got.append(e)

    threads = [threading.Thread(target=join, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(got) == 4
    raised = [g for g in got if isinstance(g, AuthenticationError)]
    waited = [g for g in got if isinstance(g, str)]
    assert raised and len(raised) + len(waited) == 4
    # Counted as failures by the pool (not "no-pool"), naming the cause.
    assert all(
        w.startswith(proto.Reason.UNREACHABLE) and "AuthenticationError" in w
        for w in waited
    ), waited
    assert not poollink._links  # nothing left behind to join later


def _results(k):
    return proto.Results([proto.Result(k, True, b"", 0.0, False)])


def test_a_frame_the_sender_cannot_make_drops_the_link(owner, monkeypatch, caplog):
    # Out of memory pickling one frame of many loops' answers (any error but
    # a failed send): the link must drop, so that its loops end and the owner
    # re-runs their chunks, not stay up with their answers queued for ever.
    boxes, links = _attach_together(owner, range(3))
    conn, _ = owner.conns.get(timeout=10)
    owner.read(conn, 3)
    link = links[0]
    real = proto.encode_frame

    def out_of_memory(routed, shared=None):
        raise MemoryError("one frame of every loop's answers")

    monkeypatch.setattr(proto, "encode_frame", out_of_memory)
    link.post(0, _results(1))  # through the sender thread: three loops
    for box in boxes.values():
        assert box.get(timeout=10) is None  # the link dropped: each loop hears
    monkeypatch.setattr(proto, "encode_frame", real)
    assert owner.hung_up(conn)
    assert "could not send" in caplog.text
    for n in range(3):
        link.detach(n, proto.Reason.TERMINATED)
    wait_until(lambda: not _link_threads(), what="the link's threads to end")


def test_loops_send_themselves_when_no_sender_thread_can_start(owner, monkeypatch):
    start = threading.Thread.start

    def no_sender(self):
        if self.name == "fiber-pool-link-send":
            raise RuntimeError("can't start new thread")
        return start(self)

    monkeypatch.setattr(threading.Thread, "start", no_sender)
    boxes, links = _attach_together(owner, range(3))
    conn, _ = owner.conns.get(timeout=10)
    owner.read(conn, 3)
    link = links[0]
    assert link._sender is None
    for n in range(3):
        link.post(n, _results(n))
    assert sorted(n for n, _ in owner.read(conn, 3)) == [0, 1, 2]
    for n in range(3):
        link.detach(n, proto.Reason.STOPPED)
    assert len(owner.read(conn, 3)) == 3 and owner.hung_up(conn)
    wait_until(lambda: not _link_threads(), what="the receiver to end")
    assert link.conn.closed


def test_no_receiver_thread_fails_the_dial_not_the_loops_waiting(owner, monkeypatch):
    start = threading.Thread.start

    def no_receiver(self):
        if self.name == "fiber-pool-link":
            raise RuntimeError("can't start new thread")
        return start(self)

    monkeypatch.setattr(threading.Thread, "start", no_receiver)
    got = []
    threads = [
        threading.Thread(target=lambda n=n: got.append(owner.attach(n, print)))
        for n in range(3)
    ]
    for t in threads:
        start(t)
    for t in threads:
        t.join(30)
    assert len(got) == 3  # nobody waits for ever on a link that never came up
    assert all(g.startswith(proto.Reason.UNREACHABLE) for g in got), got
    assert not poollink._links


def test_junk_from_the_owner_drops_the_link(owner, caplog):
    boxes, links = _attach_together(owner, range(2))
    conn, _ = owner.conns.get(timeout=10)
    owner.read(conn, 2)
    conn.send_bytes(b"\x80\x05junk")
    for box in boxes.values():
        assert box.get(timeout=10) is None
    assert owner.hung_up(conn)
    assert "could not read its owner's messages" in caplog.text
    for n in range(2):
        links[0].detach(n, proto.Reason.TERMINATED)
    wait_until(lambda: not _link_threads(), what="the link's threads to end")


def test_a_loop_that_left_is_never_interrupted_nor_its_process_ended(monkeypatch):
    from fiber_dask.engine import poolworker

    def exit_(code):  # a failure here must fail the test, not end pytest
        raise AssertionError(f"os._exit({code}) after the loop left")

    monkeypatch.setattr(poolworker.os, "_exit", exit_)
    loop = poolworker._Loop(0, kill_after=0.01)
    # As if a TERMINATE had fired just as a task was marked running, so the
    # mark stayed: after leave() the link's EOF must neither interrupt this
    # thread (by then in the link's code, or another Dask task) nor start
    # the timer that would end the process.
    loop.executing = True
    loop.leave()
    loop.deliver(None)
    assert loop.inbox.get(timeout=1) is None
    assert not loop.executing
    loop._kill_if_stuck()  # would os._exit(1) the test process
    assert not [
        t
        for t in threading.enumerate()
        if getattr(t, "function", None) == loop._kill_if_stuck
    ]


def test_serve_slot_leaves_its_loop_before_it_leaves_the_link(owner, monkeypatch):
    # The link's EOF (when this loop hangs it up) and a late TERMINATE come
    # after serve_slot has moved on: its loop must have left by then.
    from fiber_dask.engine import poolworker

    made = []

    class Loop(poolworker._Loop):
        def __init__(self, *args):
            super().__init__(*args)
            made.append(self)

    real_detach = poollink.Link.detach

    def detach(link, loop, reason):
        made[0].detached_after_leaving = getattr(made[0], "left", False)
        real_detach(link, loop, reason)

    monkeypatch.setattr(poolworker, "_Loop", Loop)
    monkeypatch.setattr(poollink.Link, "detach", detach)
    out = []
    a = owner.server.address
    t = threading.Thread(
        target=lambda: out.append(
            poolworker.serve_slot(
                a, owner.authkey, owner.service, 5, None, None, 5, "w"
            )
        )
    )
    t.start()
    conn, _ = owner.conns.get(timeout=10)
    assert isinstance(owner.read(conn, 1)[0][1], proto.Attach)
    conn.send_bytes(proto.encode_frame([(5, proto.STOP)]))
    [(n, gone)] = owner.read(conn, 1)
    assert (n, gone.reason) == (5, proto.Reason.STOPPED)
    assert owner.hung_up(conn)
    t.join(10)
    assert out == [proto.Reason.STOPPED]
    assert made[0].detached_after_leaving


# --------------------------------------------------------- pools of threads


@pytest.fixture
def threads_client():
    """2 Dask worker processes x 4 threads, loopback only; thread slots."""
    with (
        LocalCluster(
            n_workers=2,
            threads_per_worker=4,
            processes=True,
            dashboard_address=None,
            host="127.0.0.1",
        ) as cluster,
        Client(cluster, set_as_default=False) as client,
        dask.config.set({"fiber.pool.slots": "thread"}),
    ):
        yield client


def _owner_connections(pool) -> int:
    """Established connections into the pool's channel port, seen by the OS."""
    port = pool._engine._server.address[1]
    return sum(
        1
        for c in psutil.Process().net_connections(kind="tcp")
        if c.laddr and c.laddr.port == port and c.status == psutil.CONN_ESTABLISHED
    )


def _all_up(pool, n):
    return sum(s.is_alive() for s in pool._pool) == n


def test_thread_slots_share_one_connection_per_worker_process(threads_client):
    workers = set(threads_client.run(os.getpid).values())
    with fiber_dask.Pool(8, client=threads_client) as pool:
        wait_until(lambda: _all_up(pool, 8), what="all 8 slots to attach")
        assert _owner_connections(pool) == 2
        assert {s.pid for s in pool._pool} == workers

        # A long-lived pool: thousands of calls, hundreds of distinct
        # functions, every slot busy, over the two connections.
        funcs = [functools.partial(base, k=k) for k in range(300)]
        pending = [(f, x, pool.apply_async(f, (x,))) for f in funcs for x in range(10)]
        assert all(r.get(timeout=60) == f(x) for f, x, r in pending)
        seen = pool.map(where, range(5000), chunksize=1)
        assert [x for x, _, _ in seen] == list(range(5000))
        assert len({(p, t) for _, p, t in seen}) == 8  # every slot served
        assert sum(pool.imap_unordered(abs, range(-2000, 0))) == sum(range(1, 2001))
        assert _owner_connections(pool) == 2


def test_one_theta_sent_with_every_task_is_each_tasks_own(threads_client):
    # The frames of a map carry an array its tasks share once (poolprotocol's
    # Shared); each chunk must still get a copy of its own, and the items of
    # one chunk one copy between them, as the stdlib pickles a chunk.
    import multiprocessing

    np = pytest.importorskip("numpy")
    theta = np.zeros(1000)
    tasks = [(theta, seed) for seed in range(400)]
    with fiber_dask.Pool(8, client=threads_client) as pool:
        wait_until(lambda: _all_up(pool, 8), what="all 8 slots to attach")
        one = pool.map(perturb_in_place, tasks, chunksize=1)
        three = pool.map(perturb_in_place, tasks, chunksize=3)
    assert one == [1000.0 * seed for seed in range(400)]
    with multiprocessing.get_context("forkserver").Pool(2) as stdlib:
        assert three == stdlib.map(perturb_in_place, tasks, chunksize=3)
    assert three != one  # the items of a chunk did share their theta
    assert not theta.any()


def test_junk_on_an_authenticated_link_does_not_stop_the_pool(threads_client, caplog):
    # Strangers cannot get this far (the handshake; tests/test_stalled_peers);
    # a peer that knows the key but speaks nonsense (a bug, a version skew)
    # costs a logged error, not the pool.
    with fiber_dask.Pool(8, client=threads_client) as pool:
        wait_until(lambda: _all_up(pool, 8), what="all 8 slots to attach")
        e = pool._engine
        conn = channel.connect(
            e._server.address, security.authkey(), e._service, hello={"pid": 1}
        )
        try:
            conn.send_bytes(b"\x80\x05junk")  # not a pickle
            conn.send_bytes(proto.encode_frame([(10**6, proto.Gone("x"))]))
            conn.send_bytes(
                proto.encode_frame(
                    [(10**6, proto.Results([proto.Result(1, True, b"", 0, False)]))]
                )
            )
            assert pool.map(abs, range(-300, 0)) == list(range(300, 0, -1))
            wait_until(
                lambda: "error decoding a pool message" in caplog.text,
                what="the junk to be logged",
            )
        finally:
            channel.hangup(conn)
        assert pool.map(abs, range(-300, 0)) == list(range(300, 0, -1))
        wait_until(
            lambda: _owner_connections(pool) == 2, what="the junk link to be dropped"
        )


def test_sigkill_of_a_worker_process_reruns_the_chunks_of_all_its_slots(
    threads_client, tmp_path
):
    d = str(tmp_path)
    with fiber_dask.Pool(8, client=threads_client) as pool:
        wait_until(lambda: _all_up(pool, 8), what="all 8 slots to attach")
        result = pool.map_async(
            functools.partial(held_square, directory=d), range(8), chunksize=1
        )
        for x in range(8):
            wait_for_file(os.path.join(d, f"started-{x}"), timeout=60)
        started = {}
        for x in range(8):
            with open(os.path.join(d, f"started-{x}")) as f:
                started[x] = int(f.read())
        victim = started[0]
        lost = sorted(x for x, pid in started.items() if pid == victim)
        assert len(lost) == 4  # one chunk in each of its four thread slots
        os.kill(victim, signal.SIGKILL)
        wait_until(lambda: not psutil.pid_exists(victim), what="the worker to die")
        open(os.path.join(d, "release"), "w").close()
        assert result.get(timeout=60) == [x * x for x in range(8)]
        # Exactly its four items ran again, and the pool counted them.
        assert {x: executions(d, x) for x in range(8)} == {
            x: 2 if x in lost else 1 for x in range(8)
        }
        assert pool._engine._stats.reruns == 4
        # Dask started the lost loops again (the nanny restarted the worker):
        # the pool is whole, still one connection per worker process.
        wait_until(lambda: _all_up(pool, 8), what="the lost slots to come back")
        assert pool.map(abs, range(-50, 0)) == list(range(50, 0, -1))
        assert _owner_connections(pool) == 2


def test_loops_that_leave_do_not_take_the_link_from_the_others(threads_client):
    with pytest.warns(RuntimeWarning, match="maxtasksperchild"):
        pool = fiber_dask.Pool(8, maxtasksperchild=5, client=threads_client)
    with pool:
        seen = pool.map(where, range(600), chunksize=1)
        assert [x for x, _, _ in seen] == list(range(600))
        # every loop ended after 5 chunks, while the others went on
        assert next(pool._engine._loops.numbers) >= 600 // 5
        assert _owner_connections(pool) <= 2


def test_idle_thread_slots_are_given_back_and_the_link_with_them(threads_client):
    with dask.config.set({"fiber.pool.idle-timeout": "300ms"}):
        pool = fiber_dask.Pool(8, client=threads_client)
    with pool:
        assert pool.map(abs, range(-40, 0), chunksize=1) == list(range(40, 0, -1))
        e = pool._engine
        wait_until(
            lambda: e._elastic.given_back >= 8 and not e._peers,
            what="every idle slot to be given back",
        )
        wait_until(lambda: _owner_connections(pool) == 0, what="the links to close")
        # Work again: slots come back over new links.
        assert pool.map(abs, range(-40, 0), chunksize=1) == list(range(40, 0, -1))
        assert 1 <= _owner_connections(pool) <= 2
        assert e._losses == [] and e._loops.failures == 0


OWNER_SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    import dask
    import fiber_dask

    def spin(path):
        open(path, "w").close()
        for _ in range(36000):  # Python between the sleeps: interruptible
            time.sleep(0.1)

    if __name__ == "__main__":
        address, directory = sys.argv[1], sys.argv[2]
        dask.config.set({"fiber.pool.slots": "thread"})
        pool = fiber_dask.Pool(8, address=address)
        results = [
            pool.apply_async(spin, (os.path.join(directory, f"spin-{i}"),))
            for i in range(8)
        ]
        time.sleep(3600)
    """
)


def _link_threads_in_workers(client):
    def names():
        return [t.name for t in threading.enumerate() if "fiber-pool" in t.name]

    return {w: v for w, v in client.run(names).items() if v}


def test_a_killed_owner_ends_every_thread_slot_and_its_link(threads_client, tmp_path):
    script = tmp_path / "owner.py"
    script.write_text(OWNER_SCRIPT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), str(tmp_path)]))
    owner = subprocess.Popen(
        [sys.executable, str(script), threads_client.scheduler.address, str(tmp_path)],
        env=env,
    )
    try:
        for i in range(8):
            wait_for_file(os.path.join(str(tmp_path), f"spin-{i}"), timeout=60)
        assert sum(map(len, threads_client.processing().values())) == 8
        assert _link_threads_in_workers(threads_client)
        owner.kill()
        owner.wait(timeout=10)
        # The links drop: every loop's task is interrupted and ends, and the
        # links' threads with them; the workers' threads are free again.
        wait_until(
            lambda: not any(threads_client.processing().values()),
            timeout=30,
            what="the dead owner's loops to leave the workers",
        )
        wait_until(
            lambda: not _link_threads_in_workers(threads_client),
            timeout=30,
            what="the links' threads to end",
        )
        assert threads_client.submit(abs, -3, pure=False).result(timeout=30) == 3
    finally:
        owner.kill()
        owner.wait(timeout=10)
