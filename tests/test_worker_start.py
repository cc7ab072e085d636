"""The embedded cluster's worker processes are forked from one preloaded server
(fiber_dask.backends.workerstart), and get what a spawned worker gets.

Each test runs a script in a fresh interpreter, as a user does, so that the
script's own embedded cluster (not the suite's) is the one under test.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import psutil
import pytest
from support.wait import wait_until

SERVER_MARK = "fiber_dask.backends.workerstart import serve"

PROBE = textwrap.dedent(
    """
    import json, os, sys, time
    import fiber_dask
    import fiber_dask.cluster
    {top}

    def info(dask_worker=None):
        import numpy as np
        import fiber_dask.engine.slots as slots
        return {{
            "pid": os.getpid(),
            "ppid": os.getppid(),
            "var": os.environ.get("FIBER_TEST_VAR"),
            "omp": os.environ.get("OMP_NUM_THREADS"),
            "seed": os.environ.get("PYTHONHASHSEED"),
            "draw": float(np.random.random()),
            "early": slots.started_early,
        }}

    def square(x):
        return x * x

    if __name__ == "__main__":
        os.environ["FIBER_TEST_VAR"] = "set-after-import"
        with fiber_dask.Pool(2) as pool:
            squares = pool.map(square, range(20))
            client = fiber_dask.cluster.get_handle().client
            workers = list(client.run(info).values())
            out = {{"owner": os.getpid(), "squares": squares, "workers": workers}}
            if "{kill}" == "worker":
                os.kill(workers[0]["pid"], 9)
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline:
                    try:  # a broadcast may still meet the dying worker
                        now = list(client.run(info).values())
                    except Exception:
                        now = []
                    if len(now) == 2 and workers[0]["pid"] not in [w["pid"] for w in now]:
                        break
                    time.sleep(0.05)
                out["after_kill"] = now
                out["squares_after_kill"] = pool.map(square, range(20))
            servers = []
            for p in __import__("psutil").Process().children():
                try:
                    if "{mark}" in " ".join(p.cmdline()):
                        servers.append(p.pid)
                except Exception:  # a zombie, or gone meanwhile
                    pass
            out["servers"] = servers
            if "{kill}" == "owner":
                print(json.dumps(out), flush=True)
                time.sleep(3600)
        fiber_dask.shutdown()
        out["servers_left"] = [p for p in servers if __import__("psutil").pid_exists(p)]
        print(json.dumps(out), flush=True)
    """
)


def run_probe(tmp_path, *, top="", kill="", env=None, args=(), timeout=120):
    script = tmp_path / "probe.py"
    script.write_text(PROBE.format(top=top, kill=kill, mark=SERVER_MARK))
    full_env = dict(os.environ, PYTHONPATH=os.getcwd(), **(env or {}))
    # The suite's own cluster settings must not leak into the script's.
    for k in list(full_env):
        if k.startswith("DASK_FIBER__") and k not in (env or {}):
            del full_env[k]
    proc = subprocess.run(
        [sys.executable, str(script), *args],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=timeout,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def parent_cmdline(pid_of_parent):
    return " ".join(psutil.Process(pid_of_parent).cmdline())


def test_workers_are_forks_of_the_server_and_get_a_spawned_workers_state(tmp_path):
    # The main module imports numpy's generator: the server has it seeded.
    out = run_probe(tmp_path, top="import numpy.random")
    assert out["squares"] == [x * x for x in range(20)]
    assert len(out["servers"]) == 1, out
    server = out["servers"][0]
    workers = out["workers"]
    assert len(workers) == 2
    for w in workers:
        assert w["ppid"] == server, (w, out)
        # The owner's environment when the nanny started it, Dask's
        # pre-spawn environment, and a slot template forked at the start.
        assert w["var"] == "set-after-import"
        assert w["omp"] == "1"
        assert w["seed"] == "6640"
        assert w["early"] is True
    # numpy's global generator is reseeded in each fork, as spawned workers
    # each had their own.
    assert workers[0]["draw"] != workers[1]["draw"]
    # Closing the cluster reaps the server.
    assert out["servers_left"] == []


def test_the_server_imports_the_main_module_as_a_spawned_child_does(tmp_path):
    # Its top level reads the script's arguments and imports a module next to
    # it: the server has the owner's argv, cwd and sys.path (else it would
    # decline and the workers would be spawned: their parent the owner).
    (tmp_path / "sibling.py").write_text("VALUE = 7\n")
    top = "import sibling\nMODE = sys.argv[1]\nassert sibling.VALUE == 7"
    out = run_probe(tmp_path, top=top, args=["fast"])
    assert len(out["servers"]) == 1, out
    assert {w["ppid"] for w in out["workers"]} == set(out["servers"]), out
    assert out["squares"] == [x * x for x in range(20)]


def test_a_killed_worker_is_restarted_from_the_server(tmp_path):
    out = run_probe(tmp_path, kill="worker")
    server = out["servers"][0]
    killed = out["workers"][0]["pid"]
    after = out["after_kill"]
    assert len(after) == 2 and killed not in [w["pid"] for w in after], out
    # The recovery ran: a new worker, forked from the same server.
    assert {w["ppid"] for w in after} == {server}
    assert out["squares_after_kill"] == [x * x for x in range(20)]
    assert out["servers_left"] == []


@pytest.mark.parametrize(
    "top, env",
    [
        ("", {"DASK_FIBER__LOCAL__WORKER_START": "spawn"}),
        # A main module that starts a thread as it is imported: forking the
        # server after that would lose the thread, so it declines and the
        # workers are spawned, each running the main module's top level.
        (
            "import threading\n"
            "threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()",
            {},
        ),
    ],
    ids=["configured-spawn", "main-starts-a-thread"],
)
def test_workers_are_spawned_when_the_server_is_off_or_declines(tmp_path, top, env):
    out = run_probe(tmp_path, top=top, env=env)
    assert out["squares"] == [x * x for x in range(20)]
    assert out["servers"] == [] or out["servers_left"] == []
    for w in out["workers"]:
        assert w["ppid"] == out["owner"], out  # spawned by the nanny itself
        assert w["var"] == "set-after-import"


def test_owner_sigkill_leaves_no_server_and_no_worker(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE.format(top="", kill="owner", mark=SERVER_MARK))
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    owner = subprocess.Popen(
        [sys.executable, str(script)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    try:
        line = owner.stdout.readline()  # the started marker: workers are up
        out = json.loads(line)
        pids = out["servers"] + [w["pid"] for w in out["workers"]]
        assert len(out["servers"]) == 1 and all(psutil.pid_exists(p) for p in pids)
        owner.send_signal(signal.SIGKILL)
        owner.wait(timeout=10)

        def gone():
            for p in pids:
                try:
                    if psutil.Process(p).status() != psutil.STATUS_ZOMBIE:
                        return False
                except psutil.NoSuchProcess:
                    pass
            return True

        wait_until(gone, timeout=30, what="the server and workers of a SIGKILLed owner")
    finally:
        owner.kill()
        owner.wait(timeout=10)
        owner.stdout.close()
