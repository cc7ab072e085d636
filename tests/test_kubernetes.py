"""The kubernetes backend and its manifests, without a Kubernetes cluster.

What can be checked here, as real as it gets on one machine:

* the resources of every Kubernetes profile in adapters/ against the schemas the
  API server would apply: the openAPIV3Schema of the CRDs shipped in the
  installed dask-kubernetes (unknown fields rejected, nulls pruned), and the
  core objects inside (the pod templates, the scheduler Service, and the
  Deployments/Services the operator builds from them) with kubernetes-validate;
* the real dask-kubernetes operator controller (kopf) against an in-memory
  Kubernetes API (kmock): it creates the scheduler Deployment and Service and
  the worker Deployments of a fiber-dask profile, adopts its DaskAutoscaler,
  and scales a group; and the backend's ownership rules against the same API
  (an existing cluster is never taken over or deleted; a half-started cluster
  of ours is deleted);
* the backend end to end on that API with the operator and a pretend kubelet
  that runs Deployments as local ``dask`` processes: create, GPU group,
  adaptive up and graceful down, Pool growth, a pod killed under a Pool and a
  Process, attach without delete, delete at shutdown.

Tests marked ``kubernetes`` need a live cluster with the operator and an image
with fiber-dask (``FIBER_DASK_TEST_IMAGE``); they run with ``--kubernetes``.
"""

from __future__ import annotations

import copy
import os
import pathlib
import signal
import sys
import time
from collections.abc import Iterator
from typing import Any

import dask
import dask.config
import jsonschema
import pytest
import yaml

from fiber_dask import config
from fiber_dask.backends import kubemanifest
from fiber_dask.backends.kubemanifest import manifests
from fiber_dask.errors import ClusterConnectionError
from fiber_dask.meta import RESOURCE_NAMES

pytest.importorskip("dask_kubernetes")

from support import kubeapi as hk  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parent.parent
ADAPTERS = REPO / "adapters"

# What the emulated API makes kr8s and kmock say: it reports an old Kubernetes
# version and does not serve every discovery URL.
pytestmark = [
    pytest.mark.filterwarnings("ignore:Kubernetes version .* is not supported"),
    pytest.mark.filterwarnings("ignore:The URL was not found:UserWarning"),
    pytest.mark.filterwarnings("ignore:read_binary is deprecated:DeprecationWarning"),
]


def profile(name: str) -> dict[str, Any]:
    return yaml.safe_load((ADAPTERS / name).read_text())["fiber"]


def kubernetes_profiles() -> list[str]:
    names = []
    for path in sorted(ADAPTERS.glob("*.yaml")):
        fiber = yaml.safe_load(path.read_text())["fiber"]
        if fiber.get("backend") == "kubernetes":
            names.append(path.name)
    return names


KUBE_PROFILES = kubernetes_profiles()


@pytest.fixture(scope="module")
def crds() -> dict[str, Any]:
    return hk.load_crds()


def by_kind(docs: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for doc in docs:
        out.setdefault(doc["kind"], []).append(doc)
    return out


def has_none(obj: Any) -> bool:
    if obj is None:
        return True
    if isinstance(obj, dict):
        return any(has_none(v) for v in obj.values())
    if isinstance(obj, list):
        return any(has_none(v) for v in obj)
    return False


def validate_core(doc: dict[str, Any]) -> None:
    import kubernetes_validate

    kubernetes_validate.validate(
        doc, kubernetes_validate.utils.latest_version(), strict=True
    )


def pod(template: dict[str, Any], name: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": template["spec"],
    }


# ---------------------------------------------------------- the validator itself


def test_profiles_exist() -> None:
    assert {"kubernetes.yaml", "kubernetes-adaptive.yaml"} <= set(KUBE_PROFILES)


def test_crd_validation_rejects_what_the_api_server_rejects(crds) -> None:
    (doc,) = manifests({"kubernetes": {"name": "probe", "image": "example/img:1"}})
    hk.validate_custom_resource(doc, crds)

    unknown = copy.deepcopy(doc)
    unknown["spec"]["worker"]["spec"]["containers"][0]["gpus"] = 1
    with pytest.raises(jsonschema.ValidationError, match="gpus"):
        hk.validate_custom_resource(unknown, crds)

    typo = copy.deepcopy(doc)
    typo["spec"]["workers"] = typo["spec"].pop("worker")
    with pytest.raises(jsonschema.ValidationError):
        hk.validate_custom_resource(typo, crds)

    # Quantities are strings in the CRD: a bare number is refused, which is why
    # manifests() turns {cpu: 1} into {cpu: "1"}.
    number = copy.deepcopy(doc)
    number["spec"]["worker"]["spec"]["containers"][0]["resources"] = {
        "limits": {"cpu": 1}
    }
    with pytest.raises(jsonschema.ValidationError, match="string"):
        hk.validate_custom_resource(number, crds)

    # A null is pruned by the API server (not nullable): accepted, and gone.
    nulled = copy.deepcopy(doc)
    nulled["spec"]["worker"]["spec"]["containers"][0]["env"] = None
    hk.validate_custom_resource(nulled, crds)
    schema = crds["DaskCluster"]["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    assert (
        "env"
        not in hk.prune_nulls(nulled, schema)["spec"]["worker"]["spec"]["containers"][0]
    )

    bad_meta = copy.deepcopy(doc)
    bad_meta["metadata"]["dask.org/cluster-name"] = "probe"
    with pytest.raises(AssertionError, match="metadata"):
        hk.validate_custom_resource(bad_meta, crds)

    autoscaler = {
        "apiVersion": "kubernetes.dask.org/v1",
        "kind": "DaskAutoscaler",
        "metadata": {"name": "probe"},
        "spec": {"cluster": "probe", "minimum": 0, "maximum": None},
    }
    # adapt() without a maximum: the null is pruned, then "maximum" is missing.
    with pytest.raises(jsonschema.ValidationError, match="maximum"):
        hk.validate_custom_resource(autoscaler, crds)


def test_core_validation_is_strict() -> None:
    import kubernetes_validate

    bad = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "x"},
        "spec": {"containers": [{"name": "w", "image": "i", "cpus": 1}]},
    }
    with pytest.raises(kubernetes_validate.ValidationError):
        validate_core(bad)


# ------------------------------------------------------------------ the profiles


@pytest.mark.parametrize("name", KUBE_PROFILES)
def test_profile_manifests_are_valid_custom_resources(name: str, crds) -> None:
    docs = manifests(profile(name))
    kinds = by_kind(docs)
    assert len(kinds["DaskCluster"]) == 1
    for doc in docs:
        assert not has_none(doc), doc
        hk.validate_custom_resource(doc, crds)
    # What kubectl apply -f - reads.
    text = yaml.safe_dump_all(docs, sort_keys=False)
    assert list(yaml.safe_load_all(text)) == docs


@pytest.mark.parametrize("name", KUBE_PROFILES)
def test_profile_pods_and_operator_objects_are_valid_core_objects(name: str) -> None:
    """The pod templates, and what the operator builds from them (its pure
    builder functions), pass the Kubernetes API's own schemas."""
    from dask_kubernetes.operator.controller import controller

    docs = manifests(profile(name))
    cluster = by_kind(docs)["DaskCluster"][0]
    cname = cluster["metadata"]["name"]
    spec = cluster["spec"]
    validate_core(pod(spec["scheduler"], f"{cname}-scheduler"))
    validate_core(pod(spec["worker"], f"{cname}-default-worker-0"))
    validate_core(
        controller.build_scheduler_deployment_spec(
            cname, spec["scheduler"]["spec"], {}, {}
        )
    )
    validate_core(
        controller.build_scheduler_service_spec(
            cname, spec["scheduler"]["service"], {}, {}
        )
    )
    groups = [(f"{cname}-default", spec["worker"])] + [
        (d["metadata"]["name"], d["spec"]["worker"])
        for d in by_kind(docs).get("DaskWorkerGroup", [])
    ]
    for group, worker in groups:
        validate_core(pod(worker, f"{group}-worker-0"))
        validate_core(
            controller.build_worker_deployment_spec(
                group, "default", cname, "0123456789", worker["spec"], {}, {}
            )
        )


def test_fixed_profile_content() -> None:
    fiber = profile("kubernetes.yaml")
    (cluster,) = manifests(fiber)
    k = fiber["kubernetes"]
    worker = cluster["spec"]["worker"]
    assert worker["replicas"] == k["n-workers"]
    (container,) = worker["spec"]["containers"]
    assert container["image"] == k["image"]
    # `dask worker`, not the dask-worker script distributed no longer installs
    assert container["args"][:4] == ["dask", "worker", "--nthreads", "1"]
    assert container["resources"]["limits"] == {"cpu": "1", "memory": "2Gi"}
    assert {"name": "OMP_NUM_THREADS", "value": "1"} in container["env"]
    (scheduler,) = cluster["spec"]["scheduler"]["spec"]["containers"]
    assert scheduler["args"][:2] == ["dask", "scheduler"]
    assert scheduler["resources"]["requests"] == {"cpu": "500m", "memory": "1Gi"}
    env = {e["name"]: e["value"] for e in scheduler["env"]}
    # graceful scale-down: the operator retires workers through the HTTP API
    routes = yaml.safe_load(env["DASK_DISTRIBUTED__SCHEDULER__HTTP__ROUTES"])
    assert "distributed.http.scheduler.api" in routes
    assert "distributed.http.health" in routes  # the readiness probe's
    # the pools on its dashboard and in `fiber-dask info`
    preload = yaml.safe_load(env["DASK_DISTRIBUTED__SCHEDULER__PRELOAD"])
    assert preload == ["fiber_dask.dashboard"]
    assert not any(name.startswith("DASK_DISTRIBUTED__ADAPTIVE") for name in env)
    assert cluster["metadata"]["name"].startswith("fiber-")


def test_adaptive_profile_content() -> None:
    fiber = profile("kubernetes-adaptive.yaml")
    docs = manifests(fiber)
    assert [d["kind"] for d in docs] == [
        "DaskCluster",
        "DaskWorkerGroup",
        "DaskAutoscaler",
    ]
    cluster, gpu, autoscaler = docs
    name = cluster["metadata"]["name"]
    adaptive = fiber["adaptive"]
    assert cluster["spec"]["worker"]["replicas"] == adaptive["minimum"]
    assert autoscaler["metadata"]["name"] == name
    assert autoscaler["spec"] == {
        "cluster": name,
        "minimum": adaptive["minimum"],
        "maximum": adaptive["maximum"],
    }
    (scheduler,) = cluster["spec"]["scheduler"]["spec"]["containers"]
    env = {e["name"]: e["value"] for e in scheduler["env"]}
    assert env["DASK_DISTRIBUTED__ADAPTIVE__TARGET_DURATION"] == "30s"
    assert env["DASK_DISTRIBUTED__ADAPTIVE__INTERVAL"] == "1s"
    assert env["DASK_DISTRIBUTED__ADAPTIVE__WAIT_COUNT"] == "3"
    # one preload list: the dashboard and, with extra groups, the downscale rule
    preload = yaml.safe_load(env["DASK_DISTRIBUTED__SCHEDULER__PRELOAD"])
    assert preload == ["fiber_dask.dashboard", "fiber_dask.backends.kubescheduler"]
    assert [e["name"] for e in scheduler["env"]].count(
        "DASK_DISTRIBUTED__SCHEDULER__PRELOAD"
    ) == 1
    # the scheduler reads them back as Dask config
    parsed = dask.config.collect_env(env)["distributed"]["adaptive"]
    assert dask.config.get("target-duration", config=parsed) == "30s"

    assert gpu["metadata"]["name"] == f"{name}-gpu"
    assert gpu["spec"]["cluster"] == name
    (container,) = gpu["spec"]["worker"]["spec"]["containers"]
    args = container["args"]
    # meta(gpu=1) asks for the Dask resource GPU: this group declares it
    assert args[args.index("--resources") + 1] == f"{RESOURCE_NAMES['gpu']}=1"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert container["image"] == fiber["kubernetes"]["image"]  # inherited
    default_args = cluster["spec"]["worker"]["spec"]["containers"][0]["args"]
    assert "--resources" not in default_args


def test_adapt_sends_what_the_crd_requires(crds) -> None:
    """KubeCluster.adapt() with both bounds makes a valid DaskAutoscaler (what
    the backend calls); the manifest is that same object."""
    import inspect

    from dask_kubernetes.operator import KubeCluster

    source = inspect.getsource(KubeCluster._adapt)
    assert '"minimum": minimum' in source and '"maximum": maximum' in source
    docs = manifests(profile("kubernetes-adaptive.yaml"))
    hk.validate_custom_resource(docs[-1], crds)


# --------------------------------------------------------------- configuration


def base(**kubernetes: Any) -> dict[str, Any]:
    return {"kubernetes": {"name": "demo", "image": "example/img:1", **kubernetes}}


@pytest.mark.parametrize(
    "cfg, key, words",
    [
        ({"kubernetes": {"name": "demo"}}, "fiber.kubernetes.image", "image"),
        ({"kubernetes": {"image": "i"}}, "fiber.kubernetes.name", "fixed"),
        (base(name="Demo_1"), "fiber.kubernetes.name", "not a valid"),
        (base(name="x" * 60), "fiber.kubernetes.name", "at most 53"),
        (base(name="demo-{host}"), "fiber.kubernetes.name", "placeholders"),
        (
            {**base(), "adaptive": {"enabled": True, "minimum": 1}},
            "fiber.adaptive.maximum",
            "both",
        ),
        (
            base(**{"worker-groups": [{"name": "gpu"}, {"name": "gpu"}]}),
            "fiber.kubernetes.worker-groups.1.name",
            "duplicate",
        ),
        (
            base(**{"worker-groups": [{"name": "default"}]}),
            "fiber.kubernetes.worker-groups.0.name",
            "default",
        ),
        (base(attach=True), "fiber.kubernetes.attach", "nothing to create"),
        (base(**{"n-workers": -1}), "fiber.kubernetes.n-workers", "minimum"),
    ],
)
def test_bad_profiles_raise_config_error(cfg: dict, key: str, words: str) -> None:
    with pytest.raises(config.ConfigError) as info:
        manifests(cfg)
    assert key in {p.key for p in info.value.problems}, str(info.value)
    assert words in str(info.value)


def test_manifests_default_to_the_dask_config() -> None:
    with dask.config.set(
        {
            "fiber.kubernetes.name": "from-config",
            "fiber.kubernetes.image": "example/img:2",
            "fiber.kubernetes.namespace": "science",
            "fiber.kubernetes.env": {"A": 1},
        }
    ):
        (doc,) = manifests()
    assert doc["metadata"] == {"name": "from-config", "namespace": "science"}
    (container,) = doc["spec"]["worker"]["spec"]["containers"]
    assert container["image"] == "example/img:2"
    assert container["env"] == [{"name": "A", "value": "1"}]
    with pytest.raises(config.ConfigError, match="fiber.kubernetes.image"):
        manifests()  # the defaults have no image


def test_name_template_and_group_inheritance() -> None:
    import getpass

    docs = manifests(
        base(
            name="job-{uuid}",
            env={"A": "a", "B": "b"},
            resources={"requests": {"memory": "1Gi"}},
            **{
                "worker-groups": [
                    {"name": "big", "env": {"B": "big"}, "threads-per-worker": 4}
                ]
            },
        )
    )
    cluster, group = docs
    name = cluster["metadata"]["name"]
    assert name.startswith("job-") and len(name) == 14
    assert group["metadata"]["name"] == f"{name}-big"
    (c,) = group["spec"]["worker"]["spec"]["containers"]
    assert {e["name"]: e["value"] for e in c["env"]} == {"A": "a", "B": "big"}
    assert c["resources"] == {"requests": {"memory": "1Gi"}}
    assert c["args"][:4] == ["dask", "worker", "--nthreads", "4"]
    user = getpass.getuser().lower()
    if kubemanifest._NAME.match(f"u-{user}"):
        (doc,) = manifests(base(name="u-{user}"))
        assert doc["metadata"]["name"] == f"u-{user}"


# ------------------------------------------- dask-kubernetes' own configuration


def test_dask_kubernetes_settings_are_the_defaults_beneath() -> None:
    """A user's kubernetes.* (their kubernetes.yaml) fills the fiber.kubernetes
    keys left at fiber-dask's defaults; fiber's own keys win; mappings merge."""
    theirs = {
        "kubernetes.image": "registry.example.com/team/img:2",
        "kubernetes.namespace": "science",
        "kubernetes.env": {"A": "theirs", "B": "theirs"},
        "kubernetes.resources": {"limits": {"cpu": "2"}},
        "kubernetes.count.start": 5,
        "kubernetes.scheduler-service-type": "NodePort",
        "kubernetes.name": "team-{user}",
    }
    with dask.config.set(theirs):
        (doc,) = manifests({"kubernetes": {"env": {"B": "ours"}}})
        assert doc["metadata"]["namespace"] == "science"
        assert doc["metadata"]["name"] == f"team-{kubemanifest._user()}"
        worker = doc["spec"]["worker"]
        assert worker["replicas"] == 5
        (container,) = worker["spec"]["containers"]
        assert container["image"] == "registry.example.com/team/img:2"
        assert {e["name"]: e["value"] for e in container["env"]} == {
            "A": "theirs",
            "B": "ours",
        }
        assert container["resources"] == {"limits": {"cpu": "2"}}
        assert doc["spec"]["scheduler"]["service"]["type"] == "NodePort"
        # fiber.kubernetes keys that are set win.
        (doc,) = manifests(base(namespace="mine", **{"n-workers": 1}))
        assert doc["metadata"] == {"name": "demo", "namespace": "mine"}
        assert doc["spec"]["worker"]["replicas"] == 1
        assert (
            doc["spec"]["worker"]["spec"]["containers"][0]["image"] == "example/img:1"
        )


def test_dask_kubernetes_own_defaults_are_not_taken() -> None:
    """dask-kubernetes' packaged image (ghcr.io/dask/dask, without fiber-dask) and
    name template do not stand in for fiber-dask's."""
    import dask_kubernetes  # noqa: F401  (loads its defaults into dask.config)

    assert dask.config.get("kubernetes.image").startswith("ghcr.io/dask/dask")
    with pytest.raises(config.ConfigError, match="fiber.kubernetes.image"):
        manifests({"kubernetes": {"name": "demo"}})
    (doc,) = manifests(base())
    assert doc["metadata"]["name"] == "demo"
    assert doc["spec"]["worker"]["replicas"] == 2  # not kubernetes.count.start (0)


def test_a_bad_dask_kubernetes_value_names_its_key() -> None:
    with (
        dask.config.set({"kubernetes.resources": {"limits": {"memory": "lots"}}}),
        pytest.raises(config.ConfigError) as info,
    ):
        manifests(base())
    (problem,) = info.value.problems
    assert problem.key == "fiber.kubernetes.resources.limits.memory"
    assert problem.source.startswith("kubernetes.resources")


def test_a_users_kubernetes_yaml_reaches_the_manifest(tmp_path: pathlib.Path) -> None:
    """The user journey: an existing ~/.config/dask/kubernetes.yaml, a fiber
    profile that only names the cluster, `fiber-dask kubernetes manifest`."""
    import subprocess

    conf = tmp_path / "dask"
    conf.mkdir()
    (conf / "kubernetes.yaml").write_text(
        "kubernetes:\n  image: registry.example.com/team/img:3\n"
        "  namespace: team\n  env: {OMP_NUM_THREADS: '1'}\n"
    )
    profile = tmp_path / "profile.yaml"
    profile.write_text("fiber:\n  backend: kubernetes\n  kubernetes: {name: job}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("DASK_")}
    env.update(DASK_CONFIG=str(conf), PYTHONPATH=str(REPO))
    result = subprocess.run(
        [sys.executable, "-m", "fiber_dask.cli", "kubernetes", "manifest"]
        + ["--config", str(profile)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    (doc,) = yaml.safe_load_all(result.stdout)
    assert doc["metadata"] == {"name": "job", "namespace": "team"}
    (container,) = doc["spec"]["worker"]["spec"]["containers"]
    assert container["image"] == "registry.example.com/team/img:3"
    assert {"name": "OMP_NUM_THREADS", "value": "1"} in container["env"]


def _custom_spec() -> dict[str, Any]:
    from dask_kubernetes.operator import make_cluster_spec

    spec = make_cluster_spec(
        name="theirs",
        image="registry.example.com/custom:1",
        n_workers=4,
        worker_command=["dask", "worker", "--nthreads", "2"],
    )
    spec["spec"]["worker"]["spec"]["containers"][0]["env"] = [
        {"name": "CUSTOM", "value": "yes"}
    ]
    return spec


@pytest.mark.parametrize("where", ["fiber", "dask-kubernetes", "file"])
def test_custom_cluster_spec_passthrough(
    where: str, tmp_path: pathlib.Path, crds
) -> None:
    spec = _custom_spec()
    if where == "file":
        path = tmp_path / "cluster.yaml"
        path.write_text(yaml.safe_dump(spec))
        value: Any = str(path)
    else:
        value = spec
    if where == "dask-kubernetes":
        with dask.config.set({"kubernetes.custom-cluster-spec": value}):
            docs = manifests({"kubernetes": {}})
    else:
        docs = manifests({"kubernetes": {"custom-cluster-spec": value}})
    (doc,) = docs
    hk.validate_custom_resource(doc, crds)
    assert doc["metadata"]["name"] == "theirs"  # the spec's own name
    (container,) = doc["spec"]["worker"]["spec"]["containers"]
    assert container["image"] == "registry.example.com/custom:1"
    assert container["args"] == spec["spec"]["worker"]["spec"]["containers"][0]["args"]
    assert container["env"] == [{"name": "CUSTOM", "value": "yes"}]
    assert doc["spec"]["worker"]["replicas"] == 4
    (scheduler,) = doc["spec"]["scheduler"]["spec"]["containers"]
    env = {e["name"]: e["value"] for e in scheduler["env"]}
    assert (
        "distributed.http.scheduler.api"
        in env["DASK_DISTRIBUTED__SCHEDULER__HTTP__ROUTES"]
    )


def test_custom_cluster_spec_with_adaptive_and_a_name(crds) -> None:
    cfg = {
        "kubernetes": {"name": "ours", "custom-cluster-spec": _custom_spec()},
        "adaptive": {"enabled": True, "minimum": 1, "maximum": 6},
    }
    p = kubemanifest.plan(kubemanifest.effective_config(cfg))
    assert (p.name, p.n_workers, p.adaptive, p.threads_per_worker) == (
        "ours",
        1,
        (1, 6),
        2,
    )
    cluster, autoscaler = p.documents()
    assert cluster["metadata"]["name"] == "ours"
    assert cluster["spec"]["worker"]["replicas"] == 1
    assert autoscaler["spec"] == {"cluster": "ours", "minimum": 1, "maximum": 6}
    for doc in p.documents():
        hk.validate_custom_resource(doc, crds)


@pytest.mark.parametrize(
    "value, words",
    [
        ({"kind": "Pod", "spec": {}}, "not a DaskCluster"),
        ({"spec": {"worker": {}}}, "not a DaskCluster"),
        ("/no/such/file.yaml", "cannot read it"),
    ],
)
def test_bad_custom_cluster_spec(value: Any, words: str) -> None:
    with pytest.raises(config.ConfigError) as info:
        manifests({"kubernetes": {"custom-cluster-spec": value}})
    assert "fiber.kubernetes.custom-cluster-spec" in {
        p.key for p in info.value.problems
    }
    assert words in str(info.value)


def test_the_mapping_of_dask_kubernetes_keys_is_documented() -> None:
    """adapters/kubernetes/README.md's table names every key of dask-kubernetes'
    kubernetes.yaml, and what fiber-dask does with it."""
    readme = (ADAPTERS / "kubernetes" / "README.md").read_text()
    table = readme[readme.index("| dask-kubernetes") :]
    table = table[: table.index("\n\n")]
    packaged = kubemanifest._dask_kubernetes_defaults()
    assert packaged, "dask-kubernetes' kubernetes.yaml not found"
    for key in packaged:
        assert f"`kubernetes.{key}" in table, key
    for theirs, ours in kubemanifest.DASK_KUBERNETES_KEYS.items():
        assert f"| `kubernetes.{theirs}` | `fiber.kubernetes.{ours}`" in table, theirs


def test_backend_is_registered() -> None:
    from fiber_dask.backends import load_backend
    from fiber_dask.backends.kubernetes import KubernetesBackend

    assert "kubernetes" in config.available_backends()
    assert load_backend("kubernetes") is KubernetesBackend


def test_missing_dask_kubernetes_says_how_to_install(tmp_path: pathlib.Path) -> None:
    import subprocess

    blocker = tmp_path / "dask_kubernetes"
    blocker.mkdir()
    (blocker / "__init__.py").write_text("raise ImportError('blocked for the test')\n")
    code = (
        "from fiber_dask.backends.kubemanifest import manifests\n"
        "manifests({'kubernetes': {'name': 'a', 'image': 'b'}})\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0
    assert 'pip install "fiber-dask[kubernetes]"' in proc.stderr


# --------------------------------------- the operator, against an emulated API


@pytest.fixture(scope="module")
def kube(tmp_path_factory: pytest.TempPathFactory) -> Iterator[hk.KubeAPI]:
    pytest.importorskip("kmock", reason="kmock (Python >= 3.11) emulates the API")
    with hk.kube_api(tmp_path_factory.mktemp("kube")) as api:
        yield api


@pytest.fixture
def kubeconfig(kube: hk.KubeAPI, monkeypatch: pytest.MonkeyPatch) -> str:
    import kr8s

    monkeypatch.setenv("KUBECONFIG", kube.kubeconfig)
    # kr8s keeps one API object per thread and event loop: drop any made with
    # another kubeconfig.
    kr8s.Api._instances.clear()
    kr8s.asyncio.Api._instances.clear()
    return kube.kubeconfig


def daskcluster(name: str, kubeconfig: str | None = None, namespace: str = "default"):
    """The DaskCluster ``name`` (kr8s; raises kr8s.NotFoundError)."""
    import kr8s
    from kr8s.objects import new_class

    cls = new_class("DaskCluster", "kubernetes.dask.org/v1", namespaced=True)
    return cls.get(name, namespace=namespace, api=kr8s.api(kubeconfig=kubeconfig))


def apply(docs: list[dict[str, Any]], kubeconfig: str | None) -> None:
    """What `kubectl apply -f -` does with new objects: create them."""
    import kr8s
    from kr8s.objects import new_class

    api = kr8s.api(kubeconfig=kubeconfig)
    for doc in docs:
        cls = new_class(doc["kind"], doc["apiVersion"], namespaced=True)
        cls(
            doc, namespace=doc["metadata"].get("namespace", "default"), api=api
        ).create()


@pytest.mark.timeout(90)
def test_operator_creates_the_profile_resources(
    kube: hk.KubeAPI, kubeconfig: str, crds
) -> None:
    import kr8s
    from kr8s.objects import new_class

    fiber = profile("kubernetes-adaptive.yaml")
    fiber["kubernetes"]["name"] = "fiber-operator-test"
    docs = manifests(fiber)
    with hk.running_operator():
        apply(docs, kubeconfig)
        name = "fiber-operator-test"
        minimum = fiber["adaptive"]["minimum"]
        gpu_workers = fiber["kubernetes"]["worker-groups"][0]["n-workers"]

        def deployments(group: str) -> list[str]:
            return [
                d
                for d in kube.names("deployments")
                if d.startswith(f"{name}-{group}-worker-")
            ]

        hk.wait_for(
            lambda: (
                f"{name}-scheduler" in kube.names("deployments")
                and f"{name}-scheduler" in kube.names("services")
                and len(deployments("default")) == minimum
                and len(deployments("gpu")) == gpu_workers
            ),
            what="the scheduler, its service and the worker deployments",
        )
        # The operator made the default group from the DaskCluster, and adopted
        # the autoscaler into the cluster (it is deleted with it).
        assert f"{name}-default" in kube.names("daskworkergroups")
        hk.wait_for(
            lambda: kube.get("daskautoscalers", name)["metadata"].get(
                "ownerReferences"
            ),
            what="the DaskAutoscaler to be adopted",
        )
        owner = kube.get("daskautoscalers", name)["metadata"]["ownerReferences"][0]
        assert (owner["kind"], owner["name"]) == ("DaskCluster", name)

        # What it created is what the profile says, and valid core objects.
        scheduler = kube.get("deployments", f"{name}-scheduler")
        (container,) = scheduler["spec"]["template"]["spec"]["containers"]
        assert container["args"][:2] == ["dask", "scheduler"]
        env = {e["name"] for e in container["env"]}
        assert "DASK_DISTRIBUTED__ADAPTIVE__TARGET_DURATION" in env
        (gpu_deployment,) = deployments("gpu")
        worker = kube.get("deployments", gpu_deployment)
        (container,) = worker["spec"]["template"]["spec"]["containers"]
        assert "GPU=1" in container["args"]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
        env = {e["name"]: e["value"] for e in container["env"]}
        assert env["DASK_SCHEDULER_ADDRESS"] == (
            f"tcp://{name}-scheduler.default.svc.cluster.local:8786"
        )
        for plural, objname in [
            ("deployments", f"{name}-scheduler"),
            ("services", f"{name}-scheduler"),
            ("deployments", gpu_deployment),
        ]:
            obj = kube.get(plural, objname)
            for key in ("uid", "resourceVersion", "creationTimestamp", "namespace"):
                obj["metadata"].pop(key, None)
            obj.pop("status", None)
            validate_core(obj)

        # Scaling the default group (what the autoscaler and KubeCluster.scale
        # do) makes the operator add worker deployments.
        group = new_class("DaskWorkerGroup", "kubernetes.dask.org/v1").get(
            f"{name}-default",
            namespace="default",
            api=kr8s.api(kubeconfig=kubeconfig),
        )
        group.patch({"spec": {"worker": {"replicas": minimum + 2}}})
        hk.wait_for(
            lambda: len(deployments("default")) == minimum + 2,
            what="two more worker deployments",
        )


@pytest.mark.timeout(90)
def test_backend_never_takes_over_an_existing_cluster(
    kube: hk.KubeAPI, kubeconfig: str
) -> None:
    """A name that exists is an error and the cluster survives, also dask-
    kubernetes' exit hook (which deletes every KubeCluster with shutdown_on_close
    set, including one that failed to start)."""
    from dask_kubernetes.operator.kubecluster import kubecluster

    from fiber_dask.backends.kubernetes import KubernetesBackend

    existing = manifests(base(name="someone-elses"))
    apply(existing, kubeconfig)
    with dask.config.set(
        {
            "fiber.backend": "kubernetes",
            "fiber.kubernetes.name": "someone-elses",
            "fiber.kubernetes.image": "example/img:1",
            "fiber.kubernetes.resource-timeout": "2s",
        }
    ):
        with pytest.raises(ClusterConnectionError, match="attach: true"):
            KubernetesBackend().start()
    kubecluster.reap_clusters()
    assert "someone-elses" in kube.names("daskclusters")

    # attach to a name that does not exist: a clear error, nothing created
    with dask.config.set(
        {
            "fiber.kubernetes.name": "nobody",
            "fiber.kubernetes.attach": True,
            "fiber.kubernetes.resource-timeout": "2s",
        }
    ):
        with pytest.raises(ClusterConnectionError, match="cannot attach"):
            KubernetesBackend().start()
    assert "nobody" not in kube.names("daskclusters")


@pytest.mark.timeout(90)
def test_backend_deletes_its_own_half_started_cluster(
    kube: hk.KubeAPI, kubeconfig: str
) -> None:
    """No operator runs here, so the new DaskCluster never gets a status and
    KubeCluster gives up after resource-timeout: the cluster fiber-dask created
    (and only that) is deleted again, not left behind."""
    from fiber_dask.backends.kubernetes import OWNER_ANNOTATION, KubernetesBackend

    with dask.config.set(
        {
            "fiber.kubernetes.name": "half-started",
            "fiber.kubernetes.image": "example/img:1",
            "fiber.kubernetes.resource-timeout": "1s",
        }
    ):
        start = time.monotonic()
        with pytest.raises(Exception, match="not actioned|operator"):  # noqa: B017
            KubernetesBackend().start()
        assert time.monotonic() - start < 30
    import kmock

    created = [
        r
        for r in kube.requests()
        if r.action == kmock.action.CREATE
        and isinstance(r.data, dict)
        and r.data.get("metadata", {}).get("name") == "half-started"
    ]
    assert created, "the backend never created the DaskCluster"
    assert OWNER_ANNOTATION in created[0].data["metadata"]["annotations"]
    hk.wait_for(
        lambda: "half-started" not in kube.names("daskclusters"),
        timeout=10,
        what="the half-started cluster to be deleted",
    )


# ------------------------------------------------------------- a live cluster


def live_config(**extra: Any) -> dict[str, Any]:
    image = os.environ.get("FIBER_DASK_TEST_IMAGE")
    if not image:
        pytest.skip("set FIBER_DASK_TEST_IMAGE to an image with this fiber-dask")
    return {
        "fiber.backend": "kubernetes",
        "fiber.kubernetes.name": "fiber-test-{uuid}",
        "fiber.kubernetes.image": image,
        "fiber.kubernetes.n-workers": 2,
        "fiber.kubernetes.resource-timeout": "5m",
        "fiber.connect-timeout": "60s",
        **extra,
    }


def _square(x: int) -> int:
    return x * x


@pytest.mark.kubernetes
@pytest.mark.timeout(900)
def test_live_pool_and_cleanup() -> None:
    import kr8s

    import fiber_dask

    with dask.config.set(live_config()):
        try:
            fiber_dask.init()
            handle = fiber_dask.cluster.get_handle()
            name, namespace = handle.cluster.name, handle.cluster.namespace
            with fiber_dask.Pool(4) as pool:
                assert pool.map(_square, range(50)) == [x * x for x in range(50)]
        finally:
            fiber_dask.shutdown()
    with pytest.raises(kr8s.NotFoundError):
        daskcluster(name, namespace=namespace)


@pytest.mark.kubernetes
@pytest.mark.timeout(900)
def test_live_attach_never_deletes() -> None:
    import kr8s

    import fiber_dask

    name = f"fiber-attach-{os.getpid()}"
    cfg = live_config(**{"fiber.kubernetes.name": name})
    with dask.config.set(cfg):
        docs = manifests()
    namespace = docs[0]["metadata"].get("namespace", kr8s.api().namespace)
    for doc in docs:
        doc["metadata"]["namespace"] = namespace
    apply(docs, None)
    try:
        with dask.config.set({**cfg, "fiber.kubernetes.attach": True}):
            fiber_dask.init()
            with fiber_dask.Pool(2) as pool:
                assert pool.map(_square, range(10)) == [x * x for x in range(10)]
            fiber_dask.shutdown()
        assert daskcluster(name, namespace=namespace).exists()
    finally:
        daskcluster(name, namespace=namespace).delete()


@pytest.mark.kubernetes
@pytest.mark.timeout(900)
def test_live_adaptive_up_and_down() -> None:
    import fiber_dask

    cfg = live_config(
        **{
            "fiber.adaptive.enabled": True,
            "fiber.adaptive.minimum": 0,
            "fiber.adaptive.maximum": 3,
            "fiber.adaptive.target-duration": "1s",
        }
    )
    with dask.config.set(cfg):
        try:
            client = fiber_dask.init()
            with fiber_dask.Pool(3) as pool:
                pool.map(time.sleep, [2] * 30)
                peak = len(client.scheduler_info(n_workers=-1)["workers"])
            assert peak == 3
            hk.wait_for(
                lambda: not client.scheduler_info(n_workers=-1)["workers"],
                timeout=300,
                what="the workers to be retired",
            )
        finally:
            fiber_dask.shutdown()


# --------------------------------------------- scale-down keeps the other groups


def test_scheduler_preload_offers_only_default_group_workers(monkeypatch) -> None:
    """With the preload the manifests give a cluster with extra groups, the
    scheduler's choice of workers to retire (what the operator's autoscaler asks
    for through /api/v1/retire_workers) never includes a GPU worker."""
    import asyncio

    from distributed import Scheduler, Worker

    from fiber_dask.backends.kubescheduler import PREFIX_ENV

    docs = manifests(profile("kubernetes-adaptive.yaml"))
    (container,) = docs[0]["spec"]["scheduler"]["spec"]["containers"]
    env = {e["name"]: e["value"] for e in container["env"]}
    prefix = f"{docs[0]['metadata']['name']}-default-worker-"
    assert env[PREFIX_ENV] == prefix
    preload = yaml.safe_load(env["DASK_DISTRIBUTED__SCHEDULER__PRELOAD"])
    monkeypatch.setenv(PREFIX_ENV, prefix)

    async def choose() -> tuple[list[str], list[str]]:
        async with Scheduler(
            host="127.0.0.1", port=0, dashboard_address=":0", preload=preload
        ) as s:
            async with (
                Worker(s.address, name=prefix + "a", nthreads=1),
                Worker(s.address, name=prefix + "b", nthreads=1),
                # joined last and idle: the scheduler's first choice otherwise
                Worker(s.address, name="gpu-worker-x", nthreads=1),
            ):
                with_plugin = [
                    s.workers_to_close(n=n, attribute="name") for n in (1, 2, 3)
                ]
                s.remove_plugin(name="fiber-dask-default-group-downscaling")
                without = s.workers_to_close(n=3, attribute="name")
                return with_plugin, without

    (one, two, three), without = asyncio.run(choose())
    # all three are idle: without the plugin any may go, the GPU worker too
    assert "gpu-worker-x" in without
    assert len(one) == 1 and one[0].startswith(prefix)
    assert sorted(two) == sorted(three) == [prefix + "a", prefix + "b"]


# ----------------------------- the backend, end to end, on emulated Kubernetes


def _worker_name(_: Any) -> str:
    # A pool task runs in a slot process beside its Dask worker, which names
    # the worker in its environment (get_worker() exists only in the worker).
    return os.environ["FIBER_DASK_WORKER_NAME"]


def _slow_square(x: int) -> int:
    time.sleep(0.25)
    return x * x


class Nodes:
    """An emulated API with the real operator, a pretend kubelet running each
    Deployment as a local `dask` process, and cluster DNS for the operator."""

    def __init__(self, kube: hk.KubeAPI, kubelet: hk.Kubelet) -> None:
        self.kube, self.kubelet = kube, kubelet
        self.messages: list[str] = []

    def deployments(self, cluster: str, group: str = "default") -> list[str]:
        prefix = f"{cluster}-{group}-worker-"
        return [d for d in self.kube.names("deployments") if d.startswith(prefix)]

    def settings(self, name: str, **extra: Any) -> dict[str, Any]:
        return {
            "fiber.backend": "kubernetes",
            "fiber.kubernetes.name": name,
            "fiber.kubernetes.image": "local/fiber-dask:test",
            # there is no port-forward to an emulated pod: a load balancer instead
            "fiber.kubernetes.scheduler-service-type": "LoadBalancer",
            "fiber.kubernetes.resource-timeout": "60s",
            **extra,
        }


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Nodes]:
    import logging

    import kr8s

    pytest.importorskip("kmock", reason="kmock (Python >= 3.11) emulates the API")
    env = {k: v for k, v in os.environ.items() if not k.startswith("DASK_")}
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO), str(REPO / "tests"), env.get("PYTHONPATH", "")]
    )
    kopf_log = logging.getLogger("kopf.objects")
    old_level = kopf_log.level

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            result.messages.append(record.getMessage())

    handler = Collect(level=logging.INFO)
    with (
        pytest.MonkeyPatch.context() as mp,
        hk.kube_api(tmp_path_factory.mktemp("nodes")) as kube,
        hk.cluster_dns(),
    ):
        mp.setenv("KUBECONFIG", kube.kubeconfig)
        kr8s.Api._instances.clear()
        kr8s.asyncio.Api._instances.clear()
        kopf_log.addHandler(handler)
        kopf_log.setLevel(logging.INFO)
        try:
            with hk.running_operator(), hk.Kubelet(kube, env) as kubelet:
                result = Nodes(kube, kubelet)
                yield result
                assert not kubelet.errors, kubelet.errors
        finally:
            kopf_log.removeHandler(handler)
            kopf_log.setLevel(old_level)
            kr8s.Api._instances.clear()
            kr8s.asyncio.Api._instances.clear()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_backend_adaptive_end_to_end(nodes: Nodes) -> None:
    """fiber_dask.init() with an adaptive profile with a GPU group: the cluster is
    created, GPU work runs on the GPU group only, Pool load makes the operator's
    autoscaler add a worker and retire it gracefully through the scheduler's HTTP
    API afterwards (never the GPU worker), and shutdown deletes the cluster."""
    import fiber_dask
    from fiber_dask.backends.kubernetes import OWNER_ANNOTATION

    name, kube = "fiber-e2e", nodes.kube
    cfg = nodes.settings(
        name,
        **{
            "fiber.kubernetes.worker-groups": [
                {"name": "gpu", "n-workers": 1, "dask-resources": {"GPU": 1}}
            ],
            "fiber.adaptive.enabled": True,
            "fiber.adaptive.minimum": 1,
            "fiber.adaptive.maximum": 2,
            "fiber.adaptive.target-duration": "1s",
        },
    )
    # The operator's 15 s cool-down after each step is lifted (hk.NoCooldown):
    # the steps are still the autoscaler's, and this waited it out once.
    with dask.config.set(cfg), hk.NoCooldown(name, kube.kubeconfig):
        try:
            client = fiber_dask.init()
            cluster = kube.get("daskclusters", name)
            assert OWNER_ANNOTATION in cluster["metadata"]["annotations"]
            assert f"{name}-gpu" in kube.names("daskworkergroups")
            # KubeCluster.adapt(minimum, maximum), called by the backend
            autoscaler = kube.get("daskautoscalers", name)
            assert autoscaler["spec"] == {"cluster": name, "minimum": 1, "maximum": 2}
            assert len(nodes.deployments(name)) == 1

            # work that asks for a GPU runs on the GPU group only
            with fiber_dask.Pool(1, resources={"GPU": 1}) as pool:
                names = set(pool.map(_worker_name, range(4)))
            assert {n.rsplit("-", 1)[0] for n in names} == {f"{name}-gpu-worker"}

            # load: the operator's autoscaler grows the default group
            with fiber_dask.Pool(3) as pool:
                assert pool.map(_slow_square, range(60), chunksize=1) == [
                    x * x for x in range(60)
                ]
                hk.wait_for(
                    lambda: len(nodes.deployments(name)) == 2,
                    timeout=30,
                    what="the autoscaler to add a worker",
                )
                gpu = nodes.deployments(name, "gpu")
            # idle: it retires one again, gracefully, never the GPU worker
            hk.wait_for(
                lambda: len(nodes.deployments(name)) == 1,
                timeout=60,
                what="the autoscaler to retire a worker",
            )
            assert nodes.deployments(name, "gpu") == gpu
            # The scheduler's list follows the deployments: wait for it (CI
            # once read it empty just after the retirement).
            hk.wait_for(
                lambda: len(client.scheduler_info(n_workers=-1)["workers"]) == 2,
                timeout=30,
                what="the scheduler to list the default and the GPU worker",
            )
        finally:
            fiber_dask.shutdown()
    hk.wait_for(
        lambda: name not in kube.names("daskclusters"),
        timeout=20,
        what="fiber_dask.shutdown() to delete the cluster",
    )
    hk.wait_for(
        lambda: not [p for p in nodes.kubelet.procs if p.startswith(name)],
        timeout=30,
        what="the pods to stop",
    )
    messages = nodes.messages
    assert any(f"{name} worker count from 1 to 2" in m for m in messages), messages
    assert any(f"{name} worker count from 2 to 1" in m for m in messages), messages
    # graceful: retired through the scheduler's HTTP API, not the LIFO fallback
    assert any(m.startswith("Retired workers") for m in messages), messages
    assert not any("LIFO" in m for m in messages), messages


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_backend_fixed_size_grows_and_attach_never_deletes(nodes: Nodes) -> None:
    """A fixed-size cluster fiber-dask created grows for Pool(processes=N); a
    cluster it attached to is neither resized nor deleted, not even by
    dask-kubernetes' exit hook."""
    from dask_kubernetes.operator.kubecluster import kubecluster

    import fiber_dask

    kube = nodes.kube
    owned = "fiber-fixed"
    with dask.config.set(nodes.settings(owned, **{"fiber.kubernetes.n-workers": 1})):
        try:
            fiber_dask.init()
            assert len(nodes.deployments(owned)) == 1
            with fiber_dask.Pool(2) as pool:
                hk.wait_for(
                    lambda: len(nodes.deployments(owned)) == 2,
                    what="Pool(2) to grow the default group to 2",
                )
                workers = set(pool.map(_worker_name, range(40), chunksize=1))
            group = kube.get("daskworkergroups", f"{owned}-default")
            assert group["spec"]["worker"]["replicas"] == 2
            assert len(workers) >= 1

            # A pod dies during a map: its chunks run again elsewhere, the map is
            # complete, and the Deployment brings the pod back.
            with fiber_dask.Pool(2) as pool:
                # 20 x 0.25 s: long enough to be mid-map at the kill (both
                # slots busy), short enough that the 18 left, run on the one
                # pod left while the other restarts, take ~4 s instead of ~9.
                result = pool.map_async(_slow_square, range(20), chunksize=1)
                hk.wait_for(
                    lambda: result.progress()[0] >= 2,
                    what="the map to have results from its pods",
                )
                victim = nodes.deployments(owned)[0]
                assert not result.ready()  # mid-map
                nodes.kubelet.kill_pod(victim)
                assert result.get(timeout=60) == [x * x for x in range(20)]
            hk.wait_for(
                lambda: nodes.kubelet.restarts.get(victim),
                what="the killed pod to be replaced",
            )

            # A pod dies under a Process: it is not restarted elsewhere, its
            # exitcode is -SIGKILL and reason says why.
            proc = fiber_dask.Process(target=time.sleep, args=(60,))
            proc.start()
            host = hk.wait_for(
                lambda: nodes.kubelet.pod_of(proc.pid), what="the process's pod"
            )
            nodes.kubelet.kill_pod(host)
            proc.join(30)
            assert proc.exitcode == -signal.SIGKILL
            assert "died" in proc.reason
        finally:
            fiber_dask.shutdown()
    hk.wait_for(
        lambda: owned not in kube.names("daskclusters"),
        timeout=20,
        what="the created cluster to be deleted",
    )

    shared = "fiber-shared"
    cfg = nodes.settings(shared, **{"fiber.kubernetes.n-workers": 1})
    with dask.config.set(cfg):
        docs = manifests()
    apply(docs, kube.kubeconfig)  # made with kubectl apply, by someone else
    try:
        hk.wait_for(
            lambda: len(nodes.deployments(shared)) == 1, what="the shared cluster"
        )
        with dask.config.set({**cfg, "fiber.kubernetes.attach": True}):
            try:
                fiber_dask.init()
                with fiber_dask.Pool(2) as pool:
                    assert pool.map(_square, range(20)) == [x * x for x in range(20)]
                # attached: not resized for the pool
                assert len(nodes.deployments(shared)) == 1
            finally:
                fiber_dask.shutdown()
        kubecluster.reap_clusters()  # what runs at exit
        time.sleep(1.0)
        assert shared in kube.names("daskclusters")
        assert f"{shared}-scheduler" in nodes.kubelet.procs
        assert len(nodes.deployments(shared)) == 1
    finally:
        daskcluster(shared, kube.kubeconfig).delete()
