"""Ctrl-C as users press it: SIGINT to the whole process group.

A terminal's Ctrl-C, and Jupyter's "interrupt kernel", signal every process
of the foreground group: the program, and on the embedded cluster its Dask
workers, their slot templates and slot processes, and ``Process`` children.
The stdlib is the oracle: the same program runs under ``multiprocessing``
and under ``fiber_dask``, started in a session of its own with SIGINT's
default handler (as a terminal program has it, whatever this suite has), is
interrupted with ``os.killpg`` once its tasks have marked themselves started,
and must go on as the stdlib's does, printing no more than it does (plus a
line).  Then a real Jupyter kernel, driven by nbclient, whose cell is
interrupted while it maps, and whose next cell maps again.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import textwrap
import threading

import nbclient
import nbformat
import pytest
from support.interrupts import python_sigint, terminal_python
from support.wait import wait_until

pytestmark = pytest.mark.timeout(240)

MODULES = ("multiprocessing", "fiber_dask")

# Both slots run ``slow`` (each marks itself started), then SIGINT; the pool
# that was interrupted and a new one must map right away, in the program
# that caught the KeyboardInterrupt (a notebook's kernel, a REPL).
POOL_PROGRAM = """
import json, os, sys, time
import {module} as mp

MARKS = sys.argv[1]


def slow(x):
    open(os.path.join(MARKS, f"{{os.getpid()}}-{{x}}"), "w").close()
    time.sleep(300)
    return x


def square(x):
    return x * x


def where(x):
    time.sleep(0.01)
    return os.getpid()


if __name__ == "__main__":
    report = {{}}
    pool = mp.Pool(2)
    report["first"] = pool.map(square, range(10))
    fiber = mp.__name__ == "fiber_dask"
    if fiber:
        client = mp.get_client()
        report["workers_before"] = sorted(client.run(os.getpid).values())
    print("ready", flush=True)
    try:
        pool.map(slow, range(2), chunksize=1)
    except KeyboardInterrupt:
        report["interrupted"] = True
    report["old_pool"] = pool.map(square, range(100))
    report["old_slots"] = sorted(set(pool.map(where, range(40), chunksize=1)))
    with mp.Pool(2) as other:
        report["new_pool"] = other.map(square, range(100))
    if fiber:
        report["workers_after"] = sorted(client.run(os.getpid).values())
    report["ran_slow"] = sorted(os.listdir(MARKS))
    pool.terminate()
    pool.join()
    print(json.dumps(report), flush=True)
"""

PROCESS_PROGRAM = """
import os, sys, time
import {module} as mp

MARKS = sys.argv[1]


def slow():
    open(os.path.join(MARKS, str(os.getpid())), "w").close()
    time.sleep(300)


if __name__ == "__main__":
    p = mp.Process(target=slow)
    p.start()
    try:
        p.join()
    except KeyboardInterrupt:
        print("interrupted", flush=True)
    p.join(60)
    print("exitcode", p.exitcode, flush=True)
"""


def _interrupt(tmp_path, program, module, marks_wanted, group=True):
    """Run ``program`` for ``module`` as a terminal would, SIGINT its process
    group (``group=False``: the program's process alone) once
    ``marks_wanted`` tasks marked themselves started; (stdout, stderr) once
    it exits."""
    marks = tmp_path / f"marks-{module}"
    marks.mkdir()
    script = tmp_path / f"prog_{module}.py"
    script.write_text(textwrap.dedent(program.format(module=module)))
    proc = subprocess.Popen(
        terminal_python(str(script), str(marks)),
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own group, as a terminal's job
    )
    try:
        wait_until(
            lambda: len(os.listdir(marks)) >= marks_wanted or proc.poll() is not None,
            timeout=120,
            what=f"{marks_wanted} tasks of the {module} program to start",
        )
        assert proc.poll() is None, proc.communicate()
        (os.killpg if group else os.kill)(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=150)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 0, f"{module}:\n{out}\n{err}"
    return out, err


def _tracebacks(err):
    return err.count("Traceback (most recent call last)")


def test_ctrl_c_during_a_map_is_the_stdlibs_and_the_cluster_survives(tmp_path):
    runs = {m: _interrupt(tmp_path, POOL_PROGRAM, m, 2) for m in MODULES}
    reports = {m: json.loads(out.splitlines()[-1]) for m, (out, _) in runs.items()}
    squares = [x * x for x in range(100)]
    for module, report in reports.items():
        assert report["interrupted"] is True, module  # the caller's KeyboardInterrupt
        assert report["old_pool"] == squares, module
        assert report["new_pool"] == squares, module
        # Both slow tasks ran once: none re-run after the interrupt (the
        # interrupted map's result can never be taken).
        assert len(report["ran_slow"]) == 2, (module, report["ran_slow"])
        # The interrupted slots ended, as stdlib pool workers do, and the
        # pool replaced them.
        interrupted = {int(name.split("-")[0]) for name in report["ran_slow"]}
        assert interrupted.isdisjoint(report["old_slots"]), (module, report)
    # The embedded cluster's worker processes ignored it: they still serve
    # (with two more: the second Pool(2) grew the cluster, as it does).
    fiber = reports["fiber_dask"]
    assert set(fiber["workers_before"]) <= set(fiber["workers_after"]), fiber
    # What it prints: the stdlib's, plus at most a line.
    std_err, fiber_err = runs["multiprocessing"][1], runs["fiber_dask"][1]
    assert _tracebacks(fiber_err) <= _tracebacks(std_err), fiber_err
    assert len(fiber_err.splitlines()) <= len(std_err.splitlines()) + 1, (
        f"stdlib printed:\n{std_err}\nfiber_dask printed:\n{fiber_err}"
    )
    assert fiber_err.count("Process SpawnPoolWorker-") == 2, fiber_err
    for machinery in ("fiber_dask/", "distributed/", "nanny", "asyncio"):
        assert machinery not in fiber_err, fiber_err


def test_an_interrupted_map_ends_the_slots_that_the_interrupt_did_not_reach(
    tmp_path,
):
    # SIGINT to the program alone: its slots run on (as slots on other hosts
    # do, or loops that took an interrupted slot's chunk again before the
    # map was cancelled: a Jupyter cell's next map waited behind them).  The
    # cancelled map ends them, and the next map runs at once, on new slots.
    out, err = _interrupt(tmp_path, POOL_PROGRAM, "fiber_dask", 2, group=False)
    report = json.loads(out.splitlines()[-1])
    squares = [x * x for x in range(100)]
    assert report["interrupted"] is True
    assert report["old_pool"] == squares and report["new_pool"] == squares
    assert len(report["ran_slow"]) == 2, report["ran_slow"]  # none re-run
    ended = {int(name.split("-")[0]) for name in report["ran_slow"]}
    assert ended.isdisjoint(report["old_slots"]), report
    assert set(report["workers_before"]) <= set(report["workers_after"]), report


def test_ctrl_c_reaches_a_process_child_as_the_stdlibs(tmp_path):
    runs = {m: _interrupt(tmp_path, PROCESS_PROGRAM, m, 1) for m in MODULES}
    for module, (out, _) in runs.items():
        assert out.splitlines() == ["interrupted", "exitcode 1"], (module, out)
    std_err, fiber_err = runs["multiprocessing"][1], runs["fiber_dask"][1]
    # The child's own traceback, as the stdlib's child prints it; no runpy
    # warning about how the child was started.
    assert "RuntimeWarning" not in fiber_err, fiber_err
    assert fiber_err.splitlines()[0] == std_err.splitlines()[0] == "Process Process-1:"
    assert fiber_err.splitlines()[-2:] == std_err.splitlines()[-2:], fiber_err
    assert len(fiber_err.splitlines()) <= len(std_err.splitlines()) + 1, fiber_err


STARTUP_PROGRAM = """
import os, sys
import fiber_dask as mp

MARKS = sys.argv[1]


def square(x):
    return x * x


if __name__ == "__main__":
    open(os.path.join(MARKS, "starting"), "w").close()
    try:
        with mp.Pool(2) as pool:
            pool.map(square, range(10))
            print("not interrupted", flush=True)
            import time; time.sleep(300)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
    with mp.Pool(2) as pool:
        print(pool.map(square, range(10)) == [x * x for x in range(10)], flush=True)
"""


def test_ctrl_c_while_the_embedded_cluster_starts(tmp_path):
    # Wherever the cluster's start the interrupt lands (the owner importing
    # distributed, the fork server importing, the workers registering, the
    # first slots connecting), the program's next Pool works.
    out, err = _interrupt(tmp_path, STARTUP_PROGRAM, "fiber_dask", 1)
    assert out.splitlines()[-2:] == ["interrupted", "True"], (out, err)
    assert "Traceback" not in err, err


# The Ctrl-C lands in the first Pool() exactly while it binds the embedded
# cluster's background start (a real SIGINT, sent by the program to itself
# as the binding begins): bound but never started, the start left every
# later Pool() waiting for it forever.
BINDING_PROGRAM = """
import os, signal, sys, threading
import fiber_dask as mp


def square(x):
    return x * x


def interrupt_binding(frame, event, arg):
    if event == "call" and frame.f_code.co_name == "load_backend":
        sys.setprofile(None)
        os.kill(os.getpid(), signal.SIGINT)


if __name__ == "__main__":
    sys.setprofile(interrupt_binding)
    try:
        mp.Pool(2)
        print("not interrupted", flush=True)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
    sys.setprofile(None)
    with mp.Pool(2) as pool:
        print(pool.map(square, range(10)) == [x * x for x in range(10)], flush=True)
"""


def test_ctrl_c_while_the_first_pool_binds_the_clusters_start(tmp_path):
    script = tmp_path / "binding.py"
    script.write_text(BINDING_PROGRAM)
    proc = subprocess.run(
        terminal_python(str(script)),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        start_new_session=True,
    )
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    assert proc.stdout.splitlines() == ["interrupted", "True"], (proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr


SERVER_PROGRAM = """
import json, os, signal, subprocess, threading, time
from fiber_dask.backends import workerstart

BIT = 1 << (signal.SIGINT - 1)
shots = []
seen = []


def masks(pid):
    # both from one read: two reads could see the state before and after
    with open(f"/proc/{pid}/status") as f:
        status = dict(line.split(":", 1) for line in f)
    return int(status["SigIgn"], 16), int(status["SigBlk"], 16)


def barrage(pid):
    # SIGINT again and again from the moment the server exists until it
    # ignores SIGINT and no longer blocks it, then as many again.
    deadline = time.monotonic() + 60
    after = None
    while time.monotonic() < deadline and (after is None or after > 0):
        try:
            os.kill(pid, signal.SIGINT)
            shots.append(1)
            if after is None:
                ign, blk = masks(pid)
                seen.append((bool(ign & BIT), bool(blk & BIT)))
                if ign & BIT and not blk & BIT:
                    after = len(shots)
            else:
                after -= 1
        except (ProcessLookupError, FileNotFoundError):
            return


class Shot(subprocess.Popen):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.barrage = threading.Thread(target=barrage, args=(self.pid,))
        self.barrage.start()


if __name__ == "__main__":
    subprocess.Popen = Shot  # workerstart imports it when it starts the server
    server = workerstart.start()
    server._proc.barrage.join(70)
    ign, blk = masks(server.pid)
    print(json.dumps({
        "shots": len(shots),
        "states": sorted(set(seen)),
        "first": seen[:1],
        "ignored": bool(ign & BIT),
        "blocked": bool(blk & BIT),
        "running": server._proc.poll() is None,
    }), flush=True)
    server.stop(timeout=5)
"""


def test_the_worker_fork_server_ignores_ctrl_c_from_its_first_instruction(tmp_path):
    # Before its first line of code the server imports site (and whatever
    # .pth files import): a Ctrl-C there ended it with "Fatal Python error:
    # init_import_site" when SIGINT was ignored only in its code, and a
    # /bin/sh trap in front left the millisecond before the trap ran.  Real
    # SIGINTs, one after another from the moment the server exists until it
    # ignores them, in a program as a user's (SIGINT's default handler).
    script = tmp_path / "server.py"
    script.write_text(SERVER_PROGRAM)
    proc = subprocess.run(
        terminal_python(str(script)), cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout.splitlines()[-1])
    assert r["running"], (r, proc.stderr[-3000:])
    assert r["ignored"] and not r["blocked"], r
    # held (blocked) from the start, then ignored: never deliverable
    assert r["first"] == [[False, True]], r
    assert all(ign or blk for ign, blk in r["states"]), r
    assert r["shots"] >= 10, r
    assert "Fatal Python error" not in proc.stderr, proc.stderr[-3000:]
    assert "KeyboardInterrupt" not in proc.stderr, proc.stderr[-3000:]


def test_a_ctrl_c_in_a_first_import_waits_for_it_to_be_whole():
    # Cut half-way, an import leaves modules half-made that fail the next
    # time (asyncio's "name 'coroutines' is not defined" after a Ctrl-C in
    # the first Pool()): the first Ctrl-C waits for the end of the import,
    # a second one does not.
    from fiber_dask.transparency.interrupts import deferred

    done = []
    with python_sigint():
        with pytest.raises(KeyboardInterrupt):
            with deferred():
                os.kill(os.getpid(), signal.SIGINT)
                done.append("the import went on")
        assert done == ["the import went on"]
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        with pytest.raises(KeyboardInterrupt):
            with deferred():
                os.kill(os.getpid(), signal.SIGINT)
                os.kill(os.getpid(), signal.SIGINT)
                done.append("not reached")
        assert done == ["the import went on"]
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


# ------------------------------------------------------------------ Jupyter


NOTEBOOK_CELLS = [
    """
    import os, time
    import fiber_dask

    def slow(x):
        open(os.path.join({marks!r}, str(os.getpid())), "w").close()
        time.sleep(300)

    def square(x):
        return x * x

    pool = fiber_dask.Pool(2)
    print(pool.map(square, range(10)))
    """,
    "pool.map(slow, range(2), chunksize=1)",  # interrupted
    """
    print(pool.map(square, range(10)))
    with fiber_dask.Pool(2) as other:
        print(other.map(square, range(10)))
    print(len(os.listdir({marks!r})))
    pool.terminate()
    """,
]


def test_jupyter_interrupt_then_the_next_cell_maps(tmp_path):
    marks = tmp_path / "marks"
    marks.mkdir()
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell(textwrap.dedent(c.format(marks=str(marks))))
        for c in NOTEBOOK_CELLS
    ]
    client = nbclient.NotebookClient(
        nb,
        kernel_name="python3",
        timeout=120,
        allow_errors=True,
        resources={"metadata": {"path": str(tmp_path)}},
    )
    with client.setup_kernel():
        client.execute_cell(nb.cells[0], 0)
        assert nb.cells[0].outputs[0]["text"].strip() == str([x * x for x in range(10)])

        def interrupt_once_started():
            wait_until(
                lambda: len(os.listdir(marks)) >= 2,
                timeout=120,
                what="both slots to start the cell's tasks",
            )
            # What "interrupt kernel" does (jupyter_client's LocalProvisioner
            # .send_signal): SIGINT to the kernel's process group.  Called
            # here, not through the manager, whose methods are coroutines
            # of nbclient's event loop, busy running the cell.
            os.killpg(client.km.provisioner.pgid, signal.SIGINT)

        interrupter = threading.Thread(target=interrupt_once_started)
        interrupter.start()
        client.execute_cell(nb.cells[1], 1)
        interrupter.join(10)
        errors = [o for o in nb.cells[1].outputs if o["output_type"] == "error"]
        assert [e["ename"] for e in errors] == ["KeyboardInterrupt"], nb.cells[1]
        client.execute_cell(nb.cells[2], 2)
    out = "".join(o.get("text", "") for o in nb.cells[2].outputs)
    squares = str([x * x for x in range(10)])
    assert out.splitlines() == [squares, squares, "2"], nb.cells[2].outputs


def test_a_late_cancel_lets_the_slot_finish_another_jobs_chunk(tmp_path):
    # The cancel's second half takes a loop's first unanswered chunk for the
    # one it runs: forced to come after the slot process moved on to the
    # next job's chunk (support/latecancel.py).  It must finish that chunk,
    # once, and leave after it (a new slot process takes its place), not be
    # killed in it and the chunk run again.
    import dask
    from support.latecancel import SEND_AHEAD, cancel_after_the_slot_moved_on
    from tasks.poolcore import executions

    import fiber_dask

    d = str(tmp_path)
    with dask.config.set(SEND_AHEAD), fiber_dask.Pool(1) as pool:
        b, ran_b = cancel_after_the_slot_moved_on(pool, d)
        open(os.path.join(d, "go-1"), "w").close()
        assert b.get(timeout=60) == 1
        assert executions(d, 1) == 1  # not killed in it and run again
        assert pool.apply(os.getpid) != ran_b  # it left after that chunk
    assert executions(d, 0) == 1
