"""A test's program, run as a user runs it: a fresh interpreter with only the
fiber-dask and Dask settings the test gives it in its environment (none of the
suite's ``DASK_*``), reporting what it saw as one line ``RESULT <json>``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

__all__ = ["run_reporting"]


def run_reporting(
    script: Path,
    *args: Any,
    settings: dict[str, str] | None = None,
    timeout: float = 100,
) -> tuple[dict, str]:
    """Run ``script`` with ``args`` in its own folder and ``settings`` (Dask
    environment variables); its last ``RESULT`` line's JSON and its stderr.
    Fails, showing its output, if it exits non-zero or reports nothing."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DASK_")}
    env.update(settings or {})
    proc = subprocess.run(
        [sys.executable, str(script), *map(str, args)],
        env=env,
        cwd=script.parent,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout + proc.stderr[-5000:]
    return json.loads(lines[-1][len("RESULT ") :]), proc.stderr
