"""Run CPython's own multiprocessing tests against fiber-dask and the stdlib.

    python tests/cpython/run.py                 # both, then the table
    python tests/cpython/run.py --only fiber WithProcessesTestLock TestWait
    python tests/cpython/run.py --results DIR   # keep the JSON lines in DIR
    python tests/cpython/run.py --results DIR --rerun --only fiber CLASS...

The tests are the running interpreter's ``test._test_multiprocessing`` (install
the ``test`` package if ``python -c "import test._test_multiprocessing"`` fails),
built as ``test_multiprocessing_spawn`` builds them (see suite.py): the
``WithProcessesTest*`` and ``WithManagerTest*`` classes and the module-level
TestCases, 60 s per test.  Against fiber-dask they run under
``fiber-dask run --swap-multiprocessing`` with ``fiber.run.swap-modules: [test]``,
so the test module's ``import multiprocessing`` is fiber_dask.

A run that dies (a test stuck past its limit in code no signal can interrupt,
or a crash) is recorded at the test it died in, and the run goes on with the
next class.  It takes minutes and is CPU-heavy: it is not part of the pytest run
(tests/test_cpython_suite.py runs a fast subset).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
SUITE = os.path.join(HERE, "suite.py")
CONFIG = (
    "fiber:\n  run:\n    swap-multiprocessing: true\n"
    "    swap-modules: [test, mp_spawn_tests]\n"
)


def _command(target: str, workdir: str) -> list[str]:
    if target == "stdlib":
        return [sys.executable, SUITE]
    config = os.path.join(workdir, "swap.yaml")
    with open(config, "w") as f:
        f.write(CONFIG)
    return [sys.executable, "-m", "fiber_dask.cli", "run", "--config", config, SUITE]


def _read(path: str) -> tuple[dict, list, tuple | None, bool]:
    """plan {class: [tests]}, result records, the test started last, done?"""
    plan: dict[str, list[str]] = {}
    results: list[dict] = []
    started = None
    done = False
    if not os.path.exists(path):
        return plan, results, started, done
    with open(path) as f:
        for line in f:
            try:
                r = json.loads(line)
            except ValueError:
                continue  # a line cut short by the process dying
            if r["event"] == "plan":
                plan[r["cls"]] = r["tests"]
            elif r["event"] == "start":
                started = (r["cls"], r["test"])
            elif r["event"] == "result":
                results.append(r)
            elif r["event"] == "done":
                done = True
    return plan, results, started, done


def run_target(target: str, classes: list[str], timeout: int, out: str) -> None:
    """Run the suite for ``target`` ("stdlib" or "fiber"), appending to ``out``."""
    workdir = os.path.dirname(out)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [ROOT, HERE] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    )
    # Listing first gives the plan (every class and test), in a process of its own.
    subprocess.run(
        [sys.executable, SUITE, "--list", "--out", out, *classes],
        env=env, check=True, cwd=workdir,
    )  # fmt: skip
    plan, _, _, _ = _read(out)
    todo = [c for c in plan if not classes or c in classes]
    while todo:
        log = open(out + ".log", "a")
        started_at = time.monotonic()
        cmd = _command(target, workdir) + ["--out", out, "--timeout", str(timeout)]
        proc = subprocess.run(
            cmd + todo, env=env, cwd=workdir, stdout=log, stderr=subprocess.STDOUT
        )
        log.close()
        _, _, stuck, done = _read(out)
        if done and proc.returncode == 0:
            return
        # Died: record the test it died in, go on with the next class.
        if stuck is None or stuck[0] not in todo:
            return
        with open(out, "a") as f:
            f.write(json.dumps({
                "event": "result", "cls": stuck[0], "test": stuck[1],
                "outcome": "crash",
                "seconds": round(time.monotonic() - started_at, 1),
                "detail": f"the run died in this test (exit {proc.returncode}); "
                f"see {out}.log",
            }) + "\n")  # fmt: skip
        todo = todo[todo.index(stuck[0]) + 1 :]


def _summary(path: str) -> tuple[dict, dict]:
    plan, results, _, _ = _read(path)
    outcome: dict[tuple[str, str], dict] = {}
    for r in results:
        key = (r["cls"], r["test"])
        prev = outcome.get(key)
        # A subtest failure or a fixture error decides the test's outcome.
        if prev is None or prev["outcome"] in ("pass", "skip"):
            outcome[key] = r
    return plan, outcome


def table(paths: dict[str, str]) -> str:
    """The per-class table, as Markdown."""
    summaries = {t: _summary(p) for t, p in paths.items()}
    plan: dict[str, list[str]] = {}
    for p, _ in summaries.values():
        for cls, tests in p.items():
            plan.setdefault(cls, tests)
    targets = list(paths)
    head = "| class | tests | " + " | ".join(f"{t} pass (skip)" for t in targets) + " |"
    lines = [head, "|---|---:|" + "---:|" * len(targets)]
    totals = collections.Counter()
    for cls in sorted(plan):
        tests = plan[cls]
        cells = []
        for t in targets:
            _, outcome = summaries[t]
            fixture = outcome.get((cls, "<fixture>"))
            n_pass = n_skip = 0
            for name in tests:
                r = outcome.get((cls, name))
                if r is None or (
                    fixture and fixture["outcome"] not in ("pass", "skip")
                ):
                    continue
                n_pass += r["outcome"] == "pass"
                n_skip += r["outcome"] == "skip"
            totals[t, "pass"] += n_pass
            totals[t, "skip"] += n_skip
            cells.append(f"{n_pass} ({n_skip})" if n_skip else f"{n_pass}")
        totals["tests"] += len(tests)
        lines.append(f"| {cls} | {len(tests)} | " + " | ".join(cells) + " |")
    cells = []
    for t in targets:
        cells.append(f"**{totals[t, 'pass']}** ({totals[t, 'skip']})")
    lines.append(f"| **total** | **{totals['tests']}** | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def differences(std: str, fiber: str) -> str:
    """The tests that pass on the stdlib and not on fiber-dask, with the error."""
    _, s = _summary(std)
    plan, f = _summary(fiber)
    rows = []
    for cls in sorted(plan):
        for name in plan[cls]:
            sr, fr = s.get((cls, name)), f.get((cls, name))
            if sr is None or sr["outcome"] != "pass":
                continue
            if fr is not None and fr["outcome"] == "pass":
                continue
            fixture = f.get((cls, "<fixture>"))
            if fr is None and fixture is not None:
                fr = fixture
            what = "not run" if fr is None else fr["outcome"]
            detail = "" if fr is None else (fr.get("detail") or "").strip()
            last = detail.splitlines()[-1] if detail else ""
            rows.append(f"{cls}.{name}: {what}: {last[:200]}")
    return "\n".join(rows)


def _forget(path: str, classes: set[str]) -> None:
    """Drop the records of ``classes`` from a results file (for --rerun)."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        lines = f.readlines()
    with open(path, "w") as f:
        for line in lines:
            try:
                r = json.loads(line)
            except ValueError:
                continue
            if r.get("cls") not in classes or r["event"] == "plan":
                f.write(line)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("stdlib", "fiber"), help="one target only")
    parser.add_argument("--timeout", type=int, default=60, help="seconds per test")
    parser.add_argument("--results", help="directory for the JSON lines (kept)")
    parser.add_argument(
        "--table-only",
        action="store_true",
        help="print the table of the results already in --results",
    )
    parser.add_argument(
        "--rerun",
        action="store_true",
        help="run CLASSES again, replacing their results in --results",
    )
    parser.add_argument("classes", nargs="*", help="test classes (default: all)")
    args = parser.parse_args()  # fmt: skip

    workdir = args.results or tempfile.mkdtemp(prefix="fiber-cpython-")
    os.makedirs(workdir, exist_ok=True)
    targets = [args.only] if args.only else ["stdlib", "fiber"]
    paths = {t: os.path.join(workdir, f"{t}.jsonl") for t in targets}
    if not args.table_only:
        for t in targets:
            if args.rerun and args.classes:
                _forget(paths[t], set(args.classes))
            elif os.path.exists(paths[t]):
                os.unlink(paths[t])
            began = time.monotonic()
            run_target(t, args.classes, args.timeout, paths[t])
            print(f"{t}: {time.monotonic() - began:.0f} s", file=sys.stderr)
    print(table(paths))
    if len(targets) == 2:
        print("\npass on the stdlib, not on fiber-dask:")
        print(differences(paths["stdlib"], paths["fiber"]) or "(none)")
    print(f"\nresults: {workdir}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
