"""The first pool's early slots (issue 30, item 3: the cold start).

A program's first ``Pool()`` on the embedded cluster starts its slot processes
from the worker fork server while the cluster starts
(:mod:`fiber_dask.engine.earlyslots`), and hands each slot position over to the
cluster's own loop once that attaches.  Each test runs
``support/early_program.py`` in a fresh interpreter, as a user's script runs
(only the first pool of a process with no cluster starts this way), and checks
what it reports and that nothing it started outlives it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import pytest
from support.processes import processes_with, running
from support.wait import wait_until

HERE = os.path.dirname(os.path.abspath(__file__))
PROGRAM = os.path.join(HERE, "support", "early_program.py")

pytestmark = pytest.mark.timeout(240)


def _processes_with(marker: str) -> list:
    return processes_with("FIBER_EARLY_TEST_MARKER", marker)


def run(scenario: str, tmp_path, **env: str) -> tuple[dict, str]:
    """Run a scenario on a 2-worker embedded cluster; its JSON result and its
    stderr.  Every process it started must end with it."""
    marker = uuid.uuid4().hex
    environ = {
        k: v
        for k, v in os.environ.items()
        if k != "DASK_SCHEDULER_ADDRESS" and not k.startswith("DASK_FIBER__")
    }
    environ.update(
        DASK_FIBER__LOCAL__N_WORKERS="2", FIBER_EARLY_TEST_MARKER=marker, **env
    )
    marks = tmp_path / "marks"
    marks.mkdir()
    proc = subprocess.run(
        [sys.executable, PROGRAM, scenario, str(marks)],
        capture_output=True,
        text=True,
        timeout=200,
        env=environ,
        cwd=str(tmp_path),
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
    return json.loads(proc.stdout.splitlines()[-1]), proc.stderr


def test_the_first_results_come_from_early_slots_then_the_cluster_takes_over(
    tmp_path,
) -> None:
    out, stderr = run("handover", tmp_path)
    # The first result: an early slot (no Dask worker hosts it), while the
    # cluster started; Pool._pool listed the early slot processes.
    assert out["first"][0] == 10**12
    assert out["first"][1] is None
    assert None not in out["pids_early"] and len(set(out["pids_early"])) == 2
    assert out["first"][2] in out["pids_early"]
    # Then maps until one ran wholly on the cluster's slots: every position
    # handed over, and no result of the last map from an early slot.
    maps = out["maps"]
    assert all(where is not None for where, _ in maps[-1])
    assert {pid for _, pid in maps[-1]}.isdisjoint(out["pids_early"])
    assert len({pid for _, pid in maps[-1]}) == 2  # both positions
    # Every item ran exactly once, across the hand-over.
    assert out["counts"] == [1] and out["counted"] == out["items"]
    # The early slot processes ended with the hand-over.
    for pid in out["pids_early"]:
        assert not running(pid)
    assert "Traceback" not in stderr, stderr[-3000:]


def test_an_early_slot_killed_mid_task_costs_a_rerun(tmp_path) -> None:
    out, stderr = run("kill", tmp_path)
    victim = out["victim"]
    assert victim["where"] is None, "item 0 did not run in an early slot"
    assert out["results"] == [x * x for x in range(40)]
    # Item 0 ran twice (the killed run and its re-run), every other item once.
    assert out["counts"]["0"] == 2
    assert all(n == 1 for item, n in out["counts"].items() if item != "0")
    assert sorted(int(i) for i in out["counts"]) == list(range(40))
    assert "an early slot" in stderr and str(victim["pid"]) in stderr


def test_a_task_in_an_early_slot_attaches_nested_objects_to_the_same_cluster(
    tmp_path,
) -> None:
    out, _ = run("nested", tmp_path)
    got, address, where = out["got"]
    assert where is None, "the task did not run in an early slot"
    assert got == "through a nested queue"
    # The port picked before the scheduler started is the one it listens on.
    assert address == out["scheduler"]


def test_a_program_that_ends_while_the_cluster_starts_leaves_nothing(
    tmp_path,
) -> None:
    out, stderr = run("exit", tmp_path)
    assert out["results"] == [x * x for x in range(10)]
    # Nothing printed on the way out: no warning, no traceback from the
    # cluster's start given up or waited for.
    assert stderr.strip() == "", stderr[-3000:]


def test_what_starts_while_the_cluster_does_waits_for_it(tmp_path) -> None:
    out, _ = run("others_wait", tmp_path)
    assert out["a"] == [9, None]  # the first pool: an early slot
    # A second pool does not start early slots: it waits for the cluster.
    assert out["b"][0] == 16 and out["b"][1] is not None
    assert out["c"] == "from a process" and out["exitcode"] == 0
    assert out["results"] == [x * x for x in range(20)]


def test_the_schedulers_port_is_held_from_when_it_is_picked(tmp_path) -> None:
    # The port is picked before the scheduler starts (early slots are told
    # where to attach); until it listens there, no other socket may take it.
    out, _ = run("port_taken", tmp_path)
    assert out["before_up"], "the cluster was up before the program looked"
    assert out["refused"] == "EADDRINUSE", out
    assert out["scheduler"] == f"tcp://127.0.0.1:{out['port']}"
    assert out["maps"] >= 1


def test_early_slots_off_by_config_waits_for_the_cluster(tmp_path) -> None:
    out, _ = run("exit", tmp_path, DASK_FIBER__LOCAL__EARLY_SLOTS="false")
    assert out["results"] == [x * x for x in range(10)]
    assert None not in out["where"], "a task ran before the cluster was up"


def test_a_task_sees_the_same_process_in_an_early_slot_as_in_the_clusters(
    tmp_path,
) -> None:
    out, _ = run("looks", tmp_path)
    early, later = out["early"], out["later"]
    assert early.pop("where") is None and later.pop("where") is not None
    # What only a Dask worker can give: its local directory on the import
    # path (for Client.upload_file) and its nanny's pid for its own children.
    later["path"] = [p for p in later["path"] if "dask-scratch-space" not in p]
    assert "__DASK_PARENT_PID" in later["env"]
    for looked in (early, later):  # (the suite's own clusters may have set it)
        looked["env"] = [k for k in looked["env"] if k != "__DASK_PARENT_PID"]
    assert "OMP_NUM_THREADS" in early["env"]  # the nanny's variables
    # numpy is imported ahead in a Dask worker's template; in the early one
    # only if the program has imported it (this one has not): a task that
    # imports it gets the same module, seeded per process, a little later.
    assert early.pop("numpy imported") is False
    later.pop("numpy imported")
    env = set(early.pop("env")) ^ set(later.pop("env"))
    assert not env, f"variables in one environment only: {sorted(env)}"
    assert early == later


def test_an_owner_killed_while_early_slots_run_leaves_nothing(tmp_path) -> None:
    """SIGKILL of the program while a task runs in an early slot, the cluster
    still starting or just up: the early template, its slots, the worker fork
    server and anything the cluster started end with it."""
    marker = uuid.uuid4().hex
    environ = {
        k: v
        for k, v in os.environ.items()
        if k != "DASK_SCHEDULER_ADDRESS" and not k.startswith("DASK_FIBER__")
    }
    environ.update(DASK_FIBER__LOCAL__N_WORKERS="2", FIBER_EARLY_TEST_MARKER=marker)
    marks = tmp_path / "marks"
    marks.mkdir()
    proc = subprocess.Popen(
        [sys.executable, PROGRAM, "owner_killed", str(marks)],
        env=environ,
        cwd=str(tmp_path),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        started = marks / "started"
        wait_until(started.exists, timeout=120, what="item 0 to start")
        victim = json.loads(started.read_text())
        assert victim["where"] is None, "item 0 did not run in an early slot"
        assert len(_processes_with(marker)) > 2  # server, template, slots, ...
        proc.kill()
        proc.wait(30)
        wait_until(
            lambda: not _processes_with(marker),
            timeout=30,
            what="every process the killed program started to end",
        )
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for p in _processes_with(marker):
            p.kill()
        proc.stderr.close()


def test_maxtasksperchild_recycles_early_slots_then_hands_over(tmp_path) -> None:
    out, stderr = run("recycle", tmp_path)
    first = out["first"]
    assert first[0][0] is None, "the first map did not start on early slots"
    # One-item chunks, at most 3 per process, early or not: a fresh process
    # after every third task (chunk), as the stdlib starts a fresh worker.
    per_pid: dict[int, int] = {}
    for _, pid in first:
        per_pid[pid] = per_pid.get(pid, 0) + 1
    assert max(per_pid.values()) <= 3, per_pid
    early = [pid for where, pid in first if where is None]
    assert len(set(early)) >= -(-len(early) // 3)
    # More than the first two early processes could run: their successors
    # (forked by the early template) served too, before the cluster was up.
    assert len(early) > 6, first
    assert all(where is not None for where, _ in out["last"])
    assert out["counts"] == [1]
    assert "Traceback" not in stderr, stderr[-3000:]
