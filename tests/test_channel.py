"""The direct channel: authentication before any unpickling, and where it listens."""

from __future__ import annotations

import multiprocessing
import pickle
import socket
import threading
import time
from multiprocessing.connection import Connection

import pytest

from fiber_dask import channel

pytestmark = pytest.mark.timeout(60)


class Boom:
    """Unpickling this records that the server trusted a stranger's pickle."""

    unpickled = threading.Event()

    def __reduce__(self):
        return (Boom._mark, ())

    @staticmethod
    def _mark():
        Boom.unpickled.set()


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
    deadline = time.monotonic() + 5
    while not server.got and time.monotonic() < deadline:
        time.sleep(0.01)
    ((peer, hello),) = server.got
    assert hello == {"n": 1}
    conn.send_bytes(b"ping")
    assert peer.recv_bytes() == b"ping"
    conn.close()


def test_wrong_authkey_is_rejected_and_nothing_is_unpickled(server):
    Boom.unpickled.clear()
    with pytest.raises(multiprocessing.AuthenticationError):
        channel.connect(server.address, b"wrong-key", "echo", hello=Boom())
    time.sleep(0.2)
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
    with pytest.raises(channel.ChannelError, match="no service 'nope'"):
        channel.connect(server.address, b"right-key", "nope")


def test_unreachable_server_is_a_connection_error_naming_the_setting():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    with pytest.raises(channel.ChannelError, match="fiber.listen-host"):
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


def test_silent_peers_cannot_multiply_handshake_threads(monkeypatch):
    """A flood of connections that never authenticate holds at most
    _MAX_HANDSHAKES threads; a real peer still gets in once they time out, and
    served connections do not count against the limit."""
    monkeypatch.setattr(channel, "_MAX_HANDSHAKES", 2)
    monkeypatch.setattr(channel, "_HANDSHAKE_TIMEOUT", 0.5)
    s = channel.ChannelServer("127.0.0.1", b"right-key")
    served: list = []
    s.register("hold", lambda conn, hello: served.append(conn))  # kept open
    silent = []
    try:
        for _ in range(3):  # more long-lived served connections than the limit
            channel.connect(s.address, b"right-key", "hold")
        for _ in range(6):
            silent.append(socket.create_connection(s.address))
        time.sleep(0.2)
        handshaking = [
            t for t in threading.enumerate() if t.name == "fiber-channel-handshake"
        ]
        assert len(handshaking) <= 2
        t0 = time.monotonic()
        conn = channel.connect(s.address, b"right-key", "hold", timeout=10)
        assert time.monotonic() - t0 < 5  # the silent ones time out in turn
        deadline = time.monotonic() + 5
        while len(served) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)  # the handler runs just after the peer's "OK"
        assert len(served) == 4
        conn.close()
    finally:
        for sock in silent:
            sock.close()
        for conn in served:
            conn.close()
        s.close()
