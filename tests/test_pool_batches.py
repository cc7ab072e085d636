"""Chunks travel in batches (issue 15's dispatch rate): the chunks one
dispatch pass hands a slot go in one ``Calls`` message and the slot answers
runs of them in one ``Results``.  What a batch must not change: a slot
SIGKILLed in the middle of one loses only that batch's unanswered chunks
(re-run, counted), and an item that kills its process is still named
exactly.  Real slot processes on a loopback cluster, real SIGKILLs after a
started marker."""

from __future__ import annotations

import functools
import os
import signal

import dask
import pytest
from distributed import Client
from support.clusters import loopback_cluster
from support.wait import wait_for_file
from tasks.poolcore import counted_square, executions, kill_self_on_7

import fiber_dask
from fiber_dask import WorkerLostError
from fiber_dask.engine import poolprotocol as proto

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def client():
    with loopback_cluster(2) as cluster, Client(cluster, set_as_default=False) as c:
        yield c


def test_a_batch_lost_to_a_sigkill_reruns_only_its_unanswered_chunks(client, tmp_path):
    d = str(tmp_path)
    victim = 150
    f = functools.partial(counted_square, directory=d, victims=(victim,))
    with fiber_dask.Pool(2, client=client) as pool:
        engine = pool._engine
        # Measured first (a short task), so that its chunks go in batches.
        assert pool.map(f, range(1000, 1100), chunksize=1) == [
            x * x for x in range(1000, 1100)
        ]
        sent_before = engine._calls_sent
        res = pool.map_async(f, range(300), chunksize=1)
        path = wait_for_file(os.path.join(d, f"started-{victim}"), timeout=120)
        with open(path) as fh:
            os.kill(int(fh.read()), signal.SIGKILL)
        assert res.get(timeout=150) == [x * x for x in range(300)]
        calls = engine._calls_sent - sent_before
        reruns = engine._stats.reruns
    assert calls < 300, "every chunk went in a message of its own"
    runs = {x: executions(d, x) for x in range(300)}
    again = sorted(x for x, n in runs.items() if n == 2)
    assert victim in again
    # Only chunks of the lost batch ran twice: the victim and those that had
    # finished before it without their answer sent yet (at most FLUSH_CHUNKS
    # are held); every other item ran exactly once.
    assert len(again) <= proto.FLUSH_CHUNKS, again
    assert all(x < victim for x in again if x != victim), again
    assert all(n == 1 for x, n in runs.items() if x not in again), {
        x: n for x, n in runs.items() if n != 1 and x not in again
    }
    assert reruns >= len(again)


def test_an_item_that_kills_its_process_in_a_batch_is_still_named(client):
    with dask.config.set({"fiber.pool.allowed-failures": 1}):
        with fiber_dask.Pool(2, client=client) as pool:
            engine = pool._engine
            # Measured first, so that item 7 travels in a batch with others.
            assert pool.map(kill_self_on_7, range(8, 60), chunksize=1) == list(
                range(8, 60)
            )
            res = pool.map_async(kill_self_on_7, range(60), chunksize=1)
            with pytest.raises(WorkerLostError) as info:
                res.get(timeout=150)
            # Item 7 was not alone in its Calls (the first pass hands each slot
            # every other chunk): its slot's loss sent the Calls' unanswered
            # chunks again, counted as re-runs (a loss of item 7 alone adds 1,
            # the last none).
            assert engine._stats.reruns >= 3, engine._stats.reruns
            message = str(info.value)
            # The batch it was in is re-run chunk by chunk, so the losses
            # that count name the item itself.
            assert "this item (index 7) killed every process it ran in" in message
            assert "2 worker processes died while it ran" in message
            # The pool still works (the slots are replaced).
            assert pool.map(kill_self_on_7, range(8, 20), chunksize=1) == list(
                range(8, 20)
            )
