"""How the embedded cluster starts its Dask worker processes: forked from one
preloaded process (``fiber.local.worker-start: forkserver``, the default).

Dask's nannies start each worker process with multiprocessing's ``spawn``: a
fresh interpreter that imports the user's main module, fiber_dask with dask
(~0.3 s here) and distributed (~0.45 s, numpy included) before it can register.
On the 2-core machine the first ``Pool(2)`` paid that twice, at the same time
as the owner imported distributed itself: 1.2 of its 1.9 s to the first result
(benchmarks/RESULTS.md, cold start).

Here, as the embedded cluster starts, one process is started with the same
interpreter, environment and ``sys.path`` a spawned worker gets, and it imports
what a worker needs (the main module as ``__mp_main__``, fiber_dask,
distributed's worker and nanny) once, on the other core, while the owner
imports distributed.  Every worker process — the first ones, those a grown or
adaptive cluster adds, and those a nanny restarts — is then a fork of it
(multiprocessing's forkserver protocol, the stdlib's own server loop), ~10 ms
instead of ~0.8 s of imports.  What a child gets is what a spawned one gets:

* a fresh interpreter's state, never the owner's: the server is not a fork of
  the owner (which may run threads, an OpenMP pool or CUDA at that point, which
  a fork would break), and it imports nothing the owner has set up;
* the owner's environment at the moment the nanny starts it (``os.environ`` is
  carried with the process object and set first thing in the child, so a
  nanny's ``pre-spawn-environ`` and fiber-dask's own variables arrive as with
  spawn); variables read only at interpreter start or at an import (the hash
  seed, ``OMP_NUM_THREADS`` for numpy's BLAS) come from the server's
  environment, which is the owner's plus Dask's ``distributed.nanny.pre-spawn-
  environ``, exactly what a nanny would have spawned with;
* the pool-slot template forked first thing, while the child is single-threaded
  (:func:`fiber_dask.engine.slots.start_early`), as a spawned worker does after its
  imports.

Only the embedded cluster's nannies use it (:class:`Nanny` marks its own
process starts; any other ``distributed`` process start in this interpreter
keeps Dask's method).  It is not used when ``distributed.worker.multiprocessing-
method`` is set to something other than ``spawn``, nor with
``fiber.local.worker-start: spawn``.  If the server cannot be started or dies,
a worker is spawned instead, and a later start tries a fresh server.

However it starts, an embedded worker process is a :class:`_Process`, which
ignores SIGINT (:mod:`fiber_dask.transparency.interrupts`): a terminal's Ctrl-C and Jupyter's "interrupt kernel" signal
the whole process group, and are meant for the program and its tasks (slot
processes and ``Process`` children take them, as the stdlib's pool workers and
children do), not for the cluster under them.  A Dask worker that took one
closed itself and its nanny, for good.

The server lives while the owner or any of its workers does (the stdlib's
"alive" pipe: a SIGKILLed owner takes its nannies, whose workers then exit,
and with them the server), and is stopped and reaped, with a deadline, when
the cluster closes (:meth:`WorkerForkServer.stop`).  No ``PR_SET_PDEATHSIG``:
a server killed under running workers would make every nanny read its
worker's exit as 255 and start a second one.
"""

from __future__ import annotations

import contextvars
import io
import logging
import os
import pickle
import socket
import sys
import threading
from multiprocessing import (
    connection,
    context,
    forkserver,
    popen_forkserver,
    resource_tracker,
    spawn,
    util,
)
from typing import Any

from ..launch import childsetup
from ..transparency import interrupts

__all__ = [
    "WorkerForkServer",
    "EarlyTemplate",
    "available",
    "worker_env",
    "nanny_class",
    "start",
    "PRELOAD",
    "SLOT_PRELOAD",
]

logger = logging.getLogger(__name__)

#: What the server imports first (after the main module): what a pool slot
#: process needs.  An early slot template (:class:`EarlyTemplate`) is forked
#: once these are in, before distributed's imports.
SLOT_PRELOAD = [
    "fiber_dask",
    "fiber_dask.engine.slots",
    "fiber_dask.engine.slottask",
    "fiber_dask.engine.slotserver",  # and what a slot process imports
    "fiber_dask.engine.poolworker",
    "fiber_dask.launch.processchild",
    "fiber_dask.swap",
    "faulthandler",
    "multiprocessing.synchronize",
    "secrets",
    "cloudpickle",
]

#: What the server imports before it serves (after the main module): what a
#: Dask worker process started by a nanny imports before it registers.
PRELOAD = [
    *SLOT_PRELOAD,
    "distributed",
    "distributed.nanny",
    "distributed.worker",
    "distributed.process",
    "distributed.http.worker",
    "distributed.http.health",
    "distributed.http.statics",
    "distributed.http.prometheus",
]

#: Seconds :meth:`WorkerForkServer.stop` waits for the server to exit once its
#: workers are gone, before it kills it.
STOP_GRACE = 2.0

# The context of the nanny starting a process now (set by Nanny.instantiate).
_current: contextvars.ContextVar[_Context | None] = contextvars.ContextVar(
    "fiber_dask_worker_fork_server", default=None
)


class EarlyTemplate:
    """Ask the server to fork a pool-slot template of the owner's as soon as it
    has imported what slot processes need (:data:`SLOT_PRELOAD`), before
    distributed: the first pool's slots then start while the cluster does
    (:mod:`fiber_dask.engine.earlyslots`).  The template is the grandchild
    of the owner, with the same imports and main-module state as the one a
    Dask worker forks (:func:`fiber_dask.engine.slots.start_early`); the
    owner talks to it over the two pipes made here (the template protocol of
    :mod:`fiber_dask.engine.templateprotocol`), and it dies with the server
    (``PR_SET_PDEATHSIG``) or when its request pipe is closed.

    ``numpy``: preload numpy in the template (the owner has imported it, so
    the tasks likely use it); else a task that imports it pays that in its
    slot process.
    """

    def __init__(self, numpy: bool) -> None:
        from ..transparency import resourcetracker

        self.numpy = numpy
        self.request_r, self.request_w = os.pipe()
        self.report_r, self.report_w = os.pipe()
        # The owner's resource tracker, which the slot processes then share
        # (fiber_dask.transparency.resourcetracker), as a worker's slots share
        # the worker's.
        self.tracker_fd = resourcetracker.share()

    def server_fds(self) -> tuple[int, ...]:
        """The descriptors the server inherits (and closes once forked)."""
        fds = (self.request_r, self.report_w)
        return fds if self.tracker_fd is None else (*fds, self.tracker_fd)

    def sent(self) -> None:
        """The server has its copies: close the owner's ends the owner does not use."""
        for fd in (self.request_r, self.report_w):
            os.close(fd)
        self.request_r = self.report_w = -1

    def discard(self) -> None:
        """No server took it: close every end still open."""
        for name in ("request_r", "request_w", "report_r", "report_w"):
            fd = getattr(self, name)
            if fd >= 0:
                os.close(fd)
                setattr(self, name, -1)


class WorkerForkServer(forkserver.ForkServer):
    """A forkserver of our own (not the stdlib's process-wide one), started as a
    fresh interpreter with :data:`PRELOAD` imported and a spawned worker's
    environment (and, asked to, an :class:`EarlyTemplate` forked on the way)."""

    def __init__(self, env: dict[str, str], early: EarlyTemplate | None = None) -> None:
        super().__init__()
        self.env = env
        self.early = early
        self.failed = False
        self._proc: Any = None
        self.context = _Context(self)

    def alive(self) -> bool:
        """Whether the server can take a request now (or will start on one)."""
        return not self.failed

    def ensure_running(self) -> None:
        """Start the server if it is not running (as the stdlib's, but with our
        command, environment and preloads); returns at once, before the server
        has imported anything: requests wait in its listen queue."""
        import subprocess

        with self._lock:
            if self.failed:
                raise OSError("the worker fork server was stopped or failed")
            resource_tracker.ensure_running()
            if self._proc is not None:
                if self._proc.poll() is None:
                    return
                os.close(self._forkserver_alive_fd)
                self._forkserver_address = None
                self._forkserver_alive_fd = None
                self._forkserver_pid = self._proc = None
            # What spawn.prepare() gives a spawned child (argv, cwd, sys.path,
            # the main module, ...), handed over on the server's stdin; not
            # the authkey, which each worker gets with its own start.
            prep = spawn.get_preparation_data("ignore")
            prep.pop("authkey", None)
            prep.pop("name", None)
            with socket.socket(socket.AF_UNIX) as listener:
                address = connection.arbitrary_address("AF_UNIX")
                listener.bind(address)
                if not util.is_abstract_socket_namespace(address):
                    os.chmod(address, 0o600)
                listener.listen()
                # Every client (the owner, each worker) holds the write end of
                # the "alive" pipe: the server exits when all have closed it.
                alive_r, alive_w = os.pipe()
                try:
                    cmd = (
                        "from fiber_dask.backends.workerstart import serve; "
                        f"serve({listener.fileno()}, {alive_r})"
                    )
                    args = [
                        spawn.get_executable(),
                        *util._args_from_interpreter_flags(),
                        "-c",
                        cmd,
                    ]
                    env = {**os.environ, **self.env}
                    # The server must import this very fiber_dask.
                    env["PYTHONPATH"] = childsetup.pythonpath_with_package(env)
                    # Only the first start carries the early template: a
                    # server started again (the first died) forks none.
                    early, self.early = self.early, None
                    early_fds = early.server_fds() if early is not None else ()
                    early_args = (
                        None
                        if early is None
                        else (*early_fds[:2], early.tracker_fd, early.numpy)
                    )
                    # Ctrl-C is not for the cluster, from the first instruction on.
                    with interrupts.held_for_child():
                        proc = subprocess.Popen(
                            args,
                            stdin=subprocess.PIPE,
                            pass_fds=(listener.fileno(), alive_r, *early_fds),
                            env=env,
                            close_fds=True,
                        )
                    if early is not None:
                        early.sent()
                    try:
                        pickle.dump((prep, PRELOAD, early_args), proc.stdin)
                        proc.stdin.close()
                    except OSError:  # it died at once: no server, then
                        proc.kill()
                        proc.wait()
                        raise
                except BaseException:
                    os.close(alive_w)
                    raise
                finally:
                    os.close(alive_r)
            self._forkserver_address = address
            self._forkserver_alive_fd = alive_w
            self._forkserver_pid = proc.pid
            self._proc = proc

    def stop(self, timeout: float = STOP_GRACE) -> int | None:
        """Tell the server to exit (it does once the workers forked from it are
        gone) and reap it; kill it after ``timeout`` seconds (0: now).  Never
        blocks much longer.  Its exit code, None if it was not running."""
        import subprocess

        with self._lock:
            proc, fd, address = (
                self._proc,
                self._forkserver_alive_fd,
                self._forkserver_address,
            )
            self._forkserver_pid = self._forkserver_alive_fd = None
            self._forkserver_address = self._proc = None
            self.failed = True  # no new starts through a stopped server
        if fd is not None:
            os.close(fd)
        if address and not util.is_abstract_socket_namespace(address):
            try:
                os.unlink(address)
            except OSError:
                pass
        if proc is None:
            return None
        try:
            if timeout > 0:
                return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        proc.kill()  # (timeout 0: at once, its work given up)
        return proc.wait(max(timeout, STOP_GRACE))

    @property
    def pid(self) -> int | None:
        """The server's pid while it runs."""
        return self._forkserver_pid


def serve(listener_fd: int, alive_r: int) -> None:
    """The server process: read the owner's preparation data and the modules to
    preload from stdin, become what a spawned child is before it unpickles its
    process object (:func:`multiprocessing.spawn.prepare`: argv, cwd,
    ``sys.path``, the main module imported as ``__mp_main__``), import the
    preloads, then run the stdlib's forkserver loop.

    It exits instead, quietly, if that fails (code 3) or leaves a thread
    running (code 4: a fork would lose the thread, or inherit a lock it
    holds): the owner then spawns its workers, which show the real error, if
    any, as before.  Never an interpreter shutdown of its own (the owner's
    at-exit handlers are not its).
    """
    from multiprocessing import process

    interrupts.cluster_process()  # held from the start on (interrupts.held_for_child)
    code = 0
    try:
        prep, preload, early = pickle.load(sys.stdin.buffer)
        try:
            process.current_process()._inheriting = True  # as spawn._main
            try:
                spawn.prepare(prep)
            finally:
                del process.current_process()._inheriting
            for name in preload:
                __import__(name)
                if early is not None and name == SLOT_PRELOAD[-1]:
                    _fork_early_template(*early)
                    early = None
        except BaseException:  # noqa: BLE001 - the spawned workers report it
            code = 3
            return
        finally:
            if early is not None:  # not forked: the owner reads EOF at once
                _close_early(*early)
        if len(os.listdir("/proc/self/task")) != 1:
            code = 4
            return
        import warnings

        # The early slot template is this process's child too, which the
        # stdlib's loop did not fork: it reaps it when it ends, and says so.
        warnings.filterwarnings(
            "ignore", "forkserver: waitpid returned unexpected pid", UserWarning
        )
        forkserver.main(listener_fd, alive_r, [], None, None)
    finally:
        os._exit(code)


def _close_early(request_r: int, report_w: int, tracker_fd: int | None, numpy: bool):
    for fd in (request_r, report_w, tracker_fd):
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass


def _fork_early_template(
    request_r: int, report_w: int, tracker_fd: int | None, numpy: bool
) -> None:
    """In the server, single-threaded, the slot modules imported: fork the
    owner's early slot template (:class:`EarlyTemplate`), then close the
    server's copies of its pipes.  If this process is not single-threaded (the
    main module started a thread), none is forked: the owner reads EOF on the
    report pipe and its pool waits for the cluster's slots."""
    try:
        if len(os.listdir("/proc/self/task")) == 1:
            if numpy:
                try:
                    import numpy as _np  # noqa: F401
                    import numpy.random  # noqa: F401
                except ImportError:
                    pass
            parent, owner = os.getpid(), os.getppid()
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    if tracker_fd is not None:
                        resource_tracker._resource_tracker._fd = tracker_fd
                    # What a worker forked from here has, and so the slots its
                    # template forks: a process started with the forkserver
                    # method defaults to it (BaseProcess._bootstrap).
                    import multiprocessing

                    multiprocessing.set_start_method("forkserver", force=True)
                    # And, as there, the owner as its parent process (its
                    # sentinel, like a worker's, is not kept by the slots).
                    multiprocessing.process._parent_process = (
                        multiprocessing.process._ParentProcess(
                            "MainProcess", owner, request_r
                        )
                    )
                    from ..engine import slots

                    code = slots._forked_template(
                        parent, request_r, report_w, tracker_fd, numpy=numpy
                    )
                except BaseException:  # noqa: BLE001 - say it, then end
                    import traceback

                    traceback.print_exc()
                finally:
                    os._exit(code)
    finally:
        _close_early(request_r, report_w, tracker_fd, numpy)


#: Why the server exited, by its exit code (:func:`serve`).
_EXIT_REASONS = {
    3: "the main module (or fiber_dask, or distributed) failed to import in it",
    4: "importing the main module started a thread, which a fork would lose",
}


class _Popen(popen_forkserver.Popen):
    """The stdlib's forkserver ``Popen`` asking our server, not the global one."""

    server: WorkerForkServer

    def __init__(self, process_obj: Any, server: WorkerForkServer) -> None:
        self.server = server
        super().__init__(process_obj)

    def _launch(self, process_obj: Any) -> None:
        prep_data = spawn.get_preparation_data(process_obj._name)
        buf = io.BytesIO()
        context.set_spawning_popen(self)
        try:
            context.reduction.dump(prep_data, buf)
            context.reduction.dump(process_obj, buf)
        finally:
            context.set_spawning_popen(None)
        self.sentinel, w = self.server.connect_to_new_process(self._fds)
        _parent_w = os.dup(w)
        self.finalizer = util.Finalize(self, util.close_fds, (_parent_w, self.sentinel))
        with open(w, "wb", closefd=True) as f:
            f.write(buf.getbuffer())
        self.pid = forkserver.read_signed(self.sentinel)


class _Process(context.ForkServerProcess):
    """A worker process forked by a :class:`WorkerForkServer`; falls back to
    spawn when the server cannot fork it."""

    _server: WorkerForkServer | None = None
    _environ: dict[str, str] | None = None

    def start(self) -> None:
        # The owner's environment now, as a spawned child would inherit it.
        self._environ = dict(os.environ)
        super().start()

    @staticmethod
    def _Popen(process_obj: Any) -> Any:
        server = process_obj._server
        if server is not None and server.alive():
            try:
                return _Popen(process_obj, server)
            except (OSError, EOFError) as e:
                # The server is gone: spawn this worker and the ones after it.
                why = _EXIT_REASONS.get(server.stop(), f"it is gone ({e})")
                logger.info(
                    "fiber-dask: no worker fork server: %s; spawning worker "
                    "processes instead",
                    why,
                )
        # Dask's own way (spawn unless distributed.worker.multiprocessing-
        # method says otherwise); run() below still runs in the child.
        import multiprocessing

        return multiprocessing.get_context(_dask_method()).Process._Popen(process_obj)

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state.pop("_server", None)  # the owner's handle stays with the owner
        return state

    def run(self) -> None:
        # Ctrl-C is not for the cluster (fiber_dask.transparency.interrupts); with SIGINT
        # ignored, asyncio.run installs no handler of its own either.
        interrupts.cluster_process()
        if self._environ is not None:
            os.environ.clear()
            os.environ.update(self._environ)
        # Every worker a fork of one server: ``random`` reseeds itself after a
        # fork, numpy's global generator does not (spawned workers each had
        # their own seed from the OS).
        # (numpy 2 imports numpy.random lazily: only a generator the server
        # has imported is shared; one imported later is seeded then.)
        np_random = sys.modules.get("numpy.random")
        if np_random is not None:
            try:
                np_random.seed()
            except Exception:  # noqa: BLE001 - a numpy without it
                pass
        from .. import config
        from ..engine import slots

        if config.get("pool.slots") == "process":
            # Single-threaded still: fork the pool-slot template now, also in
            # the workers an adaptive or grown cluster adds later.
            os.environ[slots.EARLY_ENV] = "1"
            slots.start_early()
        super().run()


def _dask_method() -> str:
    """The start method Dask's nannies use (its config), for a worker the
    server does not fork."""
    import dask

    return dask.config.get("distributed.worker.multiprocessing-method", "spawn")


class _Context(context.ForkServerContext):
    """A multiprocessing context whose processes come from one server, or
    from Dask's start method where there is none (``server`` None)."""

    def __init__(self, server: WorkerForkServer | None) -> None:
        self.server = server

    def Process(self, *args: Any, **kwargs: Any) -> _Process:  # noqa: N802
        """A process of this server (``ctx.Process(...)`` as distributed calls it)."""
        p = _Process(*args, **kwargs)
        p._server = self.server
        return p

    def get_context(self, method: str | None = None) -> Any:
        return self if method is None else super().get_context(method)


def _spawn_env() -> dict[str, str]:
    """What a nanny sets before it spawns (``distributed.nanny.pre-spawn-environ``,
    with its ``PYTHONHASHSEED`` rule), read without importing distributed."""
    import dask

    from .. import config

    try:
        defaults = config.distributed_setting("distributed.nanny.pre-spawn-environ")
    except (OSError, KeyError, TypeError, ValueError):
        defaults = {}
    env = {
        **(defaults or {}),
        **(dask.config.get("distributed.nanny.pre-spawn-environ", {}) or {}),
    }
    env = {str(k): str(v) for k, v in env.items()}
    if env.get("PYTHONHASHSEED") in (None, "0"):
        env["PYTHONHASHSEED"] = "6640"  # distributed.nanny's choice
    return env


def worker_env() -> dict[str, str]:
    """The variables a nanny adds to its worker process's environment
    (``distributed.nanny.pre-spawn-environ`` and ``distributed.nanny.environ``,
    a value already in this process's environment winning, as
    distributed.nanny's rule has it), read without importing distributed: what
    a slot process started outside a worker must add to look like one."""
    from .. import config

    env = _spawn_env()
    try:
        extra = config.distributed_setting("distributed.nanny.environ") or {}
    except (OSError, KeyError, TypeError, ValueError):
        extra = {}
    env.update({str(k): str(v) for k, v in extra.items() if v is not None})
    return {k: os.environ.get(k, v) for k, v in env.items()}


def available() -> bool:
    """Whether the embedded cluster's workers are to be forked from a server
    (the configuration and the platform allow it)."""
    from .. import config

    if config.get("local.worker-start") != "forkserver":
        return False
    if _dask_method() != "spawn":
        return False  # the user chose Dask's method; keep it
    return hasattr(socket, "AF_UNIX") and context.reduction.HAVE_SEND_HANDLE


def start(early: EarlyTemplate | None = None) -> WorkerForkServer | None:
    """Start a server for the embedded cluster's workers now, or None where
    workers should be spawned (configured so, or it cannot start).  ``early``:
    have it fork that slot template on its way (None returned: it was not
    taken; the caller discards it)."""
    if not available():
        return None
    try:
        server = WorkerForkServer(_spawn_env(), early)
        server.ensure_running()
    except (OSError, ValueError) as e:
        logger.warning(
            "fiber-dask: cannot start the worker fork server (%s); spawning workers", e
        )
        return None
    return server


class _NannyMixin:
    """What :class:`Nanny` adds: its worker processes are :class:`_Process`
    (forked by its server, if it has one that is alive)."""

    worker_context: _Context

    async def instantiate(self) -> Any:
        token = _current.set(self.worker_context)
        try:
            return await super().instantiate()  # type: ignore[misc]
        finally:
            _current.reset(token)


def _get_mp_context_for(original: Any) -> Any:
    def get_mp_context() -> Any:
        ctx = _current.get()
        return original() if ctx is None else ctx

    get_mp_context.__wrapped__ = original  # type: ignore[attr-defined]
    return get_mp_context


_installed = False
_install_lock = threading.Lock()


def nanny_class(server: WorkerForkServer | None) -> type:
    """A ``distributed.Nanny`` whose worker processes are :class:`_Process`,
    forked by ``server`` (or started Dask's way while there is none)."""
    global _installed
    import distributed.nanny
    import distributed.process

    with _install_lock:
        if not _installed:
            # distributed asks get_mp_context() for the Process, Pipe and
            # Queue of a worker start (nanny.WorkerProcess.start and
            # process.AsyncProcess); ours answers with the server's context
            # only inside a Nanny below's instantiate(), else Dask's own.
            for mod in (distributed.nanny, distributed.process):
                mod.get_mp_context = _get_mp_context_for(mod.get_mp_context)
            _installed = True

    ctx = server.context if server is not None else _Context(None)
    return type(
        "Nanny", (_NannyMixin, distributed.nanny.Nanny), {"worker_context": ctx}
    )
