"""Several hosts on one machine: Linux network namespaces for cross-host tests.

Everything that passes on one loopback interface can still fail on a real
cluster: an address that is only valid locally, an endpoint bound to the wrong
interface, a client that cannot be reached back, a host that vanishes.  This
module builds real hosts with their own addresses on this machine, and runs
real ``dask scheduler`` / ``dask worker`` processes on them the way an operator
would::

    namespace <tag>-switch            bridges br0 (the Dask network, 10.213.N.0/24)
      br0 ── p-sched ─── eth0 10.213.N.1    <tag>-sched    dask scheduler
          ── p-w1    ─── eth0 10.213.N.11   <tag>-w1       dask worker
          ── p-client ── eth0 10.213.N.100  <tag>-client   the user's script
      br1 ── s-w1    ─── eth1 10.214.N.11   (a second, "side" network: every
          ── ...                             host is multi-homed)

The switch lives in its own namespace, not the root one: nothing here can reach
(or be reached from) the machine's real interfaces.  ``N`` is chosen per run;
every name starts with ``fdx<pid>-`` so concurrent runs never collide, and
namespaces left by a run that was SIGKILLed are removed by the next one.

Using it (see ``test_crosshost.py`` for the fixtures)::

    from support.netns import Network, DaskCluster, unavailable

    reason = unavailable()            # None, or why namespaces cannot be made
    with Network(tmp_path) as net:    # torn down on exit, also after a failure
        sched = net.add_host("sched", number=1)      # 10.213.N.1
        cluster = DaskCluster(net, sched)            # `dask scheduler --host ...`
        # (TLS: DaskCluster(net, sched, tls=make_tls_files(dir, [addresses])))
        w1 = net.add_host("w1")                      # next free number from .50
        cluster.add_worker(w1, resources={"w1": 1})  # `dask worker ... --nworkers 1`
        client = net.add_host("client")
        run = client.python("crosshost_client.py", "basic", "{}",
                            env=cluster.client_env())  # DASK_SCHEDULER_ADDRESS=...
        result = run.expect("result", timeout=60)    # the script prints JSON lines
        run.wait()                                   # (run.send("...") answers it)
        w1.kill_all()      # SIGKILL every process in the namespace (a host dies)
        w1.cut()           # pull its cable at the switch; w1.restore() plugs it back
        w1.listeners()     # `ss -ltnp` inside the namespace
        net.remove_host(w1)
        cap = net.switch_host().python("crosshost_capture.py", '{"markers": [...]}')
                           # a process in the switch: sees every frame between hosts

The pytest process itself stays in the root namespace: code that must run *on*
a host runs as a subprocess there (``Host.spawn`` / ``Host.python``), with
``PYTHONPATH`` set to this checkout and ``tests/`` (helper modules import on the
workers), and no ``DASK_*`` variable inherited from the test run.  Logs of
every process go to the network's work directory and are shown in failures.

Requires Linux, root (CAP_SYS_ADMIN + CAP_NET_ADMIN) and ``ip`` (iproute2);
:func:`unavailable` says why not, for a ``pytest.skip``.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import queue
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from support import semaphores, stackdump

__all__ = [
    "unavailable",
    "Network",
    "Host",
    "Script",
    "DaskCluster",
    "Listener",
    "make_tls_files",
]

SUPPORT_DIR = Path(__file__).resolve().parent  # the helper programs
TESTS_DIR = SUPPORT_DIR.parent
REPO_DIR = TESTS_DIR.parent
PREFIX = "fdx"


def _ip(*args: str, check: bool = True, timeout: float = 30) -> str:
    proc = subprocess.run(
        ["ip", *args], capture_output=True, text=True, timeout=timeout
    )
    if check and proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {proc.stderr.strip()}")
    return proc.stdout


def unavailable() -> str | None:
    """Why network namespaces cannot be used here, or None if they can."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "creating network namespaces needs root (CI runs as root)"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    if shutil.which("ss") is None:
        return "the `ss` command (iproute2) is not installed"
    probe = f"{PREFIX}{os.getpid()}-probe-{secrets.token_hex(2)}"
    try:
        _ip("netns", "add", probe)
        _ip("-n", probe, "link", "add", "b0", "type", "bridge")
    except (RuntimeError, subprocess.SubprocessError, OSError) as e:
        return f"cannot create a network namespace here: {e}"
    finally:
        _ip("netns", "del", probe, check=False)
    return None


def _netns_pids(ns: str) -> list[int]:
    out = _ip("netns", "pids", ns, check=False)
    return [int(p) for p in out.split()]


def _remove_stale() -> None:
    """Delete namespaces of earlier runs whose pytest process is gone."""
    for line in _ip("netns", "list", check=False).splitlines():
        name = line.split()[0] if line.split() else ""
        m = re.match(rf"{PREFIX}(\d+)-", name)
        if not m:
            continue
        pid = int(m.group(1))
        if pid == os.getpid() or os.path.exists(f"/proc/{pid}"):
            continue
        for p in _netns_pids(name):
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
        _ip("netns", "del", name, check=False)


@dataclass(frozen=True)
class Listener:
    """A listening TCP socket seen by ``ss -ltnp`` inside a namespace."""

    ip: str
    port: int
    pids: tuple[int, ...]

    @property
    def wildcard(self) -> bool:
        return self.ip in ("0.0.0.0", "::", "*")


class Network:
    """A switch namespace with two bridges, and the hosts plugged into it.

    Parameters
    ----------
    workdir : path
        Where logs (and anything else the tests write) go.
    """

    def __init__(self, workdir: str | os.PathLike) -> None:
        _remove_stale()
        self._semaphores = semaphores.snapshot()
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.tag = f"{PREFIX}{os.getpid()}-{secrets.token_hex(2)}"
        # The third octet only has to differ between runs for readable logs:
        # each run's addresses exist only inside its own namespaces.
        self.octet = 1 + (os.getpid() + secrets.randbelow(64)) % 250
        self.subnet = f"10.213.{self.octet}"
        self.side_subnet = f"10.214.{self.octet}"
        self.hosts: dict[str, Host] = {}
        self._procs: list[subprocess.Popen] = []
        self._next = 50  # automatic host numbers start here
        self.switch = f"{self.tag}-switch"
        _ip("netns", "add", self.switch)
        try:
            _ip("-n", self.switch, "link", "set", "lo", "up")
            for br in ("br0", "br1"):
                _ip("-n", self.switch, "link", "add", br, "type", "bridge")
                _ip("-n", self.switch, "link", "set", br, "up")
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> Network:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def add_host(
        self, name: str, *, number: int | None = None, side: bool = True
    ) -> Host:
        """A new host: its namespace, ``eth0`` on the Dask network (address
        ``10.213.N.<number>``) and, with ``side``, ``eth1`` on the side network."""
        if name in self.hosts:
            raise ValueError(f"host {name!r} exists")
        used = {h.number for h in self.hosts.values()}
        if number is None:
            number = next(n for n in range(self._next, 250) if n not in used)
        if number in used or not 1 <= number <= 254:
            raise ValueError(f"address .{number} is taken or invalid")
        host = Host(self, name, number, side)
        self.hosts[name] = host
        return host

    def remove_host(self, host: Host) -> None:
        """Kill what runs on ``host`` and delete its namespace."""
        host._teardown()
        self.hosts.pop(host.name, None)
        for proc in [p for p in self._procs if p.host is host]:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)  # reaped: no zombie outlives its host
            self._procs.remove(proc)

    def track(self, proc: subprocess.Popen) -> subprocess.Popen:
        self._procs.append(proc)
        return proc

    def close(self) -> None:
        """Kill every process on every host, reap ours, delete all namespaces."""
        for host in list(self.hosts.values()):
            host.kill_all()
        for proc in self._procs:
            with contextlib.suppress(OSError):
                proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        for host in list(self.hosts.values()):
            host._teardown()
        self.hosts.clear()
        for p in _netns_pids(self.switch):
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
        _ip("netns", "del", self.switch, check=False)
        # the hosts' /dev/shm would have gone with them
        semaphores.remove_orphans(self._semaphores)

    def switch_host(self) -> Host:
        """The switch's namespace as a host that runs processes (a capture of
        what the hosts send each other: ``crosshost_capture.py``).  It has no
        address and no cable; its processes end with the network."""
        return _Switch(self)

    def logs(self, tail: int = 40) -> str:
        """The last lines of every log, for failure messages."""
        out = []
        for path in sorted(self.workdir.glob("*.log")):
            lines = path.read_text(errors="replace").splitlines()[-tail:]
            out.append(f"---- {path.name}\n" + "\n".join(lines))
        return "\n".join(out)


class Host:
    """One host: a network namespace plugged into the network's switch."""

    def __init__(self, net: Network, name: str, number: int, side: bool) -> None:
        self.net = net
        self.name = name
        self.number = number
        self.ns = f"{net.tag}-{name}"
        self.ip = f"{net.subnet}.{number}"
        self.side_ip = f"{net.side_subnet}.{number}" if side else None
        self.port = f"p-{name}"[:15]  # its switch port (interface names <= 15)
        self._side_port = f"s-{name}"[:15]
        self._deleted = False
        sw = net.switch
        _ip("netns", "add", self.ns)
        try:
            _ip("-n", self.ns, "link", "set", "lo", "up")
            links = [(self.port, "eth0", "br0", self.ip)]
            if side:
                links.append((self._side_port, "eth1", "br1", self.side_ip))
            for port, dev, bridge, addr in links:
                # A veth pair made in the switch, its far end moved to the host.
                _ip(
                    "-n", sw, "link", "add", port, "type", "veth",
                    "peer", "name", dev, "netns", self.ns,
                )  # fmt: skip
                _ip("-n", sw, "link", "set", "dev", port, "master", bridge, "up")
                _ip("-n", self.ns, "addr", "add", f"{addr}/24", "dev", dev)
                _ip("-n", self.ns, "link", "set", dev, "up")
        except BaseException:
            _ip("netns", "del", self.ns, check=False)
            raise

    def __repr__(self) -> str:
        return f"<Host {self.name} {self.ip}>"

    # ---------------------------------------------------------------- processes

    def argv(self, *cmd: str) -> list[str]:
        """``cmd`` prefixed to run in this host's namespace."""
        return ["ip", "netns", "exec", self.ns, *cmd]

    def env(self, extra: dict | None = None) -> dict:
        """The environment of processes on this host: no ``DASK_*`` from the
        test run, this checkout and ``tests/`` on ``PYTHONPATH``."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("DASK_")}
        env["PYTHONPATH"] = os.pathsep.join([str(REPO_DIR), str(TESTS_DIR)])
        env["PYTHONUNBUFFERED"] = "1"
        env.update(extra or {})
        return env

    def run(self, *cmd: str, timeout: float = 30, check: bool = True) -> str:
        """Run ``cmd`` here to completion; its stdout."""
        proc = subprocess.run(
            self.argv(*cmd), capture_output=True, text=True, timeout=timeout
        )
        if check and proc.returncode:
            raise RuntimeError(
                f"{' '.join(cmd)} on {self.name} failed ({proc.returncode}): "
                f"{proc.stderr.strip()}"
            )
        return proc.stdout

    def spawn(
        self,
        *cmd: str,
        log: str,
        env: dict | None = None,
        **popen: Any,
    ) -> subprocess.Popen:
        """Start ``cmd`` here in the background; stderr (and stdout unless
        redirected) go to ``<workdir>/<log>.log``."""
        logf = open(self.net.workdir / f"{log}.log", "ab")  # noqa: SIM115
        popen.setdefault("stdout", logf)
        try:
            proc = subprocess.Popen(
                self.argv(*cmd),
                stderr=logf,
                env=self.env(env),
                cwd=self.net.workdir,
                start_new_session=True,
                **popen,
            )
        finally:
            logf.close()  # the child has its own copy
        proc.log_path = self.net.workdir / f"{log}.log"
        proc.host = self
        return self.net.track(proc)

    def python(self, script: str, *args: str, env: dict | None = None) -> Script:
        """Run ``tests/<script>`` with this interpreter on this host."""
        return Script(self, script, args, env)

    def pids(self) -> list[int]:
        """Every process running in this host's namespace."""
        return _netns_pids(self.ns)

    def kill_all(self, sig: int = signal.SIGKILL) -> list[int]:
        """Send ``sig`` to every process on this host (SIGKILL: the host dies).

        Repeated until none is left, so a process forked meanwhile dies too."""
        killed: list[int] = []
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            pids = [p for p in self.pids() if p not in killed or _alive(p)]
            pids = [p for p in pids if _alive(p)]
            if not pids:
                break
            for p in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p, sig)
                killed.append(p)
            if sig != signal.SIGKILL:
                break
            time.sleep(0.05)
        return sorted(set(killed))

    # ------------------------------------------------------------------ network

    def cut(self) -> None:
        """Pull this host's Dask-network cable at the switch: packets to and
        from it are dropped silently (its own interface stays up, no-carrier)."""
        _ip("-n", self.net.switch, "link", "set", self.port, "down")

    def restore(self) -> None:
        """Plug the cable back in."""
        _ip("-n", self.net.switch, "link", "set", self.port, "up")

    def listeners(self) -> list[Listener]:
        """Listening TCP sockets in this namespace (``ss -ltnpH``)."""
        out = self.run("ss", "-ltnpH")
        found = []
        for line in out.splitlines():
            parts = line.split()
            if len(parts) < 4:
                continue
            local = parts[3]
            ip, _, port = local.rpartition(":")
            ip = ip.strip("[]").split("%")[0]
            pids = tuple(int(p) for p in re.findall(r"pid=(\d+)", line))
            found.append(Listener(ip, int(port), pids))
        return found

    def _teardown(self) -> None:
        if self._deleted:
            return
        self.kill_all()
        deadline = time.monotonic() + 10
        while self.pids() and time.monotonic() < deadline:
            time.sleep(0.05)
        _ip("netns", "del", self.ns, check=False)
        self._deleted = True


class _Switch(Host):
    """The switch namespace, for :meth:`Host.spawn` / :meth:`Host.python` only."""

    def __init__(self, net: Network) -> None:  # noqa: D107 - no namespace to make
        self.net = net
        self.name = "switch"
        self.number = 0
        self.ns = net.switch
        self.ip = self.side_ip = None
        self._deleted = True  # Network.close() deletes the switch itself


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


_script_ids = itertools.count()


class Script:
    """A Python script running on a host that talks in JSON lines.

    The script prints one JSON object per line with an ``"event"`` key (other
    lines are kept in its log); the test waits for events with :meth:`expect`
    and answers on the script's stdin with :meth:`send`.  An event
    ``{"event": "error", "traceback": ...}`` fails the wait with that traceback.
    """

    def __init__(
        self, host: Host, script: str, args: tuple, env: dict | None = None
    ) -> None:
        self.host = host
        label = args[0] if args and re.fullmatch(r"[\w-]{1,30}", args[0]) else ""
        self.name = f"{host.name}-{Path(script).stem}-{label}{next(_script_ids)}"
        self.events: queue.Queue = queue.Queue()
        self.seen: list[dict] = []
        self.proc = host.spawn(
            sys.executable,
            str(SUPPORT_DIR / script),
            *args,
            log=self.name,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        with open(self.proc.log_path, "a") as log:
            for raw in self.proc.stdout:
                line = raw.decode(errors="replace").rstrip("\n")
                log.write(line + "\n")
                log.flush()
                try:
                    event = json.loads(line)
                except ValueError:
                    continue
                if isinstance(event, dict) and "event" in event:
                    self.events.put(event)
        self.events.put(None)  # the script ended

    def expect(self, name: str, timeout: float) -> dict:
        """Wait for the event ``name`` (earlier other events are kept in
        :attr:`seen`); fail on an error event, the script's end, or timeout."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                event = self.events.get(timeout=max(0.0, left))
            except queue.Empty:
                stacks = stackdump.request(self.proc.pid, self.proc.log_path)
                raise AssertionError(
                    f"{self.name}: no {name!r} event within {timeout:g} s\n"
                    + self.host.net.logs()
                    + (f"\n---- {self.name}: its threads\n{stacks}" if stacks else "")
                ) from None
            if event is None:
                self.events.put(None)
                rc = self.proc.wait(timeout=10)
                raise AssertionError(
                    f"{self.name} exited ({rc}) before {name!r}\n"
                    + self.host.net.logs()
                )
            self.seen.append(event)
            if event["event"] == "error":
                raise AssertionError(
                    f"{self.name} failed:\n{event.get('traceback')}\n"
                    + self.host.net.logs()
                )
            if event["event"] == name:
                return event

    def send(self, line: str = "go") -> None:
        """A line on the script's stdin."""
        self.proc.stdin.write(line.encode() + b"\n")
        self.proc.stdin.flush()

    def wait(self, timeout: float = 30) -> int:
        """Wait for the script to exit; its return code (0 expected)."""
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(
                f"{self.name} did not exit within {timeout:g} s\n"
                + self.host.net.logs()
            ) from None
        if rc != 0:
            raise AssertionError(f"{self.name} exited {rc}\n" + self.host.net.logs())
        return rc


class DaskCluster:
    """A ``dask scheduler`` on one host and ``dask worker`` processes on others,
    started with the command lines an operator would type.

    Parameters
    ----------
    net : Network
    host : Host
        Where the scheduler runs (port 8786 on its Dask-network address).
    tls : dict, optional
        From :func:`make_tls_files`: the cluster then requires TLS
        (``tls://`` addresses, certificates on the command lines) and
        :meth:`client_env` carries the client's configuration.
    env : dict, optional
        Extra environment for every scheduler and worker process (Dask or
        fiber config, e.g. ``{"DASK_FIBER__PEER_TIMEOUT": "4s"}``).
    """

    def __init__(
        self,
        net: Network,
        host: Host,
        *,
        tls: dict | None = None,
        env: dict | None = None,
        timeout: float = 60,
    ) -> None:
        self.net = net
        self.host = host
        self.tls = tls
        self.env = dict(env or {})
        self.protocol = "tls" if tls else "tcp"
        self.address = f"{self.protocol}://{host.ip}:8786"
        self.workers: dict[str, subprocess.Popen] = {}
        self.scheduler = host.spawn(
            sys.executable,
            "-m",
            "dask",
            "scheduler",
            "--host",
            host.ip,
            "--port",
            "8786",
            "--no-dashboard",
            "--protocol",
            self.protocol,
            *self._tls_args("scheduler"),
            log=f"{host.name}-scheduler",
            env=self.env,
        )
        _wait_for_log(self.scheduler, "Scheduler at:", timeout)

    def _tls_args(self, role: str) -> list[str]:
        if not self.tls:
            return []
        return [
            "--tls-ca-file",
            self.tls["ca"],
            "--tls-cert",
            self.tls["cert"],
            "--tls-key",
            self.tls["key"],
        ]

    def add_worker(
        self,
        host: Host,
        *,
        resources: dict | None = None,
        env: dict | None = None,
        nthreads: int = 1,
        wait: bool = True,
        timeout: float = 60,
    ) -> subprocess.Popen:
        """``dask worker <scheduler> --nworkers 1 --nthreads N`` on ``host``."""
        args = [
            sys.executable,
            "-m",
            "dask",
            "worker",
            self.address,
            "--nworkers",
            "1",
            "--nthreads",
            str(nthreads),
            "--no-dashboard",
            "--memory-limit",
            "0",
            "--name",
            host.name,
            *self._tls_args("worker"),
        ]
        if resources:
            args += ["--resources", " ".join(f"{k}={v}" for k, v in resources.items())]
        proc = host.spawn(
            *args, log=f"{host.name}-worker", env={**self.env, **(env or {})}
        )
        self.workers[host.name] = proc
        if wait:
            self.wait_worker(host, timeout)
        return proc

    def add_worker_hosts(
        self, names: list[str] | tuple[str, ...], resources: Callable[[str], dict]
    ) -> list[Host]:
        """A host for each of ``names`` (addresses .11, .12, ...), each with a
        ``dask worker`` holding ``resources(name)``, all started at once;
        returns them once every worker has registered."""
        hosts = []
        for i, name in enumerate(names):
            host = self.net.add_host(name, number=11 + i)
            self.add_worker(host, resources=resources(name), wait=False)
            hosts.append(host)
        for host in hosts:
            self.wait_worker(host)
        return hosts

    def wait_worker(self, host: Host, timeout: float = 60) -> None:
        """Until the worker on ``host`` has registered with the scheduler."""
        _wait_for_log(self.workers[host.name], "Registered to:", timeout)

    def client_env(self, extra: dict | None = None) -> dict:
        """Environment of a user's script attaching by scheduler address."""
        env = {"DASK_SCHEDULER_ADDRESS": self.address}
        if self.tls:
            env.update(
                {
                    "DASK_DISTRIBUTED__COMM__REQUIRE_ENCRYPTION": "True",
                    "DASK_DISTRIBUTED__COMM__TLS__CA_FILE": self.tls["ca"],
                    "DASK_DISTRIBUTED__COMM__TLS__CLIENT__CERT": self.tls["cert"],
                    "DASK_DISTRIBUTED__COMM__TLS__CLIENT__KEY": self.tls["key"],
                }
            )
        env.update(extra or {})
        return env


def _wait_for_log(proc: subprocess.Popen, needle: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = proc.log_path.read_text(errors="replace")
        if needle in text:
            return
        if proc.poll() is not None:
            raise RuntimeError(
                f"{proc.args[4:7]} exited ({proc.returncode}) before "
                f"{needle!r}:\n{text[-3000:]}"
            )
        time.sleep(0.1)
    raise RuntimeError(
        f"no {needle!r} in {proc.log_path.name} within {timeout:g} s:\n"
        + proc.log_path.read_text(errors="replace")[-3000:]
    )


def make_tls_files(directory: str | os.PathLike, ips: list[str]) -> dict:
    """A private CA and one certificate for the whole cluster (its hosts'
    addresses as subject alternative names), written as PEM files.

    Returns ``{"ca": path, "cert": path, "key": path}``.
    """
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fiber-dask test CA")])
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(
            x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(
            x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fiber-dask cluster")])
        )
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips]
            ),
            critical=False,
        )
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    paths = {
        "ca": directory / "ca.pem",
        "cert": directory / "cluster.pem",
        "key": directory / "cluster-key.pem",
    }
    paths["ca"].write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    paths["cert"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths["key"].write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    os.chmod(paths["key"], 0o600)
    return {k: str(v) for k, v in paths.items()}
