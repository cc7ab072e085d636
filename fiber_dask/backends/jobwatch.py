"""Watching a dask-jobqueue cluster's jobs: where fiber-dask reaches into it.

:mod:`fiber_dask.backends.jobqueue` starts batch clusters with dask-jobqueue's
public API; what it cannot do that way lives here, and only here:

* :class:`ReplacesEndedJobs`, mixed in before the dask-jobqueue cluster class:
  a job that ends under a running program (``scancel``, walltime, a node
  failure) is replaced once none of its workers came back within a grace
  period and the batch system no longer lists it as queued or running;
* :func:`submit`: grow the cluster to N jobs and *wait* until the batch system
  took them, raising its own words when it refuses one (``scale()`` only logs
  a refusal, from a callback);
* :func:`slots`: workers per job and threads per worker, from the settings;
* :func:`list_jobs`: each job, its batch-system state and its connected
  workers (``fiber-dask info``).

What it asks of the batch system (the commands that list job states, the
message for a refused job) it gets from ``jobqueue.py`` as a
:class:`BatchSystem`, so this module imports nothing of it.

The private names it depends on, checked against dask-jobqueue 0.9.0 (whose
``JobQueueCluster`` is a distributed ``SpecCluster``) on distributed 2026.8.0,
each with what it is used for and what breaks if upstream changes it:

``SpecCluster._correct_state()`` (distributed)
    The coroutine that submits the plan's missing jobs and cancels those
    dropped from it (concurrent calls share one run).  :func:`submit` awaits
    it, a replacement calls it.  Changed: :func:`submit` no longer waits for a
    submission nor sees its error; a replacement is planned but not submitted
    until the next ``scale()``/``adapt()``.
``SpecCluster._correct_state_internal()`` (distributed)
    Its body, overridden; raises what a job's ``start()`` raised.  Changed: a
    refused job stays ``created`` and closing the cluster fails an assertion
    (``_created`` below); a refusal is neither logged (adaptive clusters) nor
    kept for :func:`submit`.
``Cluster._update_worker_status(op, msg)`` (distributed)
    The scheduler's worker stream, overridden: ``"remove"`` with the worker's
    address, in the cluster's event loop.  Changed: ended jobs go unnoticed,
    and a fixed-size cluster shrinks for good with every ``scancel`` or
    walltime.
``SpecCluster._futures`` (distributed)
    The tasks the cluster awaits as it closes; a replacement check is one.
    Changed: the check fails in the event loop (logged there), and no ended
    job is replaced.
``SpecCluster._created`` (distributed; not named here)
    A WeakSet of every ``Job``: ``_close`` asserts each is closing, closed or
    failed, so a ``Job`` left ``created`` makes ``close()`` raise
    ``AssertionError``.  Not used, but why a refused job is marked
    ``Status.failed`` here and no ``Job`` is held longer than its use.
``JobQueueCluster._dummy_job`` (dask-jobqueue)
    A ``Job`` built from the settings; :func:`slots` reads its
    ``worker_processes`` and ``worker_process_threads``.  Changed: a backend's
    start fails (its planned slots, growing a Pool).
``worker_spec[job]["group"]`` (dask-jobqueue)
    The suffixes (``-0``, ``-1``...) of a job's workers' names when
    ``processes`` > 1.  Changed: workers are not matched to their job, so no
    replacement and no worker counts for such jobs.
``Job.job_id``, ``Job.status``, ``Job.close()`` (dask-jobqueue, distributed)
    The batch system's id (None until submitted), the ``ProcessInterface``
    status, cancelling.  Changed: :func:`submit` tells a submitted job by its
    id, so every submission looks refused; no ids in ``fiber-dask info``; an
    ended job is replaced without asking the batch system.
The message of ``Job._call``'s ``RuntimeError`` (dask-jobqueue)
    The batch system's words follow ``"stderr:"``.  Changed: a refusal quotes
    dask-jobqueue's whole message (command, exit code, stdout) instead.
The scheduler's ``remove-worker`` event and its ``expected`` field (distributed)
    Read through ``scheduler_comm.events(topic=worker)``: a worker that said it
    was closing (its ``--lifetime``, a retirement) before its job ended makes
    the replacement an INFO line, not a warning.  Changed: every job that ends
    at its workers' lifetime is reported as ended "while its workers were in
    use".

Besides these, ``worker_spec``, ``workers``, ``new_worker_spec()``,
``scheduler_info``, ``status`` and ``sync()`` of the cluster are used as
distributed documents them, but changed in place (the plan edited directly
rather than through ``scale()``).  The one other upstream coupling is outside
this module: ``jobqueue._import_dask_jobqueue`` undoes the SIGINT handler that
importing dask-jobqueue's ``runner`` module installs.  ``tests/test_slurm.py``
exercises all of them (a real SLURM: ``scancel`` of a job under a Pool, a
refused partition; without one: the cluster class, :func:`slots`, the refusal
message).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, Callable, ClassVar

import dask

from .. import config
from ..errors import ClusterConnectionError
from .base import last_event

__all__ = ["BatchSystem", "ReplacesEndedJobs", "list_jobs", "slots", "submit"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BatchSystem:
    """What watching a cluster's jobs asks of its batch system (given by
    :mod:`fiber_dask.backends.jobqueue`, which knows the batch systems)."""

    #: The backend's name (``slurm``, ``pbs``...), for messages.
    name: str
    #: States in which a job is still queued or running (and may come back).
    alive: frozenset[str]
    #: ``states(job_ids)``: ``{id: state}`` of the jobs it still lists;
    #: raises ``OSError`` when it cannot be asked.
    states: Callable[[list[str]], dict[str, str]]
    #: ``refused(cluster, words, timeout)``: the message for a job it refused
    #: (``words``: its own; empty when it did not answer within ``timeout``).
    refused: Callable[[Any, str, float], str]


class ReplacesEndedJobs:
    """Mixed in before a dask-jobqueue cluster class: replace jobs that ended.

    dask-jobqueue's ``SpecCluster`` keeps an ended job in its plan until
    ``scale()`` or ``adapt()`` changes the size, so a fixed-size cluster would
    shrink for good with every ``scancel`` or walltime.  The scheduler's
    "worker removed" events arrive here (``_update_worker_status``, in the
    cluster's event loop); a job none of whose workers is back after
    :attr:`_fiber_grace` seconds, and that the batch system does not list as
    alive, is replaced.
    """

    #: Seconds a job's workers may be away (a nanny restarting its worker).
    _fiber_grace: ClassVar[float] = 2.0
    #: Set on each cluster class (``jobqueue._cluster_class``).
    _fiber_batch: ClassVar[BatchSystem]

    @property
    def _fiber_failures(self) -> list[str]:
        """Messages of the submission errors so far, oldest first.  Strings: an
        exception's traceback would keep the failed Job objects alive."""
        if "_fiber_failed" not in self.__dict__:
            self._fiber_failed: list[str] = []
        return self._fiber_failed

    async def _correct_state_internal(self) -> None:
        from distributed.core import Status

        try:
            await super()._correct_state_internal()  # type: ignore[misc]
        except Exception as e:
            # A job the batch system refused has no id and never started; mark
            # it failed, or closing the cluster asserts on its status.
            for process in self.workers.values():
                if process.job_id is None and process.status == Status.created:
                    process.status = Status.failed
            message = _submit_error(e)
            self._fiber_failures.append(message)
            if not self.__dict__.get("_fiber_awaited"):  # else submit() raises it
                logger.error(
                    "fiber-dask: the %s batch system refused a worker job: %s",
                    self._fiber_batch.name,
                    self._fiber_batch.refused(self, message, 0.0),
                )
            raise

    def _update_worker_status(self, op: str, msg: Any) -> None:
        name = None
        if op == "remove":
            name = self.scheduler_info["workers"].get(msg, {}).get("name")
        super()._update_worker_status(op, msg)  # type: ignore[misc]
        job = self._fiber_job_of(name) if name is not None else None
        if job is not None:
            # For worker_job_ended: a pool asks why this worker went.
            job_id = getattr(self.workers.get(job), "job_id", None)
            if "_fiber_removed" not in self.__dict__:
                self._fiber_removed: dict[str, str] = {}
            if job_id is not None:
                self._fiber_removed[msg] = job_id
        if job is not None:
            asyncio.get_running_loop().call_later(
                self._fiber_grace, self._fiber_check_soon, job, 0.0
            )

    async def _fiber_planned(self, job_id: str | None) -> bool:
        """Whether every worker of batch job ``job_id`` that the scheduler
        removed had closed on purpose (``remove-worker`` event ``expected``):
        the job then ended as planned, not under its workers."""
        removed = self.__dict__.get("_fiber_removed", {})
        addresses = [a for a, j in removed.items() if j == job_id]
        if job_id is None or not addresses:
            return False
        try:
            for address in addresses:
                if not await _planned_removal(self, address):
                    return False
        except Exception:  # noqa: BLE001 - no word from the scheduler: not planned
            return False
        return True

    def _fiber_job_of(self, worker_name: Any) -> str | None:
        for job, spec in self.worker_spec.items():
            if worker_name == job or any(
                worker_name == f"{job}{suffix}" for suffix in spec.get("group", ())
            ):
                return job
        return None

    def _fiber_connected(self, job: str) -> bool:
        workers = list(self.scheduler_info["workers"].values())
        return any(self._fiber_job_of(w.get("name")) == job for w in workers)

    def _fiber_check_soon(self, job: str, waited: float) -> None:
        task = asyncio.ensure_future(self._fiber_check(job, waited))
        self._futures.add(task)
        task.add_done_callback(self._futures.discard)

    async def _fiber_check(self, job: str, waited: float) -> None:
        from distributed.core import Status

        waited += self._fiber_grace
        if self.status != Status.running or job not in self.worker_spec:
            return  # closing, or scaled down on purpose
        if self._fiber_connected(job):
            return  # the nanny restarted its worker
        process = self.workers.get(job)
        job_id = getattr(process, "job_id", None)
        del process  # holding a Job object keeps dask-jobqueue from closing it
        batch = self._fiber_batch
        if job_id is not None:
            loop = asyncio.get_running_loop()
            try:
                states = await loop.run_in_executor(None, batch.states, [job_id])
            except OSError:
                # No answer from the batch system: wait as long as distributed
                # itself waits before hard-closing a lost worker's job.
                limit = dask.config.get("distributed.deploy.lost-worker-timeout")
                if waited < dask.utils.parse_timedelta(limit):
                    asyncio.get_running_loop().call_later(
                        self._fiber_grace, self._fiber_check_soon, job, waited
                    )
                    return
            else:
                state = states.get(job_id)
                if state in batch.alive:
                    loop.call_later(
                        self._fiber_grace, self._fiber_check_soon, job, waited
                    )
                    return
        # Asked before the last check: nothing may be awaited between that
        # check and the replacement, or two checks of one job (one per worker
        # it ran) would both replace it.
        planned = await self._fiber_planned(job_id)
        if self.status != Status.running or job not in self.worker_spec:
            return
        if planned:
            # Its workers closed first, gracefully: their lifetime
            # (``--lifetime``, set below the walltime) or a retirement.
            logger.info(
                "fiber-dask: the %s job %s (%s) ended after its workers closed "
                "(their lifetime); submitting a replacement",
                batch.name,
                job_id,
                job,
            )
        else:
            logger.warning(
                "fiber-dask: the %s job %s (%s) ended while its workers were in "
                "use; submitting a replacement",
                batch.name,
                job_id,
                job,
            )
        # A new name (made while the old one is still taken): distributed's own
        # lost-worker timer for the old name must not close the replacement.
        self.worker_spec.update(self.new_worker_spec())
        del self.worker_spec[job]
        process = self.workers.pop(job, None)
        if process is not None:
            try:
                await process.close()  # cancels it if it somehow still runs
            except Exception:  # noqa: BLE001 - it is gone either way
                pass
            del process
        await self._correct_state()


async def _planned_removal(cluster: Any, address: str) -> bool:
    """Whether the scheduler, removing the worker at ``address``, expected it
    (the worker had said it was closing: its lifetime, a retirement)."""
    events = await asyncio.wait_for(cluster.scheduler_comm.events(topic=address), 5)
    removal = last_event(events, "remove-worker")
    return bool(removal and removal.get("expected"))


def slots(cluster: Any) -> tuple[int, int]:
    """(workers per job, threads per worker) of ``cluster``'s jobs."""
    job = cluster._dummy_job  # a Job object built from the settings; not kept
    try:
        return int(job.worker_processes), int(job.worker_process_threads)
    finally:
        del job


def submit(cluster: Any, jobs: int) -> None:
    """Grow ``cluster`` to ``jobs`` jobs and wait until the batch system took them.

    Raises ``ClusterConnectionError`` with the batch system's own message (and
    the ``jobqueue.<name>`` keys that went into the job's header) when it refuses
    a job, or when it does not answer within ``fiber.connect-timeout``.
    """
    before = set(cluster.worker_spec)
    failures = len(cluster._fiber_failures)
    # Not cluster.scale(): it submits from a callback of its own, whose failure
    # would only be logged.  _correct_state is the coroutine that runs
    # sbatch/qsub for every planned job that has none yet.
    while len(cluster.worker_spec) < jobs:
        cluster.worker_spec.update(cluster.new_worker_spec())
    timeout = config.timedelta("connect-timeout")
    error: str | None = None
    cluster._fiber_awaited = True
    try:
        cluster.sync(cluster._correct_state, callback_timeout=timeout)
    except TimeoutError:
        error = ""
    except (RuntimeError, ValueError, OSError) as e:
        error = _submit_error(e)  # a string: see _fiber_failures
    finally:
        cluster._fiber_awaited = False
    new = set(cluster.worker_spec) - before
    failed = [j for j in new if getattr(cluster.workers.get(j), "job_id", None) is None]
    if failed and error is None:
        # submitted by a concurrent pass (a replacement) that failed there
        recorded = cluster._fiber_failures[failures:]
        error = recorded[0] if recorded else "the job was not submitted"
    if error is not None:
        for job in failed or new:
            cluster.worker_spec.pop(job, None)
            process = cluster.workers.pop(job, None)
            if process is not None and process.job_id is None:
                from distributed.core import Status

                process.status = Status.failed
            del process
        raise ClusterConnectionError(
            cluster._fiber_batch.refused(cluster, error, timeout)
        )


def _submit_error(error: BaseException) -> str:
    """The batch system's own words from a failed submission."""
    text = str(error)
    return text.split("stderr:", 1)[1].strip() if "stderr:" in text else text


def list_jobs(cluster: Any) -> list[dict[str, Any]]:
    """The cluster's jobs: name, id, the batch system's state, connected workers.

    ``state`` is the batch system's word (``RUNNING``, ``PENDING``, ``Q``...),
    ``None`` when it no longer lists the job, or ``"unknown (...)"`` when its
    status command failed.
    """
    rows = []
    for job in list(cluster.worker_spec):
        job_id = getattr(cluster.workers.get(job), "job_id", None)
        rows.append({"name": str(job), "id": job_id, "state": None, "workers": 0})
    for w in cluster.scheduler_info.get("workers", {}).values():
        owner = cluster._fiber_job_of(w.get("name"))
        for row in rows:
            if row["name"] == str(owner):
                row["workers"] += 1
    ids = [r["id"] for r in rows if r["id"]]
    try:
        states = cluster._fiber_batch.states(ids)
    except OSError as e:
        states = {i: f"unknown ({e})" for i in ids}
    for row in rows:
        row["state"] = states.get(row["id"]) if row["id"] else "not submitted"
    return rows


def worker_job_ended(cluster: Any, worker: str) -> tuple[str, str] | None:
    """``(job id, state)`` when the Dask worker at ``worker``, of ``cluster``
    (one this process started with a :class:`ReplacesEndedJobs` class), went
    with its batch job: the batch system no longer lists the job as queued or
    running (``scancel``, walltime; ``state`` is what it lists, or
    ``"gone"``).  None when it still runs or that cannot be told."""
    batch = getattr(cluster, "_fiber_batch", None)
    if batch is None:
        return None
    job_id = cluster.__dict__.get("_fiber_removed", {}).get(worker)
    if job_id is None:  # not removed yet: find it among the connected workers
        try:
            name = cluster.scheduler_info["workers"].get(worker, {}).get("name")
            job = cluster._fiber_job_of(name) if name is not None else None
            job_id = getattr(cluster.workers.get(job), "job_id", None)
        except (AttributeError, KeyError, TypeError):
            return None
    if job_id is None:
        return None
    try:
        state = batch.states([job_id]).get(job_id)
    except OSError:
        return None
    if state in batch.alive:
        return None
    return job_id, state or "gone"
