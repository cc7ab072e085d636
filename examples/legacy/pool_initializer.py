"""A Pool whose workers are set up by an initializer: an ordinary stdlib program."""

import multiprocessing as mp

_table = None


def init(offset):
    global _table
    _table = {n: n + offset for n in range(100)}


def lookup(n):
    return _table[n]


def weighted(n, weight):
    return _table[n] * weight


if __name__ == "__main__":
    collected = []
    with mp.Pool(processes=2, initializer=init, initargs=(1000,)) as pool:
        print("map:", pool.map(lookup, range(10)))
        print("imap:", list(pool.imap(lookup, range(5), chunksize=2)))
        print("unordered:", sorted(pool.imap_unordered(lookup, range(5))))
        print("starmap:", pool.starmap(weighted, [(1, 2), (2, 3)]))
        for n in range(3):
            pool.apply_async(lookup, (n,), callback=collected.append)
        pool.close()
        pool.join()
    print("callbacks:", sorted(collected))
    try:
        with mp.Pool(2, initializer=init, initargs=(0,)) as pool:
            pool.apply(lookup, (1000,))
    except KeyError as e:
        print("error:", type(e).__name__, e)
