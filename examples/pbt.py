"""Population-based training: trainer Processes, an AsyncManager scoreboard, a Queue.

PBT (Jaderberg et al. 2017) trains a population of models at the same time,
each with its own hyperparameters, and every so often lets the bad ones take
over the good ones: *exploit* (copy the weights, optimizer state and
hyperparameters of a better member) and *explore* (perturb the copied
hyperparameters).  The population thus searches hyperparameters and trains in
one run, and can find schedules (hyperparameters that change as training goes
on) where a search over fixed settings finds one setting.

The task: fit a small MLP (1 -> 32 -> 32 -> 1, tanh) to a noisy wave,
``y = sin(3 pi x) (1 - x/2) + noise``, with minibatch SGD and momentum.  The
two hyperparameters matter a lot and interact: a small learning rate crawls, a
large one (or a large one with high momentum) diverges, and the best one early
is too noisy late.  Members start from a log-uniform learning rate in
``--lr-range`` and a momentum drawn uniformly from [0, 0.99].

Rounds, as in the paper's truncation selection:

1. every member trains ``--steps`` SGD steps and posts its validation loss,
   weights and hyperparameters to the scoreboard;
2. once the whole population has posted the round, the scoreboard ranks it: the
   bottom ``--fraction`` each copy a member of the top ``--fraction`` (chosen at
   random), and perturb its learning rate and momentum by x0.8 or x1.2 each;
3. a diverged member (loss inf or nan) ranks last, so it is replaced first.

The cluster pieces, as a researcher would use them:

* every member is a ``Process`` on a Dask worker host (a real OS process; 8 of
  them share 2 cores as stdlib processes would);
* the scoreboard is one object in an ``AsyncManager``: members post their
  round without waiting for the reply, then wait for the round's decision
  (which also lines the members up: nobody runs ahead of the population);
* a ``Queue`` carries one event per member and round to this controller, which
  prints a table row per round, and can save them all (``--events-json``).

Run ``python examples/pbt.py`` (the embedded local Dask cluster): the default,
8 members x 20 rounds x 200 steps, takes about 27 s of CPU in all (9 s of it
training, the rest the cluster's and the 8 Processes' start), so well under a
minute on 2 cores.  It saves a
plot (``pbt.png``: loss over time per member, the lineage of copies, and the
hyperparameter schedules PBT found; ``--plot PATH``, ``--no-plot``; needs
matplotlib).  ``--no-exploit`` trains the same population with the same
initial hyperparameters and seeds but never copies: the random search PBT is
compared with.  The last line starts with ``best:``.  The run is deterministic
for a given ``--seed``; with the defaults the best final validation loss is
0.0028 with PBT, every member ends below 0.008, and with ``--no-exploit`` the
best is 0.0070 while half of the members end above 0.03 or diverge.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import queue
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

import fiber_dask as multiprocessing
from fiber_dask.managers import AsyncManager

# ---------------------------------------------------------------- the task


def make_data(seed: int) -> tuple[np.ndarray, ...]:
    """512 noisy training points of the wave, 256 clean validation points."""
    rng = np.random.default_rng([seed, 0])
    x = rng.uniform(-1, 1, (512, 1))
    y = np.sin(3 * np.pi * x) * (1 - 0.5 * x) + 0.1 * rng.standard_normal(x.shape)
    xv = np.linspace(-1, 1, 256)[:, None]
    yv = np.sin(3 * np.pi * xv) * (1 - 0.5 * xv)
    return x, y, xv, yv


def init_params(hidden: int, seed: int) -> list[np.ndarray]:
    """1 -> hidden -> hidden -> 1; the first layer wide enough for the wave."""
    rng = np.random.default_rng([seed, 1])
    return [
        rng.standard_normal((1, hidden)) * 3.0,
        np.zeros(hidden),
        rng.standard_normal((hidden, hidden)) / math.sqrt(hidden),
        np.zeros(hidden),
        rng.standard_normal((hidden, 1)) / math.sqrt(hidden),
        np.zeros(1),
    ]


def forward(p: list[np.ndarray], x: np.ndarray) -> tuple[np.ndarray, ...]:
    h1 = np.tanh(x @ p[0] + p[1])
    h2 = np.tanh(h1 @ p[2] + p[3])
    return h1, h2, h2 @ p[4] + p[5]


def gradients(p: list[np.ndarray], x: np.ndarray, y: np.ndarray) -> list:
    """Backpropagation of the mean squared error."""
    h1, h2, out = forward(p, x)
    d3 = 2 * (out - y) / len(x)
    d2 = (d3 @ p[4].T) * (1 - h2**2)
    d1 = (d2 @ p[2].T) * (1 - h1**2)
    return [x.T @ d1, d1.sum(0), h1.T @ d2, d2.sum(0), h2.T @ d3, d3.sum(0)]


def sgd(p, velocity, h: dict, steps: int, data, rng, batch: int) -> None:
    """``steps`` of minibatch SGD with (heavy-ball) momentum, in place."""
    x, y = data[0], data[1]
    lr, momentum = h["lr"], h["momentum"]
    for _ in range(steps):
        i = rng.integers(0, len(x), batch)
        for k, g in enumerate(gradients(p, x[i], y[i])):
            velocity[k] *= momentum
            velocity[k] -= lr * g
            p[k] += velocity[k]


def validation_loss(p: list[np.ndarray], data) -> float:
    """Mean squared error on the validation points; inf once diverged."""
    loss = float(np.mean((forward(p, data[2])[2] - data[3]) ** 2))
    return loss if math.isfinite(loss) else math.inf


def explore(h: dict, rng: np.random.Generator) -> dict:
    """The paper's perturbation: each hyperparameter times 0.8 or 1.2."""
    lr, momentum = (v * rng.choice((0.8, 1.2)) for v in (h["lr"], h["momentum"]))
    return {"lr": float(min(lr, 10.0)), "momentum": float(min(momentum, 0.99))}


# ----------------------------------------------------------- the scoreboard


class Scoreboard:
    """The population's rounds: scores, and the snapshots the bottom copy.

    Lives in the manager's server process; members call it through proxies,
    each from its own connection (one server thread per connection, so a
    member waiting in :meth:`decide` does not hold the others up)."""

    def __init__(
        self, population: int, rounds: int, fraction: float, exploit: bool, seed: int
    ) -> None:
        self.population, self.rounds_total = population, rounds
        self.exploit, self.seed = exploit, seed
        cut = max(1, round(population * fraction))
        self.cut = min(cut, population // 2)  # top and bottom never overlap
        self.rounds: dict[int, dict[int, tuple]] = {}  # round -> member -> report
        self.plans: dict[int, dict[int, tuple]] = {}  # round -> copier -> snapshot
        self.changed = threading.Condition()

    def report(self, member: int, rnd: int, loss: float, h: dict, params, velocity):
        """Post ``member``'s state after round ``rnd``."""
        with self.changed:
            posted = self.rounds.setdefault(rnd, {})
            posted[member] = (loss, h, params, velocity)
            if len(posted) == self.population:
                self.plans[rnd] = self._truncation(rnd, posted)
                # The snapshots the copiers need are in the plan; free the rest.
                self.rounds.pop(rnd)
                self.changed.notify_all()

    def _truncation(self, rnd: int, posted: dict) -> dict[int, tuple]:
        """Each of the bottom ``cut`` gets a random member of the top ``cut``."""
        # Round 0 is untrained (nothing to copy), the last round has no sequel.
        if not self.exploit or rnd in (0, self.rounds_total):
            return {}
        ranked = sorted(posted, key=lambda m: (posted[m][0], m))  # nan/inf last
        top, bottom = ranked[: self.cut], ranked[-self.cut :]
        rng = np.random.default_rng([self.seed, rnd, 2])
        plan = {}
        for copier in bottom:
            source = int(rng.choice(top))
            _, h, params, velocity = posted[source]
            plan[copier] = (source, h, params, velocity)
        return plan

    def decide(self, member: int, rnd: int, timeout: float):
        """Wait until everyone posted ``rnd``; then ``None`` (carry on) or
        ``(source, hyperparameters, params, velocity)`` to copy."""
        with self.changed:
            if not self.changed.wait_for(lambda: rnd in self.plans, timeout):
                got = len(self.rounds.get(rnd, {}))
                raise TimeoutError(
                    f"round {rnd}: only {got} of {self.population} members posted "
                    f"within {timeout:g} s; has a member failed? (--timeout)"
                )
            return self.plans[rnd].get(member)


class PBTManager(AsyncManager):
    pass


PBTManager.register("Scoreboard", Scoreboard)


# -------------------------------------------------------------- a member


def member(ident: int, h: dict, board: Any, events: Any, cfg: dict) -> None:
    """One trainer: train a round, post it, copy if told to, explore, repeat."""
    np.seterr(all="ignore")  # a diverging member is part of the search, not noise
    data = make_data(cfg["seed"])
    params = init_params(cfg["hidden"], cfg["seed"] * 1000 + ident)
    velocity = [np.zeros_like(a) for a in params]
    loss = validation_loss(params, data)
    start = end = time.time()
    for rnd in range(cfg["rounds"] + 1):
        if rnd:  # round 0 is the start line: everyone's untrained loss
            rng = np.random.default_rng([cfg["seed"], ident, rnd])
            start = time.time()
            sgd(params, velocity, h, cfg["steps"], data, rng, cfg["batch"])
            end = time.time()
            loss = validation_loss(params, data)
        board.report(ident, rnd, loss, h, params, velocity)  # no waiting for it
        decision = board.decide(ident, rnd, cfg["timeout"]).get(cfg["timeout"] + 30)
        event = {
            "member": ident,
            "round": rnd,
            "loss": loss,
            "lr": h["lr"],
            "momentum": h["momentum"],
            "start": start,
            "end": end,
            "copied": None,
        }
        if decision is not None:
            source, source_h, params, velocity = decision
            h = explore(source_h, np.random.default_rng([cfg["seed"], ident, rnd, 3]))
            event.update(copied=int(source), new_lr=h["lr"], new_momentum=h["momentum"])
        events.put(event)


# ----------------------------------------------------------- the controller


def initial_hyperparameters(n: int, lr_range: tuple, seed: int) -> list[dict]:
    """Log-uniform learning rates, uniform momenta: a random search's start."""
    rng = np.random.default_rng([seed, 4])
    lo, hi = math.log(lr_range[0]), math.log(lr_range[1])
    return [
        {
            "lr": float(math.exp(rng.uniform(lo, hi))),
            "momentum": float(rng.uniform(0.0, 0.99)),
        }
        for _ in range(n)
    ]


def fmt_loss(loss: float) -> str:
    return f"{loss:9.5f}" if math.isfinite(loss) else " diverged"


class Table:
    """One row per round, printed once every member has reported it."""

    def __init__(self, population: int) -> None:
        self.population = population
        self.pending: dict[int, list[dict]] = {}
        self.next = 0
        print(
            "round  steps  best loss  member  lr       momentum   median    worst "
            "    exploit: bottom <- top (new lr, momentum)",
            flush=True,
        )

    def add(self, event: dict, steps: int) -> None:
        self.pending.setdefault(event["round"], []).append(event)
        while len(self.pending.get(self.next, ())) == self.population:
            self.row(self.pending.pop(self.next), steps)
            self.next += 1

    def row(self, events: list[dict], steps: int) -> None:
        ranked = sorted(events, key=lambda e: (e["loss"], e["member"]))
        best = ranked[0]
        copies = " ".join(
            f"m{e['member']}<-m{e['copied']}({e['new_lr']:.3g},{e['new_momentum']:.2f})"
            for e in sorted(events, key=lambda e: e["member"])
            if e["copied"] is not None
        )
        print(
            f"{best['round']:5d} {best['round'] * steps:6d}  {fmt_loss(best['loss'])}"
            f"  m{best['member']:<5d} {best['lr']:<8.4f} {best['momentum']:<8.3f}"
            f" {fmt_loss(ranked[len(ranked) // 2]['loss'])}"
            f" {fmt_loss(ranked[-1]['loss'])}    {copies}",
            flush=True,
        )


def lineage(events: list[dict], who: int, rounds: int) -> list[tuple[int, int]]:
    """``[(source, round), ...]``: whose weights ``who`` copied, latest first,
    following the copies back to the member whose initial weights it carries."""
    copied = {
        (e["member"], e["round"]): e["copied"]
        for e in events
        if e["copied"] is not None
    }
    chain, cur = [], who
    for rnd in range(rounds, -1, -1):
        source = copied.get((cur, rnd))
        if source is not None:
            chain.append((source, rnd))
            cur = source
    return chain


def collect(procs: list, events: Any, args: argparse.Namespace, t0: float) -> list:
    """Take every member's event of every round off the Queue, printing a table
    row per round; fail as soon as a member has failed."""
    table = None
    log: list[dict] = []
    expected = args.population * (args.rounds + 1)
    waited = 0.0
    while len(log) < expected:
        try:
            event = events.get(timeout=1.0)
        except queue.Empty:
            failed = [p for p in procs if p.exitcode not in (None, 0)]
            if failed:
                raise RuntimeError(
                    f"{failed[0].name} failed (exit code {failed[0].exitcode}); "
                    "its traceback is above"
                ) from None
            waited += 1.0
            if waited >= args.timeout:
                raise RuntimeError(
                    f"no report from any member for {args.timeout:g} s"
                ) from None
            continue
        waited = 0.0
        event["received"] = time.time()
        log.append(event)
        if table is None:  # round 0 reports once every member is up
            print(
                f"{args.population} member Processes up and lined up after "
                f"{time.perf_counter() - t0:.1f} s",
                flush=True,
            )
            table = Table(args.population)
        table.add(event, args.steps)
    return log


def run(args: argparse.Namespace) -> list[dict]:
    """Train the population; return every event in the order it arrived."""
    hs = initial_hyperparameters(args.population, args.lr_range, args.seed)
    cfg = {
        "rounds": args.rounds,
        "steps": args.steps,
        "batch": args.batch,
        "hidden": args.hidden,
        "seed": args.seed,
        "timeout": args.timeout,
    }
    t0 = time.perf_counter()
    with PBTManager() as manager:
        board = manager.Scoreboard(
            args.population, args.rounds, args.fraction, not args.no_exploit, args.seed
        )
        events = multiprocessing.Queue()
        procs = [
            multiprocessing.Process(
                target=member, args=(i, hs[i], board, events, cfg), name=f"member-{i}"
            )
            for i in range(args.population)
        ]
        started: list = []
        try:
            for p in procs:
                p.start()
                started.append(p)
            log = collect(procs, events, args, t0)
            for p in procs:
                p.join(60)
                if p.exitcode != 0:
                    raise RuntimeError(f"{p.name} ended with exit code {p.exitcode}")
        finally:
            # On an error the others would wait for the missing member until
            # --timeout: stop them now.
            for p in started:
                if p.is_alive():
                    p.terminate()
                    p.join(10)
            events.close()
    return log


def save_plot(log: list[dict], args: argparse.Namespace, path: str) -> str | None:
    """Loss per member over time, the lineage of copies, and the hyperparameter
    schedules, as PBT papers show them; the reason when it cannot."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib)"
    n, rounds = args.population, args.rounds
    at = {(e["member"], e["round"]): e for e in log}
    rs = np.arange(rounds + 1)
    colours = plt.get_cmap("tab10" if n <= 10 else "turbo")
    colour = [colours(i if n <= 10 else i / max(n - 1, 1)) for i in range(n)]

    def series(m: int, key: str) -> np.ndarray:
        v = np.array([at[m, r][key] for r in rs], dtype=float)
        v[~np.isfinite(v)] = np.nan  # a diverged point is a gap
        return v

    fig, axes = plt.subplots(2, 2, figsize=(11, 8), dpi=100)
    ax = axes[0, 0]
    for m in range(n):
        ax.plot(rs * args.steps, series(m, "loss"), color=colour[m], lw=1.2)
        hit = [r for r in rs if at[m, r]["copied"] is not None]
        ax.plot(
            np.array(hit) * args.steps,
            [
                at[m, r]["loss"] if math.isfinite(at[m, r]["loss"]) else np.nan
                for r in hit
            ],
            "x",
            color=colour[m],
            ms=6,
        )
    ax.set(
        yscale="log",
        xlabel="SGD steps",
        ylabel="validation loss (MSE)",
        title="score over time, per member (x: exploited, copies a top member)",
    )

    ax = axes[0, 1]  # lineage: each slot coloured by whose initial weights it carries
    founder = np.zeros((rounds + 1, n), dtype=int)
    founder[0] = np.arange(n)
    for r in rs[1:]:
        for m in range(n):
            src = at[m, r - 1]["copied"]
            founder[r, m] = founder[r - 1, m if src is None else src]
    for r in rs[:-1]:
        for m in range(n):
            src = at[m, r]["copied"]
            if src is None:
                ax.plot([r, r + 1], [m, m], color=colour[founder[r, m]], lw=2.5)
            else:
                ax.annotate(
                    "",
                    xy=(r + 1, m),
                    xytext=(r, src),
                    arrowprops={"arrowstyle": "->", "color": colour[founder[r, src]]},
                )
    for m in range(n):
        ax.scatter(rs, [m] * len(rs), c=[colour[f] for f in founder[:, m]], s=14)
    ax.set(
        xlabel="round",
        ylabel="member",
        yticks=range(n),
        title="lineage: arrows are copies; colour = whose initial weights",
    )
    ax.invert_yaxis()

    for ax, key, label in (
        (axes[1, 0], "lr", "learning rate"),
        (axes[1, 1], "momentum", "momentum"),
    ):
        for m in range(n):
            ax.step(rs, series(m, key), where="post", color=colour[m], lw=1.2)
        ax.set(xlabel="round", ylabel=label, title=f"{label} per member")
    axes[1, 0].set_yscale("log")
    final = sorted((at[m, rounds]["loss"], m) for m in range(n))[0]
    fig.suptitle(
        f"PBT{' (no exploit: random search)' if args.no_exploit else ''}: "
        f"{n} members x {rounds} rounds x {args.steps} steps; best final loss "
        f"{final[0]:.5f} (m{final[1]})"
    )
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return None


# ------------------------------------------------------------------ the CLI

DESCRIPTION = """\
Population-based training (Jaderberg et al. 2017) of a small MLP regression
with SGD and momentum: trainer Processes, an AsyncManager scoreboard and a Queue
of events on fiber-dask's cluster. Each round every member trains --steps
steps and posts its validation loss; the bottom --fraction then copy the
weights and hyperparameters of a random top --fraction member and multiply its
learning rate and momentum by 0.8 or 1.2. Prints a row per round and the final
population, saves a plot, and ends with a line starting "best:"."""

EPILOG = """\
examples:
  python examples/pbt.py                          8 members, well under a minute
  python examples/pbt.py --no-exploit             the same start, never copying
  python examples/pbt.py --population 32 --rounds 40 --plot big.png"""


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--population",
        type=int,
        default=8,
        help="members, one Process each (default: %(default)s)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=20,
        help="rounds of training, ranking and copying (default: %(default)s)",
    )
    p.add_argument(
        "--steps",
        type=int,
        default=200,
        help="SGD steps per member and round (default: %(default)s)",
    )
    p.add_argument(
        "--fraction",
        type=float,
        default=0.25,
        help="the bottom this fraction copy from the top this fraction, at least "
        "one member (default: %(default)s)",
    )
    p.add_argument(
        "--no-exploit",
        action="store_true",
        help="never copy or perturb: the same population as a random search "
        "(default: exploit and explore)",
    )
    p.add_argument(
        "--lr-range",
        type=float,
        nargs=2,
        default=(0.001, 0.3),
        metavar=("LOW", "HIGH"),
        help="the initial learning rates are log-uniform in this range "
        "(default: 0.001 0.3)",
    )
    p.add_argument(
        "--hidden",
        type=int,
        default=32,
        help="units in each of the MLP's two hidden layers (default: %(default)s)",
    )
    p.add_argument(
        "--batch",
        type=int,
        default=32,
        help="minibatch size (default: %(default)s)",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the data, the initial weights and hyperparameters, the "
        "minibatches and the copies (default: %(default)s)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=120.0,
        help="seconds to wait for the rest of the population, or for any report "
        "(default: %(default)s)",
    )
    plot = p.add_mutually_exclusive_group()
    plot.add_argument(
        "--plot",
        default="pbt.png",
        metavar="PATH",
        help="where to save the PNG (default: %(default)s in the current directory)",
    )
    plot.add_argument(
        "--no-plot",
        dest="plot",
        action="store_const",
        const=None,
        help="do not save the plot (default: save it)",
    )
    p.add_argument(
        "--events-json",
        metavar="PATH",
        default=None,
        help="also write every member's report of every round, in the order they "
        "arrived, as JSON (default: not written)",
    )
    a = p.parse_args(argv)
    if a.population < 2 or a.rounds < 1 or a.steps < 1 or a.batch < 1:
        p.error("--population must be >= 2; --rounds, --steps, --batch >= 1")
    if not 0 < a.fraction <= 0.5:
        p.error("--fraction must be in (0, 0.5]: the top and the bottom are disjoint")
    if not 0 < a.lr_range[0] <= a.lr_range[1]:
        p.error("--lr-range needs 0 < LOW <= HIGH")
    return a


def main(argv: Sequence[str] | None = None) -> int:
    a = parse_args(argv)
    t0 = time.perf_counter()
    mode = "never copying" if a.no_exploit else f"truncation {a.fraction:.0%}"
    print(
        f"PBT: {a.population} members x {a.rounds} rounds x {a.steps} SGD steps, "
        f"1-{a.hidden}-{a.hidden}-1 MLP; {mode}",
        flush=True,
    )
    log = run(a)
    if a.events_json:
        with open(a.events_json, "w") as f:
            json.dump(
                {"population": a.population, "rounds": a.rounds, "events": log}, f
            )
    final = sorted(
        (e for e in log if e["round"] == a.rounds),
        key=lambda e: (e["loss"], e["member"]),
    )
    print("final population, best first:")
    print("member      loss  lr        momentum  weights copied from (after round)")
    for e in final:
        chain = lineage(log, e["member"], a.rounds)
        text = " <- ".join(f"m{s} ({r})" for s, r in chain) or "its own"
        print(
            f"m{e['member']:<5d} {fmt_loss(e['loss'])}  {e['lr']:<9.5f} "
            f"{e['momentum']:<9.3f} {text}"
        )
    copies = sum(e["copied"] is not None for e in log)
    if a.plot is not None:
        why = save_plot(log, a, a.plot)
        if why is None:
            print(f"plot: {os.path.abspath(a.plot)}", flush=True)
        else:
            print(f"plot skipped: {why}", flush=True)
    best = final[0]
    print(
        f"best: member {best['member']} validation loss {best['loss']:.5f} "
        f"(lr {best['lr']:.5f}, momentum {best['momentum']:.3f}) after "
        f"{a.rounds * a.steps} steps; {copies} copies; "
        f"{time.perf_counter() - t0:.1f} s in all",
        flush=True,
    )
    return 0 if math.isfinite(best["loss"]) else 1


if __name__ == "__main__":
    sys.exit(main())
