"""Stalled and hostile peers on every fiber-dask port cannot stop the service.

2000 sockets that never complete a handshake — silent ones, partial length
headers, partial frames, junk, wrong-key handshakes — spread over the
channel server (Pools, Process launchers, Queues and Locks) and a Manager's
server; then a new Pool, a Queue used from a Pool task and a Manager call
all work at once, long before the stalled handshakes' deadline.  (Dask's own
ports are Dask's business.)
"""

from __future__ import annotations

import os
import resource
import socket
import struct
import time

import pytest
from support.wait import wait_until

from fiber_dask import channel, cluster, gate

pytestmark = pytest.mark.timeout(120)

N_STALLED = 2000


def _square(x):
    return x * x


def _roundtrip(q, x):
    """Put through the queue's owner and take it back (a remote holder)."""
    q.put(x)
    return q.get(timeout=30)


def _stall(address, kind: int, authkey_guess: bytes) -> socket.socket | None:
    sock = socket.create_connection(address, timeout=10)
    if kind == 0:
        pass  # sends nothing
    elif kind == 1:
        sock.sendall(b"\x00\x00\x00")  # three bytes of a length header
    elif kind == 2:
        sock.sendall(struct.pack("!i", 200) + b"x" * 50)  # a partial frame
    elif kind == 3:
        sock.sendall(os.urandom(64))  # junk
    else:  # a handshake with the wrong key: the challenge answered wrongly
        (size,) = struct.unpack("!i", sock.recv(4, socket.MSG_WAITALL))
        sock.recv(size, socket.MSG_WAITALL)
        sock.sendall(struct.pack("!i", 32) + authkey_guess)
    return sock


def test_a_new_pool_queue_and_manager_work_beside_2000_stalled_sockets(fiber_ctx):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = N_STALLED + 1024
    if soft < want:
        if hard != resource.RLIM_INFINITY and hard < want:
            pytest.fail(f"RLIMIT_NOFILE hard limit {hard} < {want}: raise it to run")
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    cluster.get_handle()  # the cluster is up before the attack
    manager = fiber_ctx.Manager()
    q = fiber_ctx.Queue()  # its owner's channel server serves Queues and Pools
    stalled: list[socket.socket] = []
    try:
        ports = [tuple(s.address) for s in list(channel._servers.values())]
        ports.append(tuple(manager.address))
        assert len(ports) >= 2
        g = gate.get_gate()
        evicted = g.stats["evicted-peer"]
        for i in range(N_STALLED):
            sock = _stall(ports[i % len(ports)], i % 5, b"\x00" * 32)
            stalled.append(sock)
        t0 = time.monotonic()
        with fiber_ctx.Pool(1) as pool:
            assert pool.map(_square, range(10)) == [x * x for x in range(10)]
            assert pool.apply(_roundtrip, (q, "item")) == "item"
        d = manager.dict()
        d["k"] = "v"
        assert d["k"] == "v"
        elapsed = time.monotonic() - t0
        # Well before the stalled handshakes time out: nobody waited for them.
        assert elapsed < gate.HANDSHAKE_TIMEOUT, (
            f"the new clients needed {elapsed:.1f} s: they waited for stalled peers"
        )
        # This process's gate holds only its bound of idle ones; the oldest
        # were dropped (the Manager's process has a gate of its own).
        wait_until(
            lambda: g.pending() <= gate.MAX_PER_PEER,
            gate.MIN_AGE + 5,
            f"at most {gate.MAX_PER_PEER} stalled handshakes left",
        )
        assert g.stats["evicted-peer"] > evicted
    finally:
        for sock in stalled:
            sock.close()
        manager.shutdown()
        q.close()
