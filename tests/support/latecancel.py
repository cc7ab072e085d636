"""A cancel that comes late, made to happen every time.

The second half of a cancel (``PoolEngine._end_cancelled``, a second after a
blocking call was interrupted) takes a loop's first unanswered chunk for the
one it runs.  Forced here under the engine's lock, which the owner needs to
read an answer: the cancelled job's chunk ends, its answer stays unread, and
the slot process starts the next job's chunk; then the cancel's second half
runs.
"""

from __future__ import annotations

import os
from typing import Any

from tasks.poolcore import counted_until_told

from .wait import wait_until


def _holds(engine: Any, job: Any) -> bool:
    with engine._lock:
        return any(
            c.job is job for p in engine._peers.values() for c in p.inflight.values()
        )


#: Pool settings for :func:`cancel_after_the_slot_moved_on`: chunks of a
#: measured function are sent ahead however slow a loaded machine makes it.
SEND_AHEAD = {"fiber.pool.prefetch": "30s"}


def cancel_after_the_slot_moved_on(pool: Any, directory: str) -> tuple[Any, int]:
    """On a one-slot ``pool`` made under :data:`SEND_AHEAD`: job A (item 0 of
    ``counted_until_told``) is
    cancelled late, after its slot process went on to job B (item 1, which
    waits for the file ``go-1`` in ``directory``).  Returns B's result and
    the pid of the slot process that runs it."""
    d, engine = directory, pool._engine

    def started(x: int) -> str:
        return os.path.join(d, f"started-{x}")

    # Measured short, the function's next chunks are sent ahead to a busy
    # loop (an unmeasured one's wait for an answer first).
    open(os.path.join(d, "go-9"), "w").close()
    assert pool.starmap(counted_until_told, [(9, d)] * 4, chunksize=1) == [9] * 4
    a = pool.apply_async(counted_until_told, (0, d))
    b = pool.apply_async(counted_until_told, (1, d))
    wait_until(lambda: os.path.exists(started(0)), what="the first job to start")
    wait_until(
        lambda: _holds(engine, b),
        what="the second job's chunk sent to the slot behind the first's",
    )
    with engine._lock:
        open(os.path.join(d, "go-0"), "w").close()
        wait_until(lambda: os.path.exists(started(1)), what="the second job to start")
        with open(started(1)) as f:
            ran_b = int(f.read())
        a._fail(KeyboardInterrupt())
        engine._end_cancelled(a)
    return b, ran_b
