"""The pool's results: AsyncResult, MapResult and the imap iterators.

The caller's side of a Pool job (the stdlib keeps these in ``pool.py``).  A job
is cut into chunks; the pool's engine sends chunks to pool-worker loops and
calls ``_chunk_done`` from its single result thread.  Callbacks run there, once,
before ``ready()`` turns true, as in ``multiprocessing.pool``.

A job talks to its engine through three members only: ``job_finished(job)``,
``job_consumed()`` (an imap chunk was taken by the caller) and ``draining``.

Jobs also produce their chunks lazily (``_next_chunk``), which is how ``imap``
streams from any iterable with a bounded number of chunks in flight.

Chunking by measurement (:func:`measured_chunksize`, the one owner of that
rule): a ``map``/``starmap`` whose caller gave no ``chunksize`` (and no
``fiber.pool.chunksize`` is set) sizes each chunk when it is cut, from the
engine's running estimate of the function's seconds per item and the pool's
slot count.  The results, their order and the error semantics are the
stdlib's; only how many items travel together changes.
"""

from __future__ import annotations

import collections
import itertools
import threading
from multiprocessing import TimeoutError
from typing import Any, Callable, Iterable, Iterator

__all__ = [
    "measured_chunksize",
    "ApplyResult",
    "AsyncResult",
    "MapResult",
    "IMapIterator",
    "IMapUnorderedIterator",
]


#: Time budgeted per chunk and slot: a chunk should last at least ``slots x``
#: this, so that a pool's chunks come back at no more than about 250 a second
#: however many slots it has.  Each chunk costs CPU at both ends (dispatch,
#: pickling, the result's way back, the loop's receive and send): at 1024
#: thread slots sleeping 10 ms, 0.1 ms in the owner and 0.35 ms in the slot's
#: worker process, whose 128 slot threads contend for one GIL.  At 2e-4 (0.2 s
#: chunks, ~5,000 a second) that took the CPU the sleeping tasks' wake-ups
#: needed: 58-64 % of ideal for 4-10 s maps; at 1e-3 (1 s chunks, ~1,100 a
#: second, 0.5 of a core) a median of 76-77 %; at 4e-3 together with
#: ``CHUNKS_PER_SLOT = 1`` (~3,100 chunks for the map instead of ~5,500) a
#: median of 80-84 % (two A/B runs of 12 and 15 interleaved maps each,
#: benchmarks/RESULTS.md, session 9).  Below ~13 slots ``MIN_CHUNK_SECONDS``
#: decides instead.
CHUNK_SECONDS_PER_SLOT = 4e-3
#: A chunk lasts at least this long once its function has been measured.  The
#: owner and the slot spend some 0.3-0.5 ms of CPU on each chunk (dispatch,
#: pickling, the result's way back); where they share the cores with CPU-bound
#: tasks (the embedded cluster: slots, owner and cluster on one machine), that
#: is stolen from the tasks: 5 ms chunks of 10 ms CPU-bound tasks ran 1.08x the
#: stdlib's map on 2 cores (benchmarks/overhead.py --kinds cpu), 50 ms keep it
#: under 1 %.  The tail stays short: chunks shrink toward the end of the map.
MIN_CHUNK_SECONDS = 0.05
#: A chunk holds at most ``1 / (this x slots)`` of what is left to hand out,
#: OpenMP's ``schedule(guided)`` rule at 1: every slot gets work, and the
#: chunks shrink toward the end of the map, so that no slot is left with a
#: long last chunk while the others idle.  At 2 (half that) a map was cut
#: into twice as many shrinking chunks, ~2,800 of its ~5,500 at 1024 slots
#: and 409,600 items of 10 ms, for no better balance at the end.
CHUNKS_PER_SLOT = 1
#: ... but once fewer than this many items per slot are left, a chunk holds
#: at most half a slot's share (``left / (2 x slots)``): a map of a few long
#: tasks per slot (ES: 2048 evaluations of 0.2 s on 1024 slots) keeps them
#: in chunks of one, whose results come back as each ends; in one chunk of
#: two per slot every result came at the end, and the owner's handling of
#: 1024 answers at once lengthened each iteration by 25-40 ms (session 9).
FEW_ITEMS_PER_SLOT = 16
#: ... but a chunk of a measured function lasts at least this long, also at
#: the end of a map: a shorter one costs the owner and the slot more (a
#: message each way, ~50-100 us of CPU at a busy owner) than the idle time it
#: saves a slot (at most this).  It only matters for tasks of microseconds.
TAIL_SECONDS = 0.001
#: ... and holds at least ``1 / (this x slots)`` of the map's items: chunks
#: that shrink with what is left (``CHUNKS_PER_SLOT``) would otherwise cut the
#: map's last part into ever smaller ones, some ``slots x ln(items / slots)``
#: chunks (at 1024 slots and 102,400 items of 10 ms, thousands of chunks for
#: one second of work, most of them in the tail).  At 8 a map is cut into at most
#: about 8 chunks per slot beyond its first ones; the stdlib's rule cuts 4.
TAIL_CHUNKS_PER_SLOT = 8
#: A chunk's pickled arguments weigh at most this (or it holds one item), once
#: the engine has seen what the map's items weigh: a measured chunk of a fast
#: function over large arrays held 50 pieces of 3 MB (150 MB pickled at once in
#: the owner, and again in the slot), where the time rule alone decided.
CHUNK_BYTES = 4 * 2**20


def measured_chunksize(
    per_item: float | None,
    slots: int,
    left: int,
    total: int | None = None,
    item_bytes: float = 0,
) -> int:
    """Items in the next chunk of a map whose caller gave no chunksize.

    Parameters
    ----------
    per_item : float or None
        The function's measured seconds per item (a running average over its
        finished chunks, taken in the loop), None before any has finished.
    slots : int
        The pool's slots.
    left : int
        Items of the map not handed out yet.
    total : int, optional
        Items of the whole map.
    item_bytes : float, optional
        What an item's arguments weigh pickled (0: not known yet); a chunk
        then holds no more than ``CHUNK_BYTES`` of them, or one item.

    Returns
    -------
    int
        While the function is unmeasured, the stdlib's rule,
        ``ceil(total / (4 x slots))`` (``1`` when ``total`` is not known): at
        most one such chunk per slot is out before the first result, as the
        engine sends one chunk at a time of an unmeasured function, so a map
        starts as the stdlib's does and each slot asks for its next chunk by
        the measured rule.  (One-item chunks until a result came cost a fresh
        pool's first map of 200 x 10 ms items ~15 ms: a round trip per slot
        and slots out of step at the map's end; issue 30.)  Then enough items for the chunk to
        last ``max(MIN_CHUNK_SECONDS, slots x CHUNK_SECONDS_PER_SLOT)``, but
        no more than ``ceil(left / (CHUNKS_PER_SLOT x slots))`` (half that
        once fewer than ``FEW_ITEMS_PER_SLOT`` items per slot are left) or,
        if more, the items that last ``TAIL_SECONDS`` or ``ceil(total /
        (TAIL_CHUNKS_PER_SLOT x slots))``.

    Examples
    --------
    1024 slots and 10 ms tasks: chunks of about 4 s, 410 items (while over
    420,000 items are left), so the owner handles ~250 chunks a second
    instead of ~100,000 items; toward the end of a map of 102,400 items they
    shrink to 13 (1/8192 of it), not to 1.

    >>> measured_chunksize(0.01, 1024, 10**6, 10**6)
    410
    >>> measured_chunksize(0.01, 1024, 2000, 102400)
    13
    >>> measured_chunksize(0.2, 1024, 2048, 2048)
    1

    20,000 trivial tasks (0.1 us each) on 2 slots: two chunks, where the
    stdlib's rule cuts 8.

    >>> measured_chunksize(1e-7, 2, 20000)
    10000
    """
    by_bytes = int(CHUNK_BYTES // item_bytes) if item_bytes else left
    if per_item is None:
        if not total:
            return 1
        return int(max(1, min(-(-total // (4 * max(slots, 1))), left, by_bytes)))
    target = max(MIN_CHUNK_SECONDS, slots * CHUNK_SECONDS_PER_SLOT)
    # (rounded first: 0.005 / 1e-6 is 5000.000000000001 in floats)
    want = -(-round(target / max(per_item, 1e-9), 6) // 1)
    slots = max(slots, 1)
    per_slot = CHUNKS_PER_SLOT if left >= FEW_ITEMS_PER_SLOT * slots else 2
    cap = -(-left // (per_slot * slots))
    floor = round(TAIL_SECONDS / max(per_item, 1e-9), 6) // 1
    if total:
        floor = max(floor, -(-total // (TAIL_CHUNKS_PER_SLOT * slots)))
    return int(max(1, min(want, max(cap, floor), left, by_bytes)))


class _Job:
    """What the pool needs from every job."""

    #: 0: f(x), 1: f(*x), 2: f(*args, **kwds)
    mode = 0

    def __init__(self, engine: Any, func: Callable) -> None:
        self._engine = engine
        self._func = func
        self._chunk_index = 0
        self._exhausted = False
        #: Bytes an item's arguments weigh pickled, as the engine last saw
        #: them (0 until it has pickled a chunk of this job).
        self._item_bytes = 0.0

    def _next_chunk(self) -> tuple[int, list] | None:
        """The next chunk to send, or None when exhausted or held back."""
        raise NotImplementedError

    def _give_back(self, index: int, items: list) -> bool:
        """Take back the chunk ``_next_chunk`` just returned (no loop had room
        for it), so that its items are cut again when a loop has: whether it
        was taken back (else the engine holds the chunk as it is)."""
        return False

    def _first_item(self, index: int) -> int:
        """The position in the job's input of chunk ``index``'s first item."""
        return index * getattr(self, "_chunksize", 1)

    def _chunk_done(self, index: int, ok: bool, value: Any) -> None:
        raise NotImplementedError

    def _fail(self, exc: BaseException) -> None:
        """Fail the whole job (pool broken or terminated)."""
        raise NotImplementedError

    @property
    def _finished(self) -> bool:
        raise NotImplementedError


class ApplyResult(_Job):
    """The result of :meth:`Pool.apply_async`; same API as the stdlib's."""

    mode = 2

    def __init__(self, engine, func, args, kwds, callback, error_callback) -> None:
        super().__init__(engine, func)
        self._item = (tuple(args), dict(kwds))
        self._event = threading.Event()
        self._callback = callback
        self._error_callback = error_callback
        self._success: bool | None = None
        self._value: Any = None

    def __repr__(self) -> str:
        state = "ready" if self.ready() else "pending"
        return f"<{type(self).__module__}.{type(self).__qualname__} {state}>"

    def ready(self) -> bool:
        return self._event.is_set()

    def successful(self) -> bool:
        if not self.ready():
            raise ValueError(f"{self!r} not ready")
        return bool(self._success)

    def wait(self, timeout: float | None = None) -> None:
        self._event.wait(timeout)

    def get(self, timeout: float | None = None) -> Any:
        self.wait(timeout)
        if not self.ready():
            raise TimeoutError
        if self._success:
            return self._value
        raise self._value

    @property
    def _finished(self) -> bool:
        return self._event.is_set()

    def _next_chunk(self):
        if self._exhausted:
            return None
        self._exhausted = True
        return 0, [self._item]

    def _settle(self, ok: bool, value: Any) -> None:
        if self._event.is_set():
            return
        self._success, self._value = ok, value
        try:
            if ok and self._callback is not None:
                self._callback(value)
            if not ok and self._error_callback is not None:
                self._error_callback(value)
        finally:
            # A callback that raises is logged by the result thread; the
            # result itself must still become ready (the stdlib hangs here).
            self._event.set()
            self._engine.job_finished(self)

    def _chunk_done(self, index, ok, value):
        self._settle(ok, value[0] if ok else value)

    def _fail(self, exc):
        self._exhausted = True
        self._settle(False, exc)


AsyncResult = ApplyResult


class MapResult(ApplyResult):
    """The result of :meth:`Pool.map_async` / ``starmap_async``.

    Beyond the stdlib: :meth:`progress` says how much is done, for a progress
    bar that follows an asynchronous map.
    """

    def __init__(self, engine, func, items, chunksize, mode, callback, error_callback):
        super().__init__(engine, func, (), {}, callback, error_callback)
        self.mode = mode
        self._items = items
        #: None: chunks sized by measurement (measured_chunksize); a chunk's
        #: index is then the position of its first item (its size is 1 here).
        self._measured = chunksize is None
        self._chunksize = 1 if chunksize is None else chunksize
        self._next_start = 0  # the first item not handed out yet
        self._total = len(items)
        self._done_items = 0
        self._value = [None] * len(items)
        self._left = len(items)  # items whose results have not arrived
        if self._left == 0:
            # The stdlib sets an empty map ready at once, without callbacks.
            self._exhausted = True
            self._success = True
            self._event.set()

    def progress(self) -> tuple[int, int]:
        """``(done_items, total_items)``: items whose results have arrived.

        Grows chunk by chunk (a chunk's results arrive together).

        Examples
        --------
        >>> res = pool.map_async(f, range(1000))       # doctest: +SKIP
        >>> with tqdm.tqdm(total=res.progress()[1]) as bar:   # doctest: +SKIP
        ...     while not res.ready():
        ...         res.wait(0.2)
        ...         bar.n = res.progress()[0]
        ...         bar.refresh()
        """
        return self._done_items, self._total

    def _size(self) -> int:
        if not self._measured:
            return self._chunksize
        return self._engine.measured_chunksize(
            self._func,
            len(self._items) - self._next_start,
            self._total,
            self._item_bytes,
        )

    def _chunks_to_come(self) -> int:
        """Chunks not handed out yet (an estimate when sized by measurement)."""
        if self._items is None:
            return 0
        size = self._size()
        return -(-(len(self._items) - self._next_start) // size)

    def _next_chunk(self):
        if self._exhausted:
            return None
        start, size = self._next_start, self._size()
        chunk = self._items[start : start + size]
        self._chunk_index += 1
        self._next_start = start + size
        if self._next_start >= len(self._items):
            self._exhausted = True
            self._items = None  # the pool no longer needs the input
        return start // self._chunksize, chunk

    def _give_back(self, index, items):
        """A map sized by measurement takes back its last cut chunk, so that
        a chunk cut before the function was measured (the stdlib's size) is
        cut again by the measured rule once a loop is free; a fixed size
        gains nothing from it, nor the last chunk, whose input is dropped."""
        if not self._measured or self._exhausted:
            return False
        if index + len(items) != self._next_start:
            return False
        self._next_start = index
        self._chunk_index -= 1
        return True

    def _chunk_done(self, index, ok, value):
        if self._event.is_set():
            return
        if not ok:
            self._exhausted = True  # fail fast: send no more of this map
            self._settle(False, value)
            return
        start = index * self._chunksize
        self._value[start : start + len(value)] = value
        self._done_items += len(value)
        self._left -= len(value)
        if self._left == 0:
            self._settle(True, self._value)


class IMapIterator(_Job):
    """The iterator returned by :meth:`Pool.imap` (chunks delivered in order).

    Input is read lazily; at most ``max_in_flight`` chunks are taken from it and
    not yet consumed, so an endless generator streams in bounded memory.
    """

    _ordered = True

    def __init__(
        self,
        engine,
        func,
        iterable: Iterable,
        chunksize: int,
        mode: int,
        max_in_flight: int,
    ):
        super().__init__(engine, func)
        self.mode = mode
        self._source: Iterator = iter(iterable)
        self._chunksize = chunksize
        self._max_in_flight = max_in_flight
        self._cond = threading.Condition(threading.Lock())
        self._done: dict[int, tuple[bool, Any]] = {}
        self._unordered: collections.deque = collections.deque()
        self._items: collections.deque = collections.deque()  # of the current chunk
        self._next_index = 0  # next chunk to hand to the caller (ordered)
        self._consumed = 0
        self._received_count = 0
        self._held = False  # back-pressure stopped the input (under _cond)
        self._length: int | None = None
        self._input_error: tuple[int, BaseException] | None = None

    def __iter__(self):
        return self

    def _next_chunk(self):
        if self._exhausted:
            return None
        if not self._engine.draining:
            with self._cond:
                if self._chunk_index - self._consumed >= self._max_in_flight:
                    # Back-pressure: the caller has not caught up.  It lets
                    # the input go on once it has taken half of what is out
                    # (_take_chunk), so the pool refills the loops with
                    # several chunks at a time, not one per chunk taken.
                    self._held = True
                    return None
        i = self._chunk_index
        try:
            chunk = list(itertools.islice(self._source, self._chunksize))
        except Exception as e:
            # The stdlib reports an error raised by the input at its position.
            self._exhausted = True
            self._chunk_index += 1
            self._chunk_done(i, False, e)
            self._set_length(i + 1)
            return None
        if not chunk:
            self._exhausted = True
            self._set_length(i)
            return None
        self._chunk_index += 1
        return i, chunk

    def _set_length(self, n: int) -> None:
        with self._cond:
            self._length = n
            self._cond.notify_all()
            done = self._finished_locked()
        if done:
            self._engine.job_finished(self)

    def _finished_locked(self) -> bool:
        return self._length is not None and self._received_count >= self._length

    @property
    def _finished(self) -> bool:
        with self._cond:
            return self._finished_locked()

    def _chunk_done(self, index, ok, value):
        with self._cond:
            self._received_count += 1
            if self._ordered:
                self._done[index] = (ok, value)
            else:
                self._unordered.append((ok, value))
            self._cond.notify_all()
            done = self._finished_locked()
        if done:
            self._engine.job_finished(self)

    def _fail(self, exc):
        with self._cond:
            if self._length is None:
                self._length = self._chunk_index
            # Every chunk not yet received fails with exc.
            missing = self._length - self._received_count
            for _ in range(max(missing, 0)):
                self._received_count += 1
                self._unordered.append((False, exc))
            if self._ordered:
                for i in range(self._length):
                    if i >= self._next_index and i not in self._done:
                        self._done[i] = (False, exc)
            self._exhausted = True
            self._cond.notify_all()
        self._engine.job_finished(self)

    def _take_chunk(self, timeout: float | None) -> tuple[bool, Any]:
        with self._cond:
            while True:
                if self._ordered:
                    got = self._done.pop(self._next_index, None)
                    if got is not None:
                        self._next_index += 1
                        break
                    if self._length is not None and self._next_index >= self._length:
                        raise StopIteration
                else:
                    if self._unordered:
                        got = self._unordered.popleft()
                        self._next_index += 1
                        break
                    if self._length is not None and self._next_index >= self._length:
                        raise StopIteration
                if not self._cond.wait(timeout):
                    raise TimeoutError
            self._consumed += 1
            resume = (
                self._held
                and self._chunk_index - self._consumed <= self._max_in_flight // 2
            )
            if resume:
                self._held = False
        if resume:
            self._engine.job_consumed()
        return got

    def next(self, timeout: float | None = None) -> Any:
        """The next result; ``multiprocessing.TimeoutError`` after ``timeout`` s."""
        if self._items:
            return self._items.popleft()
        while True:
            ok, value = self._take_chunk(timeout)
            if not ok:
                raise value
            if value:
                self._items.extend(value)
                return self._items.popleft()

    __next__ = next


class IMapUnorderedIterator(IMapIterator):
    """The iterator returned by :meth:`Pool.imap_unordered` (completion order)."""

    _ordered = False
