"""The README stays true: its config reference is the schema's, its quick-start
test command is what CI runs, and the files it points to exist."""

from __future__ import annotations

import os
import re

from fiber_dask import configdoc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def read(*parts: str) -> str:
    with open(os.path.join(ROOT, *parts)) as f:
        return f.read()


def test_readme_config_reference_is_generated_from_the_schema():
    readme = read("README.md")
    start, end = readme.index(configdoc.START), readme.index(configdoc.END)
    in_readme = readme[start : end + len(configdoc.END)]
    assert in_readme == configdoc.reference_markdown(), (
        "README.md's config reference is out of date: replace it with the output "
        "of `python -m fiber_dask.configdoc`"
    )
    for key, _, _ in configdoc.rows():
        assert f"`{key}`" in in_readme


def test_ci_runs_exactly_the_readme_test_command():
    readme = read("README.md")
    commands = re.findall(
        r"```bash\n(pip install -e \"\.\[test\]\"[^\n]*)\n```", readme
    )
    assert len(commands) == 1, commands
    ci = [line for line in read(".ci", "run").splitlines() if line.startswith("pip ")]
    assert ci == commands


def test_readme_links_point_to_files():
    readme = read("README.md")
    for target in re.findall(r"\]\(((?!http|#)[^)]+)\)", readme):
        assert os.path.exists(os.path.join(ROOT, target)), target
    for script in re.findall(r"python (examples/\S+\.py)", readme):
        assert os.path.exists(os.path.join(ROOT, script)), script


def test_readme_api_names_exist():
    """Every ``fiber_dask.name(...)`` the README shows is real, e.g.
    ``fiber_dask.get_client().dashboard_link``."""
    import importlib

    readme = read("README.md")
    names = set(re.findall(r"\bfiber_dask((?:\.[A-Za-z_]\w*)+)\(", readme))
    assert ".get_client" in names and ".Pool" in names, names
    for dotted in sorted(names):
        obj = importlib.import_module("fiber_dask")
        for part in dotted.strip(".").split("."):
            obj = getattr(obj, part, None)
            assert obj is not None, f"README mentions fiber_dask{dotted}"
