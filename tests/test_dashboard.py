"""Pools where Dask users look: the JSON endpoint, the dashboard page, `info`.

Real clusters on loopback, real pools reporting to them (fiber_dask.engine.poolstats),
numbers read from the scheduler's HTTP server as a browser or script would:

* the embedded cluster (the session's, started by the ``local`` backend with
  the ``fiber_dask.dashboard`` scheduler preload) and a cluster of this module
  started the same way;
* counts after a map with a failing item, while items wait, and re-runs after
  a SIGKILL of a slot process (after its started marker);
* a pool whose owner is SIGKILLed disappears (its client went away);
* ``fiber-dask info`` (text and JSON), and what it says without the plugin;
* the page in a real headless Chromium: text and a screenshot;
* the README's ``map_async`` + tqdm example, run as it is.
"""

from __future__ import annotations

import functools
import json
import os
import pathlib
import re
import signal
import struct
import subprocess
import sys
import textwrap
import urllib.error
import urllib.request

import pytest
from distributed import Client, LocalCluster
from support import browser
from support.wait import wait_for_file, wait_until
from tasks.dashboard import fail_on, hold
from tasks.poolcore import counted_square, executions

import fiber_dask
from fiber_dask import dashboard
from fiber_dask.engine import poolstats

pytestmark = pytest.mark.timeout(120)

REPO = pathlib.Path(__file__).resolve().parent.parent
FIBER_DASK = pathlib.Path(sys.executable).parent / "fiber-dask"
#: Set by .ci/run: there, a missing browser fails the browser test.
CI_ENV = "FIBER_DASK_CI"


def stats_cluster(preload: bool = True, bokeh: bool = True):
    """Two worker processes on 127.0.0.1, the scheduler with (or without) the
    pools plugin, as the embedded cluster starts it; ``bokeh=False``: its HTTP
    server without the dashboard's pages."""
    scheduler: dict = {"preload": ["fiber_dask.dashboard"]} if preload else {}
    if not bokeh:
        scheduler["dashboard"] = False
    return LocalCluster(
        n_workers=2,
        threads_per_worker=1,
        processes=True,
        host="127.0.0.1",
        dashboard_address="127.0.0.1:0",
        scheduler_kwargs=scheduler,
        preload=["fiber_dask.engine.slots"],
    )


@pytest.fixture(scope="module")
def cluster():
    with stats_cluster() as c:
        yield c


@pytest.fixture
def client(cluster):
    with Client(cluster, set_as_default=False) as c:
        yield c


def http_base(client) -> str:
    """The scheduler's HTTP server: where its dashboard is."""
    link = client.dashboard_link
    return link[: link.rindex("/")]


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        assert r.headers["Content-Type"].startswith("application/json")
        return json.load(r)


def report(base: str, pool) -> dict | None:
    """This pool's entry in the scheduler's JSON, or None."""
    pool_id = pool._engine._token
    for p in get_json(base + "/fiber/pools.json")["pools"]:
        if p["id"] == pool_id:
            return p
    return None


def wait_for_counts(base: str, pool, timeout: float = 30, **expected) -> dict:
    """Wait until the pool's reported numbers include ``expected``."""
    seen: list = []

    def check():
        p = report(base, pool)
        seen[:] = [p]
        return p if p and all(p[k] == v for k, v in expected.items()) else None

    try:
        return wait_until(check, timeout, f"the pool's report to show {expected}")
    except AssertionError as e:
        raise AssertionError(f"{e}; last report: {seen[0]}") from None


def failing_map(pool) -> None:
    """20 items in chunks of 5, item 17 raises: the map fails; the other
    three chunks all went out before the last one failed, so 15 items are
    done and 1 failed, whatever the timing."""
    res = pool.map_async(functools.partial(fail_on, bad=17), range(20), chunksize=5)
    with pytest.raises(ValueError, match="item 17 fails"):
        res.get(timeout=60)


# ------------------------------------------------------------- the JSON endpoint


def test_embedded_cluster_reports_a_map_with_a_failing_item(fiber_ctx):
    base = http_base(fiber_dask.get_client())
    with fiber_ctx.Pool(2) as pool:
        failing_map(pool)
        p = wait_for_counts(
            base, pool, done=15, failed=1, queued=0, in_flight=0, reruns=0
        )
        assert p["name"].startswith("Pool-") and p["state"] == "RUN"
        assert p["processes"] == 2 and len(p["slots"]) == 2
        assert p["pid"] == os.getpid() and p["program"]
        assert [s["name"] for s in p["slots"]] == ["PoolWorker-1", "PoolWorker-2"]
        assert p["rate"] > 0 and 0 <= p["busy"] <= 1
        # Each slot's worker and process, once connected (on a loaded machine
        # one slot may have done all four chunks before the other came up).
        wait_until(
            lambda: all(
                s["worker"] and s["worker"].startswith("tcp://127.0.0.1:") and s["pid"]
                for s in report(base, pool)["slots"]
            ),
            60,
            "both slots to report their worker and pid",
        )
        # The page is announced from the start: the embedded cluster builds
        # its bokeh dashboard on the first request for a page
        # (fiber_dask.dashboard.connect_on_request).
        wait_until(
            lambda: get_json(base + "/fiber/pools.json")["page"] == "/fiber-pools",
            60,
            "the pools page to be served",
        )
    # Closed: the owner removes it (no waiting for it to go stale).
    wait_until(
        lambda: report(base, pool) is None, poolstats.STALE_AFTER - 2, "the removal"
    )


def test_embedded_cluster_builds_its_bokeh_dashboard_on_the_first_request(fiber_ctx):
    # Not in Scheduler.__init__, before the workers start (0.5-1 s of CPU on
    # the start's critical path), nor on a timer in the middle of the
    # program's work: the HTTP server is there from the start, the bokeh
    # pages (distributed's and the pools page) are built by the first
    # request for one of them, which waits and is redirected to the page.
    from fiber_dask.cluster import current_handle

    client = fiber_dask.get_client()
    scheduler = current_handle().cluster.scheduler
    assert getattr(scheduler, dashboard._DEFERRED) is True
    base = http_base(client)
    assert get_json(base + "/fiber/pools.json")["version"] == 1
    with fiber_dask.Pool(2) as pool:  # work, and time, pass: nothing is built
        assert pool.map(abs, range(-20, 0)) == list(range(20, 0, -1))
    assert not dashboard.wait_built(scheduler, 1.5)
    assert get_json(base + "/fiber/pools.json")["page"] == "/fiber-pools"

    def fetch(path):
        with urllib.request.urlopen(base + path, timeout=60) as r:
            return r.status, r.geturl(), r.read()

    status, url, body = fetch("/status")  # builds, then redirected to itself
    assert status == 200 and url == base + "/status" and b"bokeh" in body.lower()
    assert dashboard.wait_built(scheduler, 0)
    assert dashboard._bokeh_apps(scheduler)
    assert fetch("/fiber-pools")[0] == 200
    # Built once: the stand-in routes are gone, unknown paths are 404s again.
    with pytest.raises(urllib.error.HTTPError) as e:
        fetch("/no-such-page")
    assert e.value.code == 404


def test_queued_in_flight_and_busy_while_items_wait(client, tmp_path):
    d = str(tmp_path)
    base = http_base(client)
    with fiber_dask.Pool(2, client=client) as pool:
        # A function the pool has not timed yet goes one chunk per slot.
        res = pool.map_async(functools.partial(hold, directory=d), range(10), 1)
        wait_for_file(os.path.join(d, "started-0"), 60)
        wait_for_file(os.path.join(d, "started-1"), 60)
        p = wait_for_counts(base, pool, done=0, in_flight=2, queued=8, failed=0)
        # Both slots have had work since the items started: busy climbs.
        p = wait_until(
            lambda: (
                (r := report(base, pool))
                and all(s["busy"] > 0.5 for s in r["slots"])
                and r
            ),
            30,
            "both slots to be busy more than half the time",
        )
        assert p["busy"] > 0.5
        pathlib.Path(d, "release").touch()
        assert res.get(timeout=60) == list(range(10))
        p = wait_for_counts(base, pool, done=10, in_flight=0, queued=0)
        assert p["rate"] > 0


def test_reruns_after_sigkill_of_a_slot_process(client, tmp_path):
    d = str(tmp_path)
    base = http_base(client)
    with fiber_dask.Pool(2, client=client) as pool:
        res = pool.map_async(
            functools.partial(counted_square, directory=d, victims=(5,)),
            range(10),
            chunksize=2,
        )
        path = wait_for_file(os.path.join(d, "started-5"), 60)
        with open(path) as f:
            os.kill(int(f.read()), signal.SIGKILL)
        assert res.get(timeout=90) == [x * x for x in range(10)]
        # The chunk [4, 5] was running: both items ran again.
        assert executions(d, 4) == 2 and executions(d, 5) == 2
        p = wait_for_counts(base, pool, done=10, failed=0, worker_losses=1, queued=0)
        # Every item that ran twice was counted; so may be items of the same
        # batch whose results had not come back (which of those ran cannot be
        # told), never more than the map's 10.
        twice = [x for x in range(10) if executions(d, x) >= 2]
        assert len(twice) <= p["reruns"] <= 10, (twice, p)


def test_a_pool_whose_owner_is_killed_disappears(cluster, tmp_path):
    ready = tmp_path / "ready"
    owner = textwrap.dedent(
        f"""
        import os, sys, time
        import fiber_dask
        if __name__ == "__main__":
            fiber_dask.init(address={cluster.scheduler_address!r})
            pool = fiber_dask.Pool(1)
            pool.map(abs, range(10))
            open({str(ready)!r}, "w").write(str(os.getpid()))
            time.sleep(120)
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", owner], stdin=subprocess.DEVNULL, env=_env()
    )
    with Client(cluster, set_as_default=False) as c:
        base = http_base(c)

        def owners_pool():
            for p in get_json(base + "/fiber/pools.json")["pools"]:
                if p["pid"] == proc.pid and p["done"] == 10:
                    return p
            return None

        try:
            wait_for_file(str(ready), 60)
            wait_until(owners_pool, 30, "the owner's pool to be reported")
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(30)
            # Its client is gone: the scheduler drops its pools at once, well
            # before they would go stale.
            wait_until(
                lambda: owners_pool() is None,
                poolstats.STALE_AFTER - 2,
                "the killed owner's pool to disappear",
            )
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)


def test_store_keeps_only_known_fields_and_expires_stale_pools():
    store = poolstats.PoolStore()
    good = {
        "id": "abc",
        "name": "Pool-9",
        "done": "3",
        "slots": [{"name": "PoolWorker-1", "busy": 0.5}],
        "extra": "x" * 10,
    }
    store.update(pools=[good, {"id": 5}, "junk"], client_id="c1", version=1)
    store.update(pools=[{"id": "other"}], client_id="c1", version=99)  # wrong version
    (p,) = store.document()["pools"]
    assert p["id"] == "abc" and p["done"] == 3 and "extra" not in p
    assert p["slots"] == [
        {"name": "PoolWorker-1", "worker": None, "pid": None, "busy": 0.5}
    ]
    store._received["abc"] -= poolstats.STALE_AFTER + 1  # as if 11 s passed
    assert store.document()["pools"] == []
    store.update(pools=[good], client_id="c1", version=1)
    store.drop_client("c2")
    assert len(store.document()["pools"]) == 1
    store.drop_client("c1")
    assert store.document()["pools"] == []


# --------------------------------------------------------------- fiber-dask info


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DASK_")}
    env.update(extra)
    return env


def info(address: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(FIBER_DASK), "info", "--address", address, *args],
        env=_env(),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.timeout(300)
def test_info_lists_live_pools(cluster, client):
    base = http_base(client)
    with fiber_dask.Pool(2, client=client) as pool:
        failing_map(pool)
        p = wait_for_counts(base, pool, done=15, failed=1, in_flight=0)
        text = info(cluster.scheduler_address)
        assert text.returncode == 0, text.stderr
        lines = text.stdout.splitlines()
        assert "pools:      1 live" in lines
        (line,) = [x for x in lines if p["id"] in x]
        assert line.startswith(f"  {p['name']} ({p['id']}), ")
        assert ": 2 slots, 15 done, 0 in flight, 0 queued, 1 failed, 0 re-runs," in line
        assert "PoolWorker-1 " in line and "PoolWorker-2 " in line
        (page,) = [x for x in lines if x.startswith("pools page:")]
        assert page.split()[-1] == base + "/fiber-pools"

        data = json.loads(info(cluster.scheduler_address, "--json").stdout)
        (listed,) = data["pools"]
        assert (listed["id"], listed["done"], listed["failed"]) == (p["id"], 15, 1)
        assert data["pools_page"] == base + "/fiber-pools"


@pytest.mark.slow
@pytest.mark.timeout(300)  # a cluster and two CLI runs: minutes on a loaded machine
def test_without_the_plugin_info_says_so_and_register_plugin_adds_it():
    with (
        stats_cluster(preload=False, bokeh=False) as plain,
        Client(plain, set_as_default=False) as c,
    ):
        text = info(plain.scheduler_address)
        assert text.returncode == 0, text.stderr
        (line,) = [x for x in text.stdout.splitlines() if x.startswith("pools:")]
        assert "not reported: the scheduler has no fiber-dask pool-stats plugin" in line
        assert "--preload fiber_dask.dashboard" in line
        data = json.loads(info(plain.scheduler_address, "--json").stdout)
        assert data["pools"] is None and data["pools_page"] is None
        assert poolstats.fetch(c) is None

        # An existing scheduler, given the plugin from a client.
        c.register_plugin(dashboard.PoolDashboard())
        port = c.scheduler_info()["services"]["dashboard"]
        base = f"http://127.0.0.1:{port}"
        with fiber_dask.Pool(1, client=c) as pool:
            pool.map(abs, range(7))
            wait_for_counts(base, pool, done=7)
            # Its bokeh dashboard is off: the JSON is served, the page is not.
            assert poolstats.fetch(c)["page"] is None
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(base + "/fiber-pools", timeout=10)
            assert e.value.code == 404


def test_registering_the_plugin_again_keeps_the_served_store(client):
    base = http_base(client)
    with pytest.warns(UserWarning, match="overwriting"):  # preloaded there
        client.register_plugin(dashboard.PoolDashboard())
    with fiber_dask.Pool(1, client=client) as pool:
        pool.map(abs, range(3))
        wait_for_counts(base, pool, done=3)


# ------------------------------------------------------------------ the browser


def _png_size(path: pathlib.Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_dashboard_page_in_a_real_browser(client, tmp_path):
    if browser.chromium() is None:
        message = (
            "headless Chromium is needed for the dashboard page test: install it "
            "(Debian: apt-get install -y chromium) or name it in "
            f"${browser.BROWSER_ENV}"
        )
        if os.environ.get(CI_ENV):
            pytest.fail(message + f" (${CI_ENV} is set: .ci/run installs it as root)")
        pytest.skip(message)
    base = http_base(client)
    shot = tmp_path / "fiber-pools.png"
    with fiber_dask.Pool(2, client=client) as pool:
        failing_map(pool)
        p = wait_for_counts(base, pool, done=15, failed=1, in_flight=0, queued=0)
        expected = f"{p['name']} ({p['id']}), "
        counts = "2 slots, 15 done, 0 in flight, 0 queued, 1 failed, 0 re-runs"

        async def look(page):
            text = await page.wait_for_text(
                lambda t: expected in t and counts in t,
                60,
                f"the page to show {expected!r} with {counts!r}",
            )
            await page.screenshot(str(shot))
            return text

        text = browser.open_page(base + "/fiber-pools", look, width=1280, height=800)
    # The table's headings and the pool's row, rendered by bokeh in the browser.
    for heading in ("Pool", "Done", "In flight", "Queued", "Failed", "Re-runs"):
        assert re.search(rf"^{heading}$", text, re.M), f"no column {heading!r}"
    assert re.search(rf"^{re.escape(p['id'])}$", text, re.M), "no table row"
    assert "Fiber Pools" in text  # in the dashboard's "More..." menu
    assert _png_size(shot) == (1280, 800)
    assert shot.stat().st_size > 10_000  # rendered, not a blank page


# ------------------------------------------------------------ README's example


def _readme_section(title: str) -> str:
    text = (REPO / "README.md").read_text()
    start = text.index(f"## {title}\n")
    end = text.index("\n## ", start + 1)
    return text[start:end]


@pytest.mark.timeout(300)
def test_readme_map_async_progress_example_runs(tmp_path):
    section = _readme_section("Progress and the dashboard")
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    (program,) = [b for b in blocks if "map_async" in b and "tqdm" in b]
    script = tmp_path / "progress.py"
    script.write_text(program)
    env = _env(DASK_FIBER__LOCAL__N_WORKERS="2")
    result = subprocess.run(
        [sys.executable, str(script)],
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(sum(x * x for x in range(10_000)))
    # tqdm's bar (on stderr) reached the total.
    assert re.search(r"100%\|.*\| 10000/10000", result.stderr), result.stderr


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_info_lists_the_pools_of_programs_on_fiber_dask_up(tmp_path):
    env = _env(
        DASK_FIBER__UP__STATE_DIR=str(tmp_path / "state"),
        DASK_FIBER__LOCAL__N_WORKERS="2",
    )
    ready, release = tmp_path / "ready", tmp_path / "release"
    program = tmp_path / "short.py"
    program.write_text(
        textwrap.dedent(
            f"""
            import os, time
            import fiber_dask

            if __name__ == "__main__":
                with fiber_dask.Pool(2) as pool:
                    pool.map(abs, range(10))
                    open({str(ready)!r}, "w").write(str(os.getpid()))
                    deadline = time.monotonic() + 100
                    while not os.path.exists({str(release)!r}):
                        assert time.monotonic() < deadline
                        time.sleep(0.05)
            """
        )
    )

    def command(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(FIBER_DASK), *args],
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=120,
        )

    up = command("up")
    assert up.returncode == 0, up.stderr
    owner = None
    try:
        owner = subprocess.Popen(
            [sys.executable, str(program)], env=env, stdin=subprocess.DEVNULL
        )
        wait_for_file(str(ready), 60)

        def listed():
            out = command("info").stdout
            lines = [x for x in out.splitlines() if f"pid {owner.pid} " in x]
            # The pool reports every poolstats.INTERVAL: its first report may
            # come before the map's results were counted.
            return lines and " 10 done" in lines[0] and out

        out = wait_until(
            listed, 60, "`fiber-dask info` to list the program's pool, 10 done"
        )
        assert "the cluster of `fiber-dask up`; left running" in out
        (line,) = [x for x in out.splitlines() if f"pid {owner.pid} " in x]
        assert (
            "short.py" in line and ": 2 slots, 10 done, 0 in flight, 0 queued" in line
        )
        assert "pools page: http://127.0.0.1:" in out
        release.touch()
        assert owner.wait(60) == 0
    finally:
        if owner is not None and owner.poll() is None:
            owner.kill()
            owner.wait(30)
        down = command("down")
        assert down.returncode == 0, down.stderr


# ---------------------------------------------------------------- held locks


def _held(base: str, lock) -> dict | None:
    """This lock's entry in the scheduler's JSON, or None."""
    oid = lock._ref[2]
    for entry in get_json(base + "/fiber/pools.json")["locks"]:
        if entry["id"] == oid:
            return entry
    return None


@pytest.mark.timeout(300)
def test_held_locks_are_listed_by_the_json_the_page_and_info(fiber_ctx):
    """A Lock held by a child: the embedded cluster's /fiber/pools.json, the
    Fiber Pools page's header and ``fiber-dask info`` (text and JSON) name
    the holding process, its host and how long it has held it; released, it
    is gone from all of them."""
    import socket

    from tasks.process import hold_lock

    client = fiber_dask.get_client()
    base = http_base(client)
    lock = fiber_ctx.Lock()
    started, release = fiber_ctx.Event(), fiber_ctx.Event()
    p = fiber_ctx.Process(
        target=hold_lock, args=(lock, started, release), name="lock-keeper"
    )
    p.start()
    try:
        assert started.wait(60)
        entry = wait_until(lambda: _held(base, lock), 30, "the lock's report")
        assert entry["kind"] == "Lock"
        assert entry["site"].startswith("test_dashboard.py:")
        assert entry["owner"]["pid"] == os.getpid()
        (h,) = entry["holders"]
        assert (h["process"], h["pid"], h["host"], h["alive"]) == (
            "lock-keeper",
            p.pid,
            socket.gethostname(),
            True,
        )
        wait_until(
            lambda: _held(base, lock)["holders"][0]["held_for"] > h["held_for"],
            10,
            "the holding time to grow",
        )
        assert "lock-keeper (pid" in dashboard._header(
            get_json(base + "/fiber/pools.json")
        )
        text = info(client.scheduler.address)
        assert text.returncode == 0, text.stderr
        lines = text.stdout.splitlines()
        (row,) = [x for x in lines if x.startswith("locks:")]
        assert row.split()[-1] == "held"
        (line,) = [x for x in lines if lock._ref[2] in x]
        assert line.startswith(f"  Lock {lock._ref[2]} (made at test_dashboard.py:")
        assert f"held by lock-keeper (pid {p.pid} on {socket.gethostname()}) for " in (
            line
        )
        data = json.loads(info(client.scheduler.address, "--json").stdout)
        (listed,) = [x for x in data["locks"] if x["id"] == lock._ref[2]]
        assert listed["holders"][0]["pid"] == p.pid
    finally:
        release.set()
        p.join(60)
    wait_until(lambda: _held(base, lock) is None, 30, "the released lock to go")


def test_lock_store_keeps_only_known_fields_and_drops_a_process_that_holds_none():
    from fiber_dask.comm import lockstats

    store = lockstats.LockStore()
    holder = {"process": "P-1", "pid": "7", "host": "h", "held_for": 2, "x": 1}
    lock = {"id": "a-1", "kind": "RLock", "holders": [holder], "junk": "y"}
    owner = {"host": "h", "pid": 5, "program": "p.py"}
    store.update("r1", owner, [lock, "junk"], "c1", lockstats.VERSION)
    store.update("r2", owner, [lock], "c1", lockstats.VERSION + 1)  # ignored
    (got,) = store.document()
    assert got["kind"] == "RLock" and "junk" not in got
    assert got["holders"][0]["pid"] == 7 and "x" not in got["holders"][0]
    assert got["owner"] == owner
    store.update("r1", owner, [], "c1", lockstats.VERSION)  # none held now
    assert store.document() == []
    store.update("r1", owner, [lock], "c1", lockstats.VERSION)
    store.drop_client("c1")
    assert store.document() == []
