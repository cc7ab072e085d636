"""The user's side of tests/test_ring_crosshost.py: run on the client host.

``python crosshost_ring_client.py <scenario> '<json params>'`` runs a Ring of
4 whose members each ask for the Dask resource ``ring: 1`` (the worker hosts
have 2 each, so they share the ring) and all-reduce their ranks with
``support/ringreduce.py``'s socket collective, across hosts.  One JSON line
per observation (``{"event": ...}``), as ``crosshost_client.py`` prints them.

Scenarios: ``reduce`` (the ring runs to the end) and ``hang`` (rank 0 never
sends, so everyone waits in the collective until the test kills a host; the
script reports the RingError).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback

from fiber_dask import cluster
from fiber_dask.experimental import Ring, RingError
from support import stackdump
from support import ringreduce


def emit(event: str, **data) -> None:
    print(json.dumps({"event": event, **data}, default=repr), flush=True)


def main() -> dict:
    scenario, params = sys.argv[1], json.loads(sys.argv[2])
    hang = 0 if scenario == "hang" else None
    ring = Ring(
        4,
        ringreduce.AllReduce(params["markers"], hang_rank=hang),
        ringreduce.connect,
        resources={"ring": 1},
    )
    out = {"listen_host": cluster.listen_host(resolve_cluster=True)}
    started = time.monotonic()
    try:
        out["results"] = ring.run()
    except RingError as e:
        out["error"] = {
            "message": str(e),
            "rank": e.rank,
            "host": e.host,
            "exitcode": e.exitcode,
            "cause": e.cause,
        }
    out["seconds"] = round(time.monotonic() - started, 2)
    out["members"] = [[m.rank, m.ip, m.port] for m in ring.members]
    return out


if __name__ == "__main__":
    stackdump.install()  # where it hangs, if a test gives up on it
    signal.signal(signal.SIGTERM, lambda *a: os._exit(1))
    try:
        result = main()
    except BaseException:
        emit("error", traceback=traceback.format_exc())
        raise SystemExit(1) from None
    emit("result", **result)
