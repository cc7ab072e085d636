"""The cluster layer: resolution order, attaching, the embedded default, backends.

Scripts run in fresh interpreters (``subprocess``) wherever the behaviour is
about a process's whole life: its first use, its environment, its exit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import dask
import psutil
import pytest
from distributed import Client
from support.clusters import loopback_cluster, runs_under
from support.importalone import import_alone
from support.wait import wait_until

import fiber_dask
from fiber_dask import ClusterConnectionError, cluster

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def existing():
    """A running cluster that fiber-dask did not start."""
    with loopback_cluster(1) as c:
        yield c


def run_script(body: str, tmp_path, env: dict | None = None, timeout: float = 90):
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(body))
    full_env = dict(os.environ)
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
        cwd=tmp_path,
    )


def test_attach_by_address_argument_and_leave_cluster_running(existing):
    with fiber_dask.Pool(1, address=existing.scheduler_address) as pool:
        assert pool.map(abs, [-1, -2]) == [1, 2]
        # The task ran on the existing cluster's only worker (in its slot process).
        worker_pids = set(
            Client(existing, set_as_default=False).run(os.getpid).values()
        )
        assert runs_under(pool.apply(os.getpid), worker_pids)
    # shutdown() closes fiber-dask's own client, never a cluster it did not start.
    fiber_dask.shutdown()
    with Client(existing.scheduler_address, timeout=10, set_as_default=False) as c:
        assert len(c.scheduler_info()["workers"]) == 1


def test_explicit_client_is_used_and_not_closed(existing):
    with Client(existing, set_as_default=False) as c:
        with fiber_dask.Pool(1, client=c) as pool:
            assert runs_under(pool.apply(os.getpid), c.run(os.getpid).values())
        fiber_dask.shutdown()
        assert c.status == "running"


SHOW_SCHEDULER = """
    import json, os, fiber_dask
    from fiber_dask import cluster
    if __name__ == "__main__":
        with fiber_dask.Pool(1) as p:
            assert p.apply(abs, (-3,)) == 3
        h = cluster.get_handle()
        print(json.dumps({"address": h.client.scheduler.address, "backend": h.backend,
                          "owned": h.owned}))
"""


@pytest.mark.parametrize("variable", ["DASK_SCHEDULER_ADDRESS", "DASK_FIBER__ADDRESS"])
def test_attach_by_environment(existing, tmp_path, variable):
    proc = run_script(SHOW_SCHEDULER, tmp_path, {variable: existing.scheduler_address})
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen == {
        "address": existing.scheduler_address,
        "backend": "address",
        "owned": False,
    }


def test_attach_by_yaml_file(existing, tmp_path):
    confdir = tmp_path / "conf"
    confdir.mkdir()
    (confdir / "fiber.yaml").write_text(
        f"fiber:\n  backend: address\n  address: {existing.scheduler_address}\n"
    )
    proc = run_script(SHOW_SCHEDULER, tmp_path, {"DASK_CONFIG": str(confdir)})
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["address"] == existing.scheduler_address


def test_unreachable_scheduler_is_a_clear_error_not_a_hang():
    with dask.config.set({"fiber.connect-timeout": "2s"}):
        t0 = time.monotonic()
        with pytest.raises(ClusterConnectionError) as info:
            fiber_dask.Pool(1, address="tcp://127.0.0.1:9")
        elapsed = time.monotonic() - t0
    message = str(info.value)
    assert "tcp://127.0.0.1:9" in message and "fiber.connect-timeout" in message
    assert isinstance(info.value, ConnectionError)
    assert elapsed < 30  # bounded by the connect timeout, not forever


@pytest.mark.parametrize(
    "variable, value, expected",
    [
        # unknown backend: the key, the value and the choices are named
        (
            "DASK_FIBER__BACKEND",
            "nonesuch",
            ["fiber.backend", "nonesuch", "local", "address"],
        ),
        ("DASK_FIBER__LOCAL__N_WORKERS", "-2", ["fiber.local.n-workers", "-2"]),
    ],
)
def test_bad_config_fails_at_first_use_naming_key_and_value(
    tmp_path, variable, value, expected
):
    proc = run_script(
        """
        import fiber_dask
        if __name__ == "__main__":
            fiber_dask.Pool(1)
        """,
        tmp_path,
        {variable: value},
    )
    assert proc.returncode != 0
    assert "ConfigError" in proc.stderr
    for text in expected:
        assert text in proc.stderr


def test_embedded_cluster_starts_lazily_and_leaves_no_process(tmp_path):
    proc = run_script(
        """
        import json, os, sys
        import fiber_dask
        from fiber_dask import cluster
        if __name__ == "__main__":
            assert "distributed" not in sys.modules or cluster._handle is None
            pool = fiber_dask.Pool()
            pids = sorted(set(pool.map(os.getpid, [()] * 0) + [pool.apply(os.getpid)]))
            h = cluster.get_handle()
            info = h.client.scheduler_info(n_workers=-1)
            workers = info["workers"].values()
            print(json.dumps({
                "backend": h.backend, "owned": h.owned,
                "n": len(workers), "threads": sorted({w["nthreads"] for w in workers}),
                "slots": fiber_dask.cpu_count(),
                "worker_pids": list(h.client.run(os.getpid).values()),
                "scheduler": info["address"],
                "dashboard": h.cluster.dashboard_link if h.cluster.scheduler.http_server else None,
            }))
            # Exit without close() or shutdown(): atexit must clean up.
        """,
        tmp_path,
        {"DASK_FIBER__LOCAL__N_WORKERS": "2"},
    )
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["backend"] == "local" and seen["owned"] is True
    assert seen["n"] == 2 and seen["threads"] == [1] and seen["slots"] == 2
    assert seen["scheduler"].startswith("tcp://127.0.0.1:")

    def exited(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    wait_until(
        lambda: all(exited(p) for p in seen["worker_pids"]),
        10,
        f"the script's worker processes {seen['worker_pids']} to exit with it",
    )


def test_unguarded_script_gets_the_stdlib_bootstrapping_error(tmp_path):
    proc = run_script(
        """
        import fiber_dask
        print(fiber_dask.Pool(1).map(abs, [-1]))
        """,
        tmp_path,
        {"DASK_FIBER__LOCAL__N_WORKERS": "1"},
    )
    assert proc.returncode != 0
    assert "bootstrapping phase" in proc.stderr
    assert "if __name__ == '__main__':" in proc.stderr


PLUGIN = '''
from fiber_dask.backends.base import Backend, ClusterHandle


class TinyBackend(Backend):
    """A third-party backend: a one-worker LocalCluster, marked as ours."""

    name = "tiny"

    def start(self, *, address=None):
        from distributed import Client, LocalCluster

        cluster = LocalCluster(n_workers=1, threads_per_worker=1, processes=True,
                               dashboard_address=None, host="127.0.0.1")
        client = Client(cluster, set_as_default=False)
        # No listen_host: the cluster layer decides it by the common rule.
        return ClusterHandle(client, cluster, owned=True, backend=self.name)
'''


def test_third_party_backend_from_entry_point(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "tiny_backend.py").write_text(PLUGIN)
    dist = site / "tiny_backend-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: tiny-backend\nVersion: 1.0\n"
    )
    (dist / "entry_points.txt").write_text(
        "[fiber_dask.backends]\ntiny = tiny_backend:TinyBackend\n"
    )
    proc = run_script(
        SHOW_SCHEDULER,
        tmp_path,
        {
            "PYTHONPATH": os.pathsep.join(
                [str(site), os.environ.get("PYTHONPATH", "")]
            ),
            "DASK_FIBER__BACKEND": "tiny",
        },
    )
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["backend"] == "tiny" and seen["owned"] is True


class _EntryPoint:
    """What ``importlib.metadata.entry_points`` yields: a name and a target."""

    def __init__(self, name: str, value: str) -> None:
        self.name, self.value = name, value


def test_a_backend_whose_entry_point_cannot_load_is_named_with_its_error(
    tmp_path, monkeypatch
):
    import importlib.metadata

    from fiber_dask import backends, config

    (tmp_path / "broken_backend.py").write_text("import no_such_module_here\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    entries = [
        _EntryPoint("broken", "broken_backend:Backend"),
        _EntryPoint("missing", "fiber_dask.backends.local:NoSuchBackend"),
    ]
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group: entries)
    # Listed (its name is all validation reads), refused with the reason when chosen.
    assert {"broken", "missing", "local"} <= set(config.available_backends())
    with pytest.raises(config.ConfigError) as info:
        backends.load_backend("broken")
    message = str(info.value)
    assert "broken = broken_backend:Backend" in message
    assert "ModuleNotFoundError" in message and "no_such_module_here" in message
    with pytest.raises(config.ConfigError, match="NoSuchBackend"):
        backends.load_backend("missing")
    assert backends.load_backend("local").__name__ == "LocalBackend"


def test_broken_entry_point_metadata_is_reported_once_and_keeps_the_builtins(
    monkeypatch,
):
    import importlib.metadata
    import warnings

    from fiber_dask import backends, config
    from fiber_dask.backends import registry

    def broken(group):
        raise ValueError("bad entry_points.txt in some-dist")

    monkeypatch.setattr(importlib.metadata, "entry_points", broken)
    monkeypatch.setattr(registry, "_reported", set())
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert config.available_backends() == ["address", "local"]
        assert backends.load_backend("address").__name__ == "AddressBackend"
        with dask.config.set({"fiber.backend": "local"}):
            config.validate()
    (warning,) = [w for w in seen if "entry points" in str(w.message)]
    assert "fiber_dask.backends" in str(warning.message)
    assert "bad entry_points.txt in some-dist" in str(warning.message)


def test_the_backend_registry_is_a_leaf():
    # The configuration's validation asks it for the names fiber.backend accepts;
    # it must bring nothing of fiber_dask with it, when imported or when asked.
    loaded = import_alone(
        "fiber_dask.backends.registry",
        then="assert {'address', 'local'} <= set(module.available_backends())",
    )
    ours = {m for m in loaded if m.startswith("fiber_dask")}
    # the two stand-ins for its packages, and itself
    assert ours == {"fiber_dask", "fiber_dask.backends", "fiber_dask.backends.registry"}


def test_init_and_shutdown_give_explicit_control(existing):
    c = fiber_dask.init(address=existing.scheduler_address)
    try:
        assert cluster.get_client() is c
        assert fiber_dask.cpu_count() == 1
    finally:
        fiber_dask.shutdown()
    assert cluster._handle is None
    with Client(existing.scheduler_address, timeout=10, set_as_default=False) as check:
        assert len(check.scheduler_info()["workers"]) == 1


def test_pool_of_more_processes_than_slots_grows_the_embedded_cluster(tmp_path):
    proc = run_script(
        """
        import os, fiber_dask, time
        from fiber_dask import cluster
        def pid_after(delay):
            time.sleep(delay)
            return os.getpid()
        if __name__ == "__main__":
            with fiber_dask.Pool(3) as pool:
                client = cluster.get_client()
                client.wait_for_workers(3, timeout=60)
                deadline = time.monotonic() + 30
                while sum(s.is_alive() for s in pool._pool) < 3 and time.monotonic() < deadline:
                    time.sleep(0.05)  # all three pool loops connected
                # Three tasks that overlap in time run in three processes.
                pids = pool.map(pid_after, [2.0] * 3, chunksize=1)
            # The grown size is what the next Pool() is sized for.
            print(len(client.scheduler_info()["workers"]), len(set(pids)),
                  cluster.task_slots())
        """,
        tmp_path,
        {"DASK_FIBER__LOCAL__N_WORKERS": "1"},
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "3 3 3"


def test_backend_is_abstract():
    from fiber_dask.backends import Backend

    class NoStart(Backend):
        name = "no-start"

    for cls in (Backend, NoStart):
        with pytest.raises(TypeError, match="abstract"):
            cls()


def test_a_pool_the_embedded_cluster_can_never_start_is_refused_at_once(tmp_path):
    # Pool(10**6) started scaling, returned after 42 s at 3.4 GB and never ran
    # a task; the stdlib fails with an OSError when it cannot fork.  Refused
    # before anything starts, it leaves no claim: the next pool is as before.
    proc = run_script(
        """
        import os, time, fiber_dask, psutil
        from fiber_dask import cluster
        from fiber_dask.errors import ClusterCapacityError
        if __name__ == "__main__":
            with fiber_dask.Pool(2) as pool:
                assert pool.map(abs, [-1, -2]) == [1, 2]
                # The first pool's first tasks may run on early slots while
                # the cluster starts: count from when its own slots serve it.
                cluster.get_handle()
                deadline = time.monotonic() + 60
                while not all(slot.worker for slot in pool._pool):
                    assert time.monotonic() < deadline, "no cluster slots"
                    time.sleep(0.01)
                before = set(psutil.Process().children(recursive=True))
                try:
                    fiber_dask.Pool(10**6)
                except ClusterCapacityError as e:
                    assert isinstance(e, OSError)
                    print("refused:", e)
                handle = cluster.get_handle()
                # No worker started: a process new since ``before`` can only be
                # a slot template's spare, which it forks again after handing
                # one over to this pool's slots, whenever its turn comes: this
                # process > worker server > Dask worker > slot template > spare.
                def spare(p):
                    try:
                        chain = [q.pid for q in p.parents()]
                    except psutil.Error:
                        return True  # already gone
                    return os.getpid() in chain and chain.index(os.getpid()) >= 3
                new = set(psutil.Process().children(recursive=True)) - before
                print(cluster.slots_in_use(handle), handle.planned_slots,
                      all(spare(p) for p in new))
                assert pool.map(abs, [-3]) == [3]
            with fiber_dask.Pool(2) as other:
                print(other.map(abs, [-4]))
        """,
        tmp_path,
        {"DASK_FIBER__LOCAL__N_WORKERS": "2"},
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert lines[0].startswith(
        "refused: 1000002 pool slots at once (this pool's and those in use) need "
        "1000000 more worker processes on this machine"
    ), lines
    assert "fiber.local.threads-per-worker" in lines[0]
    assert lines[1:] == ["2 2 True", "[4]"], lines
