"""The check that a script run by ``fiber-dask run`` may start the embedded cluster.

The embedded cluster's worker processes are started with multiprocessing's
``spawn`` method, which re-imports the main script (as ``__mp_main__``) in each of
them.  A script without ``if __name__ == "__main__":`` that starts a cluster at its
top level would start one again in every worker; each fails with the stdlib's
bootstrapping error, and the user gets some 130 lines of worker tracebacks ending
in ``Nanny failed to start``.

``fiber-dask run`` knows the script's source before running it: for a script (or
``-m`` module) with no such guard, it marks the time its top level runs with
:func:`unguarded`, and the cluster layer calls :func:`check` just before it would
start the embedded cluster.  Then the program stops at once with one message that
names the line.  Clusters that do not import the script (``fiber-dask up``, an
address, Kubernetes) are unaffected, and so are scripts read from stdin, which no
worker imports.
"""

from __future__ import annotations

import ast
import contextlib
import sys
from collections.abc import Iterator

__all__ = ["MainGuardError", "check", "has_main_guard", "unguarded"]

# The script whose top level is running now without a main guard, or None.
_current: str | None = None


class MainGuardError(RuntimeError):
    """The embedded cluster was about to start from an unguarded script's top level."""


def has_main_guard(source: str | bytes) -> bool:
    """Whether the module's top level has an ``if`` that tests ``__name__``
    against ``"__main__"`` (in either order, ``==`` or ``!=``)."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return True  # compile() reports it; do not guess
    for node in tree.body:
        if not isinstance(node, ast.If):
            continue
        names = {n.id for n in ast.walk(node.test) if isinstance(n, ast.Name)}
        consts = {n.value for n in ast.walk(node.test) if isinstance(n, ast.Constant)}
        if "__name__" in names and "__main__" in consts:
            return True
    return False


@contextlib.contextmanager
def unguarded(path: str) -> Iterator[None]:
    """Mark the run of ``path``'s top level (a script with no main guard)."""
    global _current
    _current = path
    try:
        yield
    finally:
        _current = None


def check() -> None:
    """Raise :class:`MainGuardError` if an unguarded script's top level is running.

    Raises
    ------
    MainGuardError
        Naming the script and, when it is on the stack, the line that asked for
        the cluster.
    """
    path = _current
    if path is None:
        return
    where = path
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename == path:
            where = f"{path}, line {frame.f_lineno}"
            break
        frame = frame.f_back
    raise MainGuardError(
        f"{where}: the embedded cluster would start from the top level of a "
        "script that has no `if __name__ == '__main__':` guard. Its worker "
        "processes import the script, as multiprocessing's spawn method does, and "
        "would run that code again. Put the code that starts work under "
        "`if __name__ == '__main__':`, or run on a cluster that does not import "
        "the script (`fiber-dask up`, --address)."
    )
