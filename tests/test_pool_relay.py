"""The slot relay: process slots reach their pool's owner through their Dask
worker process (fiber_dask.engine.slotrelay).

First the relay on its own, in this process, against a real channel server
standing in for the owner and real local sockets standing in for slot
processes (every message read off the sockets); then real pools of process
slots on real Dask workers: one connection per worker process whatever the
slots, thousands of calls through it, a SIGKILLed slot process costing a
re-run of its chunk and nothing else, ``maxtasksperchild`` successors on new
routes, ``terminate()`` through the hop.
"""

from __future__ import annotations

import functools
import os
import signal
import socket

import dask
import psutil
import pytest
from distributed import Client, LocalCluster
from support.wait import wait_for_file, wait_until
from tasks.links import held_square, where
from tasks.poolcore import base, executions
from test_pool_links import _Owner, _owner_connections

import fiber_dask
from fiber_dask.comm import channel
from fiber_dask.engine import poolprotocol as proto
from fiber_dask.engine import slotrelay

pytestmark = pytest.mark.timeout(120)


# ----------------------------------------------------------- the relay alone


@pytest.fixture
def owner():
    o = _Owner()
    yield o
    o.close()


@pytest.fixture
def relay():
    # One relay per test (the process's own, get_relay(), is for keepers).
    r = slotrelay.Relay()
    yield r
    r.close()


def _slot(hold):
    """A stand-in slot process: the connection it dials with its ticket."""
    conn = slotrelay.connect(*hold.ticket)
    assert not isinstance(conn, str), conn
    return conn


def _read_slot(conn, n):
    out = []
    while len(out) < n:
        assert conn.poll(10), f"only {len(out)} of {n} messages came"
        out.extend(proto.decode_frame(conn.recv_bytes()))
    return out


def test_slot_processes_share_the_keepers_link_each_on_a_route_of_its_own(owner, relay):
    holds = [
        relay.open(owner.server.address, owner.authkey, owner.service, n, "w")
        for n in (3, 4)
    ]
    assert not any(isinstance(h, str) for h in holds), holds
    conn, _ = owner.conns.get(timeout=10)  # one dial for both keepers
    a, b = _slot(holds[0]), _slot(holds[1])
    a.send_bytes(proto.encode_frame([(3, proto.Attach(111, "w"))]))
    b.send_bytes(proto.encode_frame([(4, proto.Attach(222, "w"))]))
    attached = {msg.slot: (route, msg.pid) for route, msg in owner.read(conn, 2)}
    (ra, pa), (rb, pb) = attached[3], attached[4]
    assert (pa, pb) == (111, 222)
    assert ra < 0 and rb < 0 and ra != rb  # routes, not loop numbers
    # The owner's messages reach each slot as its loop's, with the arrays
    # their frame shared; one frame for both.
    call = proto.Call(1, 9, b"f", 0, b"p", 0)
    conn.send_bytes(proto.encode_frame([(ra, proto.Calls([call])), (rb, proto.STOP)]))
    [(n, calls)] = _read_slot(a, 1)
    assert n == 3 and [c.fields() for c in calls.calls] == [call.fields()]
    assert _read_slot(b, 1) == [(4, proto.STOP)]
    # What the slots send goes on under their routes, in order; a slot that
    # hangs up without a word gets a Gone said for it, after what it sent.
    a.send_bytes(
        proto.encode_frame([(3, proto.Results([proto.Result(1, True, b"r", 0, 0)]))])
    )
    a.close()
    b.send_bytes(proto.encode_frame([(4, proto.Gone(proto.Reason.STOPPED))]))
    got = owner.read(conn, 3)
    assert [(r, type(m)) for r, m in got if r == ra] == [
        (ra, proto.Results),
        (ra, proto.Gone),
    ]
    gone = {r: m.reason for r, m in got if type(m) is proto.Gone}
    assert gone == {ra: slotrelay.DIED, rb: proto.Reason.STOPPED}
    # The keepers still hold the link; the last one out hangs it up.
    holds[0].close()
    assert conn.poll(0.2) is False
    holds[1].close()
    assert owner.hung_up(conn)


def test_a_stranger_without_the_token_is_cut_off_unread(owner, relay):
    hold = relay.open(owner.server.address, owner.authkey, owner.service, 3, "w")
    conn, _ = owner.conns.get(timeout=10)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(relay.address)
    s.sendall(os.urandom(slotrelay.TOKEN_BYTES))  # a wrong token
    frame = proto.encode_frame([(3, proto.Attach(1, "w"))])
    try:
        s.sendall(len(frame).to_bytes(4, "big") + frame)
    except OSError:
        pass  # cut off already
    s.settimeout(10)
    try:
        assert s.recv(1) == b""  # EOF: cut off
    except ConnectionResetError:
        pass  # cut off with the frame unread
    s.close()
    assert not conn.poll(0.2)  # nothing reached the owner
    # The keeper's own slot still gets through.
    a = _slot(hold)
    a.send_bytes(frame)
    [(route, msg)] = owner.read(conn, 1)
    assert type(msg) is proto.Attach and msg.slot == 3
    a.close()
    hold.close()


def test_a_dropped_link_shuts_every_slot_socket(owner, relay):
    hold = relay.open(owner.server.address, owner.authkey, owner.service, 3, "w")
    conn, _ = owner.conns.get(timeout=10)
    a = _slot(hold)
    a.send_bytes(proto.encode_frame([(3, proto.Attach(1, "w"))]))
    owner.read(conn, 1)
    channel.hangup(conn)  # the owner hangs up
    assert a.poll(10)
    with pytest.raises(EOFError):
        a.recv_bytes()  # the slot process ends its task as on the owner's loss
    # and a slot process of that keeper starting now is refused
    wait_until(lambda: hold.dropped, what="the keeper to hear of the drop")
    late = _slot(hold)
    assert late.poll(10)
    with pytest.raises(EOFError):
        late.recv_bytes()
    hold.close()


# ------------------------------------------------------ pools through relays


@pytest.fixture
def relay_client():
    """2 Dask worker processes x 4 threads, loopback only; process slots,
    always through the relay."""
    with (
        LocalCluster(
            n_workers=2,
            threads_per_worker=4,
            processes=True,
            dashboard_address=None,
            host="127.0.0.1",
        ) as cluster,
        Client(cluster, set_as_default=False) as client,
        dask.config.set({"fiber.pool.slots": "process", "fiber.pool.relay": True}),
    ):
        yield client


def _all_up(pool, n):
    return sum(s.is_alive() for s in pool._pool) == n


def test_process_slots_share_one_connection_per_worker_process(relay_client):
    workers = set(relay_client.run(os.getpid).values())
    with fiber_dask.Pool(8, client=relay_client) as pool:
        wait_until(lambda: _all_up(pool, 8), what="all 8 slots to attach")
        assert _owner_connections(pool) == 2
        assert len(pool._engine._links) == 2
        pids = {s.pid for s in pool._pool}
        assert len(pids) == 8 and not pids & workers  # 8 slot processes

        # A long-lived pool: thousands of calls, hundreds of distinct
        # functions, every slot process busy, over the two connections.
        funcs = [functools.partial(base, k=k) for k in range(300)]
        pending = [(f, x, pool.apply_async(f, (x,))) for f in funcs for x in range(10)]
        assert all(r.get(timeout=60) == f(x) for f, x, r in pending)
        seen = pool.map(where, range(5000), chunksize=1)
        assert [x for x, _, _ in seen] == list(range(5000))
        assert {p for _, p, _ in seen} == pids  # every slot process served
        assert sum(pool.imap_unordered(abs, range(-2000, 0))) == sum(range(1, 2001))
        assert _owner_connections(pool) == 2


def test_a_sigkilled_slot_process_behind_the_relay_costs_a_rerun(
    relay_client, tmp_path
):
    d = str(tmp_path)
    with fiber_dask.Pool(8, client=relay_client) as pool:
        wait_until(lambda: _all_up(pool, 8), what="all 8 slots to attach")
        result = pool.map_async(
            functools.partial(held_square, directory=d), range(8), chunksize=1
        )
        for x in range(8):
            wait_for_file(os.path.join(d, f"started-{x}"), timeout=60)
        with open(os.path.join(d, "started-5")) as f:
            victim = int(f.read())
        os.kill(victim, signal.SIGKILL)
        wait_until(lambda: not psutil.pid_exists(victim), what="the slot to die")
        open(os.path.join(d, "release"), "w").close()
        assert result.get(timeout=60) == [x * x for x in range(8)]
        # Exactly its item ran again, and the pool counted it.
        assert {x: executions(d, x) for x in range(8)} == {
            x: 2 if x == 5 else 1 for x in range(8)
        }
        assert pool._engine._stats.reruns == 1
        # A new slot took its place, through the same two connections.
        wait_until(lambda: _all_up(pool, 8), what="the lost slot to come back")
        assert pool.map(abs, range(-50, 0)) == list(range(50, 0, -1))
        assert _owner_connections(pool) == 2


def pid_after(_):
    return os.getpid()


def test_maxtasksperchild_successors_come_on_new_routes(relay_client):
    with fiber_dask.Pool(4, maxtasksperchild=3, client=relay_client) as pool:
        pids = pool.map(pid_after, range(120), chunksize=1)
        # A fresh process every 3 tasks (the last ones may have run fewer),
        # each process's successor on a route of its own.
        assert all(pids.count(p) <= 3 for p in set(pids))
        assert len(set(pids)) >= 40
        assert _owner_connections(pool) <= 2
        assert pool.map(abs, range(-50, 0)) == list(range(50, 0, -1))


def spin_until_terminated(path):
    with open(path, "w") as f:
        f.write(str(os.getpid()))
    while True:  # pure Python: the TERMINATE interrupt stops it
        pass


def test_terminate_interrupts_a_task_through_the_relay(relay_client, tmp_path):
    path = str(tmp_path / "spin")
    pool = fiber_dask.Pool(2, client=relay_client)
    result = pool.apply_async(spin_until_terminated, (path,))
    wait_for_file(path, timeout=60)
    with open(path) as f:
        pid = int(f.read())
    pool.terminate()
    pool.join()
    wait_until(lambda: not psutil.pid_exists(pid), what="the slot process to end")
    with pytest.raises(fiber_dask.PoolTerminatedError):
        result.get(timeout=10)  # interrupted, never finished


def test_the_policy_relays_large_pools_only():
    with dask.config.set({"fiber.pool.relay": None}):
        assert not slotrelay.wanted(slotrelay.RELAY_FROM - 1)
        assert slotrelay.wanted(slotrelay.RELAY_FROM)
    with dask.config.set({"fiber.pool.relay": False}):
        assert not slotrelay.wanted(4096)
    with dask.config.set({"fiber.pool.relay": True}):
        assert slotrelay.wanted(1)
