"""``parent_process()`` in a grandchild follows the child that started it.

The child (itself a Process) starts a grandchild and is SIGKILLed once the
grandchild has said it runs; the grandchild's ``parent_process().sentinel``
must become ready and ``is_alive()`` false, as with the stdlib (oracle: spawn).
On fiber-dask the grandchild learns it from its launcher, whose connection to
the child drops when the child dies, wherever the two run; it is then killed
``launcher.ORPHAN_GRACE`` seconds later unless it has ended (the stdlib leaves
orphans running).
"""

from __future__ import annotations

import os

import psutil
import pytest
from support.wait import wait_until
from tasks import parent as hp

from fiber_dask.launch import launcher


def _lines(path: str) -> list[str]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [line.split() for line in f.read().splitlines()]


def _find(path: str, first: str) -> list[str] | None:
    return next((w for w in _lines(path) if w[0] == first), None)


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _start(ctx, path: str, kind: str, watch: bool):
    child = ctx.Process(target=hp.start_grandchild, args=(path, kind, watch))
    child.start()
    grandchild = wait_until(
        lambda: _find(path, "grandchild"), 60, "the grandchild's started marker"
    )
    return child, grandchild


@pytest.mark.timeout(120)
def test_grandchild_sees_its_parent_die(ctx, tmp_path):
    kind = "fiber" if type(ctx).__module__.startswith("fiber_dask") else "stdlib"
    path = str(tmp_path / "log")
    child, grandchild = _start(ctx, path, kind, watch=True)
    assert grandchild[2] == "alive"
    assert _find(path, "sentinel") is None, "the sentinel was ready too early"

    child.kill()
    child.join(30)
    assert child.exitcode == -9
    seen = wait_until(
        lambda: _find(path, "sentinel"), 30, "the grandchild to see its parent die"
    )
    assert seen[1:] == ["ready", "dead"]
    # It ended by itself, well before any grace ran out.
    pid = int(grandchild[1])
    wait_until(lambda: _gone(pid), 30, f"the grandchild (pid {pid}) to exit")


@pytest.mark.timeout(120)
def test_fiber_orphan_is_killed_after_the_grace(fiber_ctx, tmp_path):
    """A grandchild that ignores its parent's death does not outlive it by
    more than the grace (no orphan keeps its worker's resources)."""
    path = str(tmp_path / "log")
    child, grandchild = _start(fiber_ctx, path, "fiber", watch=False)
    pid = int(grandchild[1])
    child.kill()
    child.join(30)
    wait_until(
        lambda: _gone(pid),
        launcher.ORPHAN_GRACE + 30,
        f"the orphaned grandchild (pid {pid}) to be killed",
    )
