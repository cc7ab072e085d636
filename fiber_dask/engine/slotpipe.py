"""The frames on the pipes between a keeper and its slot template: pickled
tuples with a 4-byte big-endian length prefix, on a private pipe between a
process and its own child, never a network socket.  What the tuples say is
:mod:`fiber_dask.engine.templateprotocol`.  Used by both ends
(:mod:`fiber_dask.engine.slots`, :mod:`fiber_dask.engine.slotserver`).
"""

from __future__ import annotations

import os
import pickle
import struct

__all__ = ["write_frame", "FrameReader"]

_HEADER = struct.Struct("!I")


def write_frame(fd: int, msg: tuple) -> None:
    """Write one message to ``fd`` (blocking until all of it is written)."""
    data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
    view = memoryview(_HEADER.pack(len(data)) + data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


class FrameReader:
    """Split the bytes read from a pipe into messages."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.buf = bytearray()

    def read(self) -> list[tuple] | None:
        """Read what is available (one ``os.read``); None at EOF."""
        data = os.read(self.fd, 1 << 16)
        if not data:
            return None
        self.buf += data
        out = []
        while len(self.buf) >= _HEADER.size:
            (size,) = _HEADER.unpack_from(self.buf)
            if len(self.buf) < _HEADER.size + size:
                break
            out.append(
                pickle.loads(bytes(self.buf[_HEADER.size : _HEADER.size + size]))
            )
            del self.buf[: _HEADER.size + size]
        return out
