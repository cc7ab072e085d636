"""The stdlib's own ``multiprocessing`` inside a pool task and a Process child,
with the stdlib as the oracle (issue 28, item 3).

A task body (tests/tasks/stdlib_inside.py) runs in a stdlib pool worker and
in a fiber-dask slot process, a child body in a stdlib ``Process`` and in a
``fiber_dask.Process``, and the outcomes (results, exception class and
message, warnings) must be the same.  A stdlib pool worker is daemonic, so
there a stdlib Pool, a stdlib Process and a DataLoader's workers are refused
and joblib goes sequential with a warning; a Process child is not, so there
they run, in parallel.

Then the rule behind it (fiber_dask/transparency/resourcetracker.py): a slot process uses
its Dask worker's resource tracker, which on the embedded cluster is the
program's own, however the worker and the slot template were started, and a
segment a task leaves behind is unlinked at the program's exit with the
stdlib's warning.  Every semaphore and segment the tests make is checked gone.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys

import pytest
from support.clusters import command_line_cluster
from support.wait import wait_until
from tasks import stdlib_inside as h

pytestmark = pytest.mark.timeout(180)

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS_DIR)


def _stdlib():
    return multiprocessing.get_context("forkserver")


def _fiber():
    import fiber_dask

    return fiber_dask.get_context()


def _in_pool_task(ctx, body, *args):
    with ctx.Pool(2) as pool:
        return pool.apply(body, args)


def _in_child(ctx, body):
    r, w = ctx.Pipe(duplex=False)
    p = ctx.Process(target=h.in_child, args=(body, w))
    p.start()
    try:
        assert r.poll(150), f"no answer from the child running {body.__name__}"
        out = r.recv()
    finally:
        p.join(60)
    assert p.exitcode == 0
    return out


def _both(run, body, *args) -> tuple:
    """``run(ctx, body)`` against the stdlib and fiber-dask: (stdlib's, ours)."""
    return run(_stdlib(), body, *args), run(_fiber(), body, *args)


def _shm_path(name: str) -> str:
    return "/dev/shm/" + name.lstrip("/")


def _assert_semaphores_gone(names) -> None:
    paths = [_shm_path("sem." + n.lstrip("/")) for n in names if n]
    wait_until(
        lambda: not any(os.path.exists(p) for p in paths), 10, f"{paths} unlinked"
    )


def _all_ok(outcomes: dict) -> bool:
    return all(o[0] == "ok" for o in outcomes.values())


# ------------------------------------------------------------- in a pool task


def test_stdlib_primitives_in_a_pool_task():
    theirs, ours = _both(_in_pool_task, h.primitives)
    assert _all_ok(theirs["outcomes"]), theirs  # the oracle really made them
    assert ours["outcomes"] == theirs["outcomes"]
    # Named semaphores (registered with the tracker), and none left behind.
    assert len(ours["semaphores"]) == len(theirs["semaphores"]) == 6
    assert all(ours["semaphores"])
    _assert_semaphores_gone(theirs["semaphores"] + ours["semaphores"])


def _segment_across_tasks(ctx, _body=None) -> tuple:
    """Created in one task, read here and in a task, unlinked in a task."""
    from multiprocessing import shared_memory

    with ctx.Pool(2) as pool:
        name = pool.apply(h.create_segment, (b"howdy",))
        try:
            here = shared_memory.SharedMemory(name)
            seen_here = bytes(here.buf[:5])
            here.close()
            seen_there = pool.apply(h.read_segment, (name, 5))
            unlinked = pool.apply(h.unlink_segment, (name,))
        finally:
            if os.path.exists(_shm_path(name)):  # a failed run leaks nothing
                import _posixshmem

                _posixshmem.shm_unlink(name)
    return seen_here, seen_there, unlinked, os.path.exists(_shm_path(name))


def test_shared_memory_created_attached_and_unlinked_in_pool_tasks():
    theirs, ours = _both(_segment_across_tasks, None)
    assert theirs == (b"howdy", b"howdy", "unlinked", False)
    assert ours == theirs


def test_a_stdlib_pool_or_process_in_a_pool_task_is_refused_as_in_the_stdlib():
    theirs, ours = _both(_in_pool_task, h.stdlib_children)
    refused = (
        "raised",
        "AssertionError",
        "daemonic processes are not allowed to have children",
        [],
    )
    assert theirs == {"pool": refused, "process": refused}
    assert ours == theirs


@pytest.mark.slow
def test_joblib_and_scikit_learn_in_a_pool_task_behave_as_in_a_stdlib_worker():
    # A stdlib worker is daemonic: joblib runs the jobs here, one at a time,
    # with its warning (not its "Inside a Dask worker" one: a slot process is
    # no Dask worker).
    pytest.importorskip("sklearn")
    for body in (h.joblib_parallel, h.sklearn_cross_val):
        theirs, ours = _both(_in_pool_task, body)
        assert theirs[0] == "ok" and any("setting n_jobs=1" in w for w in theirs[2])
        assert ours == theirs, body.__name__
    assert theirs[1] == ours[1]


@pytest.mark.slow
def test_a_torch_dataloader_in_a_pool_task_behaves_as_in_a_stdlib_worker():
    pytest.importorskip("torch")
    theirs, ours = _both(_in_pool_task, h.torch_dataloader)
    assert theirs[:2] == ("raised", "AssertionError")  # its workers: daemonic
    assert ours == theirs


# --------------------------------------------------------- in a Process child


@pytest.mark.slow
def test_stdlib_multiprocessing_and_joblib_in_a_process_child():
    # Not daemonic: a stdlib Pool and Process start there, and joblib runs
    # two jobs at once in two processes of its own.
    pytest.importorskip("sklearn")
    for body, expected in [
        (h.primitives, None),
        (h.stdlib_children, {"pool": ("ok", [0, 1, 4, 9], []),
                             "process": ("ok", 0, [])}),
        (h.joblib_parallel, ("ok", (2, 2), [])),
        (h.sklearn_cross_val, None),
    ]:  # fmt: skip
        theirs, ours = _both(_in_child, body)
        if expected is not None:
            assert theirs == expected
        if body is h.primitives:
            assert _all_ok(theirs["outcomes"]), theirs
            # (the semaphores' kind follows each child's start method)
            assert ours["outcomes"] == theirs["outcomes"]
            _assert_semaphores_gone(theirs["semaphores"] + ours["semaphores"])
        elif body is h.sklearn_cross_val:
            assert theirs[0] == "ok" and theirs[2] == []
            assert ours == theirs
        else:
            assert ours == theirs, body.__name__


@pytest.mark.slow
def test_a_torch_dataloader_with_two_workers_in_a_process_child():
    pytest.importorskip("torch")
    theirs, ours = _both(_in_child, h.torch_dataloader)
    assert theirs == ("ok", ([i * i for i in range(8)], 2), [])
    assert ours == theirs


# ---------------------------------------------- which tracker a slot process uses


def test_slot_processes_share_their_dask_workers_tracker_the_programs_own():
    from fiber_dask import cluster

    with _fiber().Pool(2) as pool:
        from_slots = pool.map(h.tracker_pipe_in_use, range(4), chunksize=1)
    workers = cluster.get_client().run(h.tracker_pipe)
    here = h.tracker_pipe()
    assert isinstance(here, int), here
    assert set(from_slots) == {here}
    assert set(workers.values()) == {here}


TRACKER_RULE = """
import json, os, sys
if os.environ.get("IMPORT_AT_TOP"):
    import fiber_dask  # a worker forks its slot template as it imports this
from tasks import stdlib_inside as h

if __name__ == "__main__":
    import fiber_dask
    from fiber_dask import cluster

    if len(sys.argv) > 1:
        fiber_dask.init(address=sys.argv[1])
    with fiber_dask.Pool(2) as pool:
        slots = pool.map(h.tracker_pipe_in_use, range(4), chunksize=1)
        templates = pool.apply(h.template_kinds)
    workers = cluster.get_client().run(h.tracker_pipe)
    print(json.dumps({"slots": sorted(set(slots)), "templates": templates,
                      "workers": sorted(set(workers.values())),
                      "owner": h.tracker_pipe()}))
"""


def _env(**extra) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (ROOT, TESTS_DIR, env.get("PYTHONPATH", "")) if p
    )
    env.update(extra)
    return env


def _run_program(path, *args, env, timeout=150) -> tuple[str, str]:
    proc = subprocess.run(
        [sys.executable, str(path), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=os.path.dirname(str(path)),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout, proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize(
    "worker_start, import_at_top, template",
    [
        ("forkserver", False, "forked"),
        ("spawn", True, "forked"),
        # Spawned too, every embedded worker forks its template as it starts
        # (backends/workerstart._Process.run), whatever the main module
        # imports; the fresh interpreter is a `dask worker`'s (next test).
        ("spawn", False, "forked"),
    ],
)
def test_the_tracker_rule_however_the_embedded_cluster_starts(
    tmp_path, worker_start, import_at_top, template
):
    script = tmp_path / "rule.py"
    script.write_text(TRACKER_RULE)
    env = _env(DASK_FIBER__LOCAL__WORKER_START=worker_start)
    if import_at_top:
        env["IMPORT_AT_TOP"] = "1"
    out, err = _run_program(script, env=env)
    seen = json.loads(out.splitlines()[-1])
    assert isinstance(seen["owner"], int), seen
    assert seen["templates"] == template, seen
    assert seen["slots"] == seen["workers"] == [seen["owner"]], seen


@pytest.mark.slow
def test_the_tracker_rule_on_a_cluster_started_on_the_command_line(tmp_path):
    # `dask worker` with a nanny: the worker's tracker is its nanny's, and the
    # slot template (a fresh interpreter there) hands it to its slots.
    with command_line_cluster(_env()) as (address, _, _):
        script = tmp_path / "rule.py"
        script.write_text(TRACKER_RULE)
        out, err = _run_program(script, address, env=_env())
    seen = json.loads(out.splitlines()[-1])
    assert seen["templates"] == "fresh", seen
    assert len(seen["workers"]) == 1 and isinstance(seen["workers"][0], int)
    assert seen["slots"] == seen["workers"], seen
    assert seen["owner"] not in seen["workers"]  # another program's tracker


LEFT_BEHIND = """
import sys
from tasks import stdlib_inside as h

if __name__ == "__main__":
    if sys.argv[1] == "stdlib":
        import multiprocessing
        ctx = multiprocessing.get_context("spawn")
    else:
        import fiber_dask
        ctx = fiber_dask.get_context()
    with ctx.Pool(1) as pool:
        print(pool.apply(h.create_segment, (b"left",)), flush=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize("target", ["stdlib", "fiber"])
def test_a_segment_a_task_leaves_is_unlinked_at_exit_with_the_stdlib_warning(
    tmp_path, target
):
    script = tmp_path / "left.py"
    script.write_text(LEFT_BEHIND)
    # The tracker holds the program's stderr: this returns once it is done.
    out, err = _run_program(script, target, env=_env())
    name = out.split()[-1]
    try:
        assert "leaked shared_memory objects to clean up at shutdown" in err, err
        wait_until(lambda: not os.path.exists(_shm_path(name)), 10, f"{name} unlinked")
    finally:
        if os.path.exists(_shm_path(name)):
            import _posixshmem

            _posixshmem.shm_unlink(name)


MAIN_FUNCTIONS_PROGRAM = """
import multiprocessing, sys
import fiber_dask

OFFSET = 10


def shifted_square(x):
    return x * x + OFFSET


def work(method):
    global OFFSET
    OFFSET = 100  # a global the child sets, seen by its own pool's workers
    with multiprocessing.get_context(method).Pool(2) as pool:
        print(method, pool.map(shifted_square, range(4)), flush=True)


class Worker(fiber_dask.Process):
    def run(self):
        work("fork")


if __name__ == "__main__":
    Process = fiber_dask.Process if sys.argv[1] == "fiber" else multiprocessing.Process
    for method in ("fork", "spawn", "forkserver"):
        p = Process(target=work, args=(method,))
        p.start()
        p.join(120)
        print("exitcode", p.exitcode, flush=True)
    if sys.argv[1] == "fiber":
        p = Worker()
        p.start()
        p.join(120)
        print("exitcode", p.exitcode, flush=True)
"""


def test_a_process_child_passes_its_main_functions_to_a_stdlib_pool(tmp_path):
    # A stdlib child has its parent's script as __main__, so it can hand a
    # function of it to a Pool of its own (fork: the same module; spawn and
    # forkserver: the grandchildren import the script).  A fiber child's
    # __main__ was fiber-dask's bootstrap: "attribute lookup ... on __main__
    # failed".
    script = tmp_path / "main_functions.py"
    script.write_text(MAIN_FUNCTIONS_PROGRAM)
    std, _ = _run_program(script, "stdlib", env=_env())
    fiber, _ = _run_program(script, "fiber", env=_env())
    # spawn and forkserver grandchildren import the script: its OFFSET
    expected = [
        "fork [100, 101, 104, 109]",
        "exitcode 0",
        "spawn [10, 11, 14, 19]",
        "exitcode 0",
        "forkserver [10, 11, 14, 19]",
        "exitcode 0",
    ]
    assert std.splitlines() == expected, std
    assert fiber.splitlines() == expected + ["fork [100, 101, 104, 109]", "exitcode 0"]
