"""``fiber-dask config show | validate | init``: the ``fiber`` configuration."""

from __future__ import annotations

import copy
import json
import os
import pathlib
import warnings
from typing import Any

import click

from ._common import (
    CONTEXT_SETTINGS,
    CLIError,
    apply_config,
    config_option,
    describe_config_error,
    load_yaml_mapping,
)

DEFAULTS_PROFILE = "defaults"


def _adapter_files() -> list[pathlib.Path]:
    """The profiles of adapters/ (packaged in the wheel, or the checkout's)."""
    package = pathlib.Path(__file__).resolve().parent.parent
    for candidate in (package / "adapters", package.parent / "adapters"):
        if candidate.is_dir():
            return sorted(candidate.glob("*.yaml"))
    return []


@click.group("config", context_settings=CONTEXT_SETTINGS)
def config_group() -> None:
    """Show, check and write fiber-dask configuration (Dask's `fiber` namespace)."""


# ----------------------------------------------------------------------------- show


@config_group.command("show", context_settings=CONTEXT_SETTINGS)
@config_option
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
def show(config_files: tuple[str, ...], as_json: bool) -> None:
    """Print the effective fiber configuration and where each value came from.

    Sources, lowest priority first: default (fiber_dask/fiber.yaml), YAML files
    (/etc/dask, ~/.config/dask, $DASK_CONFIG, then --config), DASK_FIBER__*
    environment variables.  An invalid configuration is shown too, followed by its
    problems, and the exit status is 1.
    """
    from .. import config

    error: CLIError | None = None
    try:
        loaded = apply_config(config_files)
        files = loaded.files
    except CLIError as e:
        # Show what there is, then the problems.
        error = e
        files = [os.path.abspath(f) for f in config_files]
    rows = config.sources(extra_paths=files)
    if as_json:
        data = {key: {"value": value, "source": src} for key, value, src in rows}
        click.echo(json.dumps(data, indent=2, default=str))
    else:
        shown = [(f"{key}: {_flow(value)}", src) for key, value, src in rows]
        width = max(len(left) for left, _ in shown)
        for left, src in shown:
            click.echo(f"{left.ljust(width)}  # {src}")
    if error is not None:
        raise error


def _flow(value: Any) -> str:
    """A value as it would be written in YAML, on one line."""
    import yaml

    text = yaml.safe_dump(value, default_flow_style=True, width=10_000).strip()
    if text.endswith("\n..."):
        text = text[: -len("\n...")]
    return text


# ------------------------------------------------------------------------- validate


@config_group.command("validate", context_settings=CONTEXT_SETTINGS)
@click.argument(
    "files", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False)
)
def validate(files: tuple[str, ...]) -> None:
    """Check YAML profiles against fiber-dask's schema.

    Each FILE is checked on its own, on top of the defaults (not of your other
    config files or environment).  Prints "FILE: ok" for a valid file; otherwise
    every problem with its key, value and what is allowed, and exits with status 1.
    """
    bad = 0
    for path in files:
        problems = _problems_of(path)
        if problems is None:
            click.echo(f"{path}: ok")
            continue
        bad += 1
        click.secho(problems, err=True, fg="red")
    if bad:
        raise click.exceptions.Exit(1)


def _problems_of(path: str) -> str | None:
    """None if ``path`` is a valid profile on top of the defaults, else why not."""
    import dask.config

    from .. import config

    try:
        data = load_yaml_mapping(path)
    except CLIError as e:
        return e.format_message()
    # A misspelt `fibre:` would otherwise pass: Dask keeps any top-level key.
    problems = list(config.near_misses(data))
    saved = copy.deepcopy(dask.config.config)
    try:
        # The defaults and this file only: no other YAML, no environment variables.
        dask.config.refresh(paths=[os.path.abspath(path)], env={})
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # near misses: reported as problems
            config.validate(extra_paths=[os.path.abspath(path)])
    except config.ConfigError as e:
        problems += e.problems
    finally:
        dask.config.config.clear()
        dask.config.config.update(saved)
    if not problems:
        return None
    # Everything that is not a default came from this file.
    problems = [p._replace(source=f"file {path}") for p in problems]
    return f"{path}: {describe_config_error(config.ConfigError('', problems))}"


# ----------------------------------------------------------------------------- init


@config_group.command("init", context_settings=CONTEXT_SETTINGS)
@click.argument("path", required=False, type=click.Path(dir_okay=True))
@click.option(
    "--profile",
    default=DEFAULTS_PROFILE,
    show_default=True,
    metavar="NAME",
    help="What to start from: 'defaults' (every key with its default and a comment) "
    "or the name of a profile shipped in adapters/: "
    + ", ".join(sorted(p.stem for p in _adapter_files()))
    + ".",
)
@click.option("--force", is_flag=True, help="Overwrite PATH if it exists.")
def init(path: str | None, profile: str, force: bool) -> None:
    """Write a commented configuration profile to PATH, to edit.

    PATH defaults to fiber.yaml in Dask's user config directory
    ($DASK_CONFIG, else ~/.config/dask/), where every fiber-dask program reads it;
    elsewhere, use it with `fiber-dask run --config PATH`.  A directory as PATH gets
    a fiber.yaml inside; "-" prints the profile instead.
    """
    text = _profile_text(profile)
    if path == "-":
        click.echo(text, nl=False)
        return
    if path is None:
        import dask.config

        path = os.path.join(dask.config.PATH, "fiber.yaml")
    target = pathlib.Path(path)
    if target.is_dir():
        target = target / "fiber.yaml"
    if target.exists() and not force:
        raise CLIError(f"{target} exists; use --force to overwrite it")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
    except OSError as e:
        raise CLIError(f"cannot write {target}: {e.strerror or e}") from None
    click.echo(f"wrote {target} (profile {profile!r})")
    click.echo(f"check it with: fiber-dask config validate {target}")


def profiles() -> dict[str, pathlib.Path]:
    """The profiles ``config init --profile`` accepts, name -> file."""
    from .. import config

    found = {DEFAULTS_PROFILE: pathlib.Path(config.DEFAULTS_PATH)}
    for file in _adapter_files():
        found.setdefault(file.stem, file)
    return found


def _profile_text(name: str) -> str:
    from .. import __version__

    available = profiles()
    file = available.get(name)
    if file is None:
        raise CLIError(
            f"no profile named {name!r}; available: {', '.join(sorted(available))}"
        )
    text = file.read_text()
    if name == DEFAULTS_PROFILE:
        # fiber.yaml's own header describes it as the package defaults; keep the
        # keys and their comments.
        text = text[text.index("\nfiber:") + 1 :]
        origin = "fiber-dask's defaults"
    else:
        origin = f"adapters/{file.name}"
    header = (
        f"# fiber-dask configuration, written by `fiber-dask config init` from\n"
        f"# {origin} (fiber-dask {__version__}).\n"
        "#\n"
        "# Dask reads it from ~/.config/dask/ or $DASK_CONFIG; anywhere else use it\n"
        "# with `fiber-dask run --config THIS_FILE script.py`.  Keys you do not\n"
        "# change can be deleted, so that future defaults reach you.\n"
        "# Check it with `fiber-dask config validate THIS_FILE`; every key and its\n"
        "# meaning: `fiber-dask config show` and fiber_dask/fiber-schema.yaml.\n"
    )
    return header + ("\n" if not text.startswith("#") else "#\n") + text
