"""Population-based training: trainers as Processes, a scoreboard in a manager.

PBT (Jaderberg et al. 2017) trains a population of models in parallel, each
with its own hyperparameters.  Every few steps a member *evaluates* itself and
posts the score; a member in the bottom of the population *exploits* (copies
the weights and hyperparameters of a member from the top) and *explores*
(perturbs the copied hyperparameters).  This is the paper's toy problem
(section 4, figure 2): maximise ``Q(theta) = 1.2 - (theta_0^2 + theta_1^2)``
while each member can only ascend a surrogate
``Q_h(theta) = 1.2 - (h_0 theta_0^2 + h_1 theta_1^2)`` shaped by its
hyperparameters ``h``.  A member with fixed ``h = (1, 0)`` never moves
``theta_1``; PBT's copying and perturbing reaches the optimum 1.2.

The cluster pieces, as Fiber uses them:

* every member is a ``Process`` on a Dask worker;
* the scoreboard (scores, weights, hyperparameters) is one object in an
  ``AsyncManager``: members post their score without waiting for the reply,
  and only wait when they need an answer (where they rank, whom to copy);
* a ``Queue`` carries the members' events to this controller, which prints
  them as they come.

Run ``python examples/pbt.py`` (the embedded local Dask cluster); the last
line is the best member's score and hyperparameters, and it is compared with
the same population trained without exploit/explore.
"""

from __future__ import annotations

import argparse
import random
import sys
import time

import fiber_dask as multiprocessing
from fiber_dask.managers import AsyncManager


def true_score(theta: list[float]) -> float:
    return 1.2 - (theta[0] ** 2 + theta[1] ** 2)


def surrogate_step(theta: list[float], h: list[float], lr: float) -> list[float]:
    # gradient ascent on Q_h(theta) = 1.2 - (h0 * theta0^2 + h1 * theta1^2)
    return [theta[0] - lr * 2 * h[0] * theta[0], theta[1] - lr * 2 * h[1] * theta[1]]


class Scoreboard:
    """The population's latest scores, weights and hyperparameters.

    Lives in the manager's server; members call it through proxies."""

    def __init__(self) -> None:
        self.members: dict[int, tuple[float, int, list[float], list[float]]] = {}

    def report(self, member: int, step: int, score: float, theta, h) -> None:
        self.members[member] = (score, step, list(theta), list(h))

    def quantile(self, member: int) -> float:
        """Fraction of the population scoring below ``member`` (0 = worst)."""
        mine = self.members[member][0]
        others = [s for m, (s, *_) in self.members.items() if m != member]
        return sum(s < mine for s in others) / max(len(others), 1)

    def top(self, fraction: float, seed: int) -> tuple[int, list[float], list[float]]:
        """A member from the top ``fraction`` of the population: (id, theta, h)."""
        ranked = sorted(self.members.items(), key=lambda kv: kv[1][0], reverse=True)
        best = ranked[: max(1, int(len(ranked) * fraction))]
        member, (_, _, theta, h) = random.Random(seed).choice(best)
        return member, theta, h

    def best(self) -> tuple[int, float, list[float], list[float]]:
        member, (score, _, theta, h) = max(
            self.members.items(), key=lambda kv: kv[1][0]
        )
        return member, score, theta, h


class PBTManager(AsyncManager):
    pass


PBTManager.register("Scoreboard", Scoreboard)


def member(
    ident: int, h: list[float], board, events, steps: int, ready: int, exploit: bool
):
    """One trainer: ascend the surrogate, post the true score every ``ready``
    steps, exploit and explore when in the bottom quarter."""
    rng = random.Random(ident)
    theta = [0.9, 0.9]
    for step in range(1, steps + 1):
        theta = surrogate_step(theta, h, lr=0.01)
        if step % ready:
            continue
        score = true_score(theta)
        board.report(ident, step, score, theta, h)  # no waiting for the reply
        if exploit and board.quantile(ident).get() < 0.25:
            source, theta, h = board.top(0.25, rng.randrange(1 << 30)).get()
            h = [max(0.0, x * rng.choice((0.8, 1.2)) + rng.gauss(0, 0.1)) for x in h]
            events.put((ident, step, score, f"copied member {source}"))
        else:
            events.put((ident, step, score, ""))
    board.report(ident, steps, true_score(theta), theta, h).get()
    events.put(None)


def train(population: int, steps: int, ready: int, exploit: bool, quiet: bool):
    """Run one population to the end; returns (member, score, theta, h) of the best."""
    with PBTManager() as manager:
        board = manager.Scoreboard()
        events = multiprocessing.Queue()
        # The paper's grid: half the members only train theta_0, half theta_1.
        grid = [[1.0, 0.0] if i % 2 == 0 else [0.0, 1.0] for i in range(population)]
        procs = [
            multiprocessing.Process(
                target=member,
                args=(i, grid[i], board, events, steps, ready, exploit),
                name=f"member-{i}",
            )
            for i in range(population)
        ]
        for p in procs:
            p.start()
        running = population
        while running:
            event = events.get(timeout=300)
            if event is None:
                running -= 1
                continue
            ident, step, score, note = event
            if not quiet and (note or step % (ready * 5) == 0):
                print(
                    f"  member {ident} step {step:4d} Q={score:.4f} {note}", flush=True
                )
        for p in procs:
            p.join(60)
            if p.exitcode != 0:
                raise RuntimeError(f"{p.name} failed with exit code {p.exitcode}")
        return board.best().get()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--population", type=int, default=8)
    parser.add_argument(
        "--steps", type=int, default=200, help="training steps per member"
    )
    parser.add_argument(
        "--ready", type=int, default=4, help="steps between evaluations"
    )
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)

    t0 = time.perf_counter()
    print(f"PBT: {args.population} members x {args.steps} steps", flush=True)
    _, plain, *_ = train(args.population, args.steps, args.ready, False, True)
    print(f"without exploit/explore, best Q = {plain:.4f}", flush=True)
    who, score, theta, h = train(
        args.population, args.steps, args.ready, True, args.quiet
    )
    print(f"elapsed {time.perf_counter() - t0:.1f} s")
    print(
        f"best: member {who} Q={score:.4f} (optimum 1.2; without PBT {plain:.4f}) "
        f"h=[{h[0]:.3f}, {h[1]:.3f}] theta=[{theta[0]:.4f}, {theta[1]:.4f}]"
    )
    return 0 if score > plain else 1


if __name__ == "__main__":
    sys.exit(main())
