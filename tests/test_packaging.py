"""The package as published: a real wheel, installed into a fresh environment.

The wheel is built from this checkout the way a release is (``pip wheel --no-deps
.``, with build isolation), installed into a new virtual environment (which sees
the dependencies of the environment running the tests, venv or not, but not
this checkout), and the console script is run there.  This is what a user of the
published package gets; an editable install hides missing files.

Also here: ``environment.yml`` lists exactly the dependencies and extras of
``pyproject.toml``.
"""

from __future__ import annotations

import email
import os
import pathlib
import re
import site
import subprocess
import sys
import venv
import zipfile
from collections.abc import Iterator

import pytest
import yaml
from packaging.requirements import Requirement

try:
    import tomllib
except ImportError:  # Python 3.10: the test extra installs tomli
    import tomli as tomllib

REPO = pathlib.Path(__file__).resolve().parent.parent
ADAPTERS = sorted((REPO / "adapters").glob("*.yaml"))
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


class Installed:
    def __init__(self, wheel: pathlib.Path, env_dir: pathlib.Path) -> None:
        self.wheel = wheel
        self.bin = env_dir / "bin"

    def run(self, *args: str, cwd: pathlib.Path) -> subprocess.CompletedProcess[str]:
        # No PYTHONPATH (the test suite runs with the checkout on it) and no
        # DASK_* settings: the installed package alone.
        env = {
            k: v
            for k, v in os.environ.items()
            if k != "PYTHONPATH" and not k.startswith("DASK_")
        }
        env["DASK_CONFIG"] = str(cwd / "dask-config")
        return subprocess.run(
            [str(self.bin / args[0]), *args[1:]],
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Installed]:
    root = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", str(REPO)]
        + ["-w", str(root / "dist")],
        check=True,
        cwd=root,
        timeout=300,
    )
    (wheel,) = (root / "dist").glob("fiber_dask-*.whl")
    env_dir = root / "venv"
    venv.create(env_dir, with_pip=False)
    # The dependencies are those of the environment running the tests, whether
    # it is a venv or not: its site-packages directories, listed in a .pth
    # file of the new venv (system_site_packages would give the *base*
    # interpreter's, without dask when the suite runs in a venv).  They come
    # after the venv's own site-packages, and the .pth files in them (the
    # editable install of this checkout) are not read: the wheel is found.
    (own,) = pathlib.Path(env_dir).glob("lib/python*/site-packages")
    (own / "outer-environment.pth").write_text(
        "\n".join(p for p in site.getsitepackages() if os.path.isdir(p)) + "\n"
    )
    # The venv's python runs the outer pip to install into the venv only.
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(env_dir / "bin" / "python")]
        + ["install", "-q", "--no-deps", "--force-reinstall", str(wheel)],
        check=True,
        cwd=root,
        timeout=300,
    )
    yield Installed(wheel, env_dir)


def wheel_names(wheel: pathlib.Path) -> set[str]:
    with zipfile.ZipFile(wheel) as z:
        return set(z.namelist())


def metadata(wheel: pathlib.Path) -> email.message.Message:
    with zipfile.ZipFile(wheel) as z:
        (name,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        return email.message_from_bytes(z.read(name))


# ------------------------------------------------------------------- the wheel


@pytest.mark.slow
def test_wheel_carries_profiles_license_and_types(installed: Installed) -> None:
    names = wheel_names(installed.wheel)
    assert "fiber_dask/py.typed" in names
    assert "fiber_dask/fiber.yaml" in names and "fiber_dask/fiber-schema.yaml" in names
    licenses = [n for n in names if re.search(r"\.dist-info/licenses/LICENSE$", n)]
    assert licenses, sorted(names)
    # Every profile of adapters/, byte for byte: one source of truth.
    assert ADAPTERS
    with zipfile.ZipFile(installed.wheel) as z:
        for path in ADAPTERS:
            assert z.read(f"fiber_dask/adapters/{path.name}") == path.read_bytes()
        shipped = {
            n.rsplit("/", 1)[1]
            for n in names
            if re.fullmatch(r"fiber_dask/adapters/[^/]+\.yaml", n)
        }
        assert shipped == {p.name for p in ADAPTERS}
        license_text = z.read(licenses[0]).decode()
    assert license_text == (REPO / "LICENSE").read_text()
    assert "Apache License" in license_text and "Version 2.0" in license_text


@pytest.mark.slow
def test_wheel_metadata(installed: Installed) -> None:
    meta = metadata(installed.wheel)
    import fiber_dask

    assert meta["Version"] == fiber_dask.__version__
    assert meta["License-Expression"] == "Apache-2.0"
    classifiers = meta.get_all("Classifier")
    assert "Operating System :: POSIX :: Linux" in classifiers
    assert any(c.startswith("Development Status :: ") for c in classifiers)
    low = tuple(int(x) for x in meta["Requires-Python"].lstrip(">=").split("."))
    versions = sorted(
        tuple(int(x) for x in c.rsplit(" ", 1)[1].split("."))
        for c in classifiers
        if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c)
    )
    assert versions[0] == low, (versions, low)  # the classifiers start where
    assert versions == [(3, n) for n in range(low[1], versions[-1][1] + 1)]
    urls = dict(u.split(", ", 1) for u in meta.get_all("Project-URL"))
    assert {"Source", "Documentation", "Issues"} <= set(urls)


@pytest.mark.slow
def test_installed_cli_writes_every_profile(
    installed: Installed, tmp_path: pathlib.Path
) -> None:
    probe = installed.run(
        "python",
        "-c",
        "import fiber_dask, importlib.metadata as m; "
        "print(fiber_dask.__file__); print(m.version('fiber-dask'))",
        cwd=tmp_path,
    )
    assert probe.returncode == 0, probe.stderr
    where, version = probe.stdout.split()
    assert str(installed.bin.parent) in where, where  # the wheel, not the checkout
    import fiber_dask

    assert version == fiber_dask.__version__

    assert installed.run("fiber-dask", "--version", cwd=tmp_path).stdout.strip() == (
        f"fiber-dask {fiber_dask.__version__}"
    )
    for path in ADAPTERS:
        result = installed.run(
            "fiber-dask", "config", "init", "-", "--profile", path.stem, cwd=tmp_path
        )
        assert result.returncode == 0, (path.name, result.stderr)
        assert result.stdout.endswith(path.read_text()), path.name
    defaults = installed.run("fiber-dask", "config", "init", "-", cwd=tmp_path)
    assert defaults.returncode == 0, defaults.stderr
    assert yaml.safe_load(defaults.stdout) == fiber_dask.config.defaults


def test_version_is_declared_once() -> None:
    assert "version" not in PYPROJECT["project"]
    assert "version" in PYPROJECT["project"]["dynamic"]
    assert PYPROJECT["tool"]["hatch"]["version"]["path"] == "fiber_dask/__init__.py"


# ----------------------------------------------------------- environment.yml


def _key(requirement: str) -> tuple[str, str, str]:
    r = Requirement(requirement)
    name = re.sub(r"[-_.]+", "-", r.name).lower()
    return name, str(r.specifier), str(r.marker or "")


def pyproject_requirements() -> set[tuple[str, str, str]]:
    project = PYPROJECT["project"]
    own = re.sub(r"[-_.]+", "-", project["name"]).lower()
    found = {_key(r) for r in project["dependencies"]}
    for requirements in project.get("optional-dependencies", {}).values():
        for r in requirements:
            if _key(r)[0] != own:  # fiber-dask[...]: the other extras
                found.add(_key(r))
    return found


def environment_requirements() -> set[tuple[str, str, str]]:
    env = yaml.safe_load((REPO / "environment.yml").read_text())
    found = set()
    for item in env["dependencies"]:
        if isinstance(item, dict):
            for r in item.get("pip", []):
                if not r.startswith("-"):  # "-e .": fiber-dask itself
                    found.add(_key(r))
        elif _key(item)[0] not in ("python", "pip"):
            found.add(_key(item))
    return found


def test_environment_yml_lists_exactly_the_pyproject_requirements() -> None:
    ours, env = pyproject_requirements(), environment_requirements()
    assert ours, "pyproject.toml declares no dependency?"
    assert env - ours == set(), "in environment.yml but not in pyproject.toml"
    assert ours - env == set(), "in pyproject.toml but not in environment.yml"


def test_the_suite_loads_only_its_plugins_and_rewrites_no_third_party_module(
    request: pytest.FixtureRequest,
) -> None:
    """pytest-timeout is active, and a module of an installed pytest plugin's
    distribution imported during the run is not assertion-rewritten: such
    imports happen on background threads (kr8s resolving anyio's lazy names),
    where CPython 3.11's parser races with another thread's (pyproject.toml's
    addopts says why)."""
    manager = request.config.pluginmanager
    timeout_loaded = manager.hasplugin("pytest_timeout") or manager.hasplugin("timeout")
    assert timeout_loaded, "pytest-timeout is not loaded"
    assert request.config.getini("timeout") == "120"
    assert not manager.hasplugin("anyio"), "autoloading of plugins is on"
    import anyio._core._fileio as fileio

    loader = type(fileio.__spec__.loader).__name__
    assert loader != "AssertionRewritingHook", (
        "anyio's modules are rewritten by pytest: pass --disable-plugin-autoload"
    )
