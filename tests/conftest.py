"""Shared fixtures: the stdlib oracle and fiber_dask as two values of ``ctx``.

The conformance suite asks one question per test — "does fiber_dask do what stdlib
``multiprocessing`` does?" — by running the same body against

* ``stdlib``: ``multiprocessing.get_context("forkserver")``.  Not ``fork``: this
  pytest process also runs Dask's threads (the embedded scheduler, the client's
  event loop), and forking a multi-threaded process can copy a held lock into the
  child and deadlock it.
* ``fiber``: ``fiber_dask.get_context()``, bound to fiber_dask's embedded cluster,
  which starts lazily on first use and is shared by the whole session.

At session end the embedded cluster is shut down and we check that no worker
process outlived it (loky's lesson: a leaked worker is a bug, and it is easy to
miss unless a teardown asserts on it); at the end of the run, that no named
semaphore was left in /dev/shm.
"""

from __future__ import annotations

import multiprocessing
import os
import sys

import dask.config
import psutil
import pytest

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))

# Workers must import ``tasks`` by name.  Spawned / forkserver children inherit
# ``sys.path`` from the parent's preparation data, but a worker started another
# way (a subprocess, ``dask worker`` on the command line) only sees PYTHONPATH.
if TESTS_DIR not in sys.path:
    sys.path.insert(0, TESTS_DIR)
_pythonpath = os.environ.get("PYTHONPATH", "")
if TESTS_DIR not in _pythonpath.split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (TESTS_DIR, _pythonpath) if p)

from support import semaphores  # noqa: E402 - needs TESTS_DIR on sys.path
from support.wait import wait_until  # noqa: E402

N_WORKERS = 2

# Seconds a worker process gets to exit after ``fiber_dask.shutdown()`` before it
# counts as leaked.
LEAK_GRACE = 10.0


def _is_stdlib_helper_process(proc: psutil.Process) -> bool:
    """The forkserver and resource tracker live until this interpreter exits.

    Only the processes themselves (direct children) are exempt.  Children *of the
    forkserver* are stdlib pool workers, which every test joins, so they stay under
    the leak check.
    """
    try:
        if proc.ppid() != os.getpid():
            return False
        cmdline = " ".join(proc.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False
    return (
        "multiprocessing.forkserver import main" in cmdline
        or "multiprocessing.resource_tracker import main" in cmdline
    )


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _describe(proc: psutil.Process) -> str:
    try:
        return f"pid={proc.pid} ppid={proc.ppid()} cmdline={' '.join(proc.cmdline())!r}"
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return f"pid={proc.pid} (gone or inaccessible)"


def _check_no_leaked_processes(preexisting: set[int]) -> None:
    me = psutil.Process()
    candidates = [
        p
        for p in me.children(recursive=True)
        if p.pid not in preexisting and not _is_stdlib_helper_process(p) and _alive(p)
    ]
    if not candidates:
        return
    # Shutdown may still be reaping its workers: give them a grace period.
    _, still_alive = psutil.wait_procs(candidates, timeout=LEAK_GRACE)
    leaked = [p for p in still_alive if _alive(p)]
    if not leaked:
        return
    details = "\n  ".join(_describe(p) for p in leaked)
    # Kill them (they are descendants of this test process) so a failed run does not
    # leave workers behind on the machine, then fail loudly.
    for p in leaked:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    pytest.fail(
        f"{len(leaked)} child process(es) still alive {LEAK_GRACE:.0f}s after "
        f"fiber_dask.shutdown() (killed now):\n  {details}",
        pytrace=False,
    )


@pytest.fixture(scope="session", autouse=True)
def _fiber_session():
    """Configure fiber_dask's embedded cluster for the session; tear it down after.

    The cluster itself is created lazily by fiber_dask on first use; we only set
    the config it reads, for the whole session, and shut it down at the end.
    """
    preexisting = {p.pid for p in psutil.Process().children(recursive=True)}
    with dask.config.set({"fiber.local.n-workers": N_WORKERS}):
        try:
            yield
        finally:
            # Only if a test imported it: a stdlib-only run never starts a cluster.
            fiber_dask = sys.modules.get("fiber_dask")
            shutdown = getattr(fiber_dask, "shutdown", None)
            if shutdown is not None:
                shutdown()
    _check_no_leaked_processes(preexisting)


# Named semaphores: /dev/shm is the machine's, so the check is the whole run's,
# made once by the process that runs the others (pytest-xdist's controller, or
# the only one): a worker that finished first saw, as left behind, semaphores
# that another worker's test was still to clear (a host it had just killed).
_shm_before: set[str] | None = None


def _controls_the_run(config: pytest.Config) -> bool:
    return not hasattr(config, "workerinput")  # xdist sets it on its workers


def pytest_sessionstart(session: pytest.Session) -> None:
    global _shm_before
    if _controls_the_run(session.config):
        _shm_before = semaphores.snapshot()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fail the run if it left named semaphores nobody holds in /dev/shm.

    A resource tracker unlinks its process's semaphores when that process ends,
    a moment later; harnesses that kill stand-in machines clear theirs
    (support.semaphores).  Whatever else is left leaked, on every run."""
    if _shm_before is None or not _controls_the_run(session.config):
        return
    try:
        wait_until(
            lambda: not semaphores.orphans(_shm_before),
            LEAK_GRACE,
            "the resource trackers to unlink the run's semaphores",
        )
    except AssertionError:
        left = semaphores.remove_orphans(_shm_before)
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        message = (
            f"{len(left)} named semaphore(s) made during the run were left in "
            f"/dev/shm with no process holding them (removed now): "
            f"{', '.join(left[:10])}"
        )
        if reporter is not None:
            reporter.ensure_newline()
            reporter.write_line(f"FAILED (leak check): {message}", red=True)
        else:
            print(message, file=sys.stderr)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--kubernetes",
        action="store_true",
        default=False,
        help="run the tests marked kubernetes against the cluster of $KUBECONFIG "
        "(needs the dask-kubernetes operator and FIBER_DASK_TEST_IMAGE)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    """Tests marked ``kubernetes`` need a live cluster: they run with --kubernetes,
    or when selected with ``-m kubernetes`` while KUBECONFIG is set."""
    if config.getoption("--kubernetes"):
        return
    if os.environ.get("KUBECONFIG") and "kubernetes" in (config.getoption("-m") or ""):
        return
    skip = pytest.mark.skip(
        reason="needs a live Kubernetes cluster with the dask-kubernetes operator: "
        "run with --kubernetes (or -m kubernetes with KUBECONFIG set)"
    )
    for item in items:
        if item.get_closest_marker("kubernetes") is not None:
            item.add_marker(skip)


def _stdlib_context():
    return multiprocessing.get_context("forkserver")


def _fiber_context():
    import fiber_dask

    return fiber_dask.get_context()


@pytest.fixture(params=["stdlib", "fiber"])
def ctx(request):
    """A multiprocessing-like context: the stdlib oracle or fiber_dask."""
    if request.param == "stdlib":
        return _stdlib_context()
    return _fiber_context()


@pytest.fixture
def fiber_ctx():
    """fiber_dask's context, for tests of behaviour that goes beyond stdlib."""
    return _fiber_context()
