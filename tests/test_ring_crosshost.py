"""A Ring across real hosts: network namespaces on this machine (``support/netns.py``).

A scheduler host, two worker hosts (``dask worker --resources ring=2``) and the
user's client host.  The ring's 4 members each ask for ``ring: 1``, so they
share the two worker hosts; each learns the others' addresses and ports from the ring
and connects to its neighbours directly, host to host (the socket collective
of ``support/ringreduce.py``).  Then a host dies with its members in the
middle of the collective, and the client's ``run()`` names a member on it.
The user's side is ``support/crosshost_ring_client.py``.
"""

from __future__ import annotations

import glob
import json
import os

import pytest
from support.netns import DaskCluster, Network, unavailable
from support.wait import wait_until

_REASON = unavailable()
pytestmark = [
    pytest.mark.skipif(_REASON is not None, reason=f"cross-host tests: {_REASON}"),
    pytest.mark.timeout(180),
]


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    with Network(tmp_path_factory.mktemp("crosshost-ring")) as net:
        cluster = DaskCluster(net, net.add_host("sched", number=1))
        cluster.add_worker_hosts(("w1", "w2"), lambda name: {"ring": 2})
        yield net, cluster, net.add_host("client", number=100)


def run_client(client, cluster, scenario, markers):
    os.makedirs(markers)
    return client.python(
        "crosshost_ring_client.py",
        scenario,
        json.dumps({"markers": str(markers)}),
        env=cluster.client_env(),
    )


def test_members_on_two_hosts_all_reduce_their_ranks(hosts):
    net, cluster, client = hosts
    w1, w2 = net.hosts["w1"].ip, net.hosts["w2"].ip
    script = run_client(client, cluster, "reduce", net.workdir / "reduce")
    r = script.expect("result", timeout=120)
    script.wait()
    assert r["listen_host"] == client.ip
    assert r["results"] == [6, 6, 6, 6], r
    # Members on both hosts, each with its host's own address (not the
    # client's, not a loopback one) and a port the others reached it on.
    # (Usually two on each; a Process launched beside a worker's tasks does
    # not hold its resources, so three can land on one host.)
    ips = [ip for _, ip, _ in r["members"]]
    assert set(ips) == {w1, w2}, r["members"]
    markers = glob.glob(str(net.workdir / "reduce" / "exec-*"))
    seen = sorted(tuple(open(m).read().split()) for m in markers)
    assert seen == sorted((ip, str(port)) for _, ip, port in r["members"])


def test_a_host_lost_mid_collective_fails_the_ring_naming_a_member_on_it(hosts):
    """Last in this module: it kills w2."""
    net, cluster, client = hosts
    w2 = net.hosts["w2"]
    markers = net.workdir / "hang"
    script = run_client(client, cluster, "hang", markers)
    wait_until(
        lambda: len(glob.glob(str(markers / "exec-*"))) == 4,
        120,
        "all 4 members inside the collective (their marker files)",
    )
    w2.kill_all()
    r = script.expect("result", timeout=60)
    script.wait()
    error = r["error"]
    assert error["host"] == w2.ip, error
    assert error["exitcode"] == -9, error
    on_w2 = {rank for rank, ip, _ in r["members"] if ip == w2.ip}
    assert error["rank"] in on_w2, (r["members"], error)
    assert f"on {w2.ip}" in error["message"] and "SIGKILL" in error["message"]
