"""What the ``fiber-dask`` commands share: errors in red, config options, loading config."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, TypeVar

import click

CONTEXT_SETTINGS: dict[str, Any] = {"help_option_names": ["-h", "--help"]}

F = TypeVar("F", bound=Callable[..., Any])


class CLIError(click.ClickException):
    """An error the user can act on: printed in red on stderr, exit status 1."""

    exit_code = 1

    def show(self, file: Any = None) -> None:
        click.secho(f"Error: {self.format_message()}", file=file, err=True, fg="red")


class RedUsageError(click.UsageError):
    """A click usage error (bad option, missing argument) with its message in red.

    Keeps click's usage line, hint and exit status (2, as for any usage error).
    """

    def __init__(self, original: click.UsageError) -> None:
        super().__init__(original.format_message(), original.ctx)
        self.exit_code = original.exit_code

    def show(self, file: Any = None) -> None:
        ctx = self.ctx
        color = ctx.color if ctx is not None else None
        if ctx is not None:
            hint = ""
            if ctx.command.get_help_option(ctx) is not None:
                hint = (
                    f"Try '{ctx.command_path} {ctx.help_option_names[0]}' for help.\n"
                )
            click.echo(f"{ctx.get_usage()}\n{hint}", file=file, err=True, color=color)
        click.secho(
            f"Error: {self.format_message()}",
            file=file,
            err=True,
            fg="red",
            color=color,
        )


def red_usage_errors(error: click.UsageError) -> click.UsageError:
    """The error to raise instead of ``error``: red, unless click shows help there."""
    no_args = getattr(click.exceptions, "NoArgsIsHelpError", ())
    if isinstance(error, (RedUsageError, no_args)):
        return error
    return RedUsageError(error)


# ------------------------------------------------------------------------ options


def config_option(f: F) -> F:
    """``--config FILE`` (repeatable), merged into Dask's config."""
    return click.option(
        "--config",
        "config_files",
        metavar="FILE",
        multiple=True,
        type=click.Path(exists=True, dir_okay=False),
        help=(
            "A YAML profile to merge into Dask's config (repeatable; a later file "
            "wins). It takes precedence over ~/.config/dask/ and $DASK_CONFIG files; "
            "DASK_* environment variables still override it."
        ),
    )(f)


def cluster_options(f: F) -> F:
    """``--backend B`` and ``--address A``: which cluster."""
    f = click.option(
        "--address",
        metavar="ADDRESS",
        help="Attach to this Dask scheduler (sets fiber.address and, unless "
        "--backend says otherwise, fiber.backend=address).",
    )(f)
    f = click.option(
        "--backend",
        metavar="NAME",
        help="Backend to use (sets fiber.backend): local, address, kubernetes or a "
        "plugin's name.",
    )(f)
    return f


# ------------------------------------------------------------------- loading config


class Loaded(NamedTuple):
    """The configuration a command runs with."""

    #: The validated ``fiber`` section.
    fiber: dict[str, Any]
    #: The ``--config`` files, absolute.
    files: list[str]
    #: Keys set by command-line options -> the option, to name as their source.
    flags: dict[str, str]


def apply_config(
    config_files: Sequence[str] = (),
    *,
    backend: str | None = None,
    address: str | None = None,
) -> Loaded:
    """Merge ``--config`` files and options into Dask's config and validate it.

    The files are loaded as Dask loads its own YAML (after ``/etc/dask``,
    ``~/.config/dask`` and ``$DASK_CONFIG``, before ``DASK_*`` variables), then
    ``--backend``/``--address`` are set on top.  The result is validated.

    Raises
    ------
    CLIError
        A file that is not YAML, or an invalid configuration (each problem with its
        key, value, what is allowed and which file, variable or option set it).
    """
    import dask.config

    from .. import config

    files = [os.path.abspath(f) for f in config_files]
    misses = []
    for path in files:
        misses += [
            p._replace(source=f"file {path}")
            for p in config.near_misses(load_yaml_mapping(path))
        ]
    if misses:
        raise CLIError(describe_config_error(config.ConfigError("", misses)))
    if files:
        dask.config.refresh(paths=[*dask.config.paths, *files])
    flags: dict[str, str] = {}
    if backend:
        flags["fiber.backend"] = "the --backend option"
        dask.config.set({"fiber.backend": backend})
    if address:
        flags["fiber.address"] = "the --address option"
        dask.config.set({"fiber.address": address})
        if not backend:
            flags["fiber.backend"] = "the --address option"
            dask.config.set({"fiber.backend": "address"})
    try:
        return Loaded(config.validate(extra_paths=files), files, flags)
    except config.ConfigError as e:
        raise CLIError(describe_config_error(e, flags)) from None


def describe_config_error(error: Any, flags: Mapping[str, str] | None = None) -> str:
    """The message of a ``ConfigError``, naming command-line options as sources."""
    from .. import config

    problems = list(getattr(error, "problems", ()))
    if not problems:
        return str(error)
    flags = flags or {}
    return config.describe_problems(
        [p._replace(source=flags.get(p.key, p.source)) for p in problems]
    )


def load_yaml_mapping(path: str) -> Mapping[str, Any]:
    """Parse ``path`` as a Dask config file; a CLIError naming it if it is not one."""
    import yaml

    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except OSError as e:
        raise CLIError(f"cannot read {path}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise CLIError(f"{path} is not valid YAML:\n{e}") from None
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise CLIError(
            f"{path}: the top level must be a mapping of config keys (such as "
            f"'fiber:'), not a {type(data).__name__}"
        )
    return data
