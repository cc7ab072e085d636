"""Unmodified stdlib programs (examples/legacy/) give the same output under
fiber_dask, with the import swapped, and leave no process behind."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import uuid

import psutil
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LEGACY = os.path.join(ROOT, "examples", "legacy")
PROGRAMS = sorted(f for f in os.listdir(LEGACY) if f.endswith(".py"))

pytestmark = pytest.mark.timeout(180)


def swap_import(source: str) -> str:
    """The one-line change a user makes: multiprocessing -> fiber_dask."""
    source = re.sub(
        r"^import multiprocessing as (\w+)$",
        r"import fiber_dask as \1",
        source,
        flags=re.M,
    )
    source = re.sub(
        r"^import multiprocessing$",
        "import fiber_dask as multiprocessing",
        source,
        flags=re.M,
    )
    return re.sub(
        r"^from multiprocessing import ", "from fiber_dask import ", source, flags=re.M
    )


def processes_with(marker: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("FIBER_LEGACY_MARKER") == marker:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return found


def run(path: str) -> str:
    marker = uuid.uuid4().hex
    env = dict(os.environ, FIBER_LEGACY_MARKER=marker)
    env.pop("DASK_SCHEDULER_ADDRESS", None)
    result = subprocess.run(
        [sys.executable, path],
        capture_output=True,
        text=True,
        timeout=150,
        env=env,
        cwd=os.path.dirname(path),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    # Nothing the program started may outlive it (workers, manager servers).
    deadline = time.monotonic() + 15
    while (left := processes_with(marker)) and time.monotonic() < deadline:
        time.sleep(0.2)
    for proc in left:
        proc.kill()
    assert not left, [" ".join(p.cmdline()) for p in left]
    return result.stdout


@pytest.mark.parametrize("program", PROGRAMS)
def test_same_output_under_stdlib_and_fiber_dask(program, tmp_path):
    original = os.path.join(LEGACY, program)
    with open(original) as f:
        source = f.read()
    swapped = swap_import(source)
    assert swapped != source and "fiber_dask" in swapped
    assert not re.search(r"^(import|from) multiprocessing\b", swapped, re.M)
    copy = tmp_path / program
    copy.write_text(swapped)
    expected = run(original)
    assert expected.strip(), "the stdlib run printed nothing"
    assert run(str(copy)) == expected
