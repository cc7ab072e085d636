"""Adaptive scaling for real, on the local backend: worker processes come when a
Pool has work and go when it is closed.

The cluster is started by fiber-dask from ``fiber.adaptive`` in a separate
Python process (its own cluster, not the session's; the process counts its own
children), with short interval / wait-count / target-duration so that the
test takes seconds, not the ~20 s scale-down of Dask's defaults.  The probe
reports what it saw as JSON; the assertions are here.
"""

from __future__ import annotations

import json
import textwrap

import pytest
from support.programs import run_reporting

MINIMUM, MAXIMUM = 1, 3

PROBE = (
    textwrap.dedent(
        """
    import json, os, threading, time
    import psutil

    def work(x):
        import os, time
        time.sleep(0.05)
        return os.getpid()

    def worker_processes():
        # Dask worker processes: spawned by a nanny (a child of this process
        # running spawn_main), or forked by the embedded cluster's worker
        # server (a child of that child).  Slot templates and slot processes
        # are their children, not counted.
        me, n = os.getpid(), 0
        for p in psutil.Process().children(recursive=True):
            try:
                if p.status() == "zombie":
                    continue
                cmd, parent = " ".join(p.cmdline()), p.ppid()
                if parent == me and "spawn_main" in cmd:
                    n += 1
                elif (
                    "workerstart import serve" in cmd
                    and parent != me
                    and psutil.Process(parent).ppid() == me
                ):
                    n += 1
            except psutil.Error:
                pass
        return n

    if __name__ == "__main__":
        import fiber_dask

        out = {}
        t0 = time.monotonic()
        client = fiber_dask.init()
        def workers():
            return len(client.scheduler_info(n_workers=-1)["workers"])
        samples = []
        stop = threading.Event()
        def sample():
            while not stop.is_set():
                samples.append((time.monotonic() - t0, workers(), worker_processes()))
                time.sleep(0.05)
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()

        def wait(predicate, timeout):
            start = time.monotonic()
            while not predicate():
                if time.monotonic() - start > timeout:
                    return None
                time.sleep(0.05)
            return time.monotonic() - start

        MIN, MAX = @MINIMUM@, @MAXIMUM@
        out["start_to_minimum"] = wait(
            lambda: workers() == MIN and worker_processes() == MIN, 60)
        out["idle_workers"] = workers()
        out["idle_processes"] = worker_processes()

        t_pool = time.monotonic()
        pool = fiber_dask.Pool()
        out["pool_repr"] = repr(pool)
        # Keep the pool busy until every worker adaptive scaling started has run
        # tasks (bounded: a minute), however slowly a loaded machine starts them.
        pids = set()
        rounds = 0
        while rounds < 2 or (
            (workers() < MAX or len(pids) < MAX) and time.monotonic() - t_pool < 60
        ):
            pids.update(pool.map(work, range(60), chunksize=1))
            rounds += 1
        out["map_seconds"] = time.monotonic() - t_pool
        out["distinct_pids"] = len(pids)
        up = [t for t, w, p in samples if t >= t_pool - t0 and w == MAX and p == MAX]
        out["scale_up_seconds"] = up[0] - (t_pool - t0) if up else None

        # An open pool keeps its processes, even idle (as the stdlib's does):
        # 1 s is over three times what adaptive takes to retire an idle
        # worker here (interval 100 ms x wait-count 3).
        time.sleep(1.0)
        out["open_idle_workers"] = workers()
        pool.close()
        pool.join()
        t_closed = time.monotonic()
        out["scale_down_seconds"] = wait(
            lambda: workers() == MIN and worker_processes() == MIN, 60)
        out["after_workers"] = workers()
        out["after_processes"] = worker_processes()
        time.sleep(0.5)  # and it stays there
        stop.set()
        sampler.join()
        out["max_workers_seen"] = max(w for _, w, _ in samples)
        out["max_processes_seen"] = max(p for _, _, p in samples)
        out["final_workers"] = workers()
        fiber_dask.shutdown()
        print("RESULT " + json.dumps(out), flush=True)
    """
    )
    .replace("@MINIMUM@", str(MINIMUM))
    .replace("@MAXIMUM@", str(MAXIMUM))
)


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_local_adaptive_scales_up_under_a_pool_and_down_when_idle(tmp_path) -> None:
    script = tmp_path / "adaptive_probe.py"
    script.write_text(PROBE)
    r, _ = run_reporting(
        script,
        settings={
            "DASK_FIBER__BACKEND": "local",
            "DASK_FIBER__ADAPTIVE__ENABLED": "true",
            "DASK_FIBER__ADAPTIVE__MINIMUM": str(MINIMUM),
            "DASK_FIBER__ADAPTIVE__MAXIMUM": str(MAXIMUM),
            "DASK_FIBER__ADAPTIVE__TARGET_DURATION": "1s",
            "DASK_FIBER__ADAPTIVE__INTERVAL": "100ms",
            "DASK_FIBER__ADAPTIVE__WAIT_COUNT": "3",
            "DASK_FIBER__LOCAL__DASHBOARD_ADDRESS": "None",
        },
        timeout=140,
    )
    print("adaptive:", json.dumps(r, indent=1))

    # idle: the minimum, as scheduler workers and as OS processes
    assert r["start_to_minimum"] is not None, r
    assert (r["idle_workers"], r["idle_processes"]) == (MINIMUM, MINIMUM), r
    # Pool() on an adaptive cluster is as large as the cluster may grow
    assert f"pool_size={MAXIMUM}" in r["pool_repr"], r
    # under the pool's load: up to the maximum, and every one of them worked
    assert r["scale_up_seconds"] is not None, r
    assert r["distinct_pids"] == MAXIMUM, r
    # never past the maximum
    assert r["max_workers_seen"] == MAXIMUM, r
    assert r["max_processes_seen"] == MAXIMUM, r
    # an open (idle) pool keeps its workers; closed, they go back to the minimum
    assert r["open_idle_workers"] == MAXIMUM, r
    assert r["scale_down_seconds"] is not None, r
    assert (r["after_workers"], r["after_processes"]) == (MINIMUM, MINIMUM), r
    assert r["final_workers"] == MINIMUM, r
    assert r["scale_up_seconds"] < 30 and r["scale_down_seconds"] < 30, r
