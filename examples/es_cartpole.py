"""Evolution strategies on CartPole, evaluated with a Pool — stdlib-only.

The classic workload Fiber was built for: every iteration, a population of
perturbed policies is evaluated in parallel (``Pool.map``), and the mean policy
moves toward the perturbations that scored well (OpenAI-style ES with mirrored
sampling and rank shaping).  The environment is CartPole-v1's physics written
out in plain Python, so the example needs nothing beyond fiber-dask.

Runs unchanged on the stdlib: swap the import below for ``import multiprocessing``.

    python examples/es_cartpole.py                  # embedded local Dask cluster
    python examples/es_cartpole.py --population 64 --iterations 30
"""

from __future__ import annotations

import argparse
import math
import random
import time

import fiber_dask as multiprocessing

# CartPole-v1 constants (Barto, Sutton & Anderson 1983, as in Gymnasium).
GRAVITY, CART_MASS, POLE_MASS, POLE_HALF_LENGTH = 9.8, 1.0, 0.1, 0.5
FORCE, TAU = 10.0, 0.02
TOTAL_MASS = CART_MASS + POLE_MASS
POLE_MASS_LENGTH = POLE_MASS * POLE_HALF_LENGTH
THETA_LIMIT = 12 * 2 * math.pi / 360
X_LIMIT = 2.4
MAX_STEPS = 500  # the "solved" score of CartPole-v1 is an average of 475


def episode(weights: list[float], seed: int) -> float:
    """Total reward of one CartPole episode under a linear policy."""
    rng = random.Random(seed)
    x, x_dot, theta, theta_dot = (rng.uniform(-0.05, 0.05) for _ in range(4))
    for step in range(MAX_STEPS):
        act = weights[0] * x + weights[1] * x_dot + weights[2] * theta
        act += weights[3] * theta_dot + weights[4]
        force = FORCE if act > 0 else -FORCE
        cos, sin = math.cos(theta), math.sin(theta)
        temp = (force + POLE_MASS_LENGTH * theta_dot**2 * sin) / TOTAL_MASS
        theta_acc = (GRAVITY * sin - cos * temp) / (
            POLE_HALF_LENGTH * (4.0 / 3.0 - POLE_MASS * cos**2 / TOTAL_MASS)
        )
        x_acc = temp - POLE_MASS_LENGTH * theta_acc * cos / TOTAL_MASS
        x, x_dot = x + TAU * x_dot, x_dot + TAU * x_acc
        theta, theta_dot = theta + TAU * theta_dot, theta_dot + TAU * theta_acc
        if abs(x) > X_LIMIT or abs(theta) > THETA_LIMIT:
            return float(step + 1)
    return float(MAX_STEPS)


def evaluate(task: tuple[list[float], int, int]) -> float:
    """Mean reward of a policy over a few episodes (one Pool task)."""
    weights, seed, episodes = task
    return sum(episode(weights, seed + i) for i in range(episodes)) / episodes


def ranks(values: list[float]) -> list[float]:
    """Centered ranks in [-0.5, 0.5]: robust to the scale of rewards."""
    order = sorted(range(len(values)), key=values.__getitem__)
    out = [0.0] * len(values)
    for rank, i in enumerate(order):
        out[i] = rank / (len(values) - 1) - 0.5
    return out


def train(
    pool,
    population: int,
    iterations: int,
    sigma: float,
    lr: float,
    seed: int,
    episodes: int = 3,
    target: float = 475.0,
    verbose: bool = True,
) -> dict:
    rng = random.Random(seed)
    theta = [0.0] * 5
    history = []
    for it in range(iterations):
        t0 = time.perf_counter()
        noise = [[rng.gauss(0, 1) for _ in theta] for _ in range(population // 2)]
        candidates = []
        for eps in noise:  # mirrored sampling: +eps and -eps
            candidates.append([t + sigma * e for t, e in zip(theta, eps, strict=True)])
            candidates.append([t - sigma * e for t, e in zip(theta, eps, strict=True)])
        ep_seed = rng.randrange(1 << 30)
        rewards = pool.map(evaluate, [(c, ep_seed, episodes) for c in candidates])
        shaped = ranks(rewards)
        for j, eps in enumerate(noise):
            weight = shaped[2 * j] - shaped[2 * j + 1]
            for k in range(len(theta)):
                theta[k] += lr / (population * sigma) * weight * eps[k]
        score = evaluate((theta, 10_000 + it, 10))
        history.append(score)
        if verbose:
            bar = "#" * int(30 * score / MAX_STEPS)
            print(
                f"iter {it:3d}  mean policy reward {score:6.1f}  "
                f"best candidate {max(rewards):6.1f}  {time.perf_counter() - t0:5.2f}s  {bar}",
                flush=True,
            )
        if score >= target:
            break
    return {
        "theta": theta,
        "score": history[-1],
        "iterations": len(history),
        "solved": history[-1] >= target,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--population", type=int, default=64)
    parser.add_argument("--iterations", type=int, default=40)
    parser.add_argument("--sigma", type=float, default=0.1)
    parser.add_argument("--lr", type=float, default=0.2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--processes", type=int, default=None)
    args = parser.parse_args(argv)

    t0 = time.perf_counter()
    with multiprocessing.Pool(args.processes) as pool:
        print(f"{pool!r} ready in {time.perf_counter() - t0:.2f}s", flush=True)
        result = train(
            pool, args.population, args.iterations, args.sigma, args.lr, args.seed
        )
    status = "solved" if result["solved"] else "not solved"
    print(
        f"{status}: reward {result['score']:.1f} after {result['iterations']} iterations, "
        f"{time.perf_counter() - t0:.1f}s in all; policy "
        + ", ".join(f"{w:+.3f}" for w in result["theta"])
    )
    return 0 if result["solved"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
