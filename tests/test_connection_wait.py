"""``connection.wait`` and ``Connection.fileno()``: stdlib oracle and fiber_dask.

fiber-dask's Pipe ends have a readiness descriptor (see fiber_dask.connection):
exact in the process that owns the pipe, kept by a watcher thread in a holder.
"""

from __future__ import annotations

import multiprocessing.connection
import select
import socket

import pytest

import fiber_dask
import fiber_dask.connection

pytestmark = pytest.mark.timeout(90)


def wait_of(ctx):
    if isinstance(ctx, fiber_dask.DaskContext):
        return fiber_dask.connection.wait
    return multiprocessing.connection.wait


def test_wait_on_pipe_ends_in_their_owner(ctx):
    wait = wait_of(ctx)
    a, b = ctx.Pipe()
    assert wait([a, b], 0.2) == []
    assert wait([a], timeout=-1) == []
    b.send("x")
    assert wait([a, b], 10) == [a]
    fd = a.fileno()
    assert select.select([fd], [], [], 0)[0] == [fd]
    assert a.recv() == "x"
    assert wait([a], 0) == []
    assert select.select([fd], [], [], 0)[0] == []
    b.close()
    assert wait([a], 10) == [a]  # EOF is ready, as with the stdlib
    with pytest.raises(EOFError):
        a.recv()


def test_wait_mixes_pipe_ends_sockets_and_sentinels(ctx):
    wait = wait_of(ctx)
    a, b = ctx.Pipe()
    s1, s2 = socket.socketpair()
    p = ctx.Process(target=pow, args=(2, 3))
    p.start()
    p.join(60)
    ready = wait([a, s1, p.sentinel], 10)
    assert ready == [p.sentinel]
    s2.send(b"1")
    b.send(1)
    ready = wait([a, s1, p.sentinel], 10)
    assert set(map(id, ready)) == {id(a), id(s1), id(p.sentinel)}
    s1.close()
    s2.close()


def child_waits(conn, out, wait):
    out.send(("before", len(wait([conn], 0.3))))
    out.send(("ready", len(wait([conn], 30)), conn.recv()))
    out.send(("after", len(wait([conn], 0.3))))


def test_wait_in_a_holder_on_a_pipe_owned_elsewhere(ctx):
    # The child holds `a`, whose buffers live in this process: its wait()
    # works through the watcher thread.
    a, b = ctx.Pipe()
    r, w = ctx.Pipe(duplex=False)
    p = ctx.Process(target=child_waits, args=(a, w, wait_of(ctx)))
    p.start()
    assert r.recv() == ("before", 0)
    b.send("hello")
    assert r.recv() == ("ready", 1, "hello")
    assert r.recv() == ("after", 0)
    p.join(60)
    assert p.exitcode == 0


def test_connection_of_an_os_handle_is_the_stdlibs(ctx):
    module = (
        fiber_dask.connection
        if isinstance(ctx, fiber_dask.DaskContext)
        else multiprocessing.connection
    )
    s1, s2 = socket.socketpair()
    conn = module.Connection(s1.detach())
    assert isinstance(conn, multiprocessing.connection.Connection)
    conn.close()
    s2.close()
    with pytest.raises((ValueError, OSError)):
        module.Connection(-1)
