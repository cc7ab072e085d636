"""A collective of plain sockets for Ring tests: what torch.distributed's gloo
does, in 60 lines, with no dependency.

``connect(ring)`` is a Ring initializer: the member listens on its own
``ring.members[rank]`` address and port, connects to the next rank and accepts
the previous one.  :class:`AllReduce` is a Ring's ``func``: a ring all-reduce
(sum) of the ranks, so that with 4 members every member ends with 0+1+2+3 = 6.
Like a real collective, a member waits for its neighbour with no timeout: if
the neighbour dies, only the ring's parent can end the wait.

Marker files in ``directory`` let a test see inside the members:
``exec-<rank>-<pid>`` when a member has joined the collective (its execution,
counted), holding ``<ip> <port>``.  Misbehaviour on request: ``raise_rank``
raises ``ValueError`` there (after its marker), ``hang_rank`` joins and then
never sends (a test kills it after its marker), ``die_once_rank`` SIGKILLs
itself mid-collective the first time it runs (once every member has joined;
``died-once`` remembers).
"""

from __future__ import annotations

import glob
import os
import signal
import socket
import struct
import threading
import time

_links: dict = {}  # this member's sockets ("next", "prev") and ("me") address


def connect(ring, timeout: float = 60.0) -> None:
    me = ring.members[ring.rank]
    nxt = ring.members[(ring.rank + 1) % ring.size]
    listener = socket.create_server((me.ip, me.port))
    _links["me"] = (me.ip, me.port)
    deadline = time.monotonic() + timeout
    while True:  # the next member may not listen yet
        try:
            _links["next"] = socket.create_connection((nxt.ip, nxt.port), timeout=5)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)
    _links["next"].settimeout(None)
    _links["prev"], _ = listener.accept()
    listener.close()


def _send(value: int) -> None:
    _links["next"].sendall(struct.pack("!q", value))


def _recv() -> int:
    data = b""
    while len(data) < 8:
        chunk = _links["prev"].recv(8 - len(data))
        if not chunk:
            raise ConnectionError("the previous member closed the connection")
        data += chunk
    return struct.unpack("!q", data)[0]


class AllReduce:
    """``func(rank, size)``: sum the ranks around the ring; returns the sum."""

    def __init__(
        self,
        directory: str,
        *,
        raise_rank: int | None = None,
        hang_rank: int | None = None,
        die_once_rank: int | None = None,
    ) -> None:
        self.directory = directory
        self.raise_rank = raise_rank
        self.hang_rank = hang_rank
        self.die_once_rank = die_once_rank

    def __call__(self, rank: int, size: int) -> int:
        me = _links["me"]
        with open(os.path.join(self.directory, f"exec-{rank}-{os.getpid()}"), "w") as f:
            f.write(f"{me[0]} {me[1]}")
        if rank == self.raise_rank:
            raise ValueError(f"rank {rank} refuses to reduce")
        if rank == self.hang_rank:
            threading.Event().wait()  # joined, never sends: the others wait
        if rank == self.die_once_rank:
            once = os.path.join(self.directory, "died-once")
            if not os.path.exists(once):
                open(once, "w").close()
                while len(glob.glob(os.path.join(self.directory, "exec-*"))) < size:
                    time.sleep(0.01)  # every member is in the collective
                os.kill(os.getpid(), signal.SIGKILL)
        total = value = rank
        for _ in range(size - 1):
            _send(value)
            value = _recv()
            total += value
        return total
