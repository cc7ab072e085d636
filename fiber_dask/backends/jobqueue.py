"""Batch schedulers through dask-jobqueue: SLURM, PBS, SGE, LSF and HTCondor.

``fiber.backend: slurm`` (or ``pbs``, ``sge``, ``lsf``, ``htcondor``; extra
``fiber-dask[jobqueue]``) runs the Dask scheduler in this process and its
workers as batch jobs, through dask-jobqueue's ``SLURMCluster`` & co.

The job settings are dask-jobqueue's own, read by dask-jobqueue from its config
section ``jobqueue.<name>`` (``~/.config/dask/jobqueue.yaml``,
``DASK_JOBQUEUE__SLURM__QUEUE=...``, a ``--config`` profile): ``cores``,
``memory``, ``processes``, ``queue``, ``walltime``, ``job-extra-directives``,
``interface``, ``python``, ``job-script-prologue``...  fiber-dask adds no copy of
them under ``fiber:``; :func:`setting` is the one place it reads them.

How the ``fiber`` keys apply::

    job = cores c, processes p  ──►  p workers of c // p threads  (Pool slots)

    not adaptive: one job at start; Pool(processes=N) submits jobs until N slots
                  exist (never fewer); the submission is waited for, so a job the
                  batch system refuses fails the Pool / init() with its message
    adaptive:     cluster.adapt(minimum, maximum, ...) in workers, as
                  distributed.adaptive; fiber.adaptive.maximum is required.  Jobs
                  are submitted later, in the background: on SLURM the job is
                  checked at start with ``sbatch --test-only``; elsewhere a refused
                  job is logged (ERROR) with the same message

Worker loss: a job that ends under a running program (``scancel``, walltime,
a node failure) loses its workers; a Pool re-runs their chunks elsewhere, a
Process on them ends with ``exitcode -9``.  dask-jobqueue itself submits nothing
until ``scale()``/``adapt()`` changes the size, so the cluster class made here
replaces such a job: once none of its workers has come back for a short grace
period and the batch system no longer lists the job as queued or running, the
job is dropped and a new one submitted under a new name (adaptive or not).

That, waiting for a submission and counting a job's slots take dask-jobqueue's
private methods: they live in :mod:`fiber_dask.backends.jobwatch`, with the
list of what they depend on upstream.  This module starts the clusters: the
batch systems' commands, the settings, the cluster class, the backends.

The cluster is closed at :func:`fiber_dask.shutdown` / exit, which cancels every
job it submitted.
"""

from __future__ import annotations

import functools
import math
import subprocess
from dataclasses import dataclass
from typing import Any, Callable, ClassVar

import dask

from .. import config
from ..errors import ClusterConnectionError
from . import jobwatch
from .address import listen_host
from .base import Backend, ClusterHandle, connect, scheduler_preloads

__all__ = [
    "JobQueueBackend",
    "SCHEDULERS",
    "job_states",
    "make_cluster",
    "setting",
]


def setting(name: str, key: str) -> Any:
    """dask-jobqueue's setting ``jobqueue.<name>.<key>`` (None if unset).

    The one place fiber-dask reads the job configuration, so that messages name
    the key a user sets.
    """
    _require_dask_jobqueue()  # its defaults (jobqueue.yaml) load on import
    return dask.config.get(f"jobqueue.{name}.{key}", None)


# ------------------------------------------------------------ the batch systems


def _columns(text: str, id_col: int, state_col: int, skip: int = 0) -> dict[str, str]:
    """``{job id: state}`` from a table, one job per line (ids up to the first '.')."""
    states = {}
    for line in text.splitlines()[skip:]:
        fields = line.split()
        if len(fields) > max(id_col, state_col) and fields[id_col][:1].isdigit():
            states[fields[id_col].split(".")[0]] = fields[state_col]
    return states


def _after_rule(text: str, id_col: int, state_col: int) -> dict[str, str]:
    """As :func:`_columns`, for qstat tables whose rows follow a '-----' line."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("---"):
            return _columns("\n".join(lines[i + 1 :]), id_col, state_col)
    return {}


_CONDOR = {"1": "IDLE", "2": "RUNNING", "3": "REMOVED", "4": "COMPLETED"}
_CONDOR.update({"5": "HELD", "6": "TRANSFERRING", "7": "SUSPENDED"})


def _condor(text: str) -> dict[str, str]:
    states = {}
    for line in text.splitlines():
        fields = line.split()
        if len(fields) == 2:
            states[fields[0]] = _CONDOR.get(fields[1], fields[1])
    return states


@dataclass(frozen=True)
class _Scheduler:
    """What fiber-dask needs to know about one batch system."""

    #: The dask-jobqueue cluster class.
    cluster_class: str
    #: The command that lists the given jobs' states.
    status_argv: Callable[[list[str]], list[str]]
    #: Parses the command's output to ``{job id: state}``.
    parse: Callable[[str], dict[str, str]]
    #: States in which a job is still queued or running (and may come back).
    alive: frozenset[str]
    #: Keys of ``jobqueue.<name>`` that end up in the job's header, to name
    #: when the batch system refuses a job.
    header_keys: tuple[str, ...]


#: The batch systems, by backend name (= dask-jobqueue's config section).
SCHEDULERS: dict[str, _Scheduler] = {
    "slurm": _Scheduler(
        "SLURMCluster",
        lambda ids: [
            "squeue",
            "--noheader",
            "--states=all",
            "--format=%i %T",
            "--jobs=" + ",".join(ids),
        ],
        lambda out: _columns(out, 0, 1),
        frozenset({"PENDING", "RUNNING", "CONFIGURING", "SUSPENDED", "REQUEUED"}),
        (
            "queue",
            "account",
            "walltime",
            "cores",
            "memory",
            "job-cpu",
            "job-mem",
            "job-extra-directives",
        ),
    ),
    "pbs": _Scheduler(
        "PBSCluster",
        lambda ids: ["qstat", *ids],
        lambda out: _after_rule(out, 0, 4),
        frozenset({"Q", "R", "H", "W", "T", "S", "B"}),
        (
            "queue",
            "account",
            "walltime",
            "cores",
            "memory",
            "resource-spec",
            "job-extra-directives",
        ),
    ),
    "sge": _Scheduler(
        "SGECluster",
        lambda ids: ["qstat"],  # the user's jobs; it takes no list of ids
        lambda out: _after_rule(out, 0, 4),
        frozenset({"qw", "hqw", "r", "t", "Rr", "Rq", "s", "S", "T"}),
        ("queue", "project", "walltime", "resource-spec", "job-extra-directives"),
    ),
    "lsf": _Scheduler(
        "LSFCluster",
        lambda ids: ["bjobs", "-noheader", "-o", "jobid stat", *ids],
        lambda out: _columns(out, 0, 1),
        frozenset({"PEND", "RUN", "PSUSP", "USUSP", "SSUSP", "WAIT", "PROV"}),
        (
            "queue",
            "project",
            "walltime",
            "ncpus",
            "mem",
            "cores",
            "memory",
            "job-extra-directives",
        ),
    ),
    "htcondor": _Scheduler(
        "HTCondorCluster",
        lambda ids: ["condor_q", "-af:j", "JobStatus", *ids],
        _condor,
        frozenset({"IDLE", "RUNNING", "HELD", "TRANSFERRING", "SUSPENDED"}),
        ("cores", "memory", "disk", "job-extra-directives"),
    ),
}


def job_states(name: str, job_ids: list[str], timeout: float = 10.0) -> dict[str, str]:
    """The batch system's state of each job, ``{id: state}``.

    A job the batch system no longer lists is missing from the result.  Raises
    ``OSError`` when the status command cannot be run or fails.
    """
    if not job_ids:
        return {}
    argv = SCHEDULERS[name].status_argv(list(job_ids))
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError as e:
        raise OSError(f"{argv[0]} is not installed here (not on PATH)") from e
    except subprocess.TimeoutExpired as e:
        raise OSError(f"{argv[0]} did not answer within {timeout:g}s") from e
    if r.returncode != 0:
        if name == "slurm" and "Invalid job id" in r.stderr:
            return {}  # all of them are gone (purged after MinJobAge)
        raise OSError(f"{' '.join(argv)} failed ({r.returncode}): {r.stderr.strip()}")
    states = SCHEDULERS[name].parse(r.stdout)
    wanted = {i.split(".")[0]: i for i in job_ids}
    return {wanted[k]: v for k, v in states.items() if k in wanted}


# ------------------------------------------------------------------- the cluster


_classes: dict[str, type] = {}


def _import_dask_jobqueue() -> Any:
    """``import dask_jobqueue`` without its side effect on this process.

    Its ``runner`` module (imported by the package) replaces the process's
    SIGINT handler with ``sys.exit`` at import time, so Ctrl-C in the user's
    program would no longer raise ``KeyboardInterrupt``; the handler the
    program had is put back.
    """
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        import dask_jobqueue  # signal.signal would fail there anyway

        return dask_jobqueue
    before = signal.getsignal(signal.SIGINT)
    try:
        import dask_jobqueue
    finally:
        if signal.getsignal(signal.SIGINT) is not before and before is not None:
            signal.signal(signal.SIGINT, before)
    return dask_jobqueue


def _cluster_class(name: str) -> type:
    if name not in _classes:
        dask_jobqueue = _import_dask_jobqueue()

        base = getattr(dask_jobqueue, SCHEDULERS[name].cluster_class)
        batch = jobwatch.BatchSystem(
            name,
            SCHEDULERS[name].alive,
            functools.partial(job_states, name),
            functools.partial(_refused, name),
        )
        _classes[name] = type(
            base.__name__, (jobwatch.ReplacesEndedJobs, base), {"_fiber_batch": batch}
        )
    return _classes[name]


def make_cluster(name: str, **kwargs: Any) -> Any:
    """A dask-jobqueue cluster for ``name`` from ``jobqueue.<name>``, with no job yet.

    Nothing is submitted: ``cluster.job_script()`` shows what a job will run.
    ``kwargs`` go to the cluster class (as in dask-jobqueue, they override the
    config).

    Raises
    ------
    fiber_dask.config.ConfigError
        When ``jobqueue.<name>.cores`` or ``.memory`` is not set.
    """
    _require_dask_jobqueue()
    missing = [
        f"jobqueue.{name}.{key}"
        for key in ("cores", "memory")
        if kwargs.get(key) is None and setting(name, key) is None
    ]
    if missing:
        env = ", ".join(
            f"DASK_{k.upper().replace('.', '__').replace('-', '_')}=..."
            for k in missing
        )
        raise config.ConfigError(
            f"fiber.backend is {name!r} but {' and '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not set: dask-jobqueue needs the "
            "cores and memory of each worker job. Set them in dask-jobqueue's config "
            f"(~/.config/dask/jobqueue.yaml, a --config profile such as "
            f"adapters/{name if name in ('slurm', 'pbs') else 'slurm'}.yaml, or {env})."
        )
    if "processes" not in kwargs:
        # Passed explicitly, not left to the config: only then does dask-jobqueue
        # know that a job holds several workers (its "group"), which adaptive
        # scaling and slot counting rely on.
        processes = setting(name, "processes")
        if processes is None:
            from distributed.deploy.local import nprocesses_nthreads

            cores = kwargs.get("cores") or setting(name, "cores")
            processes = nprocesses_nthreads(cores)[0]
        kwargs["processes"] = processes
    if "scheduler_options" not in kwargs:
        # The scheduler runs in this process: it shows the pools on its
        # dashboard and to `fiber-dask info` (fiber_dask.dashboard).
        options = dict(setting(name, "scheduler-options") or {})
        preload = scheduler_preloads(options.get("preload"))
        kwargs["scheduler_options"] = {**options, "preload": preload}
    try:
        return _cluster_class(name)(**kwargs)
    except ValueError as e:
        raise config.ConfigError(
            f"dask-jobqueue rejects the jobqueue.{name} settings: {e}"
        ) from e
    except RuntimeError as e:  # "Cluster failed to start: ..." (its scheduler)
        where = ", ".join(
            f"jobqueue.{name}.{k} = {setting(name, k)!r}"
            for k in ("interface", "scheduler-options")
        )
        raise ClusterConnectionError(
            f"the scheduler of the {name} cluster did not start in this process: "
            f"{e}. It listens as the settings say ({where}); an interface must "
            "exist on this host (`ip -brief addr`)."
        ) from e


def _test_only(cluster: Any) -> None:
    """Ask SLURM whether it would accept the job (``sbatch --test-only``), so that
    an adaptive cluster, which submits only once there is work, fails at start
    on a partition or account that does not exist."""
    import tempfile

    timeout = config.timedelta("connect-timeout")
    with tempfile.NamedTemporaryFile("w", suffix=".sh") as f:
        f.write(cluster.job_script())
        f.flush()
        try:
            r = subprocess.run(
                ["sbatch", "--test-only", f.name],
                capture_output=True,
                text=True,
                timeout=timeout,
            )
        except subprocess.TimeoutExpired:
            raise ClusterConnectionError(
                _refused("slurm", cluster, "", timeout)
            ) from None
        except FileNotFoundError as e:
            raise ClusterConnectionError(
                f"sbatch is not installed here ({e}): run the program where SLURM's "
                "commands work (a login node, or inside an allocation)"
            ) from None
    if r.returncode != 0:
        words = r.stderr.strip() or r.stdout.strip()
        raise ClusterConnectionError(_refused("slurm", cluster, words, timeout))


def _refused(name: str, cluster: Any, error: str, timeout: float) -> str:
    """The message for a job the batch system refused (``error``: its words;
    empty when it did not answer within ``timeout``)."""
    submit_cmd = cluster.job_cls.submit_command.split()[0]
    if not error:
        what = (
            f"{submit_cmd} did not return within fiber.connect-timeout={timeout:g}s "
            "(is the batch system's controller reachable from this host?)"
        )
    else:
        what = f"{submit_cmd} refused the worker job: {error}"
    keys = SCHEDULERS[name].header_keys
    values = {k: setting(name, k) for k in keys}
    # The key the message is most likely about first (a partition / queue name,
    # an account, a time limit), then every other one that is set.
    hints = {
        "queue": ("partition", "queue"),
        "account": ("account",),
        "project": ("project", "account"),
        "walltime": ("time limit", "walltime", "time"),
        "memory": ("memory", "mem"),
        "cores": ("cpu", "core", "processor"),
    }
    low = what.lower()
    first = [k for k in keys if any(w in low for w in hints.get(k, ())) and k in values]
    rest = [k for k in keys if k not in first and values[k] not in (None, [], {})]
    named = ", ".join(f"jobqueue.{name}.{k} = {values[k]!r}" for k in first + rest)
    return (
        f"{what}. The job was built from dask-jobqueue's settings ({named}); fix "
        f"them in ~/.config/dask/jobqueue.yaml, a --config profile or "
        f"DASK_JOBQUEUE__{name.upper()}__... variables (cluster.job_script() shows "
        "the job script)."
    )


# -------------------------------------------------------------------- backends


class JobQueueBackend(Backend):
    """Start a dask-jobqueue cluster (owned: its jobs are cancelled at exit)."""

    name: ClassVar[str] = ""

    def start(self, *, address: str | None = None) -> ClusterHandle:
        cfg = config.validate()
        adaptive = cfg["adaptive"]
        if adaptive["enabled"] and adaptive["maximum"] is None:
            raise config.ConfigError(
                f"fiber.adaptive.enabled is true with fiber.backend {self.name!r} but "
                "fiber.adaptive.maximum is null: set the most workers adaptive "
                "scaling may ask the batch system for (each job holds "
                f"jobqueue.{self.name}.processes of them)."
            )
        cluster = make_cluster(self.name)
        try:
            per_job, threads = jobwatch.slots(cluster)
            if adaptive["enabled"]:
                if self.name == "slurm":
                    _test_only(cluster)
                cluster.adapt(
                    minimum=adaptive["minimum"],
                    maximum=adaptive["maximum"],
                    target_duration=adaptive["target-duration"],
                    interval=adaptive["interval"],
                    wait_count=adaptive["wait-count"],
                )
                planned = adaptive["maximum"] * threads
            else:
                jobwatch.submit(cluster, 1)
                planned = per_job * threads
            client = connect(
                cluster,
                lambda timeout, e: (
                    f"cannot connect to the {self.name} cluster's scheduler at "
                    f"{cluster.scheduler_address} within "
                    f"fiber.connect-timeout={timeout:g}s: {e}"
                ),
            )
        except BaseException:
            cluster.close(timeout=config.timedelta("connect-timeout"))
            raise
        handle = _JobQueueHandle(
            client,
            cluster,
            owned=True,
            backend=self.name,
            listen_host=listen_host(client.scheduler.address),
            planned_slots=planned,
        )
        handle.jobs = lambda: jobwatch.list_jobs(cluster)
        if not adaptive["enabled"]:
            handle.grow = _Grower(handle, cluster, per_job * threads)
        return handle


class _JobQueueHandle(ClusterHandle):
    """Closes the cluster within a deadline: that cancels its jobs."""

    def close(self, timeout: float | None = None) -> None:
        try:
            self.client.close(**({} if timeout is None else {"timeout": timeout}))
        finally:
            # Cancelling the jobs gets its own deadline, at least 10 s: jobs
            # left queued or running would hold the allocation.
            self.cluster.close(timeout=max(10.0, config.timedelta("connect-timeout")))


class _Grower:
    """``Pool(processes=N)`` on a fixed-size cluster: submit jobs (never cancel
    any) until N tasks run at once."""

    def __init__(self, handle: ClusterHandle, cluster: Any, per_job: int) -> None:
        self.handle, self.cluster = handle, cluster
        self.per_job = per_job

    def __call__(self, slots: int) -> None:
        want = math.ceil(slots / self.per_job)
        if want > len(self.cluster.worker_spec):
            jobwatch.submit(self.cluster, want)
            self.handle.planned_slots = want * self.per_job


def _require_dask_jobqueue() -> None:
    try:
        _import_dask_jobqueue()
    except ImportError as e:
        raise ImportError(
            "the slurm, pbs, sge, lsf and htcondor backends need dask-jobqueue, "
            f'which is not installed ({e}): pip install "fiber-dask[jobqueue]"'
        ) from e


def _backend(backend_name: str) -> type[JobQueueBackend]:
    cls = type(
        f"{backend_name.upper()}Backend"
        if len(backend_name) <= 4
        else "HTCondorBackend",
        (JobQueueBackend,),
        {"name": backend_name, "__module__": __name__},
    )
    cls.__doc__ = (
        f"``fiber.backend: {backend_name}``: workers as "
        f"{SCHEDULERS[backend_name].cluster_class} jobs (jobqueue.{backend_name}.*)."
    )
    return cls


SLURMBackend = _backend("slurm")
PBSBackend = _backend("pbs")
SGEBackend = _backend("sge")
LSFBackend = _backend("lsf")
HTCondorBackend = _backend("htcondor")

__all__ += ["SLURMBackend", "PBSBackend", "SGEBackend", "LSFBackend", "HTCondorBackend"]
