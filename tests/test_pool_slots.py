"""Pool slot processes (``fiber.pool.slots: process``): stdlib pool-worker semantics.

Each pool slot's tasks run in a process of its own, forked from a per-Dask-worker
template (``fiber_dask.engine.slots``).  The stdlib is the oracle where it applies
(signals, the main thread, ``maxtasksperchild``); crash isolation and lifetimes
are checked with real crashes and real SIGKILLs, waiting on markers and on
conditions, never on timers.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import dask
import psutil
import pytest
from distributed import Client
from support.clusters import loopback_cluster
from support.processes import running
from support.wait import wait_for_file, wait_until
from tasks import process as hp

import fiber_dask
from fiber_dask.comm import channel
from fiber_dask.engine import poolprotocol as proto
from fiber_dask.engine import slots

pytestmark = pytest.mark.timeout(120)


# ----------------------------------------------------------------- task bodies


def ignore_sigint():
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def sigint_handler(_=None):
    return signal.getsignal(signal.SIGINT) is signal.SIG_IGN


class _Alarm(Exception):
    pass


def _raise_alarm(signum, frame):
    raise _Alarm()


def alarm_timeout(seconds):
    """The per-task timeout idiom: an interval timer that raises in the task."""
    signal.signal(signal.SIGALRM, _raise_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            time.sleep(0.01)
        return "not interrupted"
    except _Alarm:
        return "timed out"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def alarm_in_sleep(seconds):
    """An alarm while the task is blocked in C (one long sleep): seconds until
    the handler raised."""
    signal.signal(signal.SIGALRM, _raise_alarm)
    t0 = time.monotonic()
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        time.sleep(30)
        return None
    except _Alarm:
        return time.monotonic() - t0
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def in_main_thread(_=None):
    return threading.current_thread() is threading.main_thread()


def whoami(_=None):
    import multiprocessing

    p = multiprocessing.current_process()
    return p.name, p.daemon


def getpid(_=None):
    return os.getpid()


def slow_getpid(_=None):
    time.sleep(0.05)
    return os.getpid()


def count_init(path):
    with open(path, "a") as f:
        f.write(f"{os.getpid()}\n")


def crash_once(x, path, how):
    """Append an execution record for ``x``; item 3 crashes its process the
    first time it runs."""
    with open(path, "a") as f:
        f.write(f"{x}\n")
    if x == 3 and not os.path.exists(path + ".crashed"):
        open(path + ".crashed", "w").close()
        if how == "segfault":
            ctypes.string_at(0)
        elif how == "exit":
            os._exit(3)
        else:
            os.kill(os.getpid(), signal.SIGKILL)
    return x * x


def write_pid(path):
    """A started marker holding this process's pid, written atomically."""
    with open(path + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(path + ".tmp", path)


def read_pid(path):
    wait_for_file(path, timeout=60)
    with open(path) as f:
        return int(f.read())


def spin_forever(path):
    write_pid(path)
    while True:  # pure-Python CPU loop
        pass


def sleep_forever(path):
    write_pid(path)
    time.sleep(3600)  # blocked in C


def nested_pool(n):
    with fiber_dask.Pool(1) as inner:
        return inner.map(abs, range(-n, 0))


def nested_process(path):
    p = fiber_dask.Process(target=count_init, args=(path,))
    p.start()
    p.join()
    return p.exitcode


def shared_state(args):
    lock, value, items = args
    with lock:
        value.value += 1
    items.append(os.getpid())
    return True


def dead(pids):
    return all(not running(p) for p in pids)


def live_children(pid):
    try:
        kids = psutil.Process(pid).children()
    except psutil.NoSuchProcess:
        return []
    return [k.pid for k in kids if running(k.pid)]


def only_spares_left(templates):
    """Each template keeps its one pre-forked spare and nothing else: no slot
    process of a pool that ended is left running."""
    return all(len(live_children(t)) == 1 for t in templates)


# ------------------------------------------------------- stdlib-oracle semantics


def test_initializer_can_install_signal_handlers(ctx):
    # schwimmbad's MultiPool idiom; in a thread it raises ValueError.
    with ctx.Pool(2, initializer=ignore_sigint) as pool:
        assert pool.map(sigint_handler, range(4), chunksize=1) == [True] * 4


def test_alarm_timeout_inside_a_task(ctx):
    with ctx.Pool(1) as pool:
        assert pool.apply(alarm_timeout, (0.05,)) == "timed out"
        assert pool.apply(in_main_thread) is True  # the pool goes on


def test_an_alarm_interrupts_a_task_blocked_in_c(ctx):
    with ctx.Pool(1) as pool:
        for _ in range(5):
            took = pool.apply(alarm_in_sleep, (0.05,))
            assert took is not None and took < 5, took


def test_the_slots_helper_threads_leave_signals_to_the_main_thread(fiber_ctx):
    # A signal sent to the process goes to any thread that does not block it:
    # the slot's link and time-limit threads block those a task handles, so
    # they reach the task's (main) thread, as in a stdlib pool worker, which
    # has no other thread.
    with fiber_ctx.Pool(1, soft_time_limit=50, time_limit=60) as pool:
        masks = pool.apply(hp.helper_thread_masks)
    assert "fiber-pool-link" in masks and "fiber-time-limits" in masks, masks
    assert all(masks.values()), masks


def test_tasks_run_in_the_main_thread(ctx):
    with ctx.Pool(2) as pool:
        assert pool.map(in_main_thread, range(4), chunksize=1) == [True] * 4


def test_current_process_looks_like_a_pool_worker(ctx):
    with ctx.Pool(2) as pool:
        for name, daemon in pool.map(whoami, range(4), chunksize=1):
            assert daemon is True
            prefix, _, number = name.rpartition("-")
            assert prefix.endswith("PoolWorker") and number.isdigit(), name


def test_maxtasksperchild_gives_fresh_processes(ctx, tmp_path):
    path = str(tmp_path / "inits")
    with ctx.Pool(1, initializer=count_init, initargs=(path,), maxtasksperchild=1) as p:
        pids = [p.apply(getpid) for _ in range(4)]
    assert len(set(pids)) == 4
    with open(path) as f:
        inits = f.read().split()
    # The initializer ran in each of them (the stdlib may have started one more).
    assert set(map(str, pids)) <= set(inits)


# ------------------------------------------------------------ fiber_dask only


def test_maxtasksperchild_warns_only_with_thread_slots(fiber_ctx, recwarn):
    with fiber_ctx.Pool(1, maxtasksperchild=2) as pool:
        assert len({pool.apply(getpid) for _ in range(4)}) == 2
    assert not [w for w in recwarn if "maxtasksperchild" in str(w.message)]
    with dask.config.set({"fiber.pool.slots": "thread"}):
        with pytest.warns(RuntimeWarning, match="maxtasksperchild"):
            pool = fiber_ctx.Pool(1, maxtasksperchild=2)
    pool.terminate()
    pool.join()


def test_slot_pids_differ_from_the_dask_workers(fiber_ctx):
    client = fiber_dask.cluster.get_handle().client
    workers = set(client.run(os.getpid).values())
    with fiber_ctx.Pool(2) as pool:
        pids = set(pool.map(slow_getpid, range(20), chunksize=1))
    assert pids and not pids & workers


def test_two_slots_in_one_threaded_worker_have_their_own_pids():
    with (
        loopback_cluster_threads(1, 2) as cluster,
        Client(cluster, set_as_default=False) as client,
    ):
        [worker] = client.run(os.getpid).values()
        with fiber_dask.Pool(2, client=client) as pool:
            seen = set()

            def both_slots_served():
                seen.update(pool.map(slow_getpid, range(8), chunksize=1))
                return len(seen) >= 2

            wait_until(both_slots_served, what="both slots of the one worker serving")
        assert len(seen) == 2 and worker not in seen


def loopback_cluster_threads(n_workers, threads):
    from distributed import LocalCluster

    return LocalCluster(
        n_workers=n_workers,
        threads_per_worker=threads,
        processes=True,
        dashboard_address=":0",
        host="127.0.0.1",
    )


def test_thread_setting_keeps_tasks_in_the_dask_worker(fiber_ctx):
    client = fiber_dask.cluster.get_handle().client
    workers = set(client.run(os.getpid).values())
    with dask.config.set({"fiber.pool.slots": "thread"}):
        with fiber_ctx.Pool(2) as pool:
            assert set(pool.map(getpid, range(8), chunksize=1)) <= workers


@pytest.fixture
def client():
    with loopback_cluster(2) as cluster, Client(cluster, set_as_default=False) as c:
        yield c


def import_path_and_joblib(_):
    import joblib

    return list(sys.path), joblib.__file__


def test_a_slot_imports_top_level_modules_not_fiber_dasks_namesakes(client):
    """A slot template is started with PYTHONPATH naming the directory that
    holds fiber_dask.  When a move into ``engine/`` made that the package
    directory itself, ``import joblib`` in every task found
    ``fiber_dask/joblib.py`` ("'joblib' is not a package"); a plain
    LocalCluster's workers showed it, the embedded cluster's did not."""
    package = os.path.dirname(os.path.abspath(fiber_dask.__file__))
    with fiber_dask.Pool(2, client=client) as pool:
        for path, joblib_file in pool.map(
            import_path_and_joblib, range(4), chunksize=1
        ):
            inside = [p for p in path if os.path.abspath(p or ".").startswith(package)]
            assert not inside, (
                f"the package's own directory is on a slot's sys.path: {inside}"
            )
            assert not joblib_file.startswith(package), joblib_file
            assert (
                os.path.dirname(package) in path
            )  # this very fiber_dask stays importable


@pytest.mark.parametrize("how", ["segfault", "exit", "sigkill"])
def test_a_task_that_kills_its_process_costs_only_a_rerun(client, tmp_path, how):
    workers = client.run(os.getpid)
    path = str(tmp_path / "runs")
    with fiber_dask.Pool(2, client=client) as pool:
        # Both slots first: a slot attaching late leaves the first one all
        # the chunks after its first in one Calls, and a chunk answered with
        # a later one when the crash cut both runs again (poolprotocol's
        # lost_chunks: which of them ran cannot be told).
        wait_until(
            lambda: sum(s.is_alive() for s in pool._pool) == 2,
            what="both slots to attach",
        )
        result = pool.starmap(
            crash_once, [(x, path, how) for x in range(8)], chunksize=1
        )
        assert result == [x * x for x in range(8)]
        assert pool.apply(getpid) not in workers.values()  # the pool goes on
    with open(path) as f:
        runs = [int(x) for x in f.read().split()]
    assert runs.count(3) == 2  # the crashed chunk ran again
    assert all(runs.count(x) == 1 for x in range(8) if x != 3)
    assert client.run(os.getpid) == workers  # no Dask worker died


def test_terminate_stops_cpu_bound_and_blocked_tasks(fiber_ctx, tmp_path):
    spin, sleep = str(tmp_path / "spin"), str(tmp_path / "sleep")
    pool = fiber_ctx.Pool(2)
    r1 = pool.apply_async(spin_forever, (spin,))
    r2 = pool.apply_async(sleep_forever, (sleep,))
    pids = [read_pid(p) for p in (spin, sleep)]
    assert all(running(p) for p in pids)
    templates = {psutil.Process(p).ppid() for p in pids}
    pool.terminate()
    wait_until(lambda: dead(pids), timeout=10, what="the terminated tasks' processes")
    pool.join()
    wait_until(
        lambda: only_spares_left(templates),
        timeout=10,
        what="templates left with only their spare after terminate()",
    )
    for r in (r1, r2):
        with pytest.raises(fiber_dask.PoolTerminatedError):
            r.get(timeout=5)


def test_slot_processes_gone_after_close(fiber_ctx):
    pool = fiber_ctx.Pool(2)
    pids = set(pool.map(slow_getpid, range(20), chunksize=1))
    templates = {psutil.Process(p).ppid() for p in pids}
    pool.close()
    pool.join()
    wait_until(lambda: dead(pids), timeout=10, what="the closed pool's slot processes")
    wait_until(
        lambda: only_spares_left(templates),
        timeout=10,
        what="templates left with only their spare after close()",
    )


OWNER_SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    import fiber_dask

    def block(path):
        with open(path + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.replace(path + ".tmp", path)
        time.sleep(3600)

    if __name__ == "__main__":
        address, marker = sys.argv[1], sys.argv[2]
        pool = fiber_dask.Pool(2, address=address)
        results = [pool.apply_async(block, (f"{marker}.{i}",)) for i in range(2)]
        time.sleep(3600)
    """
)


def test_slot_processes_gone_after_the_owner_is_killed(client, tmp_path):
    script = tmp_path / "owner.py"
    script.write_text(OWNER_SCRIPT)
    marker = str(tmp_path / "started")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), str(tmp_path)]))
    owner = subprocess.Popen(
        [sys.executable, str(script), client.scheduler.address, marker], env=env
    )
    try:
        pids = [read_pid(f"{marker}.{i}") for i in range(2)]
        assert all(running(p) for p in pids)
        templates = {psutil.Process(p).ppid() for p in pids}
        owner.kill()
        owner.wait(timeout=10)
        wait_until(
            lambda: dead(pids), timeout=15, what="the dead owner's slot processes"
        )
        wait_until(
            lambda: only_spares_left(templates),
            timeout=15,
            what="templates left with only their spare after the owner's SIGKILL",
        )
    finally:
        owner.kill()
        owner.wait(timeout=10)


def block_once(path):
    """Block in the first slot that runs this; return at once elsewhere."""
    if not os.path.exists(path):
        write_pid(path)
        time.sleep(3600)
    return os.getpid()


def test_slot_processes_die_with_their_dask_worker(client, tmp_path):
    marker = str(tmp_path / "blocked")
    with fiber_dask.Pool(2, client=client) as pool:
        res = pool.apply_async(block_once, (marker,))
        slot = read_pid(marker)
        template = psutil.Process(slot).ppid()
        worker = psutil.Process(template).ppid()
        assert worker in client.run(os.getpid).values()
        # The template's spare is forked again after each hand-over.
        wait_until(
            lambda: len(live_children(template)) == 2, what="the template's spare"
        )
        family = [template, *live_children(template)]
        os.kill(worker, signal.SIGKILL)
        wait_until(
            lambda: dead(family),
            timeout=15,
            what="the slot process, spare and template of a SIGKILLed Dask worker",
        )
        # The task was re-run in another slot (the marker exists: it returns).
        assert res.get(timeout=60) != slot


def test_nested_pool_and_process_from_a_task(fiber_ctx, tmp_path):
    path = str(tmp_path / "nested")
    with fiber_ctx.Pool(1) as pool:
        assert pool.apply(nested_pool, (3,)) == [3, 2, 1]
        assert pool.apply(nested_process, (path,)) == 0
    with open(path) as f:
        assert f.read().strip()


def test_manager_lock_and_value_from_tasks(fiber_ctx):
    with fiber_ctx.Manager() as manager:
        lock, value, items = manager.Lock(), fiber_ctx.Value("i", 0), manager.list()
        with fiber_ctx.Pool(2) as pool:
            assert all(pool.map(shared_state, [(lock, value, items)] * 6, chunksize=1))
        assert value.value == 6
        assert len(items) == 6


# ------------------------------------------------------- the template on its own


class _Owner:
    """A channel service that accepts slot connections and keeps them."""

    def __init__(self):
        self.authkey = os.urandom(32)
        self.server = channel.get_server("127.0.0.1", self.authkey)
        self.service = f"test-{os.getpid()}-{id(self)}"
        self.conns = []
        self.server.register(self.service, self._on_connect)

    def _on_connect(self, conn, hello):
        # A slot process's link carries its one loop, which says Attach first.
        ((loop, attach),) = proto.decode_frame(conn.recv_bytes())
        assert isinstance(attach, proto.Attach) and attach.pid == hello["pid"]
        self.conns.append((conn, dict(hello, slot=loop)))

    def stop(self, conn, hello):
        conn.send_bytes(proto.encode_frame([(hello["slot"], proto.STOP)]))

    def spec(self, slot=0):
        return slots.SlotSpec(
            self.server.address,
            self.authkey,
            self.service,
            slot,
            None,
            None,
            None,
            dict(os.environ),
        )

    def close(self):
        self.server.unregister(self.service)
        for conn, _ in self.conns:
            channel.hangup(conn)


def test_template_forks_slots_and_reports_their_end():
    owner = _Owner()
    template = slots.Template()
    try:
        forks = [template.fork(owner.spec(i)) for i in range(3)]
        for f in forks:
            assert f.started.wait(30)
        pids = {f.pid for f in forks}
        assert len(pids) == 3 and os.getpid() not in pids
        wait_until(lambda: len(owner.conns) == 3, what="three slot connections")
        assert {h["pid"] for _, h in owner.conns} == pids
        assert sorted(h["slot"] for _, h in owner.conns) == [0, 1, 2]
        assert all(psutil.Process(p).ppid() == template.proc.pid for p in pids)
        conn, hello = owner.conns[0]
        owner.stop(conn, hello)  # a clean end, reported with its reason
        [stopped] = [f for f in forks if f.pid == hello["pid"]]
        assert stopped.done.wait(30)
        assert (stopped.code, stopped.reason) == (0, "stopped")
        os.kill(owner.conns[1][1]["pid"], signal.SIGKILL)
        [killed] = [f for f in forks if f.pid == owner.conns[1][1]["pid"]]
        assert killed.done.wait(30)
        assert (killed.code, killed.reason) == (-signal.SIGKILL, None)
        # The owner going away ends the last one.
        channel.hangup(owner.conns[2][0])
        [last] = [f for f in forks if f.pid == owner.conns[2][1]["pid"]]
        assert last.done.wait(30)
        assert last.reason == "terminated"
    finally:
        template.close()
        owner.close()
    template.thread.join(30)
    assert template.dead


def test_slot_processes_die_with_their_template():
    owner = _Owner()
    template = slots.Template()
    try:
        forks = [template.fork(owner.spec(i)) for i in range(2)]
        wait_until(lambda: len(owner.conns) == 2, what="two slot connections")
        pids = [f.pid for f in forks]
        wait_until(
            lambda: len(live_children(template.proc.pid)) == 3,
            what="two slot processes and the spare",
        )
        family = live_children(template.proc.pid)
        assert set(pids) < set(family)
        os.kill(template.proc.pid, signal.SIGKILL)  # as if OOM-killed
        wait_until(
            lambda: dead(family),
            timeout=10,
            what="slots and spare of a killed template",
        )
        template.thread.join(30)
        assert template.dead
        assert all(f.done.is_set() and f.error for f in forks)
    finally:
        template.close()
        owner.close()


def test_template_exits_when_its_parent_closes_it():
    owner = _Owner()
    template = slots.Template()
    try:
        f = template.fork(owner.spec())
        wait_until(lambda: owner.conns, what="a slot connection")
        wait_until(
            lambda: len(live_children(template.proc.pid)) == 2,
            what="the slot process and the spare",
        )
        family = [template.proc.pid, *live_children(template.proc.pid)]
        assert f.pid in family
        template.close()  # EOF on its stdin, as when the Dask worker dies
        wait_until(
            lambda: dead(family),
            timeout=10,
            what="the template, its slot and its spare",
        )
    finally:
        template.close()
        owner.close()


def test_a_slot_start_hands_over_the_pre_forked_spare():
    owner = _Owner()
    template = slots.Template()
    try:
        wait_until(
            lambda: len(live_children(template.proc.pid)) == 1,
            timeout=30,
            what="the template's spare, forked once its preloads are done",
        )
        [spare] = live_children(template.proc.pid)
        f = template.fork(owner.spec())
        assert f.started.wait(30)
        assert f.pid == spare  # a hand-over, not a fork
        wait_until(lambda: owner.conns, what="the spare's connection")
        assert owner.conns[0][1]["pid"] == spare
        wait_until(
            lambda: len(live_children(template.proc.pid)) == 2,
            what="the next spare",
        )
        [again] = set(live_children(template.proc.pid)) - {spare}
        # A spare that died before its hand-over is not handed over: a fresh
        # process serves the request, and a new spare follows.
        os.kill(again, signal.SIGKILL)
        wait_until(lambda: not running(again), what="the killed spare gone")
        g = template.fork(owner.spec(1))
        assert g.started.wait(30)
        assert g.pid not in (spare, again)
        wait_until(lambda: len(owner.conns) == 2, what="the second slot's connection")
        assert owner.conns[1][1]["pid"] == g.pid
        wait_until(
            lambda: len(live_children(template.proc.pid)) == 3,
            what="two slot processes and a new spare",
        )
    finally:
        template.close()
        owner.close()
    template.thread.join(30)
    assert template.dead


def _run_script(path, text: str, *args: str, **env: str):
    """Run ``text`` as the script ``path`` in a fresh interpreter (this
    checkout on its path, ``env`` added to the environment); it must exit 0.
    Returns the finished process and the JSON its last line of output holds."""
    path.write_text(text)
    out = subprocess.run(
        [sys.executable, str(path), *args],
        env=dict(os.environ, PYTHONPATH=os.getcwd(), **env),
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert out.returncode == 0, out.stderr
    return out, json.loads(out.stdout.splitlines()[-1])


EARLY_SCRIPT = textwrap.dedent(
    """
    import json
    import os
    import sys
    import threading

    if sys.argv[1] == "thread-first":
        # A thread before fiber_dask's import: no fork is safe any more.
        stop = threading.Event()
        threading.Thread(target=stop.wait, daemon=True).start()
    import fiber_dask  # at the top, as `import fiber_dask as multiprocessing`
    from fiber_dask.engine import slots

    def probe(_=None):
        return os.environ.get(slots.EARLY_ENV)

    def pipes(pid):
        found = set()
        for fd in os.listdir(f"/proc/{pid}/fd"):
            if int(fd) <= 2:
                continue  # stdio: this test's capture pipes, in every process
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("pipe:"):
                found.add(target)
        return found

    def template_facts():
        t = slots._template
        pid = t.proc.pid
        with open(f"/proc/{pid}/stat") as f:
            ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        shared = pipes(pid) & pipes(os.getpid())
        # The worker's resource-tracker pipe is shared on purpose
        # (fiber_dask/transparency/resourcetracker.py): slot processes use that tracker.
        from multiprocessing import resource_tracker

        tracker = os.readlink(f"/proc/self/fd/{resource_tracker.getfd()}")
        tracker_shared = tracker in shared
        shared.discard(tracker)
        return {
            "tracker_shared": tracker_shared,
            "early": slots.started_early,
            "forked": t.forked,
            "parent_is_worker": ppid == os.getpid(),
            "pipes_shared_with_worker": len(shared),
        }

    if __name__ == "__main__":
        import dask

        dask.config.set({"fiber.local.n-workers": 1})
        client = fiber_dask.get_client()
        with fiber_dask.Pool(1) as pool:
            env = pool.apply(probe)
            facts = list(client.run(template_facts).values())
        print(json.dumps([facts, env, os.environ.get(slots.EARLY_ENV)]))
        fiber_dask.shutdown()
    """
)


@pytest.mark.parametrize("order", ["fiber-dask-first", "thread-first"])
def test_embedded_workers_start_their_template_early_as_they_import_fiber_dask(
    tmp_path, order
):
    out, (facts, env_in_slot, env_in_driver) = _run_script(
        tmp_path / "early.py", EARLY_SCRIPT, order
    )
    # The worker started its template from start_early(), not dask_setup; the
    # variable that told it to neither reached the slot process nor stayed in
    # the driver.
    [fact] = facts
    assert fact["early"] is True, out.stdout
    assert fact["parent_is_worker"] is True, out.stdout
    assert (env_in_slot, env_in_driver) == (None, None), out.stdout
    assert fact["tracker_shared"] is True, out.stdout  # however it started
    if order == "fiber-dask-first":
        # Forked from the still single-threaded worker, keeping of the worker's
        # descriptors only its request and report pipes, besides the tracker's
        # (an inherited spawn pipe would be shared too).
        assert fact["forked"] is True, out.stdout
        assert fact["pipes_shared_with_worker"] == 2, out.stdout
    else:
        # A thread was running: a fresh interpreter instead of a fork.
        assert fact["forked"] is False, out.stdout
        assert fact["pipes_shared_with_worker"] == 2, out.stdout


def test_the_embedded_cluster_ticks_every_200_ms(fiber_ctx):
    # Dask's 20 ms event-loop health check, in every process of the cluster,
    # took CPU from the pool's tasks on the same cores (benchmarks/RESULTS.md).
    client = fiber_dask.get_client()
    ticks = client.run(
        lambda dask_worker: dask_worker.periodic_callbacks["tick"].callback_time
    )
    assert set(ticks.values()) == {200.0}
    scheduler_tick = client.run_on_scheduler(
        lambda dask_scheduler: dask_scheduler.periodic_callbacks["tick"].callback_time
    )
    assert scheduler_tick == 200.0


PROFILE_SCRIPT = textwrap.dedent(
    """
    import json
    import fiber_dask

    if __name__ == "__main__":
        client = fiber_dask.get_client()
        times = client.run(
            lambda dask_worker: dask_worker.periodic_callbacks["profile"].callback_time
        )
        print(json.dumps(sorted(set(times.values()))))
        fiber_dask.shutdown()
    """
)


@pytest.mark.parametrize(
    ("configured", "expected"), [(None, [100.0]), ("30ms", [30.0])]
)
def test_thread_slot_workers_sample_their_profile_every_100_ms_unless_configured(
    tmp_path, configured, expected
):
    # Dask's 10 ms profiler timer fires in every worker's event loop even when
    # thread slots keep out of it: 0.21 of a core for 8 idle workers, 0.05 at
    # 100 ms (benchmarks/RESULTS.md, issue 15).  A value the user set is kept.
    (tmp_path / "fiber.yaml").write_text(
        "fiber:\n  local: {n-workers: 2}\n  pool: {slots: thread}\n"
        + (
            f"distributed:\n  worker:\n    profile: {{interval: {configured}}}\n"
            if configured
            else ""
        )
    )
    out, intervals = _run_script(
        tmp_path / "profile.py", PROFILE_SCRIPT, DASK_CONFIG=str(tmp_path)
    )
    assert intervals == expected, out.stdout
