"""The ``fiber`` namespace's definition, and the checks of Dask's config against it.

Two files define the namespace: ``fiber.yaml`` (every key's default, loaded here
as :data:`defaults`) and ``fiber-schema.yaml`` (every key's type, limits and
meaning, :func:`schema`).  This module checks the live configuration against
them (:func:`validate`, :func:`near_misses`) and says in words what is wrong,
what is allowed and where each value came from (:class:`~fiber_dask.errors.Problem`,
:func:`describe_schema`, :func:`sources`, :func:`find_source`).

:mod:`fiber_dask.config` registers the defaults with Dask, reads values and
re-exports this module's API (``fiber_dask.config.validate`` is this
:func:`validate`); it imports this module, never the reverse, so this module
imports nothing of fiber_dask but :mod:`fiber_dask.errors` and, when
:func:`available_backends` first runs, the leaf backend registry.  ``jsonschema``
is imported the first time :func:`validate` runs, not on ``import fiber_dask``.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from functools import cache, partial
from typing import TYPE_CHECKING, Any

import dask.config
import yaml

from .errors import ConfigError, Problem

if TYPE_CHECKING:
    import jsonschema

__all__ = [
    "DEFAULTS_PATH",
    "SCHEMA_PATH",
    "ConfigError",
    "Problem",
    "available_backends",
    "defaults",
    "describe_problems",
    "describe_schema",
    "find_source",
    "load_yaml",
    "make_problem",
    "near_misses",
    "schema",
    "sources",
    "validate",
]

_HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULTS_PATH = os.path.join(_HERE, "fiber.yaml")
SCHEMA_PATH = os.path.join(_HERE, "fiber-schema.yaml")


def load_yaml(stream: Any) -> Any:
    """``yaml.safe_load`` with libyaml's parser where PyYAML has it: the same
    result, ~10x faster (40 -> 5 ms for distributed.yaml), which counts in
    every process that starts a cluster or imports fiber_dask."""
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    return yaml.load(stream, Loader=loader)  # noqa: S506 - a safe loader


with open(DEFAULTS_PATH) as _f:
    #: The defaults as loaded from fiber.yaml (``{"fiber": {...}}``); do not mutate.
    #: :mod:`fiber_dask.config` hands a copy to Dask.
    defaults: dict[str, Any] = load_yaml(_f)


@cache
def schema() -> dict[str, Any]:
    """Return the JSON Schema of the ``fiber`` namespace (``fiber-schema.yaml``).

    The dict is loaded once and shared; do not mutate it.

    Returns
    -------
    dict
        The schema, whose ``properties.fiber`` describes every key.
    """
    with open(SCHEMA_PATH) as f:
        return load_yaml(f)


@cache
def _validator() -> jsonschema.Draft7Validator:
    # Imported here, not at module top, so that ``import fiber_dask`` stays cheap.
    import jsonschema

    checker = jsonschema.FormatChecker(formats=())
    for name, (check, _) in _FORMATS.items():
        checker.checks(name)(partial(_format_ok, check))
    return jsonschema.Draft7Validator(schema(), format_checker=checker)


# ---------------------------------------------------------------------- formats
#
# Strings with a syntax are checked by a named ``format`` in fiber-schema.yaml, here
# with Dask's own parsers where Dask reads the value (so that what distributed
# accepts, fiber-dask accepts), and described in words: no message shows a regular
# expression.  Each check returns None for a good value, else why it is not.


def _check_timedelta(value: str) -> str | None:
    from dask.utils import parse_timedelta

    text = value.strip()
    if text.startswith("."):
        # dask.utils.parse_timedelta reads ".5s" as 1.5 s
        return f"{value!r} starts with '.', which dask misreads; write '0{text}'"
    try:
        seconds = parse_timedelta(text, default="seconds")
    except KeyError:
        unit = text.lstrip("0123456789.+-eE ")
        return f"{value!r} is not a duration: unknown unit {unit!r}"
    except (ValueError, TypeError, IndexError):
        return f"{value!r} is not a duration"
    if seconds is None or seconds < 0:
        return f"{value!r} is not a non-negative duration"
    return None


def _check_memory_limit(value: str) -> str | None:
    from dask.utils import parse_bytes

    if value.strip() == "auto":
        return None
    if not value.strip():
        return "must not be empty (parse_bytes would read it as 1 byte)"
    try:
        size = parse_bytes(value)
    except (ValueError, TypeError, IndexError):
        return f"{value!r} is not a byte size"
    if size < 0:
        return f"{value!r} is negative"
    return None


def _regex_check(pattern: str, what: str) -> Callable[[str], str | None]:
    import re

    compiled = re.compile(pattern)

    def check(value: str) -> str | None:
        return None if compiled.fullmatch(value) else f"{value!r} is not {what}"

    return check


# format name -> (check, what it accepts, in words)
_FORMATS: dict[str, tuple[Callable[[str], str | None], str]] = {
    "dask-timedelta": (
        _check_timedelta,
        "a duration as dask.utils.parse_timedelta reads it (units ns, us, ms, s, "
        "m, h, d, w, or spelled out: '2 minutes')",
    ),
    "dask-memory-limit": (
        _check_memory_limit,
        "'auto' or a byte size as dask.utils.parse_bytes reads it ('4G', '4Gi', "
        "'500 MB')",
    ),
    "kubernetes-quantity": (
        _regex_check(
            r"[+]?[0-9.]+([eE][-+]?[0-9]+|[munkMGTPE]|[KMGTPE]i)?",
            "a Kubernetes quantity",
        ),
        "a Kubernetes quantity, e.g. '500m', '2', '4Gi', '1.5G'",
    ),
    "kubernetes-resource-name": (
        _regex_check(
            r"([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?",
            "a Kubernetes resource name",
        ),
        "a Kubernetes resource name, e.g. cpu, memory, ephemeral-storage, "
        "nvidia.com/gpu",
    ),
    "kubernetes-name": (
        _regex_check(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", "a Kubernetes name"),
        "lower-case letters, digits and '-', starting and ending with a letter or "
        "digit, e.g. gpu, big-memory",
    ),
    "environment-variable-name": (
        _regex_check(r"[-._a-zA-Z][-._a-zA-Z0-9]*", "an environment variable name"),
        "an environment variable name: letters, digits, '_', '-' and '.', not "
        "starting with a digit, e.g. OMP_NUM_THREADS",
    ),
    "dask-resource-name": (
        _regex_check(r"[A-Za-z0-9_.-]+", "a Dask resource name"),
        "a Dask resource name: letters, digits, '_', '.' and '-', e.g. GPU, MEMORY",
    ),
    "module-name": (
        _regex_check(r"[A-Za-z_][A-Za-z0-9_]*", "a top-level module name"),
        "a top-level module name (letters, digits and '_', no dots), e.g. mypkg",
    ),
}


def _format_ok(check: Callable[[str], str | None], value: Any) -> bool:
    # A format applies to strings only; other types are the `type` keyword's job.
    return not isinstance(value, str) or check(value) is None


def available_backends() -> list[str]:
    """Return the names usable as ``fiber.backend``, sorted.

    These are the built-in ``local`` and ``address`` plus every name registered in
    the ``fiber_dask.backends`` entry-point group by an installed distribution.

    Returns
    -------
    list of str

    Examples
    --------
    >>> from fiber_dask import config
    >>> {"address", "local"} <= set(config.available_backends())
    True
    """
    # The one registry; a leaf, it imports nothing of fiber_dask.  Imported here, not
    # at the top: it comes with its package (the cluster layer), which
    # ``import fiber_dask.config`` does not load.
    from .backends.registry import available_backends as registered

    return registered()


# The last configuration that passed validation, frozen (see _freeze) and as a copy.
# validate() runs on every Pool creation, so a repeat of a known-good state costs one
# walk of a small dict instead of a schema validation and an entry-point scan.
_last_valid: tuple[Any, dict[str, Any]] | None = None


def validate(*, extra_paths: Iterable[str | os.PathLike[str]] = ()) -> dict[str, Any]:
    """Check the current ``fiber`` configuration and return it.

    The configuration is checked against ``fiber-schema.yaml`` (types, minimums,
    duration patterns, no unknown keys) and ``fiber.backend`` against
    :func:`available_backends`.  A configuration equal to the last valid one is not
    checked again.

    Parameters
    ----------
    extra_paths : iterable of path-like, optional
        Further YAML files or directories to search when naming where a bad value
        came from, for configuration loaded from places other than
        ``dask.config.paths`` and ``$DASK_CONFIG`` (e.g. a ``--config FILE`` option).

    Returns
    -------
    dict
        A copy of ``dask.config.get("fiber")``.

    Raises
    ------
    ConfigError
        Listing every problem, most relevant first, each with the dotted key, the
        value, what is allowed and its source: an environment variable, a YAML file,
        or code (``dask.config.set``).

    Examples
    --------
    >>> import dask
    >>> from fiber_dask import config
    >>> config.validate()["local"]["threads-per-worker"]
    1
    >>> with dask.config.set({"fiber.local.n-workers": 0}):
    ...     config.validate()  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    fiber_dask.errors.ConfigError: Invalid fiber-dask configuration (1 problem):
    ...
    """
    global _last_valid

    current = dask.config.get("fiber", default=None)
    frozen = _freeze(current)
    last = _last_valid
    if last is not None and last[0] == frozen:
        return copy.deepcopy(last[1])
    if last is None and frozen == _freeze(defaults["fiber"]):
        # Nothing set: the shipped defaults, valid by construction (a test
        # validates them), need no schema check and no jsonschema import
        # (50-120 ms of a program's first Pool() here).  A misspelt
        # ``fiber`` section is still warned about.
        _warn_near_misses(extra_paths)
        _last_valid = (frozen, copy.deepcopy(current))
        return copy.deepcopy(current)

    # dask treats "n_workers" and "n-workers" as one key and keeps whichever spelling
    # it saw first, so an environment variable read when dask was imported (before
    # these defaults were added) leaves "n_workers" in the config.  Validate and
    # return the schema's spelling.
    current = _canonicalize(current, schema()["properties"]["fiber"])
    problems = _collect_problems(current, [os.fspath(p) for p in extra_paths])
    _warn_near_misses(extra_paths)
    if problems:
        footer = f"Every key and its meaning: {SCHEMA_PATH}"
        raise ConfigError(f"{describe_problems(problems)}\n\n{footer}", problems)

    snapshot = copy.deepcopy(current)
    _last_valid = (frozen, snapshot)
    return copy.deepcopy(snapshot)


# Top-level namespaces of Dask and its ecosystem: never a misspelt ``fiber`` section,
# whatever they look like (dask-kubernetes' own ``kubernetes:`` above all).
_DASK_NAMESPACES = frozenset(
    {
        "admin", "array", "coiled", "cloudprovider", "dask", "dataframe",
        "distributed", "gateway", "jobqueue", "jupyter", "kubernetes",
        "labextension", "local_directory", "logging", "optimization", "rmm",
        "scheduler", "scheduler-address", "shuffle", "temporary-directory",
        "tokenize", "ucx", "visualization", "yarn",
    }
)  # fmt: skip


def near_misses(
    data: Mapping[str, Any] | None = None,
    *,
    extra_paths: Iterable[str | os.PathLike[str]] = (),
) -> list[Problem]:
    """Top-level keys that look like a misspelt or misplaced ``fiber`` section.

    ``fibre:`` (or ``fiber-dask:``) instead of ``fiber:``, or a section of fiber's
    (``pool:``, ``local:``) written at the top level instead of under ``fiber:``:
    Dask keeps such keys without complaint and fiber-dask never reads them.

    Parameters
    ----------
    data : mapping, optional
        A config file's contents, or by default Dask's whole current config.
    extra_paths : iterable of path-like, optional
        Further YAML files to search when naming where a key came from.

    Returns
    -------
    list of Problem
        One per suspicious key (none for Dask's own namespaces, such as
        dask-kubernetes' ``kubernetes``).

    Examples
    --------
    >>> from fiber_dask import config
    >>> [p.reason for p in config.near_misses({"fibre": {"pool": {}}})]
    ["unknown top-level section; did you mean 'fiber'?"]
    """
    import difflib

    data = dask.config.config if data is None else data
    known = set(_DASK_NAMESPACES)
    for defaults_ in dask.config.defaults:
        known.update(_norm(str(k)) for k in defaults_)
    known.discard("fiber")  # ours is among Dask's defaults; "Fiber" is a miss
    sections = sorted(schema()["properties"]["fiber"]["properties"])
    section_objects = [
        name
        for name in sections
        if schema()["properties"]["fiber"]["properties"][name].get("type") == "object"
    ]
    paths = [os.fspath(p) for p in extra_paths]
    found: list[Problem] = []
    for key, value in data.items():
        if key == "fiber":
            continue
        # Dask's keys are case-sensitive ("Fiber:" is not read), "-" and "_" alike.
        name = _norm(str(key)).lower()
        if name in known:
            continue
        if name.startswith("fiber") or difflib.get_close_matches(
            name, ["fiber"], n=1, cutoff=0.75
        ):
            reason = "unknown top-level section; did you mean 'fiber'?"
        else:
            guess = difflib.get_close_matches(name, section_objects, n=1, cutoff=0.8)
            if not guess:
                continue
            reason = (
                f"unknown top-level section; did you mean 'fiber.{guess[0]}'? "
                "fiber-dask reads its settings only under 'fiber:'"
            )
        allowed = "fiber: with the keys " + ", ".join(sections)
        source = find_source([str(key)], value, paths)
        found.append(Problem(str(key), value, reason, allowed, source))
    return found


_warned: set[str] = set()


def _warn_near_misses(extra_paths: Iterable[str | os.PathLike[str]]) -> None:
    """Warn once per process about each key :func:`near_misses` finds.

    A warning, not an error: the top level of Dask's config is shared with other
    libraries, and a key that merely looks like ours must not stop a program.
    """
    import warnings

    for p in near_misses(extra_paths=extra_paths):
        if p.key not in _warned:
            _warned.add(p.key)
            warnings.warn(
                f"Dask config key {p.key!r} ({p.source}): {p.reason}; it is ignored",
                UserWarning,
                stacklevel=3,
            )


def describe_problems(problems: Sequence[Problem]) -> str:
    """The message of a :class:`ConfigError`: a count, then every problem."""
    n = len(problems)
    header = f"Invalid fiber-dask configuration ({n} problem{'s' * (n != 1)}):"
    body = "\n\n".join(str(p) for p in problems)
    return f"{header}\n\n{body}"


def make_problem(
    parts: list[str],
    value: Any,
    reason: str,
    allowed: str,
    extra_paths: Sequence[str] = (),
) -> Problem:
    """A :class:`Problem` for the key ``parts``, naming where ``value`` came from."""
    source = find_source(parts, value, extra_paths)
    return Problem(".".join(parts), value, reason, allowed, source)


def _collect_problems(current: Any, extra_paths: list[str]) -> list[Problem]:
    from jsonschema.exceptions import relevance

    problem = partial(make_problem, extra_paths=extra_paths)

    if current is None:
        # Only possible if someone refreshed Dask's config without our defaults.
        return [
            problem(
                ["fiber"],
                None,
                "the fiber section is missing from Dask's config",
                describe_schema(schema()["properties"]["fiber"]),
            )
        ]

    problems: list[Problem] = []
    seen: set[str] = set()
    errors = sorted(
        _validator().iter_errors({"fiber": current}), key=relevance, reverse=True
    )
    for error in errors:
        parts = [str(p) for p in error.absolute_path]
        if error.validator == "additionalProperties":
            # One jsonschema error for the object; one problem per unknown key.
            known = sorted(error.schema.get("properties", {}))
            for name in error.instance:
                if name in known:
                    continue
                reason = "unknown key"
                guess = _did_you_mean(str(name), known)
                if guess:
                    reason += f"; did you mean {guess!r}?"
                key_parts = [*parts, str(name)]
                if ".".join(key_parts) not in seen:
                    seen.add(".".join(key_parts))
                    allowed = f"the keys {', '.join(known)}"
                    value = error.instance[name]
                    problems.append(problem(key_parts, value, reason, allowed))
            continue
        key = ".".join(parts)
        if key in seen:  # e.g. both `type` and `minimum` failed: report the key once
            continue
        seen.add(key)
        problems.append(
            problem(
                parts, error.instance, _reason(error), describe_schema(error.schema)
            )
        )

    # Checks a JSON Schema cannot express.  They read values only where the schema
    # found no problem, so a value already reported is not reported twice.
    backend = current.get("backend") if isinstance(current, Mapping) else None
    if isinstance(backend, str) and "fiber.backend" not in seen:
        names = available_backends()
        if backend not in names:
            reason = "unknown backend"
            guess = _did_you_mean(backend, names)
            if guess:
                reason += f"; did you mean {guess!r}?"
            allowed = (
                f"null (automatic) or an installed backend: {', '.join(names)} "
                "(plugins register more in the entry-point group fiber_dask.backends)"
            )
            problems.append(problem(["fiber", "backend"], backend, reason, allowed))

    adaptive = current.get("adaptive") if isinstance(current, Mapping) else None
    if isinstance(adaptive, Mapping) and not seen & {
        "fiber.adaptive.minimum",
        "fiber.adaptive.maximum",
    }:
        low, high = adaptive.get("minimum"), adaptive.get("maximum")
        if isinstance(low, int) and isinstance(high, int) and high < low:
            problems.append(
                problem(
                    ["fiber", "adaptive", "maximum"],
                    high,
                    f"is below fiber.adaptive.minimum = {low}",
                    f"an integer >= fiber.adaptive.minimum ({low}), or null",
                )
            )
    return problems


def _canonicalize(data: Any, node: Mapping[str, Any]) -> Any:
    """Copy ``data`` with keys respelt as in the schema ("n_workers" -> "n-workers").

    A key whose schema spelling is also present is left alone (and then reported as
    unknown): dask reads the schema spelling in that case, so the other is ignored.
    """
    properties = node.get("properties")
    if not isinstance(data, Mapping) or not properties:
        return data
    result: dict[Any, Any] = {}
    for key, value in data.items():
        name = key
        if isinstance(key, str) and key not in properties:
            respelt = key.replace("_", "-")
            if respelt in properties and respelt not in data:
                name = respelt
        result[name] = _canonicalize(value, properties.get(name, {}))
    return result


def _did_you_mean(name: str, candidates: Sequence[str]) -> str | None:
    import difflib

    # Dask treats "-" and "_" alike (DASK_FIBER__POOL__MAX_IN_FLIGHT), so compare in
    # one spelling; case does not matter in environment variable names either.
    def norm(s: str) -> str:
        return s.lower().replace("_", "-")

    by_norm = {norm(c): c for c in candidates}
    match = difflib.get_close_matches(norm(name), list(by_norm), n=1, cutoff=0.6)
    return by_norm[match[0]] if match else None


_TYPE_WORDS = {
    "integer": "an integer",
    "number": "a number",
    "string": "a string",
    "boolean": "true or false",
    "null": "null",
    "object": "a mapping",
    "array": "a list",
}


def describe_schema(s: Mapping[str, Any]) -> str:
    """Say in words what a (sub)schema accepts: 'an integer (minimum 1) or null'."""
    if "anyOf" in s or "oneOf" in s:
        text = " or ".join(
            describe_schema(sub) for sub in s.get("anyOf", s.get("oneOf"))
        )
    elif "enum" in s:
        text = "one of " + ", ".join(repr(v) for v in s["enum"])
    elif "const" in s:
        text = repr(s["const"])
    else:
        types = s.get("type", [])
        if not types and s.get("format") in _FORMATS:
            types = ["string"]  # e.g. propertyNames: a key is a string
        words = []
        for t in [types] if isinstance(types, str) else types:
            word = _TYPE_WORDS.get(t, t)
            if t in ("integer", "number") and "minimum" in s:
                word += f" (minimum {s['minimum']})"
            if t == "string" and s.get("minLength"):
                word = "a non-empty string"
            if t == "string" and s.get("format") in _FORMATS:
                word = _FORMATS[s["format"]][1]
            elif t == "string" and "pattern" in s:
                # Never a raw regular expression in a message: the description
                # of the key says what the format is.
                word += " in the format the key's description gives"
            if t == "object" and "properties" in s:
                word += f" with the keys {', '.join(sorted(s['properties']))}"
            words.append(word)
        text = " or ".join(words) or "anything"
    if s.get("examples"):
        text += f" (e.g. {', '.join(repr(e) for e in s['examples'])})"
    return text


def _reason(error: jsonschema.ValidationError) -> str:
    """Say in words why a value failed, independent of jsonschema's wording."""
    kind, limit, value = error.validator, error.validator_value, error.instance
    if kind == "type":
        return f"wrong type: {type(value).__name__}"
    if kind == "minimum":
        return f"{value!r} is below the minimum {limit}"
    if kind == "exclusiveMinimum":
        return f"{value!r} is not above {limit}"
    if kind == "format" and limit in _FORMATS and isinstance(value, str):
        return _FORMATS[limit][0](value) or f"{value!r} is not in the expected format"
    if kind == "pattern":
        return f"{value!r} is not in the expected format"
    if kind == "minLength":
        return "must not be empty"
    if kind in ("enum", "const"):
        return f"{value!r} is not an allowed value"
    if kind in ("anyOf", "oneOf") and error.context:
        # Explain with the alternative whose type matched (the string branch for a
        # bad duration string), not with "is not of type 'number'".
        typed = [e for e in error.context if e.validator != "type"]
        if typed:
            return _reason(typed[0])
        return f"wrong type: {type(value).__name__}"
    return error.message


# --------------------------------------------------------------- where values come from


def sources(
    *, extra_paths: Iterable[str | os.PathLike[str]] = ()
) -> list[tuple[str, Any, str]]:
    """Every setting of the current ``fiber`` configuration and where it came from.

    Parameters
    ----------
    extra_paths : iterable of path-like, optional
        Further YAML files or directories the configuration was loaded from (e.g. a
        ``--config FILE`` option), as for :func:`validate`.

    Returns
    -------
    list of (key, value, source)
        One entry per leaf of the schema (a mapping the schema does not describe
        key by key, such as ``kubernetes.env``, is one value), in config order.
        ``source`` is ``"default"``, ``"environment variable DASK_FIBER__..."``,
        ``"file /path/to.yaml"``, the inherited parent config, or
        ``"set in code (dask.config.set)"``.

    Examples
    --------
    >>> from fiber_dask import config
    >>> dict((k, s) for k, _, s in config.sources())["fiber.pool.prefetch"]
    'default'
    """
    fiber_schema = schema()["properties"]["fiber"]
    current = _canonicalize(dask.config.get("fiber", default={}), fiber_schema)
    paths = [os.fspath(p) for p in extra_paths]
    found: list[tuple[str, Any, str]] = []

    def walk(data: Any, node: Mapping[str, Any], parts: list[str]) -> None:
        properties = node.get("properties")
        if isinstance(data, Mapping) and properties:
            for key, value in data.items():
                walk(value, properties.get(key, {}), [*parts, str(key)])
        else:
            found.append((".".join(parts), data, find_source(parts, data, paths)))

    walk(current, fiber_schema, ["fiber"])
    return found


def find_source(parts: list[str], value: Any, extra_paths: Sequence[str]) -> str:
    """Name where ``value`` at ``parts`` came from, checking sources by priority.

    A source "matches" when it sets the key to this very value; a value set in code
    over another source's different value is thus reported as set in code.
    """
    want = _freeze(value)

    # 1. Environment variables, DASK_FIBER__LOCAL__N_WORKERS -> fiber.local.n-workers,
    #    including one that sets a whole section, e.g. DASK_FIBER__POOL="{...}".
    target = [_norm(p) for p in parts]
    for name, raw in os.environ.items():
        if not name.startswith("DASK_") or name == "DASK_INTERNAL_INHERIT_CONFIG":
            continue
        env_parts = [_norm(p) for p in name[5:].lower().replace("__", ".").split(".")]
        if target[: len(env_parts)] != env_parts:
            continue
        found, sub = _walk(dask.config.interpret_value(raw), parts[len(env_parts) :])
        if found and _freeze(sub) == want:
            return f"environment variable {name}"

    # 2. Config inherited from a parent process (how distributed passes config on).
    inherited = os.environ.get("DASK_INTERNAL_INHERIT_CONFIG")
    if inherited:
        try:
            found, sub = _walk(dask.config.deserialize(inherited), parts)
        except Exception:  # noqa: BLE001 - a bad blob just is not the source
            found = False
        if found and _freeze(sub) == want:
            return (
                "config inherited from the parent process "
                "(DASK_INTERNAL_INHERIT_CONFIG)"
            )

    # 3. YAML files; dask lets a later file win, so look from the last one back.
    for path, data in reversed(list(_config_files(extra_paths))):
        found, sub = _walk(data, parts)
        if found and _freeze(sub) == want:
            return f"file {path}"

    # 4. fiber-dask's own defaults (fiber.yaml), when nothing above set the key.
    found, sub = _walk(defaults, parts)
    if found and _freeze(sub) == want:
        return "default"

    return "set in code (dask.config.set)"


def _config_files(extra_paths: Sequence[str]) -> Iterator[tuple[str, Any]]:
    paths = list(dask.config.paths)
    # dask.config.paths is computed when dask is imported; a DASK_CONFIG set later
    # (and loaded with dask.config.refresh(paths=...)) is still worth searching.
    env_path = os.environ.get("DASK_CONFIG")
    for extra in ([env_path] if env_path else []) + list(extra_paths):
        if extra not in paths:
            paths.append(extra)
    for path in paths:
        try:
            yield from dask.config.collect_yaml([path], return_paths=True)
        except ValueError:
            # A malformed file: dask reports it itself when loading; it cannot be
            # the source of a value that made it into the config.
            continue


def _norm(key: str) -> str:
    return key.replace("_", "-")


def _walk(data: Any, parts: Sequence[str]) -> tuple[bool, Any]:
    """Follow ``parts`` into nested mappings; '-' and '_' are alike, as for dask."""
    for part in parts:
        if not isinstance(data, Mapping):
            return False, None
        for candidate in (part, part.replace("-", "_"), part.replace("_", "-")):
            if candidate in data:
                data = data[candidate]
                break
        else:
            return False, None
    return True, data


def _freeze(obj: Any) -> Any:
    """A comparable snapshot of ``obj`` that tells True from 1 and 1 from 1.0.

    Plain ``==`` would let ``{"threads-per-worker": True}`` pass validation by being
    equal to an earlier, valid ``1``.
    """
    if isinstance(obj, Mapping):
        items = sorted(obj.items(), key=lambda kv: str(kv[0]))
        return (dict, tuple((str(k), _freeze(v)) for k, v in items))
    if isinstance(obj, (list, tuple)):
        return (type(obj), tuple(_freeze(v) for v in obj))
    return (type(obj), obj)
