"""examples/pbt.py at a reduced size: PBT must beat the same population
trained without exploit/explore, and reach near the optimum."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.timeout(180)
def test_pbt_example_exploits_and_beats_the_fixed_grid():
    result = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "examples", "pbt.py"),
            "--population",
            "4",
            "--steps",
            "120",
        ],
        capture_output=True,
        text=True,
        timeout=170,
        env={k: v for k, v in os.environ.items() if k != "DASK_SCHEDULER_ADDRESS"},
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "copied member" in result.stdout  # exploit happened, through the board
    best = re.search(
        r"^best: member \d+ Q=([\d.]+) .*without PBT ([\d.-]+)", result.stdout, re.M
    )
    assert best, result.stdout[-2000:]
    score, plain = float(best.group(1)), float(best.group(2))
    assert plain < 0.5  # a fixed h = (1, 0) or (0, 1) never trains both weights
    assert score > 1.0  # PBT gets near the optimum 1.2
