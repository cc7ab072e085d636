"""A pool that waits for task slots says at once who holds them (fiber_dask.engine.poolwait).

Real clusters on loopback, real programs holding the slots:

* a shared cluster of 2 single-thread workers (with the pools plugin, as the
  embedded cluster and ``fiber-dask up`` start it, and without it); program A,
  a separate process, holds both slots with an idle ``Pool(2)``; a map of this
  process's pool waits: within seconds one warning names A's pool, program,
  pid, its slots, that it is idle and ``fiber.pool.idle-timeout``; once A
  closes its pool the map completes, right;
* this process's own busy pool holding the slots: said at INFO, naming it,
  never a warning (a normal start on the free cluster says nothing either);
* a program on the embedded cluster, looking for held slots every 0.05 s:
  neither its first pool's start (the workers still starting) nor a second
  pool's (the cluster growing for it while the first holds the slots) says
  anything.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest
from distributed import Client, LocalCluster
from support.wait import wait_for_file, wait_until
from tasks.conformance import square
from tasks.dashboard import hold

import fiber_dask
from fiber_dask.engine import poolwait

pytestmark = pytest.mark.timeout(180)

#: What every message of poolwait starts its "held" sentence with.
HELD = "task slots of the cluster at"


def shared_cluster(plugin: bool) -> LocalCluster:
    """2 worker processes of one thread on 127.0.0.1, the scheduler with (or
    without) the pools plugin, as the embedded cluster starts it."""
    return LocalCluster(
        n_workers=2,
        threads_per_worker=1,
        processes=True,
        host="127.0.0.1",
        dashboard_address=None,
        scheduler_kwargs={"preload": ["fiber_dask.dashboard"]} if plugin else {},
        preload=["fiber_dask.engine.slots"],
    )


class Records(logging.Handler):
    """The records of the ``fiber_dask.pool`` logger while it is attached."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def held(self, level: int | None = None) -> list[logging.LogRecord]:
        return [
            r
            for r in list(self.records)
            if HELD in r.getMessage() and (level is None or r.levelno == level)
        ]


@pytest.fixture
def records():
    logger = logging.getLogger("fiber_dask.pool")
    handler, old_level = Records(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DASK_")}
    env.update(extra)
    return env


HOLDER = """\
import json, os, sys, time
import fiber_dask

if __name__ == "__main__":
    address, ready, release = sys.argv[1:4]
    fiber_dask.init(address=address)
    with fiber_dask.Pool(2) as pool:
        # Both slots running (a slot's pid waits for its process), then idle.
        pids = [slot.pid for slot in pool._pool]
        assert all(pids), pids
        assert pool.map(abs, range(-4, 0)) == [4, 3, 2, 1]
        with open(ready + ".tmp", "w") as f:
            json.dump({"pid": os.getpid(), "id": pool._engine._token}, f)
        os.rename(ready + ".tmp", ready)
        deadline = time.monotonic() + 150
        while not os.path.exists(release):
            assert time.monotonic() < deadline, "never released"
            time.sleep(0.05)
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    "plugin, slots",
    [(True, "process"), (False, "thread")],
    ids=["plugin-process-slots", "no-plugin-thread-slots"],
)
def test_a_pool_behind_another_programs_idle_pool_says_who_holds_the_slots(
    plugin, slots, records, tmp_path: pathlib.Path
) -> None:
    program = tmp_path / "holder.py"
    program.write_text(HOLDER)
    ready, release = tmp_path / "ready", tmp_path / "release"
    with (
        shared_cluster(plugin) as cluster,
        Client(cluster, set_as_default=False) as client,
    ):
        address = cluster.scheduler_address
        holder = subprocess.Popen(
            [sys.executable, str(program), address, str(ready), str(release)],
            env=_env(DASK_FIBER__POOL__SLOTS=slots),
            stdin=subprocess.DEVNULL,
        )
        try:
            wait_for_file(str(ready), 90)
            a = json.loads(ready.read_text())
            with fiber_dask.Pool(2, client=client) as pool:
                res = pool.map_async(square, range(10))
                (record,) = wait_until(
                    lambda: records.held(),
                    poolwait.HELD_AFTER + 20,
                    "the waiting pool to say who holds the slots",
                )
                message = record.getMessage()
                assert record.levelno == logging.WARNING, message
                assert not res.ready()  # it really waited
                name = pool._engine._stats.name
                assert message.startswith(
                    f"fiber-dask: {name} of this process has 10 items waiting and "
                    "none of its "
                    f"slots is running: all 2 task slots of the cluster at "
                    f"{address} are held, by "
                ), message
                if plugin:
                    assert (
                        f"Pool-1 of holder.py (pid {a['pid']} on " in message
                        and ": 2 slots, idle (nothing queued or in flight), "
                        "fiber.pool.idle-timeout is not set there"
                        in message
                    ), message
                else:
                    assert (
                        f"the fiber-dask pool {a['id']} (tasks fiber-pool-{a['id']}-*)"
                        ": 2 slots (its owner is not known: the scheduler has no "
                        "fiber-dask pools plugin"
                    ) in message, message
                assert "set fiber.pool.idle-timeout where it runs" in message
                assert "DASK_FIBER__POOL__IDLE_TIMEOUT=30s" in message
                # Once A closes its pool, the map runs, right.
                release.touch()
                assert res.get(timeout=60) == [x * x for x in range(10)]
            assert holder.wait(60) == 0
            # One warning per wait, and not the 60 s one besides.
            assert len(records.held()) == 1
        finally:
            release.touch()
            if holder.poll() is None:
                holder.kill()
                holder.wait(30)


@pytest.mark.slow
def test_a_pool_behind_this_processes_busy_pool_says_so_without_warning(
    records, tmp_path: pathlib.Path, monkeypatch
) -> None:
    # Look at once and often: a normal start must say nothing even so.
    monkeypatch.setattr(poolwait, "HELD_AFTER", 0.05)
    with (
        shared_cluster(True) as cluster,
        Client(cluster, set_as_default=False) as client,
    ):
        first = fiber_dask.Pool(2, client=client)
        try:
            assert first.map(square, range(4)) == [0, 1, 4, 9]
            assert records.held() == []  # a normal start on a free cluster
            # ``hold`` waits for the release file: both slots busy.
            busy = first.map_async(
                functools.partial(hold, directory=str(tmp_path)), range(2), chunksize=1
            )
            for x in range(2):
                wait_for_file(str(tmp_path / f"started-{x}"), 60)
        except BaseException:
            first.terminate()
            raise
        with fiber_dask.Pool(2, client=client) as second:
            res = second.map_async(square, range(6))
            (record,) = wait_until(
                lambda: records.held(),
                20,
                "the waiting pool to say that this process's pool holds the slots",
            )
            message = record.getMessage()
            assert record.levelno == logging.INFO, message
            first_name = first._engine._stats.name
            assert f"{first_name} of this process (pid {os.getpid()} on " in message
            assert ": 2 slots, busy, fiber.pool.idle-timeout is not set:" in message
            first.close()  # closing: its slots are freed once its work is done
            (tmp_path / "release").touch()
            assert busy.get(timeout=60) == [0, 1]
            assert res.get(timeout=60) == [x * x for x in range(6)]
            first.join()
        assert records.held(logging.WARNING) == [], records.held()


EMBEDDED = """\
import logging, sys
import fiber_dask
from fiber_dask.engine import poolwait

class Held(logging.Handler):
    def emit(self, record):
        if "task slots of the cluster at" in record.getMessage():
            print("HELD " + record.getMessage(), flush=True)

def square(x):
    return x * x

if __name__ == "__main__":
    poolwait.HELD_AFTER = 0.05  # look at once and often
    logger = logging.getLogger("fiber_dask.pool")
    logger.setLevel(logging.DEBUG)
    logger.addHandler(Held())
    # The cluster starts with this pool's work waiting for its workers.
    with fiber_dask.Pool(2) as first:
        assert first.map(square, range(8)) == [x * x for x in range(8)]
        # Its 2 slots held (idle): the cluster grows for the second pool.
        with fiber_dask.Pool(2) as second:
            assert second.map(square, range(8)) == [x * x for x in range(8)]
    print("OK", flush=True)
"""


@pytest.mark.slow
def test_starting_and_growing_the_embedded_cluster_says_nothing(
    tmp_path: pathlib.Path,
) -> None:
    program = tmp_path / "embedded.py"
    program.write_text(textwrap.dedent(EMBEDDED))
    result = subprocess.run(
        [sys.executable, str(program)],
        env=_env(
            DASK_FIBER__LOCAL__N_WORKERS="2",
            DASK_FIBER__UP__USE="false",
            # Workers that take a while to start: the cluster grows for the
            # second pool while the first holds the slots it has.
            DASK_FIBER__LOCAL__WORKER_START="spawn",
        ),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["OK"], result.stdout
