"""The examples run end to end on the embedded default and do what they claim."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.timeout(300)
def test_es_cartpole_solves_the_task():
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "examples", "es_cartpole.py"),
            "--population",
            "32",
            "--iterations",
            "60",
        ],
        capture_output=True,
        text=True,
        timeout=280,
        env={**os.environ, "DASK_FIBER__LOCAL__N_WORKERS": "2"},
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("solved: reward"), last
    reward = float(last.split("reward")[1].split()[0])
    assert reward >= 475.0
