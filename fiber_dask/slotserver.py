"""The slot template process: ``python -m fiber_dask.slotserver REPORT_FD``.

Started by :class:`fiber_dask.slots.Template` in a Dask worker (the why, the
picture and the pipe protocol are in :mod:`fiber_dask.slots`).  It preloads
what every slot process needs (cloudpickle, fiber_dask's pool-worker code,
numpy if it is installed), then, single-threaded, starts one slot process per
``("fork", id, spec)`` read from stdin (handing the spec to the spare it keeps
forked ahead, or forking one now) and reports on ``REPORT_FD`` its pid and,
once reaped, its exit status and the reason its loop returned.  EOF on stdin
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


def _preload() -> None:
    # Everything a slot process imports before its first task, paid once here
    # instead of in every slot process.
    import cloudpickle  # noqa: F401

    import fiber_dask.poolworker  # noqa: F401
    import fiber_dask.process  # noqa: F401
    import fiber_dask.processchild  # noqa: F401
    import fiber_dask.slots  # noqa: F401
    import fiber_dask.swap  # noqa: F401

    # The first getaddrinfo() on a str host imports the idna codec and compiles
    # its regexes: 5-10 ms in every slot process's connect, were it left to them.
    "localhost".encode("idna")
    try:
        import numpy  # noqa: F401
        import numpy.random  # noqa: F401  (lazy in numpy 2; each slot reseeds it)
    except ImportError:
        pass


class _Waiting:
    """A forked slot process that has set itself up and waits for its spec."""

    def __init__(self, pid: int, spec_w: int, reason_r: int) -> None:
        self.pid, self.spec_w, self.reason_r = pid, spec_w, reason_r


class _Server:
    """The template's state: its slot processes, its spare, its pipes."""

    def __init__(self, request_fd: int, report_fd: int, sig_r: int, sig_w: int):
        from fiber_dask.slots import write_frame

        self.write_frame = write_frame
        self.report_fd = report_fd
        self.own_fds = [request_fd, report_fd, sig_r, sig_w]
        self.children: dict[int, tuple[int, int]] = {}  # pid -> (request id, reason fd)
        self.spare: _Waiting | None = None
        self.me = os.getpid()

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
                close = self.own_fds + [fd for _, fd in self.children.values()]
                if self.spare is not None:
                    close += [self.spare.spec_w, self.spare.reason_r]
                code = _child(self.me, close + [spec_w, reason_r], spec_r, reason_w)
            finally:
                os._exit(code)  # never return into the template's loop
        os.close(spec_r)
        os.close(reason_w)
        return _Waiting(pid, spec_w, reason_r)

    def refill(self) -> None:
        """Keep one spare forked ahead, so that a slot start (and a
        ``maxtasksperchild`` restart) is a hand-over, not a fork and setup."""
        if self.spare is None:
            try:
                self.spare = self.fork_waiting()
            except OSError:
                pass  # fork at the next request instead

    def start(self, rid: int, blob: bytes) -> None:
        """Answer a ``("fork", rid, blob)`` request: hand ``blob`` to the spare,
        or to a process forked now when there is none (or it died)."""
        for _ in range(2):
            proc, self.spare = self.spare, None
            if proc is None:
                try:
                    proc = self.fork_waiting()
                except OSError as e:
                    self.write_frame(
                        self.report_fd, ("failed", rid, f"fork failed: {e}")
                    )
                    return
            try:
                _write_all(proc.spec_w, blob)
            except OSError:
                # The spare died (or was killed) before its hand-over: it is
                # reaped as a stranger; try a fresh one.
                os.close(proc.reason_r)
                continue
            finally:
                os.close(proc.spec_w)
            self.children[proc.pid] = (rid, proc.reason_r)
            self.write_frame(self.report_fd, ("started", rid, proc.pid))
            return
        self.write_frame(self.report_fd, ("failed", rid, "slot processes die at start"))

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
            entry = self.children.pop(pid, None)
            if entry is None:
                continue
            rid, reason_fd = entry
            code = os.waitstatus_to_exitcode(status)
            reason = _read_reason(reason_fd)
            self.write_frame(self.report_fd, ("exit", rid, code, reason))

    def kill_all(self) -> None:
        pids = list(self.children)
        if self.spare is not None:
            pids.append(self.spare.pid)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def main() -> int:
    expected = os.environ.pop("FIBER_DASK_LAUNCHER_PID", None)
    _die_with_parent(int(expected) if expected else None)
    # Ctrl-C in a terminal reaches the whole process group: it is for the
    # tasks (which get the default handler back), not for the template.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    report_fd = int(sys.argv[1])
    request_fd = os.dup(0)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    _preload()

    from fiber_dask.slots import FrameReader

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
                ready, _, _ = select.select([request_fd, sig_r], [], [])
            except InterruptedError:
                continue
            if sig_r in ready:
                try:
                    while os.read(sig_r, 4096):
                        pass
                except BlockingIOError:
                    pass
            server.reap()
            if request_fd not in ready:
                continue
            try:
                msgs = reader.read()
            except OSError:
                msgs = None
            if msgs is None:
                return 0  # the Dask worker is gone or let us go
            for kind, rid, blob in msgs:
                if kind == "fork":
                    server.start(rid, blob)
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


def _read_reason(fd: int) -> str | None:
    # The slot process wrote its reason before exiting; a grandchild that
    # inherited the write end may keep it open, so never block here.
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
    return data.decode("utf-8", "replace") if data else None


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
    signal.signal(signal.SIGINT, signal.default_int_handler)
    spec = pickle.loads(blob)
    os.environ.clear()
    os.environ.update(spec.env)
    _load_environment()
    _become_pool_worker(spec.slot, spec.authkey)

    from fiber_dask.poolworker import serve_slot

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
        )
    except BaseException:  # noqa: BLE001 - report it, then end like a crash
        import traceback

        traceback.print_exc()
        return 1
    finally:
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
    try:
        os.write(reason_w, reason.encode("utf-8", "replace"))
    except OSError:
        pass
    return 0


def _load_environment() -> None:
    """Apply the environment the keeper sent: import path, Dask config, swap."""
    from fiber_dask import processchild, swap

    processchild._extend_sys_path(os.environ.get("FIBER_DASK_SYS_PATH"))
    if "dask" in sys.modules:
        import dask.config

        # The scheduler address nested Pools attach to, TLS settings: the
        # DASK_* variables on top of what the template loaded (a full
        # dask.config.refresh() would reread every YAML file: ~20 ms a fork).
        dask_env = {k: v for k, v in os.environ.items() if k.startswith("DASK_")}
        dask.config.update(dask.config.config, dask.config.collect_env(dask_env))
    swap.install_from_environ()


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
