"""A cluster on Kubernetes, run by the dask-kubernetes operator.

``fiber.backend: kubernetes`` (extra ``fiber-dask[kubernetes]``) either creates a
``DaskCluster`` from the ``fiber.kubernetes`` profile through dask-kubernetes'
``KubeCluster``, or, with ``fiber.kubernetes.attach: true``, connects to an
existing one with ``KubeCluster.from_name``.

Ownership is strict:

* a cluster fiber-dask created (its ``DaskCluster`` carries an annotation with
  this process's token) is deleted by :func:`fiber_dask.shutdown` / at exit, and
  also when starting it fails half-way;
* a cluster it attached to is never resized or deleted: dask-kubernetes'
  default ``kubernetes.shutdown-on-close: true`` would delete a cluster
  ``KubeCluster(name=existing)`` connected to; fiber-dask always passes
  ``shutdown_on_close=False`` there, and creates with ``CREATE_ONLY`` so that a
  name that already exists is an error rather than a cluster taken over.

With ``fiber.adaptive.enabled`` the default worker group starts at
``adaptive.minimum`` and ``KubeCluster.adapt(minimum, maximum)`` creates the
operator's ``DaskAutoscaler``; see :mod:`fiber_dask.backends.kubemanifest` for
what reaches the scheduler pod.
"""

from __future__ import annotations

import copy
import logging
import uuid
from typing import Any

from .. import config
from ..errors import ClusterConnectionError
from .address import listen_host
from .base import Backend, ClusterHandle, connect
from .kubemanifest import effective_config, plan, require_dask_kubernetes

__all__ = ["KubernetesBackend", "OWNER_ANNOTATION"]

logger = logging.getLogger(__name__)

#: Annotation on a DaskCluster fiber-dask created: the creating process's token.
OWNER_ANNOTATION = "fiber-dask/created-by"


class KubernetesBackend(Backend):
    """Create (and own) or attach to (never delete) a dask-kubernetes DaskCluster."""

    name = "kubernetes"

    def start(self, *, address: str | None = None) -> ClusterHandle:
        require_dask_kubernetes()
        # fiber.kubernetes over dask-kubernetes' own kubernetes.* settings
        cfg = effective_config()
        if cfg["kubernetes"]["attach"]:
            return self._attach(cfg)
        return self._create(cfg)

    # ---------------------------------------------------------------- attach

    def _attach(self, cfg: dict[str, Any]) -> ClusterHandle:
        from dask_kubernetes.operator import KubeCluster

        k = cfg["kubernetes"]
        name = k.get("name")
        if not name:
            raise config.ConfigError(
                "fiber.kubernetes.attach is true but fiber.kubernetes.name is not "
                "set: name the DaskCluster to attach to (kubectl get daskclusters)."
            )
        try:
            cluster = KubeCluster.from_name(
                name,
                namespace=k.get("namespace"),
                shutdown_on_close=False,  # never delete a cluster we did not create
                resource_timeout=_seconds("kubernetes.resource-timeout"),
                quiet=True,
            )
        except ValueError as e:
            raise ClusterConnectionError(
                f"cannot attach to the DaskCluster {name!r}"
                f"{_in(k.get('namespace'))}: {e}. Check the name and namespace "
                "(kubectl get daskclusters -A), or set fiber.kubernetes.attach: false "
                "to create a cluster."
            ) from e
        cluster.shutdown_on_close = False
        try:
            client = _client(cluster)
        except BaseException:
            cluster.close()
            raise
        return _KubeHandle(
            client,
            cluster,
            owned=False,
            backend=self.name,
            listen_host=_listen_host(client),
        )

    # ---------------------------------------------------------------- create

    def _create(self, cfg: dict[str, Any]) -> ClusterHandle:
        from dask_kubernetes.operator import KubeCluster
        from dask_kubernetes.operator.kubecluster.kubecluster import CreateMode

        p = plan(cfg, default_name=f"fiber-dask-{uuid.uuid4().hex[:10]}")
        token = uuid.uuid4().hex
        spec = copy.deepcopy(p.cluster)
        spec["metadata"].setdefault("annotations", {})[OWNER_ANNOTATION] = token
        try:
            # shutdown_on_close stays False until the cluster is known to be ours:
            # dask-kubernetes' exit hook deletes every KubeCluster instance that
            # has it set, including one that failed because the name was taken.
            cluster = KubeCluster(
                custom_cluster_spec=spec,
                namespace=p.namespace,
                create_mode=CreateMode.CREATE_ONLY,
                shutdown_on_close=False,
                resource_timeout=_seconds("kubernetes.resource-timeout"),
                quiet=True,
            )
        except ValueError as e:
            if "already exists" in str(e):
                raise ClusterConnectionError(
                    f"a DaskCluster named {p.name!r} already exists"
                    f"{_in(p.namespace)}. fiber-dask does not take over a cluster it "
                    "did not create: set fiber.kubernetes.attach: true to use it (it "
                    "is then never deleted), or choose another fiber.kubernetes.name."
                ) from None
            _delete_if_ours(p.name, p.namespace, token)
            raise
        except BaseException:
            _delete_if_ours(p.name, p.namespace, token)
            raise
        cluster.shutdown_on_close = True
        try:
            for group, doc in p.worker_groups:
                cluster.add_worker_group(group, custom_spec=doc["spec"]["worker"])
            if p.adaptive is not None:
                cluster.adapt(minimum=p.adaptive[0], maximum=p.adaptive[1])
            client = _client(cluster)
        except BaseException:
            cluster.close()
            raise
        threads = p.threads_per_worker
        handle = _KubeHandle(
            client,
            cluster,
            owned=True,
            backend=self.name,
            listen_host=_listen_host(client),
            planned_slots=(p.adaptive[1] if p.adaptive else p.n_workers) * threads,
        )
        if p.adaptive is None:
            handle.grow = _Grower(handle, cluster, p.n_workers, threads)
        return handle


class _KubeHandle(ClusterHandle):
    """Closes the KubeCluster object too: it deletes the cluster only if owned."""

    def close(self, timeout: float | None = None) -> None:
        try:
            if self.owned or getattr(self.client, "_fiber_created", False):
                self.client.close(**({} if timeout is None else {"timeout": timeout}))
        finally:
            if self.cluster is not None:
                # shutdown_on_close is True only for a cluster we created.  Its
                # deletion gets fiber.kubernetes.resource-timeout, not the
                # shorter close timeout: a cluster left behind costs money.  Still
                # bounded: without the operator (which removes its finalizer) it
                # would not finish.
                self.cluster.close(timeout=_seconds("kubernetes.resource-timeout"))


class _Grower:
    """``Pool(processes=N)`` on a fixed-size cluster we own: scale the default
    group up (never down) so that N tasks run at once."""

    def __init__(
        self, handle: ClusterHandle, cluster: Any, n_workers: int, threads: int
    ) -> None:
        self.handle, self.cluster = handle, cluster
        self.workers, self.threads = n_workers, threads

    def __call__(self, slots: int) -> None:
        want = -(-slots // self.threads)
        if want > self.workers:
            self.cluster.scale(want)
            self.workers = want
            self.handle.planned_slots = want * self.threads


def _client(cluster: Any) -> Any:
    return connect(
        cluster,
        lambda timeout, e: (
            f"cannot connect to the scheduler of the DaskCluster {cluster.name!r} at "
            f"{cluster.scheduler_address} within fiber.connect-timeout={timeout:g}s: "
            f"{e}"
        ),
    )


def _listen_host(client: Any) -> str:
    """:func:`~fiber_dask.backends.address.listen_host`, with a warning when it
    chose a loopback address that worker pods cannot reach."""
    host = listen_host(client.scheduler.address)
    if not config.get("listen-host") and (host.startswith("127.") or host == "::1"):
        logger.warning(
            "fiber-dask: the scheduler is reached at a loopback address (%s, a "
            "port-forward?), so pools, processes and queues listen on %s, where "
            "worker pods on other machines cannot connect back. Run the program "
            "inside the Kubernetes cluster (a pod), or set fiber.listen-host to an "
            "address of this machine that the pods can reach.",
            client.scheduler.address,
            host,
        )
    return host


def _seconds(key: str) -> int:
    return max(1, int(round(config.timedelta(key))))


def _in(namespace: str | None) -> str:
    return f" in namespace {namespace!r}" if namespace else ""


def _delete_if_ours(name: str, namespace: str | None, token: str) -> None:
    """Delete the DaskCluster ``name`` if this process created it (best effort)."""
    try:
        import kr8s
        from kr8s.objects import new_class

        api = kr8s.api()
        cls = new_class("DaskCluster", "kubernetes.dask.org/v1", namespaced=True)
        try:
            obj = cls.get(name, namespace=namespace or api.namespace, api=api)
        except kr8s.NotFoundError:
            return
        if obj.annotations.get(OWNER_ANNOTATION) == token:
            obj.delete()
            logger.info("fiber-dask: deleted the half-started DaskCluster %s", name)
    except Exception as e:  # noqa: BLE001 - the original error matters more
        logger.warning(
            "fiber-dask: could not delete the DaskCluster %s it created before "
            "failing (%r); delete it with: kubectl delete daskcluster %s",
            name,
            e,
            name,
        )
