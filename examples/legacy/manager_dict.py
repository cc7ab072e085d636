"""Workers filling a Manager dict and list: an ordinary stdlib program."""

from multiprocessing import Manager, Pool, Process


def fill(shared, log, worker):
    for i in range(5):
        shared[f"w{worker}-{i}"] = worker * 10 + i
    log.append(worker)


def count_words(args):
    counts, lock, text = args
    for word in text.split():
        with lock:
            counts[word] = counts.get(word, 0) + 1
    return len(text.split())


if __name__ == "__main__":
    with Manager() as manager:
        shared = manager.dict()
        log = manager.list()
        workers = [Process(target=fill, args=(shared, log, w)) for w in range(4)]
        for p in workers:
            p.start()
        for p in workers:
            p.join()
        print("keys:", len(shared))
        print("values:", sorted(shared.values()))
        print("workers done:", sorted(log))

        counts, lock = manager.dict(), manager.Lock()
        lines = ["the quick brown fox", "the lazy dog", "the end"] * 4
        with Pool(2) as pool:
            words = pool.map(count_words, [(counts, lock, line) for line in lines])
        print("words per line:", words)
        print("counts:", sorted(counts.items()))
