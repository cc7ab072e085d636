"""The direct channel: authentication before any unpickling, and where it listens."""

from __future__ import annotations

import logging
import multiprocessing
import pickle
import re
import socket
import struct
import threading
import time
from multiprocessing.connection import Connection

import pytest
from support import crowd
from support.wait import wait_until

from fiber_dask.comm import channel, gate

pytestmark = pytest.mark.timeout(60)


class Boom:
    """Unpickling this records that the server trusted a stranger's pickle."""

    unpickled = threading.Event()

    def __reduce__(self):
        return (Boom._mark, ())

    @staticmethod
    def _mark():
        Boom.unpickled.set()


@pytest.fixture(autouse=True)
def _fresh_gate_logs():
    """The gate is the process's: its log windows (one per address, flushed
    an interval later) from earlier tests, here or in other files, would
    flush into the tests that read its lines."""
    g = gate.get_gate()
    g._log._windows.clear()
    g._drops._windows.clear()
    yield
    g._log._windows.clear()
    g._drops._windows.clear()


@pytest.fixture
def server():
    s = channel.ChannelServer("127.0.0.1", b"right-key")
    got: list = []
    s.register("echo", lambda conn, hello: got.append((conn, hello)))
    s.got = got
    yield s
    s.close()
    for conn, _ in got:
        conn.close()


def test_connect_with_the_authkey_reaches_the_service(server):
    conn = channel.connect(server.address, b"right-key", "echo", hello={"n": 1})
    wait_until(lambda: server.got, 5, "the service's handler to get the connection")
    ((peer, hello),) = server.got
    assert hello == {"n": 1}
    conn.send_bytes(b"ping")
    assert peer.recv_bytes() == b"ping"
    conn.close()


def test_wrong_authkey_is_rejected_and_nothing_is_unpickled(server):
    Boom.unpickled.clear()
    stats = gate.get_gate().stats
    rejected = stats["rejected"]
    with pytest.raises(multiprocessing.AuthenticationError):
        channel.connect(server.address, b"wrong-key", "echo", hello=Boom())
    wait_until(lambda: stats["rejected"] > rejected, 5, "the gate to reject the peer")
    assert server.got == []
    assert not Boom.unpickled.is_set()


def test_raw_pickle_from_an_unauthenticated_peer_is_never_loaded(server):
    Boom.unpickled.clear()
    sock = socket.create_connection(server.address)
    conn = Connection(sock.detach())
    challenge = conn.recv_bytes(256)
    assert challenge.startswith(b"#FIBER-CHALLENGE#")
    # Answer the challenge with a pickle instead of a digest.
    conn.send_bytes(pickle.dumps(Boom()))
    assert conn.recv_bytes(256) == b"#FIBER-FAILURE#"
    with pytest.raises((EOFError, OSError)):
        conn.recv_bytes()
    conn.close()
    assert server.got == [] and not Boom.unpickled.is_set()


def test_an_impostor_server_cannot_make_the_client_trust_it():
    # A server that does not know the key: the client must refuse it.
    impostor = channel.ChannelServer("127.0.0.1", b"other-key")
    impostor.register("echo", lambda conn, hello: None)
    try:
        with pytest.raises(multiprocessing.AuthenticationError):
            channel.connect(impostor.address, b"right-key", "echo")
    finally:
        impostor.close()


def test_unknown_service_is_a_connection_error(server):
    with pytest.raises(channel.ChannelError, match="no service 'nope'") as info:
        channel.connect(server.address, b"right-key", "nope")
    # It answered: the service is gone, not the owner unreachable.
    assert not isinstance(info.value, channel.Unreachable)


def test_unreachable_server_is_a_connection_error_naming_the_setting():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    with pytest.raises(channel.Unreachable, match="fiber.listen-host"):
        channel.connect(("127.0.0.1", port), b"k", "echo", timeout=2)


def test_listens_only_on_the_interface_it_was_given(server):
    assert server.address[0] == "127.0.0.1"
    listening = server._sock.getsockname()
    assert listening[0] == "127.0.0.1"


def test_silent_peer_does_not_block_other_connections(server):
    # A connection that never answers the challenge must not stall the server.
    silent = socket.create_connection(server.address)
    try:
        conn = channel.connect(server.address, b"right-key", "echo", timeout=5)
        conn.close()
    finally:
        silent.close()


def _read_challenge(sock: socket.socket) -> bytes:
    (size,) = struct.unpack("!i", _recv_exactly(sock, 4))
    return _recv_exactly(sock, size)


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise EOFError
        data += chunk
    return data


def _closed_by_server(sock: socket.socket, timeout: float) -> bool:
    """Whether the server closed ``sock`` within ``timeout`` s (EOF or reset)."""
    sock.settimeout(timeout)
    try:
        while sock.recv(4096):
            pass
    except TimeoutError:
        return False
    except OSError:
        pass
    return True


def test_a_partial_frame_does_not_extend_the_handshake_deadline(monkeypatch):
    """The deadline covers the whole handshake: a peer that sends the length
    header of its answer a byte at a time (each byte well within any per-read
    timeout) is still dropped when the handshake's time is up."""
    monkeypatch.setattr(gate, "HANDSHAKE_TIMEOUT", 1.0)
    s = channel.ChannelServer("127.0.0.1", b"right-key")
    try:
        sock = socket.create_connection(s.address)
        assert _read_challenge(sock).startswith(b"#FIBER-CHALLENGE#")
        t0 = time.monotonic()
        closed = False
        for byte in struct.pack("!i", 32) + b"x" * 32:  # 36 bytes, 0.2 s apart
            try:
                sock.send(bytes([byte]))
            except OSError:
                closed = True
                break
            if _closed_by_server(sock, 0.2):
                closed = True
                break
        elapsed = time.monotonic() - t0
        assert closed, "the server kept a trickling peer past its deadline"
        assert elapsed < 3.0, f"dropped only after {elapsed:.1f} s"
        sock.close()
    finally:
        s.close()


def test_stalled_peers_of_one_address_are_bounded_and_cannot_lock_out(monkeypatch):
    """Handshakes in progress from one address are bounded: a new one drops
    the oldest, so a flood of silent sockets holds no thread and no slot a
    real client needs; the real client gets in at once."""
    monkeypatch.setattr(gate, "MAX_PER_PEER", 4)
    g = gate.get_gate()
    s = channel.ChannelServer("127.0.0.1", b"right-key")
    served: list = []
    s.register("hold", lambda conn, hello: served.append(conn))
    silent = []
    try:
        threads_before = threading.active_count()
        for _ in range(20):
            silent.append(socket.create_connection(s.address))
        # The 16 oldest are dropped (they see EOF after the challenge) ...
        for sock in silent[:16]:
            _read_challenge(sock)
            assert _closed_by_server(sock, 5), "an old stalled socket was kept"
        # ... and nothing per connection is left behind: no thread each.
        assert threading.active_count() <= threads_before + 1
        t0 = time.monotonic()
        conn = channel.connect(s.address, b"right-key", "hold", timeout=10)
        assert time.monotonic() - t0 < 2  # no wait for the stalled ones' deadline
        wait_until(lambda: served, 5, "the service to get the real client")
        assert g.stats["evicted-peer"] >= 16
        conn.close()
    finally:
        for sock in silent:
            sock.close()
        for conn in served:
            conn.close()
        s.close()


def test_peers_that_proved_the_key_leave_their_address_bound(monkeypatch):
    """The bound on stalled handshakes per address counts only peers that have
    not proved the authkey: many real clients of one host (a thousand pool
    slots connecting at once) past their first answer are not dropped as
    stalled, while as many silent sockets from the same address are; a
    proven peer that stalls still meets the whole-handshake deadline."""
    monkeypatch.setattr(gate, "MAX_PER_PEER", 4)
    monkeypatch.setattr(gate, "MIN_AGE", 0.1)
    monkeypatch.setattr(gate, "HANDSHAKE_TIMEOUT", 4.0)
    g = gate.get_gate()
    s = channel.ChannelServer("127.0.0.1", b"right-key")
    proven, silent = [], []
    try:
        trusted, evicted = g.stats["trusted"], g.stats["evicted-peer"]
        for _ in range(10):
            sock = socket.create_connection(s.address)
            challenge = _read_challenge(sock)[len(channel._CHALLENGE) :]
            sock.sendall(gate.frame(channel._digest(b"right-key", challenge)))
            proven.append(sock)  # ... and then says nothing more
        wait_until(
            lambda: g.stats["trusted"] >= trusted + 10, 5, "10 peers to prove the key"
        )
        for _ in range(10):
            silent.append(socket.create_connection(s.address))
        wait_until(
            lambda: g.stats["evicted-peer"] >= evicted + 6,
            5,
            "the silent sockets beyond the bound to be dropped",
        )
        assert g.stats["evicted-peer"] == evicted + 6  # none of the proven ones
        assert not any(_closed_by_server(sock, 0.05) for sock in proven)
        # The deadline still holds for them.
        assert all(_closed_by_server(sock, 6) for sock in proven)
    finally:
        for sock in proven + silent:
            sock.close()
        s.close()


def test_rejections_are_logged_once_per_address_and_interval(monkeypatch, caplog):
    """A flood of bad peers costs one log line per address per interval,
    then one line with the count of the others."""
    monkeypatch.setattr(gate, "LOG_INTERVAL", 1.0)
    g = gate.get_gate()
    s = channel.ChannelServer("127.0.0.1", b"right-key")
    caplog.set_level(logging.WARNING, logger="fiber_dask.comm.gate")
    try:
        rejected = g.stats["rejected"]
        for _ in range(20):
            sock = socket.create_connection(s.address)
            sock.sendall(b"\xff" * 16)  # junk: a negative frame length
            sock.close()
        wait_until(lambda: g.stats["rejected"] >= rejected + 20, 10, "20 rejections")
        wait_until(
            lambda: any("more connection" in r.getMessage() for r in caplog.records),
            10,
            "the line with the count of the others",
        )
        lines = [
            r.getMessage() for r in caplog.records if "127.0.0.1" in r.getMessage()
        ]
        assert len(lines) == 2, lines
        assert "rejected a connection from 127.0.0.1" in lines[0]
        # 19 of ours at least: an earlier test's dropped peers on the same
        # address may fall into the same interval.
        more = re.search(
            r"rejected (\d+) more connection\(s\) from 127.0.0.1", lines[1]
        )
        assert more and int(more.group(1)) >= 19, lines
    finally:
        s.close()


def test_a_server_that_stalls_mid_frame_cannot_hold_a_client():
    """The client's side is bounded too: a 'server' that sends part of its
    challenge and stops makes connect() fail, not hang."""
    listener = socket.create_server(("127.0.0.1", 0))
    accepted: list = []

    def serve():
        sock, _ = listener.accept()
        accepted.append(sock)
        sock.sendall(struct.pack("!i", 49) + b"#FIBER-CHAL")  # 11 of 49 bytes

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        t0 = time.monotonic()
        with pytest.raises(channel.Unreachable, match="stalled"):
            channel.connect(listener.getsockname(), b"right-key", "echo", timeout=1)
        assert time.monotonic() - t0 < 10
    finally:
        for sock in accepted:
            sock.close()
        listener.close()


def test_the_total_bound_drops_the_oldest_at_once(monkeypatch):
    """Beyond MAX_PENDING handshakes in all, each new connection drops the
    oldest one waiting (descriptors are what a flood would exhaust)."""
    monkeypatch.setattr(gate, "MAX_PENDING", 8)
    g = gate.get_gate()
    s = channel.ChannelServer("127.0.0.1", b"right-key")
    silent = []
    try:
        for _ in range(20):
            silent.append(socket.create_connection(s.address))
        for sock in silent[:12]:
            _read_challenge(sock)
            assert _closed_by_server(sock, 5), "an old stalled socket was kept"
        wait_until(lambda: g.pending() <= 8, 5, "at most 8 handshakes in progress")
        # A real client still authenticates (and hears there is no such service).
        with pytest.raises(channel.ChannelError, match="no service"):
            channel.connect(s.address, b"right-key", "nope", timeout=10)
    finally:
        for sock in silent:
            sock.close()
        s.close()


def test_frame_reader_reads_every_waiting_frame_and_keeps_partial_ones():
    """FrameReader (the pool owner's reads): several frames in one read, a
    frame larger than one read, an empty frame, then EOF."""
    import selectors

    a, b = socket.socketpair()
    sender, receiver = Connection(a.detach()), Connection(b.detach())
    reader = channel.FrameReader(receiver)
    for m in (b"a", b"bb", b"ccc"):
        sender.send_bytes(m)
    assert reader.frames() == [b"a", b"bb", b"ccc"]  # all three, one read
    big = bytes(range(256)) * 4096  # 1 MiB: several reads
    sent = [b"one", b"", b"three", big, b"last"]
    got: list[bytes] = []
    t = threading.Thread(target=lambda: [sender.send_bytes(m) for m in sent])
    t.start()
    sel = selectors.DefaultSelector()
    sel.register(receiver, selectors.EVENT_READ)
    reads = 0
    while len(got) < len(sent):
        assert sel.select(timeout=30), f"waited 30 s for frames; got {len(got)}"
        got.extend(reader.frames())
        reads += 1
    t.join()
    assert got == sent
    # Not a read per byte (a million): how much each read finds depends on
    # how the sender's thread is scheduled, a few KiB on a loaded machine.
    assert reads < len(big) // 4096, reads
    sender.close()
    assert sel.select(timeout=30)
    with pytest.raises(EOFError):
        reader.frames()
    receiver.close()


def test_frame_reader_reassembles_any_split_of_any_frames():
    """Frames of every size, the byte stream cut anywhere (as TCP may
    deliver it): each comes out whole, in order, and a buffer grown for a
    large frame goes back to its size."""
    import random
    import selectors
    import struct

    rng = random.Random(15)
    sizes = [0, 1, 3, 4, 5, 1000, (1 << 16) - 4, 1 << 16, (1 << 18) + 7, 3 << 20]
    sizes += [rng.choice(sizes) for _ in range(200)]
    frames = [rng.randbytes(n) for n in sizes]
    stream = b"".join(struct.pack("!i", len(f)) + f for f in frames)
    a, b = socket.socketpair()
    receiver = Connection(b.detach())
    reader = channel.FrameReader(receiver)

    def send():
        pos = 0
        while pos < len(stream):
            step = rng.choice((1, 2, 3, 5, 4096, 70000, 1 << 20))
            a.sendall(stream[pos : pos + step])
            pos += step
        a.close()

    t = threading.Thread(target=send)
    t.start()
    sel = selectors.DefaultSelector()
    sel.register(receiver, selectors.EVENT_READ)
    got: list[bytes] = []
    with pytest.raises(EOFError):
        while True:
            assert sel.select(timeout=30), f"waited 30 s; {len(got)} frames"
            got.extend(reader.frames())
    t.join()
    assert got == frames
    assert len(reader._buf) == channel._BUFFER
    receiver.close()


# ------------------------------------------------- handshakes cut by the server


class CuttingProxy:
    """A TCP front for a real server that, for its first ``cuts``
    connections, passes the server's challenge on, takes the client's answer
    and closes both ends without a verdict: what a gate over its bound of
    handshakes in progress from one host does.  Later connections are piped
    through.  ``connections`` counts them all."""

    def __init__(self, upstream: tuple, cuts: float) -> None:
        self.upstream, self.cuts, self.connections = upstream, cuts, 0
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = self.sock.getsockname()
        self.open: list = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            server = socket.create_connection(self.upstream)
            self.open += [client, server]
            if self.connections <= self.cuts:
                challenge = _read_challenge(server)
                client.sendall(struct.pack("!i", len(challenge)) + challenge)
                client.recv(4096)  # its answer, then nothing
                server.close()
                client.close()
                continue
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=_pipe, args=(a, b), daemon=True).start()

    def close(self) -> None:
        self.sock.close()
        for s in self.open:
            s.close()


def _pipe(a: socket.socket, b: socket.socket) -> None:
    try:
        while data := a.recv(65536):
            b.sendall(data)
        b.shutdown(socket.SHUT_WR)
    except OSError:
        pass


def test_a_handshake_cut_without_a_verdict_is_dialled_again(server):
    s, got = server, server.got
    proxy = CuttingProxy(s.address, cuts=3)
    try:
        conn = channel.connect(proxy.address, b"right-key", "echo", hello="h", timeout=10)
        wait_until(lambda: got, 5, "the service to get the connection")
        assert got[0][1] == "h"
        assert proxy.connections == 4  # three cut, the fourth through
        conn.close()
    finally:
        proxy.close()


def test_a_wrong_authkey_is_not_dialled_again(server):
    s = server
    proxy = CuttingProxy(s.address, cuts=0)
    try:
        t0 = time.monotonic()
        with pytest.raises(multiprocessing.AuthenticationError, match="wrong authkey"):
            channel.connect(proxy.address, b"wrong-key", "echo", timeout=10)
        assert time.monotonic() - t0 < 2
        assert proxy.connections == 1
    finally:
        proxy.close()


def test_a_server_that_always_cuts_the_handshake_is_unreachable_in_time(server):
    s = server
    proxy = CuttingProxy(s.address, cuts=float("inf"))
    try:
        t0 = time.monotonic()
        with pytest.raises(channel.Unreachable, match="cut the handshake .* overloaded"):
            channel.connect(proxy.address, b"right-key", "echo", timeout=2)
        assert time.monotonic() - t0 < 4
        assert proxy.connections >= 3
    finally:
        proxy.close()


def test_many_clients_of_one_host_past_a_crowded_gate_all_connect(monkeypatch):
    """Hundreds of processes of one host connecting at once (a thousand pool
    slots, each with its queues) overflow the gate's bound on handshakes in
    progress from one address; those it drops dial again, quietly, and all
    get in."""
    crowd.crowded_gate(monkeypatch)
    g = gate.get_gate()
    s, served = crowd.echo_server(b"right-key")
    evicted = g.stats["evicted-peer"]
    try:
        assert crowd.connect_at_once(s.address, b"right-key", 60, timeout=20) == []
        crowd.all_served(served, 60)
        assert g.stats["evicted-peer"] > evicted  # some were dropped on the way
    finally:
        crowd.close(s, served)


def test_a_crowd_of_real_clients_is_not_warned_of_a_strangers_flood_is(
    monkeypatch, caplog
):
    """Handshakes dropped to keep the bound from an address whose peers
    prove the key (a big host's processes connecting at once; they dial
    again) are said at INFO; from an address none of whose peers proved it,
    they are warned of, as a flood of stalled sockets is."""
    crowd.crowded_gate(monkeypatch)
    g = gate.get_gate()
    s, served = crowd.echo_server(b"right-key")
    caplog.set_level(logging.INFO, logger="fiber_dask.comm.gate")

    def ours(level):
        return [
            r.getMessage()
            for r in caplog.records
            if r.levelno == level and "127.0.0.1" in r.getMessage()
        ]

    stalled: list = []
    try:
        # A stranger: no peer of this address has proved the key.
        g._proved.clear()
        evicted = g.stats["evicted-peer"]
        stalled = [socket.create_connection(s.address) for _ in range(8)]
        wait_until(lambda: g.stats["evicted-peer"] >= evicted + 6, 10, "6 drops")
        assert any("dropped: over 2 handshakes" in m for m in ours(logging.WARNING))
        for sock in stalled:
            sock.close()
        # Real clients of one host, in a crowd.
        caplog.clear()
        g._log._windows.clear()
        channel.connect(s.address, b"right-key", "echo", timeout=20).close()
        evicted = g.stats["evicted-peer"]
        assert crowd.connect_at_once(s.address, b"right-key", 40, timeout=20) == []
        assert g.stats["evicted-peer"] > evicted  # some were dropped on the way
        assert ours(logging.WARNING) == []
        assert any("dropped a handshake from 127.0.0.1" in m for m in ours(logging.INFO))
        # Stalled sockets beside a real client of the same address (a NAT):
        # the first drop is said at INFO, but the interval's count, above
        # the proofs, is warned of.
        monkeypatch.setattr(gate, "LOG_INTERVAL", 1.0)
        caplog.clear()
        g._drops._windows.clear()
        channel.connect(s.address, b"right-key", "echo", timeout=20).close()
        evicted = g.stats["evicted-peer"]
        stalled = [socket.create_connection(s.address) for _ in range(8)]
        wait_until(lambda: g.stats["evicted-peer"] >= evicted + 6, 10, "6 more drops")
        wait_until(
            lambda: any("stalled sockets beside" in m for m in ours(logging.WARNING)),
            10,
            "the interval's count of drops to be warned of",
        )
    finally:
        for sock in stalled:
            sock.close()
        crowd.close(s, served)


def test_a_peer_gone_mid_handshake_is_counted_not_warned_of(caplog):
    """A process killed while it connects (slot processes at their program's
    exit) closes or resets its half-done handshake: the gate counts it and
    says nothing on stderr, where junk and wrong keys are warned of."""
    g = gate.get_gate()
    s = channel.ChannelServer("127.0.0.1", b"right-key")
    caplog.set_level(logging.WARNING, logger="fiber_dask.comm.gate")
    try:
        gone = g.stats["gone"]
        closed = socket.create_connection(s.address)
        _read_challenge(closed)
        closed.close()  # end of file
        reset = socket.create_connection(s.address)
        reset.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        _read_challenge(reset)
        reset.close()  # RST
        wait_until(lambda: g.stats["gone"] >= gone + 2, 5, "both to be counted")
        assert not [r for r in caplog.records if "127.0.0.1" in r.getMessage()]
    finally:
        s.close()
