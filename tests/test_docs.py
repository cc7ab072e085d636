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


def test_docs_site_builds_with_warnings_as_errors(tmp_path):
    """The API reference (mkdocstrings, from the docstrings), the README's
    journeys and the configuration reference: `mkdocs build --strict`, as CI."""
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": ROOT}
    site = tmp_path / "site"
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(site)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    page = (site / "configuration" / "index.html").read_text()
    for key, _, _ in configdoc.rows():  # every key, with its variable
        assert key in page, key
    assert "DASK_FIBER__POOL__CHUNKSIZE" in page
    api = (site / "api" / "pool" / "index.html").read_text()
    assert 'id="fiber_dask.pool.Pool.imap_unordered"' in api
    usage = (site / "usage" / "index.html").read_text()
    assert "Attach to a Dask cluster you already run" in usage


def test_docs_pages_carry_the_readme_journeys():
    markers = set()
    for name in os.listdir(os.path.join(ROOT, "docs")):
        if name.endswith(".md"):
            markers |= set(re.findall(r"<!-- readme: (.+?) -->", read("docs", name)))
    headings = set(re.findall(r"^## (.+)$", read("README.md"), flags=re.M))
    assert headings - markers == {"Development"}, headings - markers
