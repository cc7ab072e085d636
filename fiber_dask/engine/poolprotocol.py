"""The Pool wire protocol: every message between a pool's owner and its loops.

Both ends import this module and nothing else to speak to each other, so they
cannot disagree about a message's shape or about which functions a loop holds
(loky's ``process_executor`` is the model: small named message classes and one
place that encodes them).

A connection between the owner and a worker process is a *link*
(:mod:`fiber_dask.engine.poollink`): it carries the messages of every loop of that
pool in that process (a hundred thread slots, or the one loop of a slot
process).  Each frame on a link is :func:`encode_frame` of a list of
``(loop, message)`` pairs, ``loop`` being the loop's number in its pool; the
messages of one loop keep their order.

owner → loop::

    Calls([Call(ckey, fid, fblob, mode, payload, retries, evict, limits), ...])
                            run these chunks, in order (``payload``: the
                            pickled list of a chunk's items; ``limits``:
                            ``(soft, hard)`` seconds per item, or None)
    Expire(ckey, offset)    that item passed its hard time limit, or its
                            job was cancelled: a slot process still in
                            chunk ckey ends itself (SIGKILL), see
                            timelimits; one past it finishes the chunk it
                            runs, answers and leaves (``Gone(RECYCLED)``)
    STOP                    stop after the queued work
    TERMINATE               stop now, interrupting the task
    DRAIN                   the loop's Dask worker is closing: finish the
                            chunk running, start no other, answer what ran
                            and leave (``Gone(DRAINED)``): the owner then
                            knows every chunk left unanswered never started

loop → owner::

    Attach(pid, worker[, slot])
                            the loop joined the link (its first message);
                            ``slot``: the pool's loop number when the frame's
                            is a relay's route (see below)
    Results([Result(ckey, ok, blob, seconds, last), ...])
                            chunks' outcomes, in the order they ran; ``last``:
                            maxtasksperchild retires this loop after it
    Running(ckey, offset)   the chunk's item ``offset`` starts (only under a
                            hard time limit: the owner's clock for it)
    InitFailed(blob)        the initializer raised or could not be loaded
    Gone(reason)            the loop ended (its last message); a link that
                            drops ends every loop it still carried

Batches (issue 15: one message per chunk capped the pool at the owner's one
thread, whose largest cost was a socket send per chunk): the owner puts every
chunk it hands one loop in one dispatch pass into one ``Calls``, and the loop
answers a ``Calls`` with ``Results`` that each cover a run of its chunks: it
answers its first chunk on its own, then what it has finished once
:data:`FLUSH_SECONDS` have passed since the first unanswered one finished or
:data:`FLUSH_CHUNKS` are waiting, and at the end of the ``Calls``.  A
``Results`` never spans two ``Calls``.  So when a loop is lost (its link
drops), the chunks of the oldest ``Calls`` not answered yet are the ones that
may have run (one of them was running); those of later ``Calls`` never
started.  The owner's rule for that is :func:`lost_chunks`.

The function cache rule (why a long-lived pool never forgets a function): the
owner keeps, per loop, a :class:`PeerFunctions` — a bounded, least-recently-used
record of the functions that loop holds.  It alone decides: a ``Call`` carries
the function's pickle (``fblob``) when the loop does not hold it, and the ids
the loop must drop (``evict``) to stay within the bound.  The loop's
:class:`LoopFunctions` only obeys, so its content is always exactly what the
owner believes.  A loop's messages are handled in the order they were sent,
which is what keeps the two in step.

A function that cannot be *loaded* on the loop (an ``ImportError`` unpickling
it) fails every task that uses it with that error; the loop keeps its pickle
and tries again on the next use, never holding it as "missing".

Failures travel as :func:`encode_failure` / :func:`decode_failure`: the
exception itself when it can be rebuilt at the owner (also one whose
``__init__`` needs arguments: it is rebuilt without calling ``__init__``),
else a :class:`~fiber_dask.errors.RemoteTaskError` carrying its type name,
message and traceback text.
"""

from __future__ import annotations

import collections
import io
import pickle
import sys
import traceback
from multiprocessing.pool import RemoteTraceback
from typing import Any, Callable

from ..errors import RemoteTaskError

__all__ = [
    "Call",
    "Calls",
    "Result",
    "Results",
    "InitFailed",
    "Attach",
    "Gone",
    "Running",
    "Expire",
    "FLUSH_SECONDS",
    "FLUSH_CHUNKS",
    "lost_chunks",
    "dumps_items",
    "loads_items",
    "Shared",
    "STOP",
    "TERMINATE",
    "DRAIN",
    "FUNC_CACHE_SIZE",
    "PeerFunctions",
    "LoopFunctions",
    "encode_frame",
    "forward_frame",
    "decode_frame",
    "encode_failure",
    "decode_failure",
    "dumps_value",
    "Reason",
    "Death",
]

#: Functions one loop holds at most.  A pool that cycles through more (a new
#: ``functools.partial`` per generation) re-sends the evicted ones when used.
FUNC_CACHE_SIZE = 512

#: Seconds a loop holds finished chunks' results to answer them together.
#: Short next to any task worth a pool (the owner hears of a result at most
#: this late), long next to the per-chunk cost of a message (~10-50 us).
FLUSH_SECONDS = 0.002
#: Results a loop answers together at most: a loop holds more chunks than
#: this (``fiber.pool.prefetch``), so the owner refills it while it works on
#: the rest, and no loop waits for the round trip of its own answer.
FLUSH_CHUNKS = 16

_PROTOCOL = pickle.HIGHEST_PROTOCOL


class Reason:
    """Why a loop ended: the return value of the loop's Dask task."""

    STOPPED = "stopped"  # STOP after the queued work
    TERMINATED = "terminated"  # TERMINATE, or the owner hung up
    RECYCLED = "recycled"  # maxtasksperchild reached
    INIT_FAILED = "initializer-failed"
    NO_POOL = "no-pool"  # the pool was gone when the loop connected
    UNREACHABLE = "unreachable"  # prefix: the owner could not be reached
    #: SIGINT in the slot process (a terminal's Ctrl-C, Jupyter's interrupt,
    #: which signal the whole process group): it ends, as a stdlib pool
    #: worker does, and its chunks go again without a warning.
    INTERRUPTED = "interrupted"
    #: A slot process killed at the owner's word (``Expire``): an item ran
    #: past its hard time limit.  Written to its reason pipe before the
    #: SIGKILL; its template forks a successor, as after ``RECYCLED``.
    EXPIRED = "time-limit"

    #: DRAIN: its Dask worker is closing (lifetime, retirement); it finished
    #: the chunk it ran and left, and another loop takes its slot.
    DRAINED = "drained"

    #: Endings that are not a failure of the loop.
    NORMAL = frozenset({STOPPED, RECYCLED, NO_POOL, INTERRUPTED, EXPIRED, DRAINED})


class Call:
    """One chunk of a :class:`Calls`: run it.

    ``mode`` 0: ``f(x)``, 1: ``f(*x)``, 2: ``f(*args, **kwds)``.  ``fblob`` is
    the cloudpickled function when the loop does not hold ``fid``, else None;
    ``evict`` the function ids the loop drops before it looks ``fid`` up;
    ``limits`` the ``(soft, hard)`` time limits of each item in seconds
    (either None), or None (:mod:`fiber_dask.engine.timelimits`).
    """

    __slots__ = (
        "ckey",
        "fid",
        "fblob",
        "mode",
        "payload",
        "retries",
        "evict",
        "limits",
    )

    def __init__(
        self, ckey, fid, fblob, mode, payload, retries, evict=(), limits=None
    ):
        self.ckey, self.fid, self.fblob = ckey, fid, fblob
        self.mode, self.payload, self.retries = mode, payload, retries
        self.evict, self.limits = evict, limits

    def fields(self) -> tuple:
        return (
            self.ckey,
            self.fid,
            self.fblob,
            self.mode,
            self.payload,
            self.retries,
            self.evict,
            self.limits,
        )


class Calls:
    """Owner → loop: run these chunks (:class:`Call`), in this order.

    ``shared``: the pickles of the arrays the chunks of its frame share
    (:class:`Shared`), which their payloads refer to; None if none.
    """

    __slots__ = ("calls", "shared")
    tag = "C"

    def __init__(self, calls, shared=None):
        self.calls = calls
        self.shared = shared

    def fields(self) -> tuple:
        return ([c.fields() for c in self.calls],)

    @classmethod
    def from_fields(cls, calls) -> Calls:
        return cls([Call(*f) for f in calls])


class Result:
    """One chunk's outcome in a :class:`Results`: its pickled results (a
    list), or its failure (:func:`encode_failure`) when ``ok`` is False;
    ``seconds`` its items' run time."""

    __slots__ = ("ckey", "ok", "blob", "seconds", "last")

    def __init__(self, ckey, ok, blob, seconds, last):
        self.ckey, self.ok, self.blob = ckey, ok, blob
        self.seconds, self.last = seconds, last

    def fields(self) -> tuple:
        return (self.ckey, self.ok, self.blob, self.seconds, self.last)


class Results:
    """Loop → owner: the outcomes of a run of one :class:`Calls`' chunks."""

    __slots__ = ("results",)
    tag = "Q"

    def __init__(self, results):
        self.results = results

    def fields(self) -> tuple:
        return ([r.fields() for r in self.results],)

    @classmethod
    def from_fields(cls, results) -> Results:
        return cls([Result(*f) for f in results])


class InitFailed:
    """Loop → owner: the initializer raised, or could not be loaded."""

    __slots__ = ("blob",)
    tag = "I"

    def __init__(self, blob):
        self.blob = blob

    def fields(self) -> tuple:
        return (self.blob,)

    @classmethod
    def from_fields(cls, blob) -> InitFailed:
        return cls(blob)


class Death:
    """Why a loop's process died: what its keeper (or, for a lost Dask worker,
    the scheduler) knows, carried to the owner as the keeper's return value
    and into :class:`~fiber_dask.errors.WorkerLostError`'s ``cause``,
    ``signal``, ``exitcode`` and ``address``.  ``cause`` is one of
    ``WorkerLostError.CAUSES``; ``extra``: ``used``, ``limit``, ``fraction``,
    ``size`` (bytes) for a slot ended over its worker's memory limit,
    ``oom_killer`` for the kernel's, ``detail`` for a lost worker."""

    __slots__ = ("cause", "signal", "exitcode", "address", "pid", "extra")

    def __init__(self, cause, signal=None, exitcode=None, address=None, pid=None,
                 **extra):  # fmt: skip
        self.cause, self.signal, self.exitcode = cause, signal, exitcode
        self.address, self.pid, self.extra = address, pid, extra

    def __reduce__(self):
        return _death, (self.cause, self.signal, self.exitcode, self.address,
                        self.pid, self.extra)  # fmt: skip

    def signal_name(self) -> str:
        import signal

        try:
            return signal.Signals(self.signal).name
        except ValueError:
            return f"signal {self.signal}"

    def __str__(self) -> str:
        """What happened, as a clause: ``killed by SIGSEGV (pid 12)``."""
        x = self.extra
        pid = f" (pid {self.pid})" if self.pid is not None else ""
        if self.cause == "memory" and "used" in x:
            return (
                f"ended for memory{pid}: its Dask worker and slot processes used "
                f"{_mib(x['used'])}, this slot process {_mib(x['size'])}, over "
                f"distributed.worker.memory.terminate={x['fraction']:g} x the "
                f"worker's memory limit of {_mib(x['limit'])}"
            )
        if self.cause == "memory":
            return f"killed by the kernel's OOM killer{pid} (SIGKILL; its cgroup " \
                "counted an OOM kill)"
        if self.cause == "signal":
            return f"killed by {self.signal_name()}{pid}"
        if self.cause == "exit":
            return f"exited with code {self.exitcode}{pid}"
        return x.get("detail") or f"lost ({self.cause})"

    def remedy(self) -> str:
        """What to change, as a sentence."""
        if self.cause == "memory":
            return (
                "Give the workers more memory (fiber.local.memory-limit on the "
                "embedded cluster, the workers' --memory-limit or the backend's "
                "memory setting elsewhere), make the task use less, or raise "
                "distributed.worker.memory.terminate."
            )
        if self.cause == "signal":
            if self.signal == 9:
                return (
                    "Something outside the task sent SIGKILL (a user, a job's "
                    "kill, the kernel); check the host's log."
                )
            return (
                f"A {self.signal_name()} is a crash in native code (a segfault "
                "in a C extension, ctypes) or a signal sent from outside; the "
                "worker's stderr has the task's faulthandler traceback."
            )
        if self.cause == "exit":
            return (
                "The task (or a library it calls) ended its process: os._exit(), "
                "a C exit(); it should raise instead."
            )
        if self.cause == "scaled-down":
            return "The cluster retired the worker; the pool re-ran what it held."
        if self.cause == "job":
            return (
                "The batch job holding the worker ended (scancel, walltime); "
                "check the job's accounting (sacct) and its walltime."
            )
        return "Check the worker's host, its network and the worker's log."


def _death(cause, signal, exitcode, address, pid, extra) -> Death:
    return Death(cause, signal, exitcode, address, pid, **extra)


def _mib(n: int) -> str:
    return f"{n / 2**20:.0f} MiB"


class Attach:
    """Loop → owner, its first message: the loop joined the link; ``pid`` the
    process that runs its tasks, ``worker`` its Dask worker's address;
    ``slot`` the loop's number when the frame names a relay's route instead
    (None: the frame's number is the loop's)."""

    __slots__ = ("pid", "worker", "slot")
    tag = "A"

    def __init__(self, pid, worker, slot=None):
        self.pid, self.worker, self.slot = pid, worker, slot

    def fields(self) -> tuple:
        if self.slot is None:
            return (self.pid, self.worker)
        return (self.pid, self.worker, self.slot)

    @classmethod
    def from_fields(cls, pid, worker, slot=None) -> Attach:
        return cls(pid, worker, slot)


class Gone:
    """Loop → owner, its last message: the loop ended, for ``reason``
    (a :class:`Reason`)."""

    __slots__ = ("reason",)
    tag = "G"

    def __init__(self, reason):
        self.reason = reason

    def fields(self) -> tuple:
        return (self.reason,)

    @classmethod
    def from_fields(cls, reason) -> Gone:
        return cls(reason)


class Running:
    """Loop → owner: item ``offset`` of chunk ``ckey`` starts (each try of
    it).  Sent only under a hard time limit, after the ``Results`` of every
    chunk before it, so the owner knows which item runs and since when."""

    __slots__ = ("ckey", "offset")
    tag = "R"

    def __init__(self, ckey, offset):
        self.ckey, self.offset = ckey, offset

    def fields(self) -> tuple:
        return (self.ckey, self.offset)

    @classmethod
    def from_fields(cls, ckey, offset) -> Running:
        return cls(ckey, offset)


class Expire:
    """Owner → loop: item ``offset`` of chunk ``ckey`` ran past its hard
    time limit, and the owner failed it; or the job of chunk ``ckey`` was
    cancelled (its blocking caller interrupted: ``PoolEngine.cancel``).  A
    slot process still in chunk ``ckey`` ends itself at once; one that has
    moved past it (the owner took its first unanswered chunk for the one it
    runs) finishes the chunk it runs and leaves, as after
    ``maxtasksperchild``.  The owner re-sends what it still held."""

    __slots__ = ("ckey", "offset")
    tag = "X"

    def __init__(self, ckey, offset):
        self.ckey, self.offset = ckey, offset

    def fields(self) -> tuple:
        return (self.ckey, self.offset)

    @classmethod
    def from_fields(cls, ckey, offset) -> Expire:
        return cls(ckey, offset)


class _Signal:
    """A message without fields (:data:`STOP`, :data:`TERMINATE`); each is
    one object, compared with ``is``."""

    __slots__ = ("tag", "name")

    def __init__(self, tag: str, name: str) -> None:
        self.tag, self.name = tag, name

    def fields(self) -> tuple:
        return ()

    def from_fields(self) -> _Signal:
        return self

    def __repr__(self) -> str:
        return self.name


#: Owner → loop: stop after the queued work.
STOP = _Signal("S", "STOP")
#: Owner → loop: stop now, interrupting the running task.
TERMINATE = _Signal("K", "TERMINATE")
#: Owner → loop: your Dask worker is closing; finish the chunk running, then
#: leave without starting another (:data:`Reason.DRAINED`).
DRAIN = _Signal("D", "DRAIN")

_KINDS = {
    kind.tag: kind
    for kind in (
        Calls,
        Results,
        InitFailed,
        Attach,
        Gone,
        Running,
        Expire,
        STOP,
        TERMINATE,
        DRAIN,
    )
}


def encode_frame(routed: list, shared: Shared | None = None) -> bytes:
    """One frame of a link: ``routed`` is a list of ``(loop, message)``
    pairs, pickled as one list of plain tuples ``(loop, tag, *fields)``,
    after the pickles of the arrays its chunks share (``shared``)."""
    blobs = shared.blobs() if shared is not None else None
    return pickle.dumps(
        (blobs, [(loop, msg.tag, *msg.fields()) for loop, msg in routed]),
        protocol=_PROTOCOL,
    )


def forward_frame(loop: int, msg: Any) -> bytes:
    """A frame of one message taken from a decoded frame (a relay hands it
    on, as ``loop``'s): a ``Calls`` takes the shared arrays of the frame it
    came in."""
    blobs = msg.shared if type(msg) is Calls else None
    return pickle.dumps((blobs, [(loop, msg.tag, *msg.fields())]), protocol=_PROTOCOL)


def decode_frame(raw: bytes) -> list:
    """The ``(loop, message)`` pairs of a frame.

    Only plain types are unpickled here (the envelope); the payload, function
    and values inside stay bytes until the receiver decides to load them.
    """
    kinds = _KINDS
    blobs, routed = pickle.loads(raw)
    out = [(loop, kinds[tag].from_fields(*fields)) for loop, tag, *fields in routed]
    if blobs:
        for _, msg in out:
            if type(msg) is Calls:
                msg.shared = blobs
    return out


def lost_chunks(unanswered: list) -> tuple[list, list]:
    """A loop's connection dropped: which of its chunks may have run.

    ``unanswered``: ``(calls_number, first, chunk)`` for every chunk sent to
    it and not answered, in send order (``first``: the chunk came first in
    its ``Calls``).  Returns ``(maybe_ran, never_started)``: the chunks of
    the oldest ``Calls`` among them (the loop was running one of them; the
    others before it finished without their ``Results`` being sent, or after
    it never started), and those of later ``Calls``.  When the first of them
    is its ``Calls``' first chunk, which a loop answers on its own, it is
    the only one that ran.
    """
    if not unanswered:
        return [], []
    first_number, first, _ = unanswered[0]
    n = 1
    if not first:
        while n < len(unanswered) and unanswered[n][0] == first_number:
            n += 1
    return [c for _, _, c in unanswered[:n]], [c for _, _, c in unanswered[n:]]


# ---------------------------------------------------------------- functions


class PeerFunctions:
    """The owner's record of the functions one loop holds: bounded, LRU.

    :meth:`use` is called once per ``Call`` sent to that loop, in send order,
    and says whether to include the function's pickle and which ids the loop
    must drop.
    """

    __slots__ = ("_held", "_limit")

    def __init__(self, limit: int = FUNC_CACHE_SIZE) -> None:
        self._held: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._limit = limit

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, fid: int) -> bool:
        return fid in self._held

    def use(self, fid: int) -> tuple[bool, tuple[int, ...]]:
        """Record a call of ``fid``: ``(send_the_pickle, ids_to_evict)``."""
        held = self._held
        if fid in held:
            held.move_to_end(fid)
            return False, ()
        evict = []
        while len(held) >= self._limit:
            evict.append(held.popitem(last=False)[0])
        held[fid] = None
        return True, tuple(evict)


class _Unloadable:
    """A function whose pickle failed to load here: kept with its error, so
    that its tasks fail with that error, and loading is tried again next use."""

    __slots__ = ("blob", "error")

    def __init__(self, blob: bytes, error: BaseException) -> None:
        self.blob, self.error = blob, error


class LoopFunctions:
    """The loop's functions, exactly as the owner's :class:`PeerFunctions` says."""

    def __init__(self, load: Callable[[bytes], Any]) -> None:
        self._funcs: dict[int, Any] = {}
        self._load = load

    def __len__(self) -> int:
        return len(self._funcs)

    def lookup(self, call: Call) -> Any:
        """The function ``call`` runs.  Raises what loading it raised."""
        funcs = self._funcs
        for fid in call.evict:
            funcs.pop(fid, None)
        if call.fblob is not None:
            funcs[call.fid] = _Unloadable(call.fblob, None)
        entry = funcs.get(call.fid)
        if entry is None:
            raise RuntimeError(
                f"fiber-dask pool protocol error: function {call.fid} was never "
                "sent to this loop or was evicted; please report this as a bug"
            )
        if isinstance(entry, _Unloadable):
            try:
                func = self._load(entry.blob)
            except Exception as e:
                entry.error = e
                raise
            funcs[call.fid] = func
            return func
        return entry


# ------------------------------------------------------------------ values

#: Item types that plain pickle carries exactly as cloudpickle would (by
#: value, no class or function references to resolve on the loop).
_PLAIN = frozenset({int, float, str, bytes, bool, type(None), complex})


def _numpy() -> Any:
    """numpy if this process has imported it (whole: not a module another
    thread is still importing, such as the embedded cluster's start importing
    distributed while a pool's early slots serve), else None.  Only an object
    made by a whole numpy can be one of its arrays."""
    np = sys.modules.get("numpy")
    if np is None or getattr(getattr(np, "__spec__", None), "_initializing", False):
        return None
    return np


def _plain_array(x: Any) -> bool:
    """A numpy array or scalar without Python objects in it: plain pickle
    carries it exactly as cloudpickle would (``ndarray.__reduce_ex__``, no
    class or function references besides numpy's own), some 3x faster; an ES
    ``theta`` sent with every task was the owner's largest send-path cost."""
    np = _numpy()
    if np is None:
        return False
    kind = type(x)
    if kind is np.ndarray or (isinstance(x, np.generic) and kind.__module__ == "numpy"):
        return not x.dtype.hasobject
    return False


#: Bytes from which a numpy array in a chunk's items is pickled once per
#: frame (:class:`Shared`) rather than once per chunk.
SHARE_BYTES = 1024


class Shared:
    """The large arrays the chunks of one frame share, pickled once.

    The same array in many chunks (an ES ``theta`` sent with every task) was
    pickled, sent, read and copied once per chunk: 8 KB x 2048 tasks, 16 MB
    a map, most of the owner's time in a 1024-slot map's first wave.  The
    chunks' payloads refer to an array of this table by its index (pickle's
    persistent ids); the frame carries the table once; each chunk still
    unpickles its own copy, so a task that changes its array in place
    changes no other task's, as before.
    """

    __slots__ = ("_index", "objects", "nbytes")

    def __init__(self) -> None:
        self._index: dict[int, int] = {}
        self.objects: list = []  # held, so that no id() is reused meanwhile
        self.nbytes = 0  # the arrays' data: what the frame will carry for them

    def __len__(self) -> int:
        return len(self.objects)

    def ref(self, obj: Any) -> int:
        i = self._index.get(id(obj))
        if i is None:
            i = self._index[id(obj)] = len(self.objects)
            self.objects.append(obj)
            self.nbytes += obj.nbytes
        return i

    def blobs(self) -> list | None:
        if not self.objects:
            return None
        return [pickle.dumps(o, protocol=_PROTOCOL) for o in self.objects]


class _SharingPickler(pickle.Pickler):
    """Plain pickle that leaves the large arrays to the frame's :class:`Shared`."""

    def __init__(self, file: Any, shared: Shared) -> None:
        super().__init__(file, protocol=_PROTOCOL)
        self._shared = shared

    def persistent_id(self, obj: Any) -> Any:
        if _big_array(obj):
            return self._shared.ref(obj)
        return None


class _SharedUnpickler(pickle.Unpickler):
    def __init__(self, file: Any, blobs: list) -> None:
        super().__init__(file)
        self._blobs = blobs
        self._loaded: dict[int, Any] = {}  # within one chunk, one object

    def persistent_load(self, pid: Any) -> Any:
        obj = self._loaded.get(pid)
        if obj is None:
            obj = self._loaded[pid] = pickle.loads(self._blobs[pid])
        return obj


def _big_array(x: Any) -> bool:
    np = _numpy()
    return (
        np is not None
        and type(x) is np.ndarray
        and x.nbytes >= SHARE_BYTES
        and not x.dtype.hasobject
    )


def dumps_items(items: list, shared: Shared | None = None) -> bytes:
    """Pickle a chunk's items for the loop.

    Items of plain builtin types (and tuples of them, as ``starmap`` sends),
    numpy arrays and scalars of non-object dtypes among them, take plain
    pickle, some 10x faster than cloudpickle for a small chunk; anything else
    takes cloudpickle, which carries classes and functions defined in
    ``__main__`` by value.  With ``shared`` (the table of the frame this
    chunk goes in), plain items' arrays of :data:`SHARE_BYTES` or more are
    left to it.  Raises what pickling raises.
    """
    plain = _PLAIN
    big = False
    for item in items:
        kind = type(item)
        if kind in plain:
            continue
        if kind is tuple and all(type(x) in plain or _plain_array(x) for x in item):
            big = big or any(_big_array(x) for x in item)
            continue
        if _plain_array(item):
            big = big or _big_array(item)
            continue
        import cloudpickle

        return cloudpickle.dumps(items, protocol=_PROTOCOL)
    if big and shared is not None:
        buf = io.BytesIO()
        _SharingPickler(buf, shared).dump(items)
        return buf.getvalue()
    return pickle.dumps(items, protocol=_PROTOCOL)


def loads_items(payload: bytes, shared: list | None) -> list:
    """A chunk's items from its payload and its frame's shared arrays."""
    if not shared:
        return pickle.loads(payload)
    return _SharedUnpickler(io.BytesIO(payload), shared).load()


def dumps_value(value: Any) -> bytes:
    """Pickle a result: plain pickle first (fastest; classes the owner can
    import go by reference), cloudpickle for what only it can carry."""
    try:
        return pickle.dumps(value, protocol=_PROTOCOL)
    except Exception:
        import cloudpickle

        return cloudpickle.dumps(value, protocol=_PROTOCOL)


def _rebuild(exc: BaseException, tb: str) -> BaseException:
    exc.__cause__ = RemoteTraceback(tb)
    return exc


def _rebuild_without_init(
    cls: type, args: tuple, state: dict, tb: str
) -> BaseException:
    """An exception whose ``__init__`` needs other arguments than its
    ``args``: made without calling ``__init__`` (what ``copy`` does)."""
    exc = cls.__new__(cls, *args)
    exc.args = args
    if state:
        exc.__dict__.update(state)
    return _rebuild(exc, tb)


def _format(exc: BaseException) -> str:
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return '\n"""\n%s"""' % tb


def encode_failure(exc: BaseException) -> bytes:
    """A task's exception, for :func:`decode_failure` at the owner.

    Carries the exception (as the stdlib does, with the remote traceback as its
    ``__cause__``) and, in case the owner cannot rebuild it, its type name,
    message and traceback text.
    """
    tb = _format(exc)
    name = f"{type(exc).__module__}.{type(exc).__qualname__}"
    try:
        message = str(exc)
    except Exception:
        message = repr(exc.args)
    try:
        blob = dumps_value(_Reduced(_rebuild, (exc, tb)))
        pickle.loads(blob)  # an exception whose __init__ needs arguments fails here
    except Exception:
        try:
            state = dict(getattr(exc, "__dict__", {}))
            state.pop("__traceback__", None)
            blob = dumps_value(
                _Reduced(_rebuild_without_init, (type(exc), exc.args, state, tb))
            )
        except Exception:
            blob = None
    return pickle.dumps((blob, name, message, tb), protocol=_PROTOCOL)


def decode_failure(raw: bytes) -> BaseException:
    """The exception :func:`encode_failure` sent: the original type when this
    process can rebuild it, else a :class:`RemoteTaskError`."""
    blob, name, message, tb = pickle.loads(raw)
    if blob is not None:
        try:
            exc = pickle.loads(blob)
            if isinstance(exc, BaseException):
                return exc
        except Exception:
            pass
    return _rebuild(RemoteTaskError(name, message, tb), tb)


class _Reduced:
    """Pickles as ``func(*args)``."""

    __slots__ = ("func", "args")

    def __init__(self, func, args):
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args
