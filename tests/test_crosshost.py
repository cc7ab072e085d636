"""fiber-dask across real hosts: network namespaces on this machine (``support/netns.py``).

One network per protocol (every test runs twice: plain TCP, and Dask's TLS
required with certificates made for the run): a scheduler host, three worker
hosts (multi-homed: the Dask network and a side network), the user's client
host and a stranger's host, all running real ``dask scheduler`` /
``dask worker`` processes.  The user's program runs on the client host as
``crosshost_client.py <scenario>``, attached by ``DASK_SCHEDULER_ADDRESS``.

Adding a test: take the fixtures ``net`` (the :class:`netns.Network`),
``cluster`` (its :class:`netns.DaskCluster`; worker host ``wN`` has the Dask
resource ``wN``, so ``Process(resources={"w2": 1})`` runs on w2),
``client_host`` and ``stranger``; write the program's side as a
``scenario_<name>(params) -> dict`` in ``crosshost_client.py`` and run it with
:func:`run_client` (or ``client_host.python(...)`` with ``expect``/``send`` to
act in the middle of it).  A test that destroys a host (kill, cut) makes its
own with ``fresh_worker(name)``, so the shared hosts stay healthy.

Under TLS, fiber-dask's own connections are TLS too: a capture in the switch
(``crosshost_capture.py``, an ``AF_PACKET`` socket) finds the data's markers
in clear with plain TCP and nowhere under TLS, and the stranger's attacks get
the clear-text TLS hello, then nothing.

Timeouts: ``fiber.peer-timeout`` is 4 s in the partition test (client and
that worker's environment); elsewhere the defaults apply.
"""

from __future__ import annotations

import json
import secrets
import time

import pytest
from support.netns import DaskCluster, Network, make_tls_files, unavailable

_REASON = unavailable()
pytestmark = [
    pytest.mark.skipif(_REASON is not None, reason=f"cross-host tests: {_REASON}"),
    pytest.mark.timeout(180),
]

WORKERS = ("w1", "w2", "w3")


@pytest.fixture(scope="module", params=["tcp", "tls"])
def net(request, tmp_path_factory):
    """The network, once with plain TCP and once with Dask's TLS required
    (every test runs on both)."""
    with Network(tmp_path_factory.mktemp(f"crosshost-{request.param}")) as network:
        network.protocol = request.param
        yield network


@pytest.fixture(scope="module")
def cluster(net):
    sched = net.add_host("sched", number=1)
    tls = None
    if net.protocol == "tls":
        # One certificate for the cluster, signed by a CA made for this run;
        # on the command lines of scheduler and workers, in the client's config.
        ips = [f"{net.subnet}.{n}" for n in range(1, 255)]
        tls = make_tls_files(net.workdir / "tls", ips)
    dask_cluster = DaskCluster(net, sched, tls=tls)
    dask_cluster.add_worker_hosts(WORKERS, lambda name: {name: 100})
    return dask_cluster


@pytest.fixture(scope="module")
def client_host(net):
    return net.add_host("client", number=100)


def worker_ips(net) -> dict:
    return {name: net.hosts[name].ip for name in WORKERS}


def run_client(client_host, cluster, scenario, params, timeout=120, env=None):
    script = client_host.python(
        "crosshost_client.py",
        scenario,
        json.dumps(params),
        env=cluster.client_env(env),
    )
    result = script.expect("result", timeout=timeout)
    script.wait()
    return result


def test_attach_by_scheduler_address_pool_process_queue_pipe_lock(
    net, cluster, client_host
):
    ips = worker_ips(net)
    r = run_client(client_host, cluster, "basic", {"workers": ips})
    w1, w2, w3 = (ips[n] for n in WORKERS)
    assert r["client"] == client_host.ip
    assert r["scheduler"] == cluster.address
    # The client's endpoints listen on its Dask-facing address.
    assert r["listen_host"] == client_host.ip
    assert r["client_endpoint"][0] == client_host.ip
    # Pool: all three worker hosts ran tasks, results correct and in order.
    assert r["pool_hosts"] == sorted(ips.values())
    assert r["apply"] == 49
    assert r["imap"] == [x * x for x in range(10)]
    assert r["pool_queue"] == list(range(12))
    # Process on w1 using the client's Queue, Pipe and Lock.
    assert r["process_hello"] == ["hello", w1]
    assert r["process_pid_matches"]
    assert r["pipe_echo"] == ["echo", {"x": [1, 2, 3]}, w1]
    assert r["lock_busy_for_child"] is False
    assert r["child_acquired"] == ["lock-acquired", w1]
    assert r["client_blocked_while_child_holds"]
    assert r["child_released"] == "lock-released"
    assert r["client_reacquired"]
    assert r["process_exitcode"] == 0
    # w2 -> w1 directly: a Queue and a Pipe owned by a Process on w1.
    assert r["owner_queue_address"][0] == w1
    assert r["worker_to_worker"] == {
        "owner": w1,
        "items": [0, 1, 2, 3, 4],
        "from": [w2],
        "piped": ["piped", w2],
    }
    assert r["w2w_exitcodes"] == [0, 0]
    # Exit codes as the stdlib's; a Pool started inside a Process on w3.
    assert r["exitcodes"] == [3, 1, 0]
    assert r["nested_pool"]["host"] == w3
    assert r["nested_pool"]["results"] == [x * x for x in range(20)]
    assert set(r["nested_pool"]["hosts"]) <= set(ips.values())


def test_python_314_additions_and_lock_holders_across_hosts(
    net, cluster, client_host, tmp_path
):
    """Process.interrupt() reaches a child on w2; lock.holder() names a holder
    on w3, asked from the client and from w1; terminate_workers() signals the
    executor's slot processes on the worker hosts."""
    ips = worker_ips(net)
    r = run_client(
        client_host, cluster, "py314", {"workers": ips, "dir": str(tmp_path)}
    )
    w1, w2, w3 = (ips[n] for n in WORKERS)
    assert r["interrupt"] == [w2, 1]
    holder = r["holder"]
    assert holder["where"] == w3
    assert holder["here"] == ["holder-on-w3", True, True, True]
    assert holder["asked_from"] == w1
    assert holder["there"] == ["holder-on-w3", True]
    assert holder["after"] is None
    terminate = r["terminate"]
    assert set(terminate["hosts"]) <= set(ips.values())
    assert terminate["signalled"] is True
    assert set(terminate["outcomes"]) <= {"BrokenProcessPool", "cancelled"}
    assert terminate["outcomes"].count("BrokenProcessPool") >= len(WORKERS)
    assert r["submit_after"] == "BrokenProcessPool"


def test_manager_across_hosts(net, cluster, client_host):
    ips = worker_ips(net)
    r = run_client(client_host, cluster, "manager", {"workers": ips})
    w1, w2 = ips["w1"], ips["w2"]
    assert r["manager_address"][0] == client_host.ip
    assert sorted(r["dict"]) == [w1, w2]
    assert r["list"] == [w1, w2]
    assert r["queue"] == [["manager", w1], ["manager", w2]]
    assert r["exitcodes"] == [0, 0]


def test_what_crosses_the_network_is_encrypted_under_tls(net, cluster, client_host):
    """Data with known markers through every kind of direct connection, while
    a capture at the switch searches every TCP segment between the hosts for
    them: all there in clear with plain TCP (the control), none under TLS."""
    token = secrets.token_hex(8)
    paths = ("QUEUE", "QUEUE-BACK", "PROCESS", "MANAGER", "POOL-ARG", "POOL-RESULT")
    markers = {path: f"{path}-{token}" for path in paths}
    capture = net.switch_host().python(
        "crosshost_capture.py", json.dumps({"markers": list(markers.values())})
    )
    try:
        capture.expect("capturing", timeout=30)
        ips = worker_ips(net)
        r = run_client(client_host, cluster, "wire", {"workers": ips, "token": token})
    finally:
        capture.send("stop")
    seen = capture.expect("result", timeout=30)
    capture.wait()
    # It worked, across hosts.
    assert r["queue_back"] and r["manager"] and r["pool"], r
    assert r["process"] == [ips["w1"], "PROCESS-", 0], r
    assert set(r["pool_hosts"]) <= set(ips.values()), r
    # The capture saw the traffic between the client and the worker hosts.
    from_client = sum(
        n for pair, n in seen["between"].items() if pair.startswith(client_host.ip)
    )
    to_client = sum(
        n for pair, n in seen["between"].items() if pair.endswith(client_host.ip)
    )
    assert from_client > 10_000 and to_client > 10_000, seen
    found = {path: seen["found"][m] for path, m in markers.items()}
    print(  # shown with -rP: what the capture saw
        f"capture ({net.protocol}): {seen['frames']} frames, "
        f"{seen['payload_bytes']} TCP payload bytes, client->workers {from_client}, "
        f"workers->client {to_client}; markers seen: {found}"
    )
    if net.protocol == "tls":
        assert found == dict.fromkeys(paths, 0), found
    else:
        assert all(found.values()), found


@pytest.fixture(scope="module")
def stranger(net):
    """A host on the Dask network that is no part of the program."""
    return net.add_host("stranger", number=200)


def host_by_ip(net, ip):
    return next(h for h in net.hosts.values() if h.ip == ip)


@pytest.fixture(scope="module")
def served(net, cluster, client_host):
    """A client program holding one endpoint of every kind open (its own, a
    Manager's, a Process child's on w1, a Pool task's in a Dask worker), and
    the listening sockets each host had just before it started."""
    before = {
        name: {(x.ip, x.port) for x in host.listeners()}
        for name, host in net.hosts.items()
    }
    script = client_host.python(
        "crosshost_client.py",
        "serve",
        json.dumps({"workers": worker_ips(net)}),
        env=cluster.client_env(),
    )
    endpoints = script.expect("endpoints", timeout=120)["endpoints"]
    state = {"script": script, "endpoints": endpoints, "before": before}
    yield state
    if "result" in state:
        script.wait()
    else:  # the test that verifies did not run, or failed
        script.proc.kill()
        script.proc.wait()


def test_endpoints_listen_only_on_the_dask_interface(net, served):
    endpoints = served["endpoints"]
    # Where each endpoint says it listens: the host's Dask-network address.
    for e in endpoints:
        assert e["addr"][0] == e["host"], e
        assert e["host"] in {h.ip for h in net.hosts.values()}, e
    # What the kernel says, on every host: each socket that appeared since the
    # program started (fiber-dask's; Dask's own were there before) is bound to
    # that host's Dask address -- not 0.0.0.0, loopback or the side network.
    seen = set()
    for name, host in net.hosts.items():
        for sock in host.listeners():
            if (sock.ip, sock.port) in served["before"].get(name, set()):
                continue
            assert sock.ip == host.ip, f"{name}: {sock} (Dask address {host.ip})"
            seen.add((sock.ip, sock.port))
    reported = {tuple(e["addr"]) for e in endpoints}
    assert reported <= seen, (reported, seen)
    # Client, Manager, Process child and Pool task: four distinct listeners
    # (a process's Pool and objects share one channel server), two of them in
    # processes on worker hosts.
    assert len(reported) == 4
    workers = set(worker_ips(net).values())
    roles = {e["role"]: e["addr"][0] for e in endpoints}
    assert roles["process child objects"] in workers
    assert roles["pool task objects"] in workers


def test_strangers_are_rejected_and_nothing_is_unpickled(net, served, stranger):
    endpoints = sorted({tuple(e["addr"]) for e in served["endpoints"]})
    markers = net.workdir / "markers"
    markers.mkdir(exist_ok=True)
    side = [(host_by_ip(net, ip).side_ip, port) for ip, port in endpoints]
    attack = stranger.python(
        "crosshost_attack.py",
        json.dumps({"endpoints": endpoints, "side": side, "markers": str(markers)}),
    )
    attack.expect("holding", timeout=90)
    # While the stranger holds a silent connection to every endpoint, the
    # program opens new ones of its own to each: they must all work.
    script = served["script"]
    script.send("verify")
    served["result"] = result = script.expect("result", timeout=60)
    attack.send("done")
    r = attack.expect("result", timeout=30)
    attack.wait()
    assert result["checks"] == {
        "worker queue+lock": True,
        "locks": True,
        "pool task queue": True,
        "new pool": True,
        "pool": True,
        "manager": True,
    }
    assert result["exitcode"] == 0
    tls = net.protocol == "tls"
    for addr, outcome in r["attacks"].items():
        assert "attack-failed" not in outcome, (addr, outcome)
        for kind in ("junk", "pickle_first", "pickle_answer", "oversized"):
            # The server spoke first (its challenge; under TLS its clear-text
            # hello, the challenge going inside TLS), then hung up on us at once.
            said = outcome[kind]
            assert said["tls_hello" if tls else "challenge"], (addr, kind, said)
            assert not said["challenge" if tls else "tls_hello"], (addr, kind, said)
            assert said["closed"], (addr, kind, outcome[kind])
            assert said["seconds"] < 5, (addr, kind, outcome[kind])
        for kind in ("pickle_first", "pickle_answer"):
            # Plain: a failed digest.  TLS: not even a TLS handshake.
            assert outcome[kind]["failure"] is not tls, (addr, kind, outcome[kind])
        for kind in ("objects", "pool-x", "process-x", "stdlib"):
            assert outcome[f"wrong_key_{kind}"] != "connected", (addr, kind, outcome)
        # TLS without the cluster's certificate: refused (plain: not TLS).
        assert outcome["tls_no_cert"] != "answered", (addr, outcome)
        if tls:
            # A client without TLS is told why, at once (here: the stranger).
            for kind in ("objects", "pool-x", "process-x"):
                error = outcome[f"wrong_key_{kind}"]
                assert (
                    error.startswith("TLSConnectionError") and "requires TLS" in error
                )
            assert "FIBER-TLS" in outcome["wrong_key_stdlib"], outcome
        else:
            assert "does not use TLS" in outcome["tls_no_cert"], outcome
    # Not reachable at the side-network addresses of the same hosts.
    assert set(r["side"].values()) == {"ConnectionRefusedError"}, r["side"]
    # Nothing was unpickled.
    assert list(markers.iterdir()) == [] and r["markers"] == []


@pytest.fixture
def fresh_worker(net, cluster):
    """A factory of new worker hosts (for tests that destroy them), removed
    after the test."""
    made = []

    def make(name, env=None):
        host = net.add_host(name)
        made.append(host)
        cluster.add_worker(host, resources={name: 10}, env=env)
        return host

    yield make
    for host in made:
        net.remove_host(host)


def test_kill_a_whole_worker_host_mid_job(net, cluster, client_host, fresh_worker):
    doomed = fresh_worker("k1")
    script = client_host.python(
        "crosshost_client.py",
        "kill",
        json.dumps(
            {
                "doomed": "k1",
                "doomed_ip": doomed.ip,
                "items": 200,
                "slots": len(WORKERS) + 1,
                "kill_after": 20,
            }
        ),
        env=cluster.client_env(),
    )
    script.expect("kill-now", timeout=120)
    killed_at = time.monotonic()
    killed = doomed.kill_all()
    script.send(f"killed {killed_at} {time.monotonic()}")  # kill began, all dead
    r = script.expect("result", timeout=120)
    script.wait()
    assert len(killed) >= 3  # nanny, worker, the Process's child
    m = r["map"]
    # The map finished with every result, correct, in order, none twice; the
    # dead host's in-flight work was re-run elsewhere.
    assert m["count"] == 200 and m["unique"] == 200 and m["correct"], m
    assert m["by_doomed_before_kill"] >= 1 and m["by_doomed_after_kill"] == 0, m
    assert m["done_after_kill"] < 30, m
    # The Process there: a failed exit, reported promptly, with the reason.
    assert r["process"]["exitcode"] == -9, r["process"]
    assert "died or became unreachable" in r["process"]["reason"]
    assert r["process"]["join_after_kill"] < 10, r["process"]
    # The other end of its Pipe sees end-of-file, as with a dead stdlib child.
    assert r["pipe"]["recv"] == "EOFError()", r["pipe"]
    assert r["pipe"]["after_kill"] < 10, r["pipe"]
    # The lock it held was released when its connection dropped.
    assert r["lock"]["acquired"] is True and r["lock"]["after_kill"] < 10, r["lock"]
    # So was the lock it held of the client's Manager.
    mlock = r["manager lock"]
    assert mlock["acquired"] is True and mlock["after_kill"] < 10, mlock
    # The queue it fed kept every item it had put; the queue it consumed from
    # kept every item it had not taken (leased ones came back), in order.
    assert r["produced"] == list(range(20))
    taken = r["taken_before_kill"]
    assert taken == list(range(10))
    assert r["queue_rest"] == list(range(10, 100))


PEER_TIMEOUT = 4  # seconds: fiber.peer-timeout of the partition test's processes


def test_cut_a_worker_host_off_mid_job_and_back(
    net, cluster, client_host, fresh_worker
):
    timeouts = {"DASK_FIBER__PEER_TIMEOUT": f"{PEER_TIMEOUT}s"}
    host = fresh_worker("c1", env=timeouts)
    script = client_host.python(
        "crosshost_client.py",
        "partition",
        json.dumps(
            {
                "host": "c1",
                "host_ip": host.ip,
                "slots": len(WORKERS) + 1,
                "peer_timeout": PEER_TIMEOUT,
            }
        ),
        env=cluster.client_env(timeouts),
    )
    # A short cut (a third of the timeout) in the middle of a map.
    script.expect("cut-short", timeout=120)
    host.cut()
    script.send(f"cut {time.monotonic()}")
    time.sleep(PEER_TIMEOUT / 3)
    host.restore()
    script.send("restored")
    # A long one, at least twice the timeout, in the middle of the next.
    script.expect("arm", timeout=60)
    script.send("armed")
    script.expect("cut-long", timeout=60)
    host.cut()
    # Taken once the cut is in force: a task that ended while the links were
    # still being cut (a loaded machine takes a while) sent its result in time.
    cut_at = time.monotonic()
    script.send(f"cut {cut_at}")
    # long-done comes once the map and everything watched during the cut have
    # returned: the rest of the cut only keeps the host away for twice the
    # timeout before it comes back (three times cost ~4 s a run for nothing
    # more that is checked).
    script.expect("long-done", timeout=60)
    long_done = time.monotonic() - cut_at
    time.sleep(max(0.0, 2 * PEER_TIMEOUT - long_done))
    host.restore()
    script.send("restored")
    r = script.expect("result", timeout=120)
    script.wait()

    short, long = r["short"], r["long"]
    # Short cut: nothing lost, nothing twice, nothing broken.
    assert short["count"] == 150 and short["unique"] == 150 and short["correct"]
    assert short["pipe_after"] == ["pong", "after the short cut"]
    assert short["process_alive"] and short["lock_still_held"]
    # Long cut: the map finished while the host was still cut off, about the
    # timeout after the cut (the lost chunk re-ran elsewhere), every result once.
    assert long["count"] == 200 and long["unique"] == 200 and long["correct"]
    assert long["by_host_after_cut"] == 0, long
    assert long_done < 3 * PEER_TIMEOUT
    assert long["done_after_cut"] < PEER_TIMEOUT + 3, long
    # What the Process there held or used failed as if it had died, when the
    # timeout ran out: its exit (-9), the lock it held, its pipe end (EOF).
    # (An idle connection counts as silent from its last keep-alive answer,
    # up to a second or two before the cut; none is given up at once.)
    after = long["after_cut"]
    assert after["join"]["value"] == -9, after
    assert "unreachable" in long["reason"]
    assert after["lock"]["value"] is True, after
    assert after["pipe recv"]["value"] == "EOFError()", after
    for what in ("join", "lock", "pipe recv"):
        assert PEER_TIMEOUT / 2 < after[what]["since_cut"] < PEER_TIMEOUT + 3, after
    # A queue it owns: a ConnectionError one timeout after the call.
    get = after["remote queue get"]
    assert get["connection_error"], get
    assert PEER_TIMEOUT - 1 < get["since_call"] < PEER_TIMEOUT + 3, get
    # Plugged back in: the pool works, its results complete and correct, and
    # no process of the cut-off Process is left on the host.
    assert r["after"]["correct"]
    leftovers = [
        p for p in host.pids() if "processchild" in open(f"/proc/{p}/cmdline").read()
    ]
    assert leftovers == []


def test_a_client_the_workers_cannot_reach_back_gets_clear_errors(cluster, client_host):
    # fiber.listen-host set to an address that is valid only on the client's
    # own host: the workers' connections back are refused.
    r = run_client(
        client_host,
        cluster,
        "unreachable",
        {},
        env={"DASK_FIBER__LISTEN_HOST": "127.0.0.1"},
    )
    process, pool = r["process"], r["pool"]
    assert process["exitcode"] == -9, process
    assert "could not connect back to this process" in process["reason"]
    assert "127.0.0.1" in process["reason"], process
    assert process["seconds"] < 20, process
    assert pool["error"].startswith("WorkerLostError: pool-worker loops keep failing")
    assert "127.0.0.1" in pool["error"] and "fiber.listen-host" in pool["error"]
    assert pool["seconds"] < 20, pool
