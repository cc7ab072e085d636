"""Stand-in ``__main__`` for processes spawned under ``fiber-dask run --swap-multiprocessing``.

``multiprocessing``'s spawn start method (which distributed uses for its worker
processes) starts a child by re-importing the parent's main module.  With the swap
on, ``fiber-dask run`` gives the script's ``__main__`` a ``__spec__`` naming this
module, so a spawned child imports *this* first (as ``__mp_main__``): it installs the
swap from the environment the child inherited (:data:`fiber_dask.swap.ENV_VAR`) and
only then runs the script as ``__mp_main__``, exactly as spawn would have without us.
Without that order, the script's top-level ``import helper`` would bind ``helper``'s
``multiprocessing`` to the stdlib in every worker before any plugin could step in.

Importing this module anywhere else does nothing beyond activating a swap that the
environment asks for.
"""

from __future__ import annotations

import os as _os

from fiber_dask import swap as _swap

_swap.install_from_environ()

if __name__ == "__mp_main__":
    _script = _os.environ.get(_swap.MAIN_ENV_VAR)
    if _script:
        import runpy as _runpy

        globals().update(_runpy.run_path(_script, run_name="__mp_main__"))
