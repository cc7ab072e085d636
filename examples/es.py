"""Evolution strategies on CartPole-v1, every evaluation through ``Pool.map``.

The workload Fiber was built for, OpenAI-style (Salimans et al. 2017): every
iteration a population of perturbed policies ``theta + sigma * eps`` and their
mirror images ``theta - sigma * eps`` (antithetic sampling) play an episode
each, in parallel through one ``Pool.map``; the rewards are replaced by their
centred ranks, and ``theta`` moves along the rank-weighted sum of the
perturbations with Adam (or plain SGD).  Only seeds travel: a worker rebuilds
``eps`` from its noise seed (Salimans et al.'s workers index a shared noise table).

The environment is Gymnasium's ``CartPole-v1`` when ``gymnasium`` is installed
(``pip install -e ".[examples]"``), else :class:`CartPole` below, the same
physics, start states and time limit in plain Python and numpy (on a cluster,
the workers need ``gymnasium`` too, or pass ``--env builtin``).  CartPole-v1
counts as solved at a mean reward of 475 over 100 episodes; 500 is the most an
episode can score.

The one line that puts it on a Dask cluster is the import in :func:`engine`;
``--engine multiprocessing`` runs the very same code on the standard library::

    python examples/es.py                          # embedded local Dask cluster
    python examples/es.py --engine multiprocessing # the stdlib, for comparison
    python examples/es.py --population 32 --iterations 20 --workers 2
    fiber-dask run --config adapters/kubernetes.yaml examples/es.py

The last line printed is ``solved: ...`` or ``not solved: ...`` with the final
policy's mean reward over ``--final-episodes`` episodes; the exit status is 0
when solved.  ``benchmarks/es.py`` times this loop on several engines.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

SOLVED = 475.0  # CartPole-v1's reward threshold (mean over 100 episodes)
MAX_STEPS = 500  # CartPole-v1's time limit, so the best possible episode reward


# --------------------------------------------------------------- environment


class CartPole:
    """CartPole-v1 without Gymnasium: same dynamics, start states and limits.

    Gymnasium's ``CartPoleEnv`` (Barto, Sutton & Anderson 1983; Euler steps of
    20 ms) under its 500-step ``TimeLimit``.  ``reset(seed=s)`` draws the start
    state from ``np.random.default_rng(s)`` as Gymnasium does, so an episode
    with the same seed and actions follows the same trajectory.
    """

    gravity, masscart, masspole, length = 9.8, 1.0, 0.1, 0.5
    force_mag, tau = 10.0, 0.02
    total_mass = masscart + masspole
    polemass_length = masspole * length
    theta_threshold = 12 * 2 * math.pi / 360
    x_threshold = 2.4

    def __init__(self, max_episode_steps: int = MAX_STEPS) -> None:
        self.max_episode_steps = max_episode_steps
        self.rng = np.random.default_rng()
        self.state = (0.0, 0.0, 0.0, 0.0)
        self.steps = 0

    def reset(self, *, seed: int | None = None) -> tuple[np.ndarray, dict]:
        if seed is not None:
            self.rng = np.random.default_rng(seed)
        self.state = tuple(float(v) for v in self.rng.uniform(-0.05, 0.05, size=4))
        self.steps = 0
        return np.array(self.state, dtype=np.float32), {}

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict]:
        x, x_dot, theta, theta_dot = self.state
        force = self.force_mag if action == 1 else -self.force_mag
        cos, sin = math.cos(theta), math.sin(theta)
        temp = (force + self.polemass_length * theta_dot**2 * sin) / self.total_mass
        theta_acc = (self.gravity * sin - cos * temp) / (
            self.length * (4.0 / 3.0 - self.masspole * cos**2 / self.total_mass)
        )
        x_acc = temp - self.polemass_length * theta_acc * cos / self.total_mass
        x, x_dot = x + self.tau * x_dot, x_dot + self.tau * x_acc
        theta, theta_dot = (
            theta + self.tau * theta_dot,
            theta_dot + self.tau * theta_acc,
        )
        self.state = (x, x_dot, theta, theta_dot)
        self.steps += 1
        terminated = abs(x) > self.x_threshold or abs(theta) > self.theta_threshold
        truncated = self.steps >= self.max_episode_steps
        return np.array(self.state, dtype=np.float32), 1.0, terminated, truncated, {}


def env_kinds() -> list[str]:
    """The environments available here, the preferred one first."""
    try:
        import gymnasium  # noqa: F401
    except ImportError:
        return ["builtin"]
    return ["gymnasium", "builtin"]


def make_env(kind: str = "auto") -> Any:
    """A CartPole-v1 environment: ``gymnasium``, ``builtin``, or ``auto`` (the first
    of those that is installed)."""
    if kind == "auto":
        kind = env_kinds()[0]
    if kind == "gymnasium":
        import gymnasium

        return gymnasium.make("CartPole-v1")
    if kind == "builtin":
        return CartPole()
    raise ValueError(f"unknown environment {kind!r} (gymnasium, builtin or auto)")


def env_description(kind: str) -> str:
    if kind == "auto":
        kind = env_kinds()[0]
    if kind == "gymnasium":
        import gymnasium

        return f"CartPole-v1 from gymnasium {gymnasium.__version__}"
    return "CartPole-v1, built-in (numpy only; pip install gymnasium for Gymnasium's)"


# -------------------------------------------------------------------- policy


def n_params(hidden: int) -> int:
    """A linear policy (``hidden=0``: 4 weights and a bias) or a tanh MLP."""
    return 5 if hidden == 0 else hidden * 4 + hidden + hidden + 1


def act(params: np.ndarray, hidden: int, obs: np.ndarray) -> int:
    """Push right (1) when the policy's single output is positive."""
    if hidden == 0:
        out = float(params[:4] @ obs) + params[4]
    else:
        w1 = params[: 4 * hidden].reshape(hidden, 4)
        b1 = params[4 * hidden : 5 * hidden]
        w2 = params[5 * hidden : 6 * hidden]
        out = float(w2 @ np.tanh(w1 @ obs + b1)) + params[6 * hidden]
    return 1 if out > 0 else 0


def episode(env: Any, params: np.ndarray, hidden: int, seed: int) -> float:
    """The total reward of one episode."""
    obs, _ = env.reset(seed=seed)
    total = 0.0
    while True:
        obs, reward, terminated, truncated, _ = env.step(act(params, hidden, obs))
        total += reward
        if terminated or truncated:
            return total


def noise(seed: int, size: int) -> np.ndarray:
    """The perturbation with this seed: rebuilt by the worker, not sent."""
    return np.random.default_rng(seed).standard_normal(size)


# One environment per worker process and kind, made on first use.
_envs: dict[str, Any] = {}


def evaluate(task: tuple) -> float:
    """One Pool task: the mean reward of ``theta + sign * sigma * noise(seed)``.

    ``task`` is ``(theta, noise_seed, sign, sigma, episode_seed, episodes,
    hidden, env_kind)``; ``sign`` 0 evaluates ``theta`` itself.
    """
    theta, noise_seed, sign, sigma, episode_seed, episodes, hidden, kind = task
    env = _envs.get(kind)
    if env is None:
        env = _envs[kind] = make_env(kind)
    params = theta
    if sign:
        params = theta + (sign * sigma) * noise(noise_seed, theta.size)
    total = sum(episode(env, params, hidden, episode_seed + i) for i in range(episodes))
    return total / episodes


# ----------------------------------------------------------------- the search


def centered_ranks(values: np.ndarray) -> np.ndarray:
    """Ranks scaled to [-0.5, 0.5]: only the order of the rewards counts."""
    ranks = np.empty(len(values))
    ranks[np.argsort(values, kind="stable")] = np.arange(len(values))
    return ranks / (len(values) - 1) - 0.5


class Adam:
    def __init__(self, size: int, lr: float, beta1=0.9, beta2=0.999, eps=1e-8):
        self.lr, self.beta1, self.beta2, self.eps = lr, beta1, beta2, eps
        self.m, self.v, self.t = np.zeros(size), np.zeros(size), 0

    def step(self, grad: np.ndarray) -> np.ndarray:
        """The change of the parameters that ascends ``grad``."""
        self.t += 1
        self.m = self.beta1 * self.m + (1 - self.beta1) * grad
        self.v = self.beta2 * self.v + (1 - self.beta2) * grad * grad
        a = self.lr * math.sqrt(1 - self.beta2**self.t) / (1 - self.beta1**self.t)
        return a * self.m / (np.sqrt(self.v) + self.eps)


class SGD:
    def __init__(self, size: int, lr: float, momentum: float = 0.9):
        self.lr, self.momentum, self.v = lr, momentum, np.zeros(size)

    def step(self, grad: np.ndarray) -> np.ndarray:
        self.v = self.momentum * self.v + (1 - self.momentum) * grad
        return self.lr * self.v


def train(
    map_fn: Callable[[Callable, list], list],
    *,
    population: int = 256,
    iterations: int = 60,
    sigma: float = 0.1,
    lr: float = 0.1,
    optimizer: str = "adam",
    l2: float = 0.005,
    hidden: int = 0,
    episodes: int = 1,
    eval_episodes: int = 10,
    env: str = "auto",
    target: float | None = MAX_STEPS,
    seed: int = 0,
    report: Callable[[dict], None] | None = None,
) -> dict:
    """Run ES with ``map_fn(evaluate, tasks)`` (e.g. ``pool.map``).

    Each iteration evaluates ``population`` perturbed policies (``population // 2``
    mirrored pairs) and ``eval_episodes`` episodes of the current policy, all in
    one ``map_fn`` call.  Stops early when that policy's mean reward reaches
    ``target`` (None: never).  ``report(stats)`` is called after every iteration.
    """
    if env == "auto":
        env = env_kinds()[0]
    pairs = max(1, population // 2)
    rng = np.random.default_rng(seed)
    size = n_params(hidden)
    theta = np.zeros(size)
    opt = (Adam if optimizer == "adam" else SGD)(size, lr)
    history: list[dict] = []
    for it in range(iterations):
        t0 = time.perf_counter()
        seeds = rng.integers(0, 2**31 - 1, size=pairs)
        ep_seed = int(rng.integers(0, 2**31 - 1 - episodes))
        eval_seed = int(rng.integers(0, 2**31 - 1 - eval_episodes))
        tasks = []
        for s in seeds:  # both members of a pair play the same start states
            for sign in (1, -1):
                tasks.append(
                    (theta, int(s), sign, sigma, ep_seed, episodes, hidden, env)
                )
        for i in range(eval_episodes):
            tasks.append((theta, 0, 0, sigma, eval_seed + i, 1, hidden, env))
        results = np.asarray(list(map_fn(evaluate, tasks)), dtype=float)
        rewards, score = results[: 2 * pairs], results[2 * pairs :]
        ranks = centered_ranks(rewards)
        weights = ranks[0::2] - ranks[1::2]
        grad = np.zeros(size)
        for w, s in zip(weights, seeds, strict=True):
            grad += w * noise(int(s), size)
        grad /= 2 * pairs * sigma
        theta = theta + opt.step(grad - l2 * theta)
        stats = {
            "iteration": it + 1,
            "reward": float(score.mean()) if len(score) else float("nan"),
            "population_mean": float(rewards.mean()),
            "population_max": float(rewards.max()),
            "seconds": time.perf_counter() - t0,
        }
        history.append(stats)
        if report is not None:
            report(stats)
        if target is not None and stats["reward"] >= target:
            break
    return {"theta": theta, "history": history}


def final_score(
    map_fn: Callable, theta: np.ndarray, hidden: int, env: str, episodes: int
) -> float:
    """Mean reward of ``theta`` over ``episodes`` fresh episodes (in parallel)."""
    if env == "auto":
        env = env_kinds()[0]
    tasks = [(theta, 0, 0, 0.0, 1_000_000 + i, 1, hidden, env) for i in range(episodes)]
    return float(np.mean(list(map_fn(evaluate, tasks))))


# ------------------------------------------------------------------- the CLI


def engine(name: str) -> Any:
    """The multiprocessing module to run on: the stdlib's or fiber-dask's."""
    if name == "multiprocessing":
        import multiprocessing
    else:
        import fiber_dask as multiprocessing
    return multiprocessing


class Progress:
    """A tqdm bar over the iterations when tqdm is there and stderr is a
    terminal; one plain line per iteration on stdout either way."""

    def __init__(self, total: int, mode: str) -> None:
        self.bar = None
        if mode == "bar" or (mode == "auto" and sys.stderr.isatty()):
            try:
                from tqdm import tqdm
            except ImportError:
                pass
            else:
                self.bar = tqdm(total=total, unit="it", desc="ES", file=sys.stderr)

    def line(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text, file=sys.stdout)
        else:
            print(text, flush=True)

    def __call__(self, s: dict) -> None:
        filled = int(20 * s["reward"] / MAX_STEPS)
        self.line(
            f"iter {s['iteration']:3d}  reward {s['reward']:6.1f}  "
            f"population mean {s['population_mean']:6.1f} max "
            f"{s['population_max']:5.0f}  {s['seconds']:5.2f} s  "
            f"|{'#' * filled}{' ' * (20 - filled)}|"
        )
        if self.bar is not None:
            self.bar.set_postfix(reward=f"{s['reward']:.0f}", refresh=False)
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--engine", choices=["fiber_dask", "multiprocessing"], default="fiber_dask"
    )
    p.add_argument(
        "--workers", type=int, default=None, help="Pool(processes=); default: all"
    )
    p.add_argument("--population", type=int, default=256, help="evaluations/iter")
    p.add_argument("--iterations", type=int, default=60, help="at most")
    p.add_argument("--sigma", type=float, default=0.1, help="noise scale")
    p.add_argument("--lr", type=float, default=0.1, help="learning rate")
    p.add_argument("--optimizer", choices=["adam", "sgd"], default="adam")
    p.add_argument("--l2", type=float, default=0.005, help="weight decay")
    p.add_argument(
        "--hidden", type=int, default=0, help="hidden units (0: linear policy)"
    )
    p.add_argument("--episodes", type=int, default=1, help="per perturbation")
    p.add_argument(
        "--eval-episodes", type=int, default=10, help="of the policy, per iteration"
    )
    p.add_argument(
        "--final-episodes", type=int, default=100, help="of the final policy"
    )
    p.add_argument(
        "--target",
        type=float,
        default=MAX_STEPS,
        help="stop once the policy's mean reward over its --eval-episodes reaches this",
    )
    p.add_argument("--env", choices=["auto", "gymnasium", "builtin"], default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--progress", choices=["auto", "bar", "lines"], default="auto")
    a = p.parse_args(argv)
    if a.population < 2 or a.iterations < 1 or a.final_episodes < 1:
        p.error("--population must be >= 2, --iterations and --final-episodes >= 1")
    if a.env == "gymnasium" and "gymnasium" not in env_kinds():
        p.error("gymnasium is not installed: pip install gymnasium, or --env builtin")
    return a


def main(argv: Sequence[str] | None = None) -> int:
    a = parse_args(argv)
    mp = engine(a.engine)
    t0 = time.perf_counter()
    with mp.Pool(a.workers) as pool:
        print(
            f"{env_description(a.env)}; {a.engine} Pool of "
            f"{getattr(pool, '_processes', a.workers or os.cpu_count())} ready in "
            f"{time.perf_counter() - t0:.2f} s; population {a.population}, "
            f"{n_params(a.hidden)} parameters",
            flush=True,
        )
        progress = Progress(a.iterations, a.progress)
        try:
            out = train(
                pool.map,
                population=a.population,
                iterations=a.iterations,
                sigma=a.sigma,
                lr=a.lr,
                optimizer=a.optimizer,
                l2=a.l2,
                hidden=a.hidden,
                episodes=a.episodes,
                eval_episodes=a.eval_episodes,
                env=a.env,
                target=a.target,
                seed=a.seed,
                report=progress,
            )
        finally:
            progress.close()
        score = final_score(pool.map, out["theta"], a.hidden, a.env, a.final_episodes)
    solved = score >= SOLVED
    history = out["history"]
    print(
        f"{'solved' if solved else 'not solved'}: mean reward {score:.1f} over "
        f"{a.final_episodes} episodes (first iteration {history[0]['reward']:.1f}) "
        f"after {len(history)} iterations, {time.perf_counter() - t0:.1f} s in all",
        flush=True,
    )
    return 0 if solved else 1


if __name__ == "__main__":
    sys.exit(main())
