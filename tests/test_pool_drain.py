"""Draining at the end of a worker's life (``fiber.pool.drain-timeout``,
:mod:`fiber_dask.engine.pooldrain`).

When Dask starts closing a worker gracefully (its lifetime, which
dask-jobqueue sets from the walltime; adaptive or Kubernetes retiring it), the
pool's slots there take no new chunk, finish the one they run, hand the rest
back and leave; the worker closes, other slots take their place, and nothing
runs twice.  Here, for real, in a program of its own whose embedded cluster's
workers have a 3 s lifetime and are restarted by their nannies
(``distributed.worker.lifetime.*``):

* a map that outlives several worker lifetimes: every item started and
  finished exactly once (one marker file per start and per finish), in more
  slot processes than the pool has slots, with no worker loss counted; for
  process slots, relayed slots and thread slots;
* a chunk longer than ``fiber.pool.drain-timeout``: it is interrupted at the
  timeout and finishes once elsewhere, counted as cut and re-run.

The same on a real SLURM, with dask-jobqueue's ``--lifetime``, is in
``test_slurm.py``.
"""

from __future__ import annotations

import json
import os
import textwrap

import pytest
from support.programs import run_reporting

from fiber_dask.engine import pooldrain
from fiber_dask.engine import poolprotocol as proto

PROGRAM = textwrap.dedent(
    """
    import json, os, sys, time, uuid

    D = sys.argv[1]
    SECONDS = float(sys.argv[2])
    LONG = int(sys.argv[3])  # this item runs 60 s the first time (-1: none)

    def mark(kind, x):
        open(os.path.join(D, "%s-%d-%s" % (kind, x, uuid.uuid4().hex)), "w").close()

    def work(x):
        first = not any(n.startswith("start-%d-" % x) for n in os.listdir(D))
        mark("start", x)
        # small sleeps: a TERMINATE interrupts it between two
        for _ in range(600 if x == LONG and first else 1):
            time.sleep(0.1 if x == LONG and first else SECONDS)
        mark("finish", x)
        return x * x, os.getpid(), os.environ.get("FIBER_DASK_WORKER_ADDRESS")

    if __name__ == "__main__":
        import fiber_dask

        out = {}
        # the cluster up first: the pool's slots are all the cluster's (the
        # first pool of a program otherwise starts on early slots)
        fiber_dask.init()
        t0 = time.monotonic()
        with fiber_dask.Pool(2) as pool:
            e = pool._engine
            got = pool.map(work, range(int(sys.argv[4])), chunksize=1)
            out["map_seconds"] = time.monotonic() - t0
            out["ok"] = [v for v, _, _ in got] == [x * x for x in range(len(got))]
            out["pids"] = sorted({p for _, p, _ in got})
            out["workers"] = sorted({w for _, _, w in got})
            d = e._drain
            out["drain"] = {
                "started": d.started, "drained": d.drained, "cut": d.cut,
                "handed_back": d.handed_back,
            }
            out["reruns"] = e._stats.reruns
            out["loop_failures"] = e._loops.failures
        fiber_dask.shutdown()
        print("RESULT " + json.dumps(out), flush=True)
    """
)


#: The embedded cluster of the drain programs: two worker processes.
TWO_WORKERS = {
    "DASK_FIBER__BACKEND": "local",
    "DASK_FIBER__LOCAL__N_WORKERS": "2",
    "DASK_FIBER__LOCAL__DASHBOARD_ADDRESS": "None",
}


def _run(tmp_path, *, seconds: float, long: int, items: int, **env_extra) -> tuple:
    script = tmp_path / "drain_probe.py"
    script.write_text(PROGRAM)
    marks = tmp_path / "marks"
    marks.mkdir()
    r, stderr = run_reporting(
        script,
        marks,
        seconds,
        long,
        items,
        settings={
            **TWO_WORKERS,
            "DASK_DISTRIBUTED__WORKER__LIFETIME__DURATION": "3s",
            "DASK_DISTRIBUTED__WORKER__LIFETIME__RESTART": "true",
            **env_extra,
        },
    )
    counts: dict[str, dict[int, int]] = {"start": {}, "finish": {}}
    for name in os.listdir(marks):
        kind, x, _ = name.split("-")
        counts[kind][int(x)] = counts[kind].get(int(x), 0) + 1
    return r, counts, stderr


#: How the slots run: their own processes (the default), through their worker
#: process's relay (pools of 64 slots or more), or in the Dask task's thread.
SLOTS = {
    "process": {},
    "relay": {"DASK_FIBER__POOL__RELAY": "true"},
    "thread": {"DASK_FIBER__POOL__SLOTS": "thread"},
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("slots", list(SLOTS))
def test_worker_lifetime_mid_map_drains_slots_and_runs_nothing_twice(
    tmp_path, slots: str
) -> None:
    items = 40
    r, counts, err = _run(tmp_path, seconds=0.25, long=-1, items=items, **SLOTS[slots])
    print("drain:", json.dumps(r))
    assert r["ok"], r
    # the workers closed under the map (3 s lifetime, ~5 s of work per slot):
    # its slots left them and new slot processes on the restarted workers
    # took their place
    assert r["drain"]["started"] >= 2 and r["drain"]["drained"] >= 2, r
    # (thread slots: the worker processes themselves, which the nannies restart)
    assert len(r["pids"]) > 2, r
    if slots != "thread":
        assert len(r["workers"]) > 2, r
    # nothing ran twice, nothing was lost, nothing counted as a loss
    assert counts["start"] == {x: 1 for x in range(items)}, counts
    assert counts["finish"] == {x: 1 for x in range(items)}, counts
    assert r["drain"]["cut"] == 0 and r["reruns"] == 0, r
    assert r["loop_failures"] == 0, r
    # (the pool's own words for a loss; a nanny may log its worker process's
    # end in other words, which are Dask's)
    assert "re-running" not in err and "pool loop ended" not in err, err[-3000:]


@pytest.mark.timeout(120)
def test_a_chunk_past_the_drain_timeout_runs_once_elsewhere(tmp_path) -> None:
    items = 12
    r, counts, err = _run(
        tmp_path,
        seconds=0.2,
        long=0,
        items=items,
        DASK_FIBER__POOL__DRAIN_TIMEOUT="1s",
    )
    print("drain timeout:", json.dumps(r))
    assert r["ok"], r
    # item 0 ran 60 s the first time: cut at the drain timeout, run again
    # elsewhere (short then), finished once; every other item ran once
    assert counts["start"][0] == 2, counts
    assert counts["finish"] == {x: 1 for x in range(items)}, counts
    assert {x: n for x, n in counts["start"].items() if x} == {
        x: 1 for x in range(1, items)
    }, counts
    assert r["drain"]["cut"] >= 1 and r["reruns"] >= 1, r
    assert r["map_seconds"] < 40, r  # not the 60 s the first run would take
    assert "fiber.pool.drain-timeout=1s" in err, err[-3000:]


RETIRE = textwrap.dedent(
    """
    import json, os, sys, time, uuid

    D = sys.argv[1]

    def mark(kind, x):
        open(os.path.join(D, "%s-%d-%s" % (kind, x, uuid.uuid4().hex)), "w").close()

    def work(x):
        mark("start", x)
        time.sleep(0.3)
        mark("finish", x)
        return x * x, os.environ.get("FIBER_DASK_WORKER_ADDRESS")

    if __name__ == "__main__":
        import fiber_dask
        from support.wait import wait_until

        client = fiber_dask.init()
        out = {}
        with fiber_dask.Pool(2) as pool:
            e = pool._engine
            result = pool.map_async(work, range(30), chunksize=1)
            wait_until(
                lambda: sum(n.startswith("finish-") for n in os.listdir(D)) >= 4,
                60, "a few items to finish",
            )
            # what adaptive scaling and the Kubernetes operator do to a worker
            [worker] = [p.worker for p in e._peers.values()][:1]
            out["retired"] = list(client.retire_workers([worker]))
            got = result.get(60)
            out["ok"] = [v for v, _ in got] == [x * x for x in range(30)]
            out["workers"] = sorted({w for _, w in got})
            out["after"] = sorted({w for _, w in got[-5:]})
            out["worker"] = worker
            d = e._drain
            out["drain"] = {"started": d.started, "drained": d.drained, "cut": d.cut}
            out["reruns"] = e._stats.reruns
        fiber_dask.shutdown()
        print("RESULT " + json.dumps(out), flush=True)
    """
)


@pytest.mark.timeout(120)
def test_a_retired_worker_drains_its_slot(tmp_path) -> None:
    """``Client.retire_workers`` (adaptive scaling's and the Kubernetes
    operator's way to remove a worker) mid-map: its slot finishes its item and
    leaves, the map finishes on the other worker, every item once."""
    script = tmp_path / "retire_probe.py"
    script.write_text(RETIRE)
    marks = tmp_path / "marks"
    marks.mkdir()
    r, _ = run_reporting(script, marks, settings=TWO_WORKERS)
    print("retire:", json.dumps(r))
    assert r["ok"] and r["retired"] == [r["worker"]], r
    assert r["drain"] == {"started": 1, "drained": 1, "cut": 0}, r
    assert r["reruns"] == 0, r
    assert r["worker"] not in r["after"], r  # the map ended elsewhere
    starts = sorted(n.split("-")[1] for n in os.listdir(marks) if n[0] == "s")
    finishes = sorted(n.split("-")[1] for n in os.listdir(marks) if n[0] == "f")
    assert starts == finishes == sorted(str(x) for x in range(30)), (starts, finishes)


# ------------------------------------------------------- the loop's side


def test_drain_is_a_signal_of_the_protocol_and_drained_a_normal_end() -> None:
    [(loop, msg)] = proto.decode_frame(proto.encode_frame([(3, proto.DRAIN)]))
    assert loop == 3 and msg is proto.DRAIN
    assert proto.Reason.DRAINED in proto.Reason.NORMAL


def test_a_retirement_given_up_is_forgotten() -> None:
    address = "tcp://192.0.2.1:1234"  # no such worker: only the record moves
    try:
        closing = {"action": "worker-status-change", "status": "closing_gracefully"}
        pooldrain._on_event(None, address, closing)
        assert address in pooldrain._closing
        # the scheduler gave the retirement up (its data had nowhere to go)
        pooldrain._on_event(
            None, address, {"action": "worker-status-change", "status": "running"}
        )
        assert address not in pooldrain._closing
        pooldrain._on_event(None, address, {"action": "remove-worker"})
        assert address in pooldrain._closing
    finally:
        pooldrain._closing.pop(address, None)


def test_a_worker_that_closed_before_the_subscription_is_still_seen() -> None:
    """The scheduler keeps a worker's events: one subscribed to after it
    started closing is looked up (``_look_back``), so a loop that attaches
    from it then is drained at once."""
    from distributed import Client, LocalCluster
    from support.wait import wait_until

    with (
        LocalCluster(
            n_workers=2, processes=False, threads_per_worker=1, dashboard_address=":0"
        ) as lc,
        Client(lc) as client,
    ):
        worker = sorted(client.scheduler_info()["workers"])[0]
        client.retire_workers([worker])
        assert worker not in pooldrain._closing
        try:
            pooldrain._subscribe(client, worker)
            wait_until(
                lambda: worker in pooldrain._closing,
                10,
                "the retired worker's past events to be read",
            )
        finally:
            pooldrain._closing.pop(worker, None)
