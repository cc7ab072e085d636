"""The ``fiber-dask`` command (also ``dask fiber``): run scripts, inspect config and clusters.

::

    fiber-dask run [--config FILE]... [--backend B] [--address A]
                   [--swap-multiprocessing] [-m] SCRIPT|-|MODULE [args...]
    fiber-dask info [--config FILE]... [--backend B] [--address A] [--json] [--keep]
    fiber-dask config show [--config FILE]... [--json]
    fiber-dask config validate FILE...
    fiber-dask config init [PATH] [--profile NAME] [--force]
    fiber-dask kubernetes manifest [--config FILE]...
    fiber-dask up [--config FILE]... [--n-workers N]
    fiber-dask down

:data:`main` is one click group, registered twice: as the console script
``fiber-dask`` and in Dask's ``dask_cli`` entry-point group, where ``dask`` adds it
under the group's own name, ``fiber``.  Errors the user can act on are printed in red
on stderr with exit status 1 (usage errors keep click's status 2).  Importing this
package imports click and nothing heavy, and writes nothing.
"""

from __future__ import annotations

from typing import Any

import click

from ._common import CONTEXT_SETTINGS, CLIError, red_usage_errors
from .configcmd import config_group
from .info import info
from .kube import kubernetes
from .run import run
from .up import down, up

__all__ = ["main", "CLIError"]


class _Group(click.Group):
    """A group whose usage errors are red, whichever program (fiber-dask, dask) runs it."""

    def make_context(self, *args: Any, **kwargs: Any) -> click.Context:
        try:
            return super().make_context(*args, **kwargs)
        except click.UsageError as e:
            raise red_usage_errors(e) from None

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except click.UsageError as e:
            raise red_usage_errors(e) from None


@click.group("fiber", cls=_Group, context_settings=CONTEXT_SETTINGS)
@click.version_option(package_name="fiber-dask", message="%(prog)s %(version)s")
def main() -> None:
    """fiber-dask: Python's multiprocessing API on a Dask cluster.

    Run a multiprocessing program on the cluster your configuration names (the
    embedded local one by default, an existing scheduler, or Kubernetes), look at
    that configuration, and at the cluster.  Configuration is Dask's: the `fiber`
    namespace in ~/.config/dask/*.yaml, $DASK_CONFIG, DASK_FIBER__* variables, or
    --config FILE.
    """


main.add_command(run)
main.add_command(info)
main.add_command(config_group)
main.add_command(kubernetes)
main.add_command(up)
main.add_command(down)
