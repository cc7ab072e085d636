"""The Pool's engine: one dispatcher per pool that sends chunks and settles results.

:class:`PoolEngine` holds the state a pool needs to run work: the jobs waiting
for chunks, the connected pool-worker loops (:class:`_Peer`, each over a
:class:`_Link`) and what each holds, and the result thread — the one thread
that reads every loop's connection, settles results and re-runs what a lost
worker held (loky's executor manager thread is the model).  The loops
themselves, as Dask tasks (the slots claimed, the tasks submitted, one
replaced when it ends, all released), are
:class:`fiber_dask.engine.poolloops.Loops`'s: the engine holds one
(``_loops``), tells it which loop attached, and lets it maintain the loops on
every turn of the result thread (its docstring draws how the two meet).
``pool.Pool`` holds an engine and adds the stdlib API on top; see ``pool`` for
the picture of how a call travels.  Messages are
:mod:`fiber_dask.engine.poolprotocol`'s.

Its public surface: :meth:`start`, :meth:`submit`, :meth:`close`,
:meth:`terminate`, :meth:`join`, :meth:`abandon`, :meth:`slots`, ``state``,
``broken``, and for jobs :meth:`job_finished`, :meth:`job_consumed` and
``draining``.

Dispatch in batches (issue 15): one pass of :meth:`PoolEngine._dispatch`
takes the lock once and sends each loop the chunks it picked for it in one
``Calls`` message; the result thread reads every frame a loop sent with one
read, takes the answered chunks off under the lock once per turn, refills the
loops in one pass, and only then loads and settles the results.  Under load
the batches grow by themselves: the more answers wait at a turn, the more
chunks the refill carries per message.

Worker loss: a loop runs its chunks in the order they were sent and answers
a ``Calls`` before it starts the next, so when its connection drops the
unanswered chunks of the oldest ``Calls`` it held are the ones that may have
run (:func:`fiber_dask.engine.poolprotocol.lost_chunks`; only the first, when it
came first in its ``Calls``, which a loop answers on its own); the others
never started and go back as they were.  If only one may have run, it was running: if it
had several items it is re-run item by item without counting a failure (we
cannot tell which item was running); a single item counts one.  If several
may have run, each is re-run in a ``Calls`` of its own, without counting, so
the next loss names it.  So only an item that was running each time accrues
failures, as Dask counts per task, and it fails with
:class:`~fiber_dask.errors.WorkerLostError` after
``fiber.pool.allowed-failures``, saying why its process died once that is
known (:mod:`fiber_dask.engine.poolcause`, at most a few seconds).  Workers that die while no chunk finishes in
between (an out-of-memory storm) fail the running jobs after a bound instead
of looping forever.
"""

from __future__ import annotations

import collections
import errno
import functools
import heapq
import itertools
import logging
import pickle
import selectors
import socket
import threading
import time
import uuid
import weakref
from multiprocessing.pool import CLOSE, INIT, RUN, TERMINATE  # the stdlib Pool's
from typing import Any, Callable

import cloudpickle

from .. import cluster, config
from ..comm import channel, security
from ..errors import PoolTerminatedError, TimeLimitExceeded, WorkerLostError
from . import poolprotocol as proto
from . import poolstats, slotrelay
from .earlyslots import EarlySlots
from .poolcause import Causes
from .pooldrain import Drain
from .poolelastic import Elastic
from .poolloops import TERMINATE_GRACE, Loops
from .poolresults import MapResult, measured_chunksize

__all__ = ["PoolEngine", "PoolSlot", "INIT", "RUN", "CLOSE", "TERMINATE"]

logger = logging.getLogger("fiber_dask.pool")

_MAX_DEPTH = 64
#: Pickled arguments a loop holds queued beyond the chunk it runs: its depth
#: (chunks in flight) is at most ``1 + this // a chunk's bytes`` of the job.
#: Counted by chunks and seconds only, a fast function of 3 MB arguments was
#: queued 21 deep at each loop, and the dispatch pass that filled the queues
#: held all their pickles at once in the owner (issue 30: a map of 100 pieces
#: of a 300 MB array, +186-294 MB of owner peak RSS against the stdlib's 6-81).
_QUEUE_BYTES = 8 * 2**20
#: A dispatch pass sends what it has filled once its pickles reach this, so
#: the owner holds at most about this much of them at once, however many
#: loops the pass fills.
_PASS_BYTES = 8 * 2**20
#: Idle loops a dispatch pass fills before it sends them their first chunks
#: (see ``_dispatch``); fewer loops than this get one ``Calls`` each per pass.
_START_GROUP = 64
_FUNC_CACHE = 256  # the owner's pickled functions (each loop: poolprotocol's bound)
_SETTLE = 0.5  # seconds a hung-up loop's Dask task gets to be reported finished
#: Seconds PoolSlot.pid waits for a slot's process that is starting.
_PID_WAIT = 30.0
_STOP_GRACE = 10.0  # seconds join() waits for loops to hang up after STOP
#: Seconds terminate() + join() (and interpreter exit) wait for the loops to
#: hang up and their Dask tasks to end; longer than poolloops.TERMINATE_GRACE,
#: after which a stuck task's worker process is ended on clusters fiber-dask
#: started.
_TERMINATE_WAIT = TERMINATE_GRACE + 3.0
#: Seconds all pools together get to stop at interpreter exit.
_EXIT_WAIT = 3.0
#: Seconds after a cancel (an interrupted blocking call) before the slot
#: processes still running its chunks are ended: those the terminal's Ctrl-C
#: reached end by themselves first, printing what the stdlib's workers print.
CANCEL_GRACE = 1.0
#: Seconds the chunks of a slot process a SIGINT ended wait before they run
#: again: the same Ctrl-C reaches the program, whose blocking call cancels
#: their job meanwhile, and then they never run again, as with the stdlib.
#: With 1 s the Jupyter test failed once beside other tests on a loaded
#: machine (a kernel slow to raise its KeyboardInterrupt lets them run
#: again: the likely cause); a map_async's chunks, which nothing cancels, go
#: again this much later.
INTERRUPT_HOLD = 3.0

_live: weakref.WeakSet = weakref.WeakSet()  # engines with loops, for exit


class _Chunk:
    """Items of one job sent together.  ``split``: the :class:`_Split` this
    single item belongs to when its chunk was re-run item by item."""

    __slots__ = (
        "job",
        "index",
        "items",
        "attempts",
        "worker",
        "split",
        "offset",
        "calls",
        "first",
        "alone",
    )

    def __init__(self, job, index, items, split=None, offset=0):
        self.job, self.index, self.items = job, index, items
        self.attempts = 0
        self.worker = None
        self.split, self.offset = split, offset
        #: The number of the ``Calls`` message it was last sent in.
        self.calls = -1
        self.first = False  # it came first in that Calls
        #: Sent in a ``Calls`` of its own: it may have been running when a
        #: loop died, and its next loss must say so exactly.
        self.alone = split is not None

    def first_item(self) -> int:
        return self.job._first_item(self.index) + self.offset


class _Split:
    """Collects the results of a chunk re-run item by item, and hands the job
    one result for the whole chunk, as if it had not been split."""

    __slots__ = ("values", "left", "done")

    def __init__(self, n: int) -> None:
        self.values: list = [None] * n
        self.left = n
        self.done = False

    def settle(self, chunk: _Chunk, ok: bool, value: Any) -> None:
        if self.done:
            return
        if not ok:
            self.done = True
            chunk.job._chunk_done(chunk.index, False, value)
            return
        self.values[chunk.offset] = value[0]
        self.left -= 1
        if self.left == 0:
            self.done = True
            chunk.job._chunk_done(chunk.index, True, self.values)


class _Link:
    """One connection from a worker process, carrying the messages of its
    loops of this pool (:mod:`fiber_dask.engine.poollink` is the other end)."""

    __slots__ = ("conn", "reader", "peers", "hello", "broken", "silent")

    def __init__(self, conn, hello):
        self.conn = conn
        self.reader = channel.FrameReader(conn)
        self.peers: dict[int, _Peer] = {}  # loop number -> its peer
        self.hello = hello
        self.broken = False
        #: It dropped because its host stopped answering (the keep-alive of
        #: fiber.peer-timeout timed out), not with an end-of-file (poolcause).
        self.silent = False

    def send(self, routed: list, shared: proto.Shared | None = None) -> bool:
        """Send ``routed`` (``(loop, message)`` pairs) in one frame, with the
        arrays their chunks share; False if the connection is gone (the
        result thread will see its EOF)."""
        if not self.broken:
            try:
                self.conn.send_bytes(proto.encode_frame(routed, shared))
                return True
            except OSError:
                self.broken = True
        return False


class _Outgoing:
    """What a dispatch pass sends: each loop's ``Calls`` being filled (lists
    of ``(Call, chunk)`` pairs), and each link's :class:`~fiber_dask.engine.poolprotocol.Shared`
    arrays."""

    __slots__ = ("calls", "shared", "bytes")

    def __init__(self) -> None:
        self.calls: dict[_Peer, list[list]] = {}
        self.shared: dict[_Link, proto.Shared] = {}
        self.bytes = 0  # the pickled arguments of the chunks it holds


class _Peer:
    """One pool-worker loop, attached through a :class:`_Link`."""

    __slots__ = (
        "link",
        "key",
        "inflight",
        "funcs",
        "pid",
        "worker",
        "loop",
        "route",
        "retiring",
        "broken",
        "filed",
        "last_active",
        "interrupted",
        "running",
        "expired",
        "draining",
        "drained",
    )

    def __init__(self, link: _Link, route: int, hello: proto.Attach):
        self.link = link
        self.key = (link, route)  # in PoolEngine._peers
        #: The number its link's frames name it by: the loop's, or a relay's
        #: route to the slot process now serving the loop (poolprotocol).
        self.route = route
        #: Chunks sent and not answered, in send order (poolprotocol's
        #: lost_chunks tells which may have run when the loop is lost).
        self.inflight: dict[int, _Chunk] = {}
        self.funcs = proto.PeerFunctions()
        self.pid = hello.pid
        self.worker = hello.worker
        #: The loop's number in the pool (Loops': its Dask task and position).
        self.loop = route if hello.slot is None else hello.slot
        self.retiring = False
        self.broken = False
        self.filed: int | None = None  # its key in PoolEngine._load_index, if any
        #: When it connected or last sent a result (poolelastic: idle since).
        self.last_active = time.monotonic()
        #: It left saying SIGINT ended it (Reason.INTERRUPTED): the user's
        #: Ctrl-C, not a failure worth a warning.
        self.interrupted = False
        #: ``(ckey, offset)`` of the item it said it runs (``Running``, only
        #: under a hard time limit), until that chunk's result.
        self.running: tuple[int, int] | None = None
        #: Told to end (``Expire``): an item of it ran past the hard limit.
        self.expired = False
        #: Told DRAIN (its Dask worker closes): when it must have left
        #: (engine.pooldrain); ``drained``: it left saying it drained.
        self.draining: float | None = None
        self.drained = False


class PoolSlot:
    """One slot of a pool, as ``Pool._pool`` lists them (the stdlib lists its
    worker processes there): the loop now serving it, if connected."""

    __slots__ = ("_engine", "_position")

    def __init__(self, engine: PoolEngine, position: int) -> None:
        self._engine, self._position = engine, position

    def _peer(self) -> _Peer | None:
        return self._engine._peer_at.get(self._position)

    def _starting(self) -> bool:
        """A process for this slot is on its way: a loop was submitted and
        has not connected, or (a running pool that never gives slots back)
        the slot is between loops, whose replacement the pool's maintenance
        submits once the old loop's task has ended."""
        engine = self._engine
        if engine.state not in (RUN, CLOSE) or engine.broken is not None:
            return False
        if engine.state == RUN and engine._elastic is None:
            # Every position of such a pool is refilled: after a loss the
            # old loop is known gone (its connection) a moment before its
            # task has ended and its replacement is submitted, and in
            # between the slot has no loop at all.
            return True
        early = engine._early
        if early is not None and early.starting_at(self._position):
            return True
        return engine._loops.starting_at(self._position)

    @property
    def pid(self) -> int | None:
        """The pid of the process running this slot's tasks.  While that
        process is starting (after ``Pool()``, after a recycle or a loss)
        this waits for it, as ``Process.pid`` does, at most ``_PID_WAIT``
        seconds; None if no process serves the slot then."""
        deadline = time.monotonic() + _PID_WAIT
        delay = 0.005
        while True:
            peer = self._peer()
            if peer is not None:
                return peer.pid
            if not self._starting() or time.monotonic() > deadline:
                return None
            time.sleep(delay)
            delay = min(2 * delay, 0.1)

    @property
    def worker(self) -> str | None:
        """The Dask worker address this slot runs on (None until connected)."""
        peer = self._peer()
        return None if peer is None else peer.worker

    @property
    def name(self) -> str:
        return f"PoolWorker-{self._position + 1}"

    @property
    def exitcode(self) -> int | None:
        return None if self.is_alive() else 0

    def is_alive(self) -> bool:
        return self._peer() is not None

    def __repr__(self) -> str:
        # Never waits, as ``pid`` may: a repr is read in a debugger, a log
        # line or an error message.
        peer = self._peer()
        if peer is not None:
            return f"<PoolSlot {self.name} pid={peer.pid} worker={peer.worker}>"
        state = "starting" if self._starting() else "no process"
        return f"<PoolSlot {self.name} {state}>"


class PoolEngine:
    """The dispatcher of one pool: its jobs, loops, peers and result thread.

    Parameters
    ----------
    handle : fiber_dask.backends.ClusterHandle
        The cluster the loops run on.
    processes : int
        Slots (loops) to keep running.
    init_blob : bytes, optional
        The pickled ``(initializer, initargs)``.
    maxtasks : int, optional
        Chunks after which a loop ends and another starts.
    resources : dict, optional
        Dask resources each loop needs.
    retries : int
        Re-runs of a task that raises, in the loop.
    soft_time_limit, time_limit : float, optional
        Seconds each task may run before ``SoftTimeLimitExceeded`` is raised
        in it, and before its slot process is killed and its result raises
        ``TimeLimitExceeded`` (:mod:`fiber_dask.engine.timelimits`).
    """

    def __init__(
        self,
        handle: Any,
        processes: int,
        *,
        init_blob: bytes | None = None,
        maxtasks: int | None = None,
        resources: dict | None = None,
        retries: int = 0,
        slot_kind: str = "process",
        soft_time_limit: float | None = None,
        time_limit: float | None = None,
    ) -> None:
        self.state = INIT
        self.processes = processes
        self._handle = handle
        self._client = handle.client
        #: The first pool's early slots while the embedded cluster starts
        #: (handle is then a cluster.Starting: fiber_dask.engine.earlyslots).
        self._early: EarlySlots | None = None
        if isinstance(handle, cluster.Starting):
            self._address = handle.scheduler_address
            self._early = EarlySlots(self, handle)
        else:
            self._address = cluster.scheduler_address(handle)
        self._init_blob = init_blob
        self._maxtasks = maxtasks
        self._resources = resources
        self._retries = retries
        self._slot_kind = slot_kind
        #: ``(soft, hard)`` seconds every Call carries, or None.
        self._limits = (
            None
            if soft_time_limit is None and time_limit is None
            else (soft_time_limit, time_limit)
        )
        self._hard = time_limit
        #: ``(deadline, seq, peer, ckey, offset)`` of items running under the
        #: hard limit (a heap; an entry whose peer moved on is dropped when
        #: it comes up, see _expire_due).
        self._deadlines: list = []
        self._deadline_seq = itertools.count()
        #: Process slots reach this owner through their worker's relay.
        self._relay = slotrelay.wanted(processes)
        self._prefetch = config.timedelta("pool.prefetch")
        allowed = config.get("pool.allowed-failures")
        if allowed is None:
            allowed = config.distributed_setting(
                "distributed.scheduler.allowed-failures"
            )
        self._allowed_failures = int(allowed)
        #: Worker losses with no chunk finishing in between, beyond which the
        #: running jobs fail: workers die under the pool faster than it works.
        self._loss_limit = max(10, 2 * (self._allowed_failures + 1) * processes)
        self.max_in_flight = config.get("pool.max-in-flight") or max(64, 4 * processes)
        self.default_chunksize = config.get("pool.chunksize")
        #: Set by join(): imap back-pressure is lifted, join waits for all work.
        self.draining = False
        #: The exception every job fails with once the pool cannot work.
        self.broken: BaseException | None = None

        self._lock = threading.RLock()
        self._jobs: collections.deque = collections.deque()  # jobs with chunks to make
        self._retry: collections.deque = collections.deque()  # chunks to send first
        #: (when, chunks): chunks of interrupted slots, held a moment (_peer_lost).
        self._held: collections.deque = collections.deque()
        #: (chunk, error) of chunks that could not be pickled, for the result
        #: thread to settle (see _add_call).
        self._unsendable: collections.deque = collections.deque()
        self._cache: set = set()  # unfinished jobs
        self._links: set[_Link] = set()  # connected worker processes
        #: (link, loop number) -> its peer: a loop Dask re-ran elsewhere
        #: while the first run's host still reached us is two peers.
        self._peers: dict[tuple[_Link, int], _Peer] = {}
        self._peer_at: dict[int, _Peer] = {}  # slot position -> peer
        self._load_index: dict[int, dict] = {}
        self._ckeys = itertools.count()
        self._calls_numbers = itertools.count()  # numbers Calls messages
        self._calls_sent = 0  # Calls messages sent (chunks go several to one)
        self._fids: collections.OrderedDict = collections.OrderedDict()
        self._fid_counter = itertools.count()
        self._losses: list[float] = []  # times of losses since a chunk last finished
        self._stop_sent: float | None = None
        self._terminated_at: float | None = None
        self._quiet_since = time.monotonic()  # when the last peer hung up
        self._released = False
        self._thread: threading.Thread | None = None
        #: Gives idle slots back and asks for them again (fiber.pool.idle-timeout).
        self._elastic = Elastic.for_engine(self)
        #: Drains the loops of Dask workers that close (fiber.pool.drain-timeout).
        self._drain = Drain(self)
        #: The loops as Dask tasks: claimed, submitted, replaced, released.
        self._loops = Loops(self, _live)
        #: Items that fail for their losses, waiting to learn why (poolcause).
        self._causes = Causes(self)

        self._token = uuid.uuid4().hex[:12]
        self._service = f"pool-{self._token}"
        self._server = channel.get_server(
            handle.listen_host, security.authkey(), handle.client
        )
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)  # a full buffer: a wake-up is pending
        #: Connections the gate handed over, for the result thread to take in
        #: (_take_connections); guarded by _incoming_lock, never _lock, so the
        #: gate's thread never waits for the result thread.
        self._incoming: collections.deque = collections.deque()
        self._incoming_lock = threading.Lock()
        self._incoming_closed = False
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._wake_r, selectors.EVENT_READ)
        #: Counts for the dashboard (fiber_dask.engine.poolstats), kept under _lock.
        self._stats = poolstats.PoolCounters(self._loops.position)

    # ------------------------------------------------------------ public API

    def start(self) -> None:
        """Claim the slots, submit the loops and start the result thread."""
        # Inline: run on the gate's thread, it only queues the connection for
        # the result thread (no thread started per loop that connects).
        self._server.register(
            self._service,
            functools.partial(_on_connect, weakref.ref(self)),
            inline=True,
        )
        if self._early is not None:
            # The cluster is starting: early slots now, the loops' Dask tasks
            # once it is up (_adopt_handle, from the result thread).
            self.state = RUN
            _live.add(self)
            try:
                self._early.start()
            except BaseException:
                self.state = TERMINATE
                self._release()
                raise
        else:
            try:
                # Refuses, at once, a pool the cluster can never start.
                self._loops.claim_slots()
            except BaseException:
                self.state = TERMINATE
                self._release()
                raise
            self.state = RUN
            _live.add(self)
            try:
                self._loops.submit(range(self.processes))
            except BaseException:
                self.state = TERMINATE
                self._release()
                raise
        self._thread = threading.Thread(
            target=self._run, name="fiber-pool-results", daemon=True
        )
        self._thread.start()
        if self._early is None:
            poolstats.watch(self)

    def _adopt_handle(self, handle: Any) -> bool:
        """The embedded cluster this pool's early slots ran beside is up
        (:mod:`fiber_dask.engine.earlyslots`; on the cluster's starting
        thread): take its handle and claim the slots, unless the pool has no
        more work to give them (closed and done, or terminated).  True if its
        loops are to be submitted."""
        with self._lock:
            self._handle = handle
            self._client = handle.client
            self._address = cluster.scheduler_address(handle)
            done = (
                self.state == TERMINATE
                or self._released
                or (self.state == CLOSE and not self._cache)
            )
        if done:
            return False
        try:
            self._loops.claim_slots()
        except Exception as exc:
            self._break(exc)
            return False
        return True

    def _started_on_cluster(self) -> None:
        """On the result thread, after :meth:`_adopt_handle` claimed the
        slots: report the pool to the scheduler from now on."""
        poolstats.watch(self)

    def slots(self) -> list[PoolSlot]:
        """One :class:`PoolSlot` per slot (what ``Pool._pool`` shows)."""
        return [PoolSlot(self, i) for i in range(self.processes)]

    def submit(self, job) -> None:
        """Queue ``job`` (a ``poolresults`` job) for its chunks to be sent."""
        with self._lock:
            if self.state != RUN:
                raise ValueError("Pool not running")
            if self.broken is not None:
                job._fail(self.broken)
                return
            if job._finished:  # an empty map
                return
            self._cache.add(job)
            self._jobs.append(job)
            self._dispatch()

    def job_finished(self, job) -> None:
        with self._lock:
            self._cache.discard(job)
            if not self._cache and self.state == CLOSE:
                self._wake()

    def measured_chunksize(
        self, func: Any, left: int, total: int | None = None, item_bytes: float = 0
    ) -> int:
        """Items in the next chunk of a map of ``func`` sized by measurement
        (:func:`fiber_dask.engine.poolresults.measured_chunksize`; call under the
        lock, as the dispatcher does)."""
        entry = self._fids.get(id(func))
        per_item = entry[3] if entry is not None and entry[0] is func else None
        return measured_chunksize(per_item, self.processes, left, total, item_bytes)

    def job_consumed(self) -> None:
        """The caller took an imap chunk: back-pressured input may go on."""
        self._dispatch()

    def close(self) -> None:
        """Accept no more work; the loops stop once the submitted work is done."""
        with self._lock:
            if self.state == RUN:
                self.state = CLOSE
        self._wake()

    def terminate(self, first: Callable | None = None) -> None:
        """Stop now: interrupt running tasks, fail unfinished jobs.

        Returns at once; :meth:`join` waits until the loops have really
        stopped.  ``first``, if given, is called with the ``(worker address,
        pid)`` of each process serving a slot once the pool is terminated
        (nothing more is sent nor re-run, however those processes end) and
        before its loops are told (the executor's ``terminate_workers()``
        signals them there, as the stdlib's does).
        """
        with self._lock:
            if self.state == TERMINATE:
                return
            self.state = TERMINATE
            self._terminated_at = time.monotonic()
            jobs = list(self._cache)
            self._cache.clear()
            peers = list(self._peers.values())
            if first is None:
                self.signal(peers, proto.TERMINATE)
        if first is not None:
            try:
                first([(p.worker, p.pid) for p in peers])
            finally:
                with self._lock:
                    self.signal(peers, proto.TERMINATE)
        self._loops.release_claim()
        self._loops.release(only_unconnected=True)
        err = PoolTerminatedError(
            "the pool was terminated before this result was computed"
        )
        for job in jobs:
            job._fail(err)
        self._wake()

    def cancel(self, job, exc: BaseException) -> None:
        """Nobody will take ``job``'s result (its blocking caller was
        interrupted): finish it with ``exc`` now, so that no more of its
        chunks are sent, nor re-run when their loop is lost.

        A slot process still running one of its chunks :data:`CANCEL_GRACE`
        seconds later is ended (``Expire``: its template forks a successor
        at once, what else it held goes to the others uncounted), as a
        terminal's Ctrl-C ends the stdlib's pool workers.  Those in the
        terminal's process group took that Ctrl-C themselves meanwhile (and
        printed their KeyboardInterrupt, as the stdlib's do); these are the
        others: slots on other hosts, and the loops that took an interrupted
        slot's chunk again before this cancel (a Jupyter cell's next map
        waited behind them for the whole task).  A thread slot cannot be
        ended: its chunk runs on and its result is dropped.  Chunks of the
        job queued behind another at a loop run and are dropped too.  (The
        owner takes a loop's first unanswered chunk for the one it runs; a
        slot process that finished it just before the grace ended, its
        answer not read yet, and runs another job's chunk now, finishes that
        chunk and leaves after it: ``poolworker._Loop.expire``.)"""
        if job._finished:
            return
        job._fail(exc)
        if self._slot_kind != "process":
            return
        timer = threading.Timer(CANCEL_GRACE, self._end_cancelled, args=(job,))
        timer.daemon = True
        timer.name = "fiber-pool-cancel"
        timer.start()

    def _end_cancelled(self, job) -> None:
        """:meth:`cancel`'s second half: end the slot processes that still
        run a chunk of the cancelled ``job``."""
        ended = []
        with self._lock:
            if self.state == TERMINATE or self._released:
                return
            for peer in list(self._peers.values()):
                # An expired peer too: one told to end for another chunk may
                # be finishing this job's chunk before it leaves.
                if peer.broken or peer.draining is not None:
                    continue
                ckey, chunk = next(iter(peer.inflight.items()), (None, None))
                if chunk is None or chunk.job is not job:
                    continue  # idle, or what it runs is another job's
                self._end_slot(peer, ckey, 0)
                ended.append(peer.pid)
        if ended:
            logger.info(
                "fiber-dask: an interrupted call's tasks were still running in "
                "slot process(es) %s; ending them (new ones take their place)",
                ", ".join(map(str, ended)),
            )
            self._wake()

    def abandon(self) -> None:
        """The pool object was dropped while running: let it go without
        waiting for anything (this runs in ``__del__``)."""
        try:
            self.terminate()
        except Exception:  # pragma: no cover - best effort in __del__
            pass

    def join(self, timeout: float | None = None) -> bool:
        """Wait until the loops have stopped (after :meth:`close`: once the
        work is done; after :meth:`terminate`: once running tasks have ended,
        at most about ``_TERMINATE_WAIT`` seconds).  Returns False on timeout."""
        if self.state == RUN:
            raise ValueError("Pool is still running")
        if self.state not in (CLOSE, TERMINATE):
            raise ValueError("In unknown state")
        self.draining = True  # lift imap back-pressure: join waits for all work
        self._dispatch()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
            return not thread.is_alive()
        return True

    # -------------------------------------------------------------- dispatch

    def _dispatch(self) -> None:
        """Send chunks to loops with room, least loaded first.

        A loop keeps one chunk running plus a queue of about ``prefetch`` seconds
        of work, estimated per function from its past chunks.  A function not
        seen yet, or one whose chunks are long, is handed out one chunk at a
        time: nothing waits queued behind a long task while another loop idles.

        The chunks one pass hands a loop go in one ``Calls`` message (one
        pickle and one socket send for all of them: per chunk, those were
        most of the owner's time); a chunk marked ``alone`` goes in one of its
        own.  A pass takes the lock once, whatever it sends.  Idle loops get
        their first chunk in groups of ``_START_GROUP`` as the pass goes, so
        the first of 1024 starts without waiting for the last one's pickles.
        """
        with self._lock:
            if self.state == TERMINATE or self._released:
                return
            loads = self._load_index
            out = _Outgoing()
            job, size, depth = None, 0, 1  # the last chunk's depth, reused
            try:
                while True:
                    chunk = self._next_chunk()
                    if chunk is None:
                        return
                    if chunk.job is not job or len(chunk.items) != size:
                        job, size = chunk.job, len(chunk.items)
                        depth = self._depth(chunk)
                    # The least loaded loop (every bucket in loads is non-empty).
                    least = min(loads, default=depth)
                    best = next(iter(loads[least])) if least < depth else None
                    if best is None:
                        if (
                            chunk.attempts
                            or chunk.split is not None
                            or chunk.alone
                            or not chunk.job._give_back(chunk.index, chunk.items)
                        ):
                            self._retry.appendleft(chunk)  # first in line next time
                        if self._elastic is not None:
                            self._elastic.wanted()  # slots given back: ask again
                        return
                    self._add_call(best, chunk, out)
                    if out.bytes >= _PASS_BYTES:
                        self._send_out(out)  # large arguments: hold few at once
                    elif least == 0 and len(out.calls) >= _START_GROUP:
                        # Idle loops, many of them (a map opening on 1024
                        # slots): send them their first chunks in groups, not
                        # after the whole pass has pickled every loop's queue
                        # (the last loop started half a second late).  Only
                        # the first chunk of each loop: the rest of a loop's
                        # queue still goes in one Calls.
                        self._send_out(out)
            finally:
                self._send_out(out)

    def _send_out(self, out: _Outgoing) -> None:
        """Send the ``Calls`` a dispatch pass filled (``out``), one frame per
        link with the arrays its chunks share, and empty it."""
        frames: dict[_Link, list] = {}
        for peer, batches in out.calls.items():
            frames.setdefault(peer.link, []).append((peer, batches))
        shared = out.shared
        out.calls, out.shared, out.bytes = {}, {}, 0
        for link, sends in frames.items():
            routed = []
            for peer, batches in sends:
                for batch in batches:
                    routed.append((peer.route, self._calls(batch)))
            if link.send(routed, shared.get(link)):
                continue
            # The loops are gone; the result thread will see the link's EOF.
            # These chunks never ran there, so they go back without counting
            # an attempt.
            back = []
            for peer, batches in sends:
                peer.broken = True
                for batch in batches:
                    for call, chunk in batch:
                        peer.inflight.pop(call.ckey, None)
                        back.append(chunk)
                self._file(peer)
            self._retry.extendleft(reversed(back))
            self._wake()

    def _file(self, peer: _Peer) -> None:
        """File ``peer`` under its number of chunks in flight (each bucket a
        dict used as an ordered set, so that picking the least loaded loop
        costs the same with 2 loops or 500); call under the lock after its
        in-flight chunks, ``retiring``/``broken`` or presence change."""
        loads = self._load_index
        if peer.filed is not None:
            bucket = loads.get(peer.filed)
            if bucket is not None:
                bucket.pop(peer, None)
                if not bucket:
                    del loads[peer.filed]
            peer.filed = None
        if peer.retiring or peer.broken or self._peers.get(peer.key) is not peer:
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
        chunk_bytes = chunk.job._item_bytes * len(chunk.items)
        if chunk_bytes:
            depth = min(depth, 1 + int(_QUEUE_BYTES // chunk_bytes))
        return depth

    def _next_chunk(self) -> _Chunk | None:
        while self._retry:
            chunk = self._retry.popleft()
            if not chunk.job._finished and not (chunk.split and chunk.split.done):
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
        keeps its ``id()`` from being reused while the entry lives.  An evicted
        function used again gets a new fid (fids are never reused), so the
        loops' records stay right whatever this cache forgets.
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

    def _add_call(self, peer: _Peer, chunk: _Chunk, out: _Outgoing) -> None:
        """Put ``chunk`` in the ``Calls`` this pass is filling for ``peer``
        (sent by :meth:`_dispatch` at the end of the pass); it counts as in
        flight there from now, so the next pick sees the loop's new load."""
        job = chunk.job
        try:
            fid, fblob = self._function_blob(job._func)
            shared = out.shared.get(peer.link)
            if shared is None:
                shared = out.shared[peer.link] = proto.Shared()
            before = shared.nbytes
            payload = proto.dumps_items(chunk.items, shared)
            weight = len(payload) + shared.nbytes - before  # arrays in the table
        except Exception as e:
            # Unpicklable function or arguments: an error for this job, in the
            # caller's get(), as the stdlib reports it.  Settled by the result
            # thread, not here: settling runs the job's error_callback, which
            # may submit work, and a dispatch pass inside this one would send
            # its frames before this pass's (out of the order the loops'
            # function records follow).
            self._stats.failed += 1
            self._unsendable.append((chunk, e))
            self._wake()
            return
        # What the job's items weigh pickled, for the bounds on chunk sizes
        # and queues (a running average: the items of one map may differ).
        per_item = weight / max(1, len(chunk.items))
        job._item_bytes = (
            per_item if not job._item_bytes else 0.7 * job._item_bytes + 0.3 * per_item
        )
        out.bytes += weight
        ckey = next(self._ckeys)
        send_blob, evict = peer.funcs.use(fid)
        call = proto.Call(
            ckey,
            fid,
            fblob if send_blob else None,
            job.mode,
            payload,
            self._retries,
            evict,
            self._limits,
        )
        batches = out.calls.setdefault(peer, [])
        if chunk.alone or not batches or batches[-1][-1][1].alone:
            batches.append([])
        batches[-1].append((call, chunk))
        peer.inflight[ckey] = chunk
        self._stats.sent(peer)
        self._file(peer)

    def _calls(self, batch: list) -> proto.Calls:
        """One ``Calls`` (``batch``: its ``(Call, chunk)`` pairs), numbered."""
        number = next(self._calls_numbers)
        self._calls_sent += 1
        for _, chunk in batch:
            chunk.calls, chunk.first = number, False
        batch[0][1].first = True
        return proto.Calls([call for call, _ in batch])

    def signal(self, peers: Any, msg: Any) -> None:
        """Send ``msg`` (STOP or TERMINATE) to each of ``peers``' loops, one
        frame per link; a link that is gone is left to the result thread."""
        frames: dict[_Link, list] = {}
        for peer in peers:
            frames.setdefault(peer.link, []).append((peer.route, msg))
        for link, routed in frames.items():
            link.send(routed)

    def _settle(self, chunk: _Chunk, ok: bool, value: Any) -> None:
        if chunk.split is not None:
            chunk.split.settle(chunk, ok, value)
        else:
            chunk.job._chunk_done(chunk.index, ok, value)

    # --------------------------------------------------------- result thread

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass

    def _queue_connection(self, conn, hello) -> None:
        """On the gate's thread: queue a loop's new connection for the result
        thread, which takes it in at its next turn (it is woken)."""
        with self._incoming_lock:
            if not self._incoming_closed:
                self._incoming.append((conn, hello))
                conn = None
        if conn is not None:
            channel.hangup(conn)
        else:
            self._wake()

    def _take_connections(self) -> None:
        """On the result thread: take in the connections the gate queued."""
        while self._incoming:
            conn, hello = self._incoming.popleft()
            self._on_connect(conn, hello)

    def _on_connect(self, conn, hello) -> None:
        """A worker process's link is up: read it from now on (its loops
        then attach, :meth:`_on_attach`)."""
        with self._lock:
            if self.state == TERMINATE or self._released:
                channel.hangup(conn)
                return
            link = _Link(conn, hello or {})
            self._links.add(link)
            self._sel.register(conn, selectors.EVENT_READ, link)

    def _on_attach(self, link: _Link, n: int, hello: proto.Attach) -> None:
        """Loop ``n`` attached through ``link``: file it and give it work."""
        old = link.peers.get(n)
        if old is not None:  # it left without a word: lost (never seen so far)
            self._peer_lost(old)
        with self._lock:
            if self.state == TERMINATE or self._released:
                link.send([(n, proto.TERMINATE)])
                return
            # Closed with no work left: a loop still starting is let in only
            # to run the initializer (as every stdlib worker does), then stops.
            late = self._stop_sent is not None
            if late and self._init_blob is None:
                link.send([(n, proto.STOP)])
                return
            peer = self._peers[(link, n)] = link.peers[n] = _Peer(link, n, hello)
            if late:
                link.send([(n, proto.STOP)])
            position = self._loops.attached(peer.loop)
            self._drain.attached(peer)  # its worker may be closing already
            early = self._early
            if position is not None:
                held = self._peer_at.get(position)
                self._peer_at[position] = peer
                if held is not None and early is not None and early.is_early(held.loop):
                    early.retire(held)  # the cluster's loop takes over here
            elif early is not None and early.owns(peer.loop):
                position = early.attach(peer)
                if (
                    position is None
                    or early.handing_over()
                    or position in self._peer_at
                ):
                    early.retire(peer)  # the cluster is up: only the init
                if position is not None and position not in self._peer_at:
                    self._peer_at[position] = peer
            self._file(peer)
            self._dispatch()

    def _run(self) -> None:
        """The result thread."""
        try:
            while self._step():
                pass
        except Exception:  # pragma: no cover - keep the traceback visible
            logger.exception("fiber-dask: pool result thread failed")
            self._break(
                RuntimeError("the fiber-dask pool result thread failed; see the log")
            )
        finally:
            self._release()

    def _step(self) -> bool:
        """One turn of the result thread.  Returns False when the pool is done."""
        with self._lock:
            if not self._should_continue():
                return False
        timeout = 0.5
        if self._deadlines:  # wake for the next hard time limit
            timeout = min(timeout, max(0.0, self._deadlines[0][0] - time.monotonic()))
        if self._held:  # and for chunks held after a Ctrl-C
            timeout = min(timeout, max(0.0, self._held[0][0] - time.monotonic()))
        try:
            ready = self._sel.select(timeout=timeout)
        except (OSError, ValueError):  # closed by _release
            return not self._released
        arrived: list[tuple[_Peer, Any]] = []
        lost: list[_Peer] = []
        dropped: list[_Link] = []
        for key, _ in ready:
            link = key.data
            if link is None:  # the wake-up socket
                try:
                    while self._wake_r.recv(4096):
                        pass
                except OSError:
                    pass
                continue
            try:
                frames = link.reader.frames()
            except (EOFError, OSError) as exc:
                frames = None
                link.silent = getattr(exc, "errno", None) == errno.ETIMEDOUT
            for raw in frames or ():
                try:
                    routed = proto.decode_frame(raw)
                except Exception:  # never let one bad message kill the pool
                    logger.exception("fiber-dask: error decoding a pool message")
                    continue
                for n, msg in routed:
                    if isinstance(msg, proto.Attach):
                        self._on_attach(link, n, msg)
                        continue
                    peer = link.peers.get(n)
                    if peer is None:
                        continue  # told to stop as it attached
                    if isinstance(msg, proto.Gone):
                        peer.interrupted = msg.reason == proto.Reason.INTERRUPTED
                        peer.drained = msg.reason == proto.Reason.DRAINED
                        lost.append(peer)
                    elif self.state != TERMINATE:  # else nobody waits for it
                        arrived.append((peer, msg))
            if frames is None:
                dropped.append(link)
        if arrived:
            try:
                self._on_messages(arrived)
            except Exception:  # never let one bad message kill the pool
                logger.exception("fiber-dask: error handling a pool message")
        if self._deadlines:
            # Before the losses: a slot process the kernel's backstop killed
            # (its task held the GIL) is an expired item, not a crash.
            self._expire_due()
        while self._unsendable:
            chunk, err = self._unsendable.popleft()
            try:
                self._settle(chunk, False, err)
            except Exception:  # one failing callback must not drop the others
                logger.exception("fiber-dask: error settling a pool result")
        for peer in lost:  # after what it sent before it left
            self._peer_lost(peer)
        for link in dropped:
            self._link_lost(link)
        if self._held and self._held[0][0] <= time.monotonic():
            self._release_held()
        self._take_connections()
        self._drain.tick()
        if self._early is None or self._early.take_cluster():
            self._loops.maintain()
        if self._causes.waiting:
            for chunk, peer, death in self._causes.ready():
                if not chunk.job._finished:
                    self._settle(chunk, False, self._item_error(chunk, peer, death))
        return True

    def _release_held(self) -> None:
        """Chunks held after a Ctrl-C (:meth:`_peer_lost`) whose wait is
        over run again, but those of jobs cancelled meanwhile."""
        now = time.monotonic()
        with self._lock:
            while self._held and self._held[0][0] <= now:
                _, chunks = self._held.popleft()
                live = [c for c in chunks if not c.job._finished]
                self._retry.extendleft(reversed(live))
            self._dispatch()

    def _should_continue(self) -> bool:
        if self.state == TERMINATE:
            # Wait for the loops to hang up: their tasks have really stopped
            # (the stdlib's join() waits for its workers to exit).
            now = time.monotonic()
            if self._peers:
                self._quiet_since = now
                return now - (self._terminated_at or now) < _TERMINATE_WAIT
            # All hung up: give their Dask tasks a moment to be reported
            # finished (so a cluster closed next cuts no running task), but
            # not for a loop Dask re-runs elsewhere after its worker died.
            return self._loops.running() and now - self._quiet_since < _SETTLE
        if self.state == CLOSE and not self._cache:
            if self._stop_sent is None:
                self._stop_sent = time.monotonic()
                self.signal(self._peers.values(), proto.STOP)
                if self._init_blob is None:
                    self._loops.release(only_unconnected=True)
            if time.monotonic() - self._stop_sent > _STOP_GRACE:
                return False
            now = time.monotonic()
            if self._peers or (self._init_blob is not None and self._loops.starting()):
                self._quiet_since = now
            elif not self._loops.running() or now - self._quiet_since > _SETTLE:
                return False
        return True

    def _on_messages(self, arrived: list[tuple[_Peer, Any]]) -> None:
        """Handle what one turn read from the loops: take every answered chunk
        off its loop under the lock once, refill the loops in one dispatch
        pass, then load and settle the results outside the lock."""
        settle: list[tuple[_Chunk, Any]] = []
        broken: list[bytes] = []
        with self._lock:
            now = time.monotonic()
            for peer, msg in arrived:
                if not isinstance(msg, proto.Results):
                    if isinstance(msg, proto.InitFailed):
                        broken.append(msg.blob)
                    elif isinstance(msg, proto.Running):
                        self._started(peer, msg, now)
                    continue
                peer.last_active = now
                for result in msg.results:
                    if peer.running is not None and peer.running[0] == result.ckey:
                        peer.running = None
                    chunk = peer.inflight.pop(result.ckey, None)
                    if chunk is not None:
                        self._learn(chunk, result.seconds)
                        self._stats.result(peer, len(chunk.items), result.ok)
                        settle.append((chunk, result))
                    if result.last:
                        peer.retiring = True
                        self._loops.recycled.add(peer.loop)
                self._file(peer)
            if settle:
                self._losses.clear()  # the pool makes progress
            self._dispatch()  # refill before settling: keep the loops busy
        for chunk, result in settle:
            if result.ok:
                try:
                    ok, value = True, pickle.loads(result.blob)
                except Exception as e:
                    ok, value = False, e
            else:
                ok, value = False, proto.decode_failure(result.blob)
            try:
                self._settle(chunk, ok, value)
            except Exception:  # one failing callback must not drop the others
                logger.exception("fiber-dask: error settling a pool result")
        for blob in broken:
            self._break(proto.decode_failure(blob))

    def _started(self, peer: _Peer, msg: proto.Running, now: float) -> None:
        """``peer`` says an item starts: its hard time limit runs from now
        (the owner's clock, never ahead of the slot's).  Under the lock."""
        # An expired peer counts too: one told to end after it moved past the
        # chunk named finishes the chunk it runs (poolworker._Loop.expire),
        # under that chunk's limits.
        if self._hard is None or msg.ckey not in peer.inflight:
            return
        peer.running = (msg.ckey, msg.offset)
        heap = self._deadlines
        heapq.heappush(
            heap,
            (now + self._hard, next(self._deadline_seq), peer, msg.ckey, msg.offset),
        )
        if len(heap) > 64 + 4 * len(self._peers):
            # Many quick items: keep only the entries still running.
            self._deadlines = heap = [
                e for e in heap if e[2].running == (e[3], e[4])
            ]
            heapq.heapify(heap)

    def _expire_due(self) -> None:
        """On the result thread: fail each item that has run past the hard
        time limit with ``TimeLimitExceeded``, and tell its slot process to
        end (``Expire``); it is not run again.  Its loop is replaced as after
        ``maxtasksperchild`` (its template forks a successor); what the loop
        still held goes to the others when it is lost."""
        expired: list[tuple[_Chunk, int, _Peer]] = []
        with self._lock:
            heap, now = self._deadlines, time.monotonic()
            while heap and heap[0][0] <= now:
                _, _, peer, ckey, offset = heapq.heappop(heap)
                if (
                    peer.running != (ckey, offset)
                    or self._peers.get(peer.key) is not peer
                ):
                    continue  # it finished, or its loop was lost: stale
                chunk = peer.inflight.pop(ckey, None)
                peer.running = None
                if chunk is None or self.state == TERMINATE:
                    continue
                self._stats.result(peer, len(chunk.items), False)
                self._end_slot(peer, ckey, offset)
                expired.append((chunk, offset, peer))
            if expired:
                self._dispatch()
        for chunk, offset, peer in expired:
            if chunk.job._finished:
                continue
            logger.info(
                "fiber-dask: a pool task ran past its time limit (%gs); ending its "
                "slot process (pid %s%s)",
                self._hard,
                peer.pid,
                f" on {peer.worker}" if peer.worker else "",
            )
            try:
                self._settle(chunk, False, self._time_limit_error(chunk, offset, peer))
            except Exception:  # one failing callback must not drop the others
                logger.exception("fiber-dask: error settling a pool result")

    def _end_slot(self, peer: _Peer, ckey: int, offset: int) -> None:
        """Tell ``peer``'s slot process to end now (``Expire``; engine lock
        held): it gets no more chunks, and its loop is replaced as after
        ``maxtasksperchild`` (its template forks a successor), not failed."""
        peer.expired = peer.retiring = True
        self._loops.recycled.add(peer.loop)
        self._file(peer)
        peer.link.send([(peer.route, proto.Expire(ckey, offset))])

    def _time_limit_error(
        self, chunk: _Chunk, offset: int, peer: _Peer
    ) -> TimeLimitExceeded:
        name = getattr(chunk.job._func, "__qualname__", repr(chunk.job._func))
        where = f" on {peer.worker}" if peer.worker else ""
        return TimeLimitExceeded(
            f"task {name}: this item (index {chunk.first_item() + offset}) ran past "
            f"its time limit of {self._hard:g}s (Pool(time_limit=...), "
            "ProcessPoolExecutor(time_limit=...) or fiber.pool.time-limit); its slot "
            f"process (pid {peer.pid}{where}) was killed and replaced, and "
            "the item was not run again. Raise the limit if the task needs longer, "
            "or set soft_time_limit (fiber.pool.soft-time-limit) below it, so that "
            "the task gets SoftTimeLimitExceeded first and can clean up."
        )

    def _learn(self, chunk: _Chunk, secs: float) -> None:
        entry = self._fids.get(id(chunk.job._func))
        if entry is not None and entry[0] is chunk.job._func and chunk.items:
            per_item = secs / len(chunk.items)
            entry[3] = per_item if entry[3] is None else 0.7 * entry[3] + 0.3 * per_item

    def _peer_lost(self, peer: _Peer) -> None:
        failed: list[_Chunk] = []
        with self._lock:
            if self._peers.get(peer.key) is not peer:
                return  # already lost
            self._stats.lost(peer)
            peer.running = None
            del self._peers[peer.key]
            if peer.link.peers.get(peer.route) is peer:
                del peer.link.peers[peer.route]
            for pos, p in list(self._peer_at.items()):
                if p is peer:
                    del self._peer_at[pos]
            if self._early is not None:
                self._early.gone(peer)
            self._file(peer)
            if self.state == TERMINATE or self._released:
                return
            back: list[_Chunk] = []
            if peer.expired:
                # Ended at the owner's word (an item's hard time limit, a
                # cancelled job): its expired chunk is settled; what it
                # still held had not started (or did, just as the limit
                # passed): all of it goes again, nothing counted against
                # the item or the pool.  (A slot process that had moved past
                # the chunk named finishes the one it runs first; should it
                # crash in that one, the chunk too goes again uncounted:
                # once, since its next slot counts as any other.)
                back = [c for c in peer.inflight.values() if not c.job._finished]
                self._retry.extendleft(reversed(back))
                if back:
                    logger.info(
                        "fiber-dask: re-running %d chunk(s) held by a slot process "
                        "the pool ended (a time limit, or an interrupted call)",
                        len(back),
                    )
                self._dispatch()
                return
            rerun = 0  # items that may have been running there and go again
            ran, never = proto.lost_chunks(
                [(c.calls, c.first, c) for c in peer.inflight.values()]
            )
            exact = len(ran) == 1  # else which of them ran we cannot tell
            ran = [c for c in ran if not c.job._finished]
            never = [c for c in never if not c.job._finished]
            if (ran or never) and not peer.retiring:
                self._losses.append(time.monotonic())
            if peer.retiring:
                back.extend(ran)  # maxtasksperchild: it ended after its last
            elif not exact:
                # One Calls' chunks, one of them running (the others finished
                # unanswered, or never started): each goes again in a Calls
                # of its own, without counting a failure, so that the next
                # loss names the chunk.
                for chunk in ran:
                    chunk.alone = True
                    back.append(chunk)
                    rerun += len(chunk.items)
            for chunk in ran if exact and not peer.retiring else ():
                if len(chunk.items) > 1:
                    # It was running, but which item we cannot tell: re-run it
                    # item by item, so the next loss names the item.
                    split = _Split(len(chunk.items))
                    rerun += len(chunk.items)
                    for offset, item in enumerate(chunk.items):
                        back.append(
                            _Chunk(chunk.job, chunk.index, [item], split, offset)
                        )
                else:
                    chunk.attempts += 1
                    chunk.worker = peer.worker
                    chunk.alone = True
                    if chunk.attempts > self._allowed_failures:
                        failed.append(chunk)
                    else:
                        back.append(chunk)
                        rerun += 1
            back.extend(never)  # queued there, never started
            if peer.draining is not None:  # its worker closes: not a loss
                rerun = self._drain.left(peer, ran, never)
            self._stats.rerun(rerun, len(failed))
            if peer.interrupted and back:
                # A Ctrl-C: the program's main thread most likely takes it
                # too, and its blocking call cancels the job moments later
                # (cancel): its chunks wait that long before they run again,
                # so that none does (the stdlib never runs them again).
                self._held.append((time.monotonic() + INTERRUPT_HOLD, back))
            else:
                self._retry.extendleft(reversed(back))
            if back and peer.draining is None:
                logger.log(
                    logging.INFO if peer.interrupted else logging.WARNING,
                    "fiber-dask: a pool worker (%s, pid %s) %s; re-running %d chunk(s)",
                    peer.worker
                    or ("an early slot" if self._early is not None else None),
                    peer.pid,
                    "was interrupted (SIGINT)" if peer.interrupted else "died",
                    len(back),
                )
            storm = None
            if len(self._losses) > self._loss_limit:
                storm = self._storm_error()
                self._losses.clear()
            self._dispatch()
        for chunk in failed:
            # It fails once the pool learns why its process died (poolcause).
            self._causes.add(chunk, peer)
        if storm is not None:
            with self._lock:
                jobs = list(self._cache)
            for job in jobs:
                job._fail(storm)

    def _link_lost(self, link: _Link) -> None:
        """``link`` dropped: every loop it still carried is lost."""
        with self._lock:
            self._links.discard(link)
            try:
                self._sel.unregister(link.conn)
            except (KeyError, ValueError, OSError):
                pass
            link.conn.close()
            peers = list(link.peers.values())
        for peer in peers:
            self._peer_lost(peer)

    def _item_error(
        self, chunk: _Chunk, peer: _Peer, death: proto.Death | None = None
    ) -> WorkerLostError:
        name = getattr(chunk.job._func, "__qualname__", repr(chunk.job._func))
        if death is None:
            how, remedy = f", pid {peer.pid}; why is not known", ""
        else:
            how, remedy = f": {death}", " " + death.remedy()
        return WorkerLostError(
            f"task {name}: this item (index {chunk.first_item()}) killed every "
            f"process it ran in: {chunk.attempts} worker "
            f"processes died while it ran (last on {chunk.worker}{how}).{remedy} "
            f"The limit is fiber.pool.allowed-failures={self._allowed_failures}. A "
            "task that crashes its process (segfault, os._exit, out of memory) "
            "fails this way; fix the task or raise the limit "
            "(DASK_FIBER__POOL__ALLOWED_FAILURES).",
            cause=death and death.cause,
            signal=death and _signal(death.signal),
            exitcode=death and death.exitcode,
            address=(death and death.address) or chunk.worker,
        )

    def _storm_error(self) -> WorkerLostError:
        span = self._losses[-1] - self._losses[0]
        return WorkerLostError(
            f"workers kept dying under the pool: {len(self._losses)} losses in "
            f"{span:.1f} s with no chunk finishing in between (the limit is "
            f"max(10, 2 x (fiber.pool.allowed-failures + 1) x processes) = "
            f"{self._loss_limit}). The cluster is losing its workers (out of "
            "memory? preempted hosts?); check the workers' logs."
        )

    def _break(self, exc: BaseException) -> None:
        """The pool cannot work (its initializer fails): fail all, now and later."""
        with self._lock:
            if self.broken is None:
                self.broken = exc
            jobs = list(self._cache)
        for job in jobs:
            job._fail(exc)

    # ------------------------------------------------------------- release

    def _release(self) -> None:
        """Give back what this pool holds: its service, slots, loops, sockets."""
        with self._lock:
            if self._released:
                return
            self._released = True
            conns = [link.conn for link in self._links]
            with self._incoming_lock:
                self._incoming_closed = True
                conns += [conn for conn, _ in self._incoming]
                self._incoming.clear()
            self._links.clear()
            self._peers.clear()
            self._peer_at.clear()
            self._load_index.clear()
        poolstats.unwatch(self)
        if self._early is not None:
            self._early.close()
        self._server.unregister(self._service)
        for conn in conns:
            channel.hangup(conn)
        self._loops.release_claim()
        self._loops.release()
        self._sel.close()
        for s in (self._wake_r, self._wake_w):
            s.close()
        _live.discard(self)


def _signal(number: int | None) -> Any:
    """``number`` as a :class:`signal.Signals` where it names one."""
    import signal

    if number is None:
        return None
    try:
        return signal.Signals(number)
    except ValueError:
        return number


def _chunks_to_come(job) -> int:
    """Chunks of a ``map`` not handed out yet (0 for other jobs)."""
    if not isinstance(job, MapResult):
        return 0
    return job._chunks_to_come()


def _on_connect(ref, conn, hello) -> None:
    engine = ref()
    if engine is None:
        channel.hangup(conn)
        return
    engine._queue_connection(conn, hello)


def _stop_all_at_exit() -> None:
    """Stop every pool before the clients close (a cluster shutdown hook).

    Terminate them all at once, then wait (together, at most ``_EXIT_WAIT``
    seconds) for their loops to hang up and their Dask tasks to end, so that
    closing the cluster cuts no running task (which is what made distributed
    print warnings at exit).
    """
    engines = list(_live)
    for engine in engines:
        try:
            engine.terminate()
        except Exception:  # pragma: no cover - best effort at exit
            pass
    deadline = time.monotonic() + _EXIT_WAIT
    for engine in engines:
        thread = engine._thread
        if thread is not None:
            thread.join(max(0.0, deadline - time.monotonic()))
    while time.monotonic() < deadline and any(
        e._loops.running()
        for e in engines
        if e._client is not None and e._client.status == "running"
    ):
        time.sleep(0.01)
    for engine in engines:
        engine._release()


cluster.on_shutdown(_stop_all_at_exit)
