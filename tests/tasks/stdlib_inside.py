"""Task and child bodies of tests/test_stdlib_inside_tasks.py: the stdlib's own
``multiprocessing`` (and libraries built on it) used inside a pool task or a
Process child.  Importable by name, as stdlib pool workers need.

Each body returns (or sends) what it saw as plain data: results, the class and
message of an exception, the warnings raised, so that the test can compare a
stdlib worker's outcome with a fiber-dask one's.  Bodies report the names of
the semaphores and segments they made, so the test can check none is left.
"""

from __future__ import annotations

import os
import warnings


def outcome(fn, *args) -> tuple:
    """``("ok", value, warnings)`` or ``("raised", class name, message, warnings)``."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            value = fn(*args)
        except Exception as e:  # noqa: BLE001 - the outcome is the point
            result: tuple = ("raised", type(e).__name__, str(e))
        else:
            result = ("ok", value)
    return (*result, sorted({f"{w.category.__name__}: {w.message}" for w in caught}))


def _sem_name(lock) -> str:
    return lock._semlock.name


def primitives(_=None) -> dict:
    """Every stdlib primitive that makes a named semaphore, used in this process."""
    import multiprocessing

    names = []
    out = {}
    try:
        from test import support
    except ImportError:  # an interpreter without its test package
        pass
    else:
        # What CPython's test suite checks as it is imported (a SkipTest here
        # skipped its Pool tests in fiber-dask's pool workers).
        check = support.skip_if_broken_multiprocessing_synchronize
        out["suite check"] = outcome(check)

    def locks():
        made = [
            multiprocessing.Lock(),
            multiprocessing.RLock(),
            multiprocessing.Semaphore(2),
            multiprocessing.BoundedSemaphore(1),
        ]
        names.extend(_sem_name(x) for x in made)
        for x in made:
            with x:
                pass
        return [type(x).__name__ for x in made]

    def event_condition_barrier():
        e = multiprocessing.Event()
        e.set()
        c = multiprocessing.Condition()
        with c:
            c.notify_all()
        b = multiprocessing.Barrier(1)
        return e.wait(1), b.wait(1)

    def values():
        v = multiprocessing.Value("i", 3)
        with v.get_lock():
            v.value += 1
        names.append(_sem_name(v.get_lock()))
        a = multiprocessing.Array("d", [1.0, 2.0])
        names.append(_sem_name(a.get_lock()))
        return v.value, list(a), multiprocessing.RawValue("i", 7).value

    def queues():
        q = multiprocessing.Queue()
        q.put([1, 2])
        got = q.get(timeout=30)
        q.close()
        q.join_thread()
        s = multiprocessing.SimpleQueue()
        s.put("x")
        return got, s.get()

    for name, fn in [
        ("locks", locks),
        ("event, condition, barrier", event_condition_barrier),
        ("values", values),
        ("queues", queues),
    ]:
        out[name] = outcome(fn)
    return {"outcomes": out, "semaphores": names}


def create_segment(data: bytes) -> str:
    """Create a shared-memory segment holding ``data``; keep it (no unlink)."""
    from multiprocessing import shared_memory

    shm = shared_memory.SharedMemory(create=True, size=len(data))
    shm.buf[: len(data)] = data
    name = shm.name
    shm.close()
    return name


def read_segment(name: str, size: int) -> bytes:
    from multiprocessing import shared_memory

    shm = shared_memory.SharedMemory(name)
    try:
        return bytes(shm.buf[:size])
    finally:
        shm.close()


def unlink_segment(name: str) -> str:
    from multiprocessing import shared_memory

    shm = shared_memory.SharedMemory(name)
    shm.close()
    shm.unlink()
    return "unlinked"


def tracker_pipe(_=None) -> int | str | None:
    """Which pipe this process's resource tracker is (its inode), None if it
    has none, or the error its descriptor gives."""
    from multiprocessing import resource_tracker

    fd = resource_tracker._resource_tracker._fd
    if fd is None:
        return None
    try:
        return os.fstat(fd).st_ino
    except OSError as e:
        return repr(e)


def tracker_pipe_in_use(_=None) -> int | str | None:
    """:func:`tracker_pipe` once a lock was registered with the tracker."""
    import multiprocessing

    try:
        multiprocessing.get_context("spawn").Lock()
    except OSError as e:
        return repr(e)
    return tracker_pipe()


def template_kinds(_=None) -> str:
    """How this slot process's template started: "fresh" or "forked"."""
    with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
        return "fresh" if b"fiber_dask.engine.slotserver" in f.read() else "forked"


def square(x: int) -> int:
    return x * x


def pid(_=None) -> int:
    return os.getpid()


def stdlib_children(_=None) -> dict:
    """A stdlib Pool and a stdlib Process started from this process."""
    import multiprocessing

    def pool():
        with multiprocessing.Pool(2) as p:
            return p.map(square, range(4))

    def process():
        p = multiprocessing.Process(target=square, args=(2,))
        p.start()
        p.join()
        return p.exitcode

    return {"pool": outcome(pool), "process": outcome(process)}


def _meet(directory: str, parties: int) -> int:
    """A joblib task: wait (60 s at most) until ``parties`` tasks run at once."""
    import time

    open(os.path.join(directory, str(os.getpid())), "w").close()
    deadline = time.monotonic() + 60
    while len(os.listdir(directory)) < parties and time.monotonic() < deadline:
        time.sleep(0.01)
    return os.getpid()


def _stop_loky() -> None:
    """Shut joblib's reusable loky executor down, as a program ending should:
    its manager thread keeps a process from exiting (a stdlib child too) until
    the workers' idle timeout, 300 s."""
    from joblib.externals.loky import reusable_executor

    executor = reusable_executor._executor
    if executor is not None:
        executor.shutdown(wait=True)


def joblib_parallel(_=None) -> tuple:
    """joblib with ``n_jobs=2`` (loky): how many jobs it runs at once, and in
    how many processes other than this one."""
    import tempfile

    import joblib

    def run():
        # 1, with joblib's warning, in a daemonic process (a stdlib pool worker).
        n = joblib.effective_n_jobs(2)
        with tempfile.TemporaryDirectory() as d:
            tasks = (joblib.delayed(_meet)(d, n) for _ in range(n))
            pids = joblib.Parallel(n_jobs=2)(tasks)
        return n, len(set(pids) - {os.getpid()})

    try:
        return outcome(run)
    finally:
        _stop_loky()


def sklearn_cross_val(_=None) -> tuple:
    """scikit-learn with ``n_jobs=2``: a cross-validation on a small data set."""
    from sklearn.datasets import make_classification
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import cross_val_score

    x, y = make_classification(n_samples=60, n_features=4, random_state=0)

    def run():
        scores = cross_val_score(LogisticRegression(), x, y, cv=3, n_jobs=2)
        return [round(float(s), 6) for s in scores]

    try:
        return outcome(run)
    finally:
        _stop_loky()


class _Squares:
    """A map-style data set (importable, as DataLoader workers need)."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> tuple:
        return i * i, os.getpid()


def torch_dataloader(_=None) -> tuple:
    """A torch DataLoader with ``num_workers=2``: the batches and how many
    worker processes made them."""
    from torch.utils.data import DataLoader

    def run():
        values, pids = [], set()
        for batch, batch_pids in DataLoader(_Squares(), batch_size=2, num_workers=2):
            values.extend(int(v) for v in batch)
            pids.update(int(p) for p in batch_pids)
        return values, len(pids - {os.getpid()})

    return outcome(run)


def in_child(body, conn) -> None:
    """A Process target: send ``body()``'s result on ``conn``."""
    conn.send(body())
    conn.close()
