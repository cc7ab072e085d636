"""The batch-scheduler backends (dask-jobqueue): on a real SLURM, and job scripts.

On a real one-host SLURM (``tests/support/slurm.py``: started here when we are
root and ``SLURM_CONF`` names no running cluster; ``.ci/run`` starts one around
the whole suite), programs run as users run them, in their own Python process
with ``fiber.backend: slurm`` and dask-jobqueue's ``jobqueue.slurm`` settings
in ``$DASK_CONFIG``:

* a Pool whose tasks run inside SLURM jobs (``SLURM_JOB_ID``), two jobs for
  ``Pool(2)``; a Process and a Queue between two jobs; ``fiber-dask info``
  listing the jobs; no job left in ``squeue`` after the program ends;
* ``scancel`` of a job whose worker runs a task (after its started marker):
  the map completes with the right results, the task ran again, and a
  replacement job came without adaptive scaling;
* adaptive scaling from 0 jobs to 2 under a Pool and back to 0;
* a partition that does not exist: sbatch's error, naming
  ``jobqueue.slurm.queue``, within ``fiber.connect-timeout``.

PBS, SGE, LSF and HTCondor have no scheduler here: their tests check the
cluster class and the job script fiber-dask builds from ``jobqueue.<name>``
(``cluster.job_script()``), as dask-jobqueue's own tests do, without
submitting; the profiles in adapters/ are built the same way.
"""

from __future__ import annotations

import copy
import json
import os
import pathlib
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from typing import Any

import dask
import pytest
import yaml
from support import slurm as slurm_support  # noqa: E402
from support.interrupts import terminal_python  # noqa: E402
from support.wait import wait_for_file, wait_until  # noqa: E402

from fiber_dask import config  # noqa: E402
from fiber_dask.backends import jobqueue, jobwatch  # noqa: E402

# Not pytest.importorskip: a plain import of dask_jobqueue replaces this
# process's SIGINT handler (its runner module does, at import), which would
# break every later test that relies on KeyboardInterrupt.
try:
    jobqueue._import_dask_jobqueue()
except ImportError as e:
    pytest.skip(f"dask-jobqueue is not installed: {e}", allow_module_level=True)

REPO = pathlib.Path(__file__).resolve().parent.parent
TESTS = REPO / "tests"
ADAPTERS = REPO / "adapters"

# What a program gets to connect and to see its first workers.
CONNECT_TIMEOUT = 20


# ------------------------------------------------------------------ the cluster


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """The environment that reaches a running SLURM (``SLURM_CONF``)."""
    if os.environ.get("SLURM_CONF") and slurm_support.responding():
        yield {"SLURM_CONF": os.environ["SLURM_CONF"]}
        return
    reason = slurm_support.unavailable()
    if reason is not None:
        pytest.skip(f"real SLURM tests: {reason}")
    directory = str(tmp_path_factory.mktemp("slurm"))
    try:
        env = slurm_support.start(directory)
    except RuntimeError as e:
        slurm_support.stop(directory)
        pytest.fail(f"could not start the test SLURM: {e}", pytrace=False)
    try:
        yield env
    finally:
        slurm_support.stop(directory)


class Program:
    """A fiber-dask program run on the SLURM, in ``tmp_path``, as a user runs it."""

    def __init__(
        self, tmp_path: pathlib.Path, slurm: dict[str, str], **settings: Any
    ) -> None:
        self.dir = tmp_path
        self.job_name = f"fiber-ci-{uuid.uuid4().hex[:8]}"
        fiber = {"backend": "slurm", "connect-timeout": f"{CONNECT_TIMEOUT}s"}
        fiber.update(settings.pop("fiber", {}))
        jq = {
            "name": self.job_name,  # squeue --name finds this test's jobs only
            "cores": 1,
            "memory": "1GB",
            "processes": 1,
            "walltime": "00:10:00",
            "interface": "lo",
            "death-timeout": 20,
            "python": sys.executable,
            # the jobs import fiber_dask (and the tests' helpers) from this checkout
            "job-script-prologue": [f"export PYTHONPATH={REPO}:{TESTS}:$PYTHONPATH"],
            "local-directory": str(tmp_path / "worker-space"),
            "log-directory": str(tmp_path / "job-logs"),
            "scheduler-options": {"dashboard_address": ":0"},
        }
        jq.update(settings.pop("jobqueue", {}))
        assert not settings, settings
        conf = tmp_path / "dask-config"
        conf.mkdir()
        # where a user keeps them: fiber's and dask-jobqueue's own file
        (conf / "fiber.yaml").write_text(yaml.safe_dump({"fiber": fiber}))
        (conf / "jobqueue.yaml").write_text(yaml.safe_dump({"jobqueue": {"slurm": jq}}))
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("DASK_")}
        self.env.update(slurm)
        self.env["DASK_CONFIG"] = str(conf)
        self.env["PYTHONPATH"] = os.pathsep.join(
            [str(REPO), str(TESTS), *filter(None, [os.environ.get("PYTHONPATH")])]
        )
        self.slurm = slurm

    def start(self, source: str, *args: str) -> subprocess.Popen:
        script = self.dir / "program.py"
        script.write_text(textwrap.dedent(source))
        # files, not pipes: a program blocked on a full pipe while the test waits
        # for its markers would look like a hang
        with open(self.dir / "out", "w") as out, open(self.dir / "err", "w") as err:
            return subprocess.Popen(
                [sys.executable, str(script), *args],
                cwd=self.dir,
                env=self.env,
                stdout=out,
                stderr=err,
            )

    def run(self, source: str, *args: str, timeout: float = 90) -> dict[str, Any]:
        return self.result(self.start(source, *args), timeout)

    def result(self, proc: subprocess.Popen, timeout: float = 90) -> dict[str, Any]:
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        out = (self.dir / "out").read_text()
        err = (self.dir / "err").read_text()
        if proc.returncode == -9:
            pytest.fail(f"the program did not end in {timeout}s:\n{out}\n{err[-4000:]}")
        lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
        assert proc.returncode == 0 and lines, f"{out}\n{err[-6000:]}"
        return json.loads(lines[-1][len("RESULT ") :])

    def jobs(self) -> list[str]:
        """This program's jobs that SLURM still lists (pending, running, ending)."""
        r = subprocess.run(
            ["squeue", "--noheader", "--name", self.job_name, "--format=%i %T"],
            env={**os.environ, **self.slurm},
            capture_output=True,
            text=True,
            check=True,
        )
        return r.stdout.split()

    def assert_no_job_left(self) -> None:
        wait_until(
            lambda: not self.jobs(), 20, f"squeue to list no job named {self.job_name}"
        )


# ---------------------------------------------------------------- on real SLURM

POOL_PROCESS_QUEUE = """
    import json, os, time
    import fiber_dask

    def task(x):
        time.sleep(0.05)
        return x * x, os.environ.get("SLURM_JOB_ID")

    @fiber_dask.meta(cpu=1)  # every worker declares CPU=1: one such Process each
    def producer(q, n, ready):
        # Both run at once (each holding its worker's CPU=1), so they are in
        # different jobs; without the wait a fast producer could end before
        # the consumer was placed, and the consumer take the freed job.
        ready.get(timeout=60)
        for i in range(n):
            q.put((i, os.environ["SLURM_JOB_ID"]))
        q.put(None)

    @fiber_dask.meta(cpu=1)
    def consumer(q, back, ready):
        ready.put(True)
        got = []
        while (item := q.get()) is not None:
            got.append(item)
        back.put((got, os.environ["SLURM_JOB_ID"]))

    if __name__ == "__main__":
        from fiber_dask import cluster

        out = {}
        with fiber_dask.Pool(2) as pool:
            client = cluster.get_client()
            client.wait_for_workers(2, timeout=60)  # Pool(2) submitted a second job
            out["jobs_listed"] = cluster.get_handle().jobs()
            # Until tasks ran in both jobs (bounded), however late a loaded
            # machine starts the second job's pool slot.
            out["squares"], out["task_jobs"] = [], []
            t0 = time.monotonic()
            while len(set(out["task_jobs"])) < 2 and time.monotonic() - t0 < 60:
                results = pool.map(task, range(20), chunksize=1)
                out["squares"].append([v for v, _ in results])
                out["task_jobs"] += [j for _, j in results]

        q, back, ready = fiber_dask.Queue(), fiber_dask.Queue(), fiber_dask.Queue()
        c = fiber_dask.Process(target=consumer, args=(q, back, ready))
        p = fiber_dask.Process(target=producer, args=(q, 5, ready))
        c.start()
        p.start()
        got, consumer_job = back.get(timeout=60)
        p.join(60)
        c.join(60)
        out["queue_items"] = [i for i, _ in got]
        out["producer_jobs"] = sorted({j for _, j in got})
        out["consumer_job"] = consumer_job
        out["exitcodes"] = [p.exitcode, c.exitcode]
        fiber_dask.shutdown()
        print("RESULT " + json.dumps(out), flush=True)
"""


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_pool_process_and_queue_run_inside_slurm_jobs(slurm, tmp_path) -> None:
    prog = Program(
        tmp_path,
        slurm,
        jobqueue={"worker-extra-args": ["--resources", "CPU=1"]},
    )
    r = prog.run(POOL_PROCESS_QUEUE)
    assert all(squares == [x * x for x in range(20)] for squares in r["squares"])
    # every task ran inside a SLURM job, and Pool(2) had two jobs to run them
    assert all(r["task_jobs"]), r["task_jobs"]
    assert len(set(r["task_jobs"])) == 2, r["task_jobs"]
    listed = r["jobs_listed"]
    assert len(listed) == 2 and {j["state"] for j in listed} == {"RUNNING"}, listed
    assert {j["id"] for j in listed} == set(r["task_jobs"])
    # the Queue carried the items from one job's Process to the other's
    assert r["queue_items"] == [0, 1, 2, 3, 4]
    assert len(r["producer_jobs"]) == 1
    assert r["producer_jobs"][0] != r["consumer_job"]
    assert {r["producer_jobs"][0], r["consumer_job"]} <= set(r["task_jobs"])
    assert r["exitcodes"] == [0, 0]
    prog.assert_no_job_left()


SCANCEL = """
    import json, os, sys, time
    import fiber_dask

    MARKS = sys.argv[1]

    def task(x):
        job = os.environ["SLURM_JOB_ID"]
        with open(os.path.join(MARKS, "executions"), "a") as f:
            f.write(f"{x} {job}\\n")
        with open(os.path.join(MARKS, f"started-{x}-{job}.tmp"), "w") as f:
            f.write(job)
        os.rename(os.path.join(MARKS, f"started-{x}-{job}.tmp"),
                  os.path.join(MARKS, f"started-{x}-{job}"))
        time.sleep(0.5)
        return x * x

    if __name__ == "__main__":
        from fiber_dask import cluster

        out = {}
        with fiber_dask.Pool(2) as pool:
            client = cluster.get_client()
            client.wait_for_workers(2, timeout=60)
            handle = cluster.get_handle()
            out["jobs_before"] = sorted(j["id"] for j in handle.jobs())
            open(os.path.join(MARKS, "ready"), "w").close()
            out["squares"] = pool.map(task, range(12), chunksize=1)
            # without adaptive scaling, the ended job is replaced
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                jobs = handle.jobs()
                running = [j for j in jobs if j["state"] == "RUNNING" and j["workers"]]
                if len(running) == 2 and {j["id"] for j in running} - set(out["jobs_before"]):
                    break
                time.sleep(0.2)
            out["jobs_after"] = handle.jobs()
        fiber_dask.shutdown()
        print("RESULT " + json.dumps(out), flush=True)
"""


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_scancel_of_a_worker_job_costs_a_rerun_and_gets_a_replacement(
    slurm, tmp_path
) -> None:
    prog = Program(tmp_path, slurm)
    marks = tmp_path / "marks"
    marks.mkdir()
    proc = prog.start(SCANCEL, str(marks))
    try:
        wait_for_file(str(marks / "ready"), timeout=90)
        first = wait_until(
            lambda: sorted(p.name for p in marks.glob("started-*")),
            60,
            "a started task",
        )[0]
        _, x, job = first.split("-")
        subprocess.run(["scancel", job], env={**os.environ, **slurm}, check=True)
        r = prog.result(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert r["squares"] == [i * i for i in range(12)]
    assert job in r["jobs_before"]
    runs = (marks / "executions").read_text().split("\n")
    runs = [line.split() for line in runs if line]
    # the killed task ran again, in the other (or the replacement) job
    assert sum(1 for ran, _ in runs if ran == x) >= 2, runs
    assert {int(ran) for ran, _ in runs} == set(range(12))
    after = r["jobs_after"]
    replacements = {j["id"] for j in after} - set(r["jobs_before"])
    assert replacements, after
    assert len(after) == 2 and all(j["state"] == "RUNNING" for j in after), after
    assert job not in {j["id"] for j in after}
    # a job cancelled under its workers is said to be (a lifetime's end is not)
    err = (prog.dir / "err").read_text()
    assert f"job {job} " in err and "ended while its workers were in use" in err, err
    prog.assert_no_job_left()


LIFETIME = """
    import json, os, sys, time, uuid
    import fiber_dask

    MARKS = sys.argv[1]

    def mark(kind, x, job):
        open(os.path.join(MARKS, f"{kind}-{x}-{job}-{uuid.uuid4().hex}"), "w").close()

    def task(x):
        job = os.environ["SLURM_JOB_ID"]
        mark("start", x, job)
        time.sleep(0.25)
        mark("finish", x, job)
        return x * x, job

    if __name__ == "__main__":
        from fiber_dask import cluster

        out = {}
        with fiber_dask.Pool(2) as pool:
            client = cluster.get_client()
            client.wait_for_workers(2, timeout=60)
            handle = cluster.get_handle()
            out["jobs_before"] = before = sorted(j["id"] for j in handle.jobs())
            # Maps of 20 until tasks ran in a job that replaced one whose
            # worker's lifetime ended (bounded), however slowly a loaded
            # machine starts the jobs' workers.
            got, t0 = [], time.monotonic()
            while time.monotonic() - t0 < 90:
                got += pool.map(task, range(len(got), len(got) + 20), chunksize=1)
                if {j for _, j in got} - set(before):
                    break
            out["squares"] = [v for v, _ in got]
            out["task_jobs"] = sorted({j for _, j in got})
            out["jobs_after"] = handle.jobs()
            d = pool._engine._drain
            out["drain"] = {"started": d.started, "drained": d.drained, "cut": d.cut}
            out["reruns"] = pool._engine._stats.reruns
        fiber_dask.shutdown()
        print("RESULT " + json.dumps(out), flush=True)
"""


@pytest.mark.slow
@pytest.mark.timeout(160)
def test_worker_lifetime_before_the_walltime_drains_the_pool_into_new_jobs(
    slurm, tmp_path
) -> None:
    """dask-jobqueue's ``--lifetime`` (a worker closes itself before its
    job's walltime): the pool's slots there finish their chunk and leave, the
    worker and its job end under the running map, replacement jobs take over,
    and no item runs twice."""
    prog = Program(
        tmp_path,
        slurm,
        # a worker starts in ~2-6 s here (a loaded machine): 12 s leaves it
        # some life to run tasks in
        # a short walltime, as the issue asks: were the worker not to close
        # at its lifetime, SLURM would end the job under the map at 1 min
        jobqueue={
            "walltime": "00:01:00",
            "worker-extra-args": ["--lifetime", "12s", "--lifetime-stagger", "0s"],
        },
    )
    marks = tmp_path / "marks"
    marks.mkdir()
    r = prog.run(LIFETIME, str(marks), timeout=130)
    print("lifetime on SLURM:", json.dumps(r))
    items = len(r["squares"])
    assert r["squares"] == [x * x for x in range(items)]
    # the first jobs' workers closed under the map, their slots drained
    # (none cut), and the map went on in the jobs that replaced them
    assert r["drain"]["started"] >= 2 and r["drain"]["drained"] >= 2, r
    assert r["drain"]["cut"] == 0 and r["reruns"] == 0, r
    assert set(r["task_jobs"]) - set(r["jobs_before"]), r
    assert not set(r["jobs_before"]) & {j["id"] for j in r["jobs_after"]}, r
    counts: dict[str, dict[int, int]] = {"start": {}, "finish": {}}
    for p in marks.iterdir():
        kind, x, _, _ = p.name.split("-")
        counts[kind][int(x)] = counts[kind].get(int(x), 0) + 1
    assert counts["start"] == {x: 1 for x in range(items)}, counts
    assert counts["finish"] == {x: 1 for x in range(items)}, counts
    # jobs that end at their workers' planned lifetime are replaced quietly
    err = (prog.dir / "err").read_text()
    assert "ended while its workers were in use" not in err, err[-4000:]
    prog.assert_no_job_left()


ADAPTIVE = """
    import json, os, subprocess, sys, threading, time
    import fiber_dask

    MARKS = sys.argv[1]

    def task(x):
        import os, time
        time.sleep(0.25)
        return x, os.environ.get("SLURM_JOB_ID")

    def slow(x):
        import os, time
        job = os.environ["SLURM_JOB_ID"]
        open(os.path.join(MARKS, f"started-{x}-{job}"), "w").close()
        time.sleep(0.5)
        return x

    if __name__ == "__main__":
        from fiber_dask import cluster

        handle = cluster.get_handle()
        client = handle.client
        t0 = time.monotonic()
        def state():
            return len(client.scheduler_info(n_workers=-1)["workers"]), len(handle.jobs())
        samples, stop = [], threading.Event()
        def sample():
            while not stop.is_set():
                samples.append((time.monotonic() - t0, *state()))
                time.sleep(0.1)
        threading.Thread(target=sample, daemon=True).start()

        out = {"idle": state()}
        t_pool = time.monotonic() - t0
        jobs_seen = set()
        with fiber_dask.Pool() as pool:
            out["processes"] = pool._processes
            # Busy until both jobs adaptive scaling asked for have run tasks
            # (bounded), however slowly a loaded machine starts their workers.
            while len(jobs_seen) < 2 and time.monotonic() - t0 - t_pool < 60:
                jobs_seen.update(j for _, j in pool.map(task, range(8), chunksize=1))
            # A job that ends under load is replaced (adaptive scaling alone would
            # go on counting it as requested).
            pending = pool.map_async(slow, range(12), chunksize=1)
            while not (started := os.listdir(MARKS)):
                time.sleep(0.02)
            out["killed"] = started[0].split("-")[2]
            subprocess.run(["scancel", out["killed"]], check=True)
            out["slow"] = pending.get(90)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                new = [j for j in handle.jobs() if j["id"] not in jobs_seen
                       and j["state"] == "RUNNING" and j["workers"]]
                if new:
                    out["replacement"] = new[0]["id"]
                    break
                time.sleep(0.1)
        out["task_jobs"] = sorted(jobs_seen)
        t_closed = time.monotonic() - t0
        deadline = time.monotonic() + 60
        while state() != (0, 0) and time.monotonic() < deadline:
            time.sleep(0.1)
        out["after"] = state()
        stop.set()
        up = [t for t, w, _ in samples if t >= t_pool and w == 2]
        out["up_seconds"] = up[0] - t_pool if up else None
        out["down_seconds"] = time.monotonic() - t0 - t_closed
        out["max_workers"] = max(w for _, w, _ in samples)
        out["max_jobs"] = max(j for _, _, j in samples)
        fiber_dask.shutdown()
        print("RESULT " + json.dumps(out), flush=True)
"""


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_adaptive_scales_jobs_from_zero_to_two_replaces_a_lost_one_and_back(
    slurm, tmp_path
) -> None:
    prog = Program(
        tmp_path,
        slurm,
        fiber={
            "adaptive": {
                "enabled": True,
                "minimum": 0,
                "maximum": 2,
                "target-duration": "1s",
                "interval": "200ms",
                "wait-count": 3,
            }
        },
    )
    marks = tmp_path / "marks"
    marks.mkdir()
    r = prog.run(ADAPTIVE, str(marks))
    print("adaptive on SLURM:", r)
    assert r["idle"] == [0, 0]  # no job before there is work
    assert r["processes"] == 2  # Pool() sized for the adaptive maximum
    assert r["max_workers"] == 2 and r["max_jobs"] == 2, r
    assert len(r["task_jobs"]) == 2 and all(r["task_jobs"]), r
    # scancel under load: the work completes and a new job replaces the lost one
    assert r["killed"] in r["task_jobs"]
    assert r["slow"] == list(range(12))
    assert r.get("replacement") and r["replacement"] not in r["task_jobs"], r
    assert r["after"] == [0, 0], r  # and no job once the pool is closed
    prog.assert_no_job_left()


WRONG_QUEUE = """
    import json, time
    import fiber_dask
    from fiber_dask.errors import ClusterConnectionError

    if __name__ == "__main__":
        t0 = time.monotonic()
        try:
            with fiber_dask.Pool(2) as pool:
                pool.map(abs, [1])
        except ClusterConnectionError as e:
            out = {"error": str(e), "seconds": time.monotonic() - t0}
        else:
            out = {"error": None}
        print("RESULT " + json.dumps(out), flush=True)
"""


@pytest.mark.timeout(90)
@pytest.mark.parametrize("adaptive", [False, True], ids=["fixed", "adaptive"])
def test_a_partition_that_does_not_exist_is_a_clear_error(
    slurm, tmp_path, adaptive: bool
) -> None:
    prog = Program(
        tmp_path,
        slurm,
        jobqueue={"queue": "no-such-partition"},
        fiber={"adaptive": {"enabled": adaptive, "maximum": 2}},
    )
    r = prog.run(WRONG_QUEUE, timeout=CONNECT_TIMEOUT + 30)
    error = r["error"]
    assert error is not None
    assert "jobqueue.slurm.queue = 'no-such-partition'" in error
    assert error.index("jobqueue.slurm.queue") < error.index("jobqueue.slurm.walltime")
    assert "invalid partition" in error.lower()  # sbatch's own words
    assert r["seconds"] < CONNECT_TIMEOUT
    prog.assert_no_job_left()


@pytest.mark.timeout(90)
def test_info_lists_the_jobs(slurm, tmp_path, capsys) -> None:
    prog = Program(tmp_path, slurm)
    r = subprocess.run(
        [sys.executable, "-m", "fiber_dask.cli", "info", "--json"],
        cwd=tmp_path,
        env=prog.env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    data = json.loads(r.stdout)
    assert data["backend"] == "slurm" and data["owned"] is True
    [job] = data["jobs"]
    assert job["id"].isdigit() and job["state"] == "RUNNING" and job["workers"] == 1
    # and the same in words (without starting another cluster)
    from fiber_dask.cli.info import _print

    _print(data)
    words = capsys.readouterr().out.splitlines()
    [row] = [w for w in words if w.startswith("jobs:")]
    assert f"1: {job['id']} RUNNING (1 worker)" in row, words
    prog.assert_no_job_left()


# ------------------------------------------------- job scripts, no scheduler needed


def _jobqueue_section(name: str, **extra: Any) -> dict[str, Any]:
    section = {
        "cores": 4,
        "memory": "8GB",
        "processes": 2,
        "interface": "lo",
        "scheduler-options": {"dashboard_address": ":0"},
        "job-script-prologue": ["module load python"],
    }
    section.update(extra)
    return _keys(name, section)


def _keys(name: str, section: dict[str, Any]) -> dict[str, Any]:
    """``jobqueue.<name>.<key>`` settings: the section's other defaults stay."""
    return {f"jobqueue.{name}.{k}": v for k, v in section.items()}


SCRIPTS = {
    "slurm": (
        "SLURMCluster",
        {"queue": "gpu", "walltime": "02:00:00", "job-extra-directives": ["--qos=x"]},
        ["#SBATCH -p gpu", "#SBATCH -t 02:00:00", "#SBATCH --qos=x",
         "#SBATCH --cpus-per-task=4"],
    ),
    "pbs": (
        "PBSCluster",
        {"queue": "workq", "walltime": "02:00:00", "account": "proj1"},
        ["#PBS -q workq", "#PBS -l walltime=02:00:00", "#PBS -A proj1",
         "#PBS -l select=1:ncpus=4"],
    ),
    "sge": (
        "SGECluster",
        {"queue": "all.q", "walltime": "02:00:00", "resource-spec": "h_vmem=8G"},
        ["#$ -q all.q", "#$ -l h_rt=02:00:00", "#$ -l h_vmem=8G"],
    ),
    "lsf": (
        "LSFCluster",
        {"queue": "normal", "walltime": "02:00", "lsf-units": "mb"},
        ["#BSUB -q normal", "#BSUB -W 02:00", "#BSUB -n 4"],
    ),
    "htcondor": (
        "HTCondorCluster",
        {"disk": "1GB"},
        ["RequestCpus = MY.DaskWorkerCores", "RequestDisk"],
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_backend_builds_the_dask_jobqueue_cluster_and_job_script(name: str) -> None:
    import dask_jobqueue

    cls_name, extra, lines = SCRIPTS[name]
    with dask.config.set(_jobqueue_section(name, **extra)):
        cluster = jobqueue.make_cluster(name)
        try:
            assert isinstance(cluster, getattr(dask_jobqueue, cls_name))
            assert isinstance(cluster, jobwatch.ReplacesEndedJobs)
            script = cluster.job_script()
            assert cluster.worker_spec == {}  # nothing submitted
            assert jobwatch.slots(cluster) == (2, 2)  # 2 workers x 2 threads a job
        finally:
            cluster.close()
    for line in lines:
        assert line in script, f"{line!r} not in\n{script}"
    assert "module load python" in script
    assert "--nworkers 2" in script and "--nthreads 2" in script
    assert "--interface lo" in script


def test_missing_cores_and_memory_name_the_jobqueue_keys() -> None:
    with dask.config.set({"jobqueue.pbs.cores": None, "jobqueue.pbs.memory": None}):
        with pytest.raises(config.ConfigError) as info:
            jobqueue.make_cluster("pbs")
    message = str(info.value)
    assert "jobqueue.pbs.cores and jobqueue.pbs.memory are not set" in message
    assert "DASK_JOBQUEUE__PBS__CORES" in message


def test_adaptive_needs_a_maximum() -> None:
    with dask.config.set(
        {"fiber.adaptive.enabled": True, "fiber.adaptive.maximum": None}
    ):
        with pytest.raises(config.ConfigError, match="fiber.adaptive.maximum is null"):
            jobqueue.SLURMBackend().start()


def test_refused_job_names_the_likely_key_first() -> None:
    with dask.config.set(_jobqueue_section("slurm", queue="nope", walltime="1:00")):
        cluster = jobqueue.make_cluster("slurm")
        try:
            error = RuntimeError(
                "Command exited with non-zero exit code.\nstderr:\nsbatch: error: "
                "invalid partition specified: nope\n"
            )
            words = jobwatch._submit_error(error)
            # as the job watcher words it: the batch system its cluster class has
            message = cluster._fiber_batch.refused(cluster, words, 10.0)
            late = cluster._fiber_batch.refused(cluster, "", 10.0)
        finally:
            cluster.close()
    assert message.startswith(
        "sbatch refused the worker job: sbatch: error: invalid partition specified"
    )
    assert "(jobqueue.slurm.queue = 'nope', " in message
    assert "fiber.connect-timeout=10s" in late


STATUS_OUTPUT = {
    "slurm": ("12 RUNNING\n13 PENDING\n", {"12": "RUNNING", "13": "PENDING"}),
    "pbs": (
        "Job id            Name             User   Time Use S Queue\n"
        "----------------  ---------------- ------ -------- - -----\n"
        "12.pbs-server     dask-worker      me     00:00:01 R workq\n"
        "13.pbs-server     dask-worker      me            0 Q workq\n",
        {"12": "R", "13": "Q"},
    ),
    "sge": (
        "job-ID  prior   name       user  state submit/start at     queue  slots\n"
        "-----------------------------------------------------------------------\n"
        "     12 0.55500 dask-worke me    r     12/03/2026 10:00:00 all.q@n1  4\n"
        "     13 0.00000 dask-worke me    qw    12/03/2026 10:00:01           4\n",
        {"12": "r", "13": "qw"},
    ),
    "lsf": ("12 RUN\n13 PEND\n", {"12": "RUN", "13": "PEND"}),
    "htcondor": ("12.0 2\n13.0 1\n", {"12.0": "RUNNING", "13.0": "IDLE"}),
}


@pytest.mark.parametrize("name", sorted(STATUS_OUTPUT))
def test_job_states_read_each_batch_systems_listing(name: str) -> None:
    """The parsers, on the documented default output of each status command."""
    text, expected = STATUS_OUTPUT[name]
    assert jobqueue.SCHEDULERS[name].parse(text) == expected
    assert set(expected.values()) <= jobqueue.SCHEDULERS[name].alive


def fiber_defaults(fiber: dict[str, Any]) -> dict[str, Any]:
    return dask.config.merge(copy.deepcopy(config.defaults["fiber"]), fiber)


def _profiles() -> list[pathlib.Path]:
    return [
        p
        for p in sorted(ADAPTERS.glob("*.yaml"))
        if yaml.safe_load(p.read_text())["fiber"].get("backend") in jobqueue.SCHEDULERS
    ]


def test_the_hpc_profiles_exist() -> None:
    names = {p.name for p in _profiles()}
    assert {"slurm.yaml", "slurm-adaptive.yaml", "pbs.yaml"} <= names


@pytest.mark.parametrize("path", _profiles(), ids=lambda p: p.name)
def test_hpc_profile_builds_its_job_script(path: pathlib.Path) -> None:
    collected = dask.config.collect(paths=[str(path)], env={})
    name = collected["fiber"]["backend"]
    section = collected["jobqueue"][name]
    with (
        dask.config.set(
            {"fiber": fiber_defaults(collected["fiber"]), **_keys(name, section)}
        ),
        dask.config.set(
            # this host has no such network: the scheduler here listens on lo, the
            # job script keeps the profile's interface
            {
                f"jobqueue.{name}.scheduler-options": {
                    "dashboard_address": ":0",
                    "interface": "lo",
                }
            }
        ),
    ):
        config.validate(extra_paths=[path])
        cluster = jobqueue.make_cluster(name)
        try:
            script = cluster.job_script()
            per_job, threads = jobwatch.slots(cluster)
            # its scheduler (in this process) shows the pools: the dashboard plugin
            assert "fiber-dask-pools" in cluster.scheduler.plugins
        finally:
            cluster.close()
    assert per_job * threads == section["cores"]
    if section.get("queue"):
        assert section["queue"] in script
    if section.get("walltime"):
        assert str(section["walltime"]) in script
    for directive in section.get("job-extra-directives", []):
        assert directive in script
    assert "--memory-limit" in script
    for arg in section.get("worker-extra-args", []):  # --lifetime, before walltime
        assert f" {arg}" in script
    if section.get("interface"):
        assert f"--interface {section['interface']}" in script


def test_without_dask_jobqueue_the_error_says_how_to_install_it(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "dask_jobqueue", None)  # import fails
    with pytest.raises(ImportError, match=r'pip install "fiber-dask\[jobqueue\]"'):
        jobqueue.make_cluster("slurm")


def test_using_a_batch_backend_keeps_the_programs_ctrl_c() -> None:
    """dask-jobqueue replaces SIGINT's handler with sys.exit when imported; a
    program that uses these backends must still get KeyboardInterrupt."""
    code = (
        "import signal\n"
        "from fiber_dask.backends import jobqueue\n"
        "jobqueue.make_cluster('pbs', cores=1, memory='1GB')\n"
        "assert signal.getsignal(signal.SIGINT) is signal.default_int_handler, "
        "signal.getsignal(signal.SIGINT)\n"
    )
    done = subprocess.run(
        terminal_python("-c", code), capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr


SCANCEL_CAUSE = """
    import json, os, sys, time
    import fiber_dask

    MARKS = sys.argv[1]

    def task(x):
        job = os.environ["SLURM_JOB_ID"]
        with open(os.path.join(MARKS, f"started-{job}.tmp"), "w") as f:
            f.write(job)
        os.rename(os.path.join(MARKS, f"started-{job}.tmp"),
                  os.path.join(MARKS, f"started-{job}"))
        time.sleep(120)
        return "not cancelled"

    if __name__ == "__main__":
        out = {}
        with fiber_dask.Pool(1) as pool:
            try:
                out["value"] = pool.apply(task, (0,))
            except fiber_dask.WorkerLostError as e:
                out.update(cause=e.cause, address=e.address, message=str(e))
        fiber_dask.shutdown()
        print("RESULT " + json.dumps(out), flush=True)
"""


@pytest.mark.timeout(150)
def test_scancel_under_a_task_is_a_job_cause(slurm, tmp_path) -> None:
    """Issue 31: the WorkerLostError of a task whose worker's job was
    cancelled says so (``cause="job"``), not merely that a worker died."""
    prog = Program(tmp_path, slurm, fiber={"pool": {"allowed-failures": 0}})
    marks = tmp_path / "marks"
    marks.mkdir()
    proc = prog.start(SCANCEL_CAUSE, str(marks))
    try:
        started = wait_until(lambda: list(marks.glob("started-*")), 90, "the task")
        job = started[0].name.split("-")[1]
        subprocess.run(["scancel", job], env={**os.environ, **slurm}, check=True)
        r = prog.result(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert r.get("cause") == "job", r
    assert f"batch job {job}" in r["message"], r
    assert "scancel, walltime" in r["message"], r
    prog.assert_no_job_left()


def test_two_checks_of_one_ended_job_replace_it_once() -> None:
    """A job's workers end together (their --lifetime): each removal starts a
    check of the job, and the checks' awaits interleave.  One replacement is
    submitted, and neither check fails (the second raised KeyError and
    submitted a second replacement when the scheduler was asked between the
    last check and the replacement)."""
    import asyncio
    import itertools
    import time
    import types

    from distributed.core import Status

    from fiber_dask.backends.jobwatch import ReplacesEndedJobs

    class SchedulerComm:
        """Holds the first question until both checks have asked one: they
        are then both past their squeue, as when their answers cross."""

        def __init__(self):
            self.asked = 0
            self.both = asyncio.Event()

        async def events(self, topic=None):
            self.asked += 1
            if self.asked >= 2:
                self.both.set()
            await asyncio.wait_for(self.both.wait(), 10)
            return [(time.time(), {"action": "remove-worker", "expected": True})]

    class Job:
        job_id = "42"

        async def close(self):
            pass

    class Cluster(ReplacesEndedJobs):
        pass

    c = Cluster.__new__(Cluster)  # the watcher's state alone, no batch system
    c.status = Status.running
    c.worker_spec = {"job-0": {}}
    c.workers = {"job-0": Job()}
    c.scheduler_info = {"workers": {}}
    c.scheduler_comm = None  # made in the event loop, below
    c._fiber_grace = 0.1
    c._fiber_removed = {"tcp://h:1": "42", "tcp://h:2": "42"}
    numbers = itertools.count(1)
    c.new_worker_spec = lambda: {f"job-{next(numbers)}": {}}

    async def correct_state():
        pass

    c._correct_state = correct_state

    def states(ids):  # squeue: the job is gone
        return {}

    c._fiber_batch = types.SimpleNamespace(name="slurm", states=states, alive=())

    async def both():
        c.scheduler_comm = SchedulerComm()
        return await asyncio.gather(
            c._fiber_check("job-0", 0.0),
            c._fiber_check("job-0", 0.0),
            return_exceptions=True,
        )

    assert asyncio.run(both()) == [None, None]
    assert list(c.worker_spec) == ["job-1"]
