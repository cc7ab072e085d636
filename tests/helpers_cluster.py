"""Clusters for tests that need one of their own (not the session's embedded one)."""

from __future__ import annotations

from distributed import LocalCluster


def loopback_cluster(n_workers: int) -> LocalCluster:
    """A LocalCluster of worker processes, one thread each, on 127.0.0.1 only."""
    return LocalCluster(
        n_workers=n_workers,
        threads_per_worker=1,
        processes=True,
        dashboard_address=None,
        host="127.0.0.1",
    )
