"""Actors and a learner: Processes, a Queue and Pipes learning CartPole-v1.

The shape of IMPALA-style reinforcement learning, on the stdlib API:

* ``--actors`` actor Processes each step their own CartPole environment with
  the newest policy they have, and put every finished episode (observations,
  actions, the weights' version) on one shared ``Queue``;
* the learner (this process) takes episodes off the Queue, and once every
  actor's share of ``--batch`` episodes played with its current weights is in,
  makes a policy-gradient step (REINFORCE with a normalised reward-to-go
  baseline, Adam), then sends the new weights to every actor through that
  actor's ``Pipe``;
* an episode played with old weights would be counted and dropped, so every
  update is on-policy.

Each episode's randomness is seeded by (``--seed``, actor, weights' version,
episode number), and a batch is every actor's share in that order, whichever
actor's episodes arrive first: the same seed trains the same policy on any
schedule, under fiber-dask as under the stdlib, on an idle machine or a busy
one.

At the end the learner sends ``None`` down every Pipe, keeps draining the Queue
until every actor has exited (an actor that still has items to flush cannot
exit: the stdlib's own rule), joins them, and plays its final policy greedily.

Runs on the embedded Dask cluster by default; ``--engine multiprocessing`` runs
the very same code on the standard library::

    python examples/actor_learner.py
    python examples/actor_learner.py --engine multiprocessing --actors 2

The environment and the engine switch come from ``es.py`` beside this file
(Gymnasium's CartPole-v1 when installed, else its numpy-only copy).  The last
line printed starts with ``final:``; the exit status is 0 when the greedy
policy's mean reward reached ``--target``.
"""

from __future__ import annotations

import argparse
import os
import queue
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import es  # noqa: E402  (CartPole environments and the engine switch)

GAMMA = 0.99


def probability_right(params: np.ndarray, obs: np.ndarray) -> np.ndarray:
    """The policy: a logistic unit on the observation (and a bias)."""
    z = obs @ params[:4] + params[4]
    return 1.0 / (1.0 + np.exp(-np.clip(z, -30, 30)))


def actor(
    index: int, weights: Any, episodes: Any, env_kind: str, seed: int, share: int
) -> None:
    """Play ``share`` episodes with each version of the weights, always the
    newest that has arrived, until ``None`` arrives."""
    env = es.make_env(env_kind)
    version, params = -1, None
    n = 0
    while True:
        # Wait for new weights once the share is played (the learner has what
        # it needs from us), else take the newest that has arrived, if any.
        while params is None or n >= share or weights.poll():
            msg = weights.recv()
            if msg is None:
                return
            version, params = msg
            n = 0
        # Seeded by what the episode is, not by how many came before it.
        rng = np.random.default_rng([seed, index, version, n])
        obs, _ = env.reset(seed=int(rng.integers(2**31)))
        observations, actions = [], []
        while True:
            a = int(rng.random() < probability_right(params, obs))
            observations.append(obs)
            actions.append(a)
            obs, _, terminated, truncated, _ = env.step(a)
            if terminated or truncated:
                break
        episodes.put(
            (index, version, n, np.array(observations), np.array(actions, np.int8))
        )
        n += 1


def reward_to_go(length: int) -> np.ndarray:
    """Discounted sum of the rewards (1 per step) from each step on."""
    k = np.arange(length, 0, -1)  # steps left, this one included
    return (1.0 - GAMMA**k) / (1.0 - GAMMA)


def gradient(params: np.ndarray, batch: list) -> np.ndarray:
    """REINFORCE: mean over steps of grad log pi(a|s) times the normalised return."""
    obs = np.concatenate([o for o, _ in batch])
    acts = np.concatenate([a for _, a in batch]).astype(float)
    ret = np.concatenate([reward_to_go(len(a)) for _, a in batch])
    ret = (ret - ret.mean()) / (ret.std() + 1e-8)
    p = probability_right(params, obs)
    g = (acts - p) * ret  # d log pi / dz, weighted
    return np.append(g @ obs, g.sum()) / len(batch)


def greedy_score(params: np.ndarray, env_kind: str, episodes: int) -> float:
    env = es.make_env(env_kind)
    total = 0.0
    for i in range(episodes):
        obs, _ = env.reset(seed=2_000_000 + i)
        while True:
            obs, r, terminated, truncated, _ = env.step(
                int(probability_right(params, obs) > 0.5)
            )
            total += r
            if terminated or truncated:
                break
    return total / episodes


DESCRIPTION = """\
Actors and a learner, IMPALA-style, on the multiprocessing API: actor Processes
play CartPole-v1 and put their episodes on one Queue; the learner makes a
policy-gradient step (REINFORCE, Adam) every --batch episodes played with its
current weights and sends the new weights to every actor through its Pipe.
The same --seed trains the same policy on every run and engine. Ends with a
line starting "final:" (exit status 0 when the greedy policy's mean reward
reaches --target)."""

EPILOG = """\
examples:
  python examples/actor_learner.py
  python examples/actor_learner.py --engine multiprocessing --actors 2"""


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
        help="whose Process, Queue and Pipe to use (default: %(default)s)",
    )
    p.add_argument(
        "--actors", type=int, default=3, help="actor Processes (default: %(default)s)"
    )
    p.add_argument(
        "--batch",
        type=int,
        default=16,
        help="episodes per update (default: %(default)s)",
    )
    p.add_argument(
        "--updates",
        type=int,
        default=100,
        help="updates at most (default: %(default)s)",
    )
    p.add_argument(
        "--lr", type=float, default=0.2, help="Adam step size (default: %(default)s)"
    )
    p.add_argument(
        "--target",
        type=float,
        default=es.SOLVED,
        help="stop once a batch's mean reward reaches this; also the bar for the "
        "final greedy score (default: %(default)s)",
    )
    p.add_argument(
        "--final-episodes",
        type=int,
        default=20,
        help="episodes of the final greedy policy (default: %(default)s)",
    )
    p.add_argument(
        "--env",
        choices=["auto", "gymnasium", "builtin"],
        default="auto",
        help="CartPole-v1 from gymnasium, or the numpy-only copy in es.py; auto: "
        "gymnasium when installed (default: %(default)s)",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the actors' episodes and actions (default: %(default)s)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=120.0,
        help="seconds to wait for an episode (default: %(default)s)",
    )
    a = p.parse_args(argv)
    if a.actors < 1 or a.batch < 1 or a.updates < 1:
        p.error("--actors, --batch and --updates must be >= 1")
    if a.env == "auto":
        a.env = es.env_kinds()[0]
    return a


def main(argv: Sequence[str] | None = None) -> int:
    a = parse_args(argv)
    mp = es.engine(a.engine)
    if a.engine == "fiber_dask":
        # es.py is a plain file beside this script, not an installed module: ship
        # its code with the actors' targets so workers elsewhere need no copy.
        import cloudpickle

        cloudpickle.register_pickle_by_value(es)
    t0 = time.perf_counter()
    # Each actor plays its share of every batch: the batch is the same
    # episodes whichever actor is quicker (slower, the update waits for it).
    shares = [a.batch // a.actors + (i < a.batch % a.actors) for i in range(a.actors)]
    episodes = mp.Queue()
    pipes = [mp.Pipe(duplex=False) for _ in range(a.actors)]
    actors = [
        mp.Process(
            target=actor,
            args=(i, pipes[i][0], episodes, a.env, a.seed, shares[i]),
            name=f"actor-{i}",
        )
        for i in range(a.actors)
    ]
    started: list = []

    params = np.zeros(5)
    opt = es.Adam(params.size, a.lr)
    version, got = 0, {}  # (actor, episode number) -> this version's episode
    played = stale = 0
    first = last = float("nan")
    updates = 0
    waited = 0.0  # seconds without an episode

    def broadcast() -> None:
        for _, send in pipes:
            send.send((version, params))

    try:
        for p in actors:
            p.start()
            started.append(p)
        print(
            f"{es.env_description(a.env)}; {a.engine}: {a.actors} actor Processes, "
            f"started in {time.perf_counter() - t0:.2f} s",
            flush=True,
        )
        broadcast()
        while updates < a.updates:
            try:
                index, ver, n, obs, acts = episodes.get(timeout=1.0)
            except queue.Empty:
                failed = [p for p in actors if p.exitcode not in (None, 0)]
                if failed:
                    raise RuntimeError(
                        f"{failed[0].name} failed (exit code {failed[0].exitcode})"
                    ) from None
                waited += 1.0
                if waited >= a.timeout:
                    raise RuntimeError(
                        f"no episode from any actor for {a.timeout:g} s"
                    ) from None
                continue
            waited = 0.0
            played += 1
            if ver != version:
                stale += 1
                continue
            got[index, n] = (obs, acts)
            if len(got) < a.batch:
                continue
            batch = [got[k] for k in sorted(got)]  # the same order on any schedule
            returns = [len(acts) for _, acts in batch]
            params = params + opt.step(gradient(params, batch))
            version += 1
            updates += 1
            broadcast()
            last = float(np.mean(returns))
            if updates == 1:
                first = last
            filled = int(20 * last / es.MAX_STEPS)
            print(
                f"update {updates:3d}  batch mean reward {last:6.1f}  "
                f"episodes {played:5d} ({stale} stale)  "
                f"{time.perf_counter() - t0:6.1f} s  "
                f"|{'#' * filled}{' ' * (20 - filled)}|",
                flush=True,
            )
            got = {}
            if last >= a.target:
                break
    finally:
        for _, send in pipes:
            try:
                send.send(None)
            except OSError:
                pass
        # Keep the Queue drained until every actor is gone.
        deadline = time.monotonic() + 60
        while any(p.is_alive() for p in started) and time.monotonic() < deadline:
            try:
                episodes.get(timeout=0.1)
            except queue.Empty:
                pass
        for p in started:
            p.join(5)
            if p.is_alive():
                print(f"warning: {p.name} did not stop; terminating it", flush=True)
                p.terminate()
                p.join()
        for recv, send in pipes:
            recv.close()
            send.close()
        episodes.close()

    score = greedy_score(params, a.env, a.final_episodes)
    codes = [p.exitcode for p in actors]
    print(
        f"final: greedy policy mean reward {score:.1f} over {a.final_episodes} "
        f"episodes; batch mean reward {first:.1f} -> {last:.1f} in {updates} "
        f"updates, {played} episodes ({stale} stale); actor exit codes "
        f"{codes}; {time.perf_counter() - t0:.1f} s",
        flush=True,
    )
    return 0 if score >= a.target and not any(codes) else 1


if __name__ == "__main__":
    sys.exit(main())
