"""Tests of fiber_dask.config, fiber.yaml, fiber-schema.yaml and adapters/*.yaml.

Everything here goes through Dask's real config loader: real YAML files in temporary
directories, real environment variables, ``dask.config.refresh``.  Tests that change
the environment or refresh the config use the ``dask_env`` fixture, which restores
the environment and Dask's global config afterwards.
"""

from __future__ import annotations

import copy
import os
import pathlib
import subprocess
import sys
import textwrap
from collections.abc import Iterator, Mapping
from typing import Any

import dask
import dask.config
import jsonschema
import pytest
import yaml
from support.importalone import import_alone

from fiber_dask import config, configschema

REPO = pathlib.Path(__file__).resolve().parent.parent
ADAPTERS = sorted((REPO / "adapters").glob("*.yaml"))


# ------------------------------------------------------------------------- helpers


@pytest.fixture
def dask_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """monkeypatch for environment variables; restores env and dask.config after.

    Restoring a snapshot (in place: other modules hold a reference to the dict)
    rather than calling ``dask.config.refresh()`` also keeps whatever the session had
    set in code before the test.
    """
    saved = copy.deepcopy(dask.config.config)
    try:
        yield monkeypatch
    finally:
        monkeypatch.undo()
        dask.config.config.clear()
        dask.config.config.update(saved)


def refresh_from_env() -> None:
    """Reload Dask's config as a fresh process would, from the current environment.

    ``dask.config.paths`` (the default of ``refresh``) is computed once, when dask is
    imported, so a ``DASK_CONFIG`` set afterwards is only seen when the directory is
    passed explicitly; this is what dask itself does at start-up.
    """
    paths = list(dask.config.paths)
    if "DASK_CONFIG" in os.environ and os.environ["DASK_CONFIG"] not in paths:
        paths.append(os.environ["DASK_CONFIG"])
    dask.config.refresh(paths=paths)


def write_config(directory: pathlib.Path, text: str, name: str = "fiber.yaml") -> str:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def schema_keys(node: Mapping[str, Any], prefix: str = "") -> Iterator[str]:
    """Dotted names of every key the schema describes (walks ``properties``)."""
    for name, sub in node.get("properties", {}).items():
        yield prefix + name
        yield from schema_keys(sub, prefix + name + ".")


def yaml_keys(node: Mapping[str, Any], prefix: str = "") -> Iterator[str]:
    for name, sub in node.items():
        yield prefix + name
        if isinstance(sub, Mapping):
            yield from yaml_keys(sub, prefix + name + ".")


def schema_nodes(
    node: Mapping[str, Any], prefix: str = ""
) -> Iterator[tuple[str, Any]]:
    """Every named key of the schema, also inside list items ("groups[].name") and
    inside the alternatives of an anyOf."""
    for name, sub in node.get("properties", {}).items():
        yield prefix + name, sub
        yield from schema_nodes(sub, prefix + name + ".")
        for alternative in sub.get("anyOf", []):
            yield from schema_nodes(alternative, prefix + name + ".")
        if isinstance(sub.get("items"), Mapping):
            yield from schema_nodes(sub["items"], prefix + name + "[].")


def schema_objects(node: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """Every sub-schema of type object, wherever it is (properties, items, anyOf)."""
    if isinstance(node, Mapping):
        if node.get("type") == "object":
            yield path, node
        for key, sub in node.items():
            yield from schema_objects(sub, f"{path}/{key}")
    elif isinstance(node, list):
        for i, sub in enumerate(node):
            yield from schema_objects(sub, f"{path}/{i}")


def fiber_only(collected: Mapping[str, Any]) -> dict[str, Any]:
    """The collected config merged over fiber-dask's defaults, as ``{"fiber": ...}``."""
    return dask.config.merge(copy.deepcopy(config.defaults), collected)


# --------------------------------------------------------------- defaults and schema


def test_schema_is_a_valid_draft7_schema() -> None:
    jsonschema.Draft7Validator.check_schema(config.schema())


def test_defaults_validate_against_schema() -> None:
    jsonschema.Draft7Validator(config.schema()).validate(config.defaults)
    with dask.config.set({"fiber": copy.deepcopy(config.defaults["fiber"])}):
        assert config.validate() == config.defaults["fiber"]


def test_defaults_and_schema_have_the_same_keys() -> None:
    assert list(config.defaults) == ["fiber"]
    assert set(yaml_keys(config.defaults)) == set(schema_keys(config.schema()))


def test_every_schema_key_has_a_description() -> None:
    missing = [
        key
        for key, node in schema_nodes(config.schema())
        if not isinstance(node.get("description"), str)
        or not node["description"].strip()
    ]
    assert missing == []


def test_every_schema_object_rejects_unknown_keys() -> None:
    # The root is Dask's whole config and stays open; everything under fiber is
    # closed, except maps whose keys are names the user chooses (environment
    # variables, resource names): those constrain both keys and values.
    objects = list(schema_objects(config.schema()["properties"]["fiber"]))
    assert len(objects) > 5, "the schema describes no objects?"

    def checked_map(node: Mapping[str, Any]) -> bool:
        return (
            "properties" not in node
            and isinstance(node.get("additionalProperties"), Mapping)
            and {"pattern", "format"} & set(node.get("propertyNames", {}))
        )

    open_objects = [
        path
        for path, node in objects
        if node.get("additionalProperties") is not False and not checked_map(node)
    ]
    # A whole DaskCluster resource, passed to Kubernetes as written (its CRD
    # schema, not ours, judges it).
    passthrough = ["/properties/kubernetes/properties/custom-cluster-spec/anyOf/1"]
    assert open_objects == passthrough


@pytest.mark.parametrize(
    "key, value",
    [
        ("kubernetes.env", {"NOT A NAME": "1"}),
        ("kubernetes.env", {"FLAG": True}),
        ("kubernetes.resources", {"requets": {"cpu": 1}}),
        ("kubernetes.resources", {"limits": {"memory": "lots"}}),
        ("kubernetes.dask-resources", {"GPU": -1}),
        ("kubernetes.worker-groups", [{"name": "gpu", "gpus": 1}]),
        ("kubernetes.worker-groups", [{"n-workers": 1}]),
        ("kubernetes.worker-groups", [{"name": "GPU"}]),
        ("kubernetes.scheduler-service-type", "Ingress"),
    ],
)
def test_kubernetes_maps_and_lists_are_checked(key: str, value: Any) -> None:
    with (
        dask.config.set({f"fiber.{key}": value}),
        pytest.raises(config.ConfigError, match=f"fiber.{key}"),
    ):
        config.validate()


def test_defaults_are_loaded_into_dask() -> None:
    assert dask.config.get("fiber.local.threads-per-worker") == 1
    assert config.get("local.threads-per-worker") == 1
    assert config.get("pool.chunksize") is None
    assert config.get("pool.chunksize", override=8) == 8
    # dask treats "_" and "-" alike
    assert config.get("local.threads_per_worker") == 1


def test_timedelta() -> None:
    assert config.timedelta("pool.prefetch") == pytest.approx(0.02)
    assert config.timedelta("connect-timeout") == 10.0
    assert config.timedelta("connect-timeout", override="1m") == 60.0
    assert config.timedelta("connect-timeout", override=2.5) == 2.5
    with (
        dask.config.set({"fiber.connect-timeout": "soon"}),
        pytest.raises(config.ConfigError, match="fiber.connect-timeout"),
    ):
        config.timedelta("connect-timeout")


def test_available_backends() -> None:
    names = config.available_backends()
    assert names == sorted(names)
    assert {"local", "address"} <= set(names)


def test_config_import_is_cheap() -> None:
    # config.py and what it imports, not fiber_dask/__init__.py (which is not this
    # module's business), in a fresh interpreter.
    loaded = import_alone(
        "fiber_dask.config",
        then="import dask; assert dask.config.get('fiber.local.threads-per-worker') == 1",
    )
    heavy = sorted({"distributed", "jsonschema"} & loaded)
    assert not heavy, heavy
    # The configuration sits below the cluster layer, which reads it: validation
    # asks the backend registry for names only when it runs, so config, with the
    # validation it re-exports, imports none of fiber_dask.backends.
    ours = {m for m in loaded if m.startswith("fiber_dask.")}
    assert ours == {"fiber_dask.config", "fiber_dask.configschema", "fiber_dask.errors"}


# ----------------------------------------------------------- environment variables


def test_env_var_sets_a_value(dask_env: pytest.MonkeyPatch) -> None:
    dask_env.setenv("DASK_FIBER__POOL__CHUNKSIZE", "8")
    dask.config.refresh()
    assert config.get("pool.chunksize") == 8
    assert config.validate()["pool"]["chunksize"] == 8


def test_env_var_with_underscores_reaches_hyphenated_key(
    dask_env: pytest.MonkeyPatch,
) -> None:
    dask_env.setenv("DASK_FIBER__POOL__MAX_IN_FLIGHT", "32")
    dask.config.refresh()
    assert config.get("pool.max-in-flight") == 32
    config.validate()


def test_env_var_bad_value_names_the_variable(dask_env: pytest.MonkeyPatch) -> None:
    dask_env.setenv("DASK_FIBER__LOCAL__N_WORKERS", "-3")
    dask.config.refresh()
    with pytest.raises(config.ConfigError) as info:
        config.validate()
    message = str(info.value)
    assert "fiber.local.n-workers" in message
    assert "-3" in message
    assert "minimum 1" in message
    assert "environment variable DASK_FIBER__LOCAL__N_WORKERS" in message


def test_env_var_typo_names_the_variable(dask_env: pytest.MonkeyPatch) -> None:
    dask_env.setenv("DASK_FIBER__POOL__MAX_IN_FLIGT", "4")
    dask.config.refresh()
    with pytest.raises(config.ConfigError) as info:
        config.validate()
    (problem,) = info.value.problems
    assert problem.key == "fiber.pool.max_in_fligt"
    assert "did you mean 'max-in-flight'" in problem.reason
    assert problem.source == "environment variable DASK_FIBER__POOL__MAX_IN_FLIGT"


# ---------------------------------------------------------------------- YAML files


def test_dask_config_file_is_picked_up(
    dask_env: pytest.MonkeyPatch, tmp_path: pathlib.Path
) -> None:
    write_config(tmp_path / "conf", "fiber:\n  pool:\n    chunksize: 4\n")
    dask_env.setenv("DASK_CONFIG", str(tmp_path / "conf"))
    refresh_from_env()
    assert config.get("pool.chunksize") == 4
    assert config.validate()["pool"]["chunksize"] == 4


def test_typo_in_file_names_key_suggestion_and_file(
    dask_env: pytest.MonkeyPatch, tmp_path: pathlib.Path
) -> None:
    path = write_config(tmp_path / "conf", "fiber: {pool: {chunksze: 4}}\n")
    dask_env.setenv("DASK_CONFIG", str(tmp_path / "conf"))
    refresh_from_env()
    with pytest.raises(config.ConfigError) as info:
        config.validate()
    message = str(info.value)
    assert "fiber.pool.chunksze" in message
    assert "did you mean 'chunksize'" in message
    assert path in message
    (problem,) = info.value.problems
    assert problem.key == "fiber.pool.chunksze"
    assert problem.value == 4
    assert problem.source == f"file {path}"
    assert "chunksize" in problem.allowed and "max-in-flight" in problem.allowed


def test_later_source_wins_when_naming_the_origin(
    dask_env: pytest.MonkeyPatch, tmp_path: pathlib.Path
) -> None:
    # The file says 0, the environment says -1: dask uses the environment's value,
    # and the error must blame the environment, not the file.
    write_config(tmp_path / "conf", "fiber:\n  pool:\n    allowed-failures: 0\n")
    dask_env.setenv("DASK_CONFIG", str(tmp_path / "conf"))
    dask_env.setenv("DASK_FIBER__POOL__ALLOWED_FAILURES", "-1")
    refresh_from_env()
    with pytest.raises(config.ConfigError) as info:
        config.validate()
    (problem,) = info.value.problems
    assert problem.key == "fiber.pool.allowed-failures"
    assert problem.source == "environment variable DASK_FIBER__POOL__ALLOWED_FAILURES"
    assert "minimum 0" in problem.allowed


def run_fresh(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a new interpreter whose DASK_* environment is just ``env``.

    This is the real start-up path: dask reads files and variables when it is
    imported, before fiber_dask adds its defaults.
    """
    clean = {k: v for k, v in os.environ.items() if not k.startswith("DASK_")}
    return subprocess.run(
        [sys.executable, "-c", code],
        check=False,
        cwd=REPO,
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_bad_file_fails_in_a_fresh_process(tmp_path: pathlib.Path) -> None:
    path = write_config(tmp_path / "conf", "fiber:\n  local:\n    n-workers: 0\n")
    proc = run_fresh(
        "from fiber_dask import config; config.validate()",
        DASK_CONFIG=str(tmp_path / "conf"),
    )
    assert proc.returncode != 0
    assert "ConfigError" in proc.stderr
    assert "fiber.local.n-workers = 0" in proc.stderr
    assert path in proc.stderr


def test_env_var_read_at_startup_fresh_process() -> None:
    # Read before the defaults exist, dask keeps the spelling "n_workers"; it is
    # still the key n-workers, for get() and for validate().
    code = (
        "from fiber_dask import config; "
        "assert config.get('local.n-workers') == 4; "
        "assert config.validate()['local']['n-workers'] == 4"
    )
    proc = run_fresh(code, DASK_FIBER__LOCAL__N_WORKERS="4")
    assert proc.returncode == 0, proc.stderr

    proc = run_fresh(
        "from fiber_dask import config; config.validate()",
        DASK_FIBER__LOCAL__N_WORKERS="0",
    )
    assert proc.returncode != 0
    assert "fiber.local.n-workers = 0" in proc.stderr
    assert "environment variable DASK_FIBER__LOCAL__N_WORKERS" in proc.stderr


# ------------------------------------------------------------------ bad values in code


def test_negative_n_workers() -> None:
    with (
        dask.config.set({"fiber.local.n-workers": -2}),
        pytest.raises(config.ConfigError) as info,
    ):
        config.validate()
    message = str(info.value)
    assert "fiber.local.n-workers = -2" in message
    assert "minimum 1" in message
    assert "set in code (dask.config.set)" in message
    assert isinstance(info.value, ValueError)


def test_wrong_type() -> None:
    # True is not an integer here, even though True == 1 in Python.
    with (
        dask.config.set({"fiber.local.threads-per-worker": True}),
        pytest.raises(config.ConfigError, match="threads-per-worker"),
    ):
        config.validate()


def test_unknown_backend_lists_the_available_ones() -> None:
    with (
        dask.config.set({"fiber.backend": "no-such-backend"}),
        pytest.raises(config.ConfigError) as info,
    ):
        config.validate()
    (problem,) = info.value.problems
    assert problem.key == "fiber.backend"
    assert "local" in problem.allowed and "address" in problem.allowed
    for name in config.available_backends():
        assert name in str(info.value)


@pytest.mark.parametrize("backend", [None, "local", "address"])
def test_known_backends_are_accepted(backend: str | None) -> None:
    with dask.config.set({"fiber.backend": backend}):
        assert config.validate()["backend"] == backend


@pytest.mark.parametrize("value", ["5 sec", "-1s", "soon", ".5s", True, -1])
def test_bad_duration(value: Any) -> None:
    with (
        dask.config.set({"fiber.pool.prefetch": value}),
        pytest.raises(config.ConfigError) as info,
    ):
        config.validate()
    (problem,) = info.value.problems
    assert problem.key == "fiber.pool.prefetch"
    assert "20ms" in problem.allowed  # the examples


@pytest.mark.parametrize("value", ["5s", "20ms", "1.5 m", "2 minutes", "10", 0, 0.5])
def test_good_duration(value: Any) -> None:
    with dask.config.set({"fiber.adaptive.interval": value}):
        config.validate()
        assert config.timedelta("adaptive.interval") >= 0


@pytest.mark.parametrize(
    "value",
    ["auto", "4GiB", "4G", "4Gi", "4 gb", "500 MB", "1e9", 0, 0.5, 4_000_000_000, None],
)
def test_good_memory_limit(value: Any) -> None:
    """What distributed's own parser (parse_memory_limit) accepts."""
    import logging

    from distributed.worker_memory import parse_memory_limit

    # distributed accepts it (raises otherwise) ...
    parse_memory_limit(value, nthreads=1, total_cores=1, logger=logging.getLogger())
    # ... and so does fiber-dask
    with dask.config.set({"fiber.local.memory-limit": value}):
        config.validate()


@pytest.mark.parametrize("value", ["lots", "-1G", "4 XB", "", True])
def test_bad_memory_limit(value: Any) -> None:
    with (
        dask.config.set({"fiber.local.memory-limit": value}),
        pytest.raises(config.ConfigError) as info,
    ):
        config.validate()
    (problem,) = info.value.problems
    assert problem.key == "fiber.local.memory-limit"
    assert "parse_bytes" in problem.allowed and "'4Gi'" in problem.allowed


def _schema_strings(node: Any) -> Iterator[str]:
    if isinstance(node, Mapping):
        for value in node.values():
            yield from _schema_strings(value)
    elif isinstance(node, list):
        for value in node:
            yield from _schema_strings(value)
    elif isinstance(node, str):
        yield node


@pytest.mark.parametrize(
    "key, value",
    [
        ("pool.prefetch", "soon"),
        ("local.memory-limit", "lots"),
        ("kubernetes.env", {"NOT A NAME": "1"}),
        ("kubernetes.resources", {"limits": {"memory": "lots"}}),
        ("kubernetes.resources", {"limits": {"no such/name/x": "1"}}),
        ("kubernetes.dask-resources", {"G PU": 1}),
        ("kubernetes.worker-groups", [{"name": "GPU"}]),
        ("run.swap-modules", ["a.b"]),
    ],
)
def test_messages_show_no_regular_expression(key: str, value: Any) -> None:
    """Formats are described in words; nothing like '^[a-z]...$' reaches a user."""
    with (
        dask.config.set({f"fiber.{key}": value}),
        pytest.raises(config.ConfigError) as info,
    ):
        config.validate()
    message = str(info.value)
    for regex in ("^", "$'", "[a-z", "\\d", "(?"):
        assert regex not in message, message
    assert "anything" not in message  # every rejected value says what is allowed
    for problem in info.value.problems:
        assert problem.allowed and problem.reason


def test_schema_uses_no_patterns() -> None:
    """Syntax is checked by the named formats of configschema.py, which say in words
    what they accept, and durations and sizes by Dask's own parsers."""
    fiber = config.schema()["properties"]["fiber"]
    assert not [
        s for s in _schema_strings(fiber) if s.startswith("^") and s.endswith("$")
    ]
    formats = set()

    def walk(node: Any) -> None:
        if isinstance(node, Mapping):
            if "format" in node:
                formats.add(node["format"])
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(fiber)
    known = set(configschema._FORMATS)
    assert formats <= known, formats - known
    assert {"dask-timedelta", "dask-memory-limit"} <= formats


def test_durations_agree_with_dask() -> None:
    """Every duration Dask's parser reads as >= 0 is accepted, except a leading
    '.', which Dask misreads ('.5s' is 1.5 s)."""
    from dask.utils import parse_timedelta

    for text in ["5s", "5S", "1e3s", "1 hour", "3 days", "2w", "10", "100us", "1.5h"]:
        assert parse_timedelta(text) >= 0
        with dask.config.set({"fiber.adaptive.interval": text}):
            config.validate()
    with (
        dask.config.set({"fiber.adaptive.interval": ".5s"}),
        pytest.raises(config.ConfigError, match="write '0.5s'"),
    ):
        config.validate()
    with (
        dask.config.set({"fiber.adaptive.interval": "5 sec"}),
        pytest.raises(config.ConfigError, match="unknown unit 'sec'"),
    ):
        config.validate()


# ---------------------------------------------------------- misspelt sections


@pytest.mark.parametrize(
    "key, guess",
    [
        ("fibre", "fiber"),
        ("fiber-dask", "fiber"),
        ("fiber_dask", "fiber"),
        ("Fiber", "fiber"),
        ("pool", "fiber.pool"),
        ("adaptve", "fiber.adaptive"),
        ("local", "fiber.local"),
    ],
)
def test_near_misses_of_the_fiber_section(key: str, guess: str) -> None:
    (problem,) = config.near_misses({key: {"x": 1}, "fiber": {}})
    assert problem.key == key
    assert f"did you mean '{guess}'?" in problem.reason


def test_dask_namespaces_are_not_near_misses() -> None:
    data = {
        name: {}
        for name in ["kubernetes", "distributed", "jobqueue", "array", "logging"]
    }
    data.update({"scheduler-address": "tcp://x:1", "myapp": {"pool": 1}})
    assert config.near_misses(data) == []


def test_a_near_miss_in_the_config_warns_once(
    dask_env: pytest.MonkeyPatch, tmp_path: pathlib.Path
) -> None:
    path = write_config(tmp_path / "conf", "fibre:\n  pool:\n    chunksize: 4\n")
    dask_env.setenv("DASK_CONFIG", str(tmp_path / "conf"))
    dask_env.setattr(configschema, "_warned", set())
    dask_env.setattr(configschema, "_last_valid", None)
    refresh_from_env()
    with pytest.warns(UserWarning, match="did you mean 'fiber'") as record:
        config.validate()
    assert path in str(record[0].message)
    with dask.config.set({"fiber.pool.chunksize": 3}):
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("error")
            config.validate()  # warned already


def test_adaptive_maximum_below_minimum() -> None:
    with (
        dask.config.set({"fiber.adaptive.minimum": 4, "fiber.adaptive.maximum": 2}),
        pytest.raises(config.ConfigError, match="fiber.adaptive.maximum = 2"),
    ):
        config.validate()


def test_all_problems_are_reported() -> None:
    with (
        dask.config.set(
            {"fiber.local.n-workers": 0, "fiber.pool.chunksze": 4, "fiber.backend": "x"}
        ),
        pytest.raises(config.ConfigError) as info,
    ):
        config.validate()
    keys = {p.key for p in info.value.problems}
    assert keys == {"fiber.local.n-workers", "fiber.pool.chunksze", "fiber.backend"}
    assert "3 problems" in str(info.value)


def test_validate_caches_but_sees_every_change() -> None:
    with dask.config.set({"fiber.local.threads-per-worker": 1}):
        first = config.validate()
        first["local"]["threads-per-worker"] = 99  # the caller's copy, not the cache
        assert config.validate()["local"]["threads-per-worker"] == 1
    # equal to the cached valid state under ==, but a different value
    with (
        dask.config.set({"fiber.local.threads-per-worker": True}),
        pytest.raises(config.ConfigError),
    ):
        config.validate()
    with (
        dask.config.set({"fiber.local.threads-per-worker": 0}),
        pytest.raises(config.ConfigError),
    ):
        config.validate()
    config.validate()


# ------------------------------------------------------------------------- adapters


def test_there_are_adapters() -> None:
    names = {p.name for p in ADAPTERS}
    assert {
        "local.yaml",
        "local-adaptive.yaml",
        "existing-cluster.yaml",
        "kubernetes.yaml",
        "kubernetes-adaptive.yaml",
    } <= names


@pytest.mark.parametrize("path", ADAPTERS, ids=lambda p: p.name)
def test_adapter_is_valid(path: pathlib.Path) -> None:
    collected = dask.config.collect(paths=[str(path)], env={})
    assert "fiber" in collected, f"{path.name} sets nothing under fiber:"
    merged = fiber_only(collected)
    with dask.config.set({"fiber": merged["fiber"]}):
        checked = config.validate(extra_paths=[path])
    # every key the adapter spells out survives the merge unchanged
    for key in yaml_keys(collected["fiber"]):
        value = dask.config.get(key, config=collected["fiber"])
        if not isinstance(value, Mapping):
            assert dask.config.get(key, config=checked) == value


def test_adapter_files_are_commented() -> None:
    for path in ADAPTERS:
        assert path.read_text().lstrip().startswith("#"), path.name
    assert (REPO / "adapters" / "README.md").exists()
    readme = (REPO / "adapters" / "README.md").read_text()
    for path in ADAPTERS:
        assert path.name in readme, f"adapters/README.md does not mention {path.name}"


def test_existing_cluster_adapter_selects_address_backend() -> None:
    collected = dask.config.collect(
        paths=[str(REPO / "adapters" / "existing-cluster.yaml")], env={}
    )
    assert collected["fiber"]["backend"] == "address"
    assert collected["fiber"]["address"].startswith("tcp://")


def test_adapter_yaml_is_plain_yaml() -> None:
    for path in ADAPTERS:
        assert isinstance(yaml.safe_load(path.read_text()), dict), path.name


def test_dask_logging_config_sets_fiber_dasks_level() -> None:
    """What the README says: DASK_LOGGING__FIBER_DASK=debug shows fiber-dask's
    debug messages (Dask's logging config, applied when distributed is imported)."""
    code = (
        "import logging, fiber_dask, distributed\n"
        "logging.getLogger('fiber_dask.pool').debug('probe-debug-message')\n"
        "logging.getLogger('fiber_dask.pool').info('probe-info-message')\n"
    )
    on = run_fresh(code, DASK_LOGGING__FIBER_DASK="debug")
    assert on.returncode == 0, on.stderr
    assert "fiber_dask.pool - DEBUG - probe-debug-message" in on.stderr
    off = run_fresh(code)
    assert off.returncode == 0, off.stderr
    assert "probe-debug-message" not in off.stderr


def test_the_shipped_defaults_are_not_checked_again_at_first_use() -> None:
    """Validating an untouched configuration imports no jsonschema (it is the
    shipped defaults, which the test above checks); one set value is checked."""
    code = (
        "import os, sys\n"
        "from fiber_dask import config\n"
        "config.validate()\n"
        "print('jsonschema' in sys.modules)\n"
        "os.environ['DASK_FIBER__LOCAL__N_WORKERS'] = '0'\n"
        "import dask; dask.config.refresh()\n"
        "try:\n"
        "    config.validate()\n"
        "except config.ConfigError as e:\n"
        "    print('fiber.local.n-workers' in str(e))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("DASK_")}
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "True"], out.stdout + out.stderr
