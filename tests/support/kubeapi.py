"""Kubernetes without a cluster: the operator's CRD schemas as the API server
applies them, and an in-memory API server (kmock) for the real operator.

* :func:`validate_custom_resource` checks a document against the
  ``openAPIV3Schema`` of the CRDs shipped in the installed dask-kubernetes, the
  way the API server does with ``kubectl apply`` (field validation ``Strict``):
  nulls are pruned where the schema does not say ``nullable``, then a field the
  structural schema does not describe is an error (unless under
  ``x-kubernetes-preserve-unknown-fields``), and types, enums and required
  fields are checked.
* :class:`Emulator` is kmock's ``KubernetesEmulator`` with the few things the
  dask-kubernetes operator relies on and kmock leaves out: objects get
  ``metadata.resourceVersion``/``uid``/``creationTimestamp`` on create, nulls
  are pruned like the API server does, and ``labelSelector`` filters lists and
  watches (the operator counts a group's worker Deployments by label).
  :func:`running_operator` runs the operator's kopf controller against it in a
  thread.
* :class:`Kubelet` plays the nodes: it runs each scheduler and worker
  Deployment as a local ``dask scheduler`` / ``dask worker`` process with the
  container's arguments and environment, marks the scheduler pod Ready and
  points its Service at it; :func:`cluster_dns` resolves service names for the
  operator.  Together they let fiber-dask's backend, the real operator and its
  autoscaler run a whole cluster life cycle on one machine.  What they do not
  show: image pulls, scheduling onto nodes, resource limits, networking
  between hosts.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import itertools
import os
import pathlib
import re
import threading
import time
import traceback
import uuid
from collections.abc import Iterator, Mapping
from typing import Any

import yaml

from support import semaphores
from support.wait import wait_until

CRD_DIR = (
    pathlib.Path(__import__("dask_kubernetes").__file__).parent
    / "operator/deployment/helm/dask-kubernetes-operator/crds"
)

# ObjectMeta fields a client may set (the rest are set by the API server).
_META_FIELDS = {
    "name",
    "generateName",
    "namespace",
    "labels",
    "annotations",
    "finalizers",
    "ownerReferences",
}
_DNS_SUBDOMAIN = re.compile(
    r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
)


# --------------------------------------------------------------- CRD validation


def load_crds() -> dict[str, dict[str, Any]]:
    """kind -> CRD, from the dask-kubernetes package."""
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # 900 kB of YAML
    crds = {}
    for path in sorted(CRD_DIR.glob("*.yaml")):
        crd = yaml.load(path.read_text(), Loader=loader)  # noqa: S506 (safe loader)
        crds[crd["spec"]["names"]["kind"]] = crd
    return crds


def strict_schema(schema: Any) -> Any:
    """The CRD schema with unknown fields rejected, as the API server's pruning
    (reported as errors in Strict field validation) treats them.

    An object schema without ``additionalProperties`` describes exactly its
    ``properties``; ``x-kubernetes-preserve-unknown-fields: true`` keeps a subtree
    open; ``x-kubernetes-int-or-string`` accepts both types.
    """
    if isinstance(schema, list):
        return [strict_schema(s) for s in schema]
    if not isinstance(schema, Mapping):
        return schema
    out = {k: strict_schema(v) for k, v in schema.items()}
    if out.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if (
        out.get("type") == "object"
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out.setdefault("properties", {})
        out["additionalProperties"] = False
    if out.get("nullable"):
        t = out.get("type")
        if isinstance(t, str):
            out["type"] = [t, "null"]
    return out


def prune_nulls(data: Any, schema: Any) -> Any:
    """Drop null fields whose schema is not ``nullable``, as the API server does
    for custom resources before validating."""
    if isinstance(data, Mapping):
        props = (
            (schema or {}).get("properties", {}) if isinstance(schema, Mapping) else {}
        )
        extra = (
            schema.get("additionalProperties") if isinstance(schema, Mapping) else None
        )
        out = {}
        for key, value in data.items():
            sub = props.get(key, extra if isinstance(extra, Mapping) else {})
            if value is None and not (isinstance(sub, Mapping) and sub.get("nullable")):
                continue
            out[key] = prune_nulls(value, sub)
        return out
    if isinstance(data, list):
        items = schema.get("items", {}) if isinstance(schema, Mapping) else {}
        return [prune_nulls(v, items) for v in data]
    return data


def validate_custom_resource(doc: Mapping[str, Any], crds: Mapping[str, Any]) -> None:
    """Raise AssertionError / jsonschema.ValidationError if the API server would
    reject ``doc`` (a dask-kubernetes custom resource)."""
    import jsonschema

    kind = doc.get("kind")
    assert kind in crds, f"unknown kind {kind!r}"
    crd = crds[kind]
    (version,) = [v for v in crd["spec"]["versions"] if v.get("served")]
    assert doc.get("apiVersion") == f"{crd['spec']['group']}/{version['name']}"
    meta = doc.get("metadata") or {}
    assert set(meta) <= _META_FIELDS, (
        f"unknown metadata fields {set(meta) - _META_FIELDS}"
    )
    name = meta.get("name", "")
    assert len(name) <= 253 and _DNS_SUBDOMAIN.match(name), f"bad name {name!r}"
    for key in ("labels", "annotations"):
        for k, v in (meta.get(key) or {}).items():
            assert isinstance(k, str) and isinstance(v, str), (key, k, v)
    schema = version["schema"]["openAPIV3Schema"]
    body = {k: v for k, v in doc.items() if k not in ("apiVersion", "kind", "metadata")}
    body = prune_nulls(body, schema)
    top = copy.deepcopy(schema)
    # apiVersion, kind and metadata are the API server's, checked above.
    for key in ("apiVersion", "kind", "metadata"):
        top.get("properties", {}).pop(key, None)
    jsonschema.Draft7Validator(strict_schema(top)).validate(body)


# ------------------------------------------------------------ the API emulator


def _matches(obj: Mapping[str, Any], selector: str) -> bool:
    labels = (obj.get("metadata") or {}).get("labels") or {}
    for term in filter(None, (t.strip() for t in selector.split(","))):
        term = term.replace("==", "=")
        if "!=" in term:
            key, value = term.split("!=", 1)
            if labels.get(key) == value:
                return False
        elif "=" in term:
            key, value = term.split("=", 1)
            if labels.get(key) != value:
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True


def _prune(obj: Any) -> Any:
    if isinstance(obj, Mapping):
        return {k: _prune(v) for k, v in obj.items() if v is not None}
    if isinstance(obj, list):
        return [_prune(v) for v in obj]
    return obj


def _emulator_class() -> type:
    import kmock

    versions = itertools.count(1)

    class Emulator(kmock.KubernetesEmulator):
        async def _handle(self, request):  # noqa: ANN001
            data = request.data
            if request.resource is not None and isinstance(data, dict):
                if request.action == kmock.action.CREATE:
                    clean = _prune(data)
                    meta = clean.setdefault("metadata", {})
                    meta.setdefault("uid", str(uuid.uuid4()))
                    meta.setdefault(
                        "creationTimestamp",
                        time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    )
                    if request.namespace:
                        meta.setdefault("namespace", request.namespace)
                    meta["resourceVersion"] = str(next(versions))
                    data.clear()
                    data.update(clean)
                elif request.action == kmock.action.UPDATE:
                    meta = data.setdefault("metadata", {})
                    if isinstance(meta, dict):
                        meta["resourceVersion"] = str(next(versions))
            return await super()._handle(request)

        async def _serve_list(self, request):  # noqa: ANN001
            result = await super()._serve_list(request)
            selector = request.params.get("labelSelector")
            if selector:
                result["items"] = [o for o in result["items"] if _matches(o, selector)]
            return result

        async def _serve_watch(self, request):  # noqa: ANN001
            selector = request.params.get("labelSelector")
            async for event in super()._serve_watch(request):
                obj = event.get("object", {}) if isinstance(event, dict) else None
                if selector and obj is not None and not _matches(obj, selector):
                    continue
                yield event

    return Emulator


class KubeAPI:
    """A running emulator: its URL, a kubeconfig for it, and its objects."""

    def __init__(self, url: str, kubeconfig: str, emulator: Any, loop: Any) -> None:
        self.url, self.kubeconfig, self.emulator = url, kubeconfig, emulator
        self._loop = loop

    def objects(self, plural: str, namespace: str = "default") -> dict[str, dict]:
        """Copies of the live objects of a resource ("deployments", "daskclusters"),
        taken in the emulator's own thread."""

        async def snapshot() -> dict[str, dict]:
            out = {}
            for (resource, ns, name), obj in list(self.emulator.objects.items()):
                if resource.plural == plural and ns == namespace and not obj.deleted:
                    out[name] = copy.deepcopy(obj.raw)
            return out

        return asyncio.run_coroutine_threadsafe(snapshot(), self._loop).result(10)

    def names(self, plural: str, namespace: str = "default") -> list[str]:
        return sorted(self.objects(plural, namespace))

    def get(self, plural: str, name: str, namespace: str = "default") -> dict[str, Any]:
        try:
            return self.objects(plural, namespace)[name]
        except KeyError:
            raise KeyError((plural, namespace, name)) from None

    def requests(self) -> list[Any]:
        """The requests the emulator has served so far."""

        async def snapshot() -> list[Any]:
            return list(self.emulator)

        return asyncio.run_coroutine_threadsafe(snapshot(), self._loop).result(10)


@contextlib.contextmanager
def kube_api(tmp_dir: pathlib.Path) -> Iterator[KubeAPI]:
    """An in-memory Kubernetes API with the dask-kubernetes CRDs, in a thread."""
    import kmock

    ready = threading.Event()
    box: dict[str, Any] = {}

    async def main() -> None:
        async with _emulator_class()() as emulator, kmock.Server(emulator) as server:
            emulator.resources.load_bundled()
            # kr8s asks for /version/ (with the slash)
            emulator.fallback["get /version/"] << emulator._serve_server_version
            for kind, crd in load_crds().items():
                names = crd["spec"]["names"]
                emulator.resources[f"{crd['spec']['group']}/v1/{names['plural']}"] = (
                    kmock.ResourceInfo(
                        kind=kind,
                        singular=names["singular"],
                        namespaced=True,
                        verbs={
                            "create",
                            "delete",
                            "get",
                            "list",
                            "patch",
                            "update",
                            "watch",
                        },
                        shortnames=set(names.get("shortNames", [])),
                        subresources={"status", "scale"},
                    )
                )
            box["emulator"], box["url"] = emulator, str(server.url).rstrip("/")
            box["loop"], box["stop"] = asyncio.get_running_loop(), asyncio.Event()
            ready.set()
            await box["stop"].wait()

    thread = threading.Thread(target=lambda: asyncio.run(main()), daemon=True)
    thread.start()
    assert ready.wait(30), "the Kubernetes emulator did not start"
    kubeconfig = tmp_dir / "kubeconfig"
    kubeconfig.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "emulator",
                "clusters": [{"name": "emulator", "cluster": {"server": box["url"]}}],
                "contexts": [
                    {
                        "name": "emulator",
                        "context": {
                            "cluster": "emulator",
                            "user": "emulator",
                            "namespace": "default",
                        },
                    }
                ],
                "users": [{"name": "emulator", "user": {"token": "not-a-secret"}}],
            }
        )
    )
    try:
        yield KubeAPI(box["url"], str(kubeconfig), box["emulator"], box["loop"])
    finally:
        box["loop"].call_soon_threadsafe(box["stop"].set)
        thread.join(10)


# The operator polls each DaskAutoscaler (and each DaskCluster for idle
# shutdown) every 5 s.  The emulated operator polls every second: a scaling
# decision is still the operator's and the scheduler's, it is only taken sooner,
# and a test waiting for one waits up to 1 s a step instead of up to 5 s.
OPERATOR_TIMER_INTERVAL = 1.0


@contextlib.contextmanager
def _timer_interval(interval: float) -> Iterator[None]:
    """Run the operator's kopf timers every ``interval`` seconds meanwhile."""
    import dataclasses

    import kopf
    from kopf._core.intents.handlers import TimerHandler

    handlers = kopf.get_default_registry()._spawning._handlers
    saved = list(handlers)
    handlers[:] = [
        dataclasses.replace(h, interval=interval) if isinstance(h, TimerHandler) else h
        for h in handlers
    ]
    try:
        yield
    finally:
        handlers[:] = saved


@contextlib.contextmanager
def running_operator() -> Iterator[None]:
    """The dask-kubernetes operator's kopf controller, in a thread, cluster-wide,
    its timers every :data:`OPERATOR_TIMER_INTERVAL` seconds.

    Uses the kubeconfig in $KUBECONFIG (set it to the emulator's first).
    """
    import dask_kubernetes.operator.controller.controller  # noqa: F401 (handlers)

    with _timer_interval(OPERATOR_TIMER_INTERVAL):
        yield from _running_operator()


def _running_operator() -> Iterator[None]:
    import kopf

    box: dict[str, Any] = {}
    started = threading.Event()

    async def main() -> None:
        box["loop"], box["flag"] = asyncio.get_running_loop(), asyncio.Event()
        started.set()
        await kopf.operator(clusterwide=True, standalone=True, stop_flag=box["flag"])

    def run() -> None:
        try:
            asyncio.run(main())
        except BaseException as e:  # noqa: BLE001 - reported by the caller
            box["error"] = e
            started.set()

    thread = threading.Thread(target=run, name="kopf-operator", daemon=True)
    thread.start()
    assert started.wait(30), "the operator did not start"
    try:
        yield
    finally:
        if "loop" in box:
            box["loop"].call_soon_threadsafe(box["flag"].set)
        thread.join(15)
        assert not thread.is_alive(), "the operator did not stop"
        if "error" in box:
            raise box["error"]


def wait_for(predicate: Any, timeout: float = 20.0, what: str = "") -> Any:
    """:func:`support.wait.wait_until` with this module's default timeout."""
    return wait_until(predicate, timeout, what or "the condition")


def env_kubeconfig(path: str) -> dict[str, str]:
    return {**os.environ, "KUBECONFIG": path}


# ------------------------------------------------------------ a pretend kubelet


class Kubelet:
    """Runs the "containers" of the emulated cluster as local processes.

    What a node (kubelet, cluster DNS, a cloud load balancer, the garbage
    collector) would do, for the dask-kubernetes operator's objects only:

    * a scheduler Deployment: ``dask scheduler`` with its container's
      environment on free local ports; once it answers, a Ready Pod, and the
      Service pointed at it (``LoadBalancer`` ingress 127.0.0.1, ports = the real
      ones);
    * a worker Deployment: ``dask worker`` with its container's arguments and
      environment, ``DASK_SCHEDULER_ADDRESS`` pointed at that scheduler;
    * a Deployment deleted: its process is stopped; a DaskCluster deleted: its
      Deployments and Services are deleted (ownerReferences cascade).

    Cluster DNS for the operator (in this process): see :func:`cluster_dns`.
    """

    def __init__(self, api: KubeAPI, env: Mapping[str, str]) -> None:
        self.api = api
        self.env = dict(env)
        self.procs: dict[str, Any] = {}  # deployment name -> Popen
        self.schedulers: dict[str, str] = {}  # cluster name -> tcp address
        self.started: list[tuple[float, str]] = []
        self.stopped: list[tuple[float, str]] = []
        self.restarts: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kubelet", daemon=True)
        self.errors: list[str] = []
        self._semaphores = semaphores.snapshot()

    def __enter__(self) -> Kubelet:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(30)
        for name in list(self.procs):
            self._kill(name)
        # the pods' /dev/shm would have gone with them
        semaphores.remove_orphans(self._semaphores)

    # -------------------------------------------------------------- the loop

    def _run(self) -> None:
        import kr8s

        self._k8s = kr8s.api(kubeconfig=self.api.kubeconfig)
        while not self._stop.is_set():
            try:
                self._tick()
            except Exception:  # noqa: BLE001 - reported by the test
                self.errors.append(traceback.format_exc())
            self._stop.wait(0.1)

    def _tick(self) -> None:
        clusters = self.api.objects("daskclusters")
        deployments = self.api.objects("deployments")
        # garbage collection: what belonged to a deleted cluster goes
        for name, obj in list(deployments.items()):
            owner = obj["metadata"].get("labels", {}).get("dask.org/cluster-name")
            if owner and owner not in clusters:
                self._delete("deployments", name)
                del deployments[name]
        for name in list(self.procs):
            if name not in deployments:
                self._kill(name)
            elif self.procs[name].poll() is not None and "-worker-" in name:
                # the pod's container died: the Deployment's new pod replaces it
                del self.procs[name]
                self.restarts[name] = self.restarts.get(name, 0) + 1
        for name, dep in deployments.items():
            if name in self.procs:
                continue
            labels = dep["metadata"].get("labels", {})
            component = labels.get("dask.org/component")
            if component == "scheduler":
                self._start_scheduler(name, dep)
            elif component == "worker":
                cluster = labels["dask.org/cluster-name"]
                if cluster in self.schedulers:
                    self._start_worker(name, dep, self.schedulers[cluster])

    # ------------------------------------------------------------ containers

    def _container(self, dep: Mapping[str, Any]) -> tuple[list[str], dict[str, str]]:
        (container,) = dep["spec"]["template"]["spec"]["containers"]
        env = {**self.env}
        for item in container.get("env", []):
            env[item["name"]] = item.get("value", "")
        args = list(container.get("args", []))
        args = [
            a.replace("$(DASK_WORKER_NAME)", env.get("DASK_WORKER_NAME", ""))
            for a in args
        ]
        return args, env

    def _popen(self, name: str, argv: list[str], env: dict[str, str]) -> Any:
        import subprocess
        import sys

        assert argv[0] == "dask", argv
        proc = subprocess.Popen(
            [sys.executable, "-m", "dask", *argv[1:]],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # a "pod": one process group, killed together
        )
        self.procs[name] = proc
        self.started.append((time.monotonic(), name))
        return proc

    def _start_scheduler(self, name: str, dep: Mapping[str, Any]) -> None:
        import urllib.request

        from fiber_dask.comm.ports import PortReservation

        args, env = self._container(dep)
        # Held until the scheduler serves, so that no other socket takes them.
        held = [PortReservation("127.0.0.1") for _ in range(2)]
        comm, dashboard = (port.port for port in held)
        assert args[:2] == ["dask", "scheduler"], args
        args = [a for a in args if a not in ("--host", "0.0.0.0")]
        args += ["--host", "127.0.0.1", "--port", str(comm)]
        args += ["--dashboard-address", f"127.0.0.1:{dashboard}"]
        try:
            proc = self._popen(name, args, env)
            deadline = time.monotonic() + 60
            while True:  # the readiness probe: GET /health
                try:
                    with urllib.request.urlopen(
                        f"http://127.0.0.1:{dashboard}/health", timeout=1
                    ) as r:
                        if r.status == 200:
                            break
                except OSError:
                    pass
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"scheduler {name} did not start")
                time.sleep(0.1)
        finally:
            for port in held:
                port.release()
        labels = dep["spec"]["template"]["metadata"]["labels"]
        cluster = labels["dask.org/cluster-name"]
        self.schedulers[cluster] = f"tcp://127.0.0.1:{comm}"
        from kr8s.objects import Pod, Service

        Pod(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": f"{name}-0", "labels": labels},
                "spec": dep["spec"]["template"]["spec"],
                "status": {
                    "phase": "Running",
                    "conditions": [
                        {"type": t, "status": "True"}
                        for t in ("PodScheduled", "Initialized")
                        + ("ContainersReady", "Ready")
                    ],
                },
            },
            namespace="default",
            api=self._k8s,
        ).create()
        service = Service.get(name, namespace="default", api=self._k8s)
        real = {"tcp-comm": comm, "http-dashboard": dashboard}
        ports = [
            {**p, "port": real.get(p["name"], p["port"])}
            for p in service.raw["spec"]["ports"]
        ]
        service.patch(
            {
                "spec": {"type": "LoadBalancer", "ports": ports},
                "status": {"loadBalancer": {"ingress": [{"ip": "127.0.0.1"}]}},
            }
        )

    def _start_worker(self, name: str, dep: Mapping[str, Any], address: str) -> None:
        args, env = self._container(dep)
        env["DASK_SCHEDULER_ADDRESS"] = address
        # every "pod" has its own network namespace; here they share one host
        args = [("127.0.0.1:0" if a == "8788" else a) for a in args]
        self._popen(name, args, env)

    def kill_pod(self, name: str) -> None:
        """SIGKILL every process of a worker "pod" (out of memory, node lost)."""
        import os
        import signal

        os.killpg(self.procs[name].pid, signal.SIGKILL)

    def pod_of(self, pid: int) -> str | None:
        """The Deployment whose "pod" runs the process ``pid``."""
        import psutil

        try:
            ancestors = {p.pid for p in psutil.Process(pid).parents()} | {pid}
        except psutil.NoSuchProcess:
            return None
        for name, proc in list(self.procs.items()):
            if proc.pid in ancestors:
                return name
        return None

    def _kill(self, name: str) -> None:
        proc = self.procs.pop(name, None)
        if proc is None:
            return
        self.stopped.append((time.monotonic(), name))
        proc.terminate()  # SIGTERM, as when a pod is deleted
        try:
            proc.wait(10)
        except Exception:  # noqa: BLE001
            proc.kill()
            proc.wait(5)

    def _delete(self, plural: str, name: str) -> None:
        import kr8s
        from kr8s.objects import Deployment

        assert plural == "deployments"
        with contextlib.suppress(kr8s.NotFoundError):
            Deployment.get(name, namespace="default", api=self._k8s).delete()


@contextlib.contextmanager
def cluster_dns() -> Iterator[None]:
    """Resolve in-cluster service names (``svc.namespace``, ``...svc.cluster.local``)
    to 127.0.0.1, where the kubelet's processes listen, for this process."""
    import socket

    original = socket.getaddrinfo
    pattern = re.compile(r"^[a-z0-9-]+\.default(\.svc\.cluster\.local)?$")

    def getaddrinfo(host: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(host, str) and pattern.match(host):
            host = "127.0.0.1"
        return original(host, *args, **kwargs)

    socket.getaddrinfo = getaddrinfo
    try:
        yield
    finally:
        socket.getaddrinfo = original


class NoCooldown:
    """Lift the operator's 15 s cool-down after each scaling step (it would
    make a test wait 15 s per step; the decisions themselves are the
    operator's and the scheduler's), by resetting the annotation it keeps the
    cool-down in, from a thread."""

    def __init__(self, name: str, kubeconfig: str) -> None:
        self.name, self.kubeconfig = name, kubeconfig
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        import kr8s
        from dask_kubernetes.operator.controller.controller import (
            DASK_AUTOSCALER_COOLDOWN_UNTIL_ANNOTATION as COOLDOWN,
        )
        from kr8s.objects import new_class

        api = kr8s.api(kubeconfig=self.kubeconfig)
        cls = new_class("DaskAutoscaler", "kubernetes.dask.org/v1", namespaced=True)
        while not self.stop.wait(0.3):
            try:
                obj = cls.get(self.name, namespace="default", api=api)
                if float(obj.annotations.get(COOLDOWN, 0)) > time.time():
                    obj.annotate({COOLDOWN: "0"})
            except Exception:  # noqa: BLE001 - not created yet, or gone
                pass

    def __enter__(self) -> NoCooldown:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(10)
