"""Scheduler preload for Kubernetes clusters that have extra worker groups.

The dask-kubernetes operator's autoscaler resizes only the ``default`` worker
group, but to scale it down it asks the scheduler which workers to retire
(``/api/v1/retire_workers``), and the scheduler picks among *all* workers: it
may retire a GPU worker, whose pod the operator then deletes although the GPU
group was never meant to shrink (and nothing recreates it).

This module, preloaded into the scheduler (``fiber.kubernetes.worker-groups``
does that through ``DASK_DISTRIBUTED__SCHEDULER__PRELOAD``), adds a scheduler
plugin that offers only the default group's workers for removal, recognised by
the name the operator gives them (``<cluster>-default-worker-<id>``, in
``FIBER_DASK_DOWNSCALE_PREFIX``).
"""

from __future__ import annotations

import os
from typing import Any

from distributed.diagnostics.plugin import SchedulerPlugin

__all__ = ["DefaultGroupDownscaling", "PREFIX_ENV", "dask_setup"]

#: Environment variable naming the prefix of the workers that may be retired.
PREFIX_ENV = "FIBER_DASK_DOWNSCALE_PREFIX"


class DefaultGroupDownscaling(SchedulerPlugin):
    """Only workers whose name starts with ``prefix`` may be scaled down."""

    name = "fiber-dask-default-group-downscaling"

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix

    def valid_workers_downscaling(self, scheduler: Any, workers: list) -> list:
        return [ws for ws in workers if str(ws.name).startswith(self.prefix)]


def dask_setup(scheduler: Any) -> None:
    """Preload hook: install the plugin if the prefix is configured."""
    prefix = os.environ.get(PREFIX_ENV)
    if prefix:
        scheduler.add_plugin(DefaultGroupDownscaling(prefix))
