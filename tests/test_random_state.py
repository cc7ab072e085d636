"""A seeded program draws the stdlib's numbers (issue 28, item 2).

The oracle: the same program (``support/seeded_program.py``) under the
stdlib's ``multiprocessing`` and under fiber-dask, each in a fresh interpreter
that starts its own embedded cluster, as a user's script does; the numbers it
draws from ``random`` and ``numpy.random`` between its operations must be the
same.  fiber-dask's own code and Dask's (the embedded scheduler and nannies
run in the program's process) draw from :mod:`fiber_dask.transparency.privaterandom`'s
generator instead of the program's.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import uuid

import numpy as np
import pytest
from support.processes import processes_with
from support.wait import wait_until

from fiber_dask.transparency import privaterandom

HERE = os.path.dirname(os.path.abspath(__file__))
PROGRAM = os.path.join(HERE, "support", "seeded_program.py")

pytestmark = pytest.mark.timeout(240)


def _processes_with(marker: str) -> list:
    return processes_with("FIBER_RANDOM_TEST_MARKER", marker)


def run(mode: str, scenario: str, **env: str) -> dict:
    """Run the program (``std`` or ``fiber``) on the embedded cluster of 2
    workers; its JSON result.  Nothing it started may outlive it."""
    marker = uuid.uuid4().hex
    environ = {k: v for k, v in os.environ.items() if k != "DASK_SCHEDULER_ADDRESS"}
    environ.update(
        DASK_FIBER__LOCAL__N_WORKERS="2", FIBER_RANDOM_TEST_MARKER=marker, **env
    )
    proc = subprocess.run(
        [sys.executable, PROGRAM, mode, scenario],
        capture_output=True,
        text=True,
        timeout=180,
        env=environ,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    try:
        wait_until(
            lambda: not _processes_with(marker),
            timeout=15,
            what="every process the program started to end with it",
        )
    finally:
        for p in _processes_with(marker):
            p.kill()
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.fixture(scope="module")
def owner() -> dict:
    return {mode: run(mode, "owner") for mode in ("std", "fiber")}


@pytest.fixture(scope="module")
def clients() -> dict:
    return {mode: run(mode, "clients") for mode in ("std", "fiber")}


def test_streams_around_a_pool_opened_after_seeding(owner):
    """The issue's program: seed, then Pool (the cluster starts there), map,
    imap, apply_async, close."""
    assert owner["fiber"]["pool_after_seed"] == owner["std"]["pool_after_seed"]


def test_a_pool_opened_before_seeding_draws_nothing_while_idle(owner):
    """Seeded with a pool already open; the draws after several Dask
    heartbeats and pool reports have reached the in-process scheduler."""
    assert owner["fiber"]["pool_before_seed"] == owner["std"]["pool_before_seed"]


def test_streams_around_processes_queues_managers_and_the_executor(owner):
    """A Process feeding a Queue, a Manager's dict, the executor, with a pool
    open meanwhile, and its close and join."""
    fiber = owner["fiber"]["processes_queues_managers"]
    assert fiber == owner["std"]["processes_queues_managers"]
    assert fiber["process"] == [0, 5]


def test_every_loaded_module_binding_the_global_random_is_accounted_for(owner):
    """A module of Dask's (or its dependencies') that binds the program's
    generator is either rebound or left alone for a stated reason: a new
    drawer in a newer Dask fails here instead of silently moving the streams."""
    found = set(owner["fiber"]["bind_global_random"])
    found.discard(
        "fiber_dask.transparency.privaterandom"
    )  # holds `random` to make its own
    unknown = found - set(privaterandom.LEFT_ALONE)
    assert not unknown, f"modules drawing from the program's generator: {unknown}"


def test_deap_ea_simple_gives_the_stdlib_results(clients):
    """deap's eaSimple with ``toolbox.map = pool.map``, seeded (its selection,
    crossover and mutation draw from ``random`` between the pool's maps)."""
    fiber, std = clients["fiber"]["deap"], clients["std"]["deap"]
    assert fiber == std
    assert std["evaluations"][0] == 60  # the generations did go through the pool


def test_emcee_ensemble_sampler_gives_the_stdlib_results(clients):
    """emcee's EnsembleSampler(pool=pool), seeded, then a bootstrap of its
    chain with ``random``: the same chain and the same bootstrap."""
    assert clients["fiber"]["emcee"] == clients["std"]["emcee"]


@pytest.mark.parametrize("slots", ["process", "thread"])
def test_a_seeded_slot_draws_its_seeded_stream(slots):
    """An initializer seeds each pool worker; its tasks then draw exactly that
    seed's stream, one number after the other: nothing fiber-dask or Dask runs
    in a slot's process between tasks draws (as in the stdlib's workers).
    With thread slots the tasks share their process with a Dask worker, whose
    own draws (``dask.sizeof`` of each message it writes) are private."""
    ref = random.Random(7)
    ref_np = np.random.RandomState(7)
    expected = [[ref.random(), float(ref_np.random_sample())] for _ in range(40)]
    for mode in ("std", "fiber"):
        result = run(mode, "slots", DASK_FIBER__POOL__SLOTS=slots)
        streams = result["streams"]
        assert sum(len(s) for s in streams) == 40, (mode, streams)
        for stream in streams:
            assert [ran for ran, *_ in stream] == list(range(1, len(stream) + 1))
            assert [draws for _, *draws in stream] == expected[: len(stream)], mode
    if slots == "thread":
        assert result["dask_draws_privately"] is True


CHECK = r"""
import asyncio, random, sys
order = sys.argv[1]

def import_distributed():
    import dask.sizeof, distributed
    import distributed.comm.core, distributed.protocol.compression
    import distributed.scheduler, distributed.utils_comm, distributed.worker

if order == "dask-first":
    import_distributed()
from fiber_dask.transparency import privaterandom
privaterandom.DASK_DRAWERS += ("dask.no_such_module",)
privaterandom.isolate_dask()
if order == "fiber-first":
    import_distributed()

import inspect
import dask.sizeof, distributed.comm.core, distributed.scheduler, distributed.utils_comm
from distributed.protocol.compression import maybe_compress

random.seed(3)
before = random.getstate()
dask.sizeof.sizeof(list(range(100)))
dask.sizeof.sizeof({i: str(i) for i in range(100)})
maybe_compress(bytes(range(256)) * 100, compression="zlib")

async def refused():
    try:
        await distributed.comm.core.connect("tcp://127.0.0.1:9", timeout=0.5)
    except OSError:
        pass

async def failing():
    raise OSError("no")

async def retried():
    try:
        await distributed.utils_comm.retry(
            failing, count=2, delay_min=0.001, delay_max=0.001)
    except OSError:
        pass

asyncio.run(refused())
asyncio.run(retried())
assert random.getstate() == before, "Dask drew from the program's generator"
for name in ("distributed.scheduler", "distributed.worker"):
    assert privaterandom.is_private(sys.modules[name].random), name
# The modules keep their own loader (inspect, importlib.resources, reload).
assert type(distributed.scheduler.__loader__).__name__ == "SourceFileLoader"
assert "class Scheduler" in inspect.getsource(distributed.scheduler)
try:
    import dask.no_such_module
except ModuleNotFoundError:
    pass
print("ok")
"""


@pytest.mark.parametrize("order", ["fiber-first", "dask-first"])
def test_dask_draws_from_a_private_generator_whichever_is_imported_first(order):
    """Each draw site of the rebound modules (sizeof of long lists and dicts,
    a compression sample, connect's backoff, a retried operation) leaves the
    program's ``random`` state alone, whether distributed was imported before
    fiber-dask isolated it or after; a watched module that does not exist is
    no error."""
    proc = subprocess.run(
        [sys.executable, "-c", CHECK, order],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]
