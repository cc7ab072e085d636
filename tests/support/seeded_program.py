"""A seeded program, run as a user runs it, under the stdlib or fiber-dask
(tests/test_random_state.py).

``python seeded_program.py std|fiber SCENARIO``: the same code with
``multiprocessing`` (the oracle) or ``fiber_dask`` as its multiprocessing;
prints one JSON line: what the program drew from ``random`` and
``numpy.random`` between its operations (or, for ``slots``, what its tasks
drew).  Task functions are defined here, in ``__main__``: fiber-dask sends
them by value, the stdlib's fork children have them.

:func:`settle` lets the cluster's background work happen (a few Dask
heartbeats, a few reports of the open pools' numbers to the scheduler, both
handled in this process by the embedded scheduler), waiting on those events,
not on time; under the stdlib there is no such work and it returns at once.
"""

from __future__ import annotations

import json
import os
import random
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from support.wait import wait_until  # noqa: E402

MODE, SCENARIO = sys.argv[1], sys.argv[2]
if MODE == "std":
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor
else:
    import fiber_dask as mp
    from fiber_dask.futures import ProcessPoolExecutor


def square(x):
    return len(x) if isinstance(x, list) else x * x


def produce(q, n):
    for i in range(n):
        q.put(list(range(i, i + 30)))  # lists long enough for dask.sizeof to sample


def settle(times: int = 2) -> None:
    """Wait until every worker's heartbeat and every open pool's report have
    reached the embedded scheduler ``times`` more times."""
    if MODE == "std":
        return
    from fiber_dask import cluster

    scheduler = cluster.get_handle().cluster.scheduler  # waits for its start
    store = scheduler.extensions.get("fiber-pools")

    def marks():
        beats = {a: ws.last_seen for a, ws in scheduler.workers.items()}
        reports = dict(store.pools) if store is not None else {}
        return beats, reports

    seen: dict = {}
    last = marks()

    def advanced():
        nonlocal last
        now = marks()
        for kind, before, after in (
            ("beat", last[0], now[0]),
            ("pool", last[1], now[1]),
        ):
            for key, value in after.items():
                if key in before and before[key] is not value:
                    seen[kind, key] = seen.get((kind, key), 0) + 1
        last = now
        beats = [seen.get(("beat", a), 0) for a in now[0]]
        pools = [seen.get(("pool", p), 0) for p in now[1]]
        # Every worker; a pool (a closed one may linger until the scheduler drops it).
        return beats and min(beats) >= times and (not pools or max(pools) >= times)

    wait_until(
        advanced, 60, f"{times} heartbeats of each worker and reports of each pool"
    )


def draw(out: dict, label: str) -> None:
    out.setdefault("draws", []).append(
        [label, random.random(), random.getrandbits(32), float(np.random.random())]
    )


def seed(n: int) -> None:
    random.seed(n)
    np.random.seed(n)


def owner() -> dict:
    """The program's own streams around every kind of operation."""
    sections: dict = {}
    # The program: seeded, then a pool (the embedded cluster starts here).
    out = sections["pool_after_seed"] = {}
    seed(64)
    draw(out, "seeded")
    with mp.Pool(2) as pool:
        pool.map(square, range(100))
        draw(out, "map")
        list(pool.imap(square, range(50), chunksize=3))
        draw(out, "imap")
        [pool.apply_async(square, (i,)).get(timeout=60) for i in range(5)]
        draw(out, "apply_async")
        pool.map(square, [list(range(40))] * 4)
        draw(out, "map of lists")
    draw(out, "closed")

    # A pool opened before the program seeds, left idle.
    out = sections["pool_before_seed"] = {}
    pool = mp.Pool(2)
    pool.map(square, range(10))
    seed(65)
    draw(out, "seeded")
    settle()
    draw(out, "idle")
    pool.map(square, range(50))
    draw(out, "map")

    # Processes, queues, managers and the executor, with that pool open.
    out = sections["processes_queues_managers"] = {}
    seed(66)
    draw(out, "seeded")
    q = mp.Queue()
    p = mp.Process(target=produce, args=(q, 5))
    p.start()
    got = [q.get(timeout=60) for _ in range(5)]
    p.join(60)
    out["process"] = [p.exitcode, len(got)]
    draw(out, "process and queue")
    with mp.Manager() as manager:
        d = manager.dict()
        d["xs"] = list(range(40))
        d.update({str(i): i for i in range(20)})
        out["manager"] = [len(d["xs"]), len(d.keys())]
        draw(out, "manager dict")
    with ProcessPoolExecutor(2) as ex:
        out["executor"] = [
            sum(ex.map(square, range(20))),
            ex.submit(square, 3).result(),
        ]
        draw(out, "executor")
    settle()
    draw(out, "settled")
    pool.close()
    pool.join()
    draw(out, "pool joined")

    if MODE == "fiber":
        sections["bind_global_random"] = binders()
    return sections


def binders() -> list[str]:
    """Modules loaded here whose globals draw from the global generator."""
    inst = random.random.__self__
    found = []
    for name, module in list(sys.modules.items()):
        if name in ("random", "__main__", "__mp_main__") or module is None:
            continue
        for value in list(getattr(module, "__dict__", {}).values()):
            if value is random or getattr(value, "__self__", None) is inst:
                found.append(name)
                break
    return sorted(found)


def evaluate(individual):
    return (sum(individual),)


def deap_ga() -> dict:
    """deap's OneMax example (examples/ga/onemax_mp.py), smaller."""
    from deap import algorithms, base, creator, tools

    creator.create("FitnessMax", base.Fitness, weights=(1.0,))
    creator.create("Individual", list, fitness=creator.FitnessMax)
    toolbox = base.Toolbox()
    toolbox.register("attr_bool", random.randint, 0, 1)
    toolbox.register(
        "individual", tools.initRepeat, creator.Individual, toolbox.attr_bool, 50
    )
    toolbox.register("population", tools.initRepeat, list, toolbox.individual)
    toolbox.register("evaluate", evaluate)
    toolbox.register("mate", tools.cxTwoPoint)
    toolbox.register("mutate", tools.mutFlipBit, indpb=0.05)
    toolbox.register("select", tools.selTournament, tournsize=3)
    random.seed(64)
    with mp.Pool(2) as pool:
        generations = []

        def evaluations(func, items):
            results = pool.map(func, items)
            generations.append(len(items))
            if len(generations) == 3:
                settle(1)  # one generation's evaluations take a while
            return results

        toolbox.register("map", evaluations)
        pop = toolbox.population(n=60)
        hof = tools.HallOfFame(1)
        pop, log = algorithms.eaSimple(
            pop, toolbox, cxpb=0.5, mutpb=0.2, ngen=12, halloffame=hof, verbose=False
        )
    return {
        "best": list(hof[0]),
        "fitness": [ind.fitness.values[0] for ind in pop],
        "evaluations": generations,
        "next": random.random(),
    }


def log_prob(x):
    return -0.5 * float(np.sum(x**2))


def emcee_run() -> dict:
    """emcee's EnsembleSampler(pool=pool), then a bootstrap of its chain."""
    import emcee

    seed(42)
    nwalkers, ndim = 10, 3
    p0 = np.random.randn(nwalkers, ndim)
    with mp.Pool(2) as pool:
        sampler = emcee.EnsembleSampler(nwalkers, ndim, log_prob, pool=pool)
        for step, _ in enumerate(sampler.sample(p0, iterations=40)):
            if step == 5:
                settle(1)
    flat = sampler.get_chain(flat=True)
    picks = random.sample(range(len(flat)), 50)  # a bootstrap of the chain
    return {
        "chain": float(flat.sum()),
        "acceptance": sampler.acceptance_fraction.tolist(),
        "bootstrap": float(flat[picks].mean()),
        "next": [random.random(), float(np.random.random())],
    }


_ran = 0


def seed_worker(n):
    seed(n)


def task_draws(x):
    global _ran
    _ran += 1
    return [os.getpid(), _ran, random.random(), float(np.random.random())]


def dask_sizes_in_task(_):
    """Whether Dask's code in this task's process (a thread slot's Dask
    worker) leaves the task's random state alone."""
    import dask.sizeof

    state = random.getstate()
    dask.sizeof.sizeof(list(range(100)))  # as the worker sizes its messages
    return random.getstate() == state


def slots() -> dict:
    """What tasks draw in their worker after an initializer seeded it."""
    out: dict = {}
    with mp.Pool(2, initializer=seed_worker, initargs=(7,)) as pool:
        rows = pool.map(task_draws, range(20), chunksize=1)
        settle()
        rows += pool.map(task_draws, range(20), chunksize=1)
        if MODE == "fiber" and os.environ.get("DASK_FIBER__POOL__SLOTS") == "thread":
            out["dask_draws_privately"] = all(pool.map(dask_sizes_in_task, range(4)))
    streams: dict = {}
    for pid, ran, r, n in sorted(rows, key=lambda row: (row[0], row[1])):
        streams.setdefault(str(pid), []).append([ran, r, n])
    out["streams"] = list(streams.values())
    return out


if __name__ == "__main__":
    if SCENARIO == "clients":
        result = {"deap": deap_ga(), "emcee": emcee_run()}
    else:
        result = {"owner": owner, "slots": slots}[SCENARIO]()
    print(json.dumps(result))
