"""``parent_process()`` across hosts: the child on one worker host, its
grandchild on another (network namespaces, ``support/netns.py``).

The grandchild's parent is on another host, so no pid of it can be watched;
it learns of its death from its launcher, whose connection to the child drops
when the child is killed.  The hosts share this machine's pid namespace, but
nothing in the mechanism uses pids.
"""

from __future__ import annotations

import json

import pytest
from support.netns import DaskCluster, Network, unavailable

_REASON = unavailable()
pytestmark = [
    pytest.mark.skipif(_REASON is not None, reason=f"cross-host tests: {_REASON}"),
    pytest.mark.timeout(180),
]


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    with Network(tmp_path_factory.mktemp("crosshost-parent")) as net:
        cluster = DaskCluster(net, net.add_host("sched", number=1))
        cluster.add_worker_hosts(("w1", "w2"), lambda name: {name: 100})
        yield net, cluster, net.add_host("client", number=100)


def test_grandchild_on_another_host_sees_its_parent_die(hosts):
    net, cluster, client = hosts
    w1, w2 = net.hosts["w1"].ip, net.hosts["w2"].ip
    script = client.python(
        "crosshost_parent_client.py",
        json.dumps({"child_host": "w1", "grandchild_host": "w2"}),
        env=cluster.client_env(),
    )
    r = script.expect("result", timeout=150)
    script.wait()
    assert r["child"][0] == w1
    child_pid = r["child"][1]
    # On w2, parent_process() is the child on w1, alive while it runs.
    assert r["grandchild"] == [w2, child_pid, True]
    assert r["child_exitcode"] == -9
    # Killed: its sentinel is ready and it is dead, seen from the other host.
    assert r["sentinel"] == [True, False, w2], r
