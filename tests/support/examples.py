"""What the tests of examples/ share: running one as a user would, and checking
the PNG files and the ``--help`` texts they produce."""

from __future__ import annotations

import os
import re
import struct
import subprocess
import sys
import zlib

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(ROOT, "examples")


def example_env() -> dict:
    """The embedded local cluster with 2 workers, whatever this shell points at."""
    env = {k: v for k, v in os.environ.items() if k != "DASK_SCHEDULER_ADDRESS"}
    env["DASK_FIBER__LOCAL__N_WORKERS"] = "2"
    return env


def run_example(name: str, *args: str, status: int = 0, timeout: float = 240) -> str:
    """Run ``python examples/<name> args...``; check its exit status; return stdout."""
    proc = subprocess.run(
        [sys.executable, os.path.join(EXAMPLES, name), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=example_env(),
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == status, out[-3000:]
    return proc.stdout


def assert_png(path: str, min_size: tuple[int, int] = (200, 150)) -> tuple[int, int]:
    """``path`` is a complete PNG (signature, chunk CRCs, pixel data that
    decompresses to the size its header gives) of at least ``min_size``;
    returns (width, height)."""
    with open(path, "rb") as f:
        data = f.read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    at, chunks = 8, []
    while at < len(data):
        (length,) = struct.unpack(">I", data[at : at + 4])
        kind, body = data[at + 4 : at + 8], data[at + 8 : at + 8 + length]
        (crc,) = struct.unpack(">I", data[at + 8 + length : at + 12 + length])
        assert zlib.crc32(kind + body) == crc, f"bad CRC in {kind!r} of {path}"
        chunks.append((kind, body))
        at += 12 + length
    assert chunks[0][0] == b"IHDR" and chunks[-1][0] == b"IEND", path
    width, height, depth, colour = struct.unpack(">IIBB", chunks[0][1][:10])
    channels = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}[colour]
    pixels = zlib.decompress(b"".join(b for k, b in chunks if k == b"IDAT"))
    assert len(pixels) == height * (1 + width * channels * depth // 8), path
    assert width >= min_size[0] and height >= min_size[1], (width, height)
    return width, height


def example_scripts_with_options() -> list[str]:
    """Every script under examples/ that parses command-line options."""
    found = []
    for folder, _, files in os.walk(EXAMPLES):
        for name in sorted(files):
            path = os.path.join(folder, name)
            if name.endswith(".py") and "argparse" in open(path).read():
                found.append(os.path.relpath(path, EXAMPLES))
    return sorted(found)


MARKUP = re.compile(r"``|:[a-z]+:`|`[^`\n]+`_")  # rST literals, roles, links


def help_entries(text: str) -> dict[str, str]:
    """``--help`` output's options, each with its help text on one line."""
    body = text.split("\noptions:\n", 1)[1].split("\n\n", 1)[0]
    entries: dict[str, str] = {}
    name = None
    for line in body.splitlines():
        m = re.match(r"  (-[^ ,]+(?:, -[^ ,]+)*)(.*)", line)
        if m:
            name = m.group(1).split(", ")[-1]
            entries[name] = m.group(2).strip()
        elif name is not None:
            entries[name] += " " + line.strip()
    return entries
