"""Which of fiber_dask's modules a module brings with it, seen in a fresh interpreter.

``import fiber_dask.config`` runs ``fiber_dask/__init__.py`` first, which
imports half the package, so ``sys.modules`` after it says nothing about what
``config.py`` itself needs.  :func:`import_alone` imports the module with its
parent packages replaced by empty ones (their ``__path__`` only, no
``__init__.py`` run): whatever else of fiber_dask is then loaded, the module
imported, directly or through the modules it imports.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

__all__ = ["import_alone"]

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_PROBE = """
import importlib, json, sys, types
module, then, repo = sys.argv[1], sys.argv[2], sys.argv[3]
parts = module.split(".")
for i in range(1, len(parts)):
    name = ".".join(parts[:i])
    package = types.ModuleType(name)
    package.__path__ = [repo + "/" + name.replace(".", "/")]
    sys.modules[name] = package
imported = importlib.import_module(module)
if then:
    exec(then, {"module": imported})
print(json.dumps(sorted(sys.modules)))
"""


def import_alone(module: str, then: str = "") -> set[str]:
    """Import ``module`` (``"fiber_dask.config"``) alone in a fresh interpreter,
    run ``then`` there (``module`` is the imported module), and return the names
    of every module loaded at the end, its stand-in parent packages included."""
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_PROBE), module, then, REPO],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr
    return set(json.loads(result.stdout))
