"""Producers and consumers connected by queues: an ordinary stdlib program."""

import multiprocessing


def produce(tasks, start, count):
    for n in range(start, start + count):
        tasks.put(n)


def consume(tasks, results):
    while True:
        n = tasks.get()
        if n is None:
            break
        results.put((n, n * n))


if __name__ == "__main__":
    tasks = multiprocessing.Queue()
    results = multiprocessing.Queue()
    producers = [
        multiprocessing.Process(target=produce, args=(tasks, i * 100, 100))
        for i in range(2)
    ]
    consumers = [
        multiprocessing.Process(target=consume, args=(tasks, results)) for _ in range(3)
    ]
    for p in producers + consumers:
        p.start()
    for p in producers:
        p.join()
    for _ in consumers:
        tasks.put(None)
    squares = dict(results.get(timeout=60) for _ in range(200))
    for c in consumers:
        c.join()
    print("items:", len(squares))
    print("sum of squares:", sum(squares.values()))
    print("first five:", [squares[n] for n in range(5)])
    print("exit codes:", [p.exitcode for p in producers + consumers])
