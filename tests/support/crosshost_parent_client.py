"""The user's side of tests/test_crosshost_parent.py: run on the client host.

``python crosshost_parent_client.py '<json params>'``: a child Process on one
worker host starts a grandchild on another; the child is killed and the
grandchild reports what ``parent_process()`` shows, over a Queue of this
script.  One JSON line per observation (``{"event": ...}``), as
``crosshost_client.py`` prints them; remote functions are defined here, in
``__main__``, and travel by value with cloudpickle.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import socket
import struct
import sys
import time
import traceback

import fiber_dask as multiprocessing
from fiber_dask.connection import wait

from support import stackdump


def emit(event: str, **data) -> None:
    print(json.dumps({"event": event, **data}, default=repr), flush=True)


def host_ip(dev: str = "eth0") -> str:
    """This host's address on the Dask network, read from its interface."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", dev.encode()))
    return socket.inet_ntoa(packed[20:24])


def child(q, grandchild_host):
    """On the first worker host: start the grandchild on the other, then
    wait to be killed."""
    q.put(("child", host_ip(), os.getpid()))
    p = multiprocessing.Process(
        target=grandchild, args=(q,), resources={grandchild_host: 1}
    )
    p.start()
    time.sleep(300)


def grandchild(q):
    parent = multiprocessing.parent_process()
    q.put(("grandchild", host_ip(), parent.pid, parent.is_alive()))
    ready = wait([parent.sentinel], timeout=120)
    q.put(("sentinel", bool(ready), parent.is_alive(), host_ip()))


def main() -> dict:
    params = json.loads(sys.argv[1])
    q = multiprocessing.Queue()
    p = multiprocessing.Process(
        target=child,
        args=(q, params["grandchild_host"]),
        resources={params["child_host"]: 1},
    )
    p.start()
    out = {}
    for _ in range(2):
        msg = q.get(timeout=90)
        out[msg[0]] = list(msg[1:])
    emit("started", **out)
    p.kill()
    p.join(30)
    out["child_exitcode"] = p.exitcode
    killed = time.monotonic()
    msg = q.get(timeout=60)
    out[msg[0]] = list(msg[1:])
    out["seen_after"] = round(time.monotonic() - killed, 2)
    return out


if __name__ == "__main__":
    stackdump.install()  # where it hangs, if a test gives up on it
    signal.signal(signal.SIGTERM, lambda *a: os._exit(1))
    try:
        result = main()
    except BaseException:
        emit("error", traceback=traceback.format_exc())
        raise SystemExit(1) from None
    emit("result", **result)
