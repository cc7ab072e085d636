"""Why a worker died: the ``cause`` a ``WorkerLostError`` carries (issue 31).

Real causes, each on a cluster of its own so the deaths do not disturb the
session's embedded cluster: a task over its Dask worker's memory limit in a
slot process (a LocalCluster, and the embedded cluster as a user runs it), a
segfault, ``os._exit(3)``, a SIGKILL of the slot process after its started
marker, a thread slot's task ending its Dask worker, and a worker host cut off
from the network (network namespaces, ``support/netns.py``).  A SLURM job
cancelled under a task is in ``test_slurm.py``, beside its SLURM.  Each test
counts the executions, so the re-runs before the error are proven too.
"""

from __future__ import annotations

import functools
import json
import os
import pickle
import signal
import subprocess
import sys
import textwrap

import dask
import pytest
from distributed import Client
from support import memcg
from support.clusters import loopback_cluster
from support.netns import DaskCluster, Network, unavailable
from support.wait import wait_for_file
from tasks.deaths import allocate, exit3, segfault, square, wait_to_be_killed
from tasks.poolcore import executions

import fiber_dask
from fiber_dask import WorkerLostError

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def client():
    with loopback_cluster(2) as cluster, Client(cluster, set_as_default=False) as c:
        yield c


def lost(client, func, allowed=1, **kwargs):
    """The WorkerLostError of ``func(**kwargs)`` in a 2-slot pool on
    ``client`` with ``allowed`` failures, the pool still working after it."""
    with dask.config.set({"fiber.pool.allowed-failures": allowed}):
        with fiber_dask.Pool(2, client=client) as pool:
            res = pool.apply_async(functools.partial(func, **kwargs))
            with pytest.raises(WorkerLostError) as info:
                res.get(timeout=90)
            assert pool.map(square, range(4)) == [0, 1, 4, 9]
    return info.value


def _scheduler_workers(dask_scheduler):
    return list(dask_scheduler.workers)


def workers(client):
    # The scheduler's own list now: the client's scheduler_info() is a copy it
    # refreshes every few seconds (a loaded CI run read an empty one).
    return set(client.run_on_scheduler(_scheduler_workers))


@pytest.mark.parametrize("relay", [False, True], ids=["direct", "relay"])
def test_segfault_is_a_signal(client, tmp_path, relay):
    """Also through the slot relay, whose worker process says ``Gone`` for the
    dead slot before its keeper knows why."""
    with dask.config.set({"fiber.pool.relay": relay}):
        err = lost(client, segfault, directory=str(tmp_path))
    assert err.cause == "signal"
    assert err.signal == signal.SIGSEGV and err.exitcode is None
    assert err.address in workers(client)
    message = str(err)
    assert "killed by SIGSEGV" in message
    assert "crash in native code" in message
    assert "fiber.pool.allowed-failures=1" in message
    assert executions(str(tmp_path), 0) == 2  # once, then the allowed re-run
    # Picklable with what it carries (it crosses processes, e.g. in futures).
    again = pickle.loads(pickle.dumps(err))
    assert (again.cause, again.signal, again.exitcode, again.address) == (
        "signal", signal.SIGSEGV, None, err.address,
    )  # fmt: skip
    assert str(again) == message
    assert isinstance(again, fiber_dask.ProcessError)


def test_os_exit_is_an_exit_with_its_code(client, tmp_path):
    err = lost(client, exit3, allowed=0, directory=str(tmp_path))
    assert (err.cause, err.exitcode, err.signal) == ("exit", 3, None)
    assert "exited with code 3" in str(err)
    assert "os._exit()" in str(err)
    assert executions(str(tmp_path), 0) == 1


def test_sigkill_of_the_slot_process_is_a_signal(client, tmp_path):
    d = str(tmp_path)
    with dask.config.set({"fiber.pool.allowed-failures": 0}):
        with fiber_dask.Pool(2, client=client) as pool:
            res = pool.apply_async(wait_to_be_killed, (d,))
            with open(wait_for_file(os.path.join(d, "started-0"), timeout=60)) as f:
                pid = int(f.read())
            os.kill(pid, signal.SIGKILL)
            with pytest.raises(WorkerLostError) as info:
                res.get(timeout=90)
    err = info.value
    assert (err.cause, err.signal) == ("signal", signal.SIGKILL)
    assert f"killed by SIGKILL (pid {pid})" in str(err)
    assert executions(d, 0) == 1


def test_task_over_the_workers_memory_limit_is_ended_for_memory(tmp_path):
    """Today's gap: a slot process's memory did not count, and a task that
    allocates 1 GB under a 400 MB limit ran to completion."""
    d = str(tmp_path)
    with loopback_cluster(2, memory_limit="400MB") as cluster, Client(
        cluster, set_as_default=False
    ) as c:
        err = lost(c, allocate, directory=d)
        assert err.cause == "memory"
        assert err.signal == signal.SIGKILL  # as the nanny ends its worker
        assert err.address in workers(c)
        message = str(err)
        assert "over distributed.worker.memory.terminate=0.95" in message
        assert "memory limit of 381 MiB" in message  # 400 MB
        assert "fiber.local.memory-limit" in message
        assert executions(d, 0) == 2
        # The Dask workers themselves were not harmed.
        assert len(workers(c)) == 2


@pytest.mark.skipif(memcg.unavailable() is not None, reason=f"{memcg.unavailable()}")
def test_the_kernels_oom_killer_is_a_memory_cause(client, tmp_path):
    """A slot process the kernel's OOM killer kills: its Dask workers are
    moved into a memory cgroup of 400 MB (what they fork next is born in it),
    far under the workers' own memory limit, so the kernel acts, not Dask's
    rule.  Told apart by the cgroup's OOM-kill count."""
    d = str(tmp_path)
    with memcg.memory_cgroup(400 * 2**20) as cg:
        for pid in client.run(os.getpid).values():
            cg.add_tree(pid)
        before = cg.oom_kills()
        err = lost(client, allocate, directory=d)
        assert cg.oom_kills() >= before + 2  # the kernel's doing, twice
    assert (err.cause, err.signal) == ("memory", signal.SIGKILL)
    assert err.address in workers(client)
    message = str(err)
    assert "killed by the kernel's OOM killer" in message, message
    assert "Give the workers more memory" in message, message
    # Once, then the allowed re-run.  (Three runs were seen once in ~50 here:
    # one loss not counted against the item, a question for the pool's loss
    # accounting, not for the cause, which this test is about.)
    assert executions(d, 0) in (2, 3)


PROGRAM = """
import fiber_dask as multiprocessing
from tasks.deaths import allocate

if __name__ == "__main__":
    with multiprocessing.Pool(2) as pool:
        try:
            pool.apply(allocate, ({d!r},))
        except multiprocessing.WorkerLostError as e:
            print("CAUSE", e.cause, e.signal.name)
            print(e)
            print("ADDRESS", e.address)
        else:
            print("CAUSE none")
"""


def test_embedded_cluster_applies_fiber_local_memory_limit(tmp_path):
    """As a user runs it: ``fiber.local.memory-limit`` on the embedded
    cluster, the first pool (whose first slots start with the cluster)."""
    d = tmp_path / "runs"
    d.mkdir()
    script = tmp_path / "prog.py"
    script.write_text(textwrap.dedent(PROGRAM.format(d=str(d))))
    env = dict(os.environ)
    env["DASK_FIBER__LOCAL__MEMORY_LIMIT"] = "400MB"
    env["DASK_FIBER__LOCAL__N_WORKERS"] = "2"
    env["DASK_FIBER__POOL__ALLOWED_FAILURES"] = "1"
    tests = os.path.dirname(os.path.abspath(__file__))
    env["PYTHONPATH"] = os.pathsep.join(
        [tests, *filter(None, [env.get("PYTHONPATH")])]
    )
    out = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True,
        timeout=100,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "CAUSE memory SIGKILL" in out.stdout, out.stdout + out.stderr
    assert "fiber.local.memory-limit" in out.stdout
    # Twice as allowed, or three times when its first run was in an early
    # slot already handed over to the cluster's loop (a retiring slot's
    # loss is not counted against the item).
    assert executions(str(d), 0) in (2, 3)


PEER_TIMEOUT = 4  # seconds: fiber.peer-timeout of the host-cut test's processes


@pytest.mark.skipif(unavailable() is not None, reason=f"netns: {unavailable()}")
def test_host_cut_off_is_a_lost_host(tmp_path):
    """A worker host whose cable is pulled (network namespaces, support/netns)
    while the pool's only slot runs a task there: ``cause="host"``."""
    timeouts = {"DASK_FIBER__PEER_TIMEOUT": f"{PEER_TIMEOUT}s"}
    with Network(tmp_path / "net") as net:
        cluster = DaskCluster(net, net.add_host("sched", number=1))
        doomed = net.add_host("h1", number=11)
        cluster.add_worker(doomed, resources={"h1": 1}, env=timeouts)
        client = net.add_host("client", number=100)
        marker = str(tmp_path / "started")
        script = client.python(
            "crosshost_client.py",
            "cause_cut",
            json.dumps({"host": "h1", "marker": marker}),
            env=cluster.client_env(
                {**timeouts, "DASK_FIBER__POOL__ALLOWED_FAILURES": "0"}
            ),
        )
        script.expect("cut-now", timeout=120)
        doomed.cut()
        script.send("cut")
        r = script.expect("result", timeout=120)
        script.wait()
        assert r["cause"] == "host", r
        assert doomed.ip in r["address"], r
        assert r["signal"] is None, r
        assert f"stopped answering for fiber.peer-timeout={PEER_TIMEOUT}s" in (
            r["message"]
        ), r
        assert "Check the worker's host, its network" in r["message"], r
        # Found by the connection's keep-alive, within the timeout.
        assert r["after_cut"] < PEER_TIMEOUT + 5, r


def test_thread_slot_task_that_ends_its_worker_is_a_lost_worker(client, tmp_path):
    """With ``fiber.pool.slots: thread`` the task ends the Dask worker process
    itself: the scheduler's reason for removing it is all that is known."""
    with dask.config.set({"fiber.pool.slots": "thread"}):
        err = lost(client, exit3, allowed=0, directory=str(tmp_path))
    assert err.cause == "host", str(err)
    assert err.address is not None and err.address in str(err)
    assert "Check the worker's host" in str(err)
    assert executions(str(tmp_path), 0) == 1
