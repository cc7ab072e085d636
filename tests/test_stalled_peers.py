"""Stalled and hostile peers on every fiber-dask port cannot stop the service.

2000 sockets that never complete a handshake — silent ones, partial length
headers, partial frames, junk, wrong-key handshakes — spread over the
channel server (Pools, Process launchers, Queues and Locks) and a Manager's
server; then a Manager call, a new Pool, a Queue and a Lock used from a Pool
task and a new Process all work, long before the stalled handshakes'
deadline.  (Dask's own
ports are Dask's business.)
"""

from __future__ import annotations

import os
import pickle
import resource
import socket
import struct
import threading
import time

import pytest
from support.wait import wait_until

from fiber_dask import cluster
from fiber_dask.comm import channel, gate

pytestmark = pytest.mark.timeout(120)

N_STALLED = 2000


def _square(x):
    return x * x


def _roundtrip(q, x):
    """Put through the queue's owner and take it back (a remote holder)."""
    q.put(x)
    return q.get(timeout=30)


def _touch(path):
    with open(path, "w") as f:
        f.write("ran")


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


def _locked_roundtrip(lock, x):
    with lock:
        return x


def test_a_new_pool_queue_and_manager_work_beside_2000_stalled_sockets(
    fiber_ctx, tmp_path, monkeypatch
):
    # Here the stalled handshakes would wait a minute: a client that had to
    # wait for them to time out would take that long.
    monkeypatch.setattr(gate, "HANDSHAKE_TIMEOUT", 60.0)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = N_STALLED + 1024
    if soft < want:
        if hard != resource.RLIM_INFINITY and hard < want:
            pytest.fail(f"RLIMIT_NOFILE hard limit {hard} < {want}: raise it to run")
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    cluster.get_handle()  # the cluster is up before the attack
    manager = fiber_ctx.Manager()
    q = fiber_ctx.Queue()  # its owner's channel server serves Queues and Pools
    lock = fiber_ctx.Lock()
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
        # The Manager's server process keeps the default 10 s deadline.
        t0 = time.monotonic()
        d = manager.dict()
        d["k"] = "v"
        assert d["k"] == "v"
        elapsed = time.monotonic() - t0
        assert elapsed < 10, f"a Manager call took {elapsed:.1f} s"
        t0 = time.monotonic()
        with fiber_ctx.Pool(1) as pool:
            assert pool.map(_square, range(10)) == [x * x for x in range(10)]
            assert pool.apply(_roundtrip, (q, "item")) == "item"
            assert pool.apply(_locked_roundtrip, (lock, 7)) == 7
        marker = str(tmp_path / "ran")
        p = fiber_ctx.Process(target=_touch, args=(marker,))
        p.start()
        p.join(40)
        assert p.exitcode == 0 and os.path.exists(marker)
        elapsed = time.monotonic() - t0
        # Well before the stalled handshakes time out: nobody waited for them.
        assert elapsed < 45, (
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


def _frames_until_eof(sock: socket.socket, timeout: float) -> bytes:
    sock.settimeout(timeout)
    data = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return data
        if not chunk:
            return data
        data += chunk


def test_manager_server_tells_a_failed_peer_nothing_but_failure(fiber_ctx):
    """The stdlib's server answers a wrong handshake with a pickled traceback
    (unpickled by whoever connected); fiber-dask's sends the protocol's
    ``#FAILURE#`` and hangs up."""
    with fiber_ctx.Manager() as manager:
        for answer in (b"\x00" * 16, pickle.dumps(("#TRACEBACK", "x"))):
            sock = socket.create_connection(manager.address, timeout=10)
            (size,) = struct.unpack("!i", sock.recv(4, socket.MSG_WAITALL))
            assert sock.recv(size, socket.MSG_WAITALL).startswith(b"#CHALLENGE#")
            sock.sendall(struct.pack("!i", len(answer)) + answer)
            reply = _frames_until_eof(sock, 10)
            sock.close()
            assert reply == struct.pack("!i", 9) + b"#FAILURE#", reply
        d = manager.dict(a=1)  # and it still serves its clients
        assert d["a"] == 1


def test_manager_handshake_has_the_whole_handshake_deadline(monkeypatch):
    """A peer trickling a partial frame to a Manager's server is dropped
    when the handshake's time is up (the server here runs in this process,
    under this process's gate)."""
    from fiber_dask.managers import SyncManager

    monkeypatch.setattr(gate, "HANDSHAKE_TIMEOUT", 1.0)
    server = SyncManager(address=("127.0.0.1", 0), authkey=b"key").get_server()

    def serve():
        try:
            server.serve_forever()
        except SystemExit:  # how the stdlib's server ends
            pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        sock = socket.create_connection(server.address, timeout=10)
        (size,) = struct.unpack("!i", sock.recv(4, socket.MSG_WAITALL))
        sock.recv(size, socket.MSG_WAITALL)
        t0 = time.monotonic()
        closed = False
        for byte in struct.pack("!i", 16) + b"y" * 16:
            try:
                sock.send(bytes([byte]))
            except OSError:
                closed = True
                break
            sock.settimeout(0.2)
            try:
                if sock.recv(4096) == b"":
                    closed = True
                    break
            except TimeoutError:
                pass
            except OSError:
                closed = True
                break
        assert closed, "the Manager's server kept a trickling peer"
        assert time.monotonic() - t0 < 3.0
        sock.close()
    finally:
        server.stop_event.set()
        thread.join(5)
        gate.get_gate().close_listener(server.listener._listener._socket)
