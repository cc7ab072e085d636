"""Data-parallel SGD with torch.distributed on a Ring, driven by a PBT controller.

A ``fiber_dask.experimental.Ring`` of ``--members`` processes (4) on the
cluster sets up ``torch.distributed`` (gloo, CPU) in its initializer, with
rank 0's address and port as the rendezvous, as Fiber's Ring example did.  The
ring then trains a *population* of small models data-parallel: every member
holds its shard of the data and a copy of every model; each step, every
member computes the gradients on a minibatch of its shard, one
``all_reduce`` averages them across the ring, and every member takes the same
SGD-with-momentum step, so the copies stay identical.

The controller, this script's main thread, runs population-based training
(Jaderberg et al. 2017, as ``examples/pbt.py``) over the ring's models: before
each round it hands rank 0 the population (weights, momentum buffers and each
model's learning rate and momentum) through a fiber-dask ``Queue``, rank 0
broadcasts it to the ring, the ring trains ``--steps`` steps, and rank 0 sends
the weights and validation losses back.  The controller prints a row, lets the
bottom ``--fraction`` copy a top model and perturbs the copies'
hyperparameters by x0.8 or x1.2.

The task: fit a 1 -> H -> H -> 1 tanh MLP to ``y = sin(3 pi x)(1 - x/2)``
plus noise (``examples/pbt.py``'s wave).

A member that dies or raises makes ``Ring.run()`` raise instead of leaving
the others blocked in the all-reduce; with ``--max-restarts`` (1 by default)
the ring is formed again and carries on from the controller's last completed
round.  ``--fail-once`` SIGKILLs rank 1 in the middle of one round, once, to
show it.

Run ``python examples/ring_sgd.py`` (the embedded local Dask cluster; needs
torch: ``pip install -e ".[ring]"``).  The defaults, 4 members x 4 models x
8 rounds x 100 steps, take about 20 s on 2 cores, most of it four processes
importing torch; the last line starts with ``best:``.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import math
import os
import queue
import signal
import socket
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

import fiber_dask as multiprocessing
from fiber_dask.experimental import Ring, RingError

# ---------------------------------------------------------------- the task


def make_data(seed: int, n: int) -> tuple[np.ndarray, ...]:
    """``n`` noisy training points of the wave, 256 clean validation points."""
    rng = np.random.default_rng([seed, 0])
    x = rng.uniform(-1, 1, (n, 1))
    y = np.sin(3 * np.pi * x) * (1 - 0.5 * x) + 0.1 * rng.standard_normal(x.shape)
    xv = np.linspace(-1, 1, 256)[:, None]
    yv = np.sin(3 * np.pi * xv) * (1 - 0.5 * xv)
    return x, y, xv, yv


def initial_population(a: argparse.Namespace) -> list[dict]:
    """Weights (scaled normal), zero momentum buffers, log-uniform learning
    rates and uniform momenta; numpy only: the controller never imports torch."""
    rng = np.random.default_rng([a.seed, 1])
    sizes = [(a.hidden, 1), (a.hidden, a.hidden), (1, a.hidden)]
    population = []
    for _ in range(a.population):
        params = []
        for fan_out, fan_in in sizes:
            params.append(rng.standard_normal((fan_out, fan_in)) / math.sqrt(fan_in))
            params.append(np.zeros(fan_out))
        low, high = np.log(a.lr_range[0]), np.log(a.lr_range[1])
        population.append(
            {
                "params": params,
                "velocity": [np.zeros_like(p) for p in params],
                "lr": float(np.exp(rng.uniform(low, high))),
                "momentum": float(rng.uniform(0.0, 0.95)),
                "copied": None,
            }
        )
    return population


def explore(model: dict, rng: np.random.Generator) -> None:
    """PBT's explore: each hyperparameter x0.8 or x1.2 (momentum below 1)."""
    model["lr"] *= float(rng.choice([0.8, 1.2]))
    model["momentum"] = min(model["momentum"] * float(rng.choice([0.8, 1.2])), 0.99)


def exploit(population: list[dict], losses: list[float], a, rng) -> None:
    """Truncation selection: the bottom ``--fraction`` copy a top model."""
    order = sorted(range(len(losses)), key=lambda i: (_rank_key(losses[i]), i))
    cut = max(1, int(len(order) * a.fraction))
    for loser in order[-cut:]:
        winner = int(rng.choice(order[:cut]))
        src = population[winner]
        population[loser] = {
            "params": [p.copy() for p in src["params"]],
            "velocity": [v.copy() for v in src["velocity"]],
            "lr": src["lr"],
            "momentum": src["momentum"],
            "copied": winner,
        }
        explore(population[loser], rng)


def _rank_key(loss: float) -> float:
    return loss if math.isfinite(loss) else math.inf  # diverged: last


# ------------------------------------------------------------ the ring's side


def interface_of(ip: str) -> str | None:
    """The network interface that holds ``ip`` on this host (gloo must use the
    one the ring's address is on: a cluster host often has several)."""
    import fcntl
    import struct

    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                packed = fcntl.ioctl(
                    s.fileno(), 0x8915, struct.pack("256s", name[:15].encode())
                )  # SIOCGIFADDR
            except OSError:
                continue
        if socket.inet_ntoa(packed[20:24]) == ip:
            return name
    return None


def init_gloo(ring: Any, timeout: float) -> None:
    """The Ring's initializer: torch.distributed with rank 0 as the store."""
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # 4 members share the cores
    master = ring.members[0]
    os.environ["MASTER_ADDR"] = master.ip
    os.environ["MASTER_PORT"] = str(master.port)
    ifname = interface_of(ring.members[ring.rank].ip)
    if ifname:
        os.environ["GLOO_SOCKET_IFNAME"] = ifname
    dist.init_process_group(
        "gloo",
        rank=ring.rank,
        world_size=ring.size,
        timeout=datetime.timedelta(seconds=timeout),
    )


class Trainer:
    """The Ring's ``func``: train whatever population the controller sends,
    round after round, until it sends None.  Rank 0 talks to the controller;
    ``dist.broadcast_object_list`` tells the other ranks."""

    def __init__(self, a: argparse.Namespace, to_controller, from_controller):
        self.a = a
        self.to_controller = to_controller
        self.from_controller = from_controller

    def __call__(self, rank: int, size: int) -> int:
        import torch
        import torch.distributed as dist

        a = self.a
        x, y, xv, yv = make_data(a.seed, a.samples)
        shard = slice(rank * len(x) // size, (rank + 1) * len(x) // size)
        x, y = torch.tensor(x[shard]), torch.tensor(y[shard])
        xv, yv = torch.tensor(xv), torch.tensor(yv)
        rounds = 0
        while True:
            order = [None]
            if rank == 0:
                me = os.getpid()
                self.to_controller.put(("ready", me))
                while True:  # an order meant for a ring that failed is stale
                    to, order[0] = self.from_controller.get()
                    if to == me:
                        break
            dist.broadcast_object_list(order, src=0)
            if order[0] is None:
                break
            self.train_round(order[0], rank, size, x, y, xv, yv)
            rounds += 1
        dist.destroy_process_group()
        return rounds

    def train_round(self, order, rank, size, x, y, xv, yv) -> None:
        import torch
        import torch.distributed as dist

        a = self.a
        rnd = order["round"]
        models = [
            [torch.tensor(p, requires_grad=True) for p in m["params"]]
            for m in order["population"]
        ]
        velocity = [
            [torch.tensor(v) for v in m["velocity"]] for m in order["population"]
        ]
        hyper = [(m["lr"], m["momentum"]) for m in order["population"]]
        rng = np.random.default_rng([a.seed, 2, rnd, rank])
        before = self.validation_losses(models, xv, yv) if rank == 0 else None
        for step in range(a.steps):
            failing = a.fail_once and rank == 1 and rnd == a.rounds // 2
            if failing and step == a.steps // 2 and not os.path.exists(a.fail_once):
                open(a.fail_once, "w").close()
                os.kill(os.getpid(), signal.SIGKILL)  # mid-round, once
            idx = torch.from_numpy(rng.integers(0, len(x), a.batch))
            for params in models:
                loss = ((forward(params, x[idx]) - y[idx]) ** 2).mean()
                loss.backward()
            # One all-reduce for every model's gradients: their mean.
            grads = torch.cat([p.grad.reshape(-1) for ps in models for p in ps])
            dist.all_reduce(grads)
            grads /= size
            at = 0
            with torch.no_grad():
                for params, vel, (lr, mom) in zip(models, velocity, hyper, strict=True):
                    for p, v in zip(params, vel, strict=True):
                        g = grads[at : at + p.numel()].view_as(p)
                        at += p.numel()
                        v.mul_(mom).add_(g)
                        p.sub_(lr * v)
                        p.grad = None
        if rank == 0:
            self.to_controller.put(
                (
                    "round",
                    rnd,
                    before,
                    self.validation_losses(models, xv, yv),
                    [[p.detach().numpy() for p in ps] for ps in models],
                    [[v.numpy() for v in vs] for vs in velocity],
                )
            )

    @staticmethod
    def validation_losses(models, xv, yv) -> list[float]:
        import torch

        with torch.no_grad():
            return [float(((forward(ps, xv) - yv) ** 2).mean()) for ps in models]


def forward(params, x):
    import torch

    w1, b1, w2, b2, w3, b3 = params
    h = torch.tanh(x @ w1.T + b1)
    h = torch.tanh(h @ w2.T + b2)
    return h @ w3.T + b3


# ------------------------------------------------------------ the controller


def fmt(loss: float) -> str:
    return f"{loss:9.5f}" if math.isfinite(loss) else "  diverged"


def control(a: argparse.Namespace) -> tuple[list[float], list[dict], Ring]:
    """Run the ring in a thread and PBT over its rounds; the final losses."""
    to_controller, from_controller = multiprocessing.Queue(), multiprocessing.Queue()
    ring = Ring(
        a.members,
        Trainer(a, to_controller, from_controller),
        init_gloo,
        (a.timeout,),
        max_restarts=a.max_restarts,
    )
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["rounds"] = ring.run()
        except RingError as e:
            outcome["error"] = e

    runner = threading.Thread(target=run, name="ring", daemon=True)
    runner.start()
    population = initial_population(a)
    rng = np.random.default_rng([a.seed, 3])
    losses: list[float] = []
    rnd = 0
    while runner.is_alive() or not to_controller.empty():
        try:
            msg = to_controller.get(timeout=0.2)
        except queue.Empty:
            continue
        if msg[0] == "ready":  # rank 0 of a ring (a new one after a restart)
            order = None
            if rnd < a.rounds:
                order = {"round": rnd, "population": population}
            from_controller.put((msg[1], order))
            continue
        _, done, before, losses, params, velocity = msg
        if done != rnd:
            continue  # a round reported by a ring that failed right after
        if rnd == 0:
            print(
                "start      best "
                f"{fmt(min(before, key=_rank_key)).strip()}  losses "
                + " ".join(fmt(x).strip() for x in before),
                flush=True,
            )
        for model, p, v in zip(population, params, velocity, strict=True):
            model["params"], model["velocity"] = p, v
        copies = [
            f"m{i}<-m{m['copied']}"
            for i, m in enumerate(population)
            if m["copied"] is not None
        ]
        best = min(range(len(losses)), key=lambda i: _rank_key(losses[i]))
        print(
            f"round {rnd + 1:3d}  best m{best} {fmt(losses[best])}  losses "
            + " ".join(fmt(x).strip() for x in losses)
            + f"  copied before: {' '.join(copies) or '-'}  restarts {ring.restarts}",
            flush=True,
        )
        rnd += 1
        for model in population:
            model["copied"] = None
        if rnd < a.rounds and a.population > 1:
            exploit(population, losses, a, rng)
    runner.join()
    if "error" in outcome:
        raise outcome["error"]
    return losses, population, ring


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Data-parallel SGD with torch.distributed (gloo) on a "
        "fiber_dask.experimental.Ring, driven by a population-based-training "
        "controller.",
    )
    p.add_argument(
        "--members", type=int, default=4, help="ring size (default: %(default)s)"
    )
    p.add_argument(
        "--population",
        type=int,
        default=4,
        help="models the ring trains side by side (default: %(default)s)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=8,
        help="rounds of training, ranking and copying (default: %(default)s)",
    )
    p.add_argument(
        "--steps",
        type=int,
        default=100,
        help="data-parallel SGD steps per round (default: %(default)s)",
    )
    p.add_argument(
        "--batch",
        type=int,
        default=32,
        help="minibatch size of each member (default: %(default)s)",
    )
    p.add_argument(
        "--samples",
        type=int,
        default=1024,
        help="training points, split among the members (default: %(default)s)",
    )
    p.add_argument(
        "--hidden",
        type=int,
        default=32,
        help="units in each of the two hidden layers (default: %(default)s)",
    )
    p.add_argument(
        "--fraction",
        type=float,
        default=0.25,
        help="the bottom this fraction copy from the top this fraction, at least "
        "one model (default: %(default)s)",
    )
    p.add_argument(
        "--lr-range",
        type=float,
        nargs=2,
        default=(0.003, 0.3),
        metavar=("LOW", "HIGH"),
        help="initial learning rates, log-uniform (default: 0.003 0.3)",
    )
    p.add_argument(
        "--max-restarts",
        type=int,
        default=1,
        help="times the ring is formed again after a member fails "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--fail-once",
        metavar="PATH",
        default=None,
        help="SIGKILL rank 1 mid-round once, remembered by creating PATH, to "
        "show a restart (default: no failure)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=60.0,
        help="seconds torch.distributed waits for a peer (default: %(default)s)",
    )
    p.add_argument(
        "--seed", type=int, default=0, help="seed of everything (default: %(default)s)"
    )
    a = p.parse_args(argv)
    if a.members < 1 or a.population < 1 or a.rounds < 1 or a.steps < 1:
        p.error("--members, --population, --rounds and --steps must be >= 1")
    if a.samples < a.members:
        p.error("--samples must be at least --members (each needs a shard)")
    return a


def main(argv: Sequence[str] | None = None) -> int:
    a = parse_args(argv)
    # The members import torch; the controller only needs to know it is there.
    if importlib.util.find_spec("torch") is None:
        print("ring_sgd.py needs torch: pip install -e '.[ring]'", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    print(
        f"Ring of {a.members} (torch {importlib.metadata.version('torch')}, "
        f"gloo): {a.population} "
        f"models x {a.rounds} rounds x {a.steps} data-parallel steps, "
        f"1-{a.hidden}-{a.hidden}-1 MLP, {a.samples} samples",
        flush=True,
    )
    try:
        losses, population, ring = control(a)
    except RingError as e:
        print(f"the ring failed: {e}", flush=True)
        return 1
    best = min(range(len(losses)), key=lambda i: _rank_key(losses[i]))
    print(
        f"best: model {best} validation loss {losses[best]:.5f} (lr "
        f"{population[best]['lr']:.4f}, momentum {population[best]['momentum']:.3f})"
        f" after {a.rounds} rounds; ring members on "
        f"{sorted({m.ip for m in ring.members})}; {ring.restarts} restarts; "
        f"{time.perf_counter() - t0:.1f} s",
        flush=True,
    )
    return 0 if math.isfinite(losses[best]) else 1


if __name__ == "__main__":
    sys.exit(main())
