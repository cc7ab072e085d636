"""A stranger's host attacking fiber-dask endpoints (run by ``test_crosshost.py``).

``python crosshost_attack.py '<json params>'`` with ``endpoints`` (``[ip, port]``
pairs on the Dask network), ``side`` (the same ports at the hosts' side-network
addresses) and ``markers`` (a directory).  Every attack that carries a pickle
carries one whose unpickling creates a file in ``markers``: if any such file
exists afterwards, some endpoint unpickled a stranger's data.

The endpoints speak either fiber-dask's channel handshake or the stdlib's
``multiprocessing.connection`` one (a Manager's server), in clear or, on a
TLS cluster, inside TLS after a clear-text hello; the attacks work against
all of them.  The stranger has no certificate of the cluster.  Protocol with the test (JSON lines on stdout, lines on stdin):

1. each endpoint gets every attack (endpoints in parallel);
2. ``{"event": "holding"}``: a silent connection (connected, never says a word)
   is now open to every endpoint; the test checks that the program still
   accepts its own new connections meanwhile, then sends a line;
3. ``{"event": "result", ...}``: what each attack observed.
"""

from __future__ import annotations

import json
import os
import pickle
import socket
import ssl
import struct
import sys
import threading
import time
from multiprocessing import connection

from support import stackdump

_CHALLENGE = b"CHALLENGE#"  # the end of both protocols' challenge tags
_FAILURE = b"FAILURE#"
_TLS_HELLO = b"#FIBER-TLS#"  # what a TLS endpoint says first, in clear


class Evil:
    """Unpickling this creates ``path``."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def frame(payload: bytes) -> bytes:
    return struct.pack("!i", len(payload)) + payload


def read_frame(sock: socket.socket, timeout: float) -> bytes:
    """One length-prefixed message (the server's challenge)."""
    sock.settimeout(timeout)
    data = b""
    while len(data) < 4 or len(data) < 4 + struct.unpack("!i", data[:4])[0]:
        chunk = sock.recv(4096)
        if not chunk:
            break
        data += chunk
    return data


def drain(sock: socket.socket, timeout: float, got: bytes = b"") -> dict:
    """Read until the server closes; what came and how long it took."""
    sock.settimeout(timeout)
    start = time.monotonic()
    closed = False
    try:
        while True:
            data = sock.recv(65536)
            if not data:
                closed = True
                break
            got += data
    except (socket.timeout, TimeoutError):
        pass
    except OSError:
        closed = True  # reset
    return {
        "closed": closed,
        "seconds": round(time.monotonic() - start, 2),
        "received": len(got),
        "challenge": _CHALLENGE in got,
        "failure": _FAILURE in got,
        "tls_hello": got[4 : 4 + len(_TLS_HELLO)] == _TLS_HELLO,
    }


def attack(addr: tuple, markers: str) -> dict:
    out = {}
    mark = os.path.join(markers, f"{addr[0]}-{addr[1]}-{{}}")

    # Plain TCP junk: an HTTP request.
    with socket.create_connection(addr, timeout=5) as s:
        s.sendall(b"GET / HTTP/1.1\r\nHost: fiber\r\n\r\n" + os.urandom(64))
        out["junk"] = drain(s, 15)

    # A pickle right away, framed as both protocols frame messages.
    with socket.create_connection(addr, timeout=5) as s:
        s.sendall(frame(pickle.dumps(Evil(mark.format("first")))))
        out["pickle_first"] = drain(s, 15)

    # A pickle as the answer to the server's challenge.
    with socket.create_connection(addr, timeout=5) as s:
        challenge = read_frame(s, 5)
        s.sendall(frame(pickle.dumps(Evil(mark.format("answer")))))
        out["pickle_answer"] = drain(s, 15, challenge)

    # A frame that claims to be 2 GB long.
    with socket.create_connection(addr, timeout=5) as s:
        s.sendall(struct.pack("!i", 2**31 - 1) + b"x" * 1024)
        out["oversized"] = drain(s, 15)

    # TLS without a certificate of the cluster's CA, then a pickle.
    from fiber_dask.comm import tls

    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    try:
        sock = socket.create_connection(addr, timeout=5)
        conn = tls.connect(sock, ctx, 5, f"{addr}")
        conn.send_bytes(pickle.dumps(Evil(mark.format("tls"))))
        conn.recv_bytes()
        out["tls_no_cert"] = "answered"
        conn.close()
    except Exception as e:
        out["tls_no_cert"] = f"{type(e).__name__}: {e}"

    # The real clients with the wrong authkey: fiber-dask's channel (the
    # hello it would send after authenticating is the pickle) and the stdlib's.
    from fiber_dask.comm import channel

    for service in ("objects", "pool-x", "process-x"):
        try:
            conn = channel.connect(
                addr,
                b"not-the-key",
                service,
                hello=Evil(mark.format(service)),
                timeout=10,
            )
            out[f"wrong_key_{service}"] = "connected"
            conn.close()
        except Exception as e:
            out[f"wrong_key_{service}"] = f"{type(e).__name__}: {e}"
    try:
        conn = connection.Client(addr, authkey=b"not-the-key")
        conn.send(Evil(mark.format("stdlib")))
        out["wrong_key_stdlib"] = "connected"
        conn.close()
    except Exception as e:
        out["wrong_key_stdlib"] = f"{type(e).__name__}: {e}"
    return out


def try_connect(addr: tuple) -> str:
    try:
        with socket.create_connection(addr, timeout=3):
            return "connected"
    except OSError as e:
        return type(e).__name__


def main() -> None:
    params = json.loads(sys.argv[1])
    markers = params["markers"]
    results: dict = {}
    threads = []
    for addr in params["endpoints"]:
        key = f"{addr[0]}:{addr[1]}"

        def run(addr=tuple(addr), key=key):
            try:
                results[key] = attack(addr, markers)
            except Exception as e:  # recorded, and fails the test
                results[key] = {"attack-failed": repr(e)}

        threads.append(threading.Thread(target=run))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    side = {f"{a[0]}:{a[1]}": try_connect(tuple(a)) for a in params["side"]}

    # Silent connections, held while the program opens connections of its own.
    silent = [
        socket.create_connection(tuple(a), timeout=5) for a in params["endpoints"]
    ]
    print(json.dumps({"event": "holding"}), flush=True)
    sys.stdin.readline()
    for s in silent:
        s.close()
    print(
        json.dumps(
            {
                "event": "result",
                "attacks": results,
                "side": side,
                "markers": sorted(os.listdir(markers)),
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    stackdump.install()  # where it hangs, if a test gives up on it
    main()
