"""Chunking by measurement (issue 15): a map whose caller gives no chunksize
is cut into chunks sized from the function's measured duration and the
pool's slots.  The results and their order are the stdlib's; the chunk
counts prove the sizes adapt (counted, never timed)."""

from __future__ import annotations

import functools
import os
import signal
import time

import pytest
from distributed import Client
from support.clusters import loopback_cluster
from support.wait import wait_for_file
from tasks.poolcore import counted_square, executions

import fiber_dask
from fiber_dask.engine.poolresults import measured_chunksize

pytestmark = pytest.mark.timeout(180)


def triple(x):
    return 3 * x


def add(a, b):
    return a + b


def nap(x):
    time.sleep(0.1)
    return -x


def test_the_rule():
    # Unmeasured: the stdlib's rule, ceil(total / (4 x slots)), no more than
    # is left; one item when the map's length is not known.
    assert measured_chunksize(None, 2, 200, 200) == 25
    assert measured_chunksize(None, 2, 10, 200) == 10
    assert measured_chunksize(None, 1024, 2048, 2048) == 1
    assert measured_chunksize(None, 1024, 10**6) == 1
    assert measured_chunksize(0.01, 1024, 10**6) == 410  # ~4 s chunks (4 ms a slot)
    assert measured_chunksize(0.01, 256, 10**6) == 103  # ~1 s
    # Long tasks, a few per slot: one item per chunk (half a slot's share
    # once fewer than 16 items per slot are left), so results come back as
    # each task ends.
    assert measured_chunksize(0.2, 1024, 2048) == 1
    assert measured_chunksize(0.2, 512, 2048) == 2
    assert measured_chunksize(1e-6, 2, 10**6) == 50000  # 50 ms at least
    # Never more than what is left / slots (OpenMP's guided rule), with 16
    # items or more per slot left...
    assert measured_chunksize(1e-4, 2, 1000) == 500
    assert measured_chunksize(1e-4, 2, 100) == 50
    # ... unless they would last under TAIL_SECONDS (1 ms): 10 items of 0.1 ms.
    assert measured_chunksize(1e-4, 2, 20) == 10
    assert measured_chunksize(1e-6, 2, 100) == 100  # never more than is left
    assert measured_chunksize(1e-6, 2, 1) == 1
    # 20,000 trivial tasks on 2 slots: two chunks (the stdlib's rule cuts 8).
    assert measured_chunksize(1e-7, 2, 20000) == 10000
    assert measured_chunksize(1e-7, 2, 10000) == 10000
    # The tail shrinks no further than 1/(8 x slots) of the whole map: at
    # 1024 slots, 102,400 items of 10 ms end in chunks of 13, not of 1
    # (~8 chunks per slot beyond the first ones, not ~8,000 in all).
    assert measured_chunksize(0.01, 1024, 2000) == 1
    assert measured_chunksize(0.01, 1024, 2000, 102400) == 13
    assert measured_chunksize(0.01, 1024, 10, 102400) == 10  # what is left
    # ... a floor, not a target: still no more than a chunk's usual length.
    assert measured_chunksize(0.01, 1024, 2000, 10**7) == 410
    # Small maps on big pools keep one item per chunk.
    assert measured_chunksize(0.01, 1024, 1024, 1024) == 1
    # On 2 slots the 50 ms minimum stays the rule (200 items of 10 ms: 5).
    assert measured_chunksize(0.01, 2, 200, 200) == 5
    assert measured_chunksize(0.01, 2, 3, 200) == 3
    # Once what an item weighs pickled is known, a chunk holds at most
    # CHUNK_BYTES of it (or one item), measured or not.
    assert measured_chunksize(1e-3, 2, 100, 100, item_bytes=3e6) == 1
    assert measured_chunksize(None, 2, 100, 100, item_bytes=3e6) == 1
    assert measured_chunksize(1e-3, 2, 100, 100, item_bytes=2**20) == 4
    assert measured_chunksize(1e-6, 2, 10**6, 10**6, item_bytes=30) == 50000


def test_map_without_chunksize_equals_the_stdlib(ctx):
    items = list(range(3001))
    with ctx.Pool(2) as pool:
        assert pool.map(triple, items) == [3 * x for x in items]
        pairs = [(x, -2 * x) for x in items]
        assert pool.starmap(add, pairs) == [-x for x in items]
        assert pool.map_async(triple, items).get(timeout=120) == [3 * x for x in items]
        assert pool.map(triple, []) == []
        assert pool.map(triple, [5]) == [15]


def test_chunks_adapt_to_the_task_duration(fiber_ctx):
    with fiber_ctx.Pool(2) as pool:
        fast = pool.map_async(triple, range(20000))
        assert fast.get(timeout=120) == [3 * x for x in range(20000)]
        # Item by item would be 20000 chunks.  Measured: the stdlib's 2500
        # items for each slot until the first result, then chunks of up to
        # 50 ms of work that shrink toward the end, down to 1 ms.  Where
        # the first result measures triple under 57 ns an item, the 17,500
        # left last under TAIL_SECONDS and go as one chunk: two in all (CI
        # on 4575366 measured that; the rule's own case is in test_the_rule).
        assert 2 <= fast._chunk_index < 2000, fast._chunk_index
        slow = pool.map_async(nap, range(24))
        assert slow.get(timeout=120) == [-x for x in range(24)]
        # 0.1 s a task is longer than a chunk's 50 ms: after the stdlib's
        # first chunk of 3 for each slot that asked before a result came back
        # (one or both, as their starts fall), one item per chunk, where the
        # stdlib rule sends 8 chunks of 3.  A third chunk of 3, cut while no
        # slot had room, is given back and cut again by measurement (kept, it
        # made 3 + 15 = 18 chunks).
        assert slow._chunk_index in (2 + 18, 1 + 21), slow._chunk_index


def test_a_given_chunksize_keeps_the_stdlib_rule(fiber_ctx):
    with fiber_ctx.Pool(2) as pool:
        res = pool.map_async(triple, range(100), chunksize=7)
        assert res.get(timeout=120) == [3 * x for x in range(100)]
        assert res._chunk_index == 15  # ceil(100 / 7)


def test_measured_chunks_rerun_after_a_sigkill(tmp_path):
    """A slot process SIGKILLed while it runs a chunk cut by measurement:
    every result is right and the killed item ran again (counted)."""
    d = str(tmp_path)
    victim = 1500
    with loopback_cluster(2) as cluster, Client(cluster, set_as_default=False) as c:
        with fiber_dask.Pool(2, client=c) as pool:
            res = pool.map_async(
                functools.partial(counted_square, directory=d, victims=(victim,)),
                range(3000),
            )
            path = wait_for_file(os.path.join(d, f"started-{victim}"), timeout=90)
            with open(path) as f:
                os.kill(int(f.read()), signal.SIGKILL)
            assert res.get(timeout=150) == [x * x for x in range(3000)]
            assert res._chunk_index < 3000  # chunks of several items were sent
    assert executions(d, victim) == 2
    assert all(executions(d, x) >= 1 for x in range(0, 3000, 97))
