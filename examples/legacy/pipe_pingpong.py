"""Ping-pong over a Pipe, and a lock-protected shared counter: an ordinary
stdlib program."""

from multiprocessing import Lock, Pipe, Process, Value


def player(conn, rounds):
    for _ in range(rounds):
        ball = conn.recv()
        conn.send(ball + 1)
    conn.close()


def add(counter, lock, times):
    for _ in range(times):
        with lock:
            counter.value += 1


if __name__ == "__main__":
    mine, theirs = Pipe()
    p = Process(target=player, args=(theirs, 50))
    p.start()
    ball = 0
    for _ in range(50):
        mine.send(ball + 1)
        ball = mine.recv()
    p.join()
    print("ball after 50 rounds each:", ball)
    print("player exit code:", p.exitcode)

    counter, lock = Value("i", 0), Lock()
    adders = [Process(target=add, args=(counter, lock, 50)) for _ in range(4)]
    for a in adders:
        a.start()
    for a in adders:
        a.join()
    print("counter:", counter.value)
