"""The examples run end to end, in a reduced size, and do what they claim.

Each runs as its own ``python`` process on the embedded default (2 workers), as
a user would run it; the tests read the result from its output, not only the
exit status.  ``tests/test_pbt_example.py`` has examples/pbt.py's.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import numpy as np
import pytest
from support.examples import (
    EXAMPLES,
    MARKUP,
    ROOT,
    assert_png,
    example_scripts_with_options,
    help_entries,
    run_example,
)


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
        params = rng.standard_normal(es.n_params(0))  # a linear policy
        if trial == 0:  # push towards the pole's lean: balances, hits the limit
            params = np.array([0, 0, 0, 0, 0, 0, 1, 1, 0, 0], dtype=float)
        layers = es.unflatten(params, 0)
        gym, ours = es.make_env("gymnasium"), es.make_env("builtin")
        for seed in range(4):
            obs_g, _ = gym.reset(seed=seed)
            obs_o, _ = ours.reset(seed=seed)
            assert np.array_equal(obs_g, obs_o)
            steps = 0
            while True:
                a = es.act(layers, obs_g)
                obs_g, r_g, term_g, trunc_g, _ = gym.step(a)
                obs_o, r_o, term_o, trunc_o, _ = ours.step(a)
                steps += 1
                np.testing.assert_allclose(obs_o, obs_g, rtol=1e-6, atol=1e-6)
                assert (r_o, term_o, trunc_o) == (r_g, term_g, trunc_g), steps
                if term_g or trunc_g:
                    break
            lengths.add(steps)
    assert 500 in lengths and min(lengths) < 500  # both endings were compared


def test_es_policy_is_an_mlp_that_starts_knowing_nothing():
    es = load_es()
    assert es.layer_sizes(es.HIDDEN) == (4, 16, 2)
    assert es.n_params((16,)) == 4 * 16 + 16 + 16 * 2 + 2 == 114
    assert es.n_params((32, 32)) == (4 + 1) * 32 + (32 + 1) * 32 + (32 + 1) * 2
    theta = es.initial_params((32, 32), seed=0)
    layers = es.unflatten(theta, (32, 32))
    assert [w.shape for w, _ in layers] == [(32, 4), (32, 32), (2, 32)]
    # normalised columns in the hidden layers, a zero output layer: every
    # observation gives the same action, so the first policy scores about 9
    for w, b in layers[:-1]:
        np.testing.assert_allclose(np.linalg.norm(w, axis=1), 1.0)
        assert not b.any()
    assert not layers[-1][0].any() and not layers[-1][1].any()
    env = es.make_env("builtin")
    assert es.episode(env, theta, (32, 32), seed=1) < 20
    # the layers are views into theta: perturbing theta changes the policy
    theta[-1] = 1.0
    assert es.act(es.unflatten(theta, (32, 32)), np.zeros(4)) == 1


FINAL_ES = re.compile(
    r"^(solved|not solved): mean reward ([\d.]+) over (\d+) episodes "
    r"\(first iteration ([\d.]+)\) after (\d+) iterations",
    re.M,
)
ITERATION = re.compile(
    r"^iter +(\d+) +reward +([\d.]+) +population mean +([\d.]+) max +(\d+)", re.M
)


@pytest.mark.slow  # the README's full run: about 10 s on 2 idle cores
@pytest.mark.timeout(300)
def test_es_solves_cartpole_on_the_embedded_cluster(tmp_path):
    """The README's quick start, with a fixed seed (the default, 0)."""
    plot = tmp_path / "rewards.png"
    out = run_example(
        "es.py", "--env", "gymnasium", "--final-episodes", "50", "--plot", str(plot)
    )
    assert "CartPole-v1 from gymnasium" in out
    assert "population 256, policy 4-16-2 (114 parameters)" in out
    final = FINAL_ES.search(out)
    assert final, out[-2000:]
    status, score, episodes, first, iterations = final.groups()
    assert status == "solved" and float(score) >= 475.0, final.group(0)
    assert int(episodes) == 50
    assert float(first) < 20.0  # it learned: the initial policy scores ~9
    lines = ITERATION.findall(out)
    assert len(lines) == int(iterations) >= 2
    assert float(lines[-1][1]) >= 500.0  # stopped at the --target (500)
    assert f"plot: {plot}\n" in out
    assert_png(str(plot))


@pytest.mark.timeout(300)
def test_es_runs_unchanged_on_the_stdlib_with_the_same_results():
    """Same seeds, same numbers: the Pool is the only thing that differs."""
    args = ["--env", "builtin", "--population", "24", "--iterations", "4"]
    args += ["--target", "1000", "--final-episodes", "10", "--workers", "2"]
    args += ["--hidden", "8,8", "--no-plot"]
    # Four iterations do not solve it: both exit with status 1, "not solved".
    fiber = run_example("es.py", *args, status=1)
    stdlib = run_example("es.py", "--engine", "multiprocessing", *args, status=1)
    assert "fiber_dask Pool of 2" in fiber and "multiprocessing Pool of 2" in stdlib
    assert "policy 4-8-8-2 (130 parameters)" in fiber
    assert len(ITERATION.findall(fiber)) == 4
    assert ITERATION.findall(fiber) == ITERATION.findall(stdlib)
    f, s = FINAL_ES.search(fiber), FINAL_ES.search(stdlib)
    assert f and s and f.group(2) == s.group(2)
    assert "plot" not in fiber and "plot" not in stdlib  # --no-plot


def test_es_runs_without_matplotlib_and_says_it_skipped_the_plot(tmp_path):
    """matplotlib is optional (the examples extra): without it the run goes on."""
    plot = tmp_path / "never.png"
    script = (
        "import runpy, sys\n"
        "sys.modules['matplotlib'] = None  # import matplotlib raises ImportError\n"
        f"sys.argv = [{os.path.join(EXAMPLES, 'es.py')!r}] + sys.argv[1:]\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n"
    )
    args = ["--engine", "multiprocessing", "--workers", "2", "--env", "builtin"]
    args += ["--population", "4", "--iterations", "1", "--final-episodes", "2"]
    proc = subprocess.run(
        [sys.executable, "-c", script, *args, "--plot", str(plot)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr  # "not solved"
    assert "plot skipped: matplotlib is not installed" in proc.stdout
    assert FINAL_ES.search(proc.stdout), proc.stdout
    assert not plot.exists()


SCRIPTS = example_scripts_with_options()


def test_every_example_with_options_is_checked():
    assert {"es.py", "pbt.py", "actor_learner.py", "ring_sgd.py"} <= set(SCRIPTS)


@pytest.mark.parametrize("script", SCRIPTS)
def test_example_help_is_plain_text_and_shows_every_default(script):
    out = run_example(script, "--help", timeout=60)
    assert not MARKUP.search(out), MARKUP.search(out).group(0)
    entries = help_entries(out)
    assert "--help" in entries and len(entries) >= 5, entries
    for option, text in entries.items():
        if option != "--help":
            assert "(default: " in text, f"{script} {option}: {text!r}"


FINAL_AL = re.compile(
    r"^final: greedy policy mean reward ([\d.]+) over (\d+) episodes; batch mean "
    r"reward ([\d.]+) -> ([\d.]+) in (\d+) updates, (\d+) episodes \((\d+) stale\); "
    r"actor exit codes \[([^\]]*)\]",
    re.M,
)


AL_UPDATE = re.compile(r"^update +\d+ +batch mean reward +[\d.]+ +episodes +\d+ \(\d+ stale\)", re.M)


@pytest.mark.timeout(300)
def test_actor_learner_learns_and_shuts_down_cleanly():
    args = ("actor_learner.py", "--actors", "2", "--env", "builtin")
    out = run_example(*args)
    assert "2 actor Processes" in out
    final = FINAL_AL.search(out)
    assert final, out[-2000:]
    greedy, _, first, last, updates, played, stale, codes = final.groups()
    assert float(greedy) >= 475.0, final.group(0)
    assert float(last) >= 3 * float(first), final.group(0)
    assert int(updates) == len(AL_UPDATE.findall(out)) >= 2
    assert int(played) >= 16 * int(updates) + int(stale)
    assert [int(c) for c in codes.split(",")] == [0, 0]  # each actor returned
    # Seeded by what each episode is and batched in a fixed order, the run is
    # the stdlib's, update by update, whichever actor was quicker on the way.
    stdlib = run_example(*args, "--engine", "multiprocessing")
    assert AL_UPDATE.findall(out) == AL_UPDATE.findall(stdlib)
    assert final.group(0) == FINAL_AL.search(stdlib).group(0)


RING_ROUND = re.compile(
    r"^round +(\d+) +best m(\d+) +([\d.]+) +losses ([\d. ]+?)  copied before: "
    r"(.+?)  restarts (\d+)$",
    re.M,
)
RING_START = re.compile(r"^start +best ([\d.]+) +losses", re.M)
RING_BEST = re.compile(
    r"^best: model (\d+) validation loss ([\d.]+) .* after (\d+) rounds; ring "
    r"members on \[([^\]]*)\]; (\d+) restarts",
    re.M,
)


@pytest.mark.skipif(
    importlib.util.find_spec("torch") is None,
    reason="examples/ring_sgd.py needs torch (the `ring` extra)",
)
@pytest.mark.timeout(300)  # about 10 s on 2 idle cores; much more when they are not
def test_ring_sgd_trains_data_parallel_with_torch_distributed_on_a_ring():
    """examples/ring_sgd.py, short: a Ring of 4 sets up gloo and trains two
    models data-parallel for two PBT rounds of 100 steps each."""
    out = run_example(
        "ring_sgd.py",
        *("--population", "2", "--rounds", "2", "--steps", "100"),
        *("--samples", "256", "--lr-range", "0.1", "0.3"),
        timeout=240,
    )
    assert "Ring of 4 (torch " in out and "gloo): 2 models x 2 rounds" in out
    rounds = RING_ROUND.findall(out)
    assert [int(r[0]) for r in rounds] == [1, 2], out
    assert all(len(r[3].split()) == 2 for r in rounds)
    assert rounds[0][4] == "-" and "<-" in rounds[1][4]  # PBT copied one
    start = float(RING_START.search(out).group(1))
    best = RING_BEST.search(out)
    assert best, out[-2000:]
    model, loss, n_rounds, hosts, restarts = best.groups()
    # It learned: the members' averaged gradients moved the models.
    assert float(loss) < 0.9 * start, (loss, start)
    assert float(loss) == min(float(x) for x in rounds[1][3].split())
    assert (int(n_rounds), hosts, int(restarts)) == (2, "'127.0.0.1'", 0)
