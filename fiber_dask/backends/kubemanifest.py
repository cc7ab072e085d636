"""The Kubernetes resources of a ``fiber.kubernetes`` profile, as plain dicts.

:func:`manifests` is what ``fiber-dask kubernetes manifest`` prints for
``kubectl apply -f -``; the ``kubernetes`` backend creates exactly the same
resources through dask-kubernetes' ``KubeCluster``.  Both start from
:func:`plan`, which is pure: it reads only the configuration it is given.

The resources are those of the dask-kubernetes operator:

* a ``DaskCluster`` (scheduler Deployment + Service and the ``default`` worker
  group; the operator creates those), built with dask-kubernetes'
  ``make_cluster_spec`` / ``make_worker_spec``;
* a ``DaskWorkerGroup`` per entry of ``fiber.kubernetes.worker-groups``;
* a ``DaskAutoscaler`` when ``fiber.adaptive.enabled`` is true.

What fiber-dask changes in dask-kubernetes' templates, and why:

* the commands are ``dask scheduler`` / ``dask worker``: distributed no longer
  installs the ``dask-scheduler`` / ``dask-worker`` scripts the templates use;
* workers run ``--nthreads fiber.kubernetes.threads-per-worker`` (1: one task per
  process, as in multiprocessing) and ``--resources`` from ``dask-resources``;
* the scheduler gets the ``fiber.adaptive`` knobs as ``DASK_DISTRIBUTED__ADAPTIVE__*``
  and its HTTP API (``distributed.http.scheduler.api``): the operator retires
  workers through it before deleting their pods (graceful scale-down); without
  it, it falls back to an RPC that breaks when the operator's and the image's
  versions differ, and then to deleting the newest pods, running tasks and all;
* with extra worker groups, the scheduler preloads
  :mod:`fiber_dask.backends.kubescheduler`, so that scaling the default group
  down never retires a worker of another group (a GPU worker);
* quantities and environment values are strings (the CRDs' schemas say so) and
  nulls are left out (the API server would prune them).
"""

from __future__ import annotations

import copy
import getpass
import json
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import dask.config

from .. import config
from ..errors import ConfigError, Problem
from .base import DASHBOARD_PRELOAD

__all__ = [
    "manifests",
    "plan",
    "Plan",
    "effective_config",
    "require_dask_kubernetes",
]

API_VERSION = "kubernetes.dask.org/v1"
#: Longest DaskCluster name: the operator adds "-scheduler" and the result is a
#: 63-character DNS label (dask_kubernetes.constants.MAX_CLUSTER_NAME_LEN).
MAX_NAME = 63 - len("-scheduler")
_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_API_ROUTE = "distributed.http.scheduler.api"
# fiber_dask.backends.kubescheduler (not imported here: it needs distributed)
_DOWNSCALE_PRELOAD = "fiber_dask.backends.kubescheduler"
_DOWNSCALE_ENV = "FIBER_DASK_DOWNSCALE_PREFIX"


@dataclass
class Plan:
    """What a profile asks for: the documents, and what the backend needs to know."""

    name: str
    namespace: str | None
    cluster: dict[str, Any]
    #: (group name as given to ``KubeCluster.add_worker_group``, DaskWorkerGroup)
    worker_groups: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    autoscaler: dict[str, Any] | None = None
    #: Workers of the default group at start, and the adaptive bounds if enabled.
    n_workers: int = 0
    adaptive: tuple[int, int] | None = None
    threads_per_worker: int = 1

    def documents(self) -> list[dict[str, Any]]:
        docs = [self.cluster] + [doc for _, doc in self.worker_groups]
        if self.autoscaler is not None:
            docs.append(self.autoscaler)
        return docs


def manifests(cfg: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
    """The Kubernetes resources ``kubectl apply -f -`` needs for a fiber-dask profile.

    Parameters
    ----------
    cfg : mapping, optional
        The ``fiber`` configuration (the contents of the ``fiber:`` key); keys it
        leaves out take their defaults.  Default: ``dask.config.get("fiber")``.

    Returns
    -------
    list of dict
        The ``DaskCluster``, a ``DaskWorkerGroup`` per extra worker group, and a
        ``DaskAutoscaler`` if adaptive scaling is enabled, in that order.

    Raises
    ------
    ConfigError
        If the configuration is invalid, or lacks what a cluster needs (an image,
        a fixed name, both adaptive bounds), or says ``attach: true`` (the cluster
        exists: there is nothing to apply).

    Examples
    --------
    >>> from fiber_dask.backends.kubemanifest import manifests
    >>> docs = manifests({"kubernetes": {"name": "demo", "image": "example/img:1"}})
    >>> [d["kind"] for d in docs]
    ['DaskCluster']
    """
    cfg = effective_config(cfg)
    if cfg["kubernetes"].get("attach"):
        raise _error(
            [
                _problem(
                    "kubernetes.attach",
                    True,
                    "the profile attaches to an existing DaskCluster, so there is "
                    "nothing to create",
                    "false, to describe a cluster fiber-dask would create",
                )
            ]
        )
    return plan(cfg).documents()


#: dask-kubernetes' own ``kubernetes.*`` key -> the ``fiber.kubernetes`` key with
#: the same meaning (adapters/kubernetes/README.md has the whole table).
DASK_KUBERNETES_KEYS = {
    "name": "name",
    "namespace": "namespace",
    "image": "image",
    "env": "env",
    "resources": "resources",
    "count.start": "n-workers",
    "scheduler-service-type": "scheduler-service-type",
    "resource-timeout": "resource-timeout",
    "custom-cluster-spec": "custom-cluster-spec",
}


def effective_config(cfg: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``cfg`` over fiber-dask's defaults, checked against the schema.

    dask-kubernetes' own settings (``kubernetes.*``: a user's ``kubernetes.yaml``,
    ``DASK_KUBERNETES__*``) are the defaults beneath ``fiber.kubernetes``: where
    the ``fiber.kubernetes`` key keeps fiber-dask's default and the user set the
    dask-kubernetes key (to something other than dask-kubernetes' own default),
    the user's value is used (see :data:`DASK_KUBERNETES_KEYS`; mappings such as
    ``env`` merge, the ``fiber`` keys winning).
    """
    if cfg is None:
        merged = copy.deepcopy(dask.config.get("fiber"))
    else:
        merged = dask.config.merge(
            copy.deepcopy(config.defaults["fiber"]), copy.deepcopy(dict(cfg))
        )
    taken = _take_dask_kubernetes_settings(merged)
    try:
        with dask.config.set({"fiber": merged}):
            return config.validate()
    except ConfigError as e:
        if not taken:
            raise
        # Name the dask-kubernetes key a bad value came from.
        problems = []
        for p in e.problems:
            for ours, theirs in taken.items():
                if p.key == ours or p.key.startswith(ours + "."):
                    where = config.find_source(theirs.split("."), p.value, ())
                    if where.startswith("set in code"):
                        where = "dask-kubernetes' config"
                    p = p._replace(source=f"{theirs} ({where})")
                    break
            problems.append(p)
        raise ConfigError(config.describe_problems(problems), problems) from None


def _dask_kubernetes_defaults() -> dict[str, Any]:
    """dask-kubernetes' packaged ``kubernetes.yaml`` (without importing it)."""
    import importlib.util
    import os

    import yaml

    try:
        spec = importlib.util.find_spec("dask_kubernetes")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        return {}
    for location in spec.submodule_search_locations:
        path = os.path.join(location, "kubernetes.yaml")
        try:
            with open(path) as f:
                return (yaml.safe_load(f) or {}).get("kubernetes", {})
        except OSError:
            continue
    return {}


def _take_dask_kubernetes_settings(fiber: dict[str, Any]) -> dict[str, str]:
    """Fill ``fiber["kubernetes"]`` from the user's ``kubernetes.*``, in place.

    Returns the ``fiber.kubernetes.*`` keys so filled -> their ``kubernetes.*`` key.
    """
    theirs = dask.config.get("kubernetes", default=None)
    if not isinstance(theirs, Mapping):
        return {}
    packaged = _dask_kubernetes_defaults()
    ours = fiber.setdefault("kubernetes", {})
    own_defaults = config.defaults["fiber"]["kubernetes"]
    taken: dict[str, str] = {}
    for their_key, our_key in DASK_KUBERNETES_KEYS.items():
        missing = object()
        value = dask.config.get(their_key, default=missing, config=theirs)
        if value is missing or value == dask.config.get(
            their_key, default=missing, config=packaged
        ):
            continue  # not the user's: dask-kubernetes' own default
        current = ours.get(our_key, own_defaults.get(our_key))
        if isinstance(value, Mapping) and isinstance(current, Mapping):
            ours[our_key] = dask.config.merge(copy.deepcopy(dict(value)), current)
        elif current == own_defaults.get(our_key):
            ours[our_key] = copy.deepcopy(value)
        else:
            continue  # fiber.kubernetes says otherwise
        taken[f"fiber.kubernetes.{our_key}"] = f"kubernetes.{their_key}"
    return taken


def plan(cfg: Mapping[str, Any], *, default_name: str | None = None) -> Plan:
    """Build the resources of an effective, schema-valid ``fiber`` config.

    ``default_name`` is used when ``fiber.kubernetes.name`` is null (the backend
    passes a fresh random name; a manifest needs a fixed one).
    """
    operator = require_dask_kubernetes()
    make_cluster_spec, make_worker_spec = (
        operator.make_cluster_spec,
        operator.make_worker_spec,
    )

    k = cfg["kubernetes"]
    adaptive_cfg = cfg["adaptive"]
    problems: list[Problem] = []

    custom = _custom_cluster_spec(k.get("custom-cluster-spec"), problems)
    if custom is not None and k.get("name") is None:
        # dask-kubernetes takes the name from the custom spec too.
        default_name = custom.get("metadata", {}).get("name") or default_name
    name = _cluster_name(k.get("name"), default_name, problems)
    image = k.get("image")
    if custom is not None:
        image = image or _container(custom, "worker").get("image") or "custom"
    if not image:
        problems.append(
            _problem(
                "kubernetes.image",
                image,
                "an image is needed to create a cluster",
                "an image that contains fiber-dask, your code and its dependencies "
                "(see adapters/kubernetes/README.md)",
            )
        )
    adaptive: tuple[int, int] | None = None
    if adaptive_cfg.get("enabled"):
        low, high = adaptive_cfg.get("minimum"), adaptive_cfg.get("maximum")
        if high is None:
            problems.append(
                _problem(
                    "adaptive.maximum",
                    None,
                    "the kubernetes backend needs an upper bound (the operator's "
                    "DaskAutoscaler requires both)",
                    f"an integer >= fiber.adaptive.minimum ({low})",
                )
            )
        else:
            adaptive = (int(low), int(high))
    groups = list(k.get("worker-groups") or [])
    seen: set[str] = set()
    for i, group in enumerate(groups):
        gname = group["name"]
        key = f"kubernetes.worker-groups.{i}.name"
        if gname == "default" or gname in seen:
            problems.append(
                _problem(
                    key,
                    gname,
                    "duplicate worker group name"
                    if gname in seen
                    else "'default' is the name of the cluster's own group",
                    "a name not used by another group",
                )
            )
        elif name and len(f"{name}-{gname}") > 63:
            problems.append(
                _problem(
                    key,
                    gname,
                    f"'{name}-{gname}' (the DaskWorkerGroup's name) is longer than "
                    "63 characters",
                    "a shorter group or cluster name",
                )
            )
        seen.add(gname)
    if problems:
        raise _error(problems)
    assert name is not None and image

    threads = int(k["threads-per-worker"])
    n_workers = adaptive[0] if adaptive else int(k["n-workers"])
    env = _env(k.get("env"))
    resources = _resources(k.get("resources"))
    sched_resources = (
        resources
        if k.get("scheduler-resources") is None
        else _resources(k["scheduler-resources"])
    )

    if custom is not None:
        # The user's own DaskCluster, as dask-kubernetes' custom_cluster_spec: its
        # pods as written.  fiber-dask sets only the name, the namespace, the
        # adaptive start size, and adds the scheduler environment it relies on.
        cluster = custom
        worker = cluster["spec"]["worker"]
        if adaptive:
            worker["replicas"] = n_workers
        else:
            n_workers = int(worker.get("replicas", n_workers))
        threads = _nthreads(_container(cluster, "worker").get("args"), threads)
        scheduler = _container(cluster, "scheduler")
        have = {e.get("name") for e in scheduler.get("env") or []}
        scheduler["env"] = list(scheduler.get("env") or []) + [
            e for e in _scheduler_env(adaptive_cfg) if e["name"] not in have
        ]
    else:
        cluster = make_cluster_spec(
            name=name,
            image=image,
            n_workers=n_workers,
            resources=resources,
            env=env,
            worker_command=_worker_command(threads, k.get("dask-resources")),
            scheduler_service_type=k["scheduler-service-type"],
        )
        scheduler = cluster["spec"]["scheduler"]["spec"]["containers"][0]
        scheduler["args"] = ["dask", "scheduler", "--host", "0.0.0.0"]
        scheduler["resources"] = sched_resources
        scheduler["env"] = (env or []) + _scheduler_env(adaptive_cfg)
    preloads = []
    if custom is None:
        # The pools on the scheduler's dashboard and in `fiber-dask info`
        # (fiber_dask.dashboard; the scheduler runs fiber-dask's image).  A
        # custom spec's scheduler may run an image without fiber-dask: its pods
        # stay as written (docs/kubernetes.md says how to add it).
        preloads.append(DASHBOARD_PRELOAD)
    if groups:
        # The operator's autoscaler resizes the default group only; make the
        # scheduler offer only that group's workers for retirement.
        preloads.append(_DOWNSCALE_PRELOAD)
        scheduler["env"] += [
            {"name": _DOWNSCALE_ENV, "value": f"{name}-default-worker-"},
        ]
    if preloads:
        scheduler["env"] += [
            {
                "name": "DASK_DISTRIBUTED__SCHEDULER__PRELOAD",
                "value": json.dumps(preloads),
            },
        ]
    cluster["metadata"] = {
        **cluster.get("metadata", {}),
        **_metadata(name, k.get("namespace")),
    }
    if custom is None:
        # The operator fills in spec.idleTimeout's default (0, never) itself.
        cluster["spec"].pop("idleTimeout", None)

    worker_groups = []
    for group in groups:
        gthreads = group.get("threads-per-worker") or threads
        genv = dict(k.get("env") or {})
        genv.update(group.get("env") or {})
        spec = make_worker_spec(
            image=group.get("image") or image,
            n_workers=int(group.get("n-workers", 1)),
            resources=resources
            if group.get("resources") is None
            else _resources(group["resources"]),
            env=_env(genv),
            worker_command=_worker_command(gthreads, group.get("dask-resources")),
        )
        # The same document KubeCluster.add_worker_group(name, custom_spec=spec)
        # creates.
        doc = {
            "apiVersion": API_VERSION,
            "kind": "DaskWorkerGroup",
            "metadata": _metadata(f"{name}-{group['name']}", k.get("namespace")),
            "spec": {"cluster": name, "worker": spec},
        }
        worker_groups.append((group["name"], _prune(doc)))

    autoscaler = None
    if adaptive is not None:
        # What KubeCluster.adapt(minimum, maximum) creates (it also puts two label
        # keys straight into metadata, where the API server drops them).
        autoscaler = {
            "apiVersion": API_VERSION,
            "kind": "DaskAutoscaler",
            "metadata": _metadata(name, k.get("namespace")),
            "spec": {"cluster": name, "minimum": adaptive[0], "maximum": adaptive[1]},
        }
    return Plan(
        name=name,
        namespace=k.get("namespace"),
        cluster=_prune(cluster),
        worker_groups=worker_groups,
        autoscaler=autoscaler,
        n_workers=n_workers,
        adaptive=adaptive,
        threads_per_worker=threads,
    )


def _custom_cluster_spec(value: Any, problems: list[Problem]) -> dict | None:
    """The DaskCluster of ``custom-cluster-spec`` (a mapping or a YAML file)."""
    if value is None:
        return None
    key = "kubernetes.custom-cluster-spec"
    if isinstance(value, str):
        import os

        import yaml

        try:
            with open(os.path.expanduser(value)) as f:
                value = yaml.safe_load(f)
        except (OSError, yaml.YAMLError) as e:
            problems.append(
                _problem(key, value, f"cannot read it: {e}", "a readable YAML file")
            )
            return None
    allowed = (
        "a DaskCluster resource (kind: DaskCluster, spec: {scheduler: ..., "
        "worker: ...}), as a mapping or the path of a YAML file"
    )
    if (
        not isinstance(value, Mapping)
        or value.get("kind", "DaskCluster") != "DaskCluster"
        or not isinstance(value.get("spec"), Mapping)
        or not {"scheduler", "worker"} <= set(value["spec"])
    ):
        problems.append(_problem(key, value, "not a DaskCluster resource", allowed))
        return None
    spec = copy.deepcopy(dict(value))
    spec.setdefault("apiVersion", API_VERSION)
    spec.setdefault("kind", "DaskCluster")
    return spec


def _container(cluster: Mapping[str, Any], part: str) -> dict[str, Any]:
    """The first container of the scheduler's or the default workers' pods."""
    try:
        return cluster["spec"][part]["spec"]["containers"][0]
    except (KeyError, IndexError, TypeError):
        return {}


def _nthreads(args: Any, default: int) -> int:
    """``--nthreads N`` of a worker command, else ``default``."""
    args = [str(a) for a in args or []]
    for i, arg in enumerate(args):
        if arg == "--nthreads" and i + 1 < len(args) and args[i + 1].isdigit():
            return int(args[i + 1])
        if arg.startswith("--nthreads=") and arg.split("=", 1)[1].isdigit():
            return int(arg.split("=", 1)[1])
    return default


def require_dask_kubernetes() -> Any:
    """``dask_kubernetes.operator``, or an ImportError that says how to install it."""
    try:
        import dask_kubernetes.operator as operator
    except ImportError as e:
        raise ImportError(
            "the kubernetes backend needs dask-kubernetes, which is not installed "
            f'({e}): pip install "fiber-dask[kubernetes]"'
        ) from e
    return operator


# ------------------------------------------------------------------------ pieces


def _cluster_name(
    template: str | None, default: str | None, problems: list[Problem]
) -> str | None:
    if template is None:
        if default is None:
            problems.append(
                _problem(
                    "kubernetes.name",
                    None,
                    "a manifest needs a fixed cluster name",
                    "a name of lower-case letters, digits and '-'",
                )
            )
        return default
    try:
        name = template.format(user=_user(), uuid=uuid.uuid4().hex[:10])
    except (KeyError, IndexError, ValueError) as e:
        problems.append(
            _problem(
                "kubernetes.name",
                template,
                f"cannot fill in the name template ({e!r})",
                "a name; the only placeholders are {user} and {uuid}",
            )
        )
        return None
    if len(name) > MAX_NAME or not _NAME.match(name):
        shown = "" if name == template else f" (filled in: {name!r})"
        problems.append(
            _problem(
                "kubernetes.name",
                template,
                f"not a valid DaskCluster name{shown}",
                f"lower-case letters, digits and '-', starting and ending with a "
                f"letter or digit, at most {MAX_NAME} characters",
            )
        )
        return None
    return name


def _user() -> str:
    """The login name for ``{user}``, lower-cased as a Kubernetes name needs."""
    try:
        return getpass.getuser().lower()
    except Exception:  # noqa: BLE001 - no passwd entry in some containers
        return "user"


def _metadata(name: str, namespace: str | None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name}
    if namespace:
        meta["namespace"] = namespace
    return meta


def _worker_command(threads: int, dask_resources: Mapping | None) -> list[str]:
    command = ["dask", "worker", "--nthreads", str(threads)]
    if dask_resources:
        command += [
            "--resources",
            ",".join(f"{k}={_number(v)}" for k, v in dask_resources.items()),
        ]
    return command


def _number(value: Any) -> str:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


def _env(env: Mapping[str, Any] | None) -> list[dict[str, str]] | None:
    if not env:
        return None
    return [{"name": str(k), "value": _number(v)} for k, v in env.items()]


def _resources(res: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """Container resources with every quantity a string; None when empty."""
    out = {}
    for kind in ("requests", "limits"):
        values = (res or {}).get(kind) or {}
        if values:
            out[kind] = {str(k): _number(v) for k, v in values.items()}
    return out or None


def _scheduler_env(adaptive: Mapping[str, Any]) -> list[dict[str, str]]:
    routes = list(dask.config.get("distributed.scheduler.http.routes", []))
    if _API_ROUTE not in routes:
        routes.append(_API_ROUTE)
    env = [
        # dask reads a list from an environment variable as a Python literal.
        {
            "name": "DASK_DISTRIBUTED__SCHEDULER__HTTP__ROUTES",
            "value": json.dumps(routes),
        }
    ]
    if adaptive.get("enabled"):
        for key in ("target-duration", "interval", "wait-count"):
            var = "DASK_DISTRIBUTED__ADAPTIVE__" + key.upper().replace("-", "_")
            env.append({"name": var, "value": _number(adaptive[key])})
    return env


def _prune(obj: Any) -> Any:
    """Drop None values, as the API server prunes nulls from custom resources."""
    if isinstance(obj, Mapping):
        return {k: _prune(v) for k, v in obj.items() if v is not None}
    if isinstance(obj, list):
        return [_prune(v) for v in obj]
    return obj


def _problem(key: str, value: Any, reason: str, allowed: str) -> Problem:
    return config.make_problem(["fiber", *key.split(".")], value, reason, allowed)


def _error(problems: list[Problem]) -> ConfigError:
    return ConfigError(config.describe_problems(problems), problems)
