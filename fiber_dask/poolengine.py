"""The machinery behind ``Pool``: dispatching chunks to pool-worker loops,
the result thread, and the loops' life cycle (see ``pool`` for the picture).

``PoolEngine`` is a mixin holding the parts of a pool that users never call;
``pool.Pool`` adds the stdlib API on top.  The state both use is created in
``Pool.__init__``.
"""

from __future__ import annotations

import functools
import logging
import pickle
import selectors
import threading
import time
import weakref

import cloudpickle

from . import channel
from .errors import WorkerLostError
from .poolworker import run_pool_worker
from .results import MapResult

logger = logging.getLogger("fiber_dask.pool")

INIT, RUN, CLOSE, TERMINATE = "INIT", "RUN", "CLOSE", "TERMINATE"

_MAX_DEPTH = 64
_FUNC_CACHE = 256
_TERMINATE_GRACE = 2.0  # seconds a running task gets to stop after terminate()
_STOP_GRACE = 10.0  # seconds join() waits for loops to hang up after "stop"

_live_pools: weakref.WeakSet = weakref.WeakSet()
_slots_lock = threading.Lock()
_slots_in_use: dict[int, int] = {}  # id(handle) -> loops of live pools


class _Chunk:
    __slots__ = ("job", "index", "items", "attempts", "worker")

    def __init__(self, job, index, items):
        self.job, self.index, self.items = job, index, items
        self.attempts = 0
        self.worker = None


class _Peer:
    """One connected pool-worker loop."""

    __slots__ = (
        "conn",
        "inflight",
        "fids",
        "pid",
        "worker",
        "slot",
        "retiring",
        "broken",
        "filed",
    )

    def __init__(self, conn, hello):
        self.conn = conn
        self.inflight: dict[int, _Chunk] = {}
        self.fids: set[int] = set()
        self.pid = hello.get("pid")
        self.worker = hello.get("worker")
        self.slot = hello.get("slot")
        self.retiring = False
        self.broken = False
        self.filed: int | None = None  # its key in PoolEngine._loads, if any


class PoolEngine:
    """Dispatch, results and loops of a :class:`fiber_dask.pool.Pool`."""

    # ------------------------------------------------------------------ dispatch

    def _wake_dispatch(self) -> None:
        """The caller consumed an imap chunk: back-pressured input may go on."""
        self._dispatch()

    def _dispatch(self) -> None:
        """Send chunks to loops with room, least loaded first.

        A loop keeps one chunk running plus a queue of about ``prefetch`` seconds
        of work, estimated per function from its past chunks.  A function not
        seen yet, or one whose chunks are long, is handed out one chunk at a
        time: nothing waits queued behind a long task while another loop idles.
        """
        with self._lock:
            if self._state == TERMINATE:
                return
            while True:
                chunk = self._next_chunk()
                if chunk is None:
                    return
                depth = self._depth(chunk)
                best = None
                loads = self._loads()
                for n in range(depth):
                    peers = loads.get(n)
                    if peers:
                        best = next(iter(peers))
                        break
                if best is None:
                    self._retry.appendleft(chunk)  # first in line next time
                    return
                self._send_chunk(best, chunk)

    def _loads(self) -> dict[int, dict]:
        """Loops that may take work, by their number of chunks in flight (each a
        dict used as an ordered set), so that picking the least loaded one costs
        the same with 2 loops or 500."""
        loads = self.__dict__.get("_load_index")
        if loads is None:
            loads = self._load_index = {}
        return loads

    def _file(self, peer: _Peer) -> None:
        """File ``peer`` under its current load; call under the lock after its
        in-flight chunks, ``retiring``/``broken`` or presence change."""
        loads = self._loads()
        if peer.filed is not None:
            bucket = loads.get(peer.filed)
            if bucket is not None:
                bucket.pop(peer, None)
                if not bucket:
                    del loads[peer.filed]
            peer.filed = None
        if peer.retiring or peer.broken or self._peers.get(peer.conn) is not peer:
            return
        n = len(peer.inflight)
        loads.setdefault(n, {})[peer] = None
        peer.filed = n

    def _depth(self, chunk: _Chunk) -> int:
        if self._maxtasks is not None:
            return 1  # a retiring loop must not hold queued work
        entry = self._fids.get(id(chunk.job._func))
        if entry is None or entry[0] is not chunk.job._func or entry[3] is None:
            return 1
        seconds = entry[3] * len(chunk.items)
        depth = min(_MAX_DEPTH, 1 + int(self._prefetch / max(seconds, 1e-6)))
        if depth == 1 and _chunks_to_come(chunk.job) >= len(self._peers):
            # Long chunks, but this map still has another for every loop: each
            # may hold the next one, so no loop waits a round trip for it (with
            # hundreds of loops finishing together, the last one served would
            # wait for all the others' results to be handled first).
            depth = 2
        return depth

    def _next_chunk(self) -> _Chunk | None:
        while self._retry:
            chunk = self._retry.popleft()
            if not chunk.job._finished:
                return chunk
        for _ in range(len(self._jobs)):
            job = self._jobs[0]
            if job._finished:
                self._jobs.popleft()
                continue
            got = job._next_chunk()
            if got is not None:
                return _Chunk(job, got[0], got[1])
            if job._exhausted:
                self._jobs.popleft()
            else:
                self._jobs.rotate(-1)  # held back by back-pressure: try the next job
        return None

    def _function_blob(self, func) -> tuple[int, bytes]:
        """The function's id and pickle, made once per function.

        Entries are ``[func, fid, blob, seconds_per_item]``; holding ``func``
        keeps its ``id()`` from being reused while the entry lives.
        """
        entry = self._fids.get(id(func))
        if entry is not None and entry[0] is func:
            self._fids.move_to_end(id(func))
            return entry[1], entry[2]
        fid = next(self._fid_counter)
        blob = cloudpickle.dumps(func, protocol=pickle.HIGHEST_PROTOCOL)
        self._fids[id(func)] = [func, fid, blob, None]
        if len(self._fids) > _FUNC_CACHE:
            self._fids.popitem(last=False)
        return fid, blob

    def _send_chunk(self, peer: _Peer, chunk: _Chunk) -> None:
        job = chunk.job
        try:
            fid, fblob = self._function_blob(job._func)
            payload = cloudpickle.dumps(chunk.items, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:
            # Unpicklable function or arguments: an error for this job, in the
            # caller's get(), as the stdlib reports it.
            job._chunk_done(chunk.index, False, e)
            return
        ckey = next(self._ckeys)
        msg = pickle.dumps(
            (
                "T",
                ckey,
                fid,
                None if fid in peer.fids else fblob,
                job.mode,
                payload,
                self._retries,
            ),
            protocol=pickle.HIGHEST_PROTOCOL,
        )
        try:
            peer.conn.send_bytes(msg)
        except OSError:
            # The loop is gone; the result thread will see its EOF.  The chunk
            # never ran there, so it goes back without counting an attempt.
            peer.broken = True
            self._file(peer)
            self._retry.appendleft(chunk)
            self._wake()
            return
        peer.fids.add(fid)
        peer.inflight[ckey] = chunk
        self._file(peer)

    # ------------------------------------------------------------ result thread

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass

    def _on_connect(self, conn, hello) -> None:
        with self._lock:
            if self._state == TERMINATE or self._stop_sent is not None:
                channel.hangup(conn)
                return
            peer = self._peers[conn] = _Peer(conn, hello or {})
            self._file(peer)
            self._selector().register(conn, selectors.EVENT_READ)
            self._loop_failures = 0
            self._dispatch()
        self._wake()

    def _selector(self) -> selectors.BaseSelector:
        """The result thread's selector: every loop's connection and the wake-up
        socket, registered once (not on every turn: with hundreds of loops,
        building a poll set per message cost more than handling the message)."""
        sel = self.__dict__.get("_sel")
        if sel is None:
            with self._lock:
                sel = self.__dict__.get("_sel")
                if sel is None:
                    sel = selectors.DefaultSelector()
                    sel.register(self._wake_r, selectors.EVENT_READ)
                    self._sel = sel
        return sel

    def _unregister(self, conn) -> None:
        sel = self.__dict__.get("_sel")
        if sel is not None:
            try:
                sel.unregister(conn)
            except (KeyError, ValueError, OSError):
                pass

    def _step(self) -> bool:
        """One turn of the result thread.  Returns False when the pool is done."""
        with self._lock:
            if not self._should_continue():
                return False
        try:
            ready = [key.fileobj for key, _ in self._selector().select(timeout=1.0)]
        except (OSError, ValueError):  # closed by _release
            return not getattr(self, "_released", False)
        for obj in ready:
            if obj is self._wake_r:
                try:
                    while self._wake_r.recv(4096):
                        pass
                except OSError:
                    pass
                continue
            peer = self._peers.get(obj)
            if peer is None:
                continue
            try:
                raw = obj.recv_bytes()
            except (EOFError, OSError):
                self._peer_lost(peer)
                continue
            try:
                self._on_message(peer, raw)
            except Exception:  # never let one bad message kill the pool
                logger.exception("fiber-dask: error handling a pool message")
        self._maintain()
        return True

    def _should_continue(self) -> bool:
        if self._state == TERMINATE:
            return False
        if self._state == CLOSE and not self._cache:
            if self._stop_sent is None:
                self._stop_sent = time.monotonic()
                for peer in self._peers.values():
                    _send_quietly(peer, b"S")
                self._cancel_loops(only_unconnected=True)
            if not self._peers or time.monotonic() - self._stop_sent > _STOP_GRACE:
                return False
        return True

    def _on_message(self, peer: _Peer, raw: bytes) -> None:
        msg = pickle.loads(raw)  # envelope of plain types from an authenticated peer
        kind = msg[0]
        if kind == "R":
            _, ckey, ok, blob, secs, last = msg
            with self._lock:
                chunk = peer.inflight.pop(ckey, None)
                if chunk is not None:
                    self._learn(chunk, secs)
                if last:
                    peer.retiring = True
                self._file(peer)
                self._dispatch()  # refill before settling: keep the loops busy
            if chunk is None:
                return
            try:
                value = pickle.loads(blob)
            except Exception as e:
                ok, value = False, e
            chunk.job._chunk_done(chunk.index, ok, value)
        elif kind == "I":
            try:
                exc = pickle.loads(msg[1])
            except Exception as e:
                exc = e
            self._break(exc)

    def _learn(self, chunk: _Chunk, secs: float) -> None:
        entry = self._fids.get(id(chunk.job._func))
        if entry is not None and entry[0] is chunk.job._func and chunk.items:
            per_item = secs / len(chunk.items)
            entry[3] = per_item if entry[3] is None else 0.7 * entry[3] + 0.3 * per_item

    def _peer_lost(self, peer: _Peer) -> None:
        failed = []
        with self._lock:
            self._peers.pop(peer.conn, None)
            self._file(peer)
            self._unregister(peer.conn)
            peer.conn.close()
            if self._state == TERMINATE:
                return
            back = []
            for chunk in peer.inflight.values():
                if chunk.job._finished:
                    continue
                chunk.attempts += 1
                chunk.worker = peer.worker
                if chunk.attempts > self._allowed_failures:
                    failed.append(chunk)
                else:
                    back.append(chunk)
            self._retry.extendleft(reversed(back))
            if back:
                logger.warning(
                    "fiber-dask: a pool worker (%s, pid %s) died; re-running %d chunk(s)",
                    peer.worker,
                    peer.pid,
                    len(back),
                )
            self._dispatch()
        for chunk in failed:
            name = getattr(chunk.job._func, "__qualname__", repr(chunk.job._func))
            chunk.job._chunk_done(
                chunk.index,
                False,
                WorkerLostError(
                    f"task {name} (chunk {chunk.index}) was running on a worker process "
                    f"that died, {chunk.attempts} times (last on {chunk.worker}, pid "
                    f"{peer.pid}); the limit is fiber.pool.allowed-failures="
                    f"{self._allowed_failures}. A task that crashes its process "
                    "(segfault, os._exit, out of memory) fails this way; fix the task or "
                    "raise the limit (DASK_FIBER__POOL__ALLOWED_FAILURES)."
                ),
            )

    def _break(self, exc: BaseException) -> None:
        """The pool cannot work (its initializer fails): fail all, now and later."""
        with self._lock:
            self._broken = exc
            jobs = list(self._cache)
        for job in jobs:
            job._fail(exc)

    # ---------------------------------------------------------------- the loops

    def _submit_loops(self, n: int) -> None:
        for _ in range(n):
            slot = next(self._slot_counter)
            fut = self._client.submit(
                run_pool_worker,
                self._server.address,
                self._server.authkey,
                self._service,
                slot,
                self._init_blob,
                self._maxtasks,
                # On a cluster we started, a task that ignores terminate() for
                # 2 s ends its worker process (the nanny starts another).
                _TERMINATE_GRACE if self._handle.owned else None,
                self._slots,  # process | thread (fiber_dask.slots)
                key=f"fiber-pool-{self._token}-{slot}",
                pure=False,
                resources=self._resources,
            )
            self._loops[fut.key] = fut
            fut.add_done_callback(functools.partial(_on_loop_done, weakref.ref(self)))

    def _maintain(self) -> None:
        """Replace loops that ended while work remains; warn if none connect."""
        while self._loop_done:
            fut = self._loop_done.popleft()
            self._loops.pop(fut.key, None)
            if self._state == TERMINATE or self._stop_sent is not None or self._broken:
                continue
            reason = None
            if fut.status == "finished":
                try:
                    reason = fut.result(timeout=5)
                except Exception as e:
                    reason = repr(e)
                if reason == "initializer-failed":
                    continue
            elif fut.status == "error":
                try:
                    reason = repr(fut.exception(timeout=5))
                except Exception as e:
                    reason = repr(e)
            if reason not in ("recycled", "stopped", "no-pool"):
                self._loop_failures += 1
                logger.info(
                    "fiber-dask: pool loop ended (%s); starting another", reason
                )
            if self._loop_failures > 3 + 2 * self._processes:
                self._break(
                    WorkerLostError(
                        f"pool-worker loops keep failing before they connect (last: "
                        f"{reason}). Check that the workers can import fiber_dask and "
                        f"reach {self._server.address[0]}:{self._server.address[1]} "
                        "(fiber.listen-host)."
                    )
                )
                continue
            self._submit_loops(1)
        if self._peers or not self._cache:
            self._no_peers_since = time.monotonic()
            self._warned_waiting = False
        elif not self._warned_waiting and time.monotonic() - self._no_peers_since > 60:
            self._warned_waiting = True
            logger.warning(
                "fiber-dask: a pool has had work waiting for 60 s but no pool worker is "
                "running; the cluster at %s may have no free task slots or workers.",
                self._client.scheduler.address,
            )

    def _cancel_loops(self, only_unconnected: bool = False) -> None:
        """Release the loop tasks.  A running loop ends by itself on "S"/"K";
        cancelling it only tells Dask we no longer want it."""
        futs = list(self._loops.values())
        if only_unconnected:
            futs = [f for f in futs if f.status == "pending"]
        if not futs:
            return
        try:
            self._client.cancel(futs)
        except Exception:  # the client may already be closing at exit
            pass

    def _release_slots(self) -> None:
        """Stop counting this pool's loops against the cluster's slots."""
        with _slots_lock:
            if self._processes_counted:
                self._processes_counted = False
                key = id(self._handle)
                _slots_in_use[key] = max(0, _slots_in_use.get(key, 0) - self._processes)

    def _release(self) -> None:
        """Give back what this pool holds: its service, slots and sockets."""
        if getattr(self, "_released", False):
            return
        self._released = True
        self._server.unregister(self._service)
        with self._lock:
            peers = list(self._peers.values())
            self._peers.clear()
            self._loads().clear()
        for peer in peers:
            self._unregister(peer.conn)
            channel.hangup(peer.conn)
        self._release_slots()
        sel = self.__dict__.get("_sel")
        if sel is not None:
            sel.close()
        for s in (self._wake_r, self._wake_w):
            s.close()
        _live_pools.discard(self)


def _chunks_to_come(job) -> int:
    """Chunks of a ``map`` not handed out yet (0 for other jobs)."""
    if not isinstance(job, MapResult) or job._items is None:
        return 0
    size = job._chunksize
    return -(-(len(job._items) - job._chunk_index * size) // size)


def _result_thread(ref) -> None:
    """Run the pool's result loop while the pool exists and has work."""
    while True:
        pool = ref()
        if pool is None:
            return
        try:
            if not pool._step():
                if pool._state == CLOSE:
                    pool._cancel_loops()
                pool._release()
                return
        except Exception:  # pragma: no cover - keep the traceback visible
            logger.exception("fiber-dask: pool result thread failed")
            pool._break(
                RuntimeError("the fiber-dask pool result thread failed; see the log")
            )
            pool._release()
            return
        del pool


def _on_connect(ref, conn, hello) -> None:
    pool = ref()
    if pool is None:
        channel.hangup(conn)
        return
    pool._on_connect(conn, hello)


def _on_loop_done(ref, fut) -> None:
    # Runs in the client's event-loop thread: only hand the future over.
    pool = ref()
    if pool is not None:
        pool._loop_done.append(fut)
        pool._wake()


def _send_quietly(peer: _Peer, msg: bytes) -> None:
    try:
        peer.conn.send_bytes(msg)
    except OSError:
        pass


def _authkey() -> bytes:
    """This process's authkey: the stdlib's, which children inherit."""
    import multiprocessing

    return bytes(multiprocessing.current_process().authkey)


def _terminate_all_pools() -> None:
    for pool in list(_live_pools):
        try:
            pool.terminate()
            pool._thread.join(timeout=5)
        except Exception:  # pragma: no cover - best effort at shutdown
            pass
