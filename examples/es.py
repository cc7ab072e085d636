"""Evolution strategies on CartPole-v1: an MLP policy, every evaluation through Pool.map.

The workload Fiber was built for, OpenAI-style (Salimans et al. 2017): the
policy is a small neural network (by default 4 observations -> 16 tanh units
-> 2 action logits, 114 parameters; ``--hidden 32,32`` for two layers of 32),
its hidden layers initialised as OpenAI-ES did (normalised columns).
Every iteration a population of perturbed policies ``theta + sigma * eps`` and
their mirror images ``theta - sigma * eps`` (mirrored sampling) play an episode
each, in parallel through one ``Pool.map``; the rewards are replaced by their
centred ranks (fitness shaping), and ``theta`` moves along the rank-weighted
sum of the perturbations with Adam (or SGD with momentum) and weight decay.
Only seeds travel: a worker rebuilds ``eps`` from its noise seed (Salimans et
al.'s workers index a shared noise table).

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
    python examples/es.py --hidden 32,32 --population 512
    fiber-dask run --config adapters/kubernetes.yaml examples/es.py

It prints a line per iteration, saves the reward per iteration as a PNG
(``es_rewards.png`` in the current directory; ``--plot PATH``, ``--no-plot``;
needs matplotlib, else it says so and skips the plot), and ends with
``solved: ...`` or ``not solved: ...``, the final policy's mean reward over
``--final-episodes`` episodes; the exit status is 0 when solved.
``benchmarks/es.py`` times this loop on several engines.
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
SIGMA, LR, L2 = 0.1, 0.1, 0.005  # the search's defaults (train() and the CLI)
PLOT = "es_rewards.png"  # where the CLI saves its plot by default


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

OBS, ACTIONS = 4, 2  # CartPole's observation size and number of actions
HIDDEN = (16,)  # the default policy: 4 -> 16 tanh -> 2


def layer_sizes(hidden: Sequence[int] | int) -> tuple[int, ...]:
    """``(4, *hidden, 2)``; ``hidden`` empty (or 0) is a linear policy."""
    if isinstance(hidden, int):
        hidden = (hidden,) if hidden else ()
    return (OBS, *hidden, ACTIONS)


def n_params(hidden: Sequence[int] | int = HIDDEN) -> int:
    """Weights and biases of every layer, flattened into one vector."""
    sizes = layer_sizes(hidden)
    return sum(
        (n_in + 1) * n_out for n_in, n_out in zip(sizes[:-1], sizes[1:], strict=True)
    )


def unflatten(params: np.ndarray, hidden: Sequence[int] | int) -> list:
    """``params`` as ``[(W, b), ...]``, views into the flat vector, one per layer."""
    layers, at = [], 0
    sizes = layer_sizes(hidden)
    for n_in, n_out in zip(sizes[:-1], sizes[1:], strict=True):
        w = params[at : at + n_in * n_out].reshape(n_out, n_in)
        at += n_in * n_out
        layers.append((w, params[at : at + n_out]))
        at += n_out
    return layers


def initial_params(hidden: Sequence[int] | int, seed: int) -> np.ndarray:
    """OpenAI-ES's start for the hidden layers (each unit's incoming weights a
    random direction of norm 1: normalised columns), zero biases, and a zero
    output layer: the first policy knows nothing (it always pushes left and
    scores about 9), where a random output layer can balance by luck."""
    rng = np.random.default_rng([seed, 1])
    params = np.zeros(n_params(hidden))
    for w, _ in unflatten(params, hidden)[:-1]:
        x = rng.standard_normal(w.shape)
        w[...] = x / np.sqrt(np.square(x).sum(axis=1, keepdims=True))
    return params


def act(layers: list, obs: np.ndarray) -> int:
    """The action with the larger logit: tanh hidden layers, a linear output."""
    x = np.asarray(obs, dtype=float)
    for w, b in layers[:-1]:
        x = np.tanh(w @ x + b)
    w, b = layers[-1]
    logits = w @ x + b
    return int(logits[1] > logits[0])


def episode(env: Any, params: np.ndarray, hidden: Sequence[int], seed: int) -> float:
    """The total reward of one episode."""
    layers = unflatten(params, hidden)
    obs, _ = env.reset(seed=seed)
    total = 0.0
    while True:
        obs, reward, terminated, truncated, _ = env.step(act(layers, obs))
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
    sigma: float = SIGMA,
    lr: float = LR,
    optimizer: str = "adam",
    l2: float = L2,
    hidden: Sequence[int] | int = HIDDEN,
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
    ``hidden`` gives the policy's hidden layer sizes (``()`` or 0: linear).
    """
    if env == "auto":
        env = env_kinds()[0]
    hidden = layer_sizes(hidden)[1:-1]
    pairs = max(1, population // 2)
    rng = np.random.default_rng(seed)
    size = n_params(hidden)
    theta = initial_params(hidden, seed)
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
    map_fn: Callable,
    theta: np.ndarray,
    hidden: Sequence[int] | int,
    env: str,
    episodes: int,
) -> float:
    """Mean reward of ``theta`` over ``episodes`` fresh episodes (in parallel)."""
    if env == "auto":
        env = env_kinds()[0]
    hidden = layer_sizes(hidden)[1:-1]
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


DESCRIPTION = """\
Evolution strategies (OpenAI-ES: mirrored sampling, centred ranks, Adam) train
an MLP policy for CartPole-v1, evaluating every perturbed policy through
Pool.map on fiber-dask's cluster (or on the standard library with --engine
multiprocessing). Prints a line per iteration, saves a plot of the reward per
iteration, and ends with "solved: ..." or "not solved: ..." (exit status 0 when
solved, i.e. a mean reward of at least 475 over --final-episodes episodes)."""

EPILOG = """\
examples:
  python examples/es.py                            embedded local Dask cluster
  python examples/es.py --engine multiprocessing   the stdlib, for comparison
  python examples/es.py --hidden 32,32 --population 512 --plot run2.png
  fiber-dask run --config adapters/kubernetes.yaml examples/es.py"""


def hidden_sizes(text: str) -> tuple[int, ...]:
    """``--hidden``: "16", "32,32", or "0" (a linear policy)."""
    try:
        sizes = tuple(int(s) for s in text.split(",") if s.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of layer sizes, e.g. 16 or 32,32"
        ) from None
    if any(s < 0 for s in sizes):
        raise argparse.ArgumentTypeError(f"layer sizes must be >= 0, not {text!r}")
    return tuple(s for s in sizes if s)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--engine",
        choices=["fiber_dask", "multiprocessing"],
        default="fiber_dask",
        help="whose Pool evaluates the population (default: %(default)s)",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=None,
        help="Pool(processes=N) (default: every task slot of the cluster, or "
        "os.cpu_count() for multiprocessing)",
    )
    p.add_argument(
        "--population",
        type=int,
        default=256,
        help="perturbed policies evaluated per iteration, in mirrored pairs "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--iterations",
        type=int,
        default=60,
        help="iterations at most (default: %(default)s)",
    )
    p.add_argument(
        "--hidden",
        type=hidden_sizes,
        default=HIDDEN,
        metavar="SIZES",
        help="hidden layer sizes of the tanh MLP policy, comma-separated; 0 for a "
        "linear policy (default: " + ",".join(map(str, HIDDEN)) + ")",
    )
    p.add_argument(
        "--sigma",
        type=float,
        default=SIGMA,
        help="standard deviation of the parameter noise (default: %(default)s)",
    )
    p.add_argument(
        "--lr",
        type=float,
        default=LR,
        help="learning rate of the optimizer (default: %(default)s)",
    )
    p.add_argument(
        "--optimizer",
        choices=["adam", "sgd"],
        default="adam",
        help="Adam, or SGD with momentum 0.9 (default: %(default)s)",
    )
    p.add_argument(
        "--l2",
        type=float,
        default=L2,
        help="weight decay coefficient (default: %(default)s)",
    )
    p.add_argument(
        "--episodes",
        type=int,
        default=1,
        help="episodes per perturbed policy (default: %(default)s)",
    )
    p.add_argument(
        "--eval-episodes",
        type=int,
        default=10,
        help="episodes of the current policy per iteration, for the progress "
        "line and --target (default: %(default)s)",
    )
    p.add_argument(
        "--final-episodes",
        type=int,
        default=100,
        help="episodes of the final policy that decide solved or not "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--target",
        type=float,
        default=MAX_STEPS,
        help="stop once the policy's mean reward over its --eval-episodes reaches "
        "this (default: %(default)s, the most an episode can score)",
    )
    p.add_argument(
        "--env",
        choices=["auto", "gymnasium", "builtin"],
        default="auto",
        help="CartPole-v1 from gymnasium, or the numpy-only copy in this file; "
        "auto: gymnasium when installed (default: %(default)s)",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the initial policy, the noise and the episodes "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--progress",
        choices=["auto", "bar", "lines"],
        default="auto",
        help="a tqdm bar as well as the lines (auto: when stderr is a terminal "
        "and tqdm is installed) (default: %(default)s)",
    )
    plot = p.add_mutually_exclusive_group()
    plot.add_argument(
        "--plot",
        default=PLOT,
        metavar="PATH",
        help="where to save the PNG of the reward per iteration (default: "
        "%(default)s in the current directory)",
    )
    plot.add_argument(
        "--no-plot",
        dest="plot",
        action="store_const",
        const=None,
        help="do not save the plot (default: save it)",
    )
    a = p.parse_args(argv)
    if a.population < 2 or a.iterations < 1 or a.final_episodes < 1:
        p.error("--population must be >= 2, --iterations and --final-episodes >= 1")
    if a.env == "gymnasium" and "gymnasium" not in env_kinds():
        p.error("gymnasium is not installed: pip install gymnasium, or --env builtin")
    return a


def save_plot(history: list[dict], path: str, title: str) -> str | None:
    """Save the reward per iteration as a PNG; the reason when it cannot."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib)"
    its = [s["iteration"] for s in history]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    ax.plot(its, [s["reward"] for s in history], "o-", label="policy (mean)")
    ax.plot(its, [s["population_mean"] for s in history], label="population mean")
    ax.plot(its, [s["population_max"] for s in history], ":", label="population max")
    ax.axhline(SOLVED, color="grey", lw=0.8, ls="--", label=f"solved ({SOLVED:g})")
    ax.set(xlabel="iteration", ylabel="episode reward", ylim=(0, MAX_STEPS * 1.05))
    ax.set_title(title, fontsize=10)
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return None


def main(argv: Sequence[str] | None = None) -> int:
    a = parse_args(argv)
    mp = engine(a.engine)
    t0 = time.perf_counter()
    sizes = "-".join(map(str, layer_sizes(a.hidden)))
    with mp.Pool(a.workers) as pool:
        print(
            f"{env_description(a.env)}; {a.engine} Pool of "
            f"{getattr(pool, '_processes', a.workers or os.cpu_count())} ready in "
            f"{time.perf_counter() - t0:.2f} s; population {a.population}, "
            f"policy {sizes} ({n_params(a.hidden)} parameters)",
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
    if a.plot is not None:
        why = save_plot(
            history,
            a.plot,
            f"OpenAI-ES, CartPole-v1, policy {sizes}, population {a.population}; "
            f"final {score:.1f}",
        )
        if why is None:
            print(f"plot: {os.path.abspath(a.plot)}", flush=True)
        else:
            print(f"plot skipped: {why}", flush=True)
    print(
        f"{'solved' if solved else 'not solved'}: mean reward {score:.1f} over "
        f"{a.final_episodes} episodes (first iteration {history[0]['reward']:.1f}) "
        f"after {len(history)} iterations, {time.perf_counter() - t0:.1f} s in all",
        flush=True,
    )
    return 0 if solved else 1


if __name__ == "__main__":
    sys.exit(main())
