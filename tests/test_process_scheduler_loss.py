"""A fiber ``Process`` started after its Dask scheduler was SIGKILLed says so.

A real ``dask scheduler`` and ``dask worker`` process pair on 127.0.0.1,
started here and attached with ``address=``; the scheduler is SIGKILLed.  A
Process started then either raises ``ClusterConnectionError`` or ends with a
``reason`` naming the address and ``fiber.connect-timeout``, within about
that timeout — not an unexplained ``exitcode == -9`` when Dask's own
reconnect gives up.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import dask.config
import pytest
from support.wait import wait_for_file, wait_until
from tasks import process as hp

from fiber_dask import cluster
from fiber_dask.comm.ports import PortReservation
from fiber_dask.errors import ClusterConnectionError
from fiber_dask.process import Process

pytestmark = pytest.mark.timeout(120)

CONNECT_TIMEOUT = 3.0  # below Dask's own 10 s reconnect: the setting must count


def _dask(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "distributed.cli.dask_" + args[0], *args[1:]],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


@pytest.fixture
def scheduler_and_worker():
    # Held until the scheduler listens there (the test waits for that).
    reserved = PortReservation("127.0.0.1")
    port = reserved.port
    address = f"tcp://127.0.0.1:{port}"
    sched = _dask(
        "scheduler", "--host", "127.0.0.1", "--port", str(port),
        "--dashboard-address", ":0", "--no-show",
    )  # fmt: skip
    worker = _dask(
        "worker", address, "--nthreads", "1", "--nworkers", "1",
        "--no-dashboard", "--host", "127.0.0.1",
    )  # fmt: skip
    try:
        yield address, sched, reserved
    finally:
        reserved.release()
        handle = cluster._attached.pop(address, None)
        for proc in (worker, sched):
            proc.kill()
            proc.wait(30)
        if handle is not None:
            try:
                handle.client.close(timeout=2)
            except Exception:
                pass


def _expect_lost(exc_or_reason: str, address: str) -> None:
    assert address in exc_or_reason, exc_or_reason
    assert "fiber.connect-timeout" in exc_or_reason, exc_or_reason


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def test_process_started_after_the_scheduler_was_killed(scheduler_and_worker, tmp_path):
    address, sched, reserved = scheduler_and_worker
    port = int(address.rsplit(":", 1)[1])
    wait_until(lambda: _listening(port), 60, "the dask scheduler to listen")
    reserved.release()
    client = cluster.get_handle(address=address).client
    wait_until(
        lambda: client.scheduler_info()["workers"], 60, "the dask worker to register"
    )
    marker = str(tmp_path / "ran")
    first = Process(target=hp.touch, args=(marker,), address=address)
    first.start()
    wait_for_file(marker, 60)
    first.join(30)
    assert first.exitcode == 0

    with dask.config.set({"fiber.connect-timeout": f"{CONNECT_TIMEOUT}s"}):
        os.kill(sched.pid, signal.SIGKILL)
        sched.wait(10)
        # Right after the kill the client may not know yet: either outcome
        # must say what happened, soon.
        t0 = time.monotonic()
        p = Process(target=hp.touch, args=(str(tmp_path / "never"),), address=address)
        try:
            p.start()
        except ClusterConnectionError as e:
            _expect_lost(str(e), address)
        else:
            p.join(CONNECT_TIMEOUT + 20)
            assert p.exitcode is not None, "the Process never ended"
            assert p.exitcode != 0
            _expect_lost(p.reason or "", address)
        assert time.monotonic() - t0 < CONNECT_TIMEOUT + 5

        # Once the client knows, start() itself raises, after at most the
        # connect timeout (Dask would keep trying for 10 s).
        wait_until(
            lambda: client.status != "running", 30, "the client to notice the loss"
        )
        t0 = time.monotonic()
        with pytest.raises(ClusterConnectionError) as info:
            Process(target=hp.touch, args=("x",), address=address).start()
        _expect_lost(str(info.value), address)
        assert time.monotonic() - t0 < CONNECT_TIMEOUT + 5
        assert not os.path.exists(tmp_path / "never")
