"""The slot template process: ``python -m fiber_dask.engine.slotserver REPORT_FD``.

Started by :class:`fiber_dask.engine.slots.Template` in a Dask worker, as a fresh
interpreter or forked from the worker while it is still single-threaded (the
why and the picture are in :mod:`fiber_dask.engine.slots`).  It preloads
what every slot process needs (cloudpickle, fiber_dask's pool-worker code,
numpy if it is installed), then, single-threaded, starts one slot process per
``Fork`` read from stdin (handing the spec to the spare it keeps forked ahead,
or forking one now) and reports on ``REPORT_FD`` its pid and, once reaped, its
exit status and the reason its loop returned (the messages:
:mod:`fiber_dask.engine.templateprotocol`).  EOF on stdin
(the Dask worker is gone, or let it go) ends the template, and its slot
processes with it.

A slot process is made to look like a stdlib pool worker: its main thread
runs the initializer and the tasks, default signal handlers,
``current_process()`` named ``SpawnPoolWorker-N`` with ``daemon`` True, its own
``random`` and ``numpy.random`` seeds, ``/dev/null`` as stdin, and the
environment a fiber_dask ``Process`` child gets (so nested Pools, Processes and
queues started by a task attach to the same cluster).
"""

from __future__ import annotations

import os
import select
import signal
import sys

_PR_SET_PDEATHSIG = 1


def _die_with_parent(expected_ppid: int | None) -> None:
    """SIGKILL when the parent (thread) exits; exit now if it already has."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except Exception:  # noqa: BLE001 - the other guards still hold
            pass
    if expected_ppid is not None and os.getppid() != expected_ppid:
        os._exit(1)  # the parent is already gone


def _preload(numpy: bool = True) -> None:
    # Everything a slot process imports before its first task, paid once here
    # instead of in every slot process.
    import cloudpickle  # noqa: F401

    import fiber_dask.engine.poolworker  # noqa: F401
    import fiber_dask.engine.slotrelay  # noqa: F401
    import fiber_dask.launch.processchild  # noqa: F401
    from fiber_dask.launch import childsetup

    childsetup.preload()  # the swap (fiber_dask.process came with the package)

    # The first getaddrinfo() on a str host imports the idna codec and compiles
    # its regexes: 5-10 ms in every slot process's connect, were it left to them.
    "localhost".encode("idna")
    if not numpy:
        return  # the early template of an owner without numpy: its tasks pay it
    try:
        import numpy  # noqa: F401
        import numpy.random  # noqa: F401  (lazy in numpy 2; each slot reseeds it)
    except ImportError:
        pass


class _Waiting:
    """A forked slot process that has set itself up and waits for its spec."""

    def __init__(self, pid: int, spec_w: int, reason_r: int) -> None:
        self.pid, self.spec_w, self.reason_r = pid, spec_w, reason_r


class _Slot:
    """A slot process serving a request: what the template knows of it."""

    def __init__(self, rid: int, reason_fd: int, blob: bytes) -> None:
        self.rid, self.blob = rid, blob
        self.reason_fd: int | None = reason_fd  # None once read to EOF
        self.reason = b""


class _Server:
    """The template's state: its slot processes, its spare, its pipes."""

    def __init__(self, request_fd: int, report_fd: int, sig_r: int, sig_w: int):
        from fiber_dask.engine import templateprotocol
        from fiber_dask.engine.poolprotocol import Reason
        from fiber_dask.engine.slotpipe import write_frame

        self.write_frame = write_frame
        self.proto = templateprotocol
        # As a slot process writes them: maxtasksperchild retired it, or the
        # owner had it killed at an item's hard time limit (it wrote this,
        # then SIGKILLed itself).  Either way a successor takes over at once.
        self.replace = {Reason.RECYCLED.encode(), Reason.EXPIRED.encode()}
        self.report_fd = report_fd
        self.own_fds = [request_fd, report_fd, sig_r, sig_w]
        self.children: dict[int, _Slot] = {}
        self.retired: set[int] = set()  # replaced after "recycled", not yet reaped
        self.spare: _Waiting | None = None
        self.me = os.getpid()

    def report(self, msg: object) -> None:
        """Send the keeper ``msg`` (a :mod:`~fiber_dask.engine.templateprotocol`
        message)."""
        self.write_frame(self.report_fd, self.proto.encode(msg))

    def fork_waiting(self) -> _Waiting:
        """Fork a slot process that sets itself up, then waits for its spec."""
        spec_r, spec_w = os.pipe()
        reason_r, reason_w = os.pipe()
        try:
            pid = os.fork()
        except OSError:
            for fd in (spec_r, spec_w, reason_r, reason_w):
                os.close(fd)
            raise
        if pid == 0:
            code = 1
            try:
                close = self.own_fds + self.reason_fds()
                if self.spare is not None:
                    close += [self.spare.spec_w, self.spare.reason_r]
                code = _child(self.me, close + [spec_w, reason_r], spec_r, reason_w)
            finally:
                os._exit(code)  # never return into the template's loop
        os.close(spec_r)
        os.close(reason_w)
        return _Waiting(pid, spec_w, reason_r)

    def reason_fds(self) -> list[int]:
        return [c.reason_fd for c in self.children.values() if c.reason_fd is not None]

    def refill(self) -> None:
        """Keep one spare forked ahead, so that a slot start (and a
        ``maxtasksperchild`` restart) is a hand-over, not a fork and setup."""
        if self.spare is None:
            try:
                self.spare = self.fork_waiting()
            except OSError:
                pass  # fork at the next request instead

    def hand_over(self, blob: bytes) -> _Waiting | str:
        """A slot process running ``blob``: the spare, or one forked now when
        there is none (or it died); the error text if none can start."""
        for _ in range(2):
            proc, self.spare = self.spare, None
            if proc is None:
                try:
                    proc = self.fork_waiting()
                except OSError as e:
                    return f"fork failed: {e}"
            try:
                _write_all(proc.spec_w, blob)
            except OSError:
                # The spare died (or was killed) before its hand-over: it is
                # reaped as a stranger; try a fresh one.
                os.close(proc.reason_r)
                continue
            finally:
                os.close(proc.spec_w)
            return proc
        return "slot processes die at start"

    def start(self, rid: int, blob: bytes) -> None:
        """Answer a ``Fork(rid, blob)`` request."""
        proc = self.hand_over(blob)
        if isinstance(proc, str):
            self.report(self.proto.Failed(rid, proc))
            return
        self.children[proc.pid] = _Slot(rid, proc.reason_r, blob)
        self.report(self.proto.Started(rid, proc.pid))

    def read_reasons(self, ready: list[int]) -> None:
        """Read the reasons slot processes wrote as their loop returned.  A
        slot retired by ``maxtasksperchild`` (``Reason.RECYCLED``) or killed
        at a hard time limit (``Reason.EXPIRED``) is replaced at once,
        before it has even exited, with the same spec, and reported
        as ``Restarted(id, pid)``: no round trip through the keeper."""
        for pid, c in list(self.children.items()):
            if c.reason_fd is None or c.reason_fd not in ready:
                continue
            try:
                data = os.read(c.reason_fd, 4096)
            except OSError:
                data = b""
            if data:
                c.reason += data
                continue
            os.close(c.reason_fd)
            c.reason_fd = None
            if c.reason not in self.replace:
                continue  # reported once reaped, with its exit status
            proc = self.hand_over(c.blob)
            if isinstance(proc, str):
                continue  # reported once reaped: the keeper asks again
            del self.children[pid]
            self.retired.add(pid)
            self.children[proc.pid] = _Slot(c.rid, proc.reason_r, c.blob)
            self.report(self.proto.Restarted(c.rid, proc.pid))

    def reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if self.spare is not None and pid == self.spare.pid:
                os.close(self.spare.spec_w)
                os.close(self.spare.reason_r)
                self.spare = None  # forked again at the next request
                continue
            self.retired.discard(pid)
            c = self.children.pop(pid, None)
            if c is None:
                continue
            code = os.waitstatus_to_exitcode(status)
            reason = c.reason
            if c.reason_fd is not None:
                reason += _read_reason(c.reason_fd)
            text = reason.decode("utf-8", "replace") if reason else None
            self.report(self.proto.Exited(c.rid, code, text))

    def kill_all(self) -> None:
        pids = [*self.children, *self.retired]
        if self.spare is not None:
            pids.append(self.spare.pid)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def main() -> int:
    """``python -m fiber_dask.engine.slotserver REPORT_FD``: requests on stdin."""
    expected = os.environ.pop("FIBER_DASK_LAUNCHER_PID", None)
    from fiber_dask.transparency import resourcetracker

    resourcetracker.adopt()  # the Dask worker's, which slot processes inherit
    return serve(os.dup(0), int(sys.argv[1]), int(expected) if expected else None)


def serve(
    request_fd: int, report_fd: int, expected_ppid: int | None, *, numpy: bool = True
) -> int:
    """Be the template: requests on ``request_fd``, reports on ``report_fd``.

    Run by :func:`main` in a fresh interpreter, or in a child forked from the
    single-threaded Dask worker process (:func:`fiber_dask.engine.slots.start_early`)
    or from the embedded cluster's worker fork server (the first pool's early
    template, :mod:`fiber_dask.engine.earlyslots`; ``numpy``: False when its
    owner has not imported numpy).
    """
    _die_with_parent(expected_ppid)
    from fiber_dask.transparency import interrupts

    interrupts.cluster_process()  # the slot processes take it once they serve
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    _preload(numpy)

    from fiber_dask.engine.slotpipe import FrameReader
    from fiber_dask.engine.templateprotocol import REQUESTS, decode

    # SIGCHLD wakes the select through the wakeup fd, as in the stdlib's
    # forkserver: the template never blocks in waitpid.
    sig_r, sig_w = os.pipe()
    os.set_blocking(sig_r, False)
    os.set_blocking(sig_w, False)
    signal.set_wakeup_fd(sig_w)
    signal.signal(signal.SIGCHLD, lambda *a: None)
    server = _Server(request_fd, report_fd, sig_r, sig_w)
    reader = FrameReader(request_fd)
    try:
        server.refill()
        while True:
            try:
                ready, _, _ = select.select(
                    [request_fd, sig_r, *server.reason_fds()], [], []
                )
            except InterruptedError:
                continue
            if sig_r in ready:
                try:
                    while os.read(sig_r, 4096):
                        pass
                except BlockingIOError:
                    pass
            server.read_reasons(ready)
            server.reap()
            if request_fd in ready:
                try:
                    msgs = reader.read()
                except OSError:
                    msgs = None
                if msgs is None:
                    return 0  # the Dask worker is gone or let us go
                for frame in msgs:
                    fork = decode(frame, REQUESTS)  # raises on a bug: we end
                    server.start(fork.rid, fork.spec)
            # After the answers: the next spare's fork never delays a start.
            server.refill()
    finally:
        # Slot processes (and the spare) die with us by PDEATHSIG, the spare
        # also by EOF on its spec pipe; say it explicitly too (and for
        # platforms without PDEATHSIG).
        server.kill_all()


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def _read_all(fd: int) -> bytes:
    chunks = []
    while True:
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


def _read_reason(fd: int) -> bytes:
    # What is left of a reason once its slot process was reaped: a grandchild
    # that inherited the write end may keep it open, so never block here.
    os.set_blocking(fd, False)
    data = b""
    try:
        while True:
            chunk = os.read(fd, 4096)
            if not chunk:
                break
            data += chunk
    except BlockingIOError:
        pass
    finally:
        os.close(fd)
    return data


# ---------------------------------------------------------------- slot process


def _child(template_pid: int, close_fds: list[int], spec_r: int, reason_w: int) -> int:
    """Become a slot process: set up, wait for the spec on ``spec_r`` (at once,
    or later as the template's spare), serve the pool; the exit code."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for fd in close_fds:
        try:
            os.close(fd)
        except OSError:
            pass
    _die_with_parent(template_pid)

    import faulthandler
    import pickle

    # A task that crashes the process (segfault) leaves its Python traceback on
    # the Dask worker's stderr, where its log is.
    faulthandler.enable()

    # SIGINT stays ignored while this waits as a spare (Ctrl-C in a terminal
    # is not for it); EOF without a spec: the template is gone or let it go.
    try:
        blob = _read_all(spec_r)
    except OSError:
        blob = b""
    os.close(spec_r)
    if not blob:
        return 0
    from fiber_dask.transparency import interrupts

    interrupts.program_process()
    spec = pickle.loads(blob)
    os.environ.clear()
    os.environ.update(spec.env)
    _load_environment()
    _become_pool_worker(spec.slot, spec.authkey)

    from fiber_dask.engine import timelimits
    from fiber_dask.engine.poolworker import serve_slot

    timelimits.slot_process(reason_w)  # a hard time limit may end it

    reason = None
    try:
        reason = serve_slot(
            spec.address,
            spec.authkey,
            spec.service,
            spec.slot,
            spec.init_blob,
            spec.maxtasks,
            spec.kill_after,
            spec.worker_address,
            spec.relay,
        )
    except KeyboardInterrupt as e:
        _print_interrupted(e)
    except BaseException:  # noqa: BLE001 - report it, then end like a crash
        import traceback

        traceback.print_exc()
    # The reason first: a "recycled" slot's successor starts while this one
    # still runs its exit functions.
    try:
        if reason is not None:
            os.write(reason_w, reason.encode("utf-8", "replace"))
        os.close(reason_w)
    except OSError:
        pass
    # As a stdlib worker ends: multiprocessing's finalizers run, so what the
    # tasks put on queues (sent by feeder threads) reaches them.
    try:
        from multiprocessing import util

        util._exit_function()
    except Exception:  # noqa: BLE001 - never keep a slot from exiting
        pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass
    return 0 if reason is not None else 1


def _print_interrupted(exc: KeyboardInterrupt) -> None:
    """What a stdlib pool worker prints when SIGINT ends it (its name, then
    the traceback), with the task's frames only: the loop's own frames are
    fiber-dask's machinery, as the stdlib's pool.py frames are its, and there
    are more of them (24 lines a slot against the stdlib's 14)."""
    import multiprocessing
    import traceback

    from fiber_dask.launch import childsetup

    ours = childsetup.package_dir() + os.sep
    frames = [
        f
        for f in traceback.extract_tb(exc.__traceback__)
        if not f.filename.startswith(ours)
    ]
    lines = [f"Process {multiprocessing.current_process().name}:\n"]
    if frames:  # else it was waiting for work
        lines.append("Traceback (most recent call last):\n")
        lines.extend(traceback.StackSummary.from_list(frames).format())
    lines.extend(traceback.format_exception_only(type(exc), exc))
    try:
        sys.stderr.write("".join(lines))
    except Exception:  # noqa: BLE001 - a closed stderr: nothing to say it on
        pass


def _load_environment() -> None:
    """Apply the environment the keeper sent: import path, Dask config, swap."""
    from fiber_dask.launch import childsetup, processchild

    processchild.extend_sys_path(os.environ.get("FIBER_DASK_SYS_PATH"))
    if "dask" in sys.modules:
        import dask.config

        # The scheduler address nested Pools attach to, TLS settings: the
        # DASK_* variables on top of what the template loaded (a full
        # dask.config.refresh() would reread every YAML file: ~20 ms a fork).
        dask_env = {k: v for k, v in os.environ.items() if k.startswith("DASK_")}
        dask.config.update(dask.config.config, dask.config.collect_env(dask_env))
    childsetup.prepare()


def _become_pool_worker(slot: int, authkey: bytes) -> None:
    import multiprocessing.process as mpp
    import random

    random.seed()  # os.fork() reseeds random already; be explicit for numpy too
    np = sys.modules.get("numpy")
    if np is not None:
        try:
            np.random.seed()
        except Exception:  # noqa: BLE001
            pass
    proc = mpp.current_process()
    proc._name = f"SpawnPoolWorker-{slot + 1}"
    proc._identity = (slot + 1,)
    proc._config["daemon"] = True
    # Lets fiber_dask.Process start children here (stdlib ones still refuse,
    # as in a stdlib pool worker).
    proc._config["fiber_slot"] = True
    proc._config["authkey"] = mpp.AuthenticationString(authkey)
    proc._parent_pid = os.getppid()


if __name__ == "__main__":
    sys.exit(main())
