"""Slot processes: each pool slot runs its tasks in a process of its own.

How a pool slot runs (``fiber.pool.slots: process``)::

    pool owner             Dask worker process                   same host
    ──────────             ───────────────────                   ─────────
    client.submit(run_pool_worker) ─► keeper (the Dask task: holds the task
                                      slot and the pool's resources)
                                        │ Fork(id, spec)       ┌──────────────────┐
                                        ├─────────────────────►│ template process │
                                        │◄── Started(id, pid) ─│ (one per Dask    │
                                        │                      │  worker, single- │
                                        │                      │  threaded, with  │
                                        │                      │  fiber_dask and  │
                                        │                      │  cloudpickle     │
                                        │                      │  preloaded)      │
                                        │                      └───────┬──────────┘
                                        │                         fork │
    ChannelServer ◄──── connect, HMAC ─────────────────────────── slot process:
      ── chunks ──────────────────────────────────────────────►   main thread runs
      ◄── results ────────────────────────────────────────────    serve_slot (the
                                        │                          initializer, tasks)
                                        │◄── Exited(id, code, reason) ──── (reaped
                                        ▼                               by the template)
                                 returns the reason to Dask
                                 ("recycled": fork a fresh one first)

Why this shape (measured; see benchmarks/RESULTS.md):

* **A template per Dask worker, forked per slot**, as the stdlib's forkserver.
  Forking the Dask worker itself is unsafe (it runs an event loop and a thread
  pool: a lock held at fork time stays held in the child).  Starting a fresh
  interpreter per slot costs an interpreter start plus importing fiber_dask
  (which imports dask): 0.43-0.53 s per slot on this 2-core machine at load ~3
  (1.3-2.7 s at load 20), again at every ``maxtasksperchild`` restart.  A fork
  of the single-threaded, preloaded template is connected to its pool in
  ~10 ms at load ~3 (40-120 ms at load 20); the template's own start is paid
  once per Dask worker: on the embedded cluster first thing in a worker forked
  from the worker server (fiber_dask.backends.workerstart), or, for a spawned
  worker, as it imports
  the user's main module, if that imports fiber_dask (:func:`early_templates`,
  :func:`start_early`: 1-2 s before the worker has imported distributed), by
  forking the worker itself, which is then still single-threaded and has
  fiber_dask and dask imported (a fresh template interpreter re-imported them:
  ~0.3 s of CPU per worker during the cluster's start, on the same cores);
  else at its ``dask_setup`` preload below; elsewhere by the first keeper on
  that worker, both as a fresh interpreter.  What a fork does before connecting was measured too: a full
  ``dask.config.refresh()`` (20 ms), numpy 2's lazy ``numpy.random`` import
  (8 ms) and the idna codec's import in the first ``getaddrinfo`` (5-10 ms)
  were moved out of it.
* **A spare forked ahead.**  The template keeps one slot process forked and
  set up (signals, fds, ``PR_SET_PDEATHSIG``, faulthandler) that waits for
  its :class:`SlotSpec` on a pipe; a fork request hands the spec to it and
  forks the next spare after answering.  A slot start and a
  ``maxtasksperchild`` restart are then a hand-over plus the connect.  The
  spare dies with the template (PDEATHSIG, and EOF on its spec pipe).
* **Tasks get their core and GIL back** (``benchmarks/cpushare.py``, CPU
  accounting that other load on the machine does not skew): with thread slots
  the Dask worker's other threads (event loop, heartbeats, the 10 ms sampling
  profiler) used 7-17 % of a CPU-bound task's CPU *inside its process*, i.e.
  holding its GIL; in a slot process 0.1-0.2 %, as in a stdlib worker.  What
  remains is the cluster's own processes on the same cores: ~0.04 cores for
  the driver (scheduler, client, the pool's result thread) and ~0.06 cores for
  two idle Dask workers, 0.03 once ``dask_setup`` turns their profiler off.
* **The keeper stays a Dask task.**  Dask keeps placing slots, reserving
  ``resources=``, counting them for adaptive scaling and re-running a keeper
  whose worker died; the slot process talks to the owner directly over the
  channel, so no chunk takes an extra hop.
* **Lifetimes.**  The template dies with its Dask worker: ``PR_SET_PDEATHSIG``
  (it fires when the *thread* that started the template exits, so the template
  is started by, and read by, one long-lived thread of the worker, never a task
  thread that may retire) plus EOF on its stdin for other platforms and for the
  window before the ``prctl``.  A slot process dies with its template (the same
  two guards, relative to the template) and with its pool: EOF on the owner's
  connection ends it, and a task that does not stop within
  :data:`TERMINATE_GRACE` of a terminate or of the owner's loss ends the slot
  process (only it: no Dask worker is harmed, so this holds on any cluster).
* **Restarts stay local.**  ``maxtasksperchild`` retires a slot process; its
  keeper forks the next one at once instead of a new Dask task.  A slot process
  that crashed (segfault, ``os._exit``, SIGKILL, OOM) makes the keeper return
  how it died (a :class:`~fiber_dask.engine.poolprotocol.Death`), so the owner
  counts a failed loop and Dask places a new one; the owner sees the dropped
  connection and re-runs the chunk, as for a lost worker, and the error of a
  task that keeps crashing says why.  A slot process's memory counts against
  its Dask worker's limit (:mod:`fiber_dask.engine.slotmemory`).

The messages between keeper and template, and what each means, are
:mod:`fiber_dask.engine.templateprotocol`, which both ends import: ``Fork`` on
the template's stdin; ``Started``, ``Exited``, ``Failed`` and ``Restarted`` (a
``maxtasksperchild`` successor started by the template itself) on its report
pipe, each a frame of :mod:`fiber_dask.engine.slotpipe`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import pickle
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

from ..launch import childsetup
from ..transparency import resourcetracker
from . import slotmemory
from . import templateprotocol as proto
from .slotpipe import FrameReader, write_frame

__all__ = [
    "SlotSpec",
    "keep",
    "get_template",
    "warm_up",
    "early_templates",
    "start_early",
    "TERMINATE_GRACE",
]

logger = logging.getLogger(__name__)

#: Seconds a task in a slot process gets to stop after ``terminate()`` (or the
#: owner's loss) before its slot process ends itself.  Short: ending a slot
#: process harms nothing else, and the stdlib's ``terminate()`` does not wait
#: at all.
TERMINATE_GRACE = 0.3


@dataclasses.dataclass
class SlotSpec:
    """What a slot process needs: the ``serve_slot`` arguments and its environment."""

    address: tuple[str, int]
    authkey: bytes
    service: str
    slot: int
    init_blob: bytes | None
    maxtasks: int | None
    worker_address: str | None
    env: dict[str, str]
    kill_after: float = TERMINATE_GRACE
    #: The relay's address and this keeper's token (slotrelay), or None: the
    #: slot process dials the owner itself.
    relay: tuple[Any, bytes] | None = None


# ---------------------------------------------------------------- the template


class _Fork:
    """The keeper's view of one slot process."""

    def __init__(self, limits: tuple | None = None) -> None:
        #: The memory limit this slot process counts against
        #: (fiber_dask.engine.slotmemory), or None.
        self.limits = limits
        #: Set by slotmemory when it ended the slot process for memory.
        self.memory: tuple | None = None
        self.pid: int | None = None
        self.code: int | None = None
        self.reason: str | None = None
        self.error: str | None = None
        self.started = threading.Event()
        self.done = threading.Event()

    def _finish(self, code: int | None, reason: str | None, error: str | None) -> None:
        if self.limits is not None:
            slotmemory.unwatch(self)
        self.code, self.reason, self.error = code, reason, error
        self.started.set()
        self.done.set()


class Template:
    """This process's handle on its template process (one per Dask worker).

    ``fork_here``: fork the template from this process, now, if it is
    single-threaded (:func:`start_early`); else, and by default, start it as a
    fresh interpreter (``python -m fiber_dask.engine.slotserver``).
    """

    @classmethod
    def over_pipes(cls, request_w: int, report_r: int) -> Template:
        """A handle on a template another process started for this one (the
        embedded cluster's worker fork server forks the first pool's,
        :class:`fiber_dask.backends.workerstart.EarlyTemplate`): requests go
        to ``request_w``, reports come from ``report_r``, and it is not this
        process's child (nothing to reap)."""
        self = cls.__new__(cls)
        self._setup()
        self.proc = _HandedTemplate(request_w)
        self.ready.set()
        self._start_reader(report_r)
        return self

    def _start_reader(self, report_r: int) -> None:
        """Read the template's reports on a thread of their own."""
        self.thread = threading.Thread(
            target=self._read_reports,
            args=(report_r,),
            name="fiber-slot-template",
            daemon=True,
        )
        self.thread.start()

    def _setup(self) -> None:
        self.lock = threading.Lock()
        self.forks: dict[int, _Fork] = {}
        self.next_id = 0
        self.proc: subprocess.Popen | _ForkedTemplate | _HandedTemplate | None = None
        self.dead = False
        self.error: BaseException | None = None
        self.ready = threading.Event()
        self.forked = False

    def __init__(self, fork_here: bool = False) -> None:
        self._setup()
        if fork_here and _single_threaded():
            # The thread that forks is this process's main thread (start_early
            # runs as the main module is imported): the template's
            # PR_SET_PDEATHSIG then fires only when the process ends.
            try:
                report_r = self._fork()
            except OSError as e:
                raise OSError(f"cannot fork the fiber-dask slot template: {e}") from e
            self.forked = True
            self._start_reader(report_r)
            return
        # The thread that starts the template must outlive it: the template's
        # PR_SET_PDEATHSIG fires when this *thread* exits.  It then reads the
        # template's reports until the template is gone.
        self.thread = threading.Thread(
            target=self._run, name="fiber-slot-template", daemon=True
        )
        self.thread.start()
        self.ready.wait()
        if self.error is not None:
            raise self.error

    def _fork(self) -> int:
        """Fork the template from this single-threaded process; the read end
        of its report pipe."""
        tracker_fd = resourcetracker.share()  # the template and its slots share it
        request_r, request_w = os.pipe()
        report_r, report_w = os.pipe()
        parent = os.getpid()
        try:
            pid = os.fork()
        except OSError:
            for fd in (request_r, request_w, report_r, report_w):
                os.close(fd)
            raise
        if pid == 0:  # the template
            code = 1
            try:
                code = _forked_template(parent, request_r, report_w, tracker_fd)
            except BaseException:  # noqa: BLE001 - report it, then end
                import traceback

                traceback.print_exc()
            finally:
                os._exit(code)  # never back into the worker's start
        os.close(request_r)
        os.close(report_w)
        self.proc = _ForkedTemplate(pid, request_w)
        self.ready.set()
        return report_r

    def _run(self) -> None:
        report_r = -1
        try:
            report_r, report_w = os.pipe()
            env = dict(os.environ)
            env["FIBER_DASK_LAUNCHER_PID"] = str(os.getpid())
            # The template must import this very fiber_dask.
            env["PYTHONPATH"] = childsetup.pythonpath_with_package(env)
            tracker_fds = resourcetracker.for_child(env)
            try:
                self.proc = subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "fiber_dask.engine.slotserver",
                        str(report_w),
                    ],
                    stdin=subprocess.PIPE,
                    pass_fds=(report_w, *tracker_fds),
                    env=env,
                    close_fds=True,
                )
            finally:
                os.close(report_w)
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            if report_r >= 0:
                os.close(report_r)
            self.error = OSError(f"cannot start the fiber-dask slot template: {e}")
            self.dead = True
            self.ready.set()
            return
        self.ready.set()
        self._read_reports(report_r)

    def _read_reports(self, report_r: int) -> None:
        reader = FrameReader(report_r)
        broken = None
        try:
            while True:
                try:
                    frames = reader.read()
                except OSError:
                    frames = None
                if frames is None:
                    break
                try:
                    msgs = [proto.decode(frame, proto.REPORTS) for frame in frames]
                except ValueError as e:
                    # A bug: let the template go (its stdin's EOF), or the
                    # wait() below would never return, and fail what it holds.
                    logger.error("%s", e)
                    broken = str(e)
                    with self.lock:
                        self.dead = True  # no fork() writes to it any more
                        self.close()
                    break
                for msg in msgs:
                    self._on_report(msg)
        finally:
            os.close(report_r)
            with self.lock:
                self.dead = True
                forks, self.forks = list(self.forks.values()), {}
            code = self.proc.wait()
            for f in forks:
                f._finish(
                    None, None, broken or f"the slot template process exited ({code})"
                )
            global _template
            with _template_lock:
                if _template is self:
                    _template = None

    def _on_report(self, msg: Any) -> None:
        kind = type(msg)
        running = kind is proto.Started or kind is proto.Restarted
        with self.lock:
            if running:
                fork = self.forks.get(msg.rid)
            else:  # Exited, Failed: the request's last message
                fork = self.forks.pop(msg.rid, None)
        if fork is None:
            return
        if running:
            if fork.limits is not None and fork.pid is not None:
                slotmemory.unwatch(fork)  # recycled: its successor's turn
            fork.pid = msg.pid
            if fork.limits is not None:
                slotmemory.watch(fork, fork.limits)
            fork.started.set()
        elif kind is proto.Exited:
            fork._finish(msg.code, msg.reason, None)
        else:  # Failed
            fork._finish(None, None, msg.error)

    def fork(self, spec: SlotSpec, limits: tuple | None = None) -> _Fork:
        """Ask the template for a slot process running ``spec``; it counts
        against ``limits`` (:mod:`fiber_dask.engine.slotmemory`), if any."""
        blob = pickle.dumps(spec, protocol=pickle.HIGHEST_PROTOCOL)
        f = _Fork(limits)
        with self.lock:
            if self.dead:
                f._finish(None, None, "the slot template process is gone")
                return f
            rid = self.next_id
            self.next_id += 1
            self.forks[rid] = f
            try:
                write_frame(
                    self.proc.stdin.fileno(), proto.encode(proto.Fork(rid, blob))
                )
            except OSError as e:
                self.forks.pop(rid, None)
                f._finish(None, None, f"cannot reach the slot template process: {e}")
        return f

    def close(self) -> None:
        """Close the template's stdin: it exits, and its slot processes with it."""
        try:
            self.proc.stdin.close()
        except (OSError, AttributeError):
            pass


class _ForkedTemplate:
    """A template forked by :meth:`Template._fork`: what the keeper uses of a
    :class:`subprocess.Popen` (``stdin``, ``pid``, ``wait``)."""

    def __init__(self, pid: int, request_w: int) -> None:
        self.pid = pid
        self.stdin = os.fdopen(request_w, "wb", buffering=0)

    def wait(self) -> int:
        try:
            _, status = os.waitpid(self.pid, 0)
        except ChildProcessError:
            return -1
        return os.waitstatus_to_exitcode(status)


class _HandedTemplate:
    """A template that is not this process's child (:meth:`Template.over_pipes`):
    its request pipe, and nothing to wait for."""

    pid = None

    def __init__(self, request_w: int) -> None:
        self.stdin = os.fdopen(request_w, "wb", buffering=0)

    def wait(self) -> int:
        return -1  # its parent (the worker fork server) reaps it


def _single_threaded() -> bool:
    """Whether this process has one OS thread (native ones counted): only then
    is a fork safe.  False where that cannot be told (no ``/proc``)."""
    try:
        return len(os.listdir("/proc/self/task")) == 1
    except OSError:
        return False


def _forked_template(
    parent: int,
    request_fd: int,
    report_fd: int,
    tracker_fd: int | None = None,
    *,
    numpy: bool = True,
) -> int:
    """In the child of :meth:`Template._fork`: become the template process.

    It keeps only its two pipes, the standard streams and the worker's
    resource-tracker pipe ``tracker_fd`` (:mod:`fiber_dask.transparency.resourcetracker`),
    as the fresh interpreter's ``close_fds`` and ``pass_fds`` do: an inherited
    descriptor, such as the spawn pipe whose end tells a Nanny its worker
    exited, must not outlive the worker.  It drops the worker's half-imported
    main module: slot processes get their functions by value or import them,
    as from a fresh template.
    """
    keep_fds = {0, 1, 2, request_fd, report_fd}
    if tracker_fd is not None:
        keep_fds.add(tracker_fd)
    try:
        fds = [int(fd) for fd in os.listdir("/proc/self/fd")]
    except OSError:
        fds = []
    for fd in fds:
        if fd not in keep_fds:
            try:
                os.close(fd)
            except OSError:
                pass
    sys.modules.pop("__mp_main__", None)
    global _template_lock
    _template_lock = threading.Lock()  # held by the forking get_template()
    from . import slotserver

    return slotserver.serve(request_fd, report_fd, parent, numpy=numpy)


_template: Template | None = None
_template_lock = threading.Lock()


def get_template(fork_here: bool = False) -> Template:
    """This process's template, started on first use (``fork_here``: see
    :class:`Template`)."""
    global _template
    with _template_lock:
        if _template is None or _template.dead:
            _template = Template(fork_here)
        return _template


#: Set (to "1") in the environment the embedded cluster's Dask worker
#: processes are spawned with: "start your template as fiber_dask is imported".
EARLY_ENV = "FIBER_DASK_EARLY_SLOT_TEMPLATE"

#: ``multiprocessing`` names a Nanny's worker process so (distributed.nanny);
#: with the environment variable it tells such a process from any other child.
_NANNY_WORKER_NAME = "Dask Worker process (from Nanny)"


@contextlib.contextmanager
def early_templates() -> Iterator[None]:
    """Around the start of the embedded cluster: its Dask worker processes,
    spawned meanwhile, fork their slot template as soon as they have imported
    fiber_dask (:func:`start_early`), instead of starting a fresh interpreter
    for it at their ``dask_setup``.

    A spawned worker imports the user's main module (which imports fiber_dask)
    ~1-2 s before it has imported distributed and runs its preloads, while it
    is still single-threaded; a fork then is safe, and the template has
    fiber_dask (and dask, and whatever the main module imported before it)
    without importing them again: a fresh template interpreter cost ~0.3 s of
    CPU per worker, taken from the cluster's own start on the same cores.
    Only the processes spawned inside this block see the variable, and each
    worker removes it from its environment.
    """
    old = os.environ.get(EARLY_ENV)
    os.environ[EARLY_ENV] = "1"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(EARLY_ENV, None)
        else:
            os.environ[EARLY_ENV] = old


#: Whether this process's template was started by :func:`start_early`.
started_early = False


def start_early() -> None:
    """Called as the last thing of fiber_dask's ``__init__``: in a Dask worker
    process spawned by :func:`early_templates`'s cluster, start the slot
    template now, forked from this process while it is single-threaded
    (:class:`Template` ``fork_here``; a fresh interpreter if it is not, say
    because the main module started a thread before importing fiber_dask).

    Only where the main module imports fiber_dask at its top level, as
    ``import fiber_dask as multiprocessing`` does, and, for every worker of
    the embedded cluster however it starts, as its process begins to run
    (:class:`fiber_dask.backends.workerstart._Process`); elsewhere
    :func:`dask_setup` starts it.  The template then has the environment the
    worker process was spawned with (``distributed.nanny.pre-spawn-environ``
    included, not ``distributed.nanny.environ``, which the worker applies
    later); a slot process still gets its worker's whole environment.
    """
    if os.environ.pop(EARLY_ENV, None) != "1":
        return
    import multiprocessing

    if multiprocessing.current_process().name != _NANNY_WORKER_NAME:
        return
    global started_early
    try:
        get_template(fork_here=True)
        started_early = True
    except OSError:
        logger.debug("fiber-dask: cannot start the slot template", exc_info=True)


async def warm_up(dask_worker: Any = None) -> None:
    """Start this worker's template now, so the first slot need not wait for
    its interpreter and imports (``client.run(warm_up, wait=False)``: a
    coroutine, because only coroutines may run unawaited; it returns as soon
    as the template is forked, ~10 ms, without waiting for its imports)."""
    try:
        get_template()
    except OSError:
        logger.debug("fiber-dask: cannot start the slot template", exc_info=True)


def dask_setup(worker: Any) -> None:
    """Dask worker preload hook (``--preload fiber_dask.engine.slots``, as the embedded
    cluster does): start the template as the worker starts, in parallel with
    its registration, and turn the worker's sampling profiler off.

    The profiler (every 10 ms) would only sample keepers waiting for their slot
    processes; off, two idle Dask workers use 0.031 instead of 0.062 cores
    (``benchmarks/cpushare.py``), CPU the tasks on the same cores get back.
    Preloads run before the worker starts its periodic callbacks.
    """
    callbacks = getattr(worker, "periodic_callbacks", None)
    if isinstance(callbacks, dict):
        for name in ("profile", "profile-cycle"):
            pc = callbacks.pop(name, None)
            if pc is not None:
                pc.stop()
    try:
        get_template()
    except OSError:
        logger.debug("fiber-dask: cannot start the slot template", exc_info=True)


# ------------------------------------------------------------------ the keeper


def keep(
    address: tuple[str, int],
    authkey: bytes,
    service: str,
    slot: int,
    init_blob: bytes | None,
    maxtasks: int | None,
    worker: Any = None,
    relay: bool = False,
) -> str:
    """Body of a pool-slot Dask task in process mode: keep one slot process running.

    ``relay``: the slot process reaches the owner through this process's
    relay (:mod:`fiber_dask.engine.slotrelay`), which this keeper joins to
    the pool's link first; else it dials the owner itself.

    Returns why the slot ended, as :func:`fiber_dask.engine.poolworker.serve_slot`
    does (``"stopped"``, ``"terminated"``, ``"no-pool"``, ...), or, when it
    died, a :class:`~fiber_dask.engine.poolprotocol.Death` saying how (its
    signal or exit code; ended by :mod:`fiber_dask.engine.slotmemory` for
    memory), which the owner puts in the ``WorkerLostError`` of a task that
    keeps killing its processes.  A slot process retired by
    ``maxtasksperchild`` (``"recycled"``) is replaced without a new Dask task:
    by the template at once (``Restarted``), or here when that failed.
    """
    from ..launch.launcher import child_env
    from . import slotrelay

    worker_address = getattr(worker, "address", None)
    try:
        scheduler_address = worker.scheduler.address
    except AttributeError:
        scheduler_address = None
    env = child_env(
        worker_address,
        scheduler_address,
        getattr(worker, "security", None),
        getattr(worker, "name", None),
    )
    env.pop("FIBER_DASK_LAUNCHER_PID", None)
    env.pop(EARLY_ENV, None)  # left by a worker forked, not spawned, mid-start
    spec = SlotSpec(
        address, authkey, service, slot, init_blob, maxtasks, worker_address, env
    )
    hold = None
    try:
        relayer = slotrelay.get_relay() if relay else None
    except OSError as e:  # no Unix socket here: the slot process dials
        logger.debug("fiber-dask: no slot relay (%r); slots dial the owner", e)
        relayer = None
    if relayer is not None:
        hold = relayer.open(address, authkey, service, slot, worker_address)
        if isinstance(hold, str):
            return hold  # the pool is gone or unreachable: no slot process
        spec.relay = hold.ticket
    try:
        return _keep(spec, worker)
    finally:
        if hold is not None:
            hold.close()


def _keep(spec: SlotSpec, worker: Any = None) -> Any:
    """Keep ``spec``'s slot process running; why the slot ended (a string,
    or a :class:`~fiber_dask.engine.poolprotocol.Death`)."""
    from .poolprotocol import Reason

    limits = slotmemory.limits_of(worker)
    while True:
        try:
            template = get_template()
        except OSError as e:
            return f"slot process could not start: {e}"
        f = template.fork(spec, limits)
        # No timeout: the template answers once its imports are done (seconds
        # on a loaded host), and its death ends the wait; a keeper that gave up
        # early could leave a slot process it no longer keeps.
        f.done.wait()
        if f.reason in (Reason.RECYCLED, Reason.EXPIRED):
            # maxtasksperchild, or killed at a hard time limit: the template
            # could not start its successor itself
            continue
        if f.reason is not None:
            return f.reason
        if f.error is not None:
            return f"slot process could not start: {f.error}"
        return slotmemory.death(f, spec.worker_address)
