"""A real one-host SLURM for the tests: install (Debian packages), start, stop.

It runs without systemd or cgroups on any Debian-like machine where we are
root: ``munged`` as the ``munge`` user, ``slurmctld`` (cold start) and
``slurmd`` as daemons with PID files, everything else (config, state, spool,
logs) in one directory of our own, found by the clients through
``SLURM_CONF``.  The node advertises more CPUs than the machine has
(``SlurmdParameters=config_overrides``) so that several one-core worker jobs
run at once.

``stop`` ends exactly what ``start`` started: the jobs of this cluster (it is
ours alone), the daemons whose PIDs it recorded, and munged only if it was not
already running.

Used two ways::

    python tests/support/slurm.py start DIR   # .ci/run, around the test command
    python tests/support/slurm.py stop DIR    # prints SLURM_CONF=DIR/slurm.conf

and from ``tests/test_slurm.py`` (:func:`start` / :func:`stop`), which starts its
own when ``SLURM_CONF`` does not name a running cluster.  Standard library only:
``.ci/run`` calls it before installing the test requirements.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

__all__ = ["PARTITION", "CPUS", "unavailable", "responding", "start", "stop"]

#: The partition jobs run in.
PARTITION = "fiberci"
#: CPUs the node advertises (more than the machine has: one-core jobs fit).
CPUS = 8

PACKAGES = ["slurmctld", "slurmd", "slurm-client", "munge"]
BINARIES = ["slurmctld", "slurmd", "sbatch", "squeue", "scancel", "munged"]
MUNGE_SOCKET = "/run/munge/munge.socket.2"
MUNGE_PIDFILE = "/run/munge/munged.pid"
STATE_FILE = "started.json"

CONF = """\
# Written by tests/support/slurm.py: a one-host SLURM for fiber-dask's tests.
ClusterName=fiberci
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd.log
# no cgroups, no systemd
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
SchedulerType=sched/backfill
# without it a new job waits up to 3 s for the next scheduling pass
SchedulerParameters=batch_sched_delay=0
ReturnToService=2
KillWait=2
InactiveLimit=0
MinJobAge=2
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={memory_mb} State=UNKNOWN
PartitionName={partition} Nodes={host} Default=YES MaxTime=INFINITE State=UP
"""


def unavailable() -> str | None:
    """Why this process cannot start a SLURM here, or None if it can."""
    if sys.platform != "linux":
        return "needs Linux"
    if os.geteuid() != 0:
        return (
            "starting SLURM daemons needs root (run as root, or start a SLURM and "
            "set SLURM_CONF to its slurm.conf)"
        )
    missing = [b for b in BINARIES if shutil.which(b, path=_path()) is None]
    if missing and shutil.which("apt-get") is None:
        return f"{', '.join(missing)} not installed and no apt-get to install them"
    return None


def responding(env: dict[str, str] | None = None, timeout: float = 5.0) -> bool:
    """True if the SLURM that ``env`` (``SLURM_CONF``) names answers ``sinfo``."""
    if shutil.which("sinfo", path=_path()) is None:
        return False
    try:
        r = subprocess.run(
            ["sinfo", "--noheader", "-o", "%T"],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return r.returncode == 0 and r.stdout.strip() != ""


def start(directory: str, timeout: float = 60.0) -> dict[str, str]:
    """Install if needed, start munged (unless running), slurmctld and slurmd.

    Returns the environment additions for clients (``SLURM_CONF``).  Raises
    ``RuntimeError`` with the daemons' logs when the node does not come up.
    """
    reason = unavailable()
    if reason:
        raise RuntimeError(f"cannot start SLURM: {reason}")
    directory = os.path.abspath(directory)
    os.makedirs(directory, exist_ok=True)
    state: dict[str, object] = {"munged": False}
    _save(directory, state)
    _install()
    if not _munge_ok():
        _start_munged()
        state["munged"] = True
        _save(directory, state)
    for sub in ("state", "spool"):
        os.makedirs(os.path.join(directory, sub), exist_ok=True)
    conf = os.path.join(directory, "slurm.conf")
    host = socket.gethostname().split(".")[0]
    with open(conf, "w") as f:
        f.write(
            CONF.format(
                host=host,
                dir=directory,
                ctld_port=_free_port(),
                slurmd_port=_free_port(),
                cpus=CPUS,
                memory_mb=_memory_mb(),
                partition=PARTITION,
            )
        )
    env = {**os.environ, "SLURM_CONF": conf}
    daemons = [
        ("slurmctld", ["slurmctld", "-c", "-f", conf]),
        ("slurmd", ["slurmd", "-f", conf, "-N", host]),
    ]
    for name, argv in daemons:
        r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=30)
        if r.returncode != 0:
            raise RuntimeError(
                f"{name} did not start ({r.returncode}): {r.stderr.strip()}\n"
                + _logs(directory)
            )
        pidfile = os.path.join(directory, f"{name}.pid")
        state[name] = _read_pid(pidfile, timeout=10)
        _save(directory, state)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = subprocess.run(
            ["sinfo", "--noheader", "-o", "%T"],
            env=env,
            capture_output=True,
            text=True,
            timeout=10,
        )
        if r.returncode == 0 and r.stdout.strip() in ("idle", "mixed", "allocated"):
            return {"SLURM_CONF": conf}
        time.sleep(0.2)
    raise RuntimeError(
        f"the SLURM node did not become idle within {timeout:g}s\n" + _logs(directory)
    )


def stop(directory: str, timeout: float = 30.0) -> None:
    """Cancel the cluster's jobs, stop the daemons :func:`start` started."""
    directory = os.path.abspath(directory)
    try:
        with open(os.path.join(directory, STATE_FILE)) as f:
            state = json.load(f)
    except (OSError, ValueError):
        return  # nothing was started
    conf = os.path.join(directory, "slurm.conf")
    env = {**os.environ, "SLURM_CONF": conf}
    if state.get("slurmctld") and os.path.exists(conf):
        # Jobs outlive slurmd (their slurmstepd is its own process): end them first.
        subprocess.run(["scancel", "--full", "--quiet", "-p", PARTITION], env=env)
        deadline = time.monotonic() + timeout / 2
        while time.monotonic() < deadline:
            r = subprocess.run(
                ["squeue", "--noheader", "-o", "%i"],
                env=env,
                capture_output=True,
                text=True,
            )
            if r.returncode != 0 or not r.stdout.strip():
                break
            time.sleep(0.2)
    for name in ("slurmd", "slurmctld"):
        _terminate(state.get(name), timeout)
    if state.get("munged"):
        _terminate(_read_pid(MUNGE_PIDFILE, timeout=0), timeout)
    os.unlink(os.path.join(directory, STATE_FILE))


# ----------------------------------------------------------------------- helpers


def _path() -> str:
    # sbin is not on every root PATH (e.g. in containers)
    return os.environ.get("PATH", "") + ":/usr/sbin:/sbin"


def _install() -> None:
    if all(shutil.which(b, path=_path()) for b in BINARIES):
        return
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    cmd = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if r.returncode != 0:  # the package lists may be missing or stale
        subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True)
        r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{r.stdout[-2000:]}{r.stderr}")


def _munge_ok() -> bool:
    if not os.path.exists(MUNGE_SOCKET):
        return False
    try:
        cred = subprocess.run(["munge", "-n"], capture_output=True, timeout=5)
        r = subprocess.run(
            ["unmunge"], input=cred.stdout, capture_output=True, timeout=5
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return cred.returncode == 0 and r.returncode == 0


def _start_munged() -> None:
    import pwd

    munge = pwd.getpwnam("munge")
    os.makedirs("/run/munge", exist_ok=True)
    os.chown("/run/munge", munge.pw_uid, munge.pw_gid)
    os.chmod("/run/munge", 0o755)
    if not os.path.exists("/etc/munge/munge.key"):
        subprocess.run(["mungekey", "--create"], check=True, capture_output=True)
        os.chown("/etc/munge/munge.key", munge.pw_uid, munge.pw_gid)
    # a stale socket or pid file of a munged that is gone stops a new one
    for stale in (MUNGE_SOCKET, MUNGE_SOCKET + ".lock", MUNGE_PIDFILE):
        if os.path.exists(stale):
            os.unlink(stale)
    r = subprocess.run(
        ["runuser", "-u", "munge", "--", shutil.which("munged", path=_path())],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if r.returncode != 0:
        raise RuntimeError(f"munged did not start: {r.stderr.strip()}")
    deadline = time.monotonic() + 10
    while not _munge_ok():
        if time.monotonic() > deadline:
            raise RuntimeError("munged started but does not answer munge -n")
        time.sleep(0.1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _memory_mb() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) // 1024
    return 1024


def _read_pid(path: str, timeout: float) -> int | None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with open(path) as f:
                return int(f.read().strip())
        except (OSError, ValueError):
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)


def _terminate(pid: object, timeout: float) -> None:
    if not isinstance(pid, int):
        return
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _save(directory: str, state: dict[str, object]) -> None:
    with open(os.path.join(directory, STATE_FILE), "w") as f:
        json.dump(state, f)


def _logs(directory: str) -> str:
    out = []
    for name in ("slurmctld.log", "slurmd.log"):
        try:
            with open(os.path.join(directory, name)) as f:
                out.append(f"--- {name} (end)\n{f.read()[-3000:]}")
        except OSError:
            pass
    return "\n".join(out)


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("start", "stop"):
        print("usage: slurm.py start|stop DIR", file=sys.stderr)
        return 2
    command, directory = argv
    if command == "start":
        env = start(directory)
        for key, value in env.items():
            print(f"{key}={value}")
    else:
        stop(directory)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
