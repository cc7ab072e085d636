"""TLS on the direct connections, on one host (loopback): ``fiber_dask.comm.tls``.

The connection class itself (framing, ``poll`` with data already decrypted,
large messages, end of stream, both directions at once), what goes on the
wire (a relay between the two ends records every byte), and what happens
when the two ends disagree (each mismatch fails at once with a clear error).
The cross-host tests (``test_crosshost.py``, TLS variant) check the same on
real hosts, with a capture at the switch.

Certificates are Dask's ``Security.temporary()`` (made in memory); the
process's mode is pinned with ``security.pin`` for a test and restored after.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import select
import socket
import ssl
import struct
import sys
import threading
import time

import pytest
from distributed.security import Security
from support import crowd
from support.wait import wait_until

from fiber_dask import cluster
from fiber_dask.comm import channel, gate, objserver, tls
from fiber_dask.comm import security as fiber_security
from fiber_dask.errors import TLSConnectionError

pytestmark = pytest.mark.timeout(90)

KEY = b"tls-test-key"


def _settings(security: Security) -> dict:
    return {
        "role": "client",
        "require_encryption": True,
        "tls_ca_file": security.tls_ca_file,
        "tls_client_cert": security.tls_client_cert,
        "tls_client_key": security.tls_client_key,
    }


@pytest.fixture(scope="module")
def security():
    return Security.temporary()


@pytest.fixture
def pinned(security):
    """This process in TLS mode with ``security``'s certificate; ``pinned(x)``
    switches to other settings (None: no TLS).  Restored after the test, and
    the channel servers made meanwhile are closed."""
    servers_before = set(channel._servers)
    default = _settings(security)

    def pin(settings=default):
        fiber_security.pin(settings, "the test")

    pin()
    yield pin
    fiber_security._pinned = fiber_security._UNSET
    with channel._server_lock:
        for key in set(channel._servers) - servers_before:
            channel._servers.pop(key).close()


def tls_pair(security):
    """A connected (client, server) pair of TLSConnections over loopback TCP."""
    server_ctx = security.get_listen_args("client")["ssl_context"]
    client_ctx = security.get_connection_args("client")["ssl_context"]
    listener = socket.create_server(("127.0.0.1", 0))
    a = socket.create_connection(listener.getsockname())
    b, _ = listener.accept()
    listener.close()
    server = tls.TLSConnection.server(b, server_ctx)
    t = threading.Thread(target=server.handshake, args=(10,))
    t.start()
    client = tls.connect(a, client_ctx, 10, "the test server")
    t.join()
    return client, server


def fd_readable(conn) -> bool:
    return bool(select.select([conn.fileno()], [], [], 0)[0])


def whole_records_waiting(conn) -> int:
    """How many whole TLS records wait, still encrypted, in ``conn``'s socket
    (peeked: nothing is taken from it)."""
    with socket.socket(fileno=os.dup(conn.fileno())) as sock:
        try:
            data = sock.recv(1 << 20, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            return 0
    count = 0
    while len(data) >= 5:
        end = 5 + struct.unpack("!H", data[3:5])[0]  # type, version, length
        if len(data) < end:
            break
        count, data = count + 1, data[end:]
    return count


def _blocked_in_recv(thread: threading.Thread) -> bool:
    frame = sys._current_frames().get(thread.ident)
    while frame is not None:
        if frame.f_code.co_name in ("recv_bytes", "_recv", "recv_into", "recv"):
            return True
        frame = frame.f_back
    return False


# ------------------------------------------------------------ the connection


def test_messages_objects_and_order(security):
    client, server = tls_pair(security)
    try:
        for i in range(50):
            client.send_bytes(b"m%d" % i)
        client.send({"x": [1, 2, 3]})
        client.send_bytes(b"")
        client.send_bytes(b"0123456789", offset=2, size=3)
        assert [server.recv_bytes() for _ in range(50)] == [
            b"m%d" % i for i in range(50)
        ]
        assert server.recv() == {"x": [1, 2, 3]}
        assert server.recv_bytes() == b""
        assert server.recv_bytes() == b"234"
        assert server.poll(0) is False
        server.send_bytes(b"back")
        assert client.recv_bytes() == b"back"
    finally:
        client.close()
        server.close()


def test_poll_sees_data_already_decrypted_not_only_the_socket(security):
    client, server = tls_pair(security)
    try:
        client.send_bytes(b"one")
        client.send_bytes(b"two")
        wait_until(
            lambda: whole_records_waiting(server) >= 2, 5, "both messages to arrive"
        )
        assert server.poll(5)
        # poll() decrypted the first message: its bytes left the socket, but
        # the second is still there -- it never reads past a message's end.
        assert server.poll(0) and fd_readable(server)
        assert server.recv_bytes() == b"one"
        assert server.poll(0) and server.recv_bytes() == b"two"
        assert not fd_readable(server) and server.poll(0) is False
        # Only the decrypted copy left: the socket says nothing, poll does.
        client.send_bytes(b"three")
        assert server.poll(5)
        assert not fd_readable(server)
        assert server.poll(0) is True
        assert server.recv_bytes() == b"three"
        # A timeout with nothing to read.
        start = time.monotonic()
        assert server.poll(0.3) is False
        assert 0.25 < time.monotonic() - start < 2
    finally:
        client.close()
        server.close()


def test_large_messages_both_ways_at_once(security):
    client, server = tls_pair(security)
    big = os.urandom(20_000_000)
    odd = os.urandom(16_385)  # one byte past a TLS record
    got = {}
    try:

        def serve():
            got["big"] = server.recv_bytes()
            got["odd"] = server.recv_bytes(maxlength=len(odd))
            server.send_bytes(got["big"][::-1])

        t = threading.Thread(target=serve)
        t.start()
        client.send_bytes(big)
        client.send_bytes(odd)
        buf = bytearray(len(big) + 7)
        assert client.recv_bytes_into(buf, 7) == len(big)
        t.join(60)
        assert got["big"] == big and got["odd"] == odd
        assert bytes(buf[7:]) == big[::-1]
        # Too small a buffer: BufferTooShort with the whole message.
        server.send_bytes(b"x" * 100)
        with pytest.raises(multiprocessing.BufferTooShort) as e:
            client.recv_bytes_into(bytearray(10))
        assert e.value.args[0] == b"x" * 100
        # Over maxlength: refused without reading it into memory.
        server.send_bytes(b"y" * 1000)
        with pytest.raises(OSError, match="bad message length"):
            client.recv_bytes(maxlength=999)
    finally:
        client.close()
        server.close()


def test_many_threads_send_while_another_receives(security):
    """One SSL object used by senders and a receiver at once (an SSLSocket
    must not be): every message arrives whole, each sender's in order."""
    client, server = tls_pair(security)
    n = 300

    def send(tag):
        for i in range(n):
            client.send_bytes(pickle.dumps((tag, i, os.urandom(i * 37 % 5000))))

    def echo():
        try:
            while True:
                server.send_bytes(server.recv_bytes())
        except (EOFError, OSError):
            pass

    threading.Thread(target=echo, daemon=True).start()
    senders = [threading.Thread(target=send, args=(t,)) for t in range(4)]
    for t in senders:
        t.start()
    seen = {t: [] for t in range(4)}
    for _ in range(4 * n):
        assert client.poll(30)
        tag, i, _ = pickle.loads(client.recv_bytes())
        seen[tag].append(i)
    for t in senders:
        t.join()
    assert seen == {t: list(range(n)) for t in range(4)}
    channel.hangup(client)
    server.close()


def test_end_of_stream_and_hangup(security):
    client, server = tls_pair(security)
    client.send_bytes(b"last")
    client.close()
    assert server.poll(5) and server.recv_bytes() == b"last"
    assert server.poll(5)  # the end is readable, as with the stdlib
    with pytest.raises(EOFError):
        server.recv_bytes()
    server.close()
    with pytest.raises(OSError, match="closed"):
        server.recv_bytes()

    # A reader blocked in recv is woken by hangup() from another thread.
    client, server = tls_pair(security)
    result = {}

    def read():
        try:
            result["got"] = server.recv_bytes()
        except (EOFError, OSError) as e:
            result["error"] = type(e).__name__

    t = threading.Thread(target=read)
    t.start()
    wait_until(lambda: _blocked_in_recv(t), 5, "the reader to block in recv_bytes")
    channel.hangup(server)
    t.join(5)
    assert not t.is_alive() and "error" in result
    client.close()


# ------------------------------------------------------------ on the wire


class Relay:
    """A TCP relay that records every byte it forwards (what a capture of
    the network would see)."""

    def __init__(self, target):
        self.target = target
        self.wire = bytearray()
        self.lock = threading.Lock()
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = self.sock.getsockname()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                a, _ = self.sock.accept()
            except OSError:
                return
            b = socket.create_connection(self.target)
            for src, dst in ((a, b), (b, a)):
                threading.Thread(
                    target=self._pump, args=(src, dst), daemon=True
                ).start()

    def _pump(self, src, dst):
        try:
            while data := src.recv(65536):
                with self.lock:
                    self.wire += data
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self):
        self.sock.close()


@pytest.mark.parametrize("use_tls", [False, True], ids=["plain", "tls"])
def test_the_wire_carries_the_data_only_under_tls_encrypted(pinned, security, use_tls):
    if not use_tls:
        pinned(None)
    marker = b"WIRE-MARKER-" + os.urandom(6).hex().encode()
    server = channel.get_server("127.0.0.1", KEY)
    assert (server.context is not None) is use_tls
    echoed = threading.Event()

    def echo(conn, hello):
        def run():
            conn.send_bytes(hello + conn.recv_bytes())
            echoed.set()

        threading.Thread(target=run, daemon=True).start()

    server.register("wire", echo)
    relay = Relay(server.address)
    try:
        conn = channel.connect(relay.address, KEY, "wire", hello=marker + b"-hello")
        assert isinstance(conn, tls.TLSConnection) is use_tls
        conn.send_bytes(marker + b"-payload" * 1000)
        reply = conn.recv_bytes()
        assert reply == marker + b"-hello" + marker + b"-payload" * 1000
        assert echoed.wait(5)
        conn.close()
        # The relay records what it forwards before forwarding it: the reply
        # has come back, so the whole exchange is recorded.
        with relay.lock:
            wire = bytes(relay.wire)
        assert len(wire) > 8000  # the relay saw the whole exchange
        if use_tls:
            assert marker not in wire
            assert tls.HELLO in wire  # the one clear-text frame
            assert b"#FIBER-CHALLENGE#" not in wire  # the HMAC handshake is inside
        else:
            assert wire.count(marker) == 4  # hello, payload, and the echo of both
    finally:
        relay.close()
        server.unregister("wire")


# ------------------------------------------------------------ disagreements


@pytest.fixture
def tls_server(security):
    s = channel.ChannelServer(
        "127.0.0.1", KEY, security.get_listen_args("client")["ssl_context"]
    )
    got = []
    s.register("echo", lambda conn, hello: got.append((conn, hello)))
    s.got = got
    yield s
    s.close()
    for conn, _ in got:
        conn.close()


def test_tls_endpoint_works_with_a_tls_client(pinned, tls_server):
    conn = channel.connect(tls_server.address, KEY, "echo", hello={"n": 1})
    wait_until(lambda: tls_server.got, 5, "the service to get the connection")
    ((peer, hello),) = tls_server.got
    assert hello == {"n": 1} and isinstance(peer, tls.TLSConnection)
    conn.send_bytes(b"ping")
    assert peer.recv_bytes() == b"ping"
    conn.close()


def test_plaintext_client_to_a_tls_endpoint_fails_at_once(pinned, tls_server):
    pinned(None)
    start = time.monotonic()
    with pytest.raises(TLSConnectionError, match="requires TLS"):
        channel.connect(tls_server.address, KEY, "echo", timeout=20)
    assert time.monotonic() - start < 3
    assert tls_server.got == []


def test_tls_client_to_a_plaintext_endpoint_refuses_to_go_on(pinned):
    plain = channel.ChannelServer("127.0.0.1", KEY)
    got = []
    plain.register("echo", lambda conn, hello: got.append(hello))
    stats = gate.get_gate().stats
    rejected = stats["rejected"]
    try:
        start = time.monotonic()
        with pytest.raises(TLSConnectionError, match="does not use TLS"):
            channel.connect(plain.address, KEY, "echo", hello="secret", timeout=20)
        assert time.monotonic() - start < 3
        # the server's gate turned the TLS handshake away, and nothing reached
        # the service: the hello was never sent
        wait_until(lambda: stats["rejected"] > rejected, 5, "the gate to reject it")
        assert got == []
    finally:
        plain.close()


def test_a_certificate_from_another_ca_is_refused(pinned, tls_server):
    pinned(_settings(Security.temporary()))
    stats = gate.get_gate().stats
    rejected = stats["rejected"]
    with pytest.raises(TLSConnectionError, match="TLS"):
        channel.connect(tls_server.address, KEY, "echo", hello="x", timeout=10)
    wait_until(lambda: stats["rejected"] > rejected, 5, "the gate to reject it")
    assert tls_server.got == []


def test_a_stalled_tls_handshake_is_dropped_at_the_deadline(
    pinned, security, monkeypatch
):
    """The handshake deadline covers TLS too: a peer that sends part of a
    ClientHello record and stalls is dropped when its time is up, and a real
    TLS client is served meanwhile."""
    monkeypatch.setattr(gate, "HANDSHAKE_TIMEOUT", 1.0)
    s = channel.ChannelServer(
        "127.0.0.1", KEY, security.get_listen_args("client")["ssl_context"]
    )
    got = []
    s.register("echo", lambda conn, hello: got.append(conn))
    try:
        stalled = socket.create_connection(s.address, timeout=10)
        (size,) = struct.unpack("!i", stalled.recv(4, socket.MSG_WAITALL))
        assert stalled.recv(size, socket.MSG_WAITALL) == tls.HELLO
        stalled.sendall(b"\x16\x03\x01\x02\x00" + b"\x01" * 40)  # of 512 bytes
        t0 = time.monotonic()
        conn = channel.connect(s.address, KEY, "echo", timeout=10)
        wait_until(lambda: got, 5, "the real TLS client to be served")
        assert stalled.recv(4096) == b""  # EOF: dropped
        assert time.monotonic() - t0 < 4
        conn.close()
        stalled.close()
    finally:
        s.close()
        for c in got:
            c.close()


class Boom:
    """Unpickling this records that a server trusted a stranger's pickle."""

    unpickled = threading.Event()

    def __reduce__(self):
        return (_boom, ())


def _boom():
    Boom.unpickled.set()


def test_a_stranger_without_certificate_gets_nothing_unpickled(tls_server):
    """A TLS client with no certificate: the server ends the handshake."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    stats = gate.get_gate().stats
    rejected = stats["rejected"]
    sock = socket.create_connection(tls_server.address)
    with pytest.raises((TLSConnectionError, EOFError, OSError)):
        conn = tls.connect(sock, ctx, 5, "the server")
        # TLS 1.3: the refusal arrives after the client's side of the handshake.
        conn.send_bytes(pickle.dumps(Boom()))
        conn.recv_bytes()
    wait_until(lambda: stats["rejected"] > rejected, 5, "the gate to reject it")
    assert tls_server.got == [] and not Boom.unpickled.is_set()
    # Junk instead of a TLS handshake: closed at once.
    with socket.create_connection(tls_server.address) as s:
        s.settimeout(5)
        s.sendall(b"\x00\x00\x00\x05" + pickle.dumps(Boom()))
        data, start = b"", time.monotonic()
        try:
            while chunk := s.recv(4096):
                data += chunk
        except ConnectionResetError:
            pass  # closed with our junk unread
        assert time.monotonic() - start < 3
        assert data == struct.pack("!i", len(tls.HELLO)) + tls.HELLO
    assert not Boom.unpickled.is_set()


# ------------------------------------------------------------ the object server


def test_queue_holder_over_tls_acknowledges_through_tls(pinned, monkeypatch):
    """A Queue consumer's acknowledgements (written straight to the socket on
    a plain connection, corked) go encrypted on a TLS one."""
    from fiber_dask.queues import Queue

    monkeypatch.setattr(objserver, "_object_server", None)
    monkeypatch.setattr(cluster, "listen_host", lambda *a, **k: "127.0.0.1")
    q = Queue()
    assert objserver._object_server.server.context is not None
    holder = Queue.__new__(Queue)
    remote = objserver.Remote(*q._ref[:3])
    holder._setup(q._ref, remote)
    for i in range(2000):
        q.put(i)
    assert [holder.get(timeout=10) for _ in range(2000)] == list(range(2000))
    assert isinstance(remote._conn, tls.TLSConnection) and not remote._raw
    holder.put("from the holder")
    assert q.get(timeout=10) == "from the holder"
    assert q.empty()
    remote.close()
    objserver._object_server.server.close()


# ------------------------------------------------------------ the manager


@pytest.mark.parametrize("use_tls", [False, True], ids=["plain", "tls"])
def test_manager_speaks_tls_in_its_owners_mode(pinned, security, use_tls):
    """The server process listens in the mode of the process that started
    it; proxies (through a recording relay) carry nothing in clear; a client
    in the other mode fails at once, saying why."""
    from fiber_dask.managers import SyncManager

    if not use_tls:
        pinned(None)
    marker = "MANAGER-MARKER-" + os.urandom(6).hex()
    with SyncManager(address=("127.0.0.1", 0)) as manager:
        relay = Relay(manager.address)
        try:
            via = SyncManager(address=relay.address, authkey=manager._authkey)
            via.connect()
            d = via.dict()
            d["k"] = marker * 20
            assert manager.dict(d)["k"] == marker * 20  # a proxy as an argument
            assert d["k"] == marker * 20
            with relay.lock:  # recorded before forwarded: the replies are in
                wire = bytes(relay.wire)
            assert len(wire) > 1000
            assert (marker.encode() in wire) is not use_tls
            del d
        finally:
            relay.close()
        pinned(None if use_tls else _settings(Security.temporary()))
        other = SyncManager(address=manager.address, authkey=manager._authkey)
        start = time.monotonic()
        match = "requires TLS" if use_tls else "does not use TLS"
        with pytest.raises(TLSConnectionError, match=match):
            other.connect()
        assert time.monotonic() - start < 3
        pinned(_settings(security) if use_tls else None)  # to shut it down


# ------------------------------------------------------------ a TLS cluster


def _square_and_mode(x):
    from fiber_dask.comm import security as fiber_security

    security, role, source = fiber_security.mode()
    return x * x, security is not None, source


def _exit_with_mode():
    import sys

    from fiber_dask.comm import security

    sys.exit(7 if security.mode()[0] is not None else 3)


def test_pool_and_process_on_a_tls_cluster_speak_tls_with_its_workers():
    """A Pool and a Process given a client of a TLS cluster (certificates in a
    Security object, nothing in the config): their endpoint serves TLS; the
    launcher in the worker decides from its worker's security, the pool's slot
    processes and the Process's child from what their keeper or launcher
    passed on."""
    from distributed import Client, LocalCluster

    import fiber_dask

    security = Security.temporary()
    with (
        LocalCluster(
            n_workers=1,
            threads_per_worker=1,
            processes=True,
            host="127.0.0.1",
            dashboard_address=None,
            security=security,
        ) as cluster,
        Client(cluster, security=security) as client,
    ):
        assert client.scheduler.address.startswith("tls://")
        with fiber_dask.Pool(1, client=client) as pool:
            assert pool._server.context is not None
            results = pool.map(_square_and_mode, range(20))
        assert [r[0] for r in results] == [x * x for x in range(20)]
        assert all(r[1] for r in results)
        # The tasks run in slot processes, which take their worker's security
        # from the configuration their keeper passed on (as a Process child).
        assert "distributed.comm.require-encryption" in results[0][2], results[0]
        p = fiber_dask.Process(target=_exit_with_mode, client=client)
        p.start()
        p.join(60)
        assert p.exitcode == 7, p.reason


def test_many_clients_of_one_host_past_a_crowded_gate_all_connect_over_tls(
    pinned, security, monkeypatch
):
    """As test_channel's crowded gate, under TLS: a handshake the gate drops
    while the TLS part of it runs (before the server's hello, or within the
    TLS handshake, where it closes without an alert) is dialled again, not
    taken for a refused certificate."""
    # A bound of 4 and 40 clients: a TLS handshake takes longer than the
    # plain one, and a loaded machine must still let some through.
    crowd.crowded_gate(monkeypatch, bound=4)
    g = gate.get_gate()
    s, served = crowd.echo_server(KEY, security.get_listen_args("client")["ssl_context"])
    evicted = g.stats["evicted-peer"]
    try:
        assert crowd.connect_at_once(s.address, KEY, 40, timeout=30) == []
        crowd.all_served(served, 40)
        assert g.stats["evicted-peer"] > evicted  # some were dropped on the way
    finally:
        crowd.close(s, served)
