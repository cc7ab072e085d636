"""Tests of the ``fiber-dask`` command (and ``dask fiber``), run as installed.

Every test runs the real console script (``pip install -e .`` puts it next to the
interpreter) in a subprocess, with real files, real environment variables and, where
a cluster is needed, the real embedded cluster or a real ``LocalCluster`` to attach
to.  Each subprocess runs in its own session, and :func:`cli` fails the test if any
process of that session outlives the command: a worker orphaned by the command would
be re-parented away from pytest, out of reach of conftest's leak check.

Where Python itself is the oracle (argv, ``sys.path[0]``, ``__main__``'s attributes,
tracebacks, exit codes), the same script also runs under ``python``.
"""

from __future__ import annotations

import json
import os
import pathlib
import pty
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from typing import NamedTuple

import psutil
import pytest
import yaml
from support.wait import wait_until

REPO = pathlib.Path(__file__).resolve().parent.parent
ADAPTERS = REPO / "adapters"
BIN = pathlib.Path(sys.executable).parent
FIBER_DASK = BIN / "fiber-dask"
DASK = BIN / "dask"

# Seconds the command's processes get to disappear after it exits.
ORPHAN_GRACE = 10.0
UP_STATE_DIR = os.path.join(tempfile.gettempdir(), f"fiber-dask-tests-{os.getpid()}")


class Result(NamedTuple):
    returncode: int
    stdout: str
    stderr: str


def base_env(**extra: str) -> dict[str, str]:
    """The environment of a command: ours minus any DASK_* setting, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DASK_")}
    env.pop("FIBER_DASK_SWAP", None)
    env.pop("FIBER_DASK_SWAP_MAIN", None)
    env["DASK_FIBER__LOCAL__N_WORKERS"] = "2"
    # Never the user's own `fiber-dask up` cluster: a state directory of the tests.
    env["DASK_FIBER__UP__STATE_DIR"] = UP_STATE_DIR
    env.update(extra)
    return env


def cli(
    *args: str | os.PathLike[str],
    cwd: os.PathLike[str] | str | None = None,
    env: dict[str, str] | None = None,
    program: pathlib.Path = FIBER_DASK,
    timeout: float = 120,
    input: str | None = None,
) -> Result:
    """Run the installed command; fail if it leaves any process behind."""
    assert program.exists(), (
        f"{program} is missing: install fiber-dask with `pip install -e .` first"
    )
    proc = subprocess.Popen(
        [str(program), *map(str, args)],
        cwd=cwd,
        env=env if env is not None else base_env(),
        stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(input, timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.communicate()
    _check_no_orphans(proc.pid)
    return Result(proc.returncode, out, err)


def _session_members(sid: int) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["pid"]):
        try:
            if os.getsid(p.pid) == sid and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except (OSError, psutil.Error):
            continue
    return found


def _check_no_orphans(sid: int) -> None:
    deadline = time.monotonic() + ORPHAN_GRACE
    left = _session_members(sid)
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = _session_members(sid)
    if left:
        details = [" ".join(p.cmdline()) for p in left if p.is_running()]
        for p in left:
            try:
                p.kill()
            except psutil.Error:
                pass
        pytest.fail(f"the command left {len(left)} process(es) running: {details}")


def write(path: pathlib.Path, text: str) -> pathlib.Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


def marked(stdout: str, marker: str = "@@") -> list:
    """The JSON values the scripts print after ``marker`` (other lines ignored)."""
    return [
        json.loads(line[len(marker) :])
        for line in stdout.splitlines()
        if line.startswith(marker)
    ]


# ------------------------------------------------------------------------------ help


COMMANDS = [
    [],
    ["run"],
    ["info"],
    ["up"],
    ["down"],
    ["config"],
    ["config", "show"],
    ["config", "validate"],
    ["config", "init"],
    ["kubernetes"],
    ["kubernetes", "manifest"],
]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c) or "main")
def test_help_on_every_command(command: list[str]) -> None:
    result = cli(*command, "-h")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"Usage: fiber-dask {' '.join(command)}".rstrip())
    assert "-h, --help" in result.stdout
    if len(command) == 2:  # a leaf: its long form prints the same
        assert cli(*command, "--help").stdout == result.stdout


def test_dask_fiber_is_the_same_command(tmp_path: pathlib.Path) -> None:
    result = cli("fiber", "-h", program=DASK)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("Usage: dask fiber")
    for name in ("run", "info", "config", "kubernetes", "up", "down"):
        assert f"\n  {name} " in result.stdout
    script = write(tmp_path / "exit3.py", "import sys; print(sys.argv); sys.exit(3)\n")
    result = cli("fiber", "run", script, "a", program=DASK)
    assert (result.returncode, result.stdout) == (3, f"{[str(script), 'a']}\n")


# ------------------------------------------------------------------------------- run

# Prints what `python script.py` sets up, for comparison with `fiber-dask run`.
INTROSPECT = """\
import json, os, sys
main = sys.modules["__main__"]
print("@@" + json.dumps({
    "argv": sys.argv,
    "path0": sys.path[0],
    "name": __name__,
    "file": __file__,
    "main_is_me": main.__dict__ is globals(),
    "spec": repr(__spec__),
    "package": __package__,
    "cached": __cached__,
    "loader": type(__loader__).__name__,
    "doc": __doc__,
    "cwd": os.getcwd(),
}))
if __name__ == "__main__":
    sys.exit(int(sys.argv[1]))
"""


def test_run_sets_up_main_as_python_does(tmp_path: pathlib.Path) -> None:
    script = write(tmp_path / "scripts" / "introspect.py", INTROSPECT)
    args = ["5", "--flag", "-h", "--", "x y"]
    # Relative path, from another directory: __file__ absolute, argv[0] as given.
    rel = os.path.relpath(script, tmp_path)
    ours = cli("run", rel, *args, cwd=tmp_path)
    python = subprocess.run(
        [sys.executable, rel, *args], cwd=tmp_path, capture_output=True, text=True
    )
    assert ours.returncode == python.returncode == 5, ours.stderr
    assert marked(ours.stdout) == marked(python.stdout)
    assert marked(ours.stdout)[0]["argv"] == [rel, *args]


@pytest.mark.parametrize(
    "body",
    [
        "def f():\n    raise ValueError('boom')\nf()\n",
        "import sys\nsys.exit('bye')\n",
        "x = (\n",
        "raise SystemExit(0)\n",
    ],
    ids=["exception", "exit-message", "syntax-error", "exit-0"],
)
def test_run_failures_look_as_with_python(tmp_path: pathlib.Path, body: str) -> None:
    script = write(tmp_path / "bad.py", body)
    ours = cli("run", script, cwd=tmp_path)
    python = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True
    )
    assert (ours.returncode, ours.stderr) == (python.returncode, python.stderr)


def test_run_pool_on_the_embedded_cluster(tmp_path: pathlib.Path) -> None:
    """A Pool inside the script runs in the cluster's worker processes, which
    re-import the script as __mp_main__ without running its guarded part."""
    script = write(
        tmp_path / "pooled.py",
        """\
        import json, os, sys
        import fiber_dask

        def where(x):
            # The task's process and its ancestors: it runs in a slot process
            # beneath the Dask worker that imported this script.
            import psutil

            return x * x, [os.getpid()] + [p.pid for p in psutil.Process().parents()]

        print("@@" + json.dumps(["imported", __name__, os.getpid()]), flush=True)

        if __name__ == "__main__":
            with fiber_dask.Pool(2) as pool:
                results = pool.map(where, range(8))
            handle = fiber_dask.cluster.get_handle()
            print("@@" + json.dumps(["ran", [r for r, _ in results],
                                     [p for _, p in results],
                                     handle.backend, sys.argv[1:]]), flush=True)
            sys.exit(4)
        """,
    )
    result = cli("run", script, "--opt", cwd=tmp_path)
    assert result.returncode == 4, result.stderr
    events = marked(result.stdout)
    me = [e for e in events if e[:2] == ["imported", "__main__"]]
    assert len(me) == 1, events
    client_pid = me[0][2]
    ran = [e for e in events if e[0] == "ran"]
    assert len(ran) == 1, events  # the guarded part ran once, in the client
    squares, task_pids, backend, argv = ran[0][1:]
    assert squares == [x * x for x in range(8)]
    assert backend == "local" and argv == ["--opt"]
    assert client_pid not in {chain[0] for chain in task_pids}
    reimports = {e[2] for e in events if e[:2] == ["imported", "__mp_main__"]}
    assert all(set(chain) & reimports for chain in task_pids), (task_pids, events)


def test_run_rejects_an_invalid_config_before_running(tmp_path: pathlib.Path) -> None:
    marker = tmp_path / "ran"
    script = write(tmp_path / "s.py", f"open({str(marker)!r}, 'w').close()\n")
    bad = write(tmp_path / "bad.yaml", "fiber:\n  pool:\n    chunksize: 0\n")
    result = cli("run", "--config", bad, script)
    assert result.returncode == 1
    assert "fiber.pool.chunksize = 0" in result.stderr
    assert f"from: file {bad}" in result.stderr
    assert not marker.exists()
    result = cli("run", "--backend", "no-such-backend", script)
    assert result.returncode == 1
    assert "fiber.backend = 'no-such-backend'" in result.stderr
    assert "from: the --backend option" in result.stderr
    assert not marker.exists()


# ------------------------------------------------------------------------------ swap

HELPER = """\
import multiprocessing
from multiprocessing import current_process


def where(_):
    return [multiprocessing.__name__, current_process.__module__]


def report(q):
    q.put(["child", multiprocessing.__name__])
"""

# A library outside the script's directory (on PYTHONPATH), imported after the swap.
THIRD_PARTY = """\
import multiprocessing
import multiprocessing.pool
NAME = multiprocessing.__name__
POOL = multiprocessing.pool.Pool.__module__
"""

LEGACY = """\
import json
import multiprocessing
import multiprocessing as mp
import multiprocessing.pool
import multiprocessing.dummy
from multiprocessing import Pool, Queue
from multiprocessing.pool import ThreadPool
from multiprocessing.managers import SyncManager
import sys

import helper


def out(*values):
    print("@@" + json.dumps(list(values)), flush=True)


def inside(_):
    import multiprocessing as inner  # a function of the script, run on a worker
    return inner.__name__


if __name__ == "__main__":
    out("modules", multiprocessing.__name__, mp.__name__,
        multiprocessing.pool.__name__, SyncManager.__module__)
    out("fallback", multiprocessing.dummy.__name__)
    try:
        import multiprocessing.no_such_module
    except ImportError as e:
        out("missing", type(e).__name__, str(e))
    import distributed.nanny, distributed.utils, thirdparty, ourlib
    out("ourlib", ourlib.NAME)
    out("libraries", distributed.nanny.multiprocessing.__name__,
        distributed.utils.multiprocessing.__name__, thirdparty.NAME, thirdparty.POOL,
        sys.modules["multiprocessing"].__name__)
    with Pool(2) as pool:
        out("pool", type(pool).__module__, pool.map(abs, [-1, -2, 3]))
        out("workers", pool.map(helper.where, range(2)), pool.map(inside, range(2)))
    with ThreadPool(2) as tp:
        out("threadpool", tp.map(abs, [-4]))
    with multiprocessing.Manager() as manager:
        shared = manager.dict(a=1)
        out("manager", type(manager).__module__, dict(shared))
    q = Queue()
    p = multiprocessing.Process(target=helper.report, args=(q,))
    p.start()
    out("process", q.get(timeout=60))
    p.join()
    out("exitcode", p.exitcode)
"""


@pytest.fixture
def legacy(tmp_path: pathlib.Path) -> tuple[pathlib.Path, dict[str, str]]:
    """An unmodified multiprocessing program, its helper module and a library."""
    write(tmp_path / "app" / "helper.py", HELPER)
    write(tmp_path / "site" / "thirdparty.py", THIRD_PARTY)
    # The user's own library, installed elsewhere: swapped only when named in
    # fiber.run.swap-modules.
    write(tmp_path / "site" / "ourlib" / "__init__.py", THIRD_PARTY)
    script = write(tmp_path / "app" / "legacy.py", LEGACY)
    # The library's directory first; then whatever this test run imports
    # fiber_dask from (a checkout on PYTHONPATH, as in a worktree).
    pythonpath = [str(tmp_path / "site"), os.environ.get("PYTHONPATH", "")]
    env = base_env(PYTHONPATH=os.pathsep.join(p for p in pythonpath if p))
    return script, env


def by_name(events: list) -> dict:
    return {e[0]: e[1:] for e in events}


def test_legacy_program_runs_under_python(legacy) -> None:
    """The oracle: the same unmodified program under the stdlib."""
    script, env = legacy
    result = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    got = by_name(marked(result.stdout))
    assert got["modules"] == [
        "multiprocessing",
        "multiprocessing",
        "multiprocessing.pool",
        "multiprocessing.managers",
    ]
    assert got["workers"] == [
        [["multiprocessing", "multiprocessing.process"]] * 2,
        ["multiprocessing"] * 2,
    ]
    assert got["process"] == [["child", "multiprocessing"]]


def test_swap_on_the_embedded_cluster(legacy) -> None:
    script, env = legacy
    # cwd: a fiber_dask.Process child finds `helper` through its working directory
    # (it does not inherit the worker's sys.path; see the report on issue 5).
    result = cli("run", "--swap-multiprocessing", script, env=env, cwd=script.parent)
    assert result.returncode == 0, result.stderr
    got = by_name(marked(result.stdout))
    # Every import form in the script gets fiber_dask (or its submodule).
    assert got["modules"] == [
        "fiber_dask",
        "fiber_dask",
        "fiber_dask.pool",
        "fiber_dask.managers",
    ]
    # A submodule fiber_dask lacks is the stdlib's; one nobody has is not found.
    assert got["fallback"] == ["multiprocessing.dummy"]
    assert got["ourlib"] == ["multiprocessing"]  # not in fiber.run.swap-modules
    assert got["missing"] == [
        "ModuleNotFoundError",
        "No module named 'multiprocessing.no_such_module'",
    ]
    # distributed, a library imported after the swap, and sys.modules: the stdlib.
    assert got["libraries"] == [
        "multiprocessing",
        "multiprocessing",
        "multiprocessing",
        "multiprocessing.pool",
        "multiprocessing",
    ]
    assert got["pool"] == ["fiber_dask.pool", [1, 2, 3]]
    # On the workers: the helper module imported there, and a function of the
    # script shipped by value, both see fiber_dask.
    assert got["workers"] == [
        [["fiber_dask", "fiber_dask.context"]] * 2,
        ["fiber_dask"] * 2,
    ]
    assert got["threadpool"] == [[4]]
    assert got["manager"] == ["fiber_dask.managers", {"a": 1}]
    # The child of a fiber_dask.Process, which imports helper itself.
    assert got["process"] == [["child", "fiber_dask"]]
    assert got["exitcode"] == [0]


def test_swap_off_by_default_and_overridable(tmp_path: pathlib.Path) -> None:
    script = write(
        tmp_path / "which.py",
        "import json, multiprocessing\nprint('@@' + json.dumps(multiprocessing.__name__))\n",
    )
    profile = write(
        tmp_path / "swap.yaml", "fiber:\n  run:\n    swap-multiprocessing: true\n"
    )
    assert marked(cli("run", script).stdout) == ["multiprocessing"]
    result = cli("run", "--config", profile, "--no-swap-multiprocessing", script)
    assert (result.returncode, marked(result.stdout)) == (0, ["multiprocessing"])


def test_swap_needs_the_main_guard_as_spawn_does(tmp_path: pathlib.Path) -> None:
    """Workers import the script, as the stdlib's spawn method does: a script that
    starts a Pool at its top level stops with the reason, and leaves nothing."""
    script = write(
        tmp_path / "unguarded.py",
        "import multiprocessing\nwith multiprocessing.Pool(2) as p:\n    p.map(abs, [1])\n",
    )
    result = cli("run", "--swap-multiprocessing", script)
    assert result.returncode == 1
    # One message, before any worker starts (none prints its traceback).
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"Error: {script}: the embedded cluster would start")
    assert "`if __name__ == '__main__':`" in line and "fiber-dask up" in line


def test_run_without_main_guard_says_so_in_one_line(tmp_path: pathlib.Path) -> None:
    script = write(
        tmp_path / "unguarded.py",
        "import fiber_dask\nprint('top')\nwith fiber_dask.Pool(2) as p:\n"
        "    print(p.map(abs, [-1]))\n",
    )
    result = cli("run", script)
    assert (result.returncode, result.stdout) == (1, "top\n")
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"Error: {script}, line 3: the embedded cluster would")
    # A guard anywhere at the top level: not this error (the script then runs).
    guarded = write(
        tmp_path / "guarded.py",
        "import fiber_dask\nif '__main__' == __name__:\n"
        "    with fiber_dask.Pool(2) as p:\n        print(p.map(abs, [-1]))\n",
    )
    result = cli("run", guarded)
    assert (result.returncode, result.stdout) == (0, "[1]\n"), result.stderr


@pytest.mark.parametrize(
    "source, guarded",
    [
        ("if __name__ == '__main__':\n    main()\n", True),
        ('if "__main__" == __name__:\n    main()\n', True),
        ("if __name__ != '__main__':\n    raise SystemExit\nmain()\n", True),
        ("import sys\nif __name__ == '__main__' and sys.argv:\n    main()\n", True),
        ("main()\n", False),
        ("def f():\n    if __name__ == '__main__':\n        main()\n", False),
        ("if name == '__main__':\n    main()\n", False),
        ("x = (\n", True),  # a syntax error: compile() reports it, not the guard
    ],
)
def test_main_guard_detection(source: str, guarded: bool) -> None:
    from fiber_dask.launch import mainguard

    assert mainguard.has_main_guard(source) is guarded


MODULE_INTROSPECT = """\
import json, os, sys
main = sys.modules["__main__"]
print("@@" + json.dumps({
    "argv": sys.argv,
    "path0": sys.path[0],
    "name": __name__,
    "file": __file__,
    "main_is_me": main.__dict__ is globals(),
    "spec": __spec__.name,
    "package": __package__,
    "cached": __cached__,
    "loader": type(__loader__).__name__,
    "cwd": os.getcwd(),
}))
if __name__ == "__main__":
    sys.exit(int(sys.argv[1]))
"""


@pytest.mark.parametrize("target", ["pkg.intro", "pkg"])
def test_run_module_as_python_does(tmp_path: pathlib.Path, target: str) -> None:
    write(tmp_path / "pkg" / "__init__.py", "")
    write(tmp_path / "pkg" / "intro.py", MODULE_INTROSPECT)
    write(tmp_path / "pkg" / "__main__.py", MODULE_INTROSPECT)
    args = ["6", "--flag", "-h"]
    ours = cli("run", "-m", target, *args, cwd=tmp_path)
    python = subprocess.run(
        [sys.executable, "-m", target, *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=base_env(),
    )
    assert ours.returncode == python.returncode == 6, ours.stderr
    assert marked(ours.stdout) == marked(python.stdout)


def test_run_module_errors_in_one_line(tmp_path: pathlib.Path) -> None:
    write(tmp_path / "nomain" / "__init__.py", "")
    for target, words in [
        ("no_such_module", "No module named no_such_module"),
        ("no_such.thing", "No module named 'no_such'"),
        ("nomain", "'nomain' is a package and cannot be directly executed"),
    ]:
        result = cli("run", "-m", target, cwd=tmp_path)
        assert result.returncode == 1, target
        (line,) = result.stderr.splitlines()
        assert line.startswith("Error: ") and words in line, line


def test_run_module_pool_on_the_embedded_cluster(tmp_path: pathlib.Path) -> None:
    """Workers import the module by name (as __mp_main__), as spawn does."""
    write(tmp_path / "app" / "__init__.py", "")
    write(
        tmp_path / "app" / "job.py",
        """\
        import json, os, sys
        import fiber_dask

        def where(x):
            # The task's process and its ancestors: it runs in a slot process
            # beneath the Dask worker that imported this script.
            import psutil

            return x * x, [os.getpid()] + [p.pid for p in psutil.Process().parents()]

        print("@@" + json.dumps(["imported", __name__, os.getpid()]), flush=True)

        if __name__ == "__main__":
            with fiber_dask.Pool(2) as pool:
                results = pool.map(where, range(6))
            print("@@" + json.dumps(["ran", [r[0] for r in results],
                                     [r[1] for r in results], sys.argv[1:]]))
        """,
    )
    result = cli("run", "-m", "app.job", "x", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    events = marked(result.stdout)
    ((_, squares, task_pids, argv),) = [e for e in events if e[0] == "ran"]
    assert squares == [x * x for x in range(6)] and argv == ["x"]
    reimports = {e[2] for e in events if e[:2] == ["imported", "__mp_main__"]}
    assert all(set(chain) & reimports for chain in task_pids), events


def test_run_script_from_stdin(tmp_path: pathlib.Path) -> None:
    """`fiber-dask run -` as `python -`: no main guard needed, since no worker
    imports a script that has no file; its functions travel by value."""
    source = textwrap.dedent(
        """\
        import json, sys
        import fiber_dask

        def square(x):
            return x * x

        path0 = sys.path[0]  # as python set it (distributed adds its own later)
        with fiber_dask.Pool(2) as pool:
            squares = pool.map(square, range(5))
        print("@@" + json.dumps([squares, sys.argv, path0, __name__]))
        sys.exit(3)
        """
    )
    result = cli("run", "-", "a", "--b", cwd=tmp_path, input=source)
    assert result.returncode == 3, result.stderr
    assert marked(result.stdout) == [
        [[0, 1, 4, 9, 16], ["-", "a", "--b"], "", "__main__"]
    ]
    # What python does with the same argv and path (no Pool: its spawn cannot).
    python = subprocess.run(
        [sys.executable, "-", "a", "--b"],
        input="import json, sys\nprint('@@' + json.dumps([sys.argv, sys.path[0]]))\n",
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert marked(python.stdout) == [[["-", "a", "--b"], ""]]
    # Errors as python prints them, with <stdin> as the file.
    bad = cli("run", "-", input="x = 1\nraise ValueError('boom')\n")
    python = subprocess.run(
        [sys.executable, "-"],
        input="x = 1\nraise ValueError('boom')\n",
        capture_output=True,
        text=True,
    )
    assert (bad.returncode, bad.stderr) == (python.returncode, python.stderr)
    # The swap re-imports the script from its file: one clear line.
    swap = cli("run", "--swap-multiprocessing", "-", input="print(1)\n")
    assert swap.returncode == 1 and swap.stdout == ""
    (line,) = swap.stderr.splitlines()
    assert "does not support a script from stdin" in line


@pytest.fixture
def attached_cluster(tmp_path: pathlib.Path, legacy, monkeypatch):
    """A cluster fiber-dask did not start, whose workers can import the program.

    Its workers are spawned from this process, with the program's directory on
    sys.path and PYTHONPATH (for fiber_dask.Process children), and none of the
    environment `fiber-dask run` would give its own workers.
    """
    from distributed import Client, LocalCluster

    script, env = legacy
    monkeypatch.syspath_prepend(str(script.parent))
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join([str(script.parent), env["PYTHONPATH"]])
    )
    with LocalCluster(
        n_workers=1,
        threads_per_worker=2,
        processes=True,
        dashboard_address=None,
        host="127.0.0.1",
    ) as cluster:
        with Client(cluster) as client:
            yield cluster, client


def test_swap_on_an_attached_cluster_from_a_profile(
    attached_cluster, legacy, tmp_path: pathlib.Path
) -> None:
    """The worker plugin swaps on workers fiber-dask did not start, and leaves
    them as they were at the end."""
    cluster, client = attached_cluster
    script, env = legacy
    profile = write(
        tmp_path / "swap.yaml",
        "fiber:\n  run:\n    swap-multiprocessing: true\n    swap-modules: [ourlib]\n",
    )
    result = cli(
        "run",
        "--config",
        profile,
        "--address",
        cluster.scheduler_address,
        script,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    got = by_name(marked(result.stdout))
    assert got["ourlib"] == ["fiber_dask"]
    assert got["libraries"][2] == "multiprocessing"  # thirdparty
    assert got["workers"] == [
        [["fiber_dask", "fiber_dask.context"]] * 2,
        ["fiber_dask"] * 2,
    ]
    assert got["process"] == [["child", "fiber_dask"]]
    # The cluster keeps running, without the plugin, and its workers' import
    # machinery is the original again.
    plugins = client.run_on_scheduler(
        lambda dask_scheduler: sorted(dask_scheduler.worker_plugins)
    )
    assert not [p for p in plugins if p.startswith("fiber-dask-swap")], plugins
    hooks = client.run(
        lambda: getattr(__import__("builtins").__import__, "__module__", None)
    )
    assert set(hooks.values()) == {"builtins"}, hooks

    # `info` on an attached cluster describes it and leaves it running.
    info = cli("info", "--address", cluster.scheduler_address)
    assert info.returncode == 0, info.stderr
    lines = dict(line.split(":", 1) for line in info.stdout.splitlines())
    assert lines["backend"].strip() == "address (attached; left running)"
    assert lines["scheduler"].strip() == cluster.scheduler_address
    assert lines["workers"].strip() == "1"
    assert lines["threads"].strip().startswith("2 ")
    assert len(client.scheduler_info()["workers"]) == 1


# ---------------------------------------------------------------------------- config


def test_config_show_names_every_source(tmp_path: pathlib.Path) -> None:
    dask_dir = tmp_path / "dask"
    write(
        dask_dir / "site.yaml", "fiber:\n  pool:\n    prefetch: 5ms\n    chunksize: 3\n"
    )
    profile = write(tmp_path / "profile.yaml", "fiber:\n  pool:\n    chunksize: 7\n")
    env = base_env(DASK_CONFIG=str(dask_dir), DASK_FIBER__ADAPTIVE__WAIT_COUNT="9")
    result = cli("config", "show", "--json", "--config", profile, env=env)
    assert result.returncode == 0, result.stderr
    shown = json.loads(result.stdout)
    assert shown["fiber.pool.chunksize"] == {
        "value": 7,
        "source": f"file {profile}",
    }
    assert shown["fiber.pool.prefetch"] == {
        "value": "5ms",
        "source": f"file {dask_dir / 'site.yaml'}",
    }
    assert shown["fiber.adaptive.wait-count"] == {
        "value": 9,
        "source": "environment variable DASK_FIBER__ADAPTIVE__WAIT_COUNT",
    }
    assert shown["fiber.local.n-workers"]["value"] == 2  # base_env sets it
    assert shown["fiber.backend"] == {"value": None, "source": "default"}
    assert shown["fiber.run.swap-multiprocessing"] == {
        "value": False,
        "source": "default",
    }

    text = cli("config", "show", "--config", profile, env=env)
    assert text.returncode == 0
    line = next(
        x for x in text.stdout.splitlines() if x.startswith("fiber.pool.chunksize:")
    )
    assert line.split("#")[0].split(":", 1)[1].strip() == "7"
    assert line.endswith(f"# file {profile}")


def test_config_show_of_an_invalid_config(tmp_path: pathlib.Path) -> None:
    bad = write(tmp_path / "bad.yaml", "fiber:\n  pool:\n    chunksize: 0\n")
    result = cli("config", "show", "--config", bad)
    assert result.returncode == 1
    assert any(
        line.startswith("fiber.pool.chunksize: 0 ")
        for line in result.stdout.splitlines()
    )
    assert "fiber.pool.chunksize = 0" in result.stderr
    assert "allowed: an integer (minimum 1) or null" in result.stderr
    assert f"from: file {bad}" in result.stderr


def test_config_validate(tmp_path: pathlib.Path) -> None:
    adapters = sorted(ADAPTERS.glob("*.yaml"))
    assert adapters
    good = cli("config", "validate", *adapters)
    assert good.returncode == 0, good.stderr
    assert good.stdout.splitlines() == [f"{a}: ok" for a in adapters]

    bad = write(
        tmp_path / "bad.yaml",
        """\
        fiber:
          local:
            n-wrkers: 2
          adaptive:
            interval: soon
        """,
    )
    broken = write(tmp_path / "broken.yaml", "fiber: [1\n")
    result = cli("config", "validate", adapters[0], bad, broken)
    assert result.returncode == 1
    assert result.stdout.splitlines() == [f"{adapters[0]}: ok"]
    err = result.stderr
    assert f"{bad}: Invalid fiber-dask configuration (2 problems)" in err
    assert "fiber.local.n-wrkers = 2\n    unknown key; did you mean 'n-workers'?" in err
    assert "fiber.adaptive.interval = 'soon'" in err
    assert "allowed: a duration as dask.utils.parse_timedelta reads it" in err
    assert f"from: file {bad}" in err
    assert f"{broken} is not valid YAML" in err and "line 2" in err


def test_config_validate_flags_a_misspelt_section(tmp_path: pathlib.Path) -> None:
    """A file with `fibre:` and no `fiber:` sets nothing fiber-dask reads."""
    typo = write(tmp_path / "typo.yaml", "fibre:\n  pool:\n    chunksize: 2\n")
    result = cli("config", "validate", typo)
    assert result.returncode == 1
    assert "fibre = {'pool': {'chunksize': 2}}" in result.stderr
    assert "did you mean 'fiber'?" in result.stderr
    assert f"from: file {typo}" in result.stderr
    misplaced = write(tmp_path / "flat.yaml", "pool:\n  chunksize: 2\n")
    result = cli("config", "validate", misplaced)
    assert result.returncode == 1
    assert "did you mean 'fiber.pool'?" in result.stderr
    # dask-kubernetes' own namespace is not ours to judge.
    theirs = write(tmp_path / "kube.yaml", "kubernetes:\n  namespace: x\n")
    assert cli("config", "validate", theirs).returncode == 0
    script = write(tmp_path / "s.py", "print('ran')\n")
    run = cli("run", "--config", typo, script)
    assert (run.returncode, run.stdout) == (1, "")
    assert "did you mean 'fiber'?" in run.stderr


def test_config_validate_ignores_the_environment(tmp_path: pathlib.Path) -> None:
    """A profile is judged on its own: a bad variable around it is not its fault."""
    good = write(tmp_path / "good.yaml", "fiber:\n  pool:\n    chunksize: 2\n")
    env = base_env(DASK_FIBER__POOL__PREFETCH="never")
    result = cli("config", "validate", good, env=env)
    assert (result.returncode, result.stdout.strip()) == (0, f"{good}: ok")


def test_config_init(tmp_path: pathlib.Path) -> None:
    target = tmp_path / "profiles" / "mine.yaml"
    result = cli("config", "init", target)
    assert result.returncode == 0, result.stderr
    text = target.read_text()
    assert text.startswith(
        "# fiber-dask configuration, written by `fiber-dask config init`"
    )
    assert "# Which cluster to run on" in text  # the defaults' comments came along
    from fiber_dask import config

    assert yaml.safe_load(text) == config.defaults
    assert cli("config", "validate", target).returncode == 0

    # No overwriting without --force.
    target.write_text("# mine\n")
    again = cli("config", "init", target)
    assert again.returncode == 1
    assert "exists; use --force" in again.stderr
    assert target.read_text() == "# mine\n"
    forced = cli("config", "init", "--force", "--profile", "local", target)
    assert forced.returncode == 0, forced.stderr
    local = (ADAPTERS / "local.yaml").read_text()
    assert target.read_text().endswith(local)
    assert yaml.safe_load(target.read_text()) == yaml.safe_load(local)

    # The default place is Dask's user config directory; "-" prints.
    dask_dir = tmp_path / "dask-config"
    result = cli("config", "init", env=base_env(DASK_CONFIG=str(dask_dir)))
    assert result.returncode == 0, result.stderr
    assert (dask_dir / "fiber.yaml").read_text() == text
    printed = cli("config", "init", "-", "--profile", "local")
    assert printed.stdout == target.read_text()

    unknown = cli("config", "init", "-", "--profile", "nope")
    assert unknown.returncode == 1
    assert "no profile named 'nope'; available: defaults" in unknown.stderr
    assert "local" in unknown.stderr


def test_importing_the_cli_writes_nothing(tmp_path: pathlib.Path) -> None:
    home, dask_dir = tmp_path / "home", tmp_path / "dask"
    home.mkdir()
    dask_dir.mkdir()
    env = base_env(HOME=str(home), DASK_CONFIG=str(dask_dir))
    subprocess.run(
        [sys.executable, "-c", "import fiber_dask.cli, fiber_dask.swap"],
        env=env,
        check=True,
    )
    assert list(home.iterdir()) == [] and list(dask_dir.iterdir()) == []


# ------------------------------------------------------------------------ kubernetes


@pytest.mark.parametrize("profile", ["kubernetes.yaml", "kubernetes-adaptive.yaml"])
def test_kubernetes_manifest_prints_the_generators_documents(profile: str) -> None:
    from fiber_dask.backends.kubemanifest import manifests

    path = ADAPTERS / profile
    result = cli("kubernetes", "manifest", "--config", path)
    assert result.returncode == 0, result.stderr
    printed = list(yaml.safe_load_all(result.stdout))
    assert result.stdout.startswith("---\n")
    # What the generator makes of the same profile, computed here.
    expected = manifests(yaml.safe_load(path.read_text())["fiber"])
    assert printed == json.loads(json.dumps(expected))
    kinds = [d["kind"] for d in printed]
    assert kinds[0] == "DaskCluster"
    if "adaptive" in profile:
        assert "DaskAutoscaler" in kinds
    for doc in printed:
        assert doc["apiVersion"] and doc["metadata"]["name"]


def test_kubernetes_manifest_errors(tmp_path: pathlib.Path) -> None:
    # The defaults have no image: the generator says so, naming the key.
    result = cli("kubernetes", "manifest")
    assert result.returncode == 1
    assert "fiber.kubernetes.image" in result.stderr
    assert result.stdout == ""


# ------------------------------------------------------------------------------ info


def test_info_on_the_embedded_cluster() -> None:
    result = cli("info", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["backend"] == "local" and data["owned"] is True
    assert data["scheduler"].startswith("tcp://127.0.0.1:")
    assert (data["workers"], data["threads"]) == (2, 2)
    assert data["memory"] > 0
    assert data["dashboard"].startswith("http://") and data["dashboard"].endswith(
        "/status"
    )
    import dask

    assert data["versions"]["dask"] == dask.__version__


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_info_unreachable_scheduler() -> None:
    address = f"tcp://127.0.0.1:{_closed_port()}"
    env = base_env(DASK_FIBER__CONNECT_TIMEOUT="1s")
    result = cli("info", "--address", address, env=env)
    assert result.returncode == 1
    assert f"cannot reach the Dask scheduler at {address}" in result.stderr
    assert "Traceback" not in result.stderr


# ---------------------------------------------------------------------------- errors


def _stderr_on_a_tty(*args: str | os.PathLike[str]) -> tuple[int, str]:
    """Run the command with stderr on a pseudo-terminal, as a user sees it."""
    leader, follower = pty.openpty()
    try:
        proc = subprocess.run(
            [str(FIBER_DASK), *map(str, args)],
            env=base_env(TERM="xterm"),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=follower,
            timeout=60,
        )
        os.close(follower)
        follower = -1
        chunks = []
        while True:
            try:
                data = os.read(leader, 65536)
            except OSError:  # EIO: the other side is closed and drained
                break
            if not data:
                break
            chunks.append(data)
        return proc.returncode, b"".join(chunks).decode()
    finally:
        os.close(leader)
        if follower >= 0:
            os.close(follower)


RED = "\x1b[31m"


def test_errors_are_red_on_a_terminal_and_exit_1(tmp_path: pathlib.Path) -> None:
    bad = write(tmp_path / "bad.yaml", "fiber:\n  pool:\n    chunksize: 0\n")
    code, err = _stderr_on_a_tty("config", "validate", bad)
    assert code == 1
    assert err.startswith(RED) and "fiber.pool.chunksize = 0" in err

    code, err = _stderr_on_a_tty("info", "--backend", "nope")
    assert code == 1
    assert err.startswith(RED + "Error: Invalid fiber-dask configuration")

    # Usage errors: click's usage line and exit status 2, the message in red.
    code, err = _stderr_on_a_tty("run", tmp_path / "missing.py")
    assert code == 2
    assert err.startswith("Usage: fiber-dask run")
    assert RED + "Error: Invalid value for 'SCRIPT'" in err

    # Not a terminal: the same text, no colour codes.
    plain = cli("config", "validate", bad)
    assert plain.returncode == 1 and "\x1b[" not in plain.stderr
    assert "fiber.pool.chunksize = 0" in plain.stderr


def test_info_says_the_dashboard_closes_and_keep_keeps_it() -> None:
    text = cli("info")
    assert text.returncode == 0, text.stderr
    (line,) = [x for x in text.stdout.splitlines() if x.startswith("dashboard:")]
    assert "closed with the cluster when this command ends" in line
    assert "fiber-dask info --keep" in line and "fiber-dask up" in line

    proc = subprocess.Popen(
        [str(FIBER_DASK), "info", "--keep", "--json"],
        env=base_env(),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("keeping the cluster until Ctrl-C"):
                break
        data = json.loads("".join(lines[:-1]))
        assert data["kept"] is True and data["owned"] is True
        # The cluster is still there: its scheduler answers.
        host, port = data["scheduler"].removeprefix("tcp://").rsplit(":", 1)
        socket.create_connection((host, int(port)), timeout=10).close()
        os.kill(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.communicate()
    assert proc.returncode == 0, err
    _check_no_orphans(proc.pid)
    with pytest.raises(OSError):
        socket.create_connection((host, int(port)), timeout=5).close()


# -------------------------------------------------------------------------- up/down


def _tree(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


@pytest.fixture
def up_env(tmp_path: pathlib.Path):
    """An environment whose `fiber-dask up` state lives in tmp_path; whatever
    cluster a test leaves up is stopped (and, failing that, killed) afterwards."""
    env = base_env(DASK_FIBER__UP__STATE_DIR=str(tmp_path / "state"))
    yield env
    state = tmp_path / "state" / "up.json"
    if state.exists():
        pid = json.loads(state.read_text())["pid"]
        cli("down", env=env)
        if psutil.pid_exists(pid):
            os.killpg(pid, 9)


@pytest.mark.slow
def test_up_serves_programs_until_down(up_env, tmp_path: pathlib.Path) -> None:
    env = up_env
    started = cli("up", env=env)
    assert started.returncode == 0, started.stderr
    assert started.stdout.startswith("up: 2 workers, 2 task slots at tcp://127.0.0.1:")
    state_file = tmp_path / "state" / "up.json"
    state = json.loads(state_file.read_text())
    assert state_file.stat().st_mode & 0o777 == 0o600
    assert state_file.parent.stat().st_mode & 0o777 == 0o700
    server = state["pid"]
    tree = _tree(server)
    assert len(tree) >= 3  # the server and its two worker processes (nannies')
    # Nothing of it listens beyond 127.0.0.1.
    listening = [
        c.laddr
        for p in tree
        for c in p.net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN
    ]
    assert listening and {a.ip for a in listening} == {"127.0.0.1"}, listening

    again = cli("up", env=env)
    assert again.returncode == 0 and again.stdout.startswith("already up: ")
    assert json.loads(state_file.read_text())["pid"] == server

    # A program finds it by itself and runs its tasks in its worker processes.
    script = write(
        tmp_path / "short.py",
        """\
        import json, os
        import fiber_dask

        def pid(_):
            # The Dask worker beneath which the task ran (its slot process
            # is forked from the worker's template, and ends with the pool).
            import psutil

            return [p.pid for p in psutil.Process().parents()]

        if __name__ == "__main__":
            with fiber_dask.Pool(2) as pool:
                pids = pool.map(pid, range(8))
            handle = fiber_dask.cluster.get_handle()
            print("@@" + json.dumps([handle.backend, handle.owned, pids]))
        """,
    )
    for _ in range(2):  # the cluster outlives each run
        result = cli("run", script, env=env)
        assert result.returncode == 0, result.stderr
        ((backend, owned, pids),) = marked(result.stdout)
        assert (backend, owned) == ("up", False)
        up_pids = {p.pid for p in _tree(server)}
        assert all(set(chain) & up_pids for chain in pids), pids
    info = cli("info", env=env)
    assert "the cluster of `fiber-dask up`; left running" in info.stdout
    # A program that asks for the local backend gets a cluster of its own.
    local = cli("run", "--backend", "local", script, env=env)
    assert marked(local.stdout)[0][:2] == ["local", True], local.stderr
    off = cli("run", script, env={**env, "DASK_FIBER__UP__USE": "false"})
    assert marked(off.stdout)[0][:2] == ["local", True], off.stderr

    stopped = cli("down", env=env)
    assert stopped.returncode == 0, stopped.stderr
    assert stopped.stdout.startswith("down: stopped the cluster at tcp://127.0.0.1:")
    assert not state_file.exists()
    for p in tree:
        wait_until(lambda p=p: not p.is_running(), 30, f"process {p.pid} to exit")
    assert cli("down", env=env).stdout == "not up\n"


def test_a_stale_state_file_is_ignored(up_env, tmp_path: pathlib.Path) -> None:
    env = up_env
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    state_file = tmp_path / "state" / "up.json"
    write(
        state_file,
        json.dumps(
            {
                "pid": dead.pid,
                "address": f"tcp://127.0.0.1:{_closed_port()}",
                "dashboard": None,
                "workers": 2,
                "threads": 2,
                "started": 0.0,
            }
        ),
    )
    script = write(
        tmp_path / "s.py",
        "import fiber_dask\nif __name__ == '__main__':\n"
        "    print(fiber_dask.cluster.get_handle().backend)\n",
    )
    result = cli("run", script, env=env)
    assert (result.returncode, result.stdout) == (0, "local\n"), result.stderr
    # A live pid that is not the server (pid reuse) is stale too.
    from fiber_dask.backends import upcluster

    state_file.write_text(
        state_file.read_text().replace(str(dead.pid), str(os.getpid()))
    )
    assert upcluster.read_state(str(state_file)) is None
    removed = cli("down", env=env)
    assert removed.stdout.startswith("not up (removed the stale ")
    assert not state_file.exists()
