"""fiber-dask: Python's ``multiprocessing`` API on a Dask cluster.

``import fiber_dask as multiprocessing`` and run the same code on a laptop, an
existing Dask scheduler, or an adaptive Kubernetes deployment.
"""

from __future__ import annotations

from multiprocessing import (
    AuthenticationError,
    BufferTooShort,
    ProcessError,
    TimeoutError,
)

from . import config  # noqa: F401  (loads the fiber.* defaults into dask.config)
from .cluster import get_client, init, shutdown
from .context import DaskContext, default_context, get_context
from .errors import (
    ClusterConnectionError,
    ManagerConnectionError,
    PoolTerminatedError,
    WorkerLostError,
)
from .launch import childsetup
from .launch.mainglobals import keep_code_filenames
from .meta import meta

keep_code_filenames()  # tracebacks from children and workers name the real file


def _swap_from_environ() -> None:
    # Under `fiber-dask run --swap-multiprocessing` a child's modules must get
    # fiber_dask as their multiprocessing, as they do on the worker: the spec
    # arrives in the environment the child inherited.
    from . import swap

    swap.install_from_environ()


def _import_swap() -> None:
    from . import swap  # noqa: F401


childsetup.register(_swap_from_environ, preload=_import_swap)

__version__ = "0.1.0"

__all__ = [
    "AuthenticationError",
    "BufferTooShort",
    "ProcessError",
    "TimeoutError",
    "ClusterConnectionError",
    "ManagerConnectionError",
    "PoolTerminatedError",
    "WorkerLostError",
    "DaskContext",
    "get_context",
    "get_client",
    "init",
    "meta",
    "shutdown",
]

# The top level is the default context's bound methods, as in multiprocessing.
_ctx = default_context
for _name in (
    "Pool",
    "ThreadPool",
    "cpu_count",
    "current_process",
    "active_children",
    "parent_process",
    "get_start_method",
    "Process",
    "Queue",
    "SimpleQueue",
    "JoinableQueue",
    "Pipe",
    "Manager",
    "Lock",
    "RLock",
    "Semaphore",
    "BoundedSemaphore",
    "Event",
    "Condition",
    "Barrier",
    "Value",
    "Array",
    "RawValue",
    "RawArray",
    "get_all_start_methods",
    "set_start_method",
    "freeze_support",
    "set_executable",
    "set_forkserver_preload",
    "allow_connection_pickling",
    "log_to_stderr",
    "get_logger",
):
    globals()[_name] = getattr(_ctx, _name)
    __all__.append(_name)
del _name
reducer = _ctx.reducer
__all__.append("reducer")

# Last of all: in a Dask worker process of the embedded cluster, fork the
# pool-slot template now, with fiber_dask imported and the process still
# single-threaded (fiber_dask.engine.slots.start_early).
from .engine import slots as _slots  # noqa: E402

_slots.start_early()
