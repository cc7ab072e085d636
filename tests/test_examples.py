"""The examples run end to end, in a reduced size, and do what they claim.

Each runs as its own ``python`` process on the embedded default (2 workers), as
a user would run it; the tests read the result from its output, not only the
exit status.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")


def run_example(name: str, *args: str, status: int = 0, timeout: float = 240) -> str:
    """Run ``examples/<name>``; check its exit status; return its stdout."""
    proc = subprocess.run(
        [sys.executable, os.path.join(EXAMPLES, name), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env={**os.environ, "DASK_FIBER__LOCAL__N_WORKERS": "2"},
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == status, out[-3000:]
    return proc.stdout


def load_es():
    spec = importlib.util.spec_from_file_location("es_example", f"{EXAMPLES}/es.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_builtin_cartpole_follows_gymnasium():
    """The numpy-only fallback is Gymnasium's CartPole-v1: same start states,
    same trajectories, same termination and time limit."""
    pytest.importorskip("gymnasium")  # in the `test` extra
    es = load_es()
    rng = np.random.default_rng(0)
    lengths = set()
    for trial in range(6):
        params = rng.standard_normal(5)
        if trial == 0:
            params = np.array([0.0, 0.0, 1.0, 1.0, 0.0])  # balances: hits the limit
        gym, ours = es.make_env("gymnasium"), es.make_env("builtin")
        for seed in range(4):
            obs_g, _ = gym.reset(seed=seed)
            obs_o, _ = ours.reset(seed=seed)
            assert np.array_equal(obs_g, obs_o)
            steps = 0
            while True:
                a = es.act(params, 0, obs_g)
                obs_g, r_g, term_g, trunc_g, _ = gym.step(a)
                obs_o, r_o, term_o, trunc_o, _ = ours.step(a)
                steps += 1
                np.testing.assert_allclose(obs_o, obs_g, rtol=1e-6, atol=1e-6)
                assert (r_o, term_o, trunc_o) == (r_g, term_g, trunc_g), steps
                if term_g or trunc_g:
                    break
            lengths.add(steps)
    assert 500 in lengths and min(lengths) < 500  # both endings were compared


FINAL_ES = re.compile(
    r"^(solved|not solved): mean reward ([\d.]+) over (\d+) episodes "
    r"\(first iteration ([\d.]+)\) after (\d+) iterations",
    re.M,
)
ITERATION = re.compile(
    r"^iter +(\d+) +reward +([\d.]+) +population mean +([\d.]+) max +(\d+)", re.M
)


@pytest.mark.timeout(300)
def test_es_solves_cartpole_on_the_embedded_cluster():
    out = run_example("es.py", "--env", "gymnasium", "--final-episodes", "50")
    assert "CartPole-v1 from gymnasium" in out
    final = FINAL_ES.search(out)
    assert final, out[-2000:]
    status, score, episodes, first, iterations = final.groups()
    assert status == "solved" and float(score) >= 475.0, final.group(0)
    assert int(episodes) == 50
    assert float(first) < 100.0  # it learned: a zero policy scores ~10
    lines = ITERATION.findall(out)
    assert len(lines) == int(iterations) >= 2
    assert float(lines[-1][1]) >= 500.0  # stopped at the --target (500)


@pytest.mark.timeout(300)
def test_es_runs_unchanged_on_the_stdlib_with_the_same_results():
    """Same seeds, same numbers: the Pool is the only thing that differs."""
    args = ["--env", "builtin", "--population", "24", "--iterations", "4"]
    args += ["--target", "1000", "--final-episodes", "10", "--workers", "2"]
    # Four iterations do not solve it: both exit with status 1, "not solved".
    fiber = run_example("es.py", *args, status=1)
    stdlib = run_example("es.py", "--engine", "multiprocessing", *args, status=1)
    assert "fiber_dask Pool of 2" in fiber and "multiprocessing Pool of 2" in stdlib
    assert len(ITERATION.findall(fiber)) == 4
    assert ITERATION.findall(fiber) == ITERATION.findall(stdlib)
    f, s = FINAL_ES.search(fiber), FINAL_ES.search(stdlib)
    assert f and s and f.group(2) == s.group(2)


FINAL_AL = re.compile(
    r"^final: greedy policy mean reward ([\d.]+) over (\d+) episodes; batch mean "
    r"reward ([\d.]+) -> ([\d.]+) in (\d+) updates, (\d+) episodes \((\d+) stale\); "
    r"actor exit codes \[([^\]]*)\]",
    re.M,
)


@pytest.mark.timeout(300)
def test_actor_learner_learns_and_shuts_down_cleanly():
    out = run_example("actor_learner.py", "--actors", "2", "--env", "builtin")
    assert "2 actor Processes" in out
    final = FINAL_AL.search(out)
    assert final, out[-2000:]
    greedy, _, first, last, updates, played, stale, codes = final.groups()
    assert float(greedy) >= 475.0, final.group(0)
    assert float(last) >= 3 * float(first), final.group(0)
    assert int(updates) == len(re.findall(r"^update +\d+", out, re.M)) >= 2
    assert int(played) >= 16 * int(updates) + int(stale)
    assert [int(c) for c in codes.split(",")] == [0, 0]  # each actor returned
